//! Slot records: "this schedule slot already ran", kept beside the lock.
//!
//! `guard --slot ID` records a run of slot ID whose CMD exited 0 in the key
//! `redlock:{NAME}:slot:ID` (the lock's hash tag, so the lock's node serves it in cluster
//! mode), holding the run's fencing token, with the slot retention as its expiry.
//!
//! ## Behaviour
//! - The holder writes the record while it holds the lock, owner-checked on every node
//!   ([`scripts::RECORD_SLOT`]: written only where the lock key still holds our value); the
//!   slot is *recorded* once a quorum wrote it.
//! - A later holder reads the record on every node, after it took the lock and before CMD
//!   starts. Any record seen means the slot ran (only a holder whose CMD exited 0 writes one).
//!   No record on a quorum of answers means it did not run, as far as the nodes keep their
//!   data: that quorum shares a node with any quorum that recorded the slot. Fewer answers
//!   than a quorum decide nothing.
//! - A record is as strong as the nodes' data, with no data-age rule behind it (unlike a
//!   vote): a node that loses its data (restart without persistence, `FLUSHALL`, failover to
//!   a replica that missed the write, eviction) loses the records it held, and the record
//!   of a slot written on exactly a quorum is forgotten once one of those nodes lost it and
//!   no other node holding it answers. The slot may then run again.
//!
//! [`scripts::RECORD_SLOT`]: super::scripts::RECORD_SLOT

use std::time::Duration;

use super::{quorum, Lease, NodeError, Op, Redlock, RECORD_SLOT};
use crate::clock;

/// What the nodes say about a slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlotSeen {
    /// A node holds its record: the fencing token of the run that recorded it.
    Ran(String),
    /// A quorum of nodes answered, none with a record.
    NotRan,
    /// Too few answers to tell.
    Unknown,
}

/// The verdict on a slot from every node's read: `Some(token)` where a record stands,
/// `None` where none does, `Err` where the read failed.
pub fn slot_seen<E>(reads: &[Result<Option<String>, E>]) -> SlotSeen {
    if let Some(token) = reads
        .iter()
        .find_map(|read| read.as_ref().ok().cloned().flatten())
    {
        return SlotSeen::Ran(token);
    }
    let answered = reads.iter().filter(|read| read.is_ok()).count();
    if answered >= quorum(reads.len()) {
        SlotSeen::NotRan
    } else {
        SlotSeen::Unknown
    }
}

impl Redlock {
    /// The key of slot `id`'s record.
    fn slot_key(&self, id: &str) -> String {
        format!("{}:slot:{id}", self.inner.key)
    }

    /// Reads slot `id`'s record on every node (plain `GET`, each bounded by the node
    /// timeout); judge with [`slot_seen`].
    pub async fn read_slot(&self, id: &str) -> Vec<Result<Option<String>, NodeError>> {
        self.read_everywhere(&self.slot_key(id), Op::Slot)
            .await
            .into_iter()
            .map(|result| result.map(|read| read.map(|(token, _)| token)))
            .collect()
    }

    /// Records that slot `id` ran under `lease`, for `retention`, on every node where the
    /// lock still holds our value; returns on how many nodes it was written (recorded: a
    /// quorum).
    pub async fn record_slot(&self, lease: &Lease, id: &str, retention: Duration) -> usize {
        let inner = &self.inner;
        let key = self.slot_key(id);
        let keys = [inner.key.as_str(), key.as_str()];
        let token = lease.fencing_token.to_string();
        let retention = retention.as_millis().to_string();
        let args = [lease.value(), token.as_str(), retention.as_str()];
        let writes = inner.nodes.iter().enumerate().map(|(index, node)| {
            let (keys, args) = (&keys, &args);
            async move {
                // The write's latency, for the metrics only: no deadline.
                let start = clock::Stopwatch::start();
                let result = node
                    .eval::<i64>(&RECORD_SLOT, keys, args, inner.cfg.node_timeout)
                    .await;
                let outcome = result.as_ref().map(|_| ()).map_err(|e| e.kind);
                inner
                    .observer
                    .node_call(index, Op::Slot, start.elapsed(), outcome);
                matches!(result, Ok((1, _)))
            }
        });
        futures_util::future::join_all(writes)
            .await
            .into_iter()
            .filter(|written| *written)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_record_means_the_slot_ran_and_no_record_needs_a_quorum_of_answers() {
        let none: Result<Option<String>, ()> = Ok(None);
        let failed: Result<Option<String>, ()> = Err(());
        let record = Ok(Some("42".to_owned()));
        // One record is enough, whatever the others answer.
        for reads in [
            vec![record.clone(), failed.clone(), failed.clone()],
            vec![none.clone(), none.clone(), record.clone()],
        ] {
            assert_eq!(slot_seen(&reads), SlotSeen::Ran("42".to_owned()));
        }
        assert_eq!(
            slot_seen(&[none.clone(), none.clone(), failed.clone()]),
            SlotSeen::NotRan
        );
        // A record may stand on the nodes that did not answer.
        assert_eq!(
            slot_seen(&[none.clone(), failed.clone(), failed.clone()]),
            SlotSeen::Unknown
        );
        assert_eq!(
            slot_seen(&[none.clone(), none.clone(), failed.clone(), failed.clone()]),
            SlotSeen::Unknown
        );
        assert_eq!(slot_seen(std::slice::from_ref(&none)), SlotSeen::NotRan);
        assert_eq!(slot_seen::<()>(&[]), SlotSeen::Unknown);
    }
}

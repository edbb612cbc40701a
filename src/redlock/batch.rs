//! Renewals of many locks, batched: one script per node carries every lock's renewal that is
//! due, so a process holding K locks sends each node about one request per renew interval
//! instead of K.
//!
//! ## Behaviour
//! - Only the transport is batched. Each lock still runs its own [`super::round::ExtendRound`]
//!   over the per-node answers (owner check, restore only after a quorum, superseded vs lost,
//!   a validity never moved earlier), and `scripts::EXTEND_MANY` gives each lock exactly the
//!   answer `scripts::EXTEND` would.
//! - A renewal may wait in its node's batch up to [`hold`] (a sixth of its ttl, and never more
//!   than a third of its remaining validity): a lease renews a third of its ttl after the last
//!   renewal, so waiting that long still renews it well within its validity, and renewals due
//!   within a few moments of each other go out together. A batch goes out when its most
//!   urgent renewal's wait ends; every renewal waiting then goes with it.
//! - The round's clock starts when the earliest of the lock's batches was sent (never later
//!   than any of its scripts ran): the wait in the batch costs the lease no validity.
//! - A batch is one call bounded by the node timeout plus [`PER_RENEWAL`] per renewal it
//!   carries; its failure is each lock's failed vote.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::future::BoxFuture;
use redis::Script;
use tokio::sync::{oneshot, Notify};

use super::round::extend::RawExtendReply;
use super::transport::{NodeError, NodeErrorKind, NodeFacts, Voter};
use super::{scripts, Answers, Inner, Op};
use crate::clock::{self, Deadline};

static EXTEND_MANY: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(scripts::EXTEND_MANY));

/// What a batch's bound grows by per renewal it carries: the node runs them one after the
/// other (about 10 µs each on a warm server), and the node timeout bounds one renewal.
const PER_RENEWAL: Duration = Duration::from_micros(100);

/// The extend scripts' reply off the wire: read here, beside the client library,
/// into the core's [`RawExtendReply`] for `ExtendReply::parse`. On the path nearly every
/// renewal takes the reply is the max-ttl register alone, an integer (status 1, no proof).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ExtendWire(pub RawExtendReply);

impl redis::FromRedisValue for ExtendWire {
    fn from_redis_value(v: redis::Value) -> Result<Self, redis::ParsingError> {
        let raw = match v {
            redis::Value::Int(register) => u64::try_from(register)
                .map(|register| RawExtendReply(1, -1, register))
                .map_err(|_| "a negative max-ttl register")?,
            other => {
                let (status, age, max_ttl) = <(i64, i64, u64)>::from_redis_value(other)?;
                RawExtendReply(status, age, max_ttl)
            }
        };
        Ok(ExtendWire(raw))
    }
}

type Reply = Result<(ExtendWire, Arc<NodeFacts>), NodeError>;

/// One lock's renewal waiting for its node's batch.
struct Pending {
    keys: [String; 6],
    args: Vec<String>,
    send_by: Deadline,
    timeout: Duration,
    /// Told when the batch carrying it is sent.
    sent: oneshot::Sender<Deadline>,
    reply: oneshot::Sender<Reply>,
}

/// The renewals waiting for one node.
#[derive(Default)]
struct Queue {
    pending: Mutex<Vec<Pending>>,
    changed: Notify,
    started: std::sync::atomic::AtomicBool,
}

/// The batches of one group of shared nodes (see `pool`), one queue per node.
pub(super) struct Batches {
    nodes: Weak<[Voter]>,
    queues: Vec<Arc<Queue>>,
}

/// How long a renewal of a lock with `ttl`, valid for `left` more, may wait for its batch.
pub fn hold(ttl: Duration, left: Duration) -> Duration {
    (ttl / 6).min(left / 3)
}

impl Batches {
    /// Batches for `nodes`.
    pub(super) fn new(nodes: &Arc<[Voter]>) -> Batches {
        Batches {
            nodes: Arc::downgrade(nodes),
            queues: (0..nodes.len()).map(|_| Arc::default()).collect(),
        }
    }

    /// Queues one renewal on node `index`; its answer comes by the returned receiver.
    fn submit(&self, index: usize, pending: Pending) -> Option<()> {
        let queue = self.queues.get(index)?;
        queue
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(pending);
        queue.changed.notify_one();
        if !queue
            .started
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            tokio::spawn(send_batches(self.nodes.clone(), index, queue.clone()));
        }
        Some(())
    }
}

/// Sends node `index`'s batches for as long as its nodes live: each when its most urgent
/// renewal's wait is over, with every renewal waiting then.
async fn send_batches(nodes: Weak<[Voter]>, index: usize, queue: Arc<Queue>) {
    loop {
        let send_by = {
            let pending = queue.pending.lock().unwrap_or_else(|e| e.into_inner());
            pending.iter().map(|p| p.send_by).min()
        };
        let Some(send_by) = send_by else {
            if nodes.strong_count() == 0 {
                return;
            }
            // Woken by the next renewal (or, rarely, checks again whether the nodes are gone).
            let _ = clock::within(Duration::from_secs(5), queue.changed.notified()).await;
            continue;
        };
        tokio::select! {
            () = clock::sleep_until_deadline(send_by) => {}
            () = queue.changed.notified() => continue,
        }
        let mut batch =
            std::mem::take(&mut *queue.pending.lock().unwrap_or_else(|e| e.into_inner()));
        let now = Deadline::now();
        for pending in &mut batch {
            let (gone, _) = oneshot::channel();
            let _ = std::mem::replace(&mut pending.sent, gone).send(now);
        }
        let Some(nodes) = nodes.upgrade() else {
            return;
        };
        tokio::spawn(send(nodes, index, batch));
    }
}

/// One batch on node `index`: one script, its answers handed to each lock.
async fn send(nodes: Arc<[Voter]>, index: usize, batch: Vec<Pending>) {
    let timeout = batch.iter().map(|p| p.timeout).max().unwrap_or_default()
        + PER_RENEWAL.saturating_mul(u32::try_from(batch.len()).unwrap_or(u32::MAX));
    let keys: Vec<&str> = batch
        .iter()
        .flat_map(|p| p.keys.iter())
        .map(String::as_str)
        .collect();
    let args: Vec<&str> = batch
        .iter()
        .flat_map(|p| p.args.iter())
        .map(String::as_str)
        .collect();
    let answer = nodes[index]
        .eval::<Vec<ExtendWire>>(&EXTEND_MANY, &keys, &args, timeout)
        .await;
    match answer {
        Ok((replies, facts)) if replies.len() == batch.len() => {
            for (pending, reply) in batch.into_iter().zip(replies) {
                let _ = pending.reply.send(Ok((reply, facts.clone())));
            }
        }
        Ok((replies, _)) => {
            let err = NodeError {
                kind: NodeErrorKind::Protocol,
                message: format!("{} answers to {} renewals", replies.len(), batch.len()),
            };
            for pending in batch {
                let _ = pending.reply.send(Err(err.clone()));
            }
        }
        Err(err) => {
            for pending in batch {
                let _ = pending.reply.send(Err(err.clone()));
            }
        }
    }
}

/// The answers of one lock's renewal `args` (EXTEND's arguments) through `batches`, as
/// [`super::Redlock::fan_out`] would give them, and when the earliest of its batches was sent
/// (the instant its validity is measured from); `left` is the lease's remaining validity.
pub(super) async fn fan_out(
    inner: &Arc<Inner>,
    batches: &Batches,
    args: &[String],
    left: Duration,
) -> (Answers<ExtendWire>, Deadline) {
    let asked = Deadline::now();
    let wait = hold(inner.cfg.ttl, left);
    let keys = inner.keys().map(str::to_owned);
    let mut sent_at = Vec::new();
    let calls = (0..inner.nodes.len())
        .map(|index| {
            let (reply, answer) = oneshot::channel();
            let (sent, sent_rx) = oneshot::channel();
            sent_at.push(sent_rx);
            let submitted = batches.submit(
                index,
                Pending {
                    keys: keys.clone(),
                    args: args.to_vec(),
                    send_by: asked + wait,
                    timeout: inner.cfg.node_timeout,
                    sent,
                    reply,
                },
            );
            let inner = inner.clone();
            let call: BoxFuture<'static, (usize, Reply)> = Box::pin(async move {
                // The batch's own bound, with room for a large batch.
                let bound = wait + inner.cfg.node_timeout * 2 + Duration::from_secs(1);
                let result = match (submitted, clock::within(bound, answer).await) {
                    (Some(()), Ok(Ok(reply))) => reply,
                    _ => Err(NodeError::timeout(bound)),
                };
                let outcome = result.as_ref().map(|_| ()).map_err(|e| e.kind);
                inner
                    .observer
                    .node_call(index, Op::Extend, Deadline::now() - asked, outcome);
                (index, result)
            });
            call
        })
        .collect();
    // Every batch goes by its send-by instant; one that says nothing leaves `asked`, which is
    // never later than any send.
    let sent = clock::within(
        wait + Duration::from_secs(1),
        futures_util::future::join_all(sent_at),
    )
    .await
    .ok()
    .and_then(|sent| sent.into_iter().map(Result::ok).collect::<Option<Vec<_>>>())
    .and_then(|sent| sent.into_iter().min())
    .unwrap_or(asked)
    .max(asked);
    (Answers { calls }, sent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_renewal_waits_at_most_a_sixth_of_its_ttl_and_a_third_of_its_validity() {
        let s = Duration::from_secs;
        assert_eq!(hold(s(60), s(40)), s(10));
        assert_eq!(hold(s(60), s(9)), s(3));
        assert_eq!(hold(s(60), Duration::ZERO), Duration::ZERO);
    }
}

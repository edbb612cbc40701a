//! What an acquire answer says: the script reply's layout (the one place that knows it), and
//! what the answers of one round show about the lock besides the votes.

use std::time::Duration;

use crate::error::Vote;
use crate::votes::{DataAge, Proof};

/// The acquire script's reply as it comes off the wire: `{granted, fence, epoch_age_ms,
/// max_ttl_ms, candidate_stored, holder_value, holder_pttl, node_set, node_set_age_ms}`.
pub type RawAcquireReply = (i64, u64, i64, u64, i64, String, i64, String, i64);

/// What a node did with our `SET NX`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcquireStatus {
    /// It stored our key.
    Granted,
    /// Another value holds the key.
    Held,
    /// Another node set's live record stands beside the lock: no grant.
    OtherNodeSet,
}

/// One node's acquire answer, parsed (the one place that knows the reply's layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AcquireReply {
    /// What the node did.
    pub status: AcquireStatus,
    /// The node's fencing counter before this call.
    pub fence: u64,
    /// The data-age proof and the max-ttl register.
    pub proof: Proof,
    /// The node stored our candidate token (its counter was lower).
    pub candidate_stored: bool,
    /// The holder's lock value, when held.
    pub holder_value: String,
    /// The holder's key's remaining time, when held and it has an expiry.
    pub holder_pttl: Option<Duration>,
    /// The fingerprint in the node-set record the node carried before this call (empty: none,
    /// or another set's that this call replaced).
    pub node_set: String,
    /// How long ago another set's record was written, on the node's clock (`None`: ours, or
    /// written without its life, by an earlier version).
    pub node_set_age: Option<Duration>,
}

impl AcquireReply {
    /// Parses the script's reply.
    pub fn parse(raw: RawAcquireReply) -> AcquireReply {
        let (granted, fence, age, max_ttl, stored, holder_value, pttl, record, record_age) = raw;
        let node_set = record
            .split_once('@')
            .map_or(record.as_str(), |(set, _)| set)
            .to_owned();
        AcquireReply {
            status: match granted {
                0 => AcquireStatus::Held,
                -1 => AcquireStatus::OtherNodeSet,
                _ => AcquireStatus::Granted,
            },
            fence,
            proof: Proof {
                data_age: DataAge::from_script(age),
                max_ttl: std::time::Duration::from_millis(max_ttl),
            },
            candidate_stored: stored == 1,
            holder_value,
            holder_pttl: u64::try_from(pttl).ok().map(Duration::from_millis),
            node_set,
            node_set_age: u64::try_from(record_age).ok().map(Duration::from_millis),
        }
    }
}

/// What the answers of one round say about the lock besides the votes.
#[derive(Clone, Debug, Default)]
pub(super) struct Seen {
    /// The highest fencing counter any node reported.
    pub(super) fence: u64,
    /// The shortest remaining ttl of another holder's key.
    pub(super) holder_ttl: Option<Duration>,
    /// Other holders' lock values and on how many nodes each was seen.
    holders: Vec<(String, usize)>,
    /// Live node-set records of other node lists: (fingerprint, age, beside a held key).
    pub(super) foreign: Vec<ForeignRecord>,
    /// A grant replaced another set's record judged stale in an earlier round.
    pub(super) replaced: bool,
}

/// Another node set's record, as one answer showed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct ForeignRecord {
    /// Its fingerprint.
    pub(super) set: String,
    /// How long ago it was written (`None`: not told).
    pub(super) age: Option<Duration>,
    /// It stood beside a key another contender holds.
    pub(super) held: bool,
}

impl Seen {
    /// Takes one answer into account; returns the holder's identity if the key was taken.
    pub(super) fn add(&mut self, reply: &AcquireReply, own_node_set: &str) -> Option<String> {
        self.fence = self.fence.max(reply.fence);
        if !reply.node_set.is_empty() && reply.node_set != own_node_set {
            if reply.status == AcquireStatus::Granted {
                self.replaced = true;
            } else {
                self.foreign.push(ForeignRecord {
                    set: reply.node_set.clone(),
                    age: reply.node_set_age,
                    held: reply.status == AcquireStatus::Held,
                });
            }
        }
        if reply.status != AcquireStatus::Held {
            return None;
        }
        if let Some(ttl) = reply.holder_pttl {
            self.holder_ttl = Some(self.holder_ttl.map_or(ttl, |t| t.min(ttl)));
        }
        match self
            .holders
            .iter_mut()
            .find(|(v, _)| *v == reply.holder_value)
        {
            Some((_, nodes)) => *nodes += 1,
            None => self.holders.push((reply.holder_value.clone(), 1)),
        }
        Some(identity_of(&reply.holder_value).to_owned())
    }

    /// On how many nodes the most widespread other holder was seen.
    pub(super) fn most_held(&self) -> usize {
        self.holders
            .iter()
            .map(|(_, nodes)| *nodes)
            .max()
            .unwrap_or(0)
    }
}

/// The identity part of a lock value (`identity:random`).
pub fn identity_of(value: &str) -> &str {
    value
        .rsplit_once(':')
        .map_or(value, |(identity, _)| identity)
}

/// The identity that holds the key on the most nodes among `votes`.
pub(super) fn most_common_holder(votes: &[Option<Vote>]) -> Option<String> {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for vote in votes.iter().flatten() {
        if let Vote::HeldBy(identity) = vote {
            match counts.iter_mut().find(|(id, _)| id == identity) {
                Some((_, n)) => *n += 1,
                None => counts.push((identity, 1)),
            }
        }
    }
    counts
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .map(|(id, _)| id.to_owned())
}

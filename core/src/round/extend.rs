//! The extend round (a renewal) as a state machine.
//!
//! ## The rules
//! - The owner-checked renewal goes to every node; the round is decided as soon as a quorum
//!   for or against is certain, and only within the lease's validity: the end of validity
//!   ([`ExtendRound::poll_timeout`]) is the deadline of the whole round.
//! - Won: the new end of validity is `start + ttl − elapsed − drift`, but never earlier than
//!   the end already promised (`timing::renewed_until`: a slow renewal proves less than the one
//!   before, and the app may act on the earlier promise). Nodes that lost our key get it back
//!   (`RESTORE`, never over another holder's key), now the quorum is proven; so do those whose
//!   "missing" answer comes after the decision.
//! - Not won: if a quorum shows another holder's key or none at all, the lease is gone for
//!   good (superseded); otherwise it is lost for this round (retry while validity lasts).

use std::time::Duration;

use super::Rules;
use crate::clock::Deadline;
use crate::error::NodeError;
use crate::error::{Tally, Vote};
use crate::timing::{quorum, renewed_until};
use crate::votes::{DataAge, Proof};

/// The extend script's reply as it comes off the wire: `{status, epoch_age_ms, max_ttl_ms}`,
/// or, on the path nearly every renewal takes (our key extended, no proof made), the max-ttl
/// register alone as an integer (0 when not read): an array costs the node more to build than
/// the rest of that path's Lua.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawExtendReply(pub i64, pub i64, pub u64);

/// What a node did with our renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtendStatus {
    /// Our key, extended.
    Extended,
    /// Another value holds the key.
    Held,
    /// No key at all (the node lost it).
    Missing,
}

/// One node's extend answer, parsed (the one place that knows the reply's layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtendReply {
    /// What the node did.
    pub status: ExtendStatus,
    /// The data-age proof and the max-ttl register (for the node's reported health).
    pub proof: Proof,
}

impl ExtendReply {
    /// Parses the script's reply.
    pub fn parse(RawExtendReply(status, age, max_ttl): RawExtendReply) -> ExtendReply {
        ExtendReply {
            status: match status {
                1 => ExtendStatus::Extended,
                0 => ExtendStatus::Held,
                _ => ExtendStatus::Missing,
            },
            proof: Proof {
                data_age: DataAge::from_script(age),
                max_ttl: Duration::from_millis(max_ttl),
            },
        }
    }

    /// The vote this answer is.
    pub fn vote(&self) -> Vote {
        match self.status {
            ExtendStatus::Extended => Vote::Granted,
            ExtendStatus::Held => Vote::HeldBy("another holder".to_owned()),
            ExtendStatus::Missing => Vote::Missing,
        }
    }
}

/// What the caller does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtendStep {
    /// Feed in the next answer, or wake at [`ExtendRound::poll_timeout`].
    Listen,
    /// The lease's validity ended before the renewal could prove it.
    Expired,
    /// No quorum this time; the lease may still be ours (retry while validity lasts).
    Lost(Vec<Option<Vote>>),
    /// A quorum shows another holder's key or none: the lease is gone for good.
    Superseded(Vec<Option<Vote>>),
    /// Renewed until `valid_until`; restore our key on the nodes `restore` lists.
    Renewed {
        /// The new end of validity ([`renewed_end`] of the old one and `proven_until`).
        valid_until: Deadline,
        /// What this round alone proved: `start + ttl − elapsed − drift`.
        proven_until: Deadline,
        /// Nodes that answered "missing" so far.
        restore: Vec<usize>,
    },
}

/// One renewal of a lease whose validity ends at `valid_until`.
pub struct ExtendRound {
    ttl: Duration,
    start: Deadline,
    valid_until: Deadline,
    rules: Rules,
    tally: Tally,
}

impl ExtendRound {
    /// A renewal over `nodes` nodes, sent at `start`, of a lease valid until `valid_until`.
    pub fn new(
        nodes: usize,
        ttl: Duration,
        start: Deadline,
        valid_until: Deadline,
        rules: Rules,
    ) -> ExtendRound {
        ExtendRound {
            ttl,
            start,
            valid_until,
            rules,
            tally: Tally::new(nodes),
        }
    }

    /// Node `index`'s answer; returns its vote. After the round was decided, the vote is not
    /// counted: a late `Missing` after a renewal calls for a restore on that node.
    pub fn handle(&mut self, index: usize, answer: Result<ExtendReply, NodeError>) -> Vote {
        let vote = match answer {
            Ok(reply) => reply.vote(),
            Err(err) => Vote::Failed(err),
        };
        if !self.tally.decided() {
            self.tally.record(index, vote.clone());
        }
        vote
    }

    /// Every vote counted so far, by node index.
    pub fn votes(&self) -> &[Option<Vote>] {
        &self.tally.votes
    }

    /// The round ends at the lease's end of validity, whatever is still awaited.
    pub fn poll_timeout(&self) -> Option<Deadline> {
        Some(self.valid_until)
    }

    /// What to do next, at `now`.
    pub fn poll(&self, now: Deadline) -> ExtendStep {
        let expired = now >= self.valid_until;
        if !self.tally.decided() {
            return if expired {
                ExtendStep::Expired
            } else {
                ExtendStep::Listen
            };
        }
        let votes = self.tally.votes.clone();
        if !self.tally.won() {
            let contrary = votes
                .iter()
                .filter(|v| matches!(v, Some(Vote::HeldBy(_) | Vote::Missing)))
                .count();
            return if contrary >= quorum(votes.len()) {
                ExtendStep::Superseded(votes)
            } else {
                ExtendStep::Lost(votes)
            };
        }
        if expired {
            return ExtendStep::Expired;
        }
        let elapsed = now.saturating_duration_since(self.start);
        let Some(valid) = self.rules.validity(self.ttl, elapsed) else {
            return ExtendStep::Expired;
        };
        let proven_until = self.start + valid;
        let valid_until = renewed_end(self.rules, self.valid_until, proven_until);
        let restore = votes
            .iter()
            .enumerate()
            .filter(|(_, vote)| **vote == Some(Vote::Missing))
            .map(|(index, _)| index)
            .collect();
        ExtendStep::Renewed {
            valid_until,
            proven_until,
            restore,
        }
    }
}

/// The end of validity after a renewal that proved `proven` of a lease promised until
/// `previous`: never earlier than `previous` (`timing::renewed_until`, the longest promise),
/// unless the rule is switched off.
pub fn renewed_end(rules: Rules, previous: Deadline, proven: Deadline) -> Deadline {
    if rules.longest_promise {
        renewed_until(previous, proven, Duration::ZERO)
    } else {
        proven
    }
}

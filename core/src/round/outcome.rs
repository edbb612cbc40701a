//! What an acquire round ends in ([`AcquireStep`]): the next step, how a won round gets its
//! token and its validity, why a round was lost, and a stale record the next round may
//! replace.

use std::time::Duration;

use super::Rules;
use crate::clock::Deadline;
use crate::error::Vote;

/// What the caller does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AcquireStep {
    /// Feed in the next answer (each is bounded by the node timeout).
    Listen,
    /// Read the max-ttl register of these nodes (each read bounded by the node timeout once
    /// the node's connection is up) and feed each result to
    /// [`AcquireRound::handle_register`](super::AcquireRound::handle_register); nodes already being read need no second read. At
    /// [`AcquireRound::poll_timeout`](super::AcquireRound::poll_timeout), call [`AcquireRound::handle_timeout`](super::AcquireRound::handle_timeout).
    Recheck(Vec<usize>),
    /// Lost: delete our key (owner-checked, silently) on the nodes `clean_up` lists, then
    /// report `lost`.
    Lost {
        /// Nodes that may hold our key.
        clean_up: Vec<usize>,
        /// Why, with every vote.
        lost: RoundLost,
    },
    /// Won, but so late that no validity is left: delete our key everywhere.
    TooShort {
        /// How long the round took.
        elapsed: Duration,
    },
    /// Won: mint the token as planned, then lead.
    Won(TokenPlan),
}

/// How a won round gets its fencing token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenPlan {
    /// A quorum of counted grants stored the candidate: it is the token.
    Stored(u64),
    /// A node already had a counter at least as high: raise the fence above this (the
    /// highest counter seen, or the candidate).
    RaiseAbove(u64),
}

/// Another set's record that a round judged to predate a restart of our servers (see
/// `votes::NodeSet::explains`): the next round may replace it where it is still at least
/// `after` old (plus the time since this round), as the acquire script checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StaleRecord {
    /// Its fingerprint.
    pub set: String,
    /// The age it must exceed, as of the end of the round that judged it.
    pub after: Duration,
}

/// Why a round was lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lost {
    /// Another contender lists other nodes: its record (`theirs`) is live.
    NodeSetConflict {
        /// The other set's fingerprint.
        theirs: String,
    },
    /// A quorum would grant once young nodes have kept their data long enough.
    NotYetTrusted {
        /// How long until enough of them count.
        ready_in: Duration,
    },
    /// A split among contenders: nobody can have a quorum.
    Contended,
    /// Another holder has the lock.
    Busy {
        /// The identity most nodes showed.
        holder: Option<String>,
        /// The shortest remaining ttl of the holder's key.
        holder_ttl: Option<Duration>,
        /// The highest fencing counter seen.
        holder_fence: u64,
    },
    /// Too few nodes answered or counted.
    QuorumUnreachable {
        /// Votes needed.
        needed: usize,
    },
}

/// A lost round's report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoundLost {
    /// Why.
    pub why: Lost,
    /// Each node's vote, by index (`None`: no answer).
    pub votes: Vec<Option<Vote>>,
}

/// A won round's validity: `ttl − elapsed − drift` from the round's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Validity {
    pub(super) start: Deadline,
    pub(super) ttl: Duration,
    pub(super) rules: Rules,
}

impl Validity {
    /// The end of validity at `now`, or how long the round took if no validity is left.
    pub fn at(&self, now: Deadline) -> Result<Deadline, Duration> {
        let elapsed = now.saturating_duration_since(self.start);
        match self.rules.validity(self.ttl, elapsed) {
            Some(valid) => Ok(self.start + valid),
            None => Err(elapsed),
        }
    }
}

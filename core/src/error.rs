//! What can go wrong, as types every layer shares: a flag that breaks a rule
//! ([`ConfigError`], exit 2), one failed call to one node ([`NodeError`], classified in a small
//! fixed set used as a metric label), per-node votes and the lock-level errors built from them.

use std::fmt;
use std::time::Duration;

/// A configuration value that breaks a rule. Displayed as `--flag: why`, one line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{flag}: {reason}")]
pub struct ConfigError {
    /// The command-line flag at fault (its environment variable is documented beside it).
    pub flag: &'static str,
    /// The rule it breaks, with the values involved.
    pub reason: String,
}

impl ConfigError {
    /// A new error for `flag`.
    pub fn new(flag: &'static str, reason: impl Into<String>) -> ConfigError {
        ConfigError {
            flag,
            reason: reason.into(),
        }
    }
}

/// Why a call to one node failed, in a small fixed set (used as a metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NodeErrorKind {
    /// No answer within the per-node timeout.
    Timeout,
    /// Refused, reset, unreachable or unknown host.
    Connection,
    /// Wrong password or user, or a password is required.
    Auth,
    /// The peer answered something that is not the expected Redis reply.
    Protocol,
    /// Any other error the node returned.
    Other,
}

impl NodeErrorKind {
    /// Every kind, for pre-initialising metrics.
    pub const ALL: [NodeErrorKind; 5] = [
        NodeErrorKind::Timeout,
        NodeErrorKind::Connection,
        NodeErrorKind::Auth,
        NodeErrorKind::Protocol,
        NodeErrorKind::Other,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeErrorKind::Timeout => "timeout",
            NodeErrorKind::Connection => "connection",
            NodeErrorKind::Auth => "auth",
            NodeErrorKind::Protocol => "protocol",
            NodeErrorKind::Other => "other",
        }
    }
}

impl fmt::Display for NodeErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed call to one node: its kind and a scrubbed message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct NodeError {
    /// The class of failure.
    pub kind: NodeErrorKind,
    /// What the client library said, with any password removed.
    pub message: String,
}

impl NodeError {
    /// Whether the node refused a command because the ACL user may not run it (`NOPERM`).
    pub fn is_acl_denial(&self) -> bool {
        self.kind == NodeErrorKind::Auth && self.message.to_ascii_lowercase().contains("noperm")
    }

    /// No answer within `after`.
    pub fn timeout(after: Duration) -> NodeError {
        NodeError {
            kind: NodeErrorKind::Timeout,
            message: format!("no answer within {after:?}"),
        }
    }
}

/// What one node answered in one round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Vote {
    /// The node granted (or kept) our key and its vote counts.
    Granted,
    /// Another holder has the key on this node (its identity, when readable).
    HeldBy(String),
    /// The node granted, but its vote does not count: it cannot prove it kept its data for
    /// the longest ttl plus drift (a flush, restart or failover), or it may evict keys.
    NotCounted(String),
    /// Our key was gone on this node (extend only).
    Missing,
    /// The call failed.
    Failed(NodeError),
}

impl fmt::Display for Vote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Vote::Granted => f.write_str("granted"),
            Vote::HeldBy(holder) => write!(f, "held by {holder}"),
            Vote::NotCounted(why) => write!(f, "not counted ({why})"),
            Vote::Missing => f.write_str("key missing"),
            Vote::Failed(err) => write!(f, "{err}"),
        }
    }
}

/// The votes of one round, by node label. Nodes that had not answered when the
/// round was decided are absent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Votes(pub Vec<(String, Vote)>);

impl Votes {
    /// Labels of the nodes whose call failed.
    pub fn failed(&self) -> impl Iterator<Item = &str> {
        self.0
            .iter()
            .filter(|(_, v)| matches!(v, Vote::Failed(_)))
            .map(|(label, _)| label.as_str())
    }
}

impl fmt::Display for Votes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (label, vote)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{label}: {vote}")?;
        }
        Ok(())
    }
}

/// The votes of one round as they arrive, and whether the round is decided.
pub struct Tally {
    needed: usize,
    granted: usize,
    against: usize,
    /// Each node's vote, by index; `None` until it answers.
    pub votes: Vec<Option<Vote>>,
}

impl Tally {
    /// An empty tally for `nodes` nodes.
    pub fn new(nodes: usize) -> Tally {
        Tally {
            needed: crate::timing::quorum(nodes),
            granted: 0,
            against: 0,
            votes: vec![None; nodes],
        }
    }

    /// Records node `index`'s vote; true once a quorum for or against is certain.
    pub fn record(&mut self, index: usize, vote: Vote) -> bool {
        if vote == Vote::Granted {
            self.granted += 1;
        } else {
            self.against += 1;
        }
        self.votes[index] = Some(vote);
        self.decided()
    }

    /// Whether a quorum for or against is certain.
    pub fn decided(&self) -> bool {
        self.won() || self.votes.len() - self.against < self.needed
    }

    /// How many counted grants were recorded.
    pub fn granted(&self) -> usize {
        self.granted
    }

    /// Whether a quorum granted.
    pub fn won(&self) -> bool {
        self.granted >= self.needed
    }
}

/// Why the lock was not taken, kept or released.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LockError {
    /// Another holder has the lock on enough nodes that we cannot get a quorum.
    #[error("lock {lock:?} is busy (holder: {}) [{votes}]", holder.as_deref().unwrap_or("unknown"))]
    Busy {
        /// The lock name.
        lock: String,
        /// The current holder's identity, if a node told us.
        holder: Option<String>,
        /// The remaining ttl of the holder's key (smallest seen), if known.
        holder_ttl: Option<Duration>,
        /// The highest fencing counter seen: the holder's token once it is stored.
        holder_fence: u64,
        /// Per-node answers.
        votes: Votes,
    },
    /// Nobody won the round, and no holder can have a quorum either: contenders split the
    /// votes. It says nothing about a holder, so waiting retries it, also past its
    /// deadline (for up to one ttl). Its [`LockError::kind`] is `busy`.
    #[error("lock {lock:?}: votes split among contenders, no holder has a quorum [{votes}]")]
    Contended {
        /// The lock name.
        lock: String,
        /// Per-node answers.
        votes: Votes,
    },
    /// Too few nodes answered (or counted) to form a quorum, whoever holds the lock.
    #[error("lock {lock:?}: quorum of {needed} unreachable [{votes}]")]
    QuorumUnreachable {
        /// The lock name.
        lock: String,
        /// Votes needed.
        needed: usize,
        /// Per-node answers.
        votes: Votes,
    },
    /// A quorum would grant, but some of its nodes have not yet kept their data for the
    /// longest ttl plus drift (a restart, flush or failover a moment ago): their votes count
    /// after `ready_in`. Waiting retries then, also past its deadline.
    #[error("lock {lock:?}: nodes vote in {ready_in:?}, once they have kept their data for ttl + drift [{votes}]")]
    NotYetTrusted {
        /// The lock name.
        lock: String,
        /// How long until enough of them count for a quorum.
        ready_in: Duration,
        /// Per-node answers.
        votes: Votes,
    },
    /// Another contender of this lock lists other Redis nodes (its node-set record is live on
    /// a node we reached): contenders on different node sets could both get a quorum, so we
    /// refuse to lead until its record expires.
    #[error(
        "lock {lock:?}: another contender lists other Redis nodes; refusing to lead [{votes}]"
    )]
    NodeSetConflict {
        /// The lock name.
        lock: String,
        /// Per-node answers.
        votes: Votes,
    },
    /// A quorum granted, but so late that no validity was left.
    #[error("lock {lock:?}: validity too short (round took {elapsed:?} of ttl {ttl:?})")]
    ValidityTooShort {
        /// The lock name.
        lock: String,
        /// How long the round took.
        elapsed: Duration,
        /// The ttl asked for.
        ttl: Duration,
    },
    /// The lease could not be extended on a quorum: it may be held by someone else now.
    #[error("lock {lock:?}: lost, extend failed [{votes}]")]
    Lost {
        /// The lock name.
        lock: String,
        /// Per-node answers.
        votes: Votes,
    },
    /// A quorum of nodes shows another holder's key or no key at all: the lease is gone,
    /// and retrying cannot bring it back.
    #[error("lock {lock:?}: taken over or lost on a quorum [{votes}]")]
    Superseded {
        /// The lock name.
        lock: String,
        /// Per-node answers.
        votes: Votes,
    },
    /// The lease's validity ended before the call could prove it.
    #[error("lock {lock:?}: lease expired")]
    Expired {
        /// The lock name.
        lock: String,
    },
    /// The caller cancelled.
    #[error("cancelled")]
    Cancelled,
}

impl LockError {
    /// A small fixed label for metrics and exit codes.
    pub fn kind(&self) -> &'static str {
        match self {
            LockError::Busy { .. } | LockError::Contended { .. } => "busy",
            LockError::QuorumUnreachable { .. } | LockError::NotYetTrusted { .. } => "no_quorum",
            LockError::NodeSetConflict { .. } => "node_set_conflict",
            LockError::ValidityTooShort { .. } | LockError::Expired { .. } => "expired",
            LockError::Lost { .. } => "lost",
            LockError::Superseded { .. } => "superseded",
            LockError::Cancelled => "cancelled",
        }
    }

    /// The votes behind the error, if any.
    pub fn votes(&self) -> Option<&Votes> {
        match self {
            LockError::Busy { votes, .. }
            | LockError::Contended { votes, .. }
            | LockError::QuorumUnreachable { votes, .. }
            | LockError::NotYetTrusted { votes, .. }
            | LockError::NodeSetConflict { votes, .. }
            | LockError::Lost { votes, .. }
            | LockError::Superseded { votes, .. } => Some(votes),
            _ => None,
        }
    }
}

//! What the service answers: a lease granted, why none was, how a lease ended, what a
//! lease-id route finds, Dapr's unlock answers.

use crate::clock::Deadline;
use crate::locks::lease_id::LeaseId;

/// How a lease ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// The app released it.
    Released,
    /// The app stopped keeping it alive for a ttl (a Dapr lock: its expiry came).
    Abandoned,
    /// Renewal failed; the validity was about to end, or another holder showed up.
    Lost,
    /// The sidecar shut down and released it.
    Shutdown,
}

impl End {
    /// The metric label and the JSON word.
    pub fn as_str(self) -> &'static str {
        match self {
            End::Released => "released",
            End::Abandoned => "abandoned",
            End::Lost => "lost",
            End::Shutdown => "shutdown",
        }
    }

    /// What the app is told about it.
    pub fn explain(self) -> &'static str {
        match self {
            End::Released => "the lease was released",
            End::Abandoned => "the lease was released: it was not kept alive within its ttl",
            End::Lost => "the lease was lost: it could not be renewed on a quorum of nodes",
            End::Shutdown => "the lease was released: the sidecar is shutting down",
        }
    }
}

/// A lease's state, as its watchers see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseState {
    /// Held, valid until then.
    Held { valid_until: Deadline },
    /// Ended.
    Ended(End),
}

/// A lease granted to a request.
#[derive(Clone, Debug)]
pub struct Granted {
    /// The lease id (the app's handle on the lease).
    pub lease: LeaseId,
    /// The fencing token.
    pub fencing_token: u64,
    /// When the validity ends.
    pub valid_until: Deadline,
}

/// Why no lease was granted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refused {
    /// Still held elsewhere after the wait.
    Held { holder: Option<String> },
    /// No quorum of nodes.
    NoQuorum { kind: &'static str },
    /// The bound on leases of this sidecar (held, waiting, ending and remembered) is reached.
    TooMany { max: usize },
    /// [`MAX_WAITING`](super::MAX_WAITING) acquisitions with a wait are in progress.
    TooManyWaiting { max: usize },
    /// The engine cannot take this name or ttl.
    Invalid(String),
    /// The sidecar is shutting down.
    ShuttingDown,
    /// The request was cancelled.
    Cancelled,
}

impl Refused {
    pub(super) fn metric(&self) -> &'static str {
        match self {
            Refused::Held { .. } => "busy",
            Refused::NoQuorum { .. } => "no_quorum",
            Refused::Cancelled => "cancelled",
            _ => "refused",
        }
    }
}

/// What a lease-id route finds.
#[derive(Debug, PartialEq, Eq)]
pub enum Found {
    /// Not a lease of this sidecar for this name.
    Unknown,
    /// A lease that ended.
    Ended(End),
    /// A held lease, but [`MAX_WATCHES`](super::MAX_WATCHES) watch streams are open.
    TooManyWatches { max: usize },
}

/// Dapr's unlock answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unlock {
    /// 0: unlocked.
    Unlocked = 0,
    /// 1: the lock does not exist.
    NotFound = 1,
    /// 2: the lock belongs to another owner.
    BelongsToOthers = 2,
    /// 3: internal error.
    InternalError = 3,
}

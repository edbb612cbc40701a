//! The one leadership state, published by the lock loop on a `watch` channel.
//!
//! The lease loop (`run`) and `guard` are the only writers. HTTP, metrics and the
//! Kubernetes integration only read it, so they can never disagree about who leads.

use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use crate::clock::Deadline;

/// What this process knows about one lock at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct Leadership {
    /// The lock name (not the Redis key).
    pub lock: String,
    /// This process' identity, as written into the lock value.
    pub identity: String,
    /// Whether this process holds the lock, and the terms it holds it on.
    pub role: Role,
    /// The current holder as last read from a quorum (also on followers).
    pub holder: Option<HolderView>,
    /// Whether the last round reached a quorum of nodes (leader or not).
    pub quorum_reachable: bool,
}

/// This process' part in the lock.
#[derive(Clone, Debug, PartialEq)]
pub enum Role {
    /// Not holding the lock; contending (or stopping).
    Follower,
    /// Holding the lock.
    Leader(Term),
}

/// The terms of one tenure: fixed at acquisition, deadlines moved by renewals.
#[derive(Clone, Debug, PartialEq)]
pub struct Term {
    /// The fencing token minted for this acquisition.
    pub fencing_token: u64,
    /// Wall-clock time the lock was acquired (for display only).
    pub since: SystemTime,
    /// The latest moment (boot clock) at which this process still claims leadership.
    /// It is the lock's validity end minus the safety margin; readers must compare
    /// against it themselves, because a paused lease task cannot flip the state.
    pub step_down_at: Deadline,
    /// The lock's validity end (boot clock): no node can hold our key past it.
    pub valid_until: Deadline,
}

/// Who holds the lock, as seen by a quorum read.
#[derive(Clone, Debug, PartialEq)]
pub struct HolderView {
    /// The holder's identity (the lock value without its random part).
    pub identity: String,
    /// The fencing counter as read with it (the holder's token once it is written back).
    pub fencing_token: Option<u64>,
    /// When this view was read.
    pub observed_at: SystemTime,
}

impl Leadership {
    /// A follower that has not seen anything yet.
    pub fn new(lock: impl Into<String>, identity: impl Into<String>) -> Self {
        Leadership {
            lock: lock.into(),
            identity: identity.into(),
            role: Role::Follower,
            holder: None,
            quorum_reachable: false,
        }
    }

    /// The term, if this process leads and the term has not run out at `now`.
    ///
    /// This is the only test of leadership observers should use: it stays correct
    /// even when the lease task is paused and has not yet published a step-down.
    pub fn leading_at(&self, now: Deadline) -> Option<&Term> {
        match &self.role {
            Role::Leader(term) if now < term.step_down_at => Some(term),
            _ => None,
        }
    }

    /// Remaining validity of the lock at `now`, if leading.
    pub fn validity_at(&self, now: Deadline) -> Option<Duration> {
        self.leading_at(now)
            .map(|term| term.valid_until.saturating_duration_since(now))
    }
}

/// The sending half, held by the lock loop.
pub type LeadershipTx = watch::Sender<Leadership>;
/// The receiving half, cloned by every observer.
pub type LeadershipRx = watch::Receiver<Leadership>;

//! The lease table: every lease held, ending or remembered, each name's slot (its engine
//! lock and whose turn it is), and when each lease is next looked at.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{watch, Notify};

use super::answers::{End, LeaseState};
use crate::clock::Deadline;
use crate::locks::engine::NameLock;
use crate::locks::idle::IdleNames;
use crate::locks::keepalive::Keepalive;
use crate::locks::lease_id::LeaseId;
use crate::locks::wakes::Wakes;

/// A held (or recently ended) lease, as the app's calls see it.
pub(super) struct Lease {
    pub(super) id: LeaseId,
    pub(super) name: String,
    pub(super) owner: Option<String>,
    pub(super) fencing_token: u64,
    pub(super) ttl: Duration,
    pub(super) timing: Mutex<Keepalive>,
    pub(super) state: watch::Sender<LeaseState>,
    /// True once the lease is done with the nodes (released there, or lost): the state says
    /// `Ended` before that, as soon as the lease stops being held.
    pub(super) settled: Flag,
    /// Why it is to be released, once someone asked (the first reason stands).
    pub(super) stop: Mutex<Option<End>>,
}

impl Lease {
    pub(super) fn ended(&self) -> Option<End> {
        match *self.state.borrow() {
            LeaseState::Ended(end) => Some(end),
            LeaseState::Held { .. } => None,
        }
    }

    pub(super) fn timing(&self) -> std::sync::MutexGuard<'_, Keepalive> {
        self.timing.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn stop_reason(&self) -> Option<End> {
        *self.stop.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One name (and ttl) with its engine lock.
pub(super) struct Slot<N> {
    pub(super) lock: N,
    /// Whose turn it is to wait on Redis.
    pub(super) turn: Arc<tokio::sync::Mutex<()>>,
    /// The holder last seen, for a busy answer.
    pub(super) holder: Mutex<Option<String>>,
    /// Whether a lease of this sidecar holds the slot (until its release on the nodes ends).
    pub(super) held_here: Flag,
}

pub(super) type SlotKey = (String, Duration);

/// What a held lease's renewals and release work with: its name's slot (one use of it) and
/// the engine's lease.
pub(super) struct Holding<N: NameLock> {
    pub(super) key: SlotKey,
    pub(super) slot: Arc<Slot<N>>,
    pub(super) lease: N::Lease,
}

/// Where a lease is in its life.
pub(super) enum Phase<N: NameLock> {
    /// Held, nothing running: it waits for its wake-up.
    Idle(Holding<N>),
    /// Its task runs (a renewal or the release); `again`: something asked for a new decision
    /// meanwhile (a release, a shutdown).
    Busy { again: bool },
    /// Lost: its keys stay on the nodes until the validity its app was given ends, then are
    /// released.
    Promised { holding: Holding<N>, at: Deadline },
    /// Done with the nodes; forgotten at `forget_at` (never: `None`, after a shutdown).
    Ended { forget_at: Option<Deadline> },
}

/// A lease in the table.
pub(super) struct Entry<N: NameLock> {
    pub(super) lease: Arc<Lease>,
    pub(super) phase: Phase<N>,
    /// Forgotten as soon as it is done with the nodes (its app has heard how it ended).
    pub(super) forget_when_settled: bool,
}

pub(super) struct Table<N: NameLock> {
    /// Each slot with the number of requests and leases using it (0: idle, kept a while).
    pub(super) slots: HashMap<SlotKey, (Arc<Slot<N>>, usize)>,
    /// The slots nobody uses, until they are dropped.
    pub(super) idle: IdleNames<SlotKey>,
    /// Every lease held, ending or remembered: each counts against the bound.
    pub(super) leases: HashMap<LeaseId, Entry<N>>,
    /// When each lease is next looked at.
    pub(super) wakes: Wakes<LeaseId>,
    /// Acquisitions in progress (they count against the bound too).
    pub(super) acquiring: usize,
    /// Of them, those with a wait.
    pub(super) waiting: usize,
    /// Leases not yet done with the nodes.
    pub(super) live: usize,
    /// Whether the timer task runs, and the instant it sleeps until.
    pub(super) timer_running: bool,
    pub(super) timer_at: Option<Deadline>,
    /// Leases done with the nodes or forgotten since freed memory was last given back, and
    /// when that was.
    pub(super) ended_since_trim: usize,
    pub(super) trimmed_at: Option<Deadline>,
}

impl<N: NameLock> Table<N> {
    /// An empty table, keeping a name nobody uses `keep` after its last use, for at most
    /// `max_idle` names at once.
    pub(super) fn new(keep: Duration, max_idle: usize) -> Table<N> {
        Table {
            slots: HashMap::new(),
            idle: IdleNames::new(keep, max_idle),
            leases: HashMap::new(),
            wakes: Wakes::new(),
            acquiring: 0,
            waiting: 0,
            live: 0,
            timer_running: false,
            timer_at: None,
            ended_since_trim: 0,
            trimmed_at: None,
        }
    }

    /// Wakes lease `id` at `at`; whether the timer task must wake earlier than it sleeps.
    pub(super) fn wake(&mut self, id: LeaseId, at: Deadline) -> bool {
        self.wakes.set(id, at);
        self.timer_due(at)
    }

    /// Something is due at `at`; whether the timer task must wake earlier than it sleeps.
    pub(super) fn timer_due(&mut self, at: Deadline) -> bool {
        if self.timer_at.is_some_and(|sleeps| sleeps <= at) {
            return false;
        }
        self.timer_at = Some(at);
        true
    }

    /// Whether nothing holds the nodes' attention: no acquisition, no lease not yet done.
    pub(super) fn quiet(&self) -> bool {
        self.acquiring == 0 && self.live == 0
    }

    /// Forgets lease `id`.
    pub(super) fn remove(&mut self, id: LeaseId) {
        self.leases.remove(&id);
        self.wakes.remove(id);
    }
}

/// What a lease's turn does, decided under the table's lock and done outside it.
pub(super) enum Turn<N: NameLock> {
    /// Run its task: renew, release, or set its next wake-up.
    Step(Arc<Lease>, Holding<N>),
    /// Release the keys a lost lease kept for its promise.
    ReleasePromised(Arc<Lease>, Holding<N>),
}

/// A yes/no that can be waited for: kept inline (a `watch` channel allocates a few hundred
/// bytes of its own, and every lease and name has one).
#[derive(Default)]
pub(super) struct Flag {
    value: AtomicBool,
    changed: Notify,
}

impl Flag {
    pub(super) fn set(&self, value: bool) {
        if self.value.swap(value, Ordering::SeqCst) != value {
            self.changed.notify_waiters();
        }
    }

    pub(super) fn get(&self) -> bool {
        self.value.load(Ordering::SeqCst)
    }

    /// Returns once the flag is `value`.
    pub(super) async fn wait_for(&self, value: bool) {
        loop {
            // Registered before the check, so a change between the two cannot slip past.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.get() == value {
                return;
            }
            changed.await;
        }
    }
}

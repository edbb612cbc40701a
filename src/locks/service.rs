//! The lease table: who holds which request lock through this sidecar, who waits, and the
//! task that keeps each held lease (see [`super::keepalive`] for its rules).
//!
//! ## Behaviour
//! - **One waiter on Redis per name.** Requests for one name (and ttl) take turns in
//!   arrival order; only the one whose turn it is runs the engine's acquisition, which waits
//!   for the release announcement (pub/sub) rather than polling. A request whose wait ends
//!   before its turn comes answers busy with the holder last seen.
//! - **Acquisitions are never dropped half-way.** The engine's acquisition runs in the
//!   request's own task (no spawn, no hand-over between threads); a client that goes away
//!   cancels it, its rest then runs as a task of its own, and a lock won for a client that
//!   went away is released at once.
//! - **Bounded.** At most `max_leases` leases held plus acquisitions waiting; past that,
//!   [`Refused::TooMany`].
//! - **Ended leases are remembered** for a minute or one ttl, whichever is longer (or until
//!   the app deletes them), so the app's next call learns why its lease ended instead of a
//!   bare 404.
//! - **Shutdown** refuses new acquisitions, cancels the waiting ones and releases every
//!   lease ([`Locks::shutdown`]).
//! - **Hand-over inside the sidecar without pub/sub.** While a lease of this sidecar holds a
//!   name, the request whose turn it is waits for that lease's release here, then runs the
//!   acquisition round on the nodes at once; it does not wait for the release announcement to
//!   come back from Redis. Safe: the round on the nodes decides, as for any other waiter; the
//!   local signal only says when to try. Past its wait it still runs one round, so a busy
//!   answer names the holder the nodes report.
//! - **A name in use keeps its engine lock**, and keeps it [`IDLE_KEEP`] after its last
//!   request or lease ended (at most [`MAX_IDLE_NAMES`] such names; past that the one idle
//!   longest goes), so a request loop on one hot name pays the engine lock's set-up (keys,
//!   per-node state, and its subscriptions once it has waited) once, not every cycle (see
//!   [`super::idle`]).
//!   Reuse weakens no rule: every acquisition runs a fresh round on the nodes with a new random
//!   value; what the engine lock keeps between rounds only raises the bar: the highest fencing
//!   counter seen (the next candidate starts above it, and the nodes' counters still decide),
//!   the longest ttl seen (the data-age proof asked of a node), and which nodes did not count
//!   last (their proof is asked on every renewal). The node set is read from the connections
//!   at the start of every round, not when the name was opened.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch, Notify};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::engine::{AcquireFailed, EngineLease, ExtendFailed, LockEngine, NameLock};
use super::idle::IdleNames;
use super::keepalive::{Keepalive, Step};
use super::lease_id::LeaseId;
use crate::clock::{self, Deadline};
use crate::metrics::AppLockMetrics;
use crate::redlock::finish::FinishOnDrop;

/// Longest wait for a lease's release to finish before answering anyway (the engine
/// bounds each node call; this only bounds the answer).
const RELEASE_ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// Least time an ended lease (lost, abandoned) is remembered after its end.
const REMEMBER_ENDED: Duration = Duration::from_secs(60);

/// How long a name nobody uses keeps its engine lock: long enough for a request loop on one
/// name to come back, short enough that subscriptions of names nobody locks go soon.
pub const IDLE_KEEP: Duration = Duration::from_secs(5);

/// How long a lease's task waits on Tokio's timer before a boot-clock timer (see
/// [`sleep_cheaply_until`]).
const FIRST_WAITS_ON_TOKIO: Duration = Duration::from_millis(50);

/// The most names kept without use at once (each keeps a subscription on every node).
pub const MAX_IDLE_NAMES: usize = 128;

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
    /// The bound on leases of this sidecar is reached.
    TooMany { max: usize },
    /// The engine cannot take this name or ttl.
    Invalid(String),
    /// The sidecar is shutting down.
    ShuttingDown,
    /// The request was cancelled.
    Cancelled,
}

impl Refused {
    fn metric(&self) -> &'static str {
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
}

/// A held (or recently ended) lease.
struct Lease {
    id: LeaseId,
    name: String,
    owner: Option<String>,
    fencing_token: u64,
    timing: Mutex<Keepalive>,
    state: watch::Sender<LeaseState>,
    /// True once the lease task is done with the nodes (released there, or lost): the state
    /// says `Ended` before that, as soon as the lease stops being held.
    settled: watch::Sender<bool>,
    /// Wakes the lease task after a keepalive or a watcher change.
    wake: Notify,
    /// Asks the lease task to release, for the reason set in `stop_reason`.
    stop: CancellationToken,
    stop_reason: Mutex<End>,
}

impl Lease {
    fn ended(&self) -> Option<End> {
        match *self.state.borrow() {
            LeaseState::Ended(end) => Some(end),
            LeaseState::Held { .. } => None,
        }
    }
}

/// One name (and ttl) with its engine lock.
struct Slot<N> {
    lock: N,
    /// Whose turn it is to wait on Redis.
    turn: Arc<tokio::sync::Mutex<()>>,
    /// The holder last seen, for a busy answer.
    holder: Mutex<Option<String>>,
    /// Whether a lease of this sidecar holds the slot (until its release on the nodes ends).
    held_here: watch::Sender<bool>,
}

type SlotKey = (String, Duration);

struct Table<N> {
    /// Each slot with the number of requests and leases using it (0: idle, kept a while).
    slots: HashMap<SlotKey, (Arc<Slot<N>>, usize)>,
    /// The slots nobody uses, until they are dropped.
    idle: IdleNames<SlotKey>,
    /// Whether a task drops idle slots when their time comes.
    sweeping: bool,
    leases: HashMap<LeaseId, Arc<Lease>>,
    /// Leases held plus acquisitions in progress.
    in_use: usize,
}

/// The request-lock service of one sidecar.
pub struct Locks<E: LockEngine> {
    engine: E,
    max_leases: usize,
    metrics: AppLockMetrics,
    table: Mutex<Table<E::Name>>,
    closing: CancellationToken,
    /// Notified when no lease is held and no acquisition runs (for shutdown).
    idle: Notify,
}

impl<E: LockEngine> Locks<E> {
    /// A service over `engine` holding at most `max_leases` leases and waits at once.
    pub fn new(engine: E, max_leases: usize, metrics: AppLockMetrics) -> Arc<Locks<E>> {
        Locks::keeping_idle(engine, max_leases, metrics, IDLE_KEEP, MAX_IDLE_NAMES)
    }

    /// [`Locks::new`], keeping a name's engine lock `keep` after its last use, for at most
    /// `max_idle` names at once.
    pub fn keeping_idle(
        engine: E,
        max_leases: usize,
        metrics: AppLockMetrics,
        keep: Duration,
        max_idle: usize,
    ) -> Arc<Locks<E>> {
        Arc::new(Locks {
            engine,
            max_leases,
            metrics,
            table: Mutex::new(Table {
                slots: HashMap::new(),
                idle: IdleNames::new(keep, max_idle),
                sweeping: false,
                leases: HashMap::new(),
                in_use: 0,
            }),
            closing: CancellationToken::new(),
            idle: Notify::new(),
        })
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table<E::Name>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Acquires `name` with keys living `ttl`, waiting up to `wait` for a holder elsewhere.
    /// `owner` is the Dapr lock owner, if the request came that way.
    pub async fn acquire(
        self: &Arc<Self>,
        name: &str,
        ttl: Duration,
        wait: Duration,
        owner: Option<String>,
    ) -> Result<Granted, Refused> {
        // A latency for the metrics only.
        let asked = Instant::now();
        let result = self.acquire_counted(name, ttl, wait, owner).await;
        let label = match &result {
            Ok(_) => "acquired",
            Err(refused) => refused.metric(),
        };
        self.metrics.acquired(label, asked.elapsed());
        result
    }

    async fn acquire_counted(
        self: &Arc<Self>,
        name: &str,
        ttl: Duration,
        wait: Duration,
        owner: Option<String>,
    ) -> Result<Granted, Refused> {
        if self.closing.is_cancelled() {
            return Err(Refused::ShuttingDown);
        }
        let key: SlotKey = (name.to_owned(), ttl);
        let slot = self.take_slot(&key)?;
        // Given back when the request ends without a lease, or when its lease ends.
        let claim = Claim {
            locks: Arc::clone(self),
            key,
        };
        self.metrics.waiting_add(1);
        let _waiting = Waiting(&self.metrics);
        let deadline = Deadline::now() + wait;
        // Dropping this future (the client went away) cancels a wait in progress.
        let cancel = self.closing.child_token();
        let _cancel_on_drop = cancel.clone().drop_guard();
        let turn = tokio::select! {
            biased;
            turn = slot.turn.clone().lock_owned() => Some(turn),
            _ = clock::sleep_until_deadline(deadline) => None,
            _ = cancel.cancelled() => None,
        };
        let Some(turn) = turn else {
            drop(claim);
            if self.closing.is_cancelled() {
                return Err(Refused::ShuttingDown);
            }
            let holder = slot
                .holder
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            return Err(Refused::Held { holder });
        };
        let (tx, rx) = oneshot::channel();
        let this = Arc::clone(self);
        let run = cancel.clone();
        // Run here (no task of its own, no hand-over between threads), but never dropped
        // half-way: if this request goes away first, the rest runs as its own task.
        FinishOnDrop::new(async move {
            let _turn = turn;
            let result = if released_here(&slot, deadline, &run).await {
                let seen = Arc::clone(&slot);
                slot.lock
                    .acquire(deadline, run, move |holder| {
                        *seen.holder.lock().unwrap_or_else(|e| e.into_inner()) = holder;
                    })
                    .await
            } else {
                Err(AcquireFailed::Cancelled)
            };
            match result {
                Ok(lease) => {
                    let granted = this.hold(claim, slot, lease, ttl, owner);
                    let id = granted.lease;
                    if this.closing.is_cancelled() {
                        // Won as the sidecar began shutting down: released with the rest.
                        this.stop(id, End::Shutdown);
                    } else if tx.send(Ok(granted)).is_err() {
                        // Nobody to hand it to: release it at once.
                        this.stop(id, End::Released);
                    }
                }
                Err(failed) => {
                    if let AcquireFailed::Held { holder } = &failed {
                        *slot.holder.lock().unwrap_or_else(|e| e.into_inner()) = holder.clone();
                    }
                    drop(claim);
                    let _ = tx.send(Err(failed));
                }
            }
        })
        .run()
        .await;
        match rx.await {
            Ok(Ok(granted)) => Ok(granted),
            Ok(Err(AcquireFailed::Held { holder })) => Err(Refused::Held { holder }),
            Ok(Err(AcquireFailed::NoQuorum { kind })) => Err(Refused::NoQuorum { kind }),
            Ok(Err(AcquireFailed::Cancelled)) | Err(_) if self.closing.is_cancelled() => {
                Err(Refused::ShuttingDown)
            }
            Ok(Err(AcquireFailed::Cancelled)) | Err(_) => Err(Refused::Cancelled),
        }
    }

    /// Counts a request against the bound and opens (or shares) its name's slot.
    fn take_slot(&self, key: &SlotKey) -> Result<Arc<Slot<E::Name>>, Refused> {
        let mut table = self.table();
        if table.in_use >= self.max_leases {
            return Err(Refused::TooMany {
                max: self.max_leases,
            });
        }
        let slot = match table.slots.get_mut(key) {
            Some((slot, users)) => {
                *users += 1;
                let (slot, was_idle) = (Arc::clone(slot), *users == 1);
                if was_idle {
                    table.idle.reused(key);
                }
                slot
            }
            None => {
                let lock = self.engine.open(&key.0, key.1).map_err(Refused::Invalid)?;
                let slot = Arc::new(Slot {
                    lock,
                    turn: Arc::new(tokio::sync::Mutex::new(())),
                    holder: Mutex::new(None),
                    held_here: watch::Sender::new(false),
                });
                table.slots.insert(key.clone(), (Arc::clone(&slot), 1));
                slot
            }
        };
        table.in_use += 1;
        Ok(slot)
    }

    /// A request or lease of `key` is done; once nobody uses the slot, it is kept idle a
    /// while (see [`IdleNames`]).
    fn give_back(self: &Arc<Self>, key: &SlotKey) {
        let mut table = self.table();
        table.in_use = table.in_use.saturating_sub(1);
        if table.in_use == 0 {
            self.idle.notify_waiters();
        }
        let Some((_, users)) = table.slots.get_mut(key) else {
            return;
        };
        if *users == 0 {
            // Already idle (a give-back without a take): it is in the idle queue once.
            return;
        }
        *users -= 1;
        if *users > 0 {
            return;
        }
        let over = table.idle.went_idle(key.clone(), Deadline::now());
        // Dropped after the table's lock (an engine lock's drop ends its subscriptions).
        let _dropped = over.and_then(|over| table.slots.remove(&over));
        if !table.sweeping && !table.idle.is_empty() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                table.sweeping = true;
                runtime.spawn(sweep_idle(Arc::downgrade(self)));
            }
        }
        drop(table);
    }

    /// Drops the slots idle for their time at `now`; when the next one is due (`None`: no
    /// slot is idle, and the sweeping task ends).
    fn drop_idle(&self, now: Deadline) -> Option<Deadline> {
        let mut table = self.table();
        let expired = table.idle.expired(now);
        let dropped: Vec<_> = expired
            .iter()
            .filter_map(|key| table.slots.remove(key))
            .collect();
        let next = table.idle.poll_timeout();
        table.sweeping = next.is_some();
        drop(table);
        drop(dropped);
        next
    }

    /// Registers a won lease and starts the task that keeps it.
    fn hold(
        self: &Arc<Self>,
        claim: Claim<E>,
        slot: Arc<Slot<E::Name>>,
        lease: <E::Name as NameLock>::Lease,
        ttl: Duration,
        owner: Option<String>,
    ) -> Granted {
        let now = Deadline::now();
        let granted = Granted {
            lease: LeaseId::random(),
            fencing_token: lease.fencing_token(),
            valid_until: lease.valid_until(),
        };
        let held = Arc::new(Lease {
            id: granted.lease,
            name: claim.key.0.clone(),
            owner,
            fencing_token: granted.fencing_token,
            timing: Mutex::new(Keepalive::new(ttl, now, granted.valid_until)),
            state: watch::Sender::new(LeaseState::Held {
                valid_until: granted.valid_until,
            }),
            settled: watch::Sender::new(false),
            wake: Notify::new(),
            stop: CancellationToken::new(),
            stop_reason: Mutex::new(End::Released),
        });
        self.table().leases.insert(granted.lease, Arc::clone(&held));
        slot.held_here.send_replace(true);
        self.metrics.leases_add(1);
        tokio::spawn(Arc::clone(self).keep(claim, slot, held, lease, ttl));
        granted
    }

    /// The lease's task: renew, release or say lost, as [`Keepalive::next`] decides.
    async fn keep(
        self: Arc<Self>,
        claim: Claim<E>,
        slot: Arc<Slot<E::Name>>,
        held: Arc<Lease>,
        mut lease: <E::Name as NameLock>::Lease,
        ttl: Duration,
    ) {
        let cheap_until = Deadline::now() + FIRST_WAITS_ON_TOKIO;
        // How the lease ends, and whether its keys are to be released on the nodes.
        let (end, release) = loop {
            if held.stop.is_cancelled() {
                break (
                    *held.stop_reason.lock().unwrap_or_else(|e| e.into_inner()),
                    true,
                );
            }
            let now = Deadline::now();
            let step = held
                .timing
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .next(now);
            match step {
                Step::Release => break (End::Abandoned, true),
                // Owner-checked: deletes only keys that are still ours.
                Step::Lost => break (End::Lost, true),
                Step::Renew => match slot.lock.extend(&lease).await {
                    Ok(renewed) => {
                        let valid_until = renewed.valid_until();
                        lease = renewed;
                        let mut timing = held.timing.lock().unwrap_or_else(|e| e.into_inner());
                        // From when it ended: leases renewed in one batch stay in step.
                        timing.renewed(Deadline::now(), valid_until);
                        let valid_until = timing.valid_until();
                        drop(timing);
                        held.state.send_replace(LeaseState::Held { valid_until });
                    }
                    Err(ExtendFailed::Gone) => break (End::Lost, false),
                    Err(ExtendFailed::Retry) => held
                        .timing
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .renew_failed(now),
                },
                Step::WaitUntil(at) => {
                    tokio::select! {
                        biased;
                        _ = held.stop.cancelled() => {}
                        _ = held.wake.notified() => {}
                        _ = sleep_cheaply_until(at, cheap_until) => {}
                    }
                }
            }
        };
        // Ended before the nodes are asked: from here on the app hears that the lease is gone.
        // A keepalive answered while the release runs would tell it the lock is still its own
        // after a quorum deleted the key and another contender may hold it.
        held.state.send_replace(LeaseState::Ended(end));
        // Counted as the app hears it, not after the nodes answer (a stopped node takes its
        // timeout).
        self.metrics.ended(end.as_str());
        // Gone from a quorum of nodes (or lost): the next request in this sidecar may try
        // now, its calls behind the slower nodes' deletes on the same connections.
        let gone = || {
            slot.held_here.send_replace(false);
        };
        if release {
            if end == End::Lost {
                // A lost lease keeps its promise: the app may act until the validity it was
                // last given, so what we still hold keeps the name from anyone else until then
                // (a shutdown cuts the wait short). Released at once, the keys on the nodes we
                // still reach freed a majority where the key stood on fewer than all, and a
                // waiter was granted before the holder's validity ended.
                let promised = held
                    .timing
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .valid_until();
                tokio::select! {
                    biased;
                    _ = self.closing.cancelled() => {}
                    _ = clock::sleep_until_deadline(promised) => {}
                }
            }
            slot.lock.release(&lease, gone).await;
        } else {
            gone();
        }
        held.settled.send_replace(true);
        if end == End::Lost {
            warn!(lock = %held.name, fencing_token = held.fencing_token, "request lock lost");
        }
        self.metrics.leases_add(-1);
        drop(claim);
        drop(slot);
        // Remember the ending for a while, so the app's next call learns it (an app paused
        // for longer hears 404: a lease it no longer has either way).
        if end != End::Released && end != End::Shutdown {
            clock::sleep_until_deadline(Deadline::now() + ttl.max(REMEMBER_ENDED)).await;
        }
        if end != End::Shutdown {
            self.forget(held.id);
        }
    }

    fn forget(&self, id: LeaseId) {
        let mut table = self.table();
        if table.leases.get(&id).is_some_and(|l| l.ended().is_some()) {
            table.leases.remove(&id);
        }
    }

    /// Asks the lease task of `id` to release for `why`.
    fn stop(&self, id: LeaseId, why: End) -> Option<Arc<Lease>> {
        let lease = self.table().leases.get(&id).cloned()?;
        *lease.stop_reason.lock().unwrap_or_else(|e| e.into_inner()) = why;
        lease.stop.cancel();
        Some(lease)
    }

    /// The lease `id` of `name`, if this sidecar knows it.
    fn lease(&self, name: &str, id: LeaseId) -> Option<Arc<Lease>> {
        self.table()
            .leases
            .get(&id)
            .filter(|l| l.name == name)
            .cloned()
    }

    /// The app keeps lease `id` of `name` alive; the lease as it stands.
    pub fn keepalive(&self, name: &str, id: LeaseId) -> Result<Granted, Found> {
        let lease = self.lease(name, id).ok_or(Found::Unknown)?;
        if let Some(end) = lease.ended() {
            return Err(Found::Ended(end));
        }
        let mut timing = lease.timing.lock().unwrap_or_else(|e| e.into_inner());
        timing.kept_alive(Deadline::now());
        let valid_until = timing.valid_until();
        drop(timing);
        lease.wake.notify_one();
        Ok(Granted {
            lease: id,
            fencing_token: lease.fencing_token,
            valid_until,
        })
    }

    /// Releases lease `id` of `name`; an ended lease is forgotten and its ending told.
    pub async fn release(&self, name: &str, id: LeaseId) -> Result<(), Found> {
        let lease = self.lease(name, id).ok_or(Found::Unknown)?;
        if let Some(end) = lease.ended() {
            self.table().leases.remove(&id);
            return Err(Found::Ended(end));
        }
        self.stop(id, End::Released);
        let mut settled = lease.settled.subscribe();
        let released = settled.wait_for(|settled| *settled);
        let _ = tokio::time::timeout(RELEASE_ANSWER_WITHIN, released).await;
        self.table().leases.remove(&id);
        Ok(())
    }

    /// Follows lease `id` of `name`: its states until it ends. The lease counts as kept
    /// alive while the returned [`Watching`] lives.
    pub fn watch(&self, name: &str, id: LeaseId) -> Result<Watching, Found> {
        let lease = self.lease(name, id).ok_or(Found::Unknown)?;
        if let Some(end) = lease.ended() {
            return Err(Found::Ended(end));
        }
        lease
            .timing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .watcher_joined();
        lease.wake.notify_one();
        Ok(Watching {
            states: lease.state.subscribe(),
            fencing_token: lease.fencing_token,
            lease,
        })
    }

    /// Dapr's unlock: releases the lease `owner` holds on `name` through this sidecar.
    pub async fn unlock_owned(&self, name: &str, owner: &str) -> Unlock {
        let (mine, others) = {
            let table = self.table();
            let held: Vec<&Arc<Lease>> = table
                .leases
                .values()
                .filter(|l| l.name == name && l.ended().is_none())
                .collect();
            let mine = held
                .iter()
                .find(|l| l.owner.as_deref() == Some(owner))
                .map(|l| l.id);
            (mine, !held.is_empty())
        };
        if let Some(id) = mine {
            return match self.release(name, id).await {
                Ok(()) => Unlock::Unlocked,
                Err(_) => Unlock::NotFound,
            };
        }
        if others {
            return Unlock::BelongsToOthers;
        }
        if self.closing.is_cancelled() {
            return Unlock::InternalError;
        }
        // Held through another sidecar, or by nobody: ask the nodes.
        let Ok(lock) = self.engine.open(name, super::bounds::MIN_TTL) else {
            return Unlock::InternalError;
        };
        match lock.holder().await {
            Ok(Some(_)) => Unlock::BelongsToOthers,
            Ok(None) => Unlock::NotFound,
            Err(()) => Unlock::InternalError,
        }
    }

    /// Refuses new acquisitions, cancels the waiting ones and releases every lease; returns
    /// once all are released.
    pub async fn shutdown(&self) {
        self.closing.cancel();
        let mut released = 0;
        loop {
            // Registered before the check, so the last give-back cannot slip past.
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            let held: Vec<LeaseId> = self
                .table()
                .leases
                .values()
                .filter(|l| l.ended().is_none() && !l.stop.is_cancelled())
                .map(|l| l.id)
                .collect();
            for id in held {
                self.stop(id, End::Shutdown);
                released += 1;
            }
            // Every lease ended and every waiting acquisition answered.
            if self.table().in_use == 0 {
                break;
            }
            idle.await;
        }
        if released > 0 {
            info!(leases = released, "request-lock leases released");
        }
        // Names nobody uses now end their subscriptions.
        let dropped: Vec<_> = {
            let mut table = self.table();
            let idle = table.idle.drain();
            idle.iter()
                .filter_map(|key| table.slots.remove(key))
                .collect()
        };
        drop(dropped);
    }

    /// Leases held now (for tests and status).
    pub fn held(&self) -> usize {
        self.table()
            .leases
            .values()
            .filter(|l| l.ended().is_none())
            .count()
    }
}

/// Sleeps until `at` on the boot clock; before `cheap_until`, on Tokio's timer instead, in
/// one slice that ends there at the latest (the caller decides again when it ends). Most
/// request locks are released within milliseconds, before they would need a boot-clock
/// timer, and one costs a timer descriptor and its registration (five system calls): a wait
/// armed and dropped took 7.7 µs on it against 1.5 µs on Tokio's timer (debug build, 2
/// cores), and those 6 µs are 6 % of the 100 µs a request lock's HTTP hop over the library
/// path may cost. A suspend during the slice delays that decision by at most the slice; the
/// deadlines stay [`Deadline`]s, only this first slice is a relative Tokio sleep.
async fn sleep_cheaply_until(at: Deadline, cheap_until: Deadline) {
    let now = Deadline::now();
    if now < cheap_until {
        tokio::time::sleep(at.min(cheap_until).saturating_duration_since(now)).await;
    } else {
        clock::sleep_until_deadline(at).await;
    }
}

/// Drops idle slots when their time comes, while any is idle and the service lives.
async fn sweep_idle<E: LockEngine>(locks: Weak<Locks<E>>) {
    loop {
        let next = match locks.upgrade() {
            Some(locks) => locks.drop_idle(Deadline::now()),
            None => None,
        };
        let Some(next) = next else {
            return;
        };
        clock::sleep_until_deadline(next).await;
    }
}

/// Waits while a lease of this sidecar holds `slot`: until its release on the nodes ended,
/// or `deadline` (then the caller still runs one round, which reports the holder). `false`
/// when cancelled.
async fn released_here<N>(slot: &Slot<N>, deadline: Deadline, cancel: &CancellationToken) -> bool {
    let mut held = slot.held_here.subscribe();
    tokio::select! {
        biased;
        _ = cancel.cancelled() => false,
        _ = held.wait_for(|held| !*held) => true,
        _ = clock::sleep_until_deadline(deadline) => true,
    }
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

/// An open watch on a lease; dropping it counts as a keepalive at that moment.
pub struct Watching {
    /// The lease's states.
    pub states: watch::Receiver<LeaseState>,
    /// The lease's fencing token.
    pub fencing_token: u64,
    lease: Arc<Lease>,
}

impl Drop for Watching {
    fn drop(&mut self) {
        self.lease
            .timing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .watcher_left(Deadline::now());
        self.lease.wake.notify_one();
    }
}

/// A request's (then its lease's) share of the bound and of its name's slot; given back when
/// dropped, whichever way the request or lease ends.
struct Claim<E: LockEngine> {
    locks: Arc<Locks<E>>,
    key: SlotKey,
}

impl<E: LockEngine> Drop for Claim<E> {
    fn drop(&mut self) {
        self.locks.give_back(&self.key);
    }
}

/// Counts an acquisition as waiting while it lives.
struct Waiting<'a>(&'a AppLockMetrics);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting_add(-1);
    }
}

#[cfg(test)]
mod tests {
    //! The service over an in-process engine whose waiters are never woken by the nodes
    //! (as if no release announcement came), to see what the service itself does.

    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::metrics::Metrics;

    #[derive(Default)]
    struct Nodes {
        /// The names held on the nodes.
        held: Mutex<std::collections::HashSet<String>>,
        /// Acquisition rounds that found the name held.
        busy_rounds: AtomicUsize,
        tokens: AtomicUsize,
        /// Names opened and dropped (engine locks made and freed).
        opened: AtomicUsize,
        dropped: AtomicUsize,
        /// While set, a release deletes the key (a quorum answered) and then waits for
        /// `releases_finish` (the slowest node's answer).
        slow_releases: std::sync::atomic::AtomicBool,
        releases_finish: Notify,
    }

    struct Engine(Arc<Nodes>);
    struct Name(Arc<Nodes>, String);
    struct Held(u64, Deadline);

    impl Drop for Name {
        fn drop(&mut self) {
            self.0.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl EngineLease for Held {
        fn fencing_token(&self) -> u64 {
            self.0
        }
        fn valid_until(&self) -> Deadline {
            self.1
        }
    }

    impl NameLock for Name {
        type Lease = Held;

        async fn acquire(
            &self,
            deadline: Deadline,
            cancel: CancellationToken,
            _: impl FnMut(Option<String>) + Send + 'static,
        ) -> Result<Held, AcquireFailed> {
            if self.0.held.lock().unwrap().insert(self.1.clone()) {
                let token = self.0.tokens.fetch_add(1, Ordering::SeqCst) as u64 + 1;
                return Ok(Held(token, Deadline::now() + Duration::from_secs(30)));
            }
            self.0.busy_rounds.fetch_add(1, Ordering::SeqCst);
            // No announcement ever comes: only the deadline or a cancel ends the wait.
            tokio::select! {
                _ = clock::sleep_until_deadline(deadline) => Err(AcquireFailed::Held { holder: None }),
                _ = cancel.cancelled() => Err(AcquireFailed::Cancelled),
            }
        }
        async fn extend(&self, lease: &Held) -> Result<Held, ExtendFailed> {
            Ok(Held(lease.0, Deadline::now() + Duration::from_secs(30)))
        }
        async fn release(&self, _: &Held, gone: impl FnOnce() + Send) {
            self.0.held.lock().unwrap().remove(&self.1);
            gone();
            if self.0.slow_releases.load(Ordering::SeqCst) {
                self.0.releases_finish.notified().await;
            }
        }
        async fn holder(&self) -> Result<Option<String>, ()> {
            Ok(None)
        }
    }

    impl LockEngine for Engine {
        type Name = Name;
        fn open(&self, name: &str, _: Duration) -> Result<Name, String> {
            self.0.opened.fetch_add(1, Ordering::SeqCst);
            Ok(Name(Arc::clone(&self.0), name.to_owned()))
        }
    }

    fn service(nodes: &Arc<Nodes>) -> Arc<Locks<Engine>> {
        let metrics = Metrics::new("t", &[], None).app_locks().clone();
        Locks::new(Engine(Arc::clone(nodes)), 16, metrics)
    }

    fn service_keeping(nodes: &Arc<Nodes>, keep: Duration, max: usize) -> Arc<Locks<Engine>> {
        let metrics = Metrics::new("t", &[], None).app_locks().clone();
        Locks::keeping_idle(Engine(Arc::clone(nodes)), 16, metrics, keep, max)
    }

    /// One acquisition and its release; the token.
    async fn cycle(locks: &Arc<Locks<Engine>>, name: &str) -> u64 {
        let ttl = Duration::from_secs(10);
        let granted = locks
            .acquire(name, ttl, Duration::ZERO, None)
            .await
            .unwrap();
        locks.release(name, granted.lease).await.unwrap();
        granted.fencing_token
    }

    #[tokio::test]
    async fn a_hot_name_reuses_its_engine_lock_cycle_after_cycle() {
        let nodes = Arc::new(Nodes::default());
        let locks = service(&nodes);
        let mut last = 0;
        for _ in 0..20 {
            let token = cycle(&locks, "hot").await;
            assert!(token > last, "every acquisition is a new one");
            last = token;
        }
        assert_eq!(nodes.opened.load(Ordering::SeqCst), 1, "opened once");
        assert_eq!(nodes.dropped.load(Ordering::SeqCst), 0, "kept while idle");
        assert_eq!(locks.table().slots.len(), 1);
    }

    #[tokio::test]
    async fn a_name_nobody_uses_drops_its_engine_lock_after_the_idle_time() {
        let nodes = Arc::new(Nodes::default());
        let locks = service_keeping(&nodes, Duration::from_millis(50), 8);
        cycle(&locks, "once").await;
        until(|| nodes.dropped.load(Ordering::SeqCst) == 1).await;
        assert!(locks.table().slots.is_empty());
        assert!(
            !locks.table().sweeping,
            "the sweeping task ends with the last idle name"
        );
        // The name opens again when it is wanted again, and is dropped again.
        cycle(&locks, "once").await;
        assert_eq!(nodes.opened.load(Ordering::SeqCst), 2);
        until(|| nodes.dropped.load(Ordering::SeqCst) == 2).await;
    }

    #[tokio::test]
    async fn distinct_names_leave_at_most_the_bound_of_idle_engine_locks() {
        let nodes = Arc::new(Nodes::default());
        let locks = service_keeping(&nodes, Duration::from_secs(3600), 4);
        for i in 0..50 {
            cycle(&locks, &format!("order-{i}")).await;
        }
        assert_eq!(nodes.opened.load(Ordering::SeqCst), 50);
        // The acquisition's part of a name is given back just after its answer.
        until(|| nodes.dropped.load(Ordering::SeqCst) == 46).await;
        assert_eq!(locks.table().slots.len(), 4);
        assert_eq!(locks.table().idle.len(), 4);
        // The most recent names are the ones kept: reused without opening.
        cycle(&locks, "order-49").await;
        assert_eq!(nodes.opened.load(Ordering::SeqCst), 50);
    }

    #[tokio::test]
    async fn a_name_in_use_is_never_dropped_however_long_it_is_held() {
        let nodes = Arc::new(Nodes::default());
        let locks = service_keeping(&nodes, Duration::from_millis(10), 8);
        let ttl = Duration::from_secs(10);
        let held = locks
            .acquire("held", ttl, Duration::ZERO, None)
            .await
            .unwrap();
        // Other names come and go while it is held, and are dropped after their idle time
        // (so more than that time passes while it is held).
        for i in 0..5 {
            cycle(&locks, &format!("other-{i}")).await;
        }
        until(|| nodes.dropped.load(Ordering::SeqCst) == 5).await;
        assert!(locks.table().slots.contains_key(&("held".to_owned(), ttl)));
        locks.release("held", held.lease).await.unwrap();
        until(|| nodes.dropped.load(Ordering::SeqCst) == 6).await;
    }

    #[tokio::test]
    async fn shutdown_drops_the_idle_names() {
        let nodes = Arc::new(Nodes::default());
        let locks = service(&nodes);
        cycle(&locks, "a").await;
        cycle(&locks, "b").await;
        until(|| locks.table().idle.len() == 2).await;
        locks.shutdown().await;
        assert_eq!(nodes.dropped.load(Ordering::SeqCst), 2);
        assert!(locks.table().slots.is_empty());
    }

    #[tokio::test]
    async fn a_release_here_hands_the_name_to_the_next_request_here_without_an_announcement() {
        let nodes = Arc::new(Nodes::default());
        let locks = service(&nodes);
        let ttl = Duration::from_secs(10);
        let first = locks
            .acquire("hot", ttl, Duration::ZERO, None)
            .await
            .unwrap();
        let waiter = tokio::spawn({
            let locks = Arc::clone(&locks);
            async move {
                locks
                    .acquire("hot", ttl, Duration::from_secs(20), None)
                    .await
            }
        });
        // The waiter has its turn (it holds a claim) before the release.
        until(|| locks.table().in_use == 2).await;
        locks.release("hot", first.lease).await.unwrap();
        let second = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("handed over without waiting for the deadline")
            .unwrap()
            .unwrap();
        assert!(second.fencing_token > first.fencing_token);
        assert_eq!(
            nodes.busy_rounds.load(Ordering::SeqCst),
            0,
            "no round ran while the name was held here"
        );
    }

    #[tokio::test]
    async fn past_its_wait_a_request_behind_a_lease_here_still_asks_the_nodes_once() {
        let nodes = Arc::new(Nodes::default());
        let locks = service(&nodes);
        let ttl = Duration::from_secs(10);
        locks
            .acquire("hot", ttl, Duration::ZERO, None)
            .await
            .unwrap();
        let refused = locks
            .acquire("hot", ttl, Duration::from_millis(20), None)
            .await;
        assert_eq!(refused.unwrap_err(), Refused::Held { holder: None });
        assert_eq!(nodes.busy_rounds.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lease_being_released_is_no_longer_kept_alive_and_delete_waits_for_the_nodes() {
        let nodes = Arc::new(Nodes::default());
        nodes.slow_releases.store(true, Ordering::SeqCst);
        let locks = service(&nodes);
        let is_held = |name: &str| nodes.held.lock().unwrap().contains(name);

        // Abandoned: once the release has deleted the key, a keepalive hears that it ended,
        // not a validity (another contender may hold the lock by now).
        let ttl = Duration::from_millis(200);
        let granted = locks
            .acquire("abandoned", ttl, Duration::ZERO, None)
            .await
            .unwrap();
        until(|| !is_held("abandoned")).await;
        assert!(matches!(
            locks.keepalive("abandoned", granted.lease),
            Err(Found::Ended(End::Abandoned))
        ));
        nodes.releases_finish.notify_waiters();

        // DELETE answers once the nodes answered the release, not before.
        let granted = locks
            .acquire("deleted", Duration::from_secs(10), Duration::ZERO, None)
            .await
            .unwrap();
        let releasing = tokio::spawn({
            let locks = Arc::clone(&locks);
            async move { locks.release("deleted", granted.lease).await }
        });
        until(|| !is_held("deleted")).await;
        assert!(!releasing.is_finished());
        assert!(matches!(
            locks.keepalive("deleted", granted.lease),
            Err(Found::Ended(End::Released))
        ));
        until(|| {
            nodes.releases_finish.notify_waiters();
            releasing.is_finished()
        })
        .await;
        assert_eq!(releasing.await.unwrap(), Ok(()));
    }

    /// Waits (with a deadline) until `done`.
    async fn until(done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !done() {
            assert!(Instant::now() < deadline, "condition not reached in 5 s");
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

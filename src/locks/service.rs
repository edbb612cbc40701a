//! The lease table: who holds which request lock through this sidecar, who waits, and when
//! each lease is next renewed, released or forgotten (see [`super::keepalive`] for the rules,
//! [`super::wakes`] for the one table of wake-ups).
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
//! - **Every lease is counted.** At most `max_leases` (`--locks-max-leases`) leases held,
//!   acquisitions in progress, leases ending (a lost one keeps its keys until the validity
//!   its app was given) and ended leases still remembered, all together; past that,
//!   [`Refused::TooMany`] at once. Apart from that bound, at most [`MAX_WAITING`]
//!   acquisitions with a wait at once ([`Refused::TooManyWaiting`]) and at most
//!   [`MAX_WATCHES`] watch streams ([`Found::TooManyWatches`]): each holds its client's
//!   connection, and together they never take every connection of the control listener.
//! - **A lease costs no task, timer or descriptor while it waits.** Every lease is one entry
//!   in one table of wake-ups; one task sleeps (on the boot clock's shared timer, see
//!   [`crate::clock::shared`]) until the earliest, and a lease gets a task only while it
//!   renews or releases. Its next step is decided again at every wake-up, from the boot
//!   clock ([`Keepalive::next`]); a wake-up a keepalive or a watch made too early only
//!   decides again.
//! - **Memory follows the leases held.** After a burst of endings ([`TRIM_AFTER_ENDINGS`]
//!   leases, at most every [`TRIM_AT_MOST_EVERY`]) the allocator gives its free memory back.
//! - **Ended leases are remembered** for a minute or one ttl, whichever is longer (or until
//!   the app deletes them), so the app's next call learns why its lease ended instead of a
//!   bare 404; they count against the bound meanwhile. A Dapr lock's ending is not remembered
//!   (Dapr's API has no call that could ask), nor is a release the app asked for.
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
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{oneshot, watch, Notify};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::engine::{AcquireFailed, EngineLease, ExtendFailed, LockEngine, NameLock};
use super::idle::IdleNames;
use super::keepalive::{Keepalive, Step};
use super::lease_id::LeaseId;
use super::wakes::Wakes;
use crate::clock::{self, Clock, Deadline};
use crate::metrics::AppLockMetrics;
use crate::redlock::finish::FinishOnDrop;

/// Longest wait for a lease's release to finish before answering anyway (the engine
/// bounds each node call; this only bounds the answer).
const RELEASE_ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// Least time an ended lease (lost, abandoned) is remembered after its end.
pub const REMEMBER_ENDED: Duration = Duration::from_secs(60);

/// How long a name nobody uses keeps its engine lock: long enough for a request loop on one
/// name to come back, short enough that subscriptions of names nobody locks go soon.
pub const IDLE_KEEP: Duration = Duration::from_secs(5);

/// The most names kept without use at once (each keeps a subscription on every node).
pub const MAX_IDLE_NAMES: usize = 128;

/// Most acquisitions with a wait (`wait` > 0) in progress at once, whatever the bound on
/// leases. Each holds its client's connection for up to its wait; with [`MAX_WATCHES`] it
/// stays well below the control listener's connections (`crate::http::connection_cap`), so
/// waits and watches never leave a resign or a new request without a connection.
pub const MAX_WAITING: usize = 128;

/// Most lease watch streams open at once (see [`MAX_WAITING`]).
pub const MAX_WATCHES: usize = 128;

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
    /// [`MAX_WAITING`] acquisitions with a wait are in progress.
    TooManyWaiting { max: usize },
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
    /// A held lease, but [`MAX_WATCHES`] watch streams are open.
    TooManyWatches { max: usize },
}

/// A held (or recently ended) lease, as the app's calls see it.
struct Lease {
    id: LeaseId,
    name: String,
    owner: Option<String>,
    fencing_token: u64,
    ttl: Duration,
    timing: Mutex<Keepalive>,
    state: watch::Sender<LeaseState>,
    /// True once the lease is done with the nodes (released there, or lost): the state says
    /// `Ended` before that, as soon as the lease stops being held.
    settled: Flag,
    /// Why it is to be released, once someone asked (the first reason stands).
    stop: Mutex<Option<End>>,
}

impl Lease {
    fn ended(&self) -> Option<End> {
        match *self.state.borrow() {
            LeaseState::Ended(end) => Some(end),
            LeaseState::Held { .. } => None,
        }
    }

    fn timing(&self) -> std::sync::MutexGuard<'_, Keepalive> {
        self.timing.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn stop_reason(&self) -> Option<End> {
        *self.stop.lock().unwrap_or_else(|e| e.into_inner())
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
    held_here: Flag,
}

type SlotKey = (String, Duration);

/// What a held lease's renewals and release work with: its name's slot (one use of it) and
/// the engine's lease.
struct Holding<N: NameLock> {
    key: SlotKey,
    slot: Arc<Slot<N>>,
    lease: N::Lease,
}

/// Where a lease is in its life.
enum Phase<N: NameLock> {
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
struct Entry<N: NameLock> {
    lease: Arc<Lease>,
    phase: Phase<N>,
    /// Forgotten as soon as it is done with the nodes (its app has heard how it ended).
    forget_when_settled: bool,
}

struct Table<N: NameLock> {
    /// Each slot with the number of requests and leases using it (0: idle, kept a while).
    slots: HashMap<SlotKey, (Arc<Slot<N>>, usize)>,
    /// The slots nobody uses, until they are dropped.
    idle: IdleNames<SlotKey>,
    /// Every lease held, ending or remembered: each counts against the bound.
    leases: HashMap<LeaseId, Entry<N>>,
    /// When each lease is next looked at.
    wakes: Wakes<LeaseId>,
    /// Acquisitions in progress (they count against the bound too).
    acquiring: usize,
    /// Of them, those with a wait.
    waiting: usize,
    /// Leases not yet done with the nodes.
    live: usize,
    /// Whether the timer task runs, and the instant it sleeps until.
    timer_running: bool,
    timer_at: Option<Deadline>,
    /// Leases done with the nodes or forgotten since freed memory was last given back, and
    /// when that was.
    ended_since_trim: usize,
    trimmed_at: Option<Deadline>,
}

impl<N: NameLock> Table<N> {
    /// Wakes lease `id` at `at`; whether the timer task must wake earlier than it sleeps.
    fn wake(&mut self, id: LeaseId, at: Deadline) -> bool {
        self.wakes.set(id, at);
        self.timer_due(at)
    }

    /// Something is due at `at`; whether the timer task must wake earlier than it sleeps.
    fn timer_due(&mut self, at: Deadline) -> bool {
        if self.timer_at.is_some_and(|sleeps| sleeps <= at) {
            return false;
        }
        self.timer_at = Some(at);
        true
    }

    /// Whether nothing holds the nodes' attention: no acquisition, no lease not yet done.
    fn quiet(&self) -> bool {
        self.acquiring == 0 && self.live == 0
    }

    /// Forgets lease `id`.
    fn remove(&mut self, id: LeaseId) {
        self.leases.remove(&id);
        self.wakes.remove(id);
    }
}

/// What a lease's turn does, decided under the table's lock and done outside it.
enum Turn<N: NameLock> {
    /// Run its task: renew, release, or set its next wake-up.
    Step(Arc<Lease>, Holding<N>),
    /// Release the keys a lost lease kept for its promise.
    ReleasePromised(Arc<Lease>, Holding<N>),
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
    /// Wakes the timer task earlier than it sleeps.
    timer: Arc<Notify>,
    /// Watch streams open now.
    watches: Arc<AtomicUsize>,
}

impl<E: LockEngine> Locks<E> {
    /// A service over `engine` with at most `max_leases` leases (held, waiting, ending and
    /// remembered) at once.
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
                leases: HashMap::new(),
                wakes: Wakes::new(),
                acquiring: 0,
                waiting: 0,
                live: 0,
                timer_running: false,
                timer_at: None,
                ended_since_trim: 0,
                trimmed_at: None,
            }),
            closing: CancellationToken::new(),
            idle: Notify::new(),
            timer: Arc::new(Notify::new()),
            watches: Arc::new(AtomicUsize::new(0)),
        })
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table<E::Name>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The bound on leases (`--locks-max-leases`).
    pub fn max_leases(&self) -> usize {
        self.max_leases
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
        let asked = clock::Stopwatch::start();
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
        let waits = !wait.is_zero();
        let slot = self.take_slot(&key, waits)?;
        // Given back when the request ends without a lease; a lease takes it over.
        let claim = Claim {
            locks: Arc::clone(self),
            key,
            waits,
            taken_over: false,
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

    /// Counts a request against the bounds and opens (or shares) its name's slot.
    fn take_slot(&self, key: &SlotKey, waits: bool) -> Result<Arc<Slot<E::Name>>, Refused> {
        let mut table = self.table();
        if table.acquiring + table.leases.len() >= self.max_leases {
            return Err(Refused::TooMany {
                max: self.max_leases,
            });
        }
        if waits && table.waiting >= MAX_WAITING {
            return Err(Refused::TooManyWaiting { max: MAX_WAITING });
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
                    held_here: Flag::default(),
                });
                table.slots.insert(key.clone(), (Arc::clone(&slot), 1));
                slot
            }
        };
        table.acquiring += 1;
        if waits {
            table.waiting += 1;
        }
        Ok(slot)
    }

    /// An acquisition ended without a lease: its count and its use of the slot go back.
    fn give_back(self: &Arc<Self>, key: &SlotKey, waits: bool) {
        let mut table = self.table();
        table.acquiring = table.acquiring.saturating_sub(1);
        if waits {
            table.waiting = table.waiting.saturating_sub(1);
        }
        if table.quiet() {
            self.idle.notify_waiters();
        }
        let dropped = self.slot_unused(&mut table, key);
        drop(table);
        // Dropped after the table's lock (an engine lock's drop ends its subscriptions).
        drop(dropped);
    }

    /// A request or lease of `key` is done with its slot; once nobody uses the slot, it is
    /// kept idle a while (see [`IdleNames`]). The slot to drop (after the table's lock), if
    /// one goes now.
    fn slot_unused(
        self: &Arc<Self>,
        table: &mut Table<E::Name>,
        key: &SlotKey,
    ) -> Option<(Arc<Slot<E::Name>>, usize)> {
        let (_, users) = table.slots.get_mut(key)?;
        if *users == 0 {
            // Already idle (a give-back without a take): it is in the idle queue once.
            return None;
        }
        *users -= 1;
        if *users > 0 {
            return None;
        }
        let now = Deadline::now();
        let over = table.idle.went_idle(key.clone(), now);
        let dropped = over.and_then(|over| table.slots.remove(&over));
        if let Some(due) = table.idle.poll_timeout() {
            self.timer_due(table, due);
        }
        dropped
    }

    /// Something is due at `at`: the timer task wakes by then (started if it is not running).
    fn timer_due(self: &Arc<Self>, table: &mut Table<E::Name>, at: Deadline) {
        if table.timer_due(at) {
            self.timer.notify_one();
        }
        self.start_timer(table);
    }

    /// Starts the timer task, once.
    fn start_timer(self: &Arc<Self>, table: &mut Table<E::Name>) {
        if table.timer_running {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            table.timer_running = true;
            runtime.spawn(run_timer(Arc::downgrade(self), Arc::clone(&self.timer)));
        }
    }

    /// Registers a won lease: an entry in the table and a wake-up, no task.
    fn hold(
        self: &Arc<Self>,
        mut claim: Claim<E>,
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
        let timing = Keepalive::new(ttl, now, granted.valid_until);
        let first = match timing.next(now) {
            Step::WaitUntil(at) => at,
            // Nothing to wait for (a validity too short to renew in time): decide at once.
            _ => now,
        };
        let held = Arc::new(Lease {
            id: granted.lease,
            name: claim.key.0.clone(),
            owner,
            fencing_token: granted.fencing_token,
            ttl,
            timing: Mutex::new(timing),
            state: watch::Sender::new(LeaseState::Held {
                valid_until: granted.valid_until,
            }),
            settled: Flag::default(),
            stop: Mutex::new(None),
        });
        let holding = Holding {
            key: claim.key.clone(),
            slot: Arc::clone(&slot),
            lease,
        };
        let mut table = self.table();
        // The request's count becomes the lease's, in one step: the bound never sees a gap.
        claim.taken_over = true;
        table.acquiring = table.acquiring.saturating_sub(1);
        if claim.waits {
            table.waiting = table.waiting.saturating_sub(1);
        }
        table.leases.insert(
            granted.lease,
            Entry {
                lease: held,
                phase: Phase::Idle(holding),
                forget_when_settled: false,
            },
        );
        table.live += 1;
        if table.wake(granted.lease, first) {
            self.timer.notify_one();
        }
        self.start_timer(&mut table);
        drop(table);
        drop(claim);
        slot.held_here.set(true);
        self.metrics.leases_add(1);
        granted
    }

    /// Gives lease `id` its turn: its task runs if it has something to do (or may have), else
    /// its next wake-up is set again; an ended lease past its memory is forgotten.
    fn kick(self: &Arc<Self>, id: LeaseId) {
        let now = Deadline::now();
        let mut table = self.table();
        let Some(entry) = table.leases.get_mut(&id) else {
            return;
        };
        let lease = Arc::clone(&entry.lease);
        let phase = std::mem::replace(&mut entry.phase, Phase::Busy { again: false });
        let (turn, wake) = match phase {
            Phase::Idle(holding) => (Some(Turn::Step(lease, holding)), None),
            Phase::Busy { .. } => {
                entry.phase = Phase::Busy { again: true };
                (None, None)
            }
            Phase::Promised { holding, at } if at <= now || self.closing.is_cancelled() => {
                (Some(Turn::ReleasePromised(lease, holding)), None)
            }
            Phase::Promised { holding, at } => {
                entry.phase = Phase::Promised { holding, at };
                (None, Some(at))
            }
            Phase::Ended { forget_at } if forget_at.is_some_and(|at| at <= now) => {
                table.remove(id);
                table.ended_since_trim += 1;
                (None, None)
            }
            Phase::Ended { forget_at } => {
                entry.phase = Phase::Ended { forget_at };
                (None, forget_at)
            }
        };
        if let Some(at) = wake {
            if table.wake(id, at) {
                self.timer.notify_one();
            }
        }
        drop(table);
        match turn {
            Some(Turn::Step(lease, holding)) => {
                tokio::spawn(Arc::clone(self).step(lease, holding));
            }
            Some(Turn::ReleasePromised(lease, holding)) => {
                tokio::spawn(Arc::clone(self).settle(lease, holding, End::Lost, true));
            }
            None => {}
        }
    }

    /// The lease's task: renew, release or say lost, as [`Keepalive::next`] decides, until
    /// there is nothing to do before a later instant; then it leaves a wake-up and ends.
    async fn step(self: Arc<Self>, lease: Arc<Lease>, mut holding: Holding<E::Name>) {
        loop {
            let now = Deadline::now();
            let step = match lease.stop_reason() {
                Some(why) => return self.end(lease, holding, why).await,
                None => lease.timing().next(now),
            };
            match step {
                Step::Release => return self.end(lease, holding, End::Abandoned).await,
                // Owner-checked: deletes only keys that are still ours.
                Step::Lost => return self.end(lease, holding, End::Lost).await,
                Step::Renew => match holding.slot.lock.extend(&holding.lease).await {
                    Ok(renewed) => {
                        let valid_until = renewed.valid_until();
                        holding.lease = renewed;
                        let mut timing = lease.timing();
                        // From when it ended: leases renewed in one batch stay in step.
                        timing.renewed(Deadline::now(), valid_until);
                        let valid_until = timing.valid_until();
                        drop(timing);
                        lease.state.send_replace(LeaseState::Held { valid_until });
                    }
                    Err(ExtendFailed::Gone) => {
                        lease.state.send_replace(LeaseState::Ended(End::Lost));
                        self.metrics.ended(End::Lost.as_str());
                        return self.settle(lease, holding, End::Lost, false).await;
                    }
                    Err(ExtendFailed::Retry) => lease.timing().renew_failed(now),
                },
                Step::WaitUntil(at) => match self.park(&lease, holding, at) {
                    Some(back) => holding = back,
                    None => return,
                },
            }
        }
    }

    /// Leaves the lease idle until `at`; its holding back if something asked for a new
    /// decision meanwhile.
    fn park(
        self: &Arc<Self>,
        lease: &Lease,
        holding: Holding<E::Name>,
        at: Deadline,
    ) -> Option<Holding<E::Name>> {
        let mut table = self.table();
        let Some(entry) = table.leases.get_mut(&lease.id) else {
            // Not in the table (cannot happen: a lease not done with the nodes is never
            // forgotten): keep deciding, it will release.
            return Some(holding);
        };
        if let Phase::Busy { again: true } = entry.phase {
            entry.phase = Phase::Busy { again: false };
            return Some(holding);
        }
        entry.phase = Phase::Idle(holding);
        if table.wake(lease.id, at) {
            self.timer.notify_one();
        }
        None
    }

    /// The lease ends for `end`: from here on the app hears that it is gone; its keys are
    /// released, a lost lease's once the validity its app was given has ended.
    async fn end(self: Arc<Self>, lease: Arc<Lease>, holding: Holding<E::Name>, end: End) {
        // Ended before the nodes are asked: a keepalive answered while the release runs
        // would tell the app the lock is still its own after a quorum deleted the key and
        // another contender may hold it.
        lease.state.send_replace(LeaseState::Ended(end));
        // Counted as the app hears it, not after the nodes answer (a stopped node takes its
        // timeout).
        self.metrics.ended(end.as_str());
        if end == End::Lost {
            // A lost lease keeps its promise: the app may act until the validity it was last
            // given, so what we still hold keeps the name from anyone else until then (a
            // shutdown cuts the wait short). Released at once, the keys on the nodes we still
            // reach freed a majority where the key stood on fewer than all, and a waiter was
            // granted before the holder's validity ended.
            let promised = lease.timing().valid_until();
            if Deadline::now() < promised && !self.closing.is_cancelled() {
                let mut table = self.table();
                if let Some(entry) = table.leases.get_mut(&lease.id) {
                    entry.phase = Phase::Promised {
                        holding,
                        at: promised,
                    };
                    if table.wake(lease.id, promised) {
                        self.timer.notify_one();
                    }
                    drop(table);
                    // A shutdown that began meanwhile may have found it busy.
                    if self.closing.is_cancelled() {
                        self.kick(lease.id);
                    }
                    return;
                }
            }
        }
        self.settle(lease, holding, end, true).await;
    }

    /// Releases the lease's keys (`release`; a lease the nodes no longer show needs none),
    /// then it is done with the nodes: remembered, or forgotten.
    async fn settle(
        self: Arc<Self>,
        lease: Arc<Lease>,
        holding: Holding<E::Name>,
        end: End,
        release: bool,
    ) {
        // Gone from a quorum of nodes (or lost): the next request in this sidecar may try
        // now, its calls behind the slower nodes' deletes on the same connections.
        let slot = Arc::clone(&holding.slot);
        let gone = move || {
            slot.held_here.set(false);
        };
        if release {
            holding.slot.lock.release(&holding.lease, gone).await;
        } else {
            gone();
        }
        lease.settled.set(true);
        if end == End::Lost {
            warn!(lock = %lease.name, fencing_token = lease.fencing_token, "request lock lost");
        }
        self.metrics.leases_add(-1);
        let now = Deadline::now();
        // Remember the ending for a while, so the app's next call learns it (an app paused
        // for longer hears 404: a lease it no longer has either way). Dapr's API has no call
        // that could ask; a released lease's app asked for it.
        let remembered = match end {
            End::Shutdown => None,
            End::Lost | End::Abandoned if lease.owner.is_none() => {
                Some(now + lease.ttl.max(REMEMBER_ENDED))
            }
            End::Lost | End::Abandoned | End::Released => Some(now),
        };
        let mut table = self.table();
        table.live = table.live.saturating_sub(1);
        table.ended_since_trim += 1;
        if let Some(entry) = table.leases.get_mut(&lease.id) {
            if entry.forget_when_settled || remembered.is_some_and(|at| at <= now) {
                table.remove(lease.id);
            } else {
                entry.phase = Phase::Ended {
                    forget_at: remembered,
                };
                match remembered {
                    Some(at) => {
                        if table.wake(lease.id, at) {
                            self.timer.notify_one();
                        }
                    }
                    None => table.wakes.remove(lease.id),
                }
            }
        }
        if table.quiet() {
            self.idle.notify_waiters();
        }
        let dropped = self.slot_unused(&mut table, &holding.key);
        drop(table);
        drop(holding);
        drop(dropped);
    }

    /// The timer's turn at `now`: gives the leases due their turn and drops the idle slots
    /// due; when it is next due.
    fn on_time(self: &Arc<Self>, now: Deadline) -> Option<Deadline> {
        let mut table = self.table();
        let due = table.wakes.due(now);
        let expired = table.idle.expired(now);
        let dropped: Vec<_> = expired
            .iter()
            .filter_map(|key| table.slots.remove(key))
            .collect();
        table.timer_at = None;
        drop(table);
        drop(dropped);
        for id in due {
            self.kick(id);
        }
        let mut table = self.table();
        let mut trim_at = None;
        if table.ended_since_trim >= TRIM_AFTER_ENDINGS {
            let at = table
                .trimmed_at
                .map_or(now, |last| last + TRIM_AT_MOST_EVERY);
            if at <= now {
                table.ended_since_trim = 0;
                table.trimmed_at = Some(now);
                tokio::task::spawn_blocking(give_back_memory);
            } else {
                trim_at = Some(at);
            }
        }
        let next = [table.wakes.next(), table.idle.poll_timeout(), trim_at]
            .into_iter()
            .flatten()
            .min();
        table.timer_at = next;
        next
    }

    /// Forgets lease `id` if it is done with the nodes, else once it is.
    fn forget(&self, id: LeaseId) {
        let mut table = self.table();
        let Some(entry) = table.leases.get_mut(&id) else {
            return;
        };
        if let Phase::Ended { .. } = entry.phase {
            table.remove(id);
        } else {
            entry.forget_when_settled = true;
        }
    }

    /// Asks the lease task of `id` to release for `why` (unless a reason was given before).
    fn stop(self: &Arc<Self>, id: LeaseId, why: End) -> Option<Arc<Lease>> {
        let lease = self.table().leases.get(&id).map(|e| Arc::clone(&e.lease))?;
        lease
            .stop
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(why);
        self.kick(id);
        Some(lease)
    }

    /// The lease `id` of `name`, if this sidecar knows it.
    fn lease(&self, name: &str, id: LeaseId) -> Option<Arc<Lease>> {
        self.table()
            .leases
            .get(&id)
            .filter(|e| e.lease.name == name)
            .map(|e| Arc::clone(&e.lease))
    }

    /// The app keeps lease `id` of `name` alive; the lease as it stands. (No wake-up moves:
    /// a keepalive only moves the release later, and the lease's next wake-up decides again.)
    pub fn keepalive(&self, name: &str, id: LeaseId) -> Result<Granted, Found> {
        let lease = self.lease(name, id).ok_or(Found::Unknown)?;
        if let Some(end) = lease.ended() {
            return Err(Found::Ended(end));
        }
        let mut timing = lease.timing();
        timing.kept_alive(Deadline::now());
        let valid_until = timing.valid_until();
        drop(timing);
        Ok(Granted {
            lease: id,
            fencing_token: lease.fencing_token,
            valid_until,
        })
    }

    /// Releases lease `id` of `name`; an ended lease is forgotten and its ending told.
    pub async fn release(self: &Arc<Self>, name: &str, id: LeaseId) -> Result<(), Found> {
        let lease = self.lease(name, id).ok_or(Found::Unknown)?;
        if let Some(end) = lease.ended() {
            self.forget(id);
            return Err(Found::Ended(end));
        }
        self.stop(id, End::Released);
        let _ = clock::within(RELEASE_ANSWER_WITHIN, lease.settled.wait_for(true)).await;
        self.forget(id);
        Ok(())
    }

    /// Follows lease `id` of `name`: its states until it ends. The lease counts as kept
    /// alive while the returned [`Watching`] lives. At most [`MAX_WATCHES`] at once.
    pub fn watch(&self, name: &str, id: LeaseId) -> Result<Watching, Found> {
        let lease = self.lease(name, id).ok_or(Found::Unknown)?;
        if let Some(end) = lease.ended() {
            return Err(Found::Ended(end));
        }
        let counted = self
            .watches
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |open| {
                (open < MAX_WATCHES).then_some(open + 1)
            });
        if counted.is_err() {
            return Err(Found::TooManyWatches { max: MAX_WATCHES });
        }
        lease.timing().watcher_joined();
        Ok(Watching {
            states: lease.state.subscribe(),
            fencing_token: lease.fencing_token,
            lease,
            open: Arc::clone(&self.watches),
        })
    }

    /// Dapr's unlock: releases the lease `owner` holds on `name` through this sidecar.
    pub async fn unlock_owned(self: &Arc<Self>, name: &str, owner: &str) -> Unlock {
        let (mine, others) = {
            let table = self.table();
            let held: Vec<&Arc<Lease>> = table
                .leases
                .values()
                .map(|e| &e.lease)
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
    pub async fn shutdown(self: &Arc<Self>) {
        self.closing.cancel();
        let mut released = 0;
        loop {
            // Registered before the check, so the last give-back cannot slip past.
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            let (to_stop, quiet) = {
                let table = self.table();
                let to_stop: Vec<(LeaseId, bool)> = table
                    .leases
                    .values()
                    .filter(|e| !matches!(e.phase, Phase::Ended { .. }))
                    .filter(|e| e.lease.stop_reason().is_none())
                    .map(|e| (e.lease.id, e.lease.ended().is_none()))
                    .collect();
                (to_stop, table.quiet())
            };
            for (id, held) in to_stop {
                self.stop(id, End::Shutdown);
                released += usize::from(held);
            }
            // Every lease done with the nodes and every waiting acquisition answered.
            if quiet {
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
            .filter(|e| e.lease.ended().is_none())
            .count()
    }

    /// Everything that counts against the bound now: leases held, ending or remembered, and
    /// acquisitions in progress.
    pub fn counted(&self) -> usize {
        let table = self.table();
        table.leases.len() + table.acquiring
    }
}

/// After this many leases ended, the memory their renewals and releases used is given back
/// to the system (see [`give_back_memory`]).
const TRIM_AFTER_ENDINGS: usize = 256;
/// At most this often.
const TRIM_AT_MOST_EVERY: Duration = Duration::from_secs(10);

/// Gives the allocator's free memory back to the system. glibc keeps what a burst freed (a
/// thousand leases renewed or released at once leave ~14 MB behind, measured) unless asked;
/// so the resident size follows the leases held now, not the most ever held. A few
/// milliseconds, on a blocking thread.
fn give_back_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of the allocator's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The timer task: sleeps on the boot clock until the earliest wake-up of any lease or idle
/// slot, gives them their turn, and sleeps again; woken earlier when something is due
/// earlier. Ends with the service.
async fn run_timer<E: LockEngine>(locks: Weak<Locks<E>>, earlier: Arc<Notify>) {
    loop {
        // Registered before the table is read, so a wake-up set meanwhile cannot slip past.
        let notified = earlier.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let next = match locks.upgrade() {
            Some(locks) => locks.on_time(Deadline::now()),
            None => return,
        };
        tokio::select! {
            biased;
            _ = notified => {}
            _ = Clock::Boot.sleep_until_some(next) => {}
        }
    }
}

/// Waits while a lease of this sidecar holds `slot`: until its release on the nodes ended,
/// or `deadline` (then the caller still runs one round, which reports the holder). `false`
/// when cancelled.
async fn released_here<N>(slot: &Slot<N>, deadline: Deadline, cancel: &CancellationToken) -> bool {
    tokio::select! {
        biased;
        _ = cancel.cancelled() => false,
        _ = slot.held_here.wait_for(false) => true,
        _ = clock::sleep_until_deadline(deadline) => true,
    }
}

/// A yes/no that can be waited for: kept inline (a `watch` channel allocates a few hundred
/// bytes of its own, and every lease and name has one).
#[derive(Default)]
struct Flag {
    value: AtomicBool,
    changed: Notify,
}

impl Flag {
    fn set(&self, value: bool) {
        if self.value.swap(value, Ordering::SeqCst) != value {
            self.changed.notify_waiters();
        }
    }

    fn get(&self) -> bool {
        self.value.load(Ordering::SeqCst)
    }

    /// Returns once the flag is `value`.
    async fn wait_for(&self, value: bool) {
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
    /// The count of open watches, this one included.
    open: Arc<AtomicUsize>,
}

impl Drop for Watching {
    fn drop(&mut self) {
        // The release moves to a ttl from now: later than the lease's next wake-up (a
        // renewal within a third of the ttl), which decides again.
        self.lease.timing().watcher_left(Deadline::now());
        self.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request's share of the bounds and of its name's slot; given back when dropped,
/// whichever way the request ends, unless a lease took it over.
struct Claim<E: LockEngine> {
    locks: Arc<Locks<E>>,
    key: SlotKey,
    waits: bool,
    /// A lease has the share now (see [`Locks::hold`]).
    taken_over: bool,
}

impl<E: LockEngine> Drop for Claim<E> {
    fn drop(&mut self) {
        if !self.taken_over {
            self.locks.give_back(&self.key, self.waits);
        }
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
        assert_eq!(
            locks.table().timer_at,
            None,
            "nothing is due once the last idle name is gone"
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
        until(|| locks.counted() == 2).await;
        locks.release("hot", first.lease).await.unwrap();
        let second = clock::within(Duration::from_secs(5), waiter)
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

    fn service_of(nodes: &Arc<Nodes>, max: usize) -> Arc<Locks<Engine>> {
        let metrics = Metrics::new("t", &[], None).app_locks().clone();
        Locks::new(Engine(Arc::clone(nodes)), max, metrics)
    }

    #[tokio::test]
    async fn a_held_lease_costs_no_task_while_it_waits() {
        let nodes = Arc::new(Nodes::default());
        let locks = service_of(&nodes, 2_000);
        let tasks = || {
            tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks()
        };
        let ttl = Duration::from_secs(30);
        locks
            .acquire("first", ttl, Duration::ZERO, None)
            .await
            .unwrap();
        let before = tasks();
        for i in 0..1_000 {
            locks
                .acquire(&format!("order-{i}"), ttl, Duration::ZERO, None)
                .await
                .unwrap();
        }
        assert_eq!(locks.held(), 1_001);
        assert_eq!(tasks(), before, "one timer task for all, none per lease");
        assert_eq!(locks.table().wakes.len(), 1_001, "one wake-up each");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ended_leases_count_against_the_bound_until_forgotten() {
        let nodes = Arc::new(Nodes::default());
        let locks = service_of(&nodes, 2);
        let short = Duration::from_millis(200);
        let a = locks
            .acquire("a", short, Duration::ZERO, None)
            .await
            .unwrap();
        locks
            .acquire("b", short, Duration::ZERO, None)
            .await
            .unwrap();
        // Nobody keeps them alive: abandoned after their ttl, and remembered.
        until(|| locks.held() == 0 && nodes.held.lock().unwrap().is_empty()).await;
        assert_eq!(locks.counted(), 2);
        let refused = locks.acquire("c", short, Duration::ZERO, None).await;
        assert_eq!(refused.unwrap_err(), Refused::TooMany { max: 2 });
        // The app hears how its lease ended; then it is forgotten, and there is room again.
        assert_eq!(
            locks.release("a", a.lease).await,
            Err(Found::Ended(End::Abandoned))
        );
        assert_eq!(locks.counted(), 1);
        locks
            .acquire("c", short, Duration::ZERO, None)
            .await
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dapr_lock_that_expires_is_not_remembered() {
        let nodes = Arc::new(Nodes::default());
        let locks = service_of(&nodes, 1);
        let short = Duration::from_millis(200);
        let owner = || Some("app-1".to_owned());
        locks
            .acquire("a", short, Duration::ZERO, owner())
            .await
            .unwrap();
        until(|| locks.counted() == 0).await;
        locks
            .acquire("b", short, Duration::ZERO, owner())
            .await
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waits_and_watches_have_bounds_of_their_own() {
        let nodes = Arc::new(Nodes::default());
        let locks = service_of(&nodes, 1_000);
        let ttl = Duration::from_secs(30);
        let held = locks
            .acquire("hot", ttl, Duration::ZERO, None)
            .await
            .unwrap();
        let mut waiters = Vec::new();
        for _ in 0..MAX_WAITING {
            let locks = Arc::clone(&locks);
            waiters.push(tokio::spawn(async move {
                locks
                    .acquire("hot", ttl, Duration::from_secs(60), None)
                    .await
            }));
        }
        until(|| locks.table().waiting == MAX_WAITING).await;
        let refused = locks
            .acquire("cold", ttl, Duration::from_secs(1), None)
            .await;
        assert_eq!(
            refused.unwrap_err(),
            Refused::TooManyWaiting { max: MAX_WAITING }
        );
        // A request without a wait, and a release, still go through.
        let other = locks
            .acquire("cold", ttl, Duration::ZERO, None)
            .await
            .unwrap();
        locks.release("cold", other.lease).await.unwrap();

        let mut watching: Vec<_> = (0..MAX_WATCHES)
            .map(|_| locks.watch("hot", held.lease).unwrap())
            .collect();
        assert!(matches!(
            locks.watch("hot", held.lease),
            Err(Found::TooManyWatches { .. })
        ));
        watching.pop();
        assert!(locks.watch("hot", held.lease).is_ok());
        for waiter in waiters {
            waiter.abort();
        }
        until(|| locks.table().waiting == 0).await;
    }

    /// Waits (with a deadline) until `done`.
    async fn until(done: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !done() {
            assert!(
                std::time::Instant::now() < deadline,
                "condition not reached in 5 s"
            );
            tokio::task::yield_now().await;
            clock::pause(Duration::from_millis(1)).await;
        }
    }
}

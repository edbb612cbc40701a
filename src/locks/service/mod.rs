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
//!   clock ([`Keepalive::next`](super::keepalive::Keepalive::next)); a wake-up a keepalive or
//!   a watch made too early only decides again.
//! - **Memory follows the leases held.** After a burst of endings
//!   ([`life::TRIM_AFTER_ENDINGS`] leases, at most every [`life::TRIM_AT_MOST_EVERY`]) the
//!   allocator gives its free memory back.
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

//!
//! | file | concern |
//! |---|---|
//! | [`answers`] | what the service answers: grants, refusals, endings, Dapr's unlock |
//! | [`table`] | the lease table: leases, names' slots, phases, wake-ups |
//! | [`acquire`] | a request for a lease: the bounds, the turns per name, the round, the grant |
//! | [`life`] | a held lease's turns: renewals, its end, its release, the timer |
//! | [`calls`] | the app's calls on a lease (keepalive, release, watch), Dapr's unlock, shutdown |

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::engine::LockEngine;
use crate::metrics::AppLockMetrics;
use table::Table;

pub mod acquire;
pub mod answers;
pub mod calls;
pub mod life;
pub mod table;

pub use answers::{End, Found, Granted, LeaseState, Refused, Unlock};
pub use calls::Watching;

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
            table: Mutex::new(Table::new(keep, max_idle)),
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

#[cfg(test)]
mod tests;

//! A request for a lease: counted against the bounds, in turn behind the other requests for
//! its name, one round on the nodes, and a won lease entered in the table.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::answers::{End, Granted, LeaseState, Refused};
use super::table::{Entry, Flag, Holding, Lease, Phase, Slot, SlotKey, Table};
use super::{Locks, MAX_WAITING};
use crate::clock::{self, Deadline};
use crate::locks::engine::{AcquireFailed, EngineLease, LockEngine, NameLock};
use crate::locks::keepalive::{Keepalive, Step};
use crate::locks::lease_id::LeaseId;
use crate::metrics::AppLockMetrics;
use crate::redlock::finish::FinishOnDrop;

impl<E: LockEngine> Locks<E> {
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
        // Run here (no task of its own, no hand-over between threads), but never dropped
        // half-way: if this request goes away first, the rest runs as its own task.
        FinishOnDrop::new(async move {
            let _turn = turn;
            let result = round(&slot, deadline, cancel).await;
            this.deliver(claim, slot, result, owner, tx);
        })
        .run()
        .await;
        answer(rx.await, self.closing.is_cancelled())
    }

    /// Hands the round's outcome to the request: a won lease enters the table (released at
    /// once if the request went away, or with the rest if the sidecar is shutting down); a
    /// holder seen is kept for the next busy answer.
    fn deliver(
        self: &Arc<Self>,
        claim: Claim<E>,
        slot: Arc<Slot<E::Name>>,
        result: Result<<E::Name as NameLock>::Lease, AcquireFailed>,
        owner: Option<String>,
        tx: oneshot::Sender<Result<Granted, AcquireFailed>>,
    ) {
        match result {
            Ok(lease) => {
                let ttl = claim.key.1;
                let granted = self.hold(claim, slot, lease, ttl, owner);
                let id = granted.lease;
                if self.closing.is_cancelled() {
                    // Won as the sidecar began shutting down: released with the rest.
                    self.stop(id, End::Shutdown);
                } else if tx.send(Ok(granted)).is_err() {
                    // Nobody to hand it to: release it at once.
                    self.stop(id, End::Released);
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
    pub(super) fn slot_unused(
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
}

/// The request's round on the nodes, its turn come: after a lease of this sidecar released
/// the name (see [`released_here`]), the engine's acquisition until `deadline`, the holder it
/// sees kept in the slot as it goes.
async fn round<N: NameLock>(
    slot: &Arc<Slot<N>>,
    deadline: Deadline,
    cancel: CancellationToken,
) -> Result<N::Lease, AcquireFailed> {
    if !released_here(slot, deadline, &cancel).await {
        return Err(AcquireFailed::Cancelled);
    }
    let seen = Arc::clone(slot);
    slot.lock
        .acquire(deadline, cancel, move |holder| {
            *seen.holder.lock().unwrap_or_else(|e| e.into_inner()) = holder;
        })
        .await
}

/// The request's answer from what its round sent; nothing sent (the round was cancelled, or
/// ended without a word) is a cancellation, or the shutdown when `closing`.
fn answer(
    sent: Result<Result<Granted, AcquireFailed>, oneshot::error::RecvError>,
    closing: bool,
) -> Result<Granted, Refused> {
    match sent {
        Ok(Ok(granted)) => Ok(granted),
        Ok(Err(AcquireFailed::Held { holder })) => Err(Refused::Held { holder }),
        Ok(Err(AcquireFailed::NoQuorum { kind })) => Err(Refused::NoQuorum { kind }),
        Ok(Err(AcquireFailed::Cancelled)) | Err(_) if closing => Err(Refused::ShuttingDown),
        Ok(Err(AcquireFailed::Cancelled)) | Err(_) => Err(Refused::Cancelled),
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

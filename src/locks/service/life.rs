//! A held lease's turns, decided at each wake-up: renewals, its end, the release of its keys,
//! and the one timer task that gives every lease its turn.

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tracing::warn;

use super::answers::{End, LeaseState};
use super::table::{Holding, Lease, Phase, Table, Turn};
use super::{Locks, REMEMBER_ENDED};
use crate::clock::{Clock, Deadline};
use crate::locks::engine::{EngineLease, ExtendFailed, LockEngine, NameLock};
use crate::locks::keepalive::Step;
use crate::locks::lease_id::LeaseId;

impl<E: LockEngine> Locks<E> {
    /// Something is due at `at`: the timer task wakes by then (started if it is not running).
    pub(super) fn timer_due(self: &Arc<Self>, table: &mut Table<E::Name>, at: Deadline) {
        if table.timer_due(at) {
            self.timer.notify_one();
        }
        self.start_timer(table);
    }

    /// Starts the timer task, once.
    pub(super) fn start_timer(self: &Arc<Self>, table: &mut Table<E::Name>) {
        if table.timer_running {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            table.timer_running = true;
            runtime.spawn(run_timer(Arc::downgrade(self), Arc::clone(&self.timer)));
        }
    }

    /// Gives lease `id` its turn: its task runs if it has something to do (or may have), else
    /// its next wake-up is set again; an ended lease past its memory is forgotten.
    pub(super) fn kick(self: &Arc<Self>, id: LeaseId) {
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
}

/// After this many leases ended, the memory their renewals and releases used is given back
/// to the system (see `give_back_memory`).
pub const TRIM_AFTER_ENDINGS: usize = 256;
/// At most this often.
pub const TRIM_AT_MOST_EVERY: Duration = Duration::from_secs(10);

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

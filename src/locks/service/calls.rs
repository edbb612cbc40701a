//! The app's calls on a lease (keepalive, release, watch), Dapr's unlock, and the shutdown
//! that releases every lease.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::watch;
use tracing::info;

use super::answers::{End, Found, Granted, LeaseState, Unlock};
use super::table::{Lease, Phase};
use super::{Locks, MAX_WATCHES, RELEASE_ANSWER_WITHIN};
use crate::clock::{self, Deadline};
use crate::locks::bounds::MIN_TTL;
use crate::locks::engine::{LockEngine, NameLock};
use crate::locks::lease_id::LeaseId;

impl<E: LockEngine> Locks<E> {
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
    pub(super) fn stop(self: &Arc<Self>, id: LeaseId, why: End) -> Option<Arc<Lease>> {
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
        let Ok(lock) = self.engine.open(name, MIN_TTL) else {
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

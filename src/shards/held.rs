//! The shards a member holds: one lease each on the process' engine, each driven by the lease
//! machine (`redlock::tenure`), renewed together so that the engine sends them in one batch
//! per node.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures_util::future::{join_all, BoxFuture};
use tracing::{info, warn};

use crate::clock::Deadline;
use crate::config::Renewal;
use crate::redlock::tenure::{Event, Failure, Policy, RenewFrom, Step, Tenure};
use crate::redlock::{Engine, Lease, LockError, NoObserver, Redlock, RedlockConfig};

use super::view::shard_lock;

/// One held shard.
struct Shard {
    redlock: Redlock,
    lease: Lease,
    tenure: Tenure,
    /// Being revoked: released at the app's acknowledgement or at this instant.
    revoke_by: Option<Deadline>,
    /// When it was taken, in takes by this member (the planner gives up the latest first).
    taken: u64,
}

/// What the app sees of a held shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owned {
    /// The shard's fencing token (its epoch): above every earlier owner's.
    pub token: u64,
    /// When this member stops acting on it unless a renewal moves it on.
    pub step_down_at: Deadline,
    /// Being revoked: the app stops acting on it by this instant (or acknowledges sooner).
    pub revoke_by: Option<Deadline>,
}

/// The held shards.
pub struct Held {
    engine: Engine,
    /// The group lock's config: each shard's is the same under the shard's name.
    cfg: RedlockConfig,
    policy: Policy,
    shards: BTreeMap<u32, Shard>,
    /// Shards taken so far.
    takes: u64,
}

impl Held {
    /// No shard yet, on `engine`, for the group lock `cfg`, renewed at `renewal`'s cadence.
    pub fn new(engine: Engine, cfg: RedlockConfig, renewal: &Renewal) -> Held {
        Held {
            engine,
            cfg,
            policy: Policy {
                // Renewed together: each next renewal counted from the batch's end.
                renew_from: RenewFrom::End,
                ..crate::lease::policy(renewal)
            },
            shards: BTreeMap::new(),
            takes: 0,
        }
    }

    /// Whether `shard` is held.
    pub fn holds(&self, shard: u32) -> bool {
        self.shards.contains_key(&shard)
    }

    /// When `shard` was taken, in takes by this member (0: not held).
    pub fn taken(&self, shard: u32) -> u64 {
        self.shards.get(&shard).map_or(0, |s| s.taken)
    }

    /// The held shards, as the app sees them.
    pub fn owned(&self) -> BTreeMap<u32, Owned> {
        self.shards
            .iter()
            .map(|(&id, shard)| {
                let owned = Owned {
                    token: shard.lease.fencing_token,
                    step_down_at: shard.tenure.step_down_at(),
                    revoke_by: shard.revoke_by,
                };
                (id, owned)
            })
            .collect()
    }

    /// How many are held.
    pub fn count(&self) -> usize {
        self.shards.len()
    }

    /// The next instant a held shard needs a renewal, a step-down or its release.
    pub fn next_due(&self) -> Option<Deadline> {
        let tenures = self.shards.values().map(|s| s.tenure.poll_timeout()).min();
        tenures.into_iter().chain(self.next_revoke()).min()
    }

    /// Drops every shard whose lease machine says to step down at `now` (no I/O); the shards
    /// dropped.
    pub fn step_down_due(&mut self, now: Deadline) -> Vec<u32> {
        let due: Vec<(u32, &'static str)> = self
            .shards
            .iter()
            .filter_map(|(&id, s)| match s.tenure.poll(now) {
                Step::StepDown(why) => Some((id, why.as_str())),
                _ => None,
            })
            .collect();
        for (id, reason) in &due {
            self.shards.remove(id);
            warn!(
                shard = id,
                reason, "shard lost: its lease could not be renewed"
            );
        }
        due.into_iter().map(|(id, _)| id).collect()
    }

    /// Once any shard is due at `now`, the renewal of every held shard at once, so in one
    /// batch per node: shards taken in different cycles fall into step, and a member sends each
    /// node one renewal per renew interval whatever it holds. The future owns what it needs:
    /// the loop goes on (cycles, step-downs, shutdown) while it waits in the engine's batch;
    /// [`Held::apply`] takes its result.
    pub fn renewal(&self, now: Deadline) -> Option<BoxFuture<'static, Renewed>> {
        if !self
            .shards
            .values()
            .any(|s| s.tenure.poll(now) == Step::Renew)
        {
            return None;
        }
        let leases: Vec<(u32, Redlock, Lease)> = self
            .shards
            .iter()
            .filter(|(_, s)| matches!(s.tenure.poll(now), Step::Renew | Step::WaitUntil(_)))
            .map(|(&id, s)| (id, s.redlock.clone(), s.lease.clone()))
            .collect();
        Some(Box::pin(async move {
            let started = Deadline::now();
            let rounds = leases
                .iter()
                .map(|(_, redlock, lease)| redlock.extend(lease));
            let results = join_all(rounds).await;
            let renewed = leases
                .iter()
                .zip(results)
                .map(|((id, _, lease), result)| (*id, lease.fencing_token, result))
                .collect();
            Renewed {
                started,
                ended: Deadline::now(),
                renewed,
            }
        }))
    }

    /// Takes a renewal's results into account, for the shards still held under the same lease.
    pub fn apply(&mut self, renewal: Renewed) {
        let Renewed {
            started,
            ended,
            renewed,
        } = renewal;
        for (id, token, result) in renewed {
            let Some(shard) = self.shards.get_mut(&id) else {
                continue;
            };
            if shard.lease.fencing_token != token {
                continue;
            }
            let event = match result {
                Ok(lease) => {
                    let valid_until = lease.valid_until;
                    shard.lease = lease;
                    Event::Renewed {
                        started,
                        ended,
                        valid_until,
                    }
                }
                Err(err) => Event::RenewFailed {
                    at: ended,
                    failure: match err {
                        LockError::Expired { .. } => Failure::Expired,
                        LockError::Superseded { .. } => Failure::Superseded,
                        _ => Failure::Retry,
                    },
                },
            };
            shard.tenure.handle(event);
        }
    }

    /// The next instant a held shard must step down or be released.
    pub fn next_step_down(&self) -> Option<Deadline> {
        let tenures = self.shards.values().map(|s| s.tenure.step_down_at()).min();
        tenures.into_iter().chain(self.next_revoke()).min()
    }

    /// Tries to take every shard of `take` at once; the shards won.
    pub async fn take(&mut self, take: &[u32]) -> Vec<u32> {
        let attempts = take.iter().map(|&id| {
            let mut cfg = self.cfg.clone();
            cfg.lock = shard_lock(&self.cfg.lock, id);
            let engine = self.engine.clone();
            async move {
                let redlock = Redlock::on(&engine, cfg, Arc::new(NoObserver)).ok()?;
                let lease = redlock.try_acquire().await.ok()?;
                Some((id, redlock, lease))
            }
        });
        let mut won = Vec::new();
        for (id, redlock, lease) in join_all(attempts).await.into_iter().flatten() {
            self.takes += 1;
            let tenure = Tenure::new(self.policy, lease.acquired_at, lease.valid_until);
            info!(
                shard = id,
                fencing_token = lease.fencing_token,
                "shard taken"
            );
            self.shards.insert(
                id,
                Shard {
                    redlock,
                    lease,
                    tenure,
                    revoke_by: None,
                    taken: self.takes,
                },
            );
            won.push(id);
        }
        won
    }

    /// Starts revoking every held shard of `ids` not yet revoked: each is released at the app's
    /// acknowledgement or at `by`, or at its step-down instant if that comes first.
    pub fn revoke(&mut self, ids: &[u32], by: Deadline) {
        for id in ids {
            if let Some(shard) = self.shards.get_mut(id) {
                let by = by.min(shard.tenure.step_down_at());
                shard.revoke_by = Some(shard.revoke_by.map_or(by, |was| was.min(by)));
            }
        }
    }

    /// Whether a shard is being revoked.
    pub fn revoking(&self) -> bool {
        self.shards.values().any(|s| s.revoke_by.is_some())
    }

    /// The next instant a revoked shard is due to be released.
    pub fn next_revoke(&self) -> Option<Deadline> {
        self.shards.values().filter_map(|s| s.revoke_by).min()
    }

    /// Stops holding the revoked shards the app acknowledged (`acked`) and those due at `now`;
    /// every revoked shard once the app no longer `acknowledges`.
    pub fn revoked(
        &mut self,
        now: Deadline,
        acked: &BTreeSet<u32>,
        acknowledges: bool,
    ) -> Released {
        let done: Vec<u32> = self
            .shards
            .iter()
            .filter(|(id, s)| {
                s.revoke_by
                    .is_some_and(|by| by <= now || acked.contains(id) || !acknowledges)
            })
            .map(|(&id, _)| id)
            .collect();
        self.forget(&done)
    }

    /// Stops holding every shard of `release` (the app is told before the keys go: see
    /// [`Released::release`]).
    pub fn forget(&mut self, release: &[u32]) -> Released {
        Released(
            release
                .iter()
                .filter_map(|id| Some((*id, self.shards.remove(id)?)))
                .collect(),
        )
    }

    /// Every held shard's id.
    pub fn ids(&self) -> Vec<u32> {
        self.shards.keys().copied().collect()
    }
}

/// A renewal of held shards: when it ran, and each shard's result (with its lease's token).
pub struct Renewed {
    started: Deadline,
    ended: Deadline,
    renewed: Vec<(u32, u64, Result<Lease, LockError>)>,
}

/// Shards no longer held whose keys are still to be released.
pub struct Released(Vec<(u32, Shard)>);

impl Released {
    /// Releases them all at once, whatever the nodes answer.
    pub async fn release(self) {
        let deleted = join_all(self.0.iter().map(|(_, s)| s.redlock.release(&s.lease))).await;
        for ((id, _), nodes) in self.0.iter().zip(deleted) {
            info!(shard = id, nodes, "shard released");
        }
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.0.len()
    }
}

//! The leadership loop: acquire, renew, step down before the lock can expire, contend again.
//!
//! ## Behaviour
//! - Waits for the lock (see `redlock::standby`); every round, every read of the nodes that
//!   shows a holder on a quorum, and every pushed release or acquisition refreshes the
//!   follower's view of the holder, stamped with when it was learnt.
//! - The lease's timing is the lease machine's (`redlock::tenure`, with [`policy`]); this loop
//!   only waits, renews and reports what happened.
//! - While holding, extends every renew interval. A failed extend is retried quickly;
//!   leadership is given up at `valid_until − safety margin` at the latest, before the key
//!   can expire on any node. Losing is never fatal: the loop steps down, lets the lost
//!   lease's validity run out (below) and contends again.
//! - **Contrary evidence.** An extend that finds a quorum of nodes holding another value or
//!   no key ends leadership at once (reason `superseded`): no retry can bring the lease back.
//! - **A lost lease keeps its promise.** Whatever ended it, the nodes we still hold are
//!   released only once the validity last published has run out: an app may act on
//!   `validity_ms` until then, so nobody else may lead before. Only SIGTERM, a resign and an
//!   app unready for `--app-unready-after` (see `candidacy`) release at once.
//! - **Candidacy.** The loop contends only while [`Candidacy::may_contend`] and leads only while
//!   [`Candidacy::may_lead`]; a wait or a tenure that stops being allowed ends as on SIGTERM
//!   (a round in flight is finished, a lock won meanwhile is released unpublished), and the
//!   loop waits until it may contend again.
//! - All deadlines are on [`clock`]: a host suspend counts against them, so a resumed
//!   process never believes it still leads.
//! - **Pause detection.** If the task wakes much later than scheduled (process paused,
//!   CPU-starved), the lease is suspect: it is kept only if an extend proves it is still
//!   held, within its validity. Readers never rely on this task being awake: they compare
//!   `step_down_at` with the clock themselves ([`Leadership::leading_at`]).
//! - On cancellation (SIGTERM), stops claiming leadership first, then releases the lock on
//!   every node (owner-checked) and announces the release so a standby takes over at once.
//!   A round is never abandoned half-way: one that wins after the signal is released without
//!   ever being published (no 200 on `/leader`, no pod label, no event).

use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::candidacy::{self, Candidacy, CandidacyRx};
use crate::clock::{self, Deadline};
use crate::config::Renewal;
use crate::leadership::{HolderView, Leadership, LeadershipTx, Role, Term};
use crate::metrics::Metrics;
use crate::redlock::tenure::{Event, Failure, Policy, RenewFrom, Step, Tenure};
use crate::redlock::{HolderSeen, Lease, LockError, Redlock};

/// Why [`hold`] returned.
#[derive(Debug)]
pub enum HoldEnd {
    /// The caller cancelled; the lease may still be valid and should be released.
    Cancelled(Lease),
    /// Leadership was given up; the reason is one of `metrics::LOST_REASONS`.
    Lost(&'static str, Lease),
}

/// The leadership lock's timing, for the lease machine (`redlock::tenure`): renew every
/// `--renew-interval` from the round's start; retry a failed renewal after an eighth of it
/// (20–500 ms); step down `--safety-margin` before the validity ends; a wake-up half an
/// interval late (at least 100 ms) means the process was paused or starved.
pub fn policy(renewal: &Renewal) -> Policy {
    Policy {
        renew_every: renewal.interval,
        renew_from: RenewFrom::Start,
        retry_after: (renewal.interval / 8)
            .clamp(Duration::from_millis(20), Duration::from_millis(500)),
        step_down_before: renewal.safety_margin,
        pause_after: Some((renewal.interval / 2).max(Duration::from_millis(100))),
    }
}

/// The moment to stop claiming a lease (the lease machine's: see `redlock::tenure`).
pub fn step_down_at(lease: &Lease, renewal: &Renewal) -> Deadline {
    Tenure::new(policy(renewal), lease.acquired_at, lease.valid_until).step_down_at()
}

/// Publishes `lease` as this process' tenure.
pub fn publish_leader(tx: &LeadershipTx, lease: &Lease, renewal: &Renewal) {
    tx.send_modify(|state| {
        state.role = Role::Leader(Term {
            fencing_token: lease.fencing_token,
            since: lease.since,
            step_down_at: step_down_at(lease, renewal),
            valid_until: lease.valid_until,
        });
        state.holder = Some(HolderView {
            identity: state.identity.clone(),
            fencing_token: Some(lease.fencing_token),
            observed_at: SystemTime::now(),
        });
        state.quorum_reachable = true;
    });
}

/// Publishes that this process does not lead (any more).
pub fn publish_follower(tx: &LeadershipTx) {
    tx.send_if_modified(|state| {
        let was_leader = matches!(state.role, Role::Leader(_));
        state.role = Role::Follower;
        if was_leader {
            state.holder = None;
        }
        was_leader
    });
}

/// The metric label for an acquisition outcome.
pub fn attempt_label(result: &Result<Lease, LockError>) -> &'static str {
    match result {
        Ok(_) => "acquired",
        Err(err) => match err.kind() {
            kind @ ("busy" | "no_quorum" | "expired") => kind,
            _ => "error",
        },
    }
}

/// Records an acquisition attempt: metrics and the follower's view of the holder.
pub fn observe_attempt(
    tx: &LeadershipTx,
    metrics: &Metrics,
    result: &Result<Lease, LockError>,
    elapsed: Duration,
) {
    metrics.acquire_attempt(attempt_label(result), elapsed);
    tx.send_modify(|state| match result {
        Err(LockError::Busy {
            holder,
            holder_fence,
            ..
        }) => {
            state.quorum_reachable = true;
            state.holder = holder.as_ref().map(|identity| HolderView {
                identity: identity.clone(),
                fencing_token: Some(*holder_fence),
                observed_at: SystemTime::now(),
            });
        }
        Err(LockError::QuorumUnreachable { .. }) => state.quorum_reachable = false,
        _ => {}
    });
}

/// Records a holder learnt between rounds (a push or a read of the nodes): the follower's
/// view of the holder, stamped with the time it was learnt. `None`: released.
pub fn observe_holder(tx: &LeadershipTx, seen: Option<HolderSeen>) {
    tx.send_modify(|state| {
        if matches!(state.role, Role::Leader(_)) {
            return;
        }
        state.holder = seen.map(|seen| {
            // A read does not show the fencing token: keep the one known for the same holder.
            let known = state
                .holder
                .as_ref()
                .filter(|h| h.identity == seen.identity)
                .and_then(|h| h.fencing_token);
            HolderView {
                identity: seen.identity,
                fencing_token: seen.fencing_token.or(known),
                observed_at: SystemTime::now(),
            }
        });
    });
}

/// Keeps `lease` renewed and published until `cancel` fires or the lease is given up.
pub async fn hold(
    redlock: &Redlock,
    mut lease: Lease,
    renewal: Renewal,
    tx: &LeadershipTx,
    metrics: &Metrics,
    cancel: &CancellationToken,
) -> HoldEnd {
    publish_leader(tx, &lease, &renewal);
    // The first renewal counts from the start of the round that won, as later ones count
    // from theirs.
    let mut tenure = Tenure::new(policy(&renewal), lease.acquired_at, lease.valid_until);
    loop {
        let wake = tenure.poll_timeout();
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return HoldEnd::Cancelled(lease),
            _ = clock::sleep_until_deadline(wake) => {}
        }
        let now = Deadline::now();
        metrics.renew_lag(now.saturating_duration_since(wake));
        tenure.handle(Event::Woke {
            at: now,
            scheduled: wake,
        });
        match tenure.poll(now) {
            Step::StepDown(why) => return HoldEnd::Lost(why.as_str(), lease),
            Step::WaitUntil(_) => continue,
            Step::Renew => {}
        }
        let started = Deadline::now();
        let result = redlock.extend(&lease).await;
        let ended = Deadline::now();
        metrics.renewal(result.is_ok(), ended.saturating_duration_since(started));
        let failure = match result {
            Ok(renewed) => {
                lease = renewed;
                tenure.handle(Event::Renewed {
                    started,
                    ended,
                    valid_until: lease.valid_until,
                });
                publish_leader(tx, &lease, &renewal);
                continue;
            }
            Err(err) => {
                let failure = match err {
                    LockError::Expired { .. } => Failure::Expired,
                    LockError::Superseded { .. } => Failure::Superseded,
                    _ => Failure::Retry,
                };
                if tenure.suspect() {
                    warn!(lock = %redlock.config().lock, error = %err, "woke up late and could not prove the lock is still held");
                } else if failure == Failure::Superseded {
                    warn!(lock = %redlock.config().lock, error = %err, "a quorum shows the lock is no longer ours");
                } else if failure == Failure::Retry {
                    warn!(lock = %redlock.config().lock, error = %err, "renewal failed; retrying");
                }
                failure
            }
        };
        tenure.handle(Event::RenewFailed { at: ended, failure });
    }
}

/// The `run` loop: contend while `candidacy` allows, hold, step down and contend again, until
/// `cancel`. On cancellation it steps down and releases the lock before returning.
pub async fn run(
    redlock: Redlock,
    renewal: Renewal,
    tx: LeadershipTx,
    metrics: std::sync::Arc<Metrics>,
    mut candidacy: CandidacyRx,
    cancel: CancellationToken,
) {
    let lock = redlock.config().lock.clone();
    loop {
        if !candidacy.borrow().may_contend(Deadline::now()) {
            info!(lock = %lock, why = candidacy.borrow().why_not(Deadline::now()), "not contending");
        }
        if !candidacy::until(&mut candidacy, &cancel, Candidacy::may_contend).await {
            return;
        }
        // The wait ends on cancellation or when the app stops being fit to lead; a round in
        // flight is finished first (the engine never abandons one half-way).
        let unfit = cancel.child_token();
        let acquire = redlock.acquire_watching(
            None,
            &unfit,
            |result, elapsed| observe_attempt(&tx, &metrics, result, elapsed),
            |seen| observe_holder(&tx, seen),
        );
        let acquired = while_fit(acquire, &mut candidacy, &unfit, Candidacy::may_contend).await;
        let lease = match acquired {
            Ok(lease) => lease,
            // Only cancellation ends an unbounded wait: shutdown, or the app became unfit.
            Err(_) if cancel.is_cancelled() => return,
            Err(_) => continue,
        };
        if !may_lead_won(&redlock, &lease, &candidacy, &cancel).await {
            if cancel.is_cancelled() {
                return;
            }
            continue;
        }
        info!(
            lock = %lock,
            fencing_token = lease.fencing_token,
            validity_ms = lease.remaining_at(Deadline::now()).as_millis() as u64,
            "acquired the lock"
        );
        let unfit = cancel.child_token();
        let hold = hold(&redlock, lease, renewal, &tx, &metrics, &unfit);
        let held = while_fit(hold, &mut candidacy, &unfit, Candidacy::may_lead).await;
        end_tenure(&redlock, held, &tx, &metrics, &candidacy, &cancel).await;
        if cancel.is_cancelled() {
            return;
        }
    }
}

/// Whether a lease the round just won may be led: not when shutdown began or the sidecar
/// stopped contending while the round was in flight; it is then released unpublished (a
/// process going away must never be seen leading).
async fn may_lead_won(
    redlock: &Redlock,
    lease: &Lease,
    candidacy: &CandidacyRx,
    cancel: &CancellationToken,
) -> bool {
    let lock = &redlock.config().lock;
    if cancel.is_cancelled() {
        info!(
            lock = %lock,
            fencing_token = lease.fencing_token,
            "won the lock after shutdown began; releasing it without leading"
        );
    } else if !candidacy.borrow().may_contend(Deadline::now()) {
        info!(lock = %lock, fencing_token = lease.fencing_token, why = candidacy.borrow().why_not(Deadline::now()), "won the lock as this sidecar stopped contending; releasing it without leading");
    } else {
        return true;
    }
    release(redlock, lease).await;
    false
}

/// Steps down after a tenure and releases the lock: at once when the tenure was cancelled
/// (shutdown, or the app no longer fit to lead); after a loss, once the validity the app was
/// told has passed (what we still hold keeps the lock from anyone else until then, and a
/// node of our last quorum that lost our key since does not vote before then either, see
/// `redlock::votes`), or at once when shutdown begins (the app is stopped first).
async fn end_tenure(
    redlock: &Redlock,
    held: HoldEnd,
    tx: &LeadershipTx,
    metrics: &Metrics,
    candidacy: &CandidacyRx,
    cancel: &CancellationToken,
) {
    let lock = &redlock.config().lock;
    publish_follower(tx);
    let lease = match held {
        HoldEnd::Cancelled(lease) => {
            if cancel.is_cancelled() {
                info!(lock = %lock, fencing_token = lease.fencing_token, "stepped down for shutdown; releasing the lock");
            } else {
                let why = candidacy.borrow().why_not(Deadline::now());
                warn!(lock = %lock, fencing_token = lease.fencing_token, why, "stepping down and releasing the lock at once");
            }
            lease
        }
        HoldEnd::Lost(reason, lease) => {
            metrics.lock_lost(reason);
            warn!(lock = %lock, fencing_token = lease.fencing_token, reason, "stepped down: lock lost");
            tokio::select! {
                biased;
                _ = cancel.cancelled() => {}
                _ = clock::sleep_until_deadline(lease.valid_until) => {}
            }
            lease
        }
    };
    // Owner-checked, so harmless if someone else holds it now.
    release(redlock, &lease).await;
}

/// Runs `work` to its end, cancelling `unfit` (which `work` must watch) as soon as `verdict`
/// stops holding: `work` is never dropped half-way, it ends on its own terms.
async fn while_fit<T>(
    work: impl std::future::Future<Output = T>,
    candidacy: &mut CandidacyRx,
    unfit: &CancellationToken,
    verdict: fn(&Candidacy, Deadline) -> bool,
) -> T {
    let watch = async {
        if candidacy::until(candidacy, unfit, |c, now| !verdict(c, now)).await {
            unfit.cancel();
        }
        std::future::pending::<()>().await
    };
    tokio::pin!(work, watch);
    loop {
        tokio::select! {
            out = &mut work => return out,
            () = &mut watch => {}
        }
    }
}

/// Releases `lease` on every node (owner-checked, announced to waiters) and logs how many
/// nodes still held it.
pub async fn release(redlock: &Redlock, lease: &Lease) {
    let released = redlock.release(lease).await;
    info!(lock = %redlock.config().lock, fencing_token = lease.fencing_token, nodes = released, "released the lock");
}

/// The lock `cfg` names on connections of its own (guard's one lock), reporting to a fresh
/// metrics registry (which also carries the Kubernetes error family, when given).
pub fn instrumented_engine(
    cfg: &crate::redlock::RedlockConfig,
    kube_errors: Option<prometheus::IntCounterVec>,
) -> Result<(Redlock, std::sync::Arc<Metrics>), crate::redlock::ConfigError> {
    let metrics = metrics_for(cfg, kube_errors);
    let redlock = Redlock::new(cfg.clone(), metrics.clone())?;
    Ok((redlock, metrics))
}

/// [`instrumented_engine`] on the connections of `engine`, shared with every other lock of
/// the process (`run`'s leadership beside the request locks), renewing on its own.
pub fn instrumented_lock_on(
    engine: &crate::redlock::Engine,
    cfg: &crate::redlock::RedlockConfig,
    kube_errors: Option<prometheus::IntCounterVec>,
) -> Result<(Redlock, std::sync::Arc<Metrics>), crate::redlock::ConfigError> {
    let metrics = metrics_for(cfg, kube_errors);
    let redlock = Redlock::on_unbatched(engine, cfg.clone(), metrics.clone())?;
    Ok((redlock, metrics))
}

fn metrics_for(
    cfg: &crate::redlock::RedlockConfig,
    kube_errors: Option<prometheus::IntCounterVec>,
) -> std::sync::Arc<Metrics> {
    let labels: Vec<String> = cfg.nodes.iter().map(|n| n.label().to_owned()).collect();
    Metrics::new(&cfg.lock, &labels, kube_errors)
}

/// A fresh leadership channel for `redlock`'s lock and identity.
pub fn channel(redlock: &Redlock) -> (LeadershipTx, crate::leadership::LeadershipRx) {
    let cfg = redlock.config();
    tokio::sync::watch::channel(Leadership::new(cfg.lock.clone(), cfg.identity.clone()))
}

//! Taking the lock before CMD starts: wait up to `--wait` unless a signal comes first, and
//! turn every way of not getting it into the run's outcome.

use futures_util::FutureExt;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use super::outcome::{Kind, Outcome};
use super::report::Report;
use super::signals::Signals;
use crate::clock::Deadline;
use crate::config::{GuardConfig, OnBusy};
use crate::exit;
use crate::leadership::LeadershipTx;
use crate::lease;
use crate::redlock::{Lease, Redlock};

/// The lease, or the outcome of a run that will not start CMD.
pub async fn acquire(
    cfg: &GuardConfig,
    redlock: &Redlock,
    tx: &LeadershipTx,
    signals: &mut Signals,
    report: &Report,
) -> Result<Lease, Outcome> {
    let lock = &cfg.redlock.lock;
    // A round in flight is finished (the engine never abandons one half-way), so a lock won
    // as a signal comes is released below.
    let interrupt = CancellationToken::new();
    let deadline = Deadline::now() + cfg.wait;
    let mut interrupted = None;
    let acquired = {
        let metrics = report.metrics();
        let acquire = redlock.acquire_watching(
            Some(deadline),
            &interrupt,
            |result, elapsed| lease::observe_attempt(tx, metrics, result, elapsed),
            |seen| lease::observe_holder(tx, seen),
        );
        tokio::pin!(acquire);
        loop {
            tokio::select! {
                biased;
                result = &mut acquire => break result,
                sig = signals.recv(), if interrupted.is_none() => {
                    interrupted = Some(sig);
                    interrupt.cancel();
                }
            }
        }
    };
    // A signal that came with the round's answers still counts as before CMD started.
    if let Some(sig) = interrupted.or_else(|| signals.recv().now_or_never()) {
        info!(signal = sig, lock = %lock, "signal before CMD started; not running CMD");
        let token = match &acquired {
            Ok(lease) => {
                lease::release(redlock, lease).await;
                Some(lease.fencing_token)
            }
            Err(_) => None,
        };
        return Err(Outcome {
            kind: Kind::NotStarted,
            exit_code: exit::killed_by(sig),
            fencing_token: token,
        });
    }
    match acquired {
        Ok(lease) => Ok(lease),
        // Another contender of the lock on other nodes is as good as a holder: not ours to run.
        Err(err) if matches!(err.kind(), "busy" | "node_set_conflict") => {
            let skip = cfg.on_busy == OnBusy::Skip;
            info!(lock = %lock, error = %err, on_busy = if skip { "skip" } else { "fail" }, "lock busy; not running CMD");
            report.run("skipped");
            report
                .event("RunSkipped", &format!("lock {lock} is busy: {err}"), false)
                .await;
            Err(if skip {
                Outcome::without_lock(Kind::Skipped, 0)
            } else {
                Outcome::without_lock(Kind::Busy, exit::BUSY)
            })
        }
        Err(err) => {
            error!(lock = %lock, error = %err, "cannot take the lock");
            report.run("failed");
            Err(Outcome::without_lock(Kind::Unreachable, exit::UNREACHABLE))
        }
    }
}

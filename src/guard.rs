//! `guard`: run a command only while the lock is held.
//!
//! ## Behaviour
//! - Signal handlers (SIGTERM, SIGINT, SIGHUP, SIGQUIT) are installed before anything
//!   else. A signal before CMD starts (while waiting for the lock, or while a round takes
//!   it) ends the wait, releases the lock if it was taken, and exits 128+signal without
//!   running CMD. From the moment CMD is being started, signals are forwarded to CMD's
//!   process group (one that arrives while the supervisor starts CMD is delivered then).
//! - Takes the lock (waiting up to `--wait`); if it is busy, skips (exit 0) or fails
//!   (exit 75) as `--on-busy` says; without a quorum, exits 69. A round that nobody won
//!   (split votes among contenders) is not "busy", and a round left short of a quorum by
//!   timeouts or connection errors is not "unreachable": the engine retries both, also with
//!   `--wait 0`, for up to one ttl past the wait.
//! - `--slot ID`: a slot whose run already ended with CMD's exit 0 is skipped (exit 0,
//!   outcome `already-ran`); a run whose CMD exits 0 records its slot. A record that reached
//!   fewer than a quorum (the slot may run again) ends the run with exit 69, outcome
//!   `unrecorded`. See `slot`.
//! - Runs CMD without a shell in its own process group, below two small helper processes
//!   (guard → watchdog → supervisor → CMD, see [`supervisor`]), and renews the lock in the
//!   background. CMD's environment is guard's without any `REDLOCK_*` variable (guard's own
//!   settings, among them the Redis URLs and credentials), plus `REDLOCK_LOCK`,
//!   `REDLOCK_FENCING_TOKEN` and `REDLOCK_HOLDER`.
//! - **Self-fencing.** CMD's process group gets SIGTERM `--kill-grace` before the lease's
//!   step-down point and SIGKILL at it, both before the lock's validity ends. The schedule
//!   follows every renewal: each one publishes a later step-down point and moves both
//!   signals with it, so CMD runs for as long as renewals succeed, however long that is.
//!   Renewals that give up before (guard woke too late to prove it still holds the lock, or
//!   the lease ran out during a renewal) get CMD SIGTERM at once, SIGKILL `--kill-grace` later
//!   but never after the step-down point; a renewal that shows a quorum holding another
//!   value or no key (the lease is superseded) gets CMD SIGTERM and SIGKILL at once. guard
//!   then exits 76, also when a helper stopped CMD at those points because guard's own thread
//!   was late (stopped, blocked).
//! - **The whole tree dies by the lock's expiry under any single or double fault** of guard
//!   and its helpers (SIGSTOP or SIGKILL, any two of the three): guard and both helpers hold
//!   the SIGKILL point, are child subreapers, and kill every process below them at it, so the
//!   one still running is an ancestor of all of CMD's tree (processes that left its process
//!   group or session included). A helper kills everything below it at once when guard dies.
//!   What no process without privileges can do is in `docs/reference.md` (a triple fault, a
//!   process that changed user, one stuck in the kernel). Needs `/proc`: the helpers are
//!   started from `/proc/self/exe`, the tree is read from `/proc`.
//! - Orphans below guard and its helpers are reaped, so guard can be a container's PID 1.
//! - A stopped helper neither keeps the lock nor hides CMD's code: guard watches CMD itself
//!   (a pidfd), and a helper that has not ended a second after CMD did is killed.
//! - When CMD exits, whatever is left of its tree is killed, the lock is kept until
//!   `--min-hold` has passed since CMD started (a signal, forwarded to CMD before or
//!   received during the hold, cuts this short), then released;
//!   guard exits with CMD's code (128+signal if a signal killed it). A lock lost during
//!   `--min-hold` is logged, counted and reported as an Event; CMD's code stands.
//! - `--max-hold`, counted from CMD's start and of any length: CMD gets SIGTERM and renewals
//!   stop; SIGKILL follows `--kill-grace` later, never after the step-down point; exit 124.
//! - Whenever renewals end, not-leader is published (`/leader` 503,
//!   `redlock_is_leader` 0) before the lock is released.
//! - `--listen`: the admin endpoint (`/healthz`, `/leader`, `/metrics`) while guard runs,
//!   so a scrape of a running job sees `redlock_guard_runs_total` and the lock metrics.
//! - `--outcome-file`: one line at exit, see [`outcome`].
//!
//! Where: `acquire` takes the lock; `slot` checks and records `--slot`; `holder` starts CMD
//! (`children`, below the helpers of `supervisor`, which share guard's `fence` and read CMD's
//! `tree`) and carries out `schedule`, the pure decision of what to do next and when;
//! `report` counts and records how the run went.

mod acquire;
mod children;
mod fence;
mod holder;
pub mod outcome;
mod report;
mod schedule;
mod signals;
mod slot;
pub mod supervisor;
pub mod tree;

use tokio_util::sync::CancellationToken;

use crate::config::{self, GuardConfig, ReadyWhen};
use crate::http::{self, AdminState};
use crate::k8s::Kube;
use crate::lease;
use children::Children;
use outcome::Outcome;
use report::Report;
use signals::Signals;

/// Runs `cfg.command` under the lock; returns the process exit code.
pub async fn guard(cfg: GuardConfig) -> i32 {
    // First, so that no signal from now on can kill guard with the lock left behind.
    let mut signals = Signals::new();
    let mut children = Children::new();
    let outcome = run(&cfg, &mut signals, &mut children).await;
    if let Some(path) = &cfg.outcome_file {
        outcome.write(path, &cfg.redlock.lock);
    }
    outcome.exit_code
}

/// Takes the lock, runs CMD under it and releases it; every exit path returns its outcome.
async fn run(cfg: &GuardConfig, signals: &mut Signals, children: &mut Children) -> Outcome {
    // Kubernetes first: `--kubernetes on` outside a pod is refused before any node is contacted.
    let kube_errors = crate::k8s::errors_counter();
    let kube = match Kube::connect(cfg.kubernetes.clone(), kube_errors.clone()).await {
        Ok(kube) => kube,
        Err(err) => config::exit_invalid(&format!("--kubernetes: {err}")),
    };
    let (redlock, metrics) = lease::instrumented_engine(&cfg.redlock, Some(kube_errors))
        .unwrap_or_else(|err| config::exit_invalid(&err.to_string()));
    metrics.set_timing(
        cfg.redlock.ttl,
        cfg.renewal.interval,
        cfg.renewal.safety_margin,
    );
    tokio::spawn(crate::ops::warn_about_nodes(redlock.clone()));
    let (tx, rx) = lease::channel(&redlock);
    // Observers of the one leadership state, as in `run`: the admin endpoint and the metrics.
    let admin_stop = CancellationToken::new();
    let _stop_admin_on_exit = admin_stop.clone().drop_guard();
    if let Some(addr) = cfg.listen {
        let listener = match http::bind(addr).await {
            Ok(listener) => listener,
            Err(err) => config::exit_invalid(&format!("--listen: cannot bind {addr}: {err}")),
        };
        let admin = AdminState {
            leadership: rx.clone(),
            metrics: metrics.clone(),
            ready_when: ReadyWhen::Leader,
            shutdown: admin_stop.clone(),
        };
        tokio::spawn(http::serve(listener, admin));
    }
    tokio::spawn(metrics.clone().follow(rx.clone()));
    let mut report = Report::new(metrics, kube, &cfg.redlock.lock);

    let lease = match acquire::acquire(cfg, &redlock, &tx, signals, &report).await {
        Ok(lease) => lease,
        Err(outcome) => return outcome,
    };
    if let Some(slot) = &cfg.slot {
        if let Err(outcome) = slot::check(cfg, slot, &redlock, &lease, &report).await {
            return outcome;
        }
    }
    holder::run_cmd(
        cfg,
        &redlock,
        lease,
        (tx, rx),
        signals,
        children,
        &mut report,
    )
    .await
}

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
//!   (split votes among contenders) is not "busy": the engine retries it.
//! - Runs CMD without a shell in its own process group, with `REDLOCK_LOCK`,
//!   `REDLOCK_FENCING_TOKEN` and `REDLOCK_HOLDER` in its environment, below a small
//!   supervisor process ([`supervisor`]), and renews the lock in the background.
//! - **Self-fencing.** CMD's process group gets SIGTERM `--kill-grace` before the lease's
//!   step-down point, and SIGKILL at it, unless a renewal moved that point; both come
//!   before the lock's validity ends. A renewal that shows a quorum holding another value
//!   or no key (the lease is superseded) gets CMD SIGTERM and SIGKILL at once. guard then
//!   exits 76.
//! - If guard itself dies (even by SIGKILL), the supervisor kills every process of
//!   CMD's tree, including those that left CMD's process group. Both need `/proc`: the
//!   supervisor is started from `/proc/self/exe`, the tree is read from `/proc`.
//! - guard and the supervisor are child subreapers: orphans below them are reaped, so
//!   guard can be a container's PID 1.
//! - When CMD exits, whatever is left of its tree is killed, the lock is kept until
//!   `--min-hold` has passed since CMD started (a signal, forwarded to CMD before or
//!   received during the hold, cuts this short), then released;
//!   guard exits with CMD's code (128+signal if a signal killed it). A lock lost during
//!   `--min-hold` is logged, counted and reported as an Event; CMD's code stands.
//! - `--max-hold`: renewals stop and CMD is stopped (SIGTERM, then SIGKILL); exit 124.
//! - Whenever renewals end, not-leader is published (`/leader` 503,
//!   `redlock_is_leader` 0) before the lock is released.
//! - `--listen`: the admin endpoint (`/healthz`, `/leader`, `/metrics`) while guard runs,
//!   so a scrape of a running job sees `redlock_guard_runs_total` and the lock metrics.
//! - `--outcome-file`: one line at exit, see [`outcome`].

mod children;
pub mod outcome;
pub mod supervisor;
pub mod tree;

use std::time::{Duration, Instant};

use futures_util::FutureExt;
use tokio::signal::unix::{signal, SignalKind};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::clock;
use crate::config::{GuardConfig, OnBusy, ReadyWhen};
use crate::http::{self, AdminState};
use crate::k8s::Kube;
use crate::leadership::Role;
use crate::lease::{self, HoldEnd};
use crate::metrics::Metrics;
use crate::redlock::{Lease, Redlock};
use children::Children;
use outcome::{Kind, Outcome};

/// Exit code: Redis quorum unreachable.
pub const EXIT_UNREACHABLE: i32 = 69;
/// Exit code: lock busy with `--on-busy fail`.
pub const EXIT_BUSY: i32 = 75;
/// Exit code: the lock was lost while CMD ran; CMD was stopped.
pub const EXIT_LOST: i32 = 76;
/// Exit code: `--max-hold` reached; CMD was stopped.
pub const EXIT_MAX_HOLD: i32 = 124;
/// Exit code: CMD could not be executed.
pub const EXIT_NOT_EXECUTABLE: i32 = 126;
/// Exit code: CMD not found.
pub const EXIT_NOT_FOUND: i32 = 127;

/// Why CMD is being stopped by guard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    LockLost,
    MaxHold,
}

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

async fn run(cfg: &GuardConfig, signals: &mut Signals, children: &mut Children) -> Outcome {
    // Kubernetes first: `--kubernetes on` outside a pod is refused before any node is contacted.
    let kube_errors = crate::k8s::errors_counter();
    let kube = match Kube::connect(cfg.kubernetes.clone(), kube_errors.clone()).await {
        Ok(kube) => kube,
        Err(err) => crate::config::exit_invalid(&format!("--kubernetes: {err}")),
    };
    let (redlock, metrics) = lease::instrumented_engine(&cfg.redlock, Some(kube_errors))
        .unwrap_or_else(|err| crate::config::exit_invalid(&err.to_string()));
    tokio::spawn(crate::ops::warn_about_nodes(redlock.clone()));
    let lock = cfg.redlock.lock.clone();
    let (tx, rx) = lease::channel(&redlock);
    let admin_stop = CancellationToken::new();
    let _stop_admin_on_exit = admin_stop.clone().drop_guard();
    if let Some(addr) = cfg.listen {
        let listener = match http::bind(addr).await {
            Ok(listener) => listener,
            Err(err) => {
                crate::config::exit_invalid(&format!("--listen: cannot bind {addr}: {err}"))
            }
        };
        let admin = AdminState {
            leadership: rx.clone(),
            metrics: metrics.clone(),
            ready_when: ReadyWhen::Leader,
            shutdown: admin_stop.clone(),
        };
        tokio::spawn(http::serve(listener, admin));
    }

    // Wait for the lock unless a signal comes first. A round in flight is finished (the
    // engine never abandons one half-way), so a won lock is released below.
    let interrupt = CancellationToken::new();
    let deadline = Instant::now() + cfg.wait;
    let mut interrupted = None;
    let acquired = {
        let acquire = redlock.acquire(Some(deadline), &interrupt, |result, elapsed| {
            lease::observe_attempt(&tx, &metrics, result, elapsed)
        });
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
    let interrupted = interrupted.or_else(|| signals.recv().now_or_never());
    if let Some(sig) = interrupted {
        info!(signal = sig, lock = %lock, "signal before CMD started; not running CMD");
        let token = match &acquired {
            Ok(lease) => {
                lease::release(&redlock, lease).await;
                Some(lease.fencing_token)
            }
            Err(_) => None,
        };
        return Outcome {
            kind: Kind::NotStarted,
            exit_code: 128 + sig,
            fencing_token: token,
        };
    }
    let lease = match acquired {
        Ok(lease) => lease,
        Err(err) if err.kind() == "busy" => {
            let skip = cfg.on_busy == OnBusy::Skip;
            info!(lock = %lock, error = %err, on_busy = if skip { "skip" } else { "fail" }, "lock busy; not running CMD");
            metrics.guard_run("skipped");
            event(
                &kube,
                "RunSkipped",
                &format!("lock {lock} is busy: {err}"),
                false,
            )
            .await;
            return if skip {
                Outcome::without_lock(Kind::Skipped, 0)
            } else {
                Outcome::without_lock(Kind::Busy, EXIT_BUSY)
            };
        }
        Err(err) => {
            error!(lock = %lock, error = %err, "cannot take the lock");
            metrics.guard_run("failed");
            return Outcome::without_lock(Kind::Unreachable, EXIT_UNREACHABLE);
        }
    };
    let token = lease.fencing_token;
    info!(lock = %lock, fencing_token = token, validity_ms = lease.remaining_at(clock::now()).as_millis() as u64, "acquired the lock; starting CMD");

    let cmd_pgid = match children.start(cfg, token, &redlock.config().identity).await {
        Ok(pid) => pid,
        Err(err) => {
            error!(command = %cfg.command[0], error = %err, "cannot start CMD");
            lease::release(&redlock, &lease).await;
            metrics.guard_run("failed");
            let code = if err.kind() == std::io::ErrorKind::NotFound {
                EXIT_NOT_FOUND
            } else {
                EXIT_NOT_EXECUTABLE
            };
            return Outcome {
                kind: Kind::NotStarted,
                exit_code: code,
                fencing_token: Some(token),
            };
        }
    };
    // Deadlines of the tenure are on the lease's clock, which counts host suspends.
    let started = clock::now();
    metrics.guard_run("ran");
    let mut cmd = CmdGroup {
        pgid: cmd_pgid,
        stopping: None,
        kill_at: None,
        kill_grace: cfg.kill_grace,
    };

    let stop_renewing = CancellationToken::new();
    let mut holder = Some(spawn_holder(
        &redlock,
        lease,
        cfg,
        tx,
        &metrics,
        &stop_renewing,
    ));
    let mut hold_end: Option<HoldEnd> = None;
    let mut loss = Loss { reason: None };
    // A signal forwarded to CMD asks the whole job to end: no --min-hold after it.
    let mut forwarded = None;
    let max_hold_at = cfg.max_hold.map(|d| started + d);
    let code = loop {
        let step_down_at = match &rx.borrow().role {
            Role::Leader(term) => Some(term.step_down_at),
            Role::Follower => None,
        };
        // Self-fencing schedule: SIGTERM kill_grace before step-down, SIGKILL at it. A
        // renewal moves step-down later; the timer then finds nothing due and sleeps again.
        let term_at = step_down_at.map(|at| at.checked_sub(cfg.kill_grace).unwrap_or(at));
        let next_timer = match cmd.stopping {
            Some(_) => cmd.kill_at,
            None => term_at.into_iter().chain(max_hold_at).min(),
        };
        tokio::select! {
            code = children.supervisor_exit() => break code,
            sig = signals.recv() => {
                info!(signal = sig, "forwarding signal to CMD");
                cmd.signal(sig);
                forwarded = Some(sig);
            }
            end = async { holder.as_mut().expect("polled only while running").await }, if holder.is_some() => {
                holder = None;
                let end = end.unwrap_or_else(|err| hold_task_failed(&err));
                if let HoldEnd::Lost(reason, lease) = &end {
                    loss.record(&metrics, &lock, reason);
                    warn!(lock = %lock, "stopping CMD: the lock was lost");
                    let step_down = lease::step_down_at(lease, &cfg.renewal);
                    cmd.stop(Stop::LockLost, clock::now(), Some(step_down));
                    if *reason == "superseded" {
                        // Proof that the lock is someone else's leaves no grace period.
                        warn!(lock = %lock, "the lock is someone else's: SIGKILL to CMD at once");
                        cmd.signal(libc::SIGKILL);
                        cmd.kill_at = None;
                    }
                }
                hold_end = Some(end);
            }
            _ = sleep_until(next_timer) => {
                let now = clock::now();
                if cmd.stopping.is_some() {
                    warn!("CMD still running; sending SIGKILL");
                    cmd.signal(libc::SIGKILL);
                    cmd.kill_at = None;
                } else if max_hold_at.is_some_and(|at| now >= at) {
                    info!(lock = %lock, "--max-hold reached; stopping CMD");
                    stop_renewing.cancel();
                    cmd.stop(Stop::MaxHold, now, step_down_at);
                } else if term_at.is_some_and(|at| now >= at) {
                    warn!(lock = %lock, "renewals could not keep the lock; stopping CMD before it expires");
                    loss.record(&metrics, &lock, "renew_failed");
                    cmd.stop(Stop::LockLost, now, step_down_at);
                }
            }
        }
    };
    // The supervisor killed what CMD left behind; if it was itself killed, orphans of
    // CMD's tree were re-parented to guard: nothing of CMD's may run on after the release.
    children.kill_all_below().await;

    info!(exit_code = code, "CMD exited");
    if let Some(sig) = forwarded.filter(|_| !cfg.min_hold.is_zero()) {
        info!(
            signal = sig,
            "CMD was signalled; releasing without waiting for --min-hold"
        );
    } else if cmd.stopping.is_none() {
        // Keep the lock for --min-hold after CMD started, still renewing.
        if let Some(running) = holder.as_mut() {
            tokio::select! {
                end = running => {
                    holder = None;
                    hold_end = Some(end.unwrap_or_else(|err| hold_task_failed(&err)));
                }
                _ = clock::sleep_until(started + cfg.min_hold) => {}
                sig = signals.recv() => info!(signal = sig, "signal during --min-hold; releasing now"),
            }
        }
    }
    stop_renewing.cancel();
    if let Some(running) = holder {
        hold_end = Some(running.await.unwrap_or_else(|err| hold_task_failed(&err)));
    }
    let lost_after_cmd = match &hold_end {
        Some(HoldEnd::Lost(reason, _)) if cmd.stopping.is_none() => {
            loss.record(&metrics, &lock, reason);
            true
        }
        _ => false,
    };
    // The hold task has published not-leader before returning.
    if let Some(HoldEnd::Cancelled(lease) | HoldEnd::Lost(_, lease)) = &hold_end {
        lease::release(&redlock, lease).await;
    }
    let held = |kind, exit_code| Outcome {
        kind,
        exit_code,
        fencing_token: Some(token),
    };
    match cmd.stopping {
        Some(Stop::LockLost) => {
            metrics.guard_run("lost");
            event(
                &kube,
                "LockLost",
                &format!("lock {lock} (fencing token {token}) was lost; CMD was stopped"),
                true,
            )
            .await;
            held(Kind::Lost, EXIT_LOST)
        }
        Some(Stop::MaxHold) => held(Kind::MaxHold, EXIT_MAX_HOLD),
        None => {
            if lost_after_cmd {
                warn!(lock = %lock, exit_code = code, "the lock was lost during --min-hold, after CMD finished; its exit code stands");
                metrics.guard_run("lost");
                event(
                    &kube,
                    "LockLost",
                    &format!("lock {lock} (fencing token {token}) was lost during --min-hold, after CMD finished (exit code {code})"),
                    true,
                )
                .await;
            }
            info!(lock = %lock, exit_code = code, "CMD finished");
            held(Kind::Ran, code)
        }
    }
}

/// Renews `lease` in the background; publishes not-leader as soon as renewals end.
/// Leadership is published before it returns, so the caller's first look at the channel
/// already has the step-down deadline its self-fencing timers need.
fn spawn_holder(
    redlock: &Redlock,
    lease: Lease,
    cfg: &GuardConfig,
    tx: crate::leadership::LeadershipTx,
    metrics: &std::sync::Arc<Metrics>,
    stop: &CancellationToken,
) -> JoinHandle<HoldEnd> {
    let (redlock, metrics, stop) = (redlock.clone(), metrics.clone(), stop.clone());
    let renewal = cfg.renewal;
    lease::publish_leader(&tx, &lease, &renewal);
    tokio::spawn(async move {
        let end = lease::hold(&redlock, lease, renewal, &tx, &metrics, &stop).await;
        lease::publish_follower(&tx);
        end
    })
}

/// The renewal task has no panicking paths; were one to panic, the lease is gone with
/// it, so guard stops as after a loss (CMD's tree dies with the supervisor).
fn hold_task_failed(err: &tokio::task::JoinError) -> HoldEnd {
    error!(error = %err, "the renewal task failed; the lock expires on its own");
    std::process::exit(EXIT_LOST)
}

/// Counts and logs a loss of the lock, once per run.
struct Loss {
    reason: Option<&'static str>,
}

impl Loss {
    fn record(&mut self, metrics: &Metrics, lock: &str, reason: &'static str) {
        if self.reason.is_none() {
            self.reason = Some(reason);
            metrics.lock_lost(reason);
            warn!(lock = %lock, reason, "lock lost");
        }
    }
}

/// CMD's process group and the state of stopping it.
struct CmdGroup {
    pgid: i32,
    /// Why CMD is being stopped, once it is.
    stopping: Option<Stop>,
    /// When SIGKILL is due; `None` before stopping and once it is sent.
    kill_at: Option<Instant>,
    kill_grace: Duration,
}

impl CmdGroup {
    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) with a negative pid signals the process group; no memory involved.
        // The group cannot be reused while the supervisor runs: it has not reaped CMD.
        unsafe { libc::kill(-self.pgid, sig) };
    }

    /// SIGTERM now, SIGKILL after the grace period but never after `step_down_at`.
    fn stop(&mut self, why: Stop, now: Instant, step_down_at: Option<Instant>) {
        if self.stopping.is_none() {
            self.signal(libc::SIGTERM);
            self.stopping = Some(why);
            self.kill_at = Some((now + self.kill_grace).min(step_down_at.unwrap_or(now)));
        }
    }
}

/// The signals guard handles: before CMD starts they stop guard, then they go to CMD.
struct Signals(Vec<(i32, tokio::signal::unix::Signal)>);

impl Signals {
    fn new() -> Signals {
        let kinds = [
            (libc::SIGTERM, SignalKind::terminate()),
            (libc::SIGINT, SignalKind::interrupt()),
            (libc::SIGHUP, SignalKind::hangup()),
            (libc::SIGQUIT, SignalKind::quit()),
        ];
        Signals(
            kinds
                .into_iter()
                .filter_map(|(num, kind)| signal(kind).ok().map(|s| (num, s)))
                .collect(),
        )
    }

    async fn recv(&mut self) -> i32 {
        if self.0.is_empty() {
            return std::future::pending().await;
        }
        let waits = self.0.iter_mut().map(|(num, s)| {
            let num = *num;
            Box::pin(async move {
                if s.recv().await.is_none() {
                    std::future::pending::<()>().await;
                }
                num
            })
        });
        futures_util::future::select_all(waits).await.0
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => clock::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn event(kube: &Option<Kube>, reason: &str, message: &str, warning: bool) {
    if let Some(kube) = kube {
        if let Err(err) = kube.event(reason, message, warning).await {
            warn!(reason, error = %err, "could not record a Kubernetes event");
        }
    }
}

//! `guard`: run a command only while the lock is held.
//!
//! ## Behaviour
//! - Takes the lock (waiting up to `--wait`); if it is busy, skips (exit 0) or fails
//!   (exit 75) as `--on-busy` says; without a quorum, exits 69.
//! - Runs CMD without a shell in its own process group, with `REDLOCK_LOCK`,
//!   `REDLOCK_FENCING_TOKEN` and `REDLOCK_HOLDER` in its environment, and renews the lock
//!   in the background.
//! - **Self-fencing.** CMD's process group gets SIGTERM `--kill-grace` before the lease's
//!   step-down point, and SIGKILL at it, unless a renewal moved that point; both come
//!   before the lock's validity ends. guard then exits 76.
//! - If guard itself dies, the kernel sends CMD SIGKILL (Linux parent-death signal).
//! - SIGTERM, SIGINT, SIGHUP and SIGQUIT are forwarded to CMD's process group.
//! - When CMD exits, leftovers in its process group are killed, the lock is kept until
//!   `--min-hold` has passed since CMD started, then released; guard exits with CMD's code
//!   (128+signal if a signal killed it).
//! - `--max-hold`: renewals stop and CMD is stopped (SIGTERM, then SIGKILL); exit 124.
//! - `--listen`: the admin endpoint (`/healthz`, `/leader`, `/metrics`) while guard runs,
//!   so a scrape of a running job sees `redlock_guard_runs_total` and the lock metrics.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::time::{Duration, Instant};

use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::{GuardConfig, OnBusy, ReadyWhen};
use crate::http::{self, AdminState};
use crate::k8s::{Kube, KubeMode, KubeSettings};
use crate::leadership::Role;
use crate::lease::{self, HoldEnd};
use crate::redlock::LockError;

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
    let (redlock, metrics) = lease::instrumented_engine(&cfg.redlock, None)
        .unwrap_or_else(|err| crate::config::exit_invalid(&err.to_string()));
    tokio::spawn(crate::ops::warn_about_nodes(redlock.clone()));
    let kube = events_client(&cfg).await;
    let lock = cfg.redlock.lock.clone();
    let (tx, mut rx) = lease::channel(&redlock);
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

    let never = CancellationToken::new();
    let deadline = Instant::now() + cfg.wait;
    let acquired = redlock
        .acquire(Some(deadline), &never, |result, elapsed| {
            lease::observe_attempt(&tx, &metrics, result, elapsed)
        })
        .await;
    let lease = match acquired {
        Ok(lease) => lease,
        Err(err @ LockError::Busy { .. }) => {
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
            return if skip { 0 } else { EXIT_BUSY };
        }
        Err(err) => {
            error!(lock = %lock, error = %err, "cannot take the lock");
            metrics.guard_run("failed");
            return EXIT_UNREACHABLE;
        }
    };
    let token = lease.fencing_token;
    info!(lock = %lock, fencing_token = token, validity_ms = lease.remaining_at(Instant::now()).as_millis() as u64, "acquired the lock; starting CMD");

    // Handlers first, so a signal sent right after CMD starts is forwarded, not fatal.
    let mut forwarded = Signals::new();
    let mut child = match spawn(&cfg, token, &redlock.config().identity) {
        Ok(child) => child,
        Err(err) => {
            error!(command = %cfg.command[0], error = %err, "cannot start CMD");
            redlock.release(&lease).await;
            metrics.guard_run("failed");
            return if err.kind() == std::io::ErrorKind::NotFound {
                EXIT_NOT_FOUND
            } else {
                EXIT_NOT_EXECUTABLE
            };
        }
    };
    let started = Instant::now();
    metrics.guard_run("ran");
    let mut cmd = CmdGroup {
        pgid: child.id().map(|pid| pid as i32),
        stopping: None,
        kill_at: None,
        kill_grace: cfg.kill_grace,
    };

    let stop_renewing = CancellationToken::new();
    let holder = {
        let (redlock, metrics, stop) = (redlock.clone(), metrics.clone(), stop_renewing.clone());
        let renewal = cfg.renewal;
        tokio::spawn(
            async move { lease::hold(&redlock, lease, renewal, &tx, &metrics, &stop).await },
        )
    };
    let mut holder = Some(holder);
    let mut hold_end: Option<HoldEnd> = None;

    let max_hold_at = cfg.max_hold.map(|d| started + d);
    let status = loop {
        let step_down_at = match &rx.borrow().role {
            Role::Leader(term) => Some(term.step_down_at),
            Role::Follower => None,
        };
        // Self-fencing schedule: SIGTERM kill_grace before step-down, SIGKILL at it.
        let next_timer = match cmd.stopping {
            Some(_) => cmd.kill_at,
            None => {
                let term_at = step_down_at.map(|at| at.checked_sub(cfg.kill_grace).unwrap_or(at));
                term_at.into_iter().chain(max_hold_at).min()
            }
        };
        tokio::select! {
            status = child.wait() => break status,
            sig = forwarded.recv() => {
                info!(signal = sig, "forwarding signal to CMD");
                cmd.signal(sig);
            }
            end = async { holder.as_mut().expect("polled only while running").await }, if holder.is_some() => {
                holder = None;
                let end = end.expect("hold task does not panic");
                if let HoldEnd::Lost(reason, _) = &end {
                    warn!(lock = %lock, reason, "lock lost while CMD runs; stopping CMD");
                    cmd.stop(Stop::LockLost, Instant::now(), step_down_at);
                }
                hold_end = Some(end);
            }
            _ = rx.changed() => {}
            _ = sleep_until(next_timer) => {
                let now = Instant::now();
                if cmd.stopping.is_some() {
                    warn!("CMD still running; sending SIGKILL");
                    cmd.signal(libc::SIGKILL);
                    cmd.kill_at = None;
                } else if max_hold_at.is_some_and(|at| now >= at) {
                    info!(lock = %lock, "--max-hold reached; stopping CMD");
                    stop_renewing.cancel();
                    cmd.stop(Stop::MaxHold, now, step_down_at);
                } else {
                    warn!(lock = %lock, "renewals could not keep the lock; stopping CMD before it expires");
                    cmd.stop(Stop::LockLost, now, step_down_at);
                }
            }
        }
    };
    // Nothing of CMD's may run on after the lock is released.
    cmd.signal(libc::SIGKILL);
    let code = match &status {
        Ok(status) => status
            .code()
            .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)),
        Err(err) => {
            error!(error = %err, "lost track of CMD");
            1
        }
    };

    if cmd.stopping.is_none() {
        // Keep the lock for --min-hold after CMD started, still renewing. A loss now is
        // logged by the hold task; CMD finished under the lock, so its code stands.
        if let Some(holder) = holder.as_mut() {
            tokio::select! {
                end = holder => hold_end = end.ok(),
                _ = tokio::time::sleep_until((started + cfg.min_hold).into()) => {}
            }
        }
    }
    stop_renewing.cancel();
    if let Some(holder) = holder {
        hold_end = holder.await.ok();
    }
    if let Some(HoldEnd::Cancelled(lease) | HoldEnd::Lost(_, lease)) = &hold_end {
        let released = redlock.release(lease).await;
        info!(lock = %lock, fencing_token = token, nodes = released, "released the lock");
    }
    let lost = cmd.stopping == Some(Stop::LockLost);
    if lost {
        metrics.guard_run("lost");
        event(
            &kube,
            "LockLost",
            &format!("lock {lock} (fencing token {token}) was lost; CMD was stopped"),
            true,
        )
        .await;
        return EXIT_LOST;
    }
    if cmd.stopping == Some(Stop::MaxHold) {
        return EXIT_MAX_HOLD;
    }
    info!(lock = %lock, exit_code = code, "CMD finished");
    code
}

/// CMD's process group and the state of stopping it.
struct CmdGroup {
    pgid: Option<i32>,
    /// Why CMD is being stopped, once it is.
    stopping: Option<Stop>,
    /// When SIGKILL is due; `None` before stopping and once it is sent.
    kill_at: Option<Instant>,
    kill_grace: Duration,
}

impl CmdGroup {
    fn signal(&self, sig: i32) {
        if let Some(pgid) = self.pgid {
            // SAFETY: kill(2) with a negative pid signals the process group; no memory involved.
            unsafe { libc::kill(-pgid, sig) };
        }
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

fn spawn(cfg: &GuardConfig, token: u64, identity: &str) -> std::io::Result<tokio::process::Child> {
    let mut command = std::process::Command::new(&cfg.command[0]);
    command
        .args(&cfg.command[1..])
        .env("REDLOCK_LOCK", &cfg.redlock.lock)
        .env("REDLOCK_FENCING_TOKEN", token.to_string())
        .env("REDLOCK_HOLDER", identity)
        .process_group(0);
    // SAFETY: getpid, prctl, getppid and _exit are async-signal-safe, as pre_exec requires.
    let parent = unsafe { libc::getpid() };
    unsafe {
        command.pre_exec(move || {
            // If guard dies (even by SIGKILL), CMD must not run on without the lock.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // guard may have died before prctl took effect.
            if libc::getppid() != parent {
                libc::_exit(EXIT_LOST);
            }
            Ok(())
        });
    }
    tokio::process::Command::from(command)
        .kill_on_drop(true)
        .spawn()
}

/// The signals guard forwards to CMD.
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
        let waits = self.0.iter_mut().map(|(num, s)| {
            let num = *num;
            Box::pin(async move {
                s.recv().await;
                num
            })
        });
        futures_util::future::select_all(waits).await.0
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// A Kubernetes client for Events when guard runs in a pod; `None` elsewhere.
async fn events_client(cfg: &GuardConfig) -> Option<Kube> {
    let (pod, namespace) = cfg.pod.clone()?;
    let settings = KubeSettings {
        mode: KubeMode::Auto,
        label_key: String::new(),
        mirror_lease: false,
        pod_name: Some(pod),
        namespace: Some(namespace),
        renew_interval: cfg.renewal.interval,
    };
    Kube::connect(settings, crate::k8s::errors_counter())
        .await
        .ok()
        .flatten()
}

async fn event(kube: &Option<Kube>, reason: &str, message: &str, warning: bool) {
    if let Some(kube) = kube {
        if let Err(err) = kube.event(reason, message, warning).await {
            warn!(reason, error = %err, "could not record a Kubernetes event");
        }
    }
}

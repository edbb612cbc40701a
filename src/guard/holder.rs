//! Holding the lock while CMD runs: start CMD, renew in the background, carry out the
//! [`schedule`] until the job is done, release, and say how the run ended.
//!
//! The loop only waits and acts. It waits for the next deadline, CMD's exit, a signal, a
//! change on the leadership channel (a renewal moves the step-down point) and the end of the
//! renewals; after each of them it reads the tenure as published and asks the schedule again.

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::children::{Children, CmdGroup};
use super::outcome::{Kind, Outcome};
use super::report::Report;
use super::schedule::{self, Action, Limits, State, Why, RENEW_FAILED, SUPERSEDED};
use super::signals::Signals;
use super::{EXIT_LOST, EXIT_MAX_HOLD, EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND};
use crate::clock::{Clock, Deadline};
use crate::config::GuardConfig;
use crate::leadership::{LeadershipRx, LeadershipTx, Role};
use crate::lease::{self, HoldEnd};
use crate::redlock::{Lease, Redlock};

/// Runs CMD under `lease` until it is done; returns the run's outcome. `leadership` is the
/// channel the renewals publish on, and the loop reads.
pub async fn run_cmd(
    cfg: &GuardConfig,
    redlock: &Redlock,
    lease: Lease,
    leadership: (LeadershipTx, LeadershipRx),
    signals: &mut Signals,
    children: &mut Children,
    report: &mut Report,
) -> Outcome {
    let (tx, mut rx) = leadership;
    let lock = &cfg.redlock.lock;
    let token = lease.fencing_token;
    info!(lock = %lock, fencing_token = token, validity_ms = lease.remaining_at(Deadline::now()).as_millis() as u64, "acquired the lock; starting CMD");
    // Deadlines of the tenure are on the lease's clock, which counts host suspends.
    let limits = Limits {
        kill_grace: cfg.kill_grace,
        min_hold: cfg.min_hold,
        max_hold: cfg.max_hold,
    };
    let mut state = State::new(
        limits,
        Deadline::now(),
        lease::step_down_at(&lease, &cfg.renewal),
    );
    let identity = &redlock.config().identity;
    let first_fence = schedule::signal_points(&state);
    let mut cmd = match children.start(cfg, token, identity, first_fence).await {
        Ok(cmd) => cmd,
        Err(err) => {
            error!(command = %cfg.command[0], error = %err, "cannot start CMD");
            lease::release(redlock, &lease).await;
            report.run("failed");
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
    report.run("ran");
    // The lock value stays the same through renewals: the slot's record is owner-checked by it.
    let held = lease.clone();
    let stop_renewing = CancellationToken::new();
    let mut renewals = Some(spawn_renewals(
        redlock,
        lease,
        cfg,
        tx,
        report,
        &stop_renewing,
    ));
    let mut ended: Option<HoldEnd> = None;
    let mut exit_code = None;
    let mut watching = true;
    loop {
        // Whatever just happened may have moved a deadline: read the tenure as published
        // now, and ask the schedule again.
        if let Role::Leader(term) = &rx.borrow_and_update().role {
            state.published(term.step_down_at);
        }
        // The supervisor signals CMD at these points on its own, should this thread stall.
        let fenced = hand_over_fence(&mut cmd, &state);
        let now = Deadline::now();
        let (action, wake) = schedule::next(&state, now);
        match action {
            Action::Wait => {}
            Action::Terminate(why) => {
                match why {
                    Why::MaxHold => info!(lock = %lock, "--max-hold reached; stopping CMD"),
                    Why::Lost(RENEW_FAILED) => {
                        warn!(lock = %lock, "renewals could not keep the lock; stopping CMD before it expires");
                        report.lock_lost(RENEW_FAILED);
                    }
                    Why::Lost(_) => warn!(lock = %lock, "stopping CMD: the lock was lost"),
                }
                state.terminated(why, now);
                if !hand_over_fence(&mut cmd, &state) {
                    cmd.signal(libc::SIGTERM);
                }
                continue;
            }
            Action::Kill => {
                if state.lost() == Some(SUPERSEDED) {
                    warn!(lock = %lock, "the lock is someone else's: SIGKILL to CMD at once");
                } else {
                    warn!("CMD still running; sending SIGKILL");
                }
                state.killed();
                if !fenced {
                    cmd.signal(libc::SIGKILL);
                }
                continue;
            }
            Action::StopRenewing => {
                stop_renewing.cancel();
                state.renewals_stopped();
                continue;
            }
            Action::Release => break,
        }
        tokio::select! {
            code = children.supervisor_exit(), if state.cmd_running() => {
                // The supervisor killed what CMD left behind; if it was itself killed, orphans
                // of CMD's tree were re-parented to guard: nothing of CMD's may run on after
                // the release.
                children.kill_all_below().await;
                info!(exit_code = code, "CMD exited");
                state.cmd_exited();
                exit_code = Some(code);
                // At once, under the lock: before --min-hold, which a kill could cut short.
                if let Some(slot) = cfg.slot.as_ref().filter(|_| completed(code, &state, &ended)) {
                    super::slot::record(cfg, slot, redlock, &held).await;
                }
            }
            sig = signals.recv() => {
                if state.cmd_running() {
                    info!(signal = sig, "forwarding signal to CMD; the lock is released when it exits");
                    cmd.signal(sig);
                } else {
                    info!(signal = sig, "signal during --min-hold; releasing now");
                }
                state.signalled();
            }
            changed = rx.changed(), if watching => watching = changed.is_ok(),
            end = async { renewals.as_mut().expect("polled only while running").await }, if renewals.is_some() => {
                renewals = None;
                let end = end.unwrap_or_else(|err| renewal_task_failed(&err));
                let (lost, lease) = match &end {
                    HoldEnd::Lost(reason, lease) => (Some(*reason), lease),
                    HoldEnd::Cancelled(lease) => (None, lease),
                };
                if let Some(reason) = lost {
                    report.lock_lost(reason);
                }
                state.renewals_ended(lost, lease::step_down_at(lease, &cfg.renewal));
                ended = Some(end);
            }
            _ = Clock::Boot.sleep_until_some(wake) => {}
        }
    }
    let code = exit_code.expect("the schedule releases only after CMD exited");
    stop_renewing.cancel();
    if let Some(running) = renewals {
        ended = Some(
            running
                .await
                .unwrap_or_else(|err| renewal_task_failed(&err)),
        );
    }
    // Renewals that ended on their own as they were being stopped count as a loss too.
    if let Some(HoldEnd::Lost(reason, _)) = &ended {
        report.lock_lost(reason);
    }
    // The renewal task has published not-leader before returning.
    if let Some(HoldEnd::Cancelled(lease) | HoldEnd::Lost(_, lease)) = &ended {
        lease::release(redlock, lease).await;
    }
    let held = |kind, exit_code| Outcome {
        kind,
        exit_code,
        fencing_token: Some(token),
    };
    match state.stopped_for() {
        Some(Why::Lost(_)) => {
            report.run("lost");
            report
                .event(
                    "LockLost",
                    &format!("lock {lock} (fencing token {token}) was lost; CMD was stopped"),
                    true,
                )
                .await;
            held(Kind::Lost, EXIT_LOST)
        }
        Some(Why::MaxHold) => held(Kind::MaxHold, EXIT_MAX_HOLD),
        None => {
            if matches!(ended, Some(HoldEnd::Lost(..))) {
                warn!(lock = %lock, exit_code = code, "the lock was lost during --min-hold, after CMD finished; its exit code stands");
                report.run("lost");
                report
                    .event(
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

/// Whether CMD's exit `code` ends a run that counts as done for `--slot`: 0, CMD not
/// stopped by guard (a loss, `--max-hold`), and renewals not lost.
fn completed(code: i32, state: &State, ended: &Option<HoldEnd>) -> bool {
    code == 0 && state.stopped_for().is_none() && !matches!(ended, Some(HoldEnd::Lost(..)))
}

/// Hands the supervisor the SIGTERM and SIGKILL points as they stand; false if it could not
/// take them (guard then signals CMD itself, as a fallback).
fn hand_over_fence(cmd: &mut CmdGroup, state: &State) -> bool {
    match schedule::fence(state) {
        Some((term_at, kill_at)) => cmd.fence(term_at, kill_at),
        None => true,
    }
}

/// Renews `lease` in the background until `stop`, or until renewals fail; publishes
/// not-leader as soon as they end. The tenure is published before this returns.
fn spawn_renewals(
    redlock: &Redlock,
    lease: Lease,
    cfg: &GuardConfig,
    tx: LeadershipTx,
    report: &Report,
    stop: &CancellationToken,
) -> JoinHandle<HoldEnd> {
    let (redlock, metrics, stop) = (redlock.clone(), report.metrics().clone(), stop.clone());
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
fn renewal_task_failed(err: &tokio::task::JoinError) -> HoldEnd {
    error!(error = %err, "the renewal task failed; the lock expires on its own");
    std::process::exit(EXIT_LOST)
}

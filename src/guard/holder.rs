//! Holding the lock while CMD runs: start CMD, renew in the background, carry out the
//! [`schedule`] until the job is done, release, and say how the run ended.
//!
//! The loop only waits and acts. It waits for the next deadline, CMD's exit, a signal, a
//! change on the leadership channel (a renewal moves the step-down point) and the end of the
//! renewals; after each of them it reads the tenure as published and asks the schedule again.

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::children::{Children, CmdGroup, Seen};
use super::outcome::{Kind, Outcome};
use super::report::Report;
use super::schedule::{self, Action, Limits, State, Why, RENEW_FAILED, SUPERSEDED};
use super::signals::Signals;
use crate::clock::{Clock, Deadline};
use crate::config::{GuardConfig, Slot};
use crate::exit;
use crate::leadership::{LeadershipRx, LeadershipTx, Role};
use crate::lease::{self, HoldEnd};
use crate::redlock::{Lease, Redlock};

/// How long guard waits for its helpers to end after CMD has exited before it kills them:
/// running, they end within milliseconds.
const HELPERS_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

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
                exit::NOT_FOUND
            } else {
                exit::NOT_EXECUTABLE
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
    // `--slot`: CMD finished with 0 but its record did not reach a quorum.
    let mut unrecorded = false;
    // When guard stops waiting for the helpers to end, once CMD is seen gone (its pidfd).
    let mut helpers_due: Option<Deadline> = None;
    // CMD's code as read from /proc when guard killed the helpers instead.
    let mut helpers_killed: Option<Option<i32>> = None;
    loop {
        // Whatever just happened may have moved a deadline: read the tenure as published
        // now, and ask the schedule again.
        if let Role::Leader(term) = &rx.borrow_and_update().role {
            state.published(term.step_down_at);
        }
        // The helpers signal CMD at these points on their own, should this thread stall.
        hand_over_fence(&mut cmd, &state);
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
                hand_over_fence(&mut cmd, &state);
                // The supervisor sends it at the fence; stopped or gone, it cannot.
                if !cmd.supervisor_running() {
                    cmd.signal(libc::SIGTERM);
                }
                continue;
            }
            Action::Kill => {
                // First, before any log line: every process below guard, the helpers
                // included (they hold the same point, but may be stopped).
                children.kill_below();
                state.killed();
                if state.lost() == Some(SUPERSEDED) {
                    warn!(lock = %lock, "the lock is someone else's: SIGKILL to CMD at once");
                } else {
                    warn!("CMD still running; sending SIGKILL");
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
                // The helpers killed what CMD left behind; if they were themselves killed,
                // orphans of CMD's tree were re-parented to guard: nothing of CMD's may run on
                // after the release.
                children.kill_all_below().await;
                // Killed by guard, the helpers could not pass CMD's code on.
                let code = match helpers_killed {
                    Some(read) => read.or_else(|| cmd.cmd_exit_code()).unwrap_or(code),
                    None => code,
                };
                // A helper that stopped CMD at the fence said so before CMD's exit.
                if cmd.fenced_now() {
                    fenced_by_helper(&mut state, report, lock);
                }
                info!(exit_code = code, "CMD exited");
                state.cmd_exited();
                exit_code = Some(code);
                // At once, under the lock: before --min-hold, which a kill could cut short.
                if let Some(slot) = cfg.slot.as_ref().filter(|_| finished(code, &state)) {
                    unrecorded = !record_slot(cfg, slot, redlock, &held, &ended).await;
                }
            }
            seen = cmd.watch(state.stopped_for().is_none(), helpers_due.is_none()), if state.cmd_running() => {
                match seen {
                    Seen::Fenced => fenced_by_helper(&mut state, report, lock),
                    Seen::CmdGone => helpers_due = Some(Deadline::now() + HELPERS_GRACE),
                }
            }
            _ = Clock::Boot.sleep_until_some(helpers_due), if state.cmd_running() && helpers_killed.is_none() => {
                // CMD has exited and the helpers have not: one of them is stopped (or hung).
                // Nothing of CMD's may run on, nor the lock be held for it. Its code, from the
                // zombie a stopped helper has not reaped, first.
                helpers_killed = Some(cmd.cmd_exit_code());
                children.kill_below();
                warn!("CMD exited but guard's helper processes did not end (stopped?); killed them");
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
            held(Kind::Lost, exit::LOST)
        }
        Some(Why::MaxHold) => held(Kind::MaxHold, exit::MAX_HOLD),
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
            if unrecorded {
                let slot = cfg.slot.as_ref().map_or("", |slot| slot.id.as_str());
                report
                    .event(
                        "SlotNotRecorded",
                        &format!("slot {slot} of lock {lock} ran (fencing token {token}) but its record reached too few nodes; a later run of the slot may run it again"),
                        true,
                    )
                    .await;
                report.run("unrecorded");
                return held(Kind::Unrecorded, exit::UNREACHABLE);
            }
            held(Kind::Ran, code)
        }
    }
}

/// Whether CMD's exit `code` ends a run that counts as done for `--slot`: 0, and CMD not
/// stopped by guard (a loss, `--max-hold`) nor by a helper at the fence.
fn finished(code: i32, state: &State) -> bool {
    code == 0 && state.stopped_for().is_none()
}

/// Records that `slot` ran, unless the renewals were lost before CMD's exit was seen (the
/// lock cannot be shown to have held to the end); whether a quorum has the record.
async fn record_slot(
    cfg: &GuardConfig,
    slot: &Slot,
    redlock: &Redlock,
    held: &Lease,
    ended: &Option<HoldEnd>,
) -> bool {
    if matches!(ended, Some(HoldEnd::Lost(..))) {
        warn!(lock = %cfg.redlock.lock, slot = %slot.id, "the lock was lost before CMD's exit was seen: the slot is not recorded, and a later run of this slot may run it again");
        return false;
    }
    super::slot::record(cfg, slot, redlock, held).await
}

/// A helper signalled CMD at the fence before guard's own thread did (it was stopped or
/// blocked past the SIGTERM point): CMD is being stopped, and the run is told as such.
fn fenced_by_helper(state: &mut State, report: &mut Report, lock: &str) {
    if state.stopped_for().is_some() {
        return;
    }
    state.fenced(Deadline::now());
    if state.stopped_for() == Some(Why::Lost(RENEW_FAILED)) {
        report.lock_lost(RENEW_FAILED);
    }
    warn!(lock = %lock, "guard's supervisor signalled CMD at the fence: guard did not renew the lock in time");
}

/// Publishes the SIGTERM and SIGKILL points as they stand to the helpers.
fn hand_over_fence(cmd: &mut CmdGroup, state: &State) {
    if let Some((term_at, kill_at)) = schedule::fence(state) {
        cmd.fence(term_at, kill_at);
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
    exit::now(exit::LOST)
}

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
    let (tx, rx) = leadership;
    let lock = &cfg.redlock.lock;
    let token = lease.fencing_token;
    info!(lock = %lock, fencing_token = token, validity_ms = lease.remaining_at(Deadline::now()).as_millis() as u64, "acquired the lock; starting CMD");
    // Deadlines of the tenure are on the lease's clock, which counts host suspends.
    let limits = Limits {
        kill_grace: cfg.kill_grace,
        min_hold: cfg.min_hold,
        max_hold: cfg.max_hold,
    };
    let state = State::new(
        limits,
        Deadline::now(),
        lease::step_down_at(&lease, &cfg.renewal),
    );
    let identity = &redlock.config().identity;
    let first_fence = schedule::signal_points(&state);
    let cmd = match children.start(cfg, token, identity, first_fence).await {
        Ok(cmd) => cmd,
        Err(err) => return not_started(cfg, redlock, &lease, report, &err).await,
    };
    report.run("ran");
    // The lock value stays the same through renewals: the slot's record is owner-checked by it.
    let held = lease.clone();
    let stop_renewing = CancellationToken::new();
    let renewals = Some(spawn_renewals(
        redlock,
        lease,
        cfg,
        tx,
        report,
        &stop_renewing,
    ));
    let mut run = Run {
        cfg,
        redlock,
        signals,
        children,
        report,
        token,
        held,
        state,
        cmd,
        rx,
        renewals,
        stop_renewing,
        ended: None,
        exit_code: None,
        watching: true,
        unrecorded: false,
        helpers_due: None,
        helpers_killed: None,
    };
    run.until_released().await;
    run.release().await;
    run.outcome().await
}

/// CMD could not be started: the lock is released at once, and the run ends as a shell
/// would have (127 not found, 126 not executable).
async fn not_started(
    cfg: &GuardConfig,
    redlock: &Redlock,
    lease: &Lease,
    report: &mut Report,
    err: &std::io::Error,
) -> Outcome {
    error!(command = %cfg.command[0], error = %err, "cannot start CMD");
    lease::release(redlock, lease).await;
    report.run("failed");
    let code = if err.kind() == std::io::ErrorKind::NotFound {
        exit::NOT_FOUND
    } else {
        exit::NOT_EXECUTABLE
    };
    Outcome {
        kind: Kind::NotStarted,
        exit_code: code,
        fencing_token: Some(lease.fencing_token),
    }
}

/// One run of CMD under the lock: what the loop keeps from one turn to the next.
struct Run<'a> {
    cfg: &'a GuardConfig,
    redlock: &'a Redlock,
    signals: &'a mut Signals,
    children: &'a mut Children,
    report: &'a mut Report,
    token: u64,
    /// The lease as acquired (its value is the slot record's owner).
    held: Lease,
    state: State,
    cmd: CmdGroup,
    rx: LeadershipRx,
    /// The renewal task, while it runs.
    renewals: Option<JoinHandle<HoldEnd>>,
    stop_renewing: CancellationToken,
    /// How the renewals ended, once they did.
    ended: Option<HoldEnd>,
    /// CMD's exit code, once it exited.
    exit_code: Option<i32>,
    /// Whether the leadership channel is still open.
    watching: bool,
    /// `--slot`: CMD finished with 0 but its record did not reach a quorum.
    unrecorded: bool,
    /// When guard stops waiting for the helpers to end, once CMD is seen gone (its pidfd).
    helpers_due: Option<Deadline>,
    /// CMD's code as read from /proc when guard killed the helpers instead.
    helpers_killed: Option<Option<i32>>,
}

/// What ended one wait of the loop.
enum Event {
    /// The supervisor exited with this code (CMD's, or 128+S).
    SupervisorExited(i32),
    /// CMD's group reported something.
    Seen(Seen),
    /// CMD is gone but the helpers did not end within [`HELPERS_GRACE`].
    HelpersHung,
    /// guard got this signal.
    Signal(i32),
    /// The leadership channel changed (`false`: its sender is gone).
    Leadership(bool),
    /// The renewal task ended.
    RenewalsEnded(Result<HoldEnd, tokio::task::JoinError>),
    /// The schedule's next deadline came.
    Woke,
}

impl<'a> Run<'a> {
    /// The lock's name.
    fn lock(&self) -> &'a str {
        &self.cfg.redlock.lock
    }

    /// The loop: it only waits and acts. After whatever happened, it reads the tenure as
    /// published now and asks the schedule again, until the schedule says release.
    async fn until_released(&mut self) {
        loop {
            // Whatever just happened may have moved a deadline.
            if let Role::Leader(term) = &self.rx.borrow_and_update().role {
                self.state.published(term.step_down_at);
            }
            // The helpers signal CMD at these points on their own, should this thread stall.
            hand_over_fence(&mut self.cmd, &self.state);
            let now = Deadline::now();
            let (action, wake) = schedule::next(&self.state, now);
            match action {
                Action::Wait => {
                    let event = self.wait(wake).await;
                    self.handle(event).await;
                }
                Action::Release => return,
                Action::Terminate(why) => self.terminate(why, now),
                Action::Kill => self.kill(),
                Action::StopRenewing => {
                    self.stop_renewing.cancel();
                    self.state.renewals_stopped();
                }
            }
        }
    }

    /// The schedule stops CMD for `why`: SIGTERM now, SIGKILL at the fence.
    fn terminate(&mut self, why: Why, now: Deadline) {
        let lock = self.lock();
        match why {
            Why::MaxHold => info!(lock = %lock, "--max-hold reached; stopping CMD"),
            Why::Lost(RENEW_FAILED) => {
                warn!(lock = %lock, "renewals could not keep the lock; stopping CMD before it expires");
                self.report.lock_lost(RENEW_FAILED);
            }
            Why::Lost(_) => warn!(lock = %lock, "stopping CMD: the lock was lost"),
        }
        self.state.terminated(why, now);
        hand_over_fence(&mut self.cmd, &self.state);
        // The supervisor sends it at the fence; stopped or gone, it cannot.
        if !self.cmd.supervisor_running() {
            self.cmd.signal(libc::SIGTERM);
        }
    }

    /// The schedule's SIGKILL point came with CMD still running.
    fn kill(&mut self) {
        // First, before any log line: every process below guard, the helpers included (they
        // hold the same point, but may be stopped).
        self.children.kill_below();
        self.state.killed();
        if self.state.lost() == Some(SUPERSEDED) {
            warn!(lock = %self.lock(), "the lock is someone else's: SIGKILL to CMD at once");
        } else {
            warn!("CMD still running; sending SIGKILL");
        }
    }

    /// Waits for the first of: CMD's end, a report of its group, hung helpers, a signal, a
    /// change of the tenure, the end of the renewals, or the schedule's `wake`.
    async fn wait(&mut self, wake: Option<Deadline>) -> Event {
        let running = self.state.cmd_running();
        let fenced = self.state.stopped_for().is_none();
        let gone = self.helpers_due.is_none();
        let renewals = &mut self.renewals;
        tokio::select! {
            code = self.children.supervisor_exit(), if running => Event::SupervisorExited(code),
            seen = self.cmd.watch(fenced, gone), if running => Event::Seen(seen),
            _ = Clock::Boot.sleep_until_some(self.helpers_due), if running && self.helpers_killed.is_none() => Event::HelpersHung,
            sig = self.signals.recv() => Event::Signal(sig),
            changed = self.rx.changed(), if self.watching => Event::Leadership(changed.is_ok()),
            end = async { renewals.as_mut().expect("polled only while running").await }, if renewals.is_some() => Event::RenewalsEnded(end),
            _ = Clock::Boot.sleep_until_some(wake) => Event::Woke,
        }
    }

    /// Carries out what ended the wait.
    async fn handle(&mut self, event: Event) {
        match event {
            Event::SupervisorExited(code) => self.cmd_exited(code).await,
            Event::Seen(Seen::Fenced) => {
                let lock = self.lock();
                fenced_by_helper(&mut self.state, self.report, lock);
            }
            Event::Seen(Seen::CmdGone) => self.helpers_due = Some(Deadline::now() + HELPERS_GRACE),
            Event::HelpersHung => {
                // CMD has exited and the helpers have not: one of them is stopped (or hung).
                // Nothing of CMD's may run on, nor the lock be held for it. Its code, from the
                // zombie a stopped helper has not reaped, first.
                self.helpers_killed = Some(self.cmd.cmd_exit_code());
                self.children.kill_below();
                warn!(
                    "CMD exited but guard's helper processes did not end (stopped?); killed them"
                );
            }
            Event::Signal(sig) => {
                if self.state.cmd_running() {
                    info!(
                        signal = sig,
                        "forwarding signal to CMD; the lock is released when it exits"
                    );
                    self.cmd.signal(sig);
                } else {
                    info!(signal = sig, "signal during --min-hold; releasing now");
                }
                self.state.signalled();
            }
            Event::Leadership(open) => self.watching = open,
            Event::RenewalsEnded(end) => self.renewals_ended(end),
            Event::Woke => {}
        }
    }

    /// The supervisor exited: CMD's code is known, and with `--slot` a run that finished is
    /// recorded at once, under the lock.
    async fn cmd_exited(&mut self, code: i32) {
        // The helpers killed what CMD left behind; if they were themselves killed, orphans of
        // CMD's tree were re-parented to guard: nothing of CMD's may run on after the release.
        self.children.kill_all_below().await;
        // Killed by guard, the helpers could not pass CMD's code on.
        let code = match self.helpers_killed {
            Some(read) => read.or_else(|| self.cmd.cmd_exit_code()).unwrap_or(code),
            None => code,
        };
        // A helper that stopped CMD at the fence said so before CMD's exit.
        if self.cmd.fenced_now() {
            let lock = self.lock();
            fenced_by_helper(&mut self.state, self.report, lock);
        }
        info!(exit_code = code, "CMD exited");
        self.state.cmd_exited();
        self.exit_code = Some(code);
        // At once, under the lock: before --min-hold, which a kill could cut short.
        let cfg = self.cfg;
        if let Some(slot) = cfg.slot.as_ref().filter(|_| finished(code, &self.state)) {
            self.unrecorded = !record_slot(cfg, slot, self.redlock, &self.held, &self.ended).await;
        }
    }

    /// The renewal task ended: lost (said so), or stopped as asked.
    fn renewals_ended(&mut self, end: Result<HoldEnd, tokio::task::JoinError>) {
        self.renewals = None;
        let end = end.unwrap_or_else(|err| renewal_task_failed(&err));
        let (lost, lease) = match &end {
            HoldEnd::Lost(reason, lease) => (Some(*reason), lease),
            HoldEnd::Cancelled(lease) => (None, lease),
        };
        if let Some(reason) = lost {
            self.report.lock_lost(reason);
        }
        self.state
            .renewals_ended(lost, lease::step_down_at(lease, &self.cfg.renewal));
        self.ended = Some(end);
    }

    /// Stops the renewals (if they still run) and releases the lock.
    async fn release(&mut self) {
        self.stop_renewing.cancel();
        if let Some(running) = self.renewals.take() {
            self.ended = Some(
                running
                    .await
                    .unwrap_or_else(|err| renewal_task_failed(&err)),
            );
        }
        // Renewals that ended on their own as they were being stopped count as a loss too.
        if let Some(HoldEnd::Lost(reason, _)) = &self.ended {
            self.report.lock_lost(reason);
        }
        // The renewal task has published not-leader before returning.
        if let Some(HoldEnd::Cancelled(lease) | HoldEnd::Lost(_, lease)) = &self.ended {
            lease::release(self.redlock, lease).await;
        }
    }

    /// How the run ended, told to the report (and as a Kubernetes Event when it went wrong).
    async fn outcome(self) -> Outcome {
        let code = self
            .exit_code
            .expect("the schedule releases only after CMD exited");
        let (lock, token) = (self.lock(), self.token);
        let held = |kind, exit_code| Outcome {
            kind,
            exit_code,
            fencing_token: Some(token),
        };
        match self.state.stopped_for() {
            Some(Why::Lost(_)) => {
                self.report.run("lost");
                self.report
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
                if matches!(self.ended, Some(HoldEnd::Lost(..))) {
                    warn!(lock = %lock, exit_code = code, "the lock was lost during --min-hold, after CMD finished; its exit code stands");
                    self.report.run("lost");
                    self.report
                        .event(
                            "LockLost",
                            &format!("lock {lock} (fencing token {token}) was lost during --min-hold, after CMD finished (exit code {code})"),
                            true,
                        )
                        .await;
                }
                info!(lock = %lock, exit_code = code, "CMD finished");
                if self.unrecorded {
                    let slot = self.cfg.slot.as_ref().map_or("", |slot| slot.id.as_str());
                    self.report
                        .event(
                            "SlotNotRecorded",
                            &format!("slot {slot} of lock {lock} ran (fencing token {token}) but its record reached too few nodes; a later run of the slot may run it again"),
                            true,
                        )
                        .await;
                    self.report.run("unrecorded");
                    return held(Kind::Unrecorded, exit::UNREACHABLE);
                }
                held(Kind::Ran, code)
            }
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

//! The holder's schedule: what guard does next while it holds the lock, and when.
//!
//! A pure decision over the job's [`State`] and the time ([`next`]): no clock, no I/O, so every
//! timing rule below is a unit test over instants. [`super::holder`] feeds it the events (a
//! renewal published on the leadership channel, CMD's exit, a signal, the renewals' end),
//! carries out the [`Action`] it returns, and asks again after every event: a deadline is never
//! kept from before an event that may have moved it.
//!
//! ## Behaviour
//! - **Self-fencing.** While CMD runs, SIGTERM is due `kill_grace` before the step-down point
//!   last published, SIGKILL at it. Every renewal publishes a later step-down point, so a CMD
//!   of any length runs on while renewals succeed.
//! - **`--max-hold`** after CMD started: SIGTERM, then renewals stop; SIGKILL `kill_grace` later,
//!   but never after the step-down point.
//! - **Renewals ended on their own** (the tenure was lost): SIGTERM at once, SIGKILL
//!   `kill_grace` later but never after the step-down point; a superseded tenure (a quorum
//!   shows another holder or no key) gets SIGKILL at once.
//! - **The helpers hold the same deadlines.** [`fence`] gives the SIGTERM and SIGKILL points
//!   as they stand; the holder publishes them to the helper processes after every event, and
//!   they signal CMD at them on their own, whatever guard's thread is doing. When one of them
//!   did so first (guard's thread was late), CMD is being stopped from then on ([`State::fenced`]),
//!   for the reason guard would have given.
//! - **After CMD exited**, the lock is released once `--min-hold` has passed since CMD started;
//!   at once if guard was stopping CMD, if a signal came (forwarded to CMD, or during the
//!   hold), or if renewals have ended.

use std::time::Duration;

use crate::clock::Deadline;

/// The loss reason of a tenure that a quorum shows to be someone else's.
pub const SUPERSEDED: &str = "superseded";
/// The loss reason when the step-down point comes near without a renewal.
pub const RENEW_FAILED: &str = "renew_failed";

/// Why guard stops CMD.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// The tenure is lost, or about to be (a reason of `metrics::LOST_REASONS`).
    Lost(&'static str),
    /// `--max-hold` was reached.
    MaxHold,
}

/// What to do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Nothing until the deadline returned with it, or the next event.
    Wait,
    /// SIGTERM to CMD's process group.
    Terminate(Why),
    /// SIGKILL to CMD's process group.
    Kill,
    /// Stop renewing the lock.
    StopRenewing,
    /// CMD is done and the lock is no longer needed: release it.
    Release,
}

/// The job's timing options.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub kill_grace: Duration,
    pub min_hold: Duration,
    pub max_hold: Option<Duration>,
}

/// What the schedule knows about the job; changed only by events.
#[derive(Clone, Debug)]
pub struct State {
    limits: Limits,
    /// When CMD started.
    started: Deadline,
    /// The tenure's step-down point, as last published.
    step_down_at: Deadline,
    /// Renewals run (neither ended nor asked to stop).
    renewing: bool,
    /// Why the tenure was lost, once renewals ended on their own.
    lost: Option<&'static str>,
    /// Why and when CMD got SIGTERM.
    stopping: Option<(Why, Deadline)>,
    killed: bool,
    exited: bool,
    signalled: bool,
}

impl State {
    /// CMD started at `started` under a tenure that steps down at `step_down_at`.
    pub fn new(limits: Limits, started: Deadline, step_down_at: Deadline) -> State {
        State {
            limits,
            started,
            step_down_at,
            renewing: true,
            lost: None,
            stopping: None,
            killed: false,
            exited: false,
            signalled: false,
        }
    }

    /// A renewal (or the first publication) set the step-down point.
    pub fn published(&mut self, step_down_at: Deadline) {
        self.step_down_at = step_down_at;
    }

    /// Renewals ended: `lost` with a reason if they ended on their own; `step_down_at` is the
    /// final tenure's.
    pub fn renewals_ended(&mut self, lost: Option<&'static str>, step_down_at: Deadline) {
        self.renewing = false;
        self.step_down_at = step_down_at;
        if self.lost.is_none() {
            self.lost = lost;
        }
    }

    /// [`Action::StopRenewing`] was carried out.
    pub fn renewals_stopped(&mut self) {
        self.renewing = false;
    }

    /// [`Action::Terminate`] was carried out at `now`.
    pub fn terminated(&mut self, why: Why, now: Deadline) {
        self.stopping.get_or_insert((why, now));
    }

    /// A helper signalled CMD at the fence on its own, guard's thread having been late to
    /// (stopped, blocked): CMD is being stopped since `now` for the reason the schedule gives
    /// then: the loss if renewals ended, `--max-hold` if it has passed, else renewals that did
    /// not keep the lock in time.
    pub fn fenced(&mut self, now: Deadline) {
        if self.stopping.is_some() || self.exited {
            return;
        }
        let max_hold_passed = self
            .limits
            .max_hold
            .is_some_and(|max| now >= self.started + max);
        let why = match self.lost {
            Some(reason) => Why::Lost(reason),
            None if max_hold_passed => Why::MaxHold,
            None => Why::Lost(RENEW_FAILED),
        };
        self.stopping = Some((why, now));
    }

    /// [`Action::Kill`] was carried out.
    pub fn killed(&mut self) {
        self.killed = true;
    }

    /// CMD (and what it left behind) is gone.
    pub fn cmd_exited(&mut self) {
        self.exited = true;
    }

    /// A signal came: forwarded to CMD while it runs, and either way the job should end.
    pub fn signalled(&mut self) {
        self.signalled = true;
    }

    pub fn cmd_running(&self) -> bool {
        !self.exited
    }

    /// Why guard stopped CMD, if it did.
    pub fn stopped_for(&self) -> Option<Why> {
        self.stopping.map(|(why, _)| why)
    }

    /// Why the tenure was lost, if renewals ended on their own.
    pub fn lost(&self) -> Option<&'static str> {
        self.lost
    }
}

/// What to do at `now`, and until when to wait (`None`: until the next event) if nothing.
/// After a non-[`Action::Wait`] action, carry it out, record it in the state, and ask again.
pub fn next(s: &State, now: Deadline) -> (Action, Option<Deadline>) {
    if s.exited {
        let release_at = if s.stopping.is_some() || s.signalled || !s.renewing {
            now
        } else {
            s.started + s.limits.min_hold
        };
        return due(now, release_at, Action::Release);
    }
    let (term_at, kill_at) = signal_points(s);
    match s.stopping {
        None => {
            if let Some(reason) = s.lost {
                return (Action::Terminate(Why::Lost(reason)), None);
            }
            let max_hold_at = s.limits.max_hold.map(|d| s.started + d);
            if max_hold_at.is_some_and(|at| now >= at) {
                return (Action::Terminate(Why::MaxHold), None);
            }
            if now >= term_at {
                return (Action::Terminate(Why::Lost(RENEW_FAILED)), None);
            }
            let wake = max_hold_at.map_or(term_at, |at| at.min(term_at));
            (Action::Wait, Some(wake))
        }
        Some((why, _)) if why == Why::MaxHold && s.renewing => (Action::StopRenewing, None),
        Some(_) if s.killed => (Action::Wait, None),
        Some(_) => due(now, kill_at, Action::Kill),
    }
}

/// When CMD must get SIGTERM and SIGKILL as things stand (`None` once CMD has exited): the
/// points [`next`] acts on, handed to the supervisor so that they hold even if guard stops.
pub fn fence(s: &State) -> Option<(Deadline, Deadline)> {
    (!s.exited).then(|| signal_points(s))
}

/// SIGTERM `kill_grace` before the step-down point and SIGKILL at it; once CMD got SIGTERM,
/// SIGKILL `kill_grace` after that but never past the step-down point.
pub fn signal_points(s: &State) -> (Deadline, Deadline) {
    let step_down = s.step_down_at;
    match s.stopping {
        None => (step_down - s.limits.kill_grace, step_down),
        // Proof that the lock is someone else's leaves no grace period.
        Some((_, term_sent)) if s.lost == Some(SUPERSEDED) => (term_sent, term_sent),
        Some((_, term_sent)) => (term_sent, (term_sent + s.limits.kill_grace).min(step_down)),
    }
}

/// `action` if `at` has come, else wait for it.
fn due(now: Deadline, at: Deadline, action: Action) -> (Action, Option<Deadline>) {
    if now >= at {
        (action, None)
    } else {
        (Action::Wait, Some(at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(2);

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    /// The default timing: ttl 10 s, step-down 8.9 s after a renewal (validity minus drift
    /// and safety margin), kill grace 2 s.
    const STEP_DOWN: f64 = 8.9;

    struct Job {
        t0: Deadline,
        state: State,
    }

    impl Job {
        fn new(min_hold: f64, max_hold: Option<f64>) -> Job {
            let t0 = Deadline::from_boottime(Duration::from_secs(1_000));
            let limits = Limits {
                kill_grace: GRACE,
                min_hold: secs(min_hold),
                max_hold: max_hold.map(secs),
            };
            Job {
                t0,
                state: State::new(limits, t0, t0 + secs(STEP_DOWN)),
            }
        }

        fn at(&self, s: f64) -> Deadline {
            self.t0 + secs(s)
        }

        fn next(&self, s: f64) -> (Action, Option<Deadline>) {
            next(&self.state, self.at(s))
        }

        /// A renewal that started at `s` published its step-down point.
        fn renew(&mut self, s: f64) {
            let at = self.at(s + STEP_DOWN);
            self.state.published(at);
        }

        /// Carries out whatever is due at `s` (as the holder loop would), and returns the
        /// actions in order, up to the next wait.
        fn run(&mut self, s: f64) -> Vec<Action> {
            let now = self.at(s);
            let mut done = Vec::new();
            loop {
                let (action, _) = next(&self.state, now);
                match action {
                    Action::Wait => return done,
                    Action::Terminate(why) => self.state.terminated(why, now),
                    Action::Kill => self.state.killed(),
                    Action::StopRenewing => self.state.renewals_stopped(),
                    Action::Release => return [done, vec![Action::Release]].concat(),
                }
                done.push(action);
            }
        }
    }

    #[test]
    fn sigterm_comes_kill_grace_before_step_down_and_sigkill_at_it() {
        let mut job = Job::new(0.0, None);
        assert_eq!(job.next(0.0), (Action::Wait, Some(job.at(STEP_DOWN - 2.0))));
        assert_eq!(job.run(6.8), vec![]);
        assert_eq!(
            job.run(6.9),
            vec![Action::Terminate(Why::Lost(RENEW_FAILED))]
        );
        assert_eq!(job.next(7.0), (Action::Wait, Some(job.at(STEP_DOWN))));
        assert_eq!(job.run(8.8), vec![]);
        assert_eq!(job.run(STEP_DOWN), vec![Action::Kill]);
        assert_eq!(job.next(9.5), (Action::Wait, None), "then only CMD's exit");
        job.state.cmd_exited();
        assert_eq!(
            job.run(9.6),
            vec![Action::Release],
            "no --min-hold after a stop"
        );
        assert_eq!(job.state.stopped_for(), Some(Why::Lost(RENEW_FAILED)));
    }

    #[test]
    fn a_renewal_moves_both_deadlines() {
        let mut job = Job::new(0.0, None);
        // The deadline read before the renewal is 6.9 s; the renewal at 3.3 s moves it.
        assert_eq!(job.next(3.0).1, Some(job.at(6.9)));
        job.renew(3.3);
        assert_eq!(job.next(6.9), (Action::Wait, Some(job.at(3.3 + 6.9))));
        assert_eq!(
            job.run(6.9),
            vec![],
            "the old deadline means nothing any more"
        );
    }

    #[test]
    fn a_cmd_of_any_length_runs_while_renewals_succeed() {
        // An hour of renewals every ttl/3, the loop waking at every deadline it is given.
        let mut job = Job::new(0.0, None);
        let mut renewal = 3.33;
        let mut t = 0.0;
        while t < 3600.0 {
            let (action, wake) = job.next(t);
            assert_eq!(action, Action::Wait, "at {t} s");
            let wake = wake.expect("a deadline while CMD runs");
            let wake_s = (wake - job.t0).as_secs_f64();
            if renewal < wake_s {
                t = renewal;
                job.renew(renewal);
                renewal += 3.33;
            } else {
                t = wake_s;
            }
        }
        assert_eq!(job.state.stopped_for(), None);
        job.state.cmd_exited();
        assert_eq!(job.run(3600.5), vec![Action::Release]);
        assert_eq!(job.state.lost(), None);
    }

    #[test]
    fn max_hold_stops_cmd_then_renewals_and_kills_after_the_grace() {
        // 25 s: almost three validity windows, honoured at its time, not before.
        let mut job = Job::new(0.0, Some(25.0));
        for t in [3.3, 6.6, 9.9, 13.2, 16.5, 19.8, 23.1] {
            job.renew(t);
            assert_eq!(job.run(t), vec![]);
        }
        assert_eq!(job.next(24.0), (Action::Wait, Some(job.at(25.0))));
        assert_eq!(
            job.run(25.0),
            vec![Action::Terminate(Why::MaxHold), Action::StopRenewing]
        );
        assert_eq!(job.next(25.1), (Action::Wait, Some(job.at(27.0))));
        assert_eq!(job.run(27.0), vec![Action::Kill]);
        job.state.cmd_exited();
        assert_eq!(job.run(27.1), vec![Action::Release]);
        assert_eq!(job.state.stopped_for(), Some(Why::MaxHold));
    }

    #[test]
    fn max_hold_kills_no_later_than_the_step_down_point() {
        let mut job = Job::new(0.0, Some(11.0));
        job.renew(3.3);
        // SIGTERM at 11 s; the grace would end at 13 s, the last renewal steps down at 12.2 s.
        assert_eq!(
            job.run(11.0),
            vec![Action::Terminate(Why::MaxHold), Action::StopRenewing]
        );
        job.state.renewals_ended(None, job.at(3.3 + STEP_DOWN));
        assert_eq!(
            job.next(11.1),
            (Action::Wait, Some(job.at(3.3 + STEP_DOWN)))
        );
        assert_eq!(job.run(3.3 + STEP_DOWN), vec![Action::Kill]);
    }

    #[test]
    fn a_lost_tenure_stops_cmd_at_once_and_kills_it_by_step_down() {
        let mut job = Job::new(10.0, None);
        job.renew(3.3);
        // Renewals gave up at 5 s (e.g. the key expired on a quorum).
        job.state
            .renewals_ended(Some("expired"), job.at(3.3 + STEP_DOWN));
        assert_eq!(job.run(5.0), vec![Action::Terminate(Why::Lost("expired"))]);
        assert_eq!(job.next(5.1), (Action::Wait, Some(job.at(7.0))));
        assert_eq!(job.run(7.0), vec![Action::Kill]);
        job.state.cmd_exited();
        assert_eq!(
            job.run(7.1),
            vec![Action::Release],
            "no --min-hold after a loss"
        );
    }

    #[test]
    fn a_superseded_tenure_gets_sigkill_at_once() {
        let mut job = Job::new(0.0, None);
        job.state
            .renewals_ended(Some(SUPERSEDED), job.at(STEP_DOWN));
        assert_eq!(
            job.run(1.0),
            vec![Action::Terminate(Why::Lost(SUPERSEDED)), Action::Kill]
        );
        // Also while CMD is already being stopped for --max-hold.
        let mut job = Job::new(0.0, Some(1.0));
        job.run(1.0);
        job.state
            .renewals_ended(Some(SUPERSEDED), job.at(STEP_DOWN));
        assert_eq!(job.run(1.1), vec![Action::Kill]);
        assert_eq!(job.state.stopped_for(), Some(Why::MaxHold));
    }

    #[test]
    fn min_hold_keeps_the_lock_after_cmd_exits_while_renewing() {
        let mut job = Job::new(30.0, None);
        job.renew(3.3);
        job.state.cmd_exited();
        assert_eq!(job.next(4.0), (Action::Wait, Some(job.at(30.0))));
        assert_eq!(job.run(29.9), vec![]);
        assert_eq!(job.run(30.0), vec![Action::Release]);
        // Without --min-hold, at once.
        let mut job = Job::new(0.0, None);
        job.state.cmd_exited();
        assert_eq!(job.run(0.5), vec![Action::Release]);
    }

    #[test]
    fn after_cmd_exits_no_signal_is_due_even_past_step_down() {
        let mut job = Job::new(30.0, None);
        job.state.cmd_exited();
        assert_eq!(job.run(STEP_DOWN + 1.0), vec![]);
        // The renewals end on their own at step-down: released then, not at --min-hold.
        job.state.renewals_ended(Some("expired"), job.at(STEP_DOWN));
        assert_eq!(job.run(STEP_DOWN + 1.0), vec![Action::Release]);
        assert_eq!(
            job.state.stopped_for(),
            None,
            "CMD finished: its code stands"
        );
        assert_eq!(job.state.lost(), Some("expired"));
    }

    #[test]
    fn a_signal_skips_min_hold() {
        // Forwarded to CMD while it ran.
        let mut job = Job::new(30.0, None);
        job.state.signalled();
        assert_eq!(job.run(1.0), vec![], "CMD decides what the signal means");
        job.state.cmd_exited();
        assert_eq!(job.run(1.1), vec![Action::Release]);
        // Received during the hold.
        let mut job = Job::new(30.0, None);
        job.state.cmd_exited();
        assert_eq!(job.run(1.0), vec![]);
        job.state.signalled();
        assert_eq!(job.run(1.5), vec![Action::Release]);
    }

    #[test]
    fn a_late_wake_past_step_down_sends_both_signals_at_once() {
        // The process was paused: SIGTERM and SIGKILL are both overdue.
        let mut job = Job::new(0.0, None);
        assert_eq!(
            job.run(STEP_DOWN + 5.0),
            vec![Action::Terminate(Why::Lost(RENEW_FAILED)), Action::Kill]
        );
    }

    #[test]
    fn a_renewal_after_sigterm_does_not_push_sigkill_past_the_grace() {
        let mut job = Job::new(0.0, None);
        assert_eq!(
            job.run(6.9),
            vec![Action::Terminate(Why::Lost(RENEW_FAILED))]
        );
        job.renew(7.5);
        assert_eq!(job.next(7.6), (Action::Wait, Some(job.at(8.9))));
    }

    #[test]
    fn a_fence_carried_out_by_a_helper_stops_cmd_for_the_reason_guard_would_give() {
        // guard was stopped past the SIGTERM point: the lock was not kept in time.
        let mut job = Job::new(30.0, None);
        job.state.fenced(job.at(7.5));
        assert_eq!(job.state.stopped_for(), Some(Why::Lost(RENEW_FAILED)));
        assert_eq!(
            job.next(7.6),
            (Action::Wait, Some(job.at(STEP_DOWN))),
            "SIGKILL by the step-down point"
        );
        job.state.cmd_exited();
        assert_eq!(
            job.run(7.7),
            vec![Action::Release],
            "no --min-hold after a stop"
        );
        // Renewals that ended first give their reason; --max-hold passed gives its own.
        let mut job = Job::new(0.0, None);
        job.state.renewals_ended(Some("expired"), job.at(STEP_DOWN));
        job.state.fenced(job.at(5.0));
        assert_eq!(job.state.stopped_for(), Some(Why::Lost("expired")));
        let mut job = Job::new(0.0, Some(5.0));
        job.state.fenced(job.at(5.5));
        assert_eq!(job.state.stopped_for(), Some(Why::MaxHold));
        assert_eq!(job.run(5.5), vec![Action::StopRenewing]);
        // A stop guard decided itself stands, and after CMD's exit nothing changes.
        let mut job = Job::new(0.0, Some(5.0));
        job.run(5.0);
        job.state.fenced(job.at(6.0));
        assert_eq!(job.state.stopped_for(), Some(Why::MaxHold));
        let mut job = Job::new(0.0, None);
        job.state.cmd_exited();
        job.state.fenced(job.at(9.0));
        assert_eq!(job.state.stopped_for(), None);
    }

    #[test]
    fn the_supervisors_fence_follows_renewals_and_decisions_and_ends_with_cmd() {
        let mut job = Job::new(0.0, Some(20.0));
        let fence = |job: &Job| fence(&job.state);
        assert_eq!(fence(&job), Some((job.at(6.9), job.at(STEP_DOWN))));
        // A renewal moves both points later.
        job.renew(3.0);
        assert_eq!(fence(&job), Some((job.at(9.9), job.at(11.9))));
        // --max-hold: SIGTERM now, SIGKILL kill_grace later (before the step-down point).
        job.renew(19.0);
        assert_eq!(
            job.run(20.0),
            vec![Action::Terminate(Why::MaxHold), Action::StopRenewing]
        );
        assert_eq!(fence(&job), Some((job.at(20.0), job.at(22.0))));
        job.state.cmd_exited();
        assert_eq!(fence(&job), None);
        // A superseded tenure: both at once.
        let mut job = Job::new(0.0, None);
        job.state
            .renewals_ended(Some(SUPERSEDED), job.at(STEP_DOWN));
        job.run(1.0);
        assert_eq!(fence(&job), Some((job.at(1.0), job.at(1.0))));
    }
}

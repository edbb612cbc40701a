//! Whether this sidecar stands for leadership: its app's readiness, and hand-overs.
//!
//! A lock held for a broken app stops the work it exists for: the healthy standbys wait, and
//! a Service that routes by the leader label sends traffic to the broken pod. So the lock loop
//! (`lease::run`) asks [`Candidacy`] before it contends and while it leads. [`Candidacy`] is a
//! pure decision over what the app's checks answered and the time; the checks ([`probe`]) and
//! the control listener's resign route feed it through one `watch` channel.
//!
//! ## Behaviour
//! - **No check configured:** the app counts as ready; only a resign changes anything.
//! - **Contending** needs the app's last answer to be "ready": not before its first ready
//!   answer (an app still starting never leads), and not while it fails.
//! - **Leading** survives failed answers for `--app-unready-after`, counted from the first
//!   failure of the current run of failures (a single slow answer does not move the work).
//!   Past that the leader steps down and releases at once, as on SIGTERM: a ready standby takes
//!   over within milliseconds. A broken leader therefore leads at most `--app-unready-after`
//!   plus one probe interval after its app broke.
//! - **Back to ready:** the sidecar contends again, as a standby: it never takes leadership from
//!   a healthy leader.
//! - **Resign** (`POST /v1/leader/resign?hold=D` on the control listener): a leader steps down
//!   and releases at once, and this sidecar does not contend again until `D` has passed.

pub mod probe;

use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::clock::{Clock, Deadline};

/// What the app's checks said and what was asked of this sidecar; changed only by events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidacy {
    /// How long a leader's app may fail before it steps down.
    unready_after: Duration,
    /// The app's last answer; `None` until its first.
    ready: Option<bool>,
    /// The first failure of the current run of failures.
    failing_since: Option<Deadline>,
    /// No contending before this (a resign's hold).
    hold_until: Option<Deadline>,
}

impl Candidacy {
    /// Without any check of the app: always ready.
    pub fn unchecked() -> Candidacy {
        Candidacy {
            unready_after: Duration::MAX,
            ready: Some(true),
            failing_since: None,
            hold_until: None,
        }
    }

    /// With a check of the app: not ready until its first ready answer.
    pub fn checked(unready_after: Duration) -> Candidacy {
        Candidacy {
            unready_after,
            ready: None,
            failing_since: None,
            hold_until: None,
        }
    }

    /// The app answered at `now`.
    pub fn answered(&mut self, ready: bool, now: Deadline) {
        self.ready = Some(ready);
        if ready {
            self.failing_since = None;
        } else {
            self.failing_since.get_or_insert(now);
        }
    }

    /// Stand aside from `now` for `hold`.
    pub fn resign(&mut self, hold: Duration, now: Deadline) {
        self.hold_until = Some(now + hold);
    }

    /// Whether this sidecar may start contending at `now`.
    pub fn may_contend(&self, now: Deadline) -> bool {
        self.ready == Some(true) && !self.held(now)
    }

    /// Whether a leader may go on leading at `now`.
    pub fn may_lead(&self, now: Deadline) -> bool {
        let failing_too_long = self
            .failing_since
            .is_some_and(|since| now >= since + self.unready_after);
        self.ready.is_some() && !failing_too_long && !self.held(now)
    }

    /// The next instant after `now` at which a verdict may change without a new event.
    pub fn changes_at(&self, now: Deadline) -> Option<Deadline> {
        let unready = self.failing_since.map(|since| since + self.unready_after);
        [unready, self.hold_until]
            .into_iter()
            .flatten()
            .filter(|&at| at > now)
            .min()
    }

    /// Why this sidecar does not contend or lead at `now`, for logs and answers.
    pub fn why_not(&self, now: Deadline) -> &'static str {
        if self.held(now) {
            "resigned"
        } else if self.ready.is_none() {
            "app not ready yet"
        } else {
            "app not ready"
        }
    }

    fn held(&self, now: Deadline) -> bool {
        self.hold_until.is_some_and(|until| now < until)
    }
}

/// The sending half: the app's checks and the resign route.
pub type CandidacyTx = watch::Sender<Candidacy>;
/// The receiving half: the lock loop.
pub type CandidacyRx = watch::Receiver<Candidacy>;

/// Waits until `verdict(candidacy, now)` holds, re-asking after every change and at every
/// instant a verdict may change; false if `cancel` fired first.
pub async fn until(
    rx: &mut CandidacyRx,
    cancel: &CancellationToken,
    verdict: impl Fn(&Candidacy, Deadline) -> bool,
) -> bool {
    loop {
        if cancel.is_cancelled() {
            return false;
        }
        let now = Deadline::now();
        let (holds, wake) = {
            let candidacy = rx.borrow_and_update();
            (verdict(&candidacy, now), candidacy.changes_at(now))
        };
        if holds {
            return true;
        }
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return false,
            changed = rx.changed() => {
                if changed.is_err() {
                    // Nobody can change it any more: only cancellation ends the wait.
                    cancel.cancelled().await;
                    return false;
                }
            }
            _ = Clock::Boot.sleep_until_some(wake) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AFTER: Duration = Duration::from_secs(5);

    fn at(t0: Deadline, s: f64) -> Deadline {
        t0 + Duration::from_secs_f64(s)
    }

    #[test]
    fn without_a_check_it_contends_and_leads_until_it_resigns() {
        let t0 = Deadline::from_boottime(Duration::from_secs(1_000));
        let mut c = Candidacy::unchecked();
        assert!(c.may_contend(t0) && c.may_lead(t0));
        c.resign(Duration::from_secs(10), t0);
        assert!(!c.may_contend(at(t0, 9.9)) && !c.may_lead(at(t0, 9.9)));
        assert_eq!(c.why_not(t0), "resigned");
        assert_eq!(c.changes_at(t0), Some(at(t0, 10.0)));
        assert!(c.may_contend(at(t0, 10.0)));
        assert_eq!(c.changes_at(at(t0, 10.0)), None);
    }

    #[test]
    fn an_app_that_never_answered_ready_is_not_contended_for() {
        let t0 = Deadline::from_boottime(Duration::from_secs(1_000));
        let mut c = Candidacy::checked(AFTER);
        assert!(!c.may_contend(t0));
        assert_eq!(c.why_not(t0), "app not ready yet");
        c.answered(false, t0);
        assert!(!c.may_contend(at(t0, 1.0)));
        c.answered(true, at(t0, 2.0));
        assert!(c.may_contend(at(t0, 2.0)) && c.may_lead(at(t0, 2.0)));
    }

    #[test]
    fn a_leader_steps_down_only_after_its_app_failed_for_unready_after() {
        let t0 = Deadline::from_boottime(Duration::from_secs(1_000));
        let mut c = Candidacy::checked(AFTER);
        c.answered(true, t0);
        c.answered(false, at(t0, 1.0));
        // A standby stops contending at the first failure; a leader keeps leading for 5 s.
        assert!(!c.may_contend(at(t0, 1.0)));
        assert!(c.may_lead(at(t0, 5.9)));
        c.answered(false, at(t0, 2.0));
        assert_eq!(c.changes_at(at(t0, 2.0)), Some(at(t0, 6.0)));
        assert!(!c.may_lead(at(t0, 6.0)));
        // Ready again: contends again, and the count of failures starts over.
        c.answered(true, at(t0, 7.0));
        assert!(c.may_contend(at(t0, 7.0)) && c.may_lead(at(t0, 7.0)));
        c.answered(false, at(t0, 8.0));
        assert!(c.may_lead(at(t0, 12.9)) && !c.may_lead(at(t0, 13.0)));
    }

    #[tokio::test]
    async fn until_wakes_on_a_change_and_at_the_instant_a_verdict_flips() {
        let t0 = Deadline::now();
        let mut c = Candidacy::unchecked();
        c.resign(Duration::from_millis(50), t0);
        let (tx, mut rx) = watch::channel(c);
        let cancel = CancellationToken::new();
        assert!(until(&mut rx, &cancel, Candidacy::may_contend).await);
        assert!(Deadline::now() >= t0 + Duration::from_millis(50));
        tx.send_modify(|c| c.resign(Duration::from_secs(3600), Deadline::now()));
        let waiting = until(&mut rx, &cancel, Candidacy::may_contend);
        tokio::pin!(waiting);
        let early = tokio::time::timeout(Duration::from_millis(20), waiting.as_mut()).await;
        assert!(early.is_err(), "still held");
        cancel.cancel();
        assert!(!waiting.await);
    }
}

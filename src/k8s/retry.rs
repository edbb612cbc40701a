//! When an API operation may be tried again, and when its failures are worth a log line.
//!
//! [`Retry`] is a pure decision over instants (no clock, no sleep): the callers tell it when an
//! attempt started and how it ended, and ask [`Retry::next_at`] when the next one may start.
//! [`Health`] decides which failures and recoveries are logged.
//!
//! ## The rules
//! - **Backoff.** After the n-th failure in a row the next attempt waits "equal jitter" of
//!   `min(first · factorⁿ⁻¹, cap)`: half of it fixed, half drawn at random, so that a fleet of
//!   sidecars that failed together spreads out, yet none comes back too soon.
//! - **`Retry-After`.** A server that says when to come back is obeyed: the next attempt waits
//!   at least that long (at most [`MAX_RETRY_AFTER`], so a bogus header cannot silence the
//!   sidecar for good).
//! - **A bounded rate.** At most [`WINDOW_ATTEMPTS`] attempts in any [`WINDOW`]: for the pod's
//!   watch always (its steady budget; it normally sends one request every 5 to 10 minutes), for
//!   writes while they fail (a write that succeeds clears the window, so a leadership change is
//!   never held back by an earlier one). Failures never push a sidecar past that budget.
//!
//! Whichever of the three rules is latest wins.

use crate::redlock::timing;
use std::time::Duration;

use tracing::{debug, info, warn};

use super::KubeError;
use crate::clock::Deadline;

/// The longest `Retry-After` obeyed; a longer one counts as this.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(600);
/// The window in which at most [`WINDOW_ATTEMPTS`] attempts start.
pub const WINDOW: Duration = Duration::from_secs(60);
/// Attempts allowed in any [`WINDOW`].
pub const WINDOW_ATTEMPTS: usize = 2;

/// How one operation backs off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The delay after a first failure, before jitter.
    pub first: Duration,
    /// How much each further failure in a row multiplies it by.
    pub factor: u32,
    /// The longest delay, before jitter.
    pub cap: Duration,
    /// Whether the attempt window applies to every attempt (`true`) or only to the attempts
    /// of a run of failures (`false`).
    pub window_always: bool,
}

/// Retry state of one operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retry {
    policy: RetryPolicy,
    /// Failures in a row.
    failures: u32,
    /// When the last [`WINDOW_ATTEMPTS`] attempts that count toward the window started,
    /// oldest first.
    recent: Vec<Deadline>,
    /// No attempt before this (backoff, `Retry-After`).
    not_before: Option<Deadline>,
}

impl Retry {
    /// No failure yet.
    pub fn new(policy: RetryPolicy) -> Retry {
        Retry {
            policy,
            failures: 0,
            recent: Vec::with_capacity(WINDOW_ATTEMPTS),
            not_before: None,
        }
    }

    /// The earliest instant the next attempt may start; `None`: at once.
    pub fn next_at(&self) -> Option<Deadline> {
        let window = (self.recent.len() >= WINDOW_ATTEMPTS).then(|| self.recent[0] + WINDOW);
        self.not_before.max(window)
    }

    /// Whether an attempt may start at `now`.
    pub fn due(&self, now: Deadline) -> bool {
        self.next_at().is_none_or(|at| now >= at)
    }

    /// Failures in a row so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// An attempt starts at `now`.
    pub fn started(&mut self, now: Deadline) {
        if self.recent.len() >= WINDOW_ATTEMPTS {
            self.recent.remove(0);
        }
        self.recent.push(now);
    }

    /// The attempt succeeded.
    pub fn succeeded(&mut self) {
        self.failures = 0;
        self.not_before = None;
        if !self.policy.window_always {
            self.recent.clear();
        }
    }

    /// The attempt failed at `now`; the server asked to wait `retry_after`. `draw` is a
    /// random number in `[0, 1)` (the jitter). Returns when the next attempt may start.
    pub fn failed(&mut self, now: Deadline, retry_after: Option<Duration>, draw: f64) -> Deadline {
        self.failures = self.failures.saturating_add(1);
        let (first, factor, cap) = (self.policy.first, self.policy.factor, self.policy.cap);
        let ceiling = timing::backoff_ceiling(first, factor, cap, self.failures - 1);
        let backoff = timing::equal_jitter(ceiling, draw);
        let asked = retry_after.map_or(Duration::ZERO, |d| d.min(MAX_RETRY_AFTER));
        self.not_before = Some(now + backoff.max(asked));
        self.next_at().unwrap_or(now)
    }

    /// Forgets the backoff, the server's `Retry-After` and the window: the next attempt may
    /// start at once (one last try at shutdown).
    pub fn forget(&mut self) {
        self.not_before = None;
        self.recent.clear();
    }
}

/// A random draw for [`Retry::failed`].
pub fn jitter() -> f64 {
    rand::random::<f64>()
}

/// Whether an operation works, for logs: a warning when it starts failing or fails in a new
/// way, one info line when it works again, and debug lines in between.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Health {
    /// The reason of the failures in a row, if failing.
    failing: Option<&'static str>,
    /// Failed attempts since it last worked.
    failures: u64,
}

impl Health {
    /// Records a failure of `op`; logs it if the state changed.
    pub fn failed(&mut self, op: &'static str, err: &KubeError, retry_at: Option<Duration>) {
        self.failures = self.failures.saturating_add(1);
        let reason = err.reason();
        let retry_in = retry_at.unwrap_or_default();
        if self.failing == Some(reason) {
            debug!(op, reason, error = %err, cause = %err.cause(), ?retry_in, failures = self.failures, "kubernetes API call failed again");
            return;
        }
        self.failing = Some(reason);
        warn!(
            op,
            reason,
            error = %err,
            cause = %err.cause(),
            ?retry_in,
            "kubernetes API call failing; retrying with backoff (logged again when it works or fails differently)"
        );
    }

    /// Records a success of `op`; logs the recovery if it was failing.
    pub fn succeeded(&mut self, op: &'static str) {
        if self.failing.take().is_some() {
            info!(
                op,
                failures = self.failures,
                "kubernetes API call works again"
            );
        }
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    fn at(t0: Deadline, secs: f64) -> Deadline {
        t0 + Duration::from_secs_f64(secs)
    }

    fn policy(window_always: bool) -> RetryPolicy {
        RetryPolicy {
            first: SECOND,
            factor: 2,
            cap: Duration::from_secs(60),
            window_always,
        }
    }

    #[test]
    fn backoff_grows_with_equal_jitter_up_to_its_cap() {
        let t0 = Deadline::from_boottime(Duration::from_secs(1_000));
        for (draw, expect) in [(0.0, [0.5, 1.0, 2.0, 4.0]), (0.999, [1.0, 2.0, 4.0, 8.0])] {
            // No attempt recorded as started: only the backoff counts.
            let mut retry = Retry::new(policy(false));
            for expected in expect {
                let next = retry.failed(t0, None, draw);
                let delay = (next - t0).as_secs_f64();
                assert!((delay - expected).abs() < 0.01, "{delay} vs {expected}");
            }
        }
        let mut retry = Retry::new(policy(false));
        for _ in 0..30 {
            retry.failed(t0, None, 0.999);
        }
        let delay = retry.next_at().expect("backing off") - t0;
        assert!(
            delay <= Duration::from_secs(60) && delay >= Duration::from_secs(59),
            "{delay:?}"
        );
    }

    #[test]
    fn the_pods_watch_retries_once_quickly_then_less_than_once_a_minute() {
        let t0 = Deadline::from_boottime(Duration::from_secs(1_000));
        let mut retry = Retry::new(crate::k8s::pod::WATCH_RETRY);
        let mut now = t0;
        let mut starts = Vec::new();
        while now < at(t0, 3_600.0) {
            retry.started(now);
            starts.push(now);
            now = retry.failed(now, None, jitter());
        }
        let gap = starts[1] - starts[0];
        assert!(gap >= Duration::from_millis(500) && gap < SECOND, "{gap:?}");
        for pair in starts[1..].windows(2) {
            let gap = pair[1] - pair[0];
            assert!(
                gap >= Duration::from_secs(60) && gap < Duration::from_secs(120),
                "{gap:?}"
            );
        }
        assert!(starts.len() <= 62, "{} attempts in an hour", starts.len());
    }

    #[test]
    fn retry_after_is_a_floor_and_is_capped() {
        let t0 = Deadline::from_boottime(Duration::from_secs(1_000));
        let mut retry = Retry::new(policy(false));
        retry.started(t0);
        let next = retry.failed(t0, Some(Duration::from_secs(90)), 0.0);
        assert_eq!(next, at(t0, 90.0));
        assert!(!retry.due(at(t0, 89.9)) && retry.due(at(t0, 90.0)));
        // Shorter than the backoff: the backoff stands.
        let mut retry = Retry::new(policy(false));
        let next = retry.failed(t0, Some(Duration::from_millis(10)), 0.0);
        assert_eq!(next, at(t0, 0.5));
        // A day is read as the cap.
        let mut retry = Retry::new(policy(false));
        let next = retry.failed(t0, Some(Duration::from_secs(86_400)), 0.0);
        assert_eq!(next, t0 + MAX_RETRY_AFTER);
    }

    #[test]
    fn a_failing_operation_starts_at_most_two_attempts_in_any_minute() {
        let t0 = Deadline::from_boottime(Duration::from_secs(1_000));
        let mut retry = Retry::new(policy(false));
        let mut starts = Vec::new();
        let mut now = t0;
        for _ in 0..40 {
            assert!(retry.due(now));
            retry.started(now);
            starts.push(now);
            now = retry.failed(now, None, 0.0);
        }
        for pair in starts.windows(3) {
            assert!(pair[2] - pair[0] >= WINDOW, "{pair:?}");
        }
        // The second attempt comes after the first backoff, not after a minute.
        assert_eq!(starts[1] - starts[0], Duration::from_millis(500));
    }

    #[test]
    fn a_write_that_succeeds_clears_the_window_and_the_watch_keeps_it() {
        let t0 = Deadline::from_boottime(Duration::from_secs(1_000));
        for (always, next) in [(false, None), (true, Some(at(t0, 61.0)))] {
            let mut retry = Retry::new(policy(always));
            retry.started(t0);
            retry.failed(t0, None, 0.0);
            retry.started(at(t0, 1.0));
            retry.succeeded();
            retry.started(at(t0, 2.0));
            assert_eq!(retry.next_at(), next, "window_always: {always}");
            assert_eq!(retry.failures(), 0);
        }
    }

    #[test]
    fn forget_allows_an_attempt_at_once() {
        let t0 = Deadline::from_boottime(Duration::from_secs(1_000));
        let mut retry = Retry::new(policy(true));
        retry.started(t0);
        retry.started(t0);
        retry.failed(t0, Some(Duration::from_secs(300)), 0.5);
        assert!(!retry.due(at(t0, 299.0)));
        retry.forget();
        assert!(retry.due(t0));
    }
}

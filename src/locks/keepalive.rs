//! When a held lease is renewed, released or declared lost: a pure decision over
//! (state, now), carried out by the lease's task. The lease's life is the lease machine's
//! (`redlock::tenure`, with the policy below); what is the app's (keepalives, watch streams)
//! is decided here.
//!
//! ## Rules
//! - **Renew** every ttl/3 after the last acquisition or renewal; after a failed renewal,
//!   again every ttl/10 (the node timeout bounds each attempt).
//! - **Release** once the app stopped keeping the lease alive: no keepalive for one ttl and
//!   no open watch stream. A stream that closes counts as a keepalive at that moment, so a
//!   client that reconnects within the ttl keeps its lease.
//! - **Lost** ttl/5 before the validity ends when no renewal has moved it on: the app hears
//!   `lost` while its lease is still valid, with time to stop writing.
//!
//! Release comes first when both are due: a lease nobody keeps alive is released whatever
//! else happened to it.

use std::time::Duration;

use crate::clock::Deadline;
use crate::redlock::tenure::{self, Event, Failure, Policy, RenewFrom, Tenure};

/// Renew this fraction of the ttl after the last renewal.
const RENEW_DIVISOR: u32 = 3;
/// Retry a failed renewal after this fraction of the ttl.
const RETRY_DIVISOR: u32 = 10;
/// Say `lost` this fraction of the ttl before the validity ends.
const LOST_NOTICE_DIVISOR: u32 = 5;

/// What the lease's task does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Release the lock: the app stopped keeping the lease alive.
    Release,
    /// Tell the app the lease is lost, and stop.
    Lost,
    /// Extend the lock now.
    Renew,
    /// Nothing until this instant (or an event).
    WaitUntil(Deadline),
}

/// A request lease's timing for the lease machine: renew every ttl/3 from the end of the
/// last renewal (leases renewed in one batch stay in step), retry every ttl/10, say `lost`
/// ttl/5 before the validity ends; no pause suspicion (the app hears `lost` by the clock).
pub fn policy(ttl: Duration) -> Policy {
    Policy {
        renew_every: ttl / RENEW_DIVISOR,
        renew_from: RenewFrom::End,
        retry_after: ttl / RETRY_DIVISOR,
        step_down_before: ttl / LOST_NOTICE_DIVISOR,
        pause_after: None,
    }
}

/// A held lease's timing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keepalive {
    ttl: Duration,
    tenure: Tenure,
    kept_alive_until: Deadline,
    watchers: usize,
}

impl Keepalive {
    /// A lease acquired at `now`, valid until `valid_until`.
    pub fn new(ttl: Duration, now: Deadline, valid_until: Deadline) -> Keepalive {
        Keepalive {
            ttl,
            tenure: Tenure::new(policy(ttl), now, valid_until),
            kept_alive_until: now + ttl,
            watchers: 0,
        }
    }

    /// The next step as of `now`.
    pub fn next(&self, now: Deadline) -> Step {
        let abandon_at = (self.watchers == 0).then_some(self.kept_alive_until);
        if abandon_at.is_some_and(|at| now >= at) {
            return Step::Release;
        }
        match self.tenure.poll(now) {
            tenure::Step::StepDown(_) => Step::Lost,
            tenure::Step::Renew => Step::Renew,
            tenure::Step::WaitUntil(wake) => {
                Step::WaitUntil(abandon_at.map_or(wake, |at| at.min(wake)))
            }
        }
    }

    /// When `lost` is said unless a renewal moves the validity on.
    pub fn lost_at(&self) -> Deadline {
        self.tenure.step_down_at()
    }

    /// The validity as last proven.
    pub fn valid_until(&self) -> Deadline {
        self.tenure.valid_until()
    }

    /// The app kept the lease alive at `now`.
    pub fn kept_alive(&mut self, now: Deadline) {
        self.kept_alive_until = self.kept_alive_until.max(now + self.ttl);
    }

    /// A watch stream opened.
    pub fn watcher_joined(&mut self) {
        self.watchers += 1;
    }

    /// A watch stream closed at `now`: it kept the lease alive until then.
    pub fn watcher_left(&mut self, now: Deadline) {
        self.watchers = self.watchers.saturating_sub(1);
        self.kept_alive(now);
    }

    /// A renewal that ended at `now` proved the lock until `valid_until` (never moved
    /// earlier).
    pub fn renewed(&mut self, now: Deadline, valid_until: Deadline) {
        self.tenure.handle(Event::Renewed {
            started: now,
            ended: now,
            valid_until,
        });
    }

    /// A renewal failed at `now` without losing the lock for good.
    pub fn renew_failed(&mut self, now: Deadline) {
        self.tenure.handle(Event::RenewFailed {
            at: now,
            failure: Failure::Retry,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(3);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn held() -> (Keepalive, Deadline) {
        let t0 = Deadline::from_boottime(Duration::from_secs(100));
        (Keepalive::new(TTL, t0, t0 + ms(2900)), t0)
    }

    #[test]
    fn a_fresh_lease_renews_after_a_third_of_its_ttl() {
        let (k, t0) = held();
        assert_eq!(k.next(t0), Step::WaitUntil(t0 + ms(1000)));
        assert_eq!(k.next(t0 + ms(1000)), Step::Renew);
    }

    #[test]
    fn renewals_move_the_next_renewal_and_the_lost_notice() {
        let (mut k, t0) = held();
        k.kept_alive(t0 + ms(1000));
        k.renewed(t0 + ms(1000), t0 + ms(3900));
        assert_eq!(k.next(t0 + ms(1500)), Step::WaitUntil(t0 + ms(2000)));
        assert_eq!(k.lost_at(), t0 + ms(3300));
    }

    #[test]
    fn a_renewal_never_moves_the_validity_earlier() {
        let (mut k, t0) = held();
        k.renewed(t0 + ms(1000), t0 + ms(100));
        assert_eq!(k.valid_until(), t0 + ms(2900));
    }

    #[test]
    fn a_lease_nobody_keeps_alive_is_released_after_its_ttl() {
        let (mut k, t0) = held();
        // Renewals alone do not keep it: only the app does.
        k.renewed(t0 + ms(1000), t0 + ms(3900));
        k.renewed(t0 + ms(2000), t0 + ms(4900));
        assert_eq!(k.next(t0 + ms(2999)), Step::WaitUntil(t0 + ms(3000)));
        assert_eq!(k.next(t0 + ms(3000)), Step::Release);
    }

    #[test]
    fn keepalives_push_the_release_one_ttl_on() {
        let (mut k, t0) = held();
        k.kept_alive(t0 + ms(2500));
        k.renewed(t0 + ms(2500), t0 + ms(5400));
        assert_eq!(k.next(t0 + ms(3000)), Step::WaitUntil(t0 + ms(3500)));
        k.renewed(t0 + ms(3500), t0 + ms(6400));
        k.renewed(t0 + ms(4500), t0 + ms(7400));
        assert_eq!(k.next(t0 + ms(5500)), Step::Release);
    }

    #[test]
    fn an_open_watch_stream_keeps_it_and_its_close_counts_as_a_keepalive() {
        let (mut k, t0) = held();
        k.watcher_joined();
        let mut now = t0;
        for _ in 0..10 {
            now += ms(1000);
            assert_eq!(k.next(now), Step::Renew);
            k.renewed(now, now + ms(2900));
        }
        let left = now;
        k.watcher_left(left);
        for _ in 0..2 {
            now += ms(1000);
            assert_eq!(k.next(now), Step::Renew);
            k.renewed(now, now + ms(2900));
        }
        assert_eq!(k.next(now + ms(999)), Step::WaitUntil(left + TTL));
        assert_eq!(k.next(left + TTL), Step::Release);
    }

    #[test]
    fn failing_renewals_retry_and_end_in_lost_before_the_validity_ends() {
        let (mut k, t0) = held();
        k.kept_alive(t0 + ms(2000));
        k.renew_failed(t0 + ms(1000));
        assert_eq!(k.next(t0 + ms(1100)), Step::WaitUntil(t0 + ms(1300)));
        k.renew_failed(t0 + ms(1300));
        // Retried until ttl/5 = 600 ms before the validity's end at 2900.
        assert_eq!(k.next(t0 + ms(2299)), Step::Renew);
        assert_eq!(k.next(t0 + ms(2300)), Step::Lost);
        assert!(k.lost_at() < k.valid_until());
    }

    #[test]
    fn release_comes_before_lost_when_both_are_due() {
        let (k, t0) = held();
        assert_eq!(k.next(t0 + ms(5000)), Step::Release);
    }
}

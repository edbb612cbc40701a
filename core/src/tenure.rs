//! A held lease's life as a pure state machine over (events, now): when to renew, when to
//! retry a failed renewal, when to step down before the lock can expire anywhere, and until
//! when a lost lease's promise keeps its keys. Every holder drives it: `run`'s leadership
//! (`lease::hold`, and so `guard`), the request-lock leases (`locks::keepalive`) and the
//! protocol model (tests/model), each with its own [`Policy`].
//!
//! ## Rules
//! - **Renew** `renew_every` after the last renewal (counted from the round's start, or from
//!   its end for leases renewed in batches, which then stay in step: [`RenewFrom`]).
//! - **Retry** a renewal that failed without proof of loss `retry_after` later.
//! - **Step down** at `valid_until − step_down_before`, never before the acquisition: the
//!   holder stops acting while its keys still stand on a quorum.
//! - **Contrary evidence ends it at once**: a renewal that finds a quorum of other values
//!   (`superseded`) or of no key (`expired`).
//! - **Pause suspicion** (with `pause_after`): a wake-up later than scheduled by more than
//!   that makes the lease suspect; the next renewal must prove it, or the lease ends
//!   (`paused`). Readers never rely on the holder being awake: they compare the step-down
//!   instant with the clock themselves.
//! - **The kept promise**: however it ended, the keys are released no earlier than
//!   [`Tenure::valid_until`], the end of validity last proven (a renewal never moves it
//!   earlier), unless the app was stopped first (SIGTERM, resign).

use std::time::Duration;

use crate::clock::Deadline;
use crate::round::extend::renewed_end;
use crate::round::Rules;

/// From when the next renewal is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RenewFrom {
    /// The start of the last renewal round (a lease renewed on its own).
    Start,
    /// Its end (leases renewed in one batch stay in step).
    End,
}

/// A holder's timing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Policy {
    /// Time between renewals.
    pub renew_every: Duration,
    /// From when it is counted.
    pub renew_from: RenewFrom,
    /// Delay before retrying a failed renewal.
    pub retry_after: Duration,
    /// Step down this long before the validity ends.
    pub step_down_before: Duration,
    /// A wake-up this much later than scheduled makes the lease suspect (`None`: never).
    pub pause_after: Option<Duration>,
}

/// Why a tenure ended on its own (the `reason` label of `redlock_lock_lost_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ended {
    /// The step-down instant came without a renewal that moved it on.
    Expired,
    /// A quorum holds other values.
    Superseded,
    /// It woke up late and could not prove the lock was still held.
    Paused,
}

impl Ended {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Ended::Expired => "expired",
            Ended::Superseded => "superseded",
            Ended::Paused => "paused",
        }
    }
}

/// How a renewal failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Failure {
    /// Short of a quorum (timeouts, errors): retry.
    Retry,
    /// A quorum shows no key of ours: it expired or was lost.
    Expired,
    /// A quorum shows other values.
    Superseded,
}

/// What happened to the lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Event {
    /// The holder woke at `at` for a wake-up scheduled at `scheduled`.
    Woke {
        /// When it woke.
        at: Deadline,
        /// When it meant to.
        scheduled: Deadline,
    },
    /// A renewal round that ran from `started` to `ended` proved the lock until `valid_until`.
    Renewed {
        /// The round's start.
        started: Deadline,
        /// Its end.
        ended: Deadline,
        /// The end of validity it proved.
        valid_until: Deadline,
    },
    /// A renewal failed at `at`.
    RenewFailed {
        /// When it failed.
        at: Deadline,
        /// How.
        failure: Failure,
    },
}

/// What the holder does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// Run a renewal round now.
    Renew,
    /// Stop acting on the lease; release its keys at [`Tenure::valid_until`].
    StepDown(Ended),
    /// Nothing until this instant (or an event).
    WaitUntil(Deadline),
}

/// One held lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tenure {
    policy: Policy,
    /// All on but in the protocol model (`longest_promise`: a renewal never moves the
    /// validity earlier).
    rules: Rules,
    acquired: Deadline,
    valid_until: Deadline,
    next_renew: Deadline,
    suspect: bool,
    ended: Option<Ended>,
}

impl Tenure {
    /// A lease won by a round that started at `acquired`, valid until `valid_until`; its first
    /// renewal is `renew_every` after `acquired`.
    pub fn new(policy: Policy, acquired: Deadline, valid_until: Deadline) -> Tenure {
        Tenure::resume(policy, acquired, valid_until, acquired + policy.renew_every)
    }

    /// A tenure as a holder that stores only its instants keeps it (the protocol model, whose
    /// states must stay small): acquired at `acquired`, valid until `valid_until`, next
    /// renewal at `next_renew`, neither suspect nor ended.
    pub fn resume(
        policy: Policy,
        acquired: Deadline,
        valid_until: Deadline,
        next_renew: Deadline,
    ) -> Tenure {
        Tenure {
            policy,
            rules: Rules::ALL,
            acquired,
            valid_until,
            next_renew,
            suspect: false,
            ended: None,
        }
    }

    /// The same under `rules` (the model switches rules off to show why each is there).
    pub fn under(self, rules: Rules) -> Tenure {
        Tenure { rules, ..self }
    }

    /// Takes `event` into account.
    pub fn handle(&mut self, event: Event) {
        match event {
            Event::Woke { at, scheduled } => {
                let lag = at.saturating_duration_since(scheduled);
                if self.policy.pause_after.is_some_and(|after| lag > after) {
                    self.suspect = true;
                }
            }
            Event::Renewed {
                started,
                ended,
                valid_until,
            } => {
                self.valid_until = renewed_end(self.rules, self.valid_until, valid_until);
                let from = match self.policy.renew_from {
                    RenewFrom::Start => started,
                    RenewFrom::End => ended,
                };
                self.next_renew = from + self.policy.renew_every;
                self.suspect = false;
            }
            Event::RenewFailed { at, failure } => {
                let ended = match failure {
                    Failure::Superseded => Some(Ended::Superseded),
                    Failure::Expired => Some(Ended::Expired),
                    Failure::Retry if self.suspect => Some(Ended::Paused),
                    Failure::Retry => None,
                };
                match ended {
                    Some(why) => self.ended = self.ended.or(Some(why)),
                    None => self.next_renew = at + self.policy.retry_after,
                }
            }
        }
    }

    /// The next step as of `now`.
    pub fn poll(&self, now: Deadline) -> Step {
        if let Some(why) = self.ended {
            return Step::StepDown(why);
        }
        if now >= self.step_down_at() {
            return Step::StepDown(if self.suspect {
                Ended::Paused
            } else {
                Ended::Expired
            });
        }
        if now >= self.next_renew {
            return Step::Renew;
        }
        Step::WaitUntil(self.poll_timeout())
    }

    /// When to poll again without an event: the next renewal or the step-down.
    pub fn poll_timeout(&self) -> Deadline {
        self.next_renew.min(self.step_down_at())
    }

    /// When the holder stops acting: `step_down_before` ahead of the validity's end, never
    /// before the acquisition.
    pub fn step_down_at(&self) -> Deadline {
        (self.valid_until - self.policy.step_down_before).max(self.acquired)
    }

    /// The end of validity last proven (a renewal never moves it earlier): a lost lease's
    /// keys are released no earlier.
    pub fn valid_until(&self) -> Deadline {
        self.valid_until
    }

    /// When the next renewal is due.
    pub fn next_renew(&self) -> Deadline {
        self.next_renew
    }

    /// Whether a late wake-up made the lease suspect (until a renewal proves it).
    pub fn suspect(&self) -> bool {
        self.suspect
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn at(n: u64) -> Deadline {
        Deadline::from_boottime(ms(100_000 + n))
    }

    const POLICY: Policy = Policy {
        renew_every: Duration::from_millis(1_000),
        renew_from: RenewFrom::Start,
        retry_after: Duration::from_millis(100),
        step_down_before: Duration::from_millis(500),
        pause_after: Some(Duration::from_millis(300)),
    };

    fn held() -> Tenure {
        Tenure::new(POLICY, at(0), at(2_900))
    }

    #[test]
    fn renews_every_interval_from_the_rounds_start() {
        let mut t = held();
        assert_eq!(t.poll(at(0)), Step::WaitUntil(at(1_000)));
        assert_eq!(t.poll(at(1_000)), Step::Renew);
        t.handle(Event::Renewed {
            started: at(1_000),
            ended: at(1_040),
            valid_until: at(3_900),
        });
        assert_eq!(t.poll(at(1_040)), Step::WaitUntil(at(2_000)));
        let batched = Policy {
            renew_from: RenewFrom::End,
            ..POLICY
        };
        let mut b = Tenure::new(batched, at(0), at(2_900));
        b.handle(Event::Renewed {
            started: at(1_000),
            ended: at(1_040),
            valid_until: at(3_900),
        });
        assert_eq!(b.next_renew(), at(2_040));
    }

    #[test]
    fn failed_renewals_retry_until_the_step_down_before_the_validity_ends() {
        let mut t = held();
        t.handle(Event::RenewFailed {
            at: at(1_000),
            failure: Failure::Retry,
        });
        assert_eq!(t.poll(at(1_050)), Step::WaitUntil(at(1_100)));
        assert_eq!(t.poll(at(2_399)), Step::Renew);
        assert_eq!(t.poll(at(2_400)), Step::StepDown(Ended::Expired));
        assert_eq!(t.step_down_at(), at(2_400));
        assert_eq!(
            t.valid_until(),
            at(2_900),
            "the promise outlives the step-down"
        );
    }

    #[test]
    fn contrary_evidence_ends_it_at_once() {
        for (failure, why) in [
            (Failure::Superseded, Ended::Superseded),
            (Failure::Expired, Ended::Expired),
        ] {
            let mut t = held();
            t.handle(Event::RenewFailed {
                at: at(1_000),
                failure,
            });
            assert_eq!(t.poll(at(1_000)), Step::StepDown(why));
        }
    }

    #[test]
    fn a_late_wake_up_must_be_proven_by_the_next_renewal() {
        let mut t = held();
        t.handle(Event::Woke {
            at: at(1_301),
            scheduled: at(1_000),
        });
        assert!(t.suspect());
        let mut failed = t;
        failed.handle(Event::RenewFailed {
            at: at(1_350),
            failure: Failure::Retry,
        });
        assert_eq!(failed.poll(at(1_350)), Step::StepDown(Ended::Paused));
        t.handle(Event::Renewed {
            started: at(1_301),
            ended: at(1_340),
            valid_until: at(4_200),
        });
        assert!(!t.suspect(), "proven");
        // A wake-up past the step-down instant while suspect is a pause, not an expiry.
        let mut slept = held();
        slept.handle(Event::Woke {
            at: at(2_500),
            scheduled: at(1_000),
        });
        assert_eq!(slept.poll(at(2_500)), Step::StepDown(Ended::Paused));
        // Without the policy, lateness is never suspect.
        let mut lax = Tenure::new(
            Policy {
                pause_after: None,
                ..POLICY
            },
            at(0),
            at(2_900),
        );
        lax.handle(Event::Woke {
            at: at(2_000),
            scheduled: at(1_000),
        });
        assert!(!lax.suspect());
    }

    #[test]
    fn a_renewal_never_moves_the_validity_earlier_and_the_step_down_never_precedes_the_win() {
        let mut t = held();
        t.handle(Event::Renewed {
            started: at(1_000),
            ended: at(1_010),
            valid_until: at(100),
        });
        assert_eq!(t.valid_until(), at(2_900));
        let short = Tenure::new(POLICY, at(0), at(200));
        assert_eq!(short.step_down_at(), at(0));
        assert_eq!(short.poll(at(0)), Step::StepDown(Ended::Expired));
    }
}

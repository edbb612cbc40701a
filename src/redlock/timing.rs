//! The arithmetic of the algorithm: quorum, clock drift, validity, retry delays.
//!
//! All durations are measured on the monotonic clock and combined with checked
//! arithmetic: a validity that would be negative is `None`, never a wrapped number.

use std::time::Duration;

use rand::Rng;

/// Share of the ttl allowed for clock drift between client and nodes (the Redlock spec's 1%).
pub const CLOCK_DRIFT_FACTOR: f64 = 0.01;
/// Fixed drift added for timer granularity on the nodes.
pub const CLOCK_DRIFT_FLOOR: Duration = Duration::from_millis(2);

/// The longest `--ttl` or `--max-ttl` any contender may use. A node that has kept its data
/// for longer than this (plus drift) counts whatever ttl anyone uses, so its grant can be
/// counted before the other nodes have answered (see `votes`).
pub const MAX_TTL: Duration = Duration::from_secs(3600);

/// Votes needed among `nodes`: a strict majority.
pub fn quorum(nodes: usize) -> usize {
    nodes / 2 + 1
}

/// Clock drift allowed for a lock of this ttl: `ttl × 1% + 2 ms`.
pub fn drift(ttl: Duration) -> Duration {
    ttl.mul_f64(CLOCK_DRIFT_FACTOR) + CLOCK_DRIFT_FLOOR
}

/// What is left of a lock set with `ttl` after `elapsed`: `ttl − elapsed − drift`,
/// or `None` when nothing is left.
pub fn validity(ttl: Duration, elapsed: Duration) -> Option<Duration> {
    ttl.checked_sub(elapsed)?
        .checked_sub(drift(ttl))
        .filter(|left| !left.is_zero())
}

/// A random delay before retry `attempt` (0-based): uniform in `[cap/2, cap]` where
/// `cap = min(base × 2^attempt, max)`. Random so that contenders spread out; growing so
/// that a struggling fleet is not hammered; bounded so that a waiter still notices.
pub fn retry_delay(base: Duration, max: Duration, attempt: u32) -> Duration {
    let cap = base.saturating_mul(1u32 << attempt.min(16)).min(max);
    let half = cap / 2;
    half + rand::rng().random_range(Duration::ZERO..=half)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quorum_is_a_strict_majority() {
        assert_eq!(
            [1, 2, 3, 4, 5, 7].map(quorum),
            [1, 2, 2, 3, 3, 4],
            "quorum for 1, 2, 3, 4, 5, 7 nodes"
        );
    }

    #[test]
    fn drift_is_one_percent_plus_two_milliseconds() {
        assert_eq!(drift(Duration::from_secs(10)), Duration::from_millis(102));
    }

    #[test]
    fn validity_subtracts_elapsed_and_drift() {
        let ttl = Duration::from_secs(10);
        assert_eq!(
            validity(ttl, Duration::from_millis(898)),
            Some(Duration::from_secs(9))
        );
    }

    #[test]
    fn validity_never_underflows() {
        let ttl = Duration::from_millis(100);
        assert_eq!(validity(ttl, Duration::from_millis(99)), None);
        assert_eq!(validity(ttl, Duration::from_secs(5)), None);
        assert_eq!(validity(ttl, Duration::from_millis(97)), None, "zero left");
    }

    #[test]
    fn retry_delay_grows_and_stays_bounded() {
        let base = Duration::from_millis(100);
        let max = Duration::from_secs(1);
        for attempt in 0..40 {
            let cap = (base * 2u32.pow(attempt.min(10))).min(max);
            let d = retry_delay(base, max, attempt);
            assert!(
                d >= cap / 2 && d <= cap,
                "attempt {attempt}: {d:?} vs cap {cap:?}"
            );
        }
    }
}

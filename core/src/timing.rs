//! The arithmetic of the algorithm: quorum, clock drift, validity, backoff.
//!
//! All durations are measured on the monotonic clock and combined with checked
//! arithmetic: a validity that would be negative is `None`, never a wrapped number.

use std::time::Duration;

use crate::clock::Deadline;

/// Share of the ttl allowed for clock drift between client and nodes (the Redlock spec's 1%).
pub const CLOCK_DRIFT_FACTOR: f64 = 0.01;
/// Fixed drift added for timer granularity on the nodes.
pub const CLOCK_DRIFT_FLOOR: Duration = Duration::from_millis(2);

/// How many times the longest ttl the lock's max-ttl register and node-set record live (see
/// `votes`, rules 3 and 7). A renewal rewrites them once less than one ttl is left, so the
/// longer they live, the rarer that write: at 4, one renewal in about nine (a renewal every
/// third of the ttl), where 2 made it one in three and cost a renewal 0.3× the classic
/// owner-checked one. The price is rule 7's bound: a departed holder's record keeps contenders
/// that list other servers out for up to this many ttls after its last renewal.
pub const RECORD_LIFE: u32 = 4;

/// Longest `ttl` (and `max_ttl`) accepted: an hour. A node that has kept its data for longer
/// than this (plus drift) counts whatever ttl anyone uses, so its grant can be counted before
/// the other nodes have answered (see `votes`); the bound also keeps every deadline sum far
/// from overflow.
pub const MAX_TTL: Duration = Duration::from_secs(3600);
/// Longest bound on one call to one node. A round waits this long for a silent node.
pub const MAX_NODE_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest bound on making a connection (TCP, TLS, AUTH).
pub const MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest first retry delay (and longest poll period of a waiter).
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(60);
/// Longest fencing-counter retention: a year (365.25 days, humantime's `1y`).
pub const MAX_FENCE_RETENTION: Duration = Duration::from_secs(31_557_600);

/// How long after its start an acquire round reads again the max-ttl register of a node that
/// did not answer in time, before it counts young nodes' grants without it (`round::acquire`,
/// rule 5): long enough for a connection to be set up (`connect_timeout`) or a slow node to
/// answer a few node timeouts late, and at most half the ttl, so that a round that waited the
/// whole window still leads with half its validity.
pub fn recheck_window(
    ttl: Duration,
    node_timeout: Duration,
    connect_timeout: Duration,
) -> Duration {
    connect_timeout
        .max(node_timeout.saturating_mul(4))
        .min(ttl / 2)
}

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

/// The end of validity after a renewal that started at `start` and proved `valid`: never
/// earlier than `previous`. A slow renewal round (a pause in the middle of it) proves less
/// than the round before it did, but the app may act on the end it was told before, and
/// every key of that promise still stands (a renewal only pushes expiries later). Moving
/// the end earlier would release the lock, after a loss, while that promise still runs.
/// Found by the protocol model (tests/model).
pub fn renewed_until(previous: Deadline, start: Deadline, valid: Duration) -> Deadline {
    (start + valid).max(previous)
}

/// The delay before retry `attempt` (0-based) for a uniform `draw` in `[0, 1]`: in
/// `[cap/2, cap]` where `cap = min(base × 2^attempt, max)`. Random so that contenders spread
/// out; growing so that a struggling fleet is not hammered; bounded so that a waiter still
/// notices.
pub fn backoff_delay(base: Duration, max: Duration, attempt: u32, draw: f64) -> Duration {
    equal_jitter(backoff_ceiling(base, 2, max, attempt), draw)
}

/// The ceiling of backoff `attempt` (0-based): `first × factor^attempt`, at most `cap`.
pub fn backoff_ceiling(first: Duration, factor: u32, cap: Duration, attempt: u32) -> Duration {
    let mut ceiling = first;
    for _ in 0..attempt.min(64) {
        if ceiling >= cap {
            break;
        }
        ceiling = ceiling.saturating_mul(factor);
    }
    ceiling.min(cap)
}

/// "Equal jitter": uniform in `[ceiling/2, ceiling]` for a uniform `draw` in `[0, 1]`.
pub fn equal_jitter(ceiling: Duration, draw: f64) -> Duration {
    let half = ceiling / 2;
    half + half.mul_f64(draw.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recheck_waits_for_a_connection_or_a_few_node_timeouts_within_half_the_ttl() {
        let ms = Duration::from_millis;
        assert_eq!(recheck_window(ms(10_000), ms(50), ms(1_000)), ms(1_000));
        assert_eq!(recheck_window(ms(10_000), ms(500), ms(1_000)), ms(2_000));
        assert_eq!(recheck_window(ms(1_000), ms(200), ms(1_000)), ms(500));
    }

    #[test]
    fn a_slow_renewal_never_moves_the_end_of_validity_earlier() {
        let t0 = Deadline::from_boottime(Duration::from_secs(100));
        let ttl = Duration::from_secs(10);
        let previous = t0 + ttl;
        // Started 1 s later, but the round took 4 s: it proves only up to t0 + 7 s.
        let slow = validity(ttl, Duration::from_secs(4)).unwrap();
        let start = t0 + Duration::from_secs(1);
        assert!(start + slow < previous);
        assert_eq!(renewed_until(previous, start, slow), previous);
        // A quick round moves it later.
        let quick = validity(ttl, Duration::from_millis(5)).unwrap();
        assert_eq!(renewed_until(previous, start, quick), start + quick);
    }

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
}

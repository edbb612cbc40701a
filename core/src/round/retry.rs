//! How a wait for the lock retries: until when, and how long it sleeps between rounds.

use std::time::Duration;

use crate::clock::Deadline;
use crate::error::NodeErrorKind;
use crate::error::{LockError, Vote, Votes};
use crate::timing::{backoff_delay, drift, CLOCK_DRIFT_FLOOR};

/// Until when a wait with `deadline` retries after a round that failed with `err`; `next` is
/// when the next round would start. Past the deadline, only rounds that said nothing about a
/// holder are retried, each for a bounded time:
/// - a split among contenders, and a round too slow to count (timeouts or connection errors
///   left it short of a quorum, or it took the whole validity): up to one ttl past the
///   deadline. A busy host that misses the node timeout once is not an outage; by then every
///   key of such a round has expired. A node that stays down still ends the wait then.
/// - votes that count soon: until they do (at most the longest ttl + drift).
pub fn retry_until(err: &LockError, deadline: Deadline, ttl: Duration, next: Deadline) -> Deadline {
    match err {
        LockError::Contended { .. } | LockError::ValidityTooShort { .. } => deadline + ttl,
        LockError::QuorumUnreachable { votes, .. } if slow_or_unreachable(votes) => deadline + ttl,
        LockError::NotYetTrusted { .. } => deadline.max(next + CLOCK_DRIFT_FLOOR),
        _ => deadline,
    }
}

/// Whether some node failed to answer in time or could not be reached: a retry may get its
/// vote. Other failures (a wrong password, a node that may evict keys) stay as they are.
fn slow_or_unreachable(votes: &Votes) -> bool {
    votes.0.iter().any(|(_, vote)| {
        matches!(vote, Vote::Failed(err) if matches!(err.kind, NodeErrorKind::Timeout | NodeErrorKind::Connection))
    })
}

/// The backoff between rounds of a wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// The first delay (`--retry-delay`).
    pub base: Duration,
    /// The longest delay.
    pub max: Duration,
    /// Rounds retried so far since the last progress (0-based).
    pub attempt: u32,
}

impl Backoff {
    /// How long to sleep after a round that failed with `err`; `draw` is a uniform random
    /// number in `[0, 1]`.
    /// - Nodes that count soon: until they do, plus their drift (their clocks may run up to
    ///   the drift factor slower than ours).
    /// - Otherwise random and growing, so a struggling fleet is not hammered:
    ///   [`backoff_delay`].
    pub fn delay_after(&self, err: &LockError, draw: f64) -> Duration {
        match err {
            LockError::NotYetTrusted { ready_in, .. } => *ready_in + drift(*ready_in),
            _ => backoff_delay(self.base, self.max, self.attempt, draw),
        }
    }

    /// One more attempt.
    pub fn next(&mut self) {
        self.attempt = self.attempt.saturating_add(1);
    }

    /// Progress (a release, the lock seen free): start small again.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::NodeError;

    fn votes(failed: &[NodeErrorKind]) -> Votes {
        let mut votes = vec![("a:1".to_owned(), Vote::Granted)];
        for (i, kind) in failed.iter().enumerate() {
            let err = NodeError {
                kind: *kind,
                message: String::new(),
            };
            votes.push((format!("n{i}:1"), Vote::Failed(err)));
        }
        Votes(votes)
    }

    fn unreachable(failed: &[NodeErrorKind]) -> LockError {
        LockError::QuorumUnreachable {
            lock: "l".to_owned(),
            needed: 2,
            votes: votes(failed),
        }
    }

    fn at(ms: u64) -> Deadline {
        Deadline::from_boottime(Duration::from_millis(ms))
    }

    #[test]
    fn rounds_short_of_a_quorum_for_timeouts_or_connection_errors_are_retried_for_one_ttl() {
        let deadline = at(1_000);
        let ttl = Duration::from_secs(10);
        let next = at(1_200);
        for failed in [
            &[NodeErrorKind::Timeout, NodeErrorKind::Timeout][..],
            &[NodeErrorKind::Connection, NodeErrorKind::Timeout],
            &[NodeErrorKind::Auth, NodeErrorKind::Connection],
        ] {
            let err = unreachable(failed);
            assert_eq!(
                retry_until(&err, deadline, ttl, next),
                deadline + ttl,
                "{err}"
            );
        }
        let slow = LockError::ValidityTooShort {
            lock: "l".to_owned(),
            elapsed: ttl,
            ttl,
        };
        assert_eq!(retry_until(&slow, deadline, ttl, next), deadline + ttl);
        let split = LockError::Contended {
            lock: "l".to_owned(),
            votes: Votes::default(),
        };
        assert_eq!(retry_until(&split, deadline, ttl, next), deadline + ttl);
    }

    #[test]
    fn other_failures_end_the_wait_at_its_deadline() {
        let deadline = at(1_000);
        let ttl = Duration::from_secs(10);
        let next = at(1_200);
        // Nodes that answered but cannot count, or refuse our password: a retry changes nothing.
        let refused = unreachable(&[NodeErrorKind::Auth, NodeErrorKind::Protocol]);
        assert_eq!(retry_until(&refused, deadline, ttl, next), deadline);
        let not_counted = LockError::QuorumUnreachable {
            lock: "l".to_owned(),
            needed: 2,
            votes: Votes(vec![(
                "a:1".to_owned(),
                Vote::NotCounted("may evict keys".to_owned()),
            )]),
        };
        assert_eq!(retry_until(&not_counted, deadline, ttl, next), deadline);
        let busy = LockError::Busy {
            lock: "l".to_owned(),
            holder: None,
            holder_ttl: None,
            holder_fence: 0,
            votes: Votes::default(),
        };
        assert_eq!(retry_until(&busy, deadline, ttl, next), deadline);
        let conflict = LockError::NodeSetConflict {
            lock: "l".to_owned(),
            votes: Votes::default(),
        };
        assert_eq!(retry_until(&conflict, deadline, ttl, next), deadline);
        // Votes that count soon: waited for, past the deadline if need be.
        let soon = LockError::NotYetTrusted {
            lock: "l".to_owned(),
            ready_in: Duration::from_secs(3),
            votes: Votes::default(),
        };
        let later = at(4_000);
        assert_eq!(
            retry_until(&soon, deadline, ttl, later),
            later + CLOCK_DRIFT_FLOOR
        );
    }

    #[test]
    fn the_backoff_grows_stays_bounded_and_waits_for_young_nodes() {
        let backoff = |attempt| Backoff {
            base: Duration::from_millis(100),
            max: Duration::from_secs(1),
            attempt,
        };
        let busy = LockError::Contended {
            lock: "l".to_owned(),
            votes: Votes::default(),
        };
        assert_eq!(
            backoff(0).delay_after(&busy, 0.0),
            Duration::from_millis(50)
        );
        assert_eq!(
            backoff(0).delay_after(&busy, 1.0),
            Duration::from_millis(100)
        );
        assert_eq!(
            backoff(3).delay_after(&busy, 1.0),
            Duration::from_millis(800)
        );
        assert_eq!(
            backoff(30).delay_after(&busy, 0.0),
            Duration::from_millis(500)
        );
        let soon = LockError::NotYetTrusted {
            lock: "l".to_owned(),
            ready_in: Duration::from_secs(1),
            votes: Votes::default(),
        };
        assert_eq!(
            backoff(5).delay_after(&soon, 0.5),
            Duration::from_secs(1) + drift(Duration::from_secs(1))
        );
        let mut b = backoff(0);
        b.next();
        b.next();
        assert_eq!(b.attempt, 2);
        b.reset();
        assert_eq!(b.attempt, 0);
    }
}

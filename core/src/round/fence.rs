//! Raising the fencing counter when a won round's candidate token was not stored on a quorum
//! (see `fencing`, "How a token is minted", step 3).
//!
//! Each node raises its counter to the proposed token and answers with the counter it had.
//! The token is ours only if every answer of the deciding quorum was lower; else the next
//! attempt proposes a token above the highest answer, at most [`RAISE_ATTEMPTS`] times.

use crate::error::{NodeError, NodeErrorKind};
use crate::error::{Tally, Vote};

/// The largest token: Lua compares counters as doubles, exact below 2^53. A node reporting
/// a higher counter is answering garbage (see `acquire`), and no token is minted above it.
pub const MAX_TOKEN: u64 = (1 << 53) - 1;

/// The token to propose above `highest` when the wall clock reads `wall_ms` (Unix ms): above
/// every counter seen, at least the wall clock, and below 2^53.
pub fn token_above(highest: u64, wall_ms: u64) -> u64 {
    highest.saturating_add(1).max(wall_ms).min(MAX_TOKEN)
}

/// Raise rounds before an acquisition gives up (each one starts above every counter the
/// previous one saw, so only a fleet minting in a tight loop needs more).
pub const RAISE_ATTEMPTS: usize = 3;

/// What the caller does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RaiseStep {
    /// Feed in the next answer.
    Listen,
    /// The token is ours.
    Minted(u64),
    /// A node had a counter at least as high: raise again, to this token.
    Again(u64),
    /// No quorum answered, or the attempts ran out: these were the last votes.
    Failed(Vec<Option<Vote>>),
}

/// One raise round (attempt `attempt`, 0-based) proposing `token`.
pub struct FenceRaise {
    token: u64,
    attempt: usize,
    tally: Tally,
    /// The highest counter among the answers that decided the round.
    highest: u64,
    /// The highest counter any answer showed, late ones included.
    seen: u64,
}

impl FenceRaise {
    /// Attempt `attempt` over `nodes` nodes, proposing `token`.
    pub fn new(nodes: usize, token: u64, attempt: usize) -> FenceRaise {
        FenceRaise {
            token,
            attempt,
            tally: Tally::new(nodes),
            highest: 0,
            seen: 0,
        }
    }

    /// The token proposed.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// Which attempt this is (0-based).
    pub fn attempt(&self) -> usize {
        self.attempt
    }

    /// The highest counter seen, and the token proposed: the next candidate starts above it.
    pub fn fence_seen(&self) -> u64 {
        self.seen.max(self.token)
    }

    /// Node `index`'s answer: the counter it had before (the script's reply), or an error.
    pub fn handle(&mut self, index: usize, answer: Result<String, NodeError>) {
        let before = answer.and_then(|before| parse_counter(&before));
        if let Ok(before) = &before {
            self.seen = self.seen.max(*before);
        }
        if self.tally.decided() {
            // Late: only the counter is taken.
            return;
        }
        let vote = match before {
            Ok(before) => {
                self.highest = self.highest.max(before);
                Vote::Granted
            }
            Err(err) => Vote::Failed(err),
        };
        self.tally.record(index, vote);
    }

    /// What to do next; `wall_ms` is the client's wall clock (Unix ms), the floor of a next
    /// token.
    pub fn poll(&self, wall_ms: u64) -> RaiseStep {
        if !self.tally.decided() {
            return RaiseStep::Listen;
        }
        if !self.tally.won() {
            return RaiseStep::Failed(self.tally.votes.clone());
        }
        if self.highest < self.token && self.token <= MAX_TOKEN {
            return RaiseStep::Minted(self.token);
        }
        if self.attempt + 1 < RAISE_ATTEMPTS {
            RaiseStep::Again(token_above(self.highest, wall_ms))
        } else {
            RaiseStep::Failed(self.tally.votes.clone())
        }
    }
}

/// The counter a raise answer reports; at or above 2^53 it is garbage (see `fencing`).
fn parse_counter(before: &str) -> Result<u64, NodeError> {
    match before.parse::<u64>() {
        Ok(before) if before <= MAX_TOKEN => Ok(before),
        _ => Err(NodeError {
            kind: NodeErrorKind::Protocol,
            message: format!("fencing counter {before:?} is not below 2^53"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeout() -> NodeError {
        NodeError::timeout(std::time::Duration::from_millis(50))
    }

    #[test]
    fn a_quorum_of_lower_counters_mints_the_token() {
        let mut raise = FenceRaise::new(3, 100, 0);
        raise.handle(2, Ok("7".into()));
        assert_eq!(raise.poll(0), RaiseStep::Listen);
        raise.handle(0, Ok("99".into()));
        assert_eq!(raise.poll(0), RaiseStep::Minted(100));
    }

    #[test]
    fn a_higher_counter_in_the_quorum_raises_again_above_it_until_the_attempts_run_out() {
        let mut raise = FenceRaise::new(3, 100, 0);
        raise.handle(0, Ok("150".into()));
        raise.handle(1, Ok("1".into()));
        assert_eq!(raise.poll(0), RaiseStep::Again(151));
        assert_eq!(
            raise.poll(500),
            RaiseStep::Again(500),
            "the wall clock is a floor"
        );
        let mut last = FenceRaise::new(3, 100, RAISE_ATTEMPTS - 1);
        last.handle(0, Ok("150".into()));
        last.handle(1, Ok("1".into()));
        assert!(matches!(last.poll(0), RaiseStep::Failed(_)));
    }

    #[test]
    fn no_quorum_of_answers_or_garbage_fails() {
        let mut raise = FenceRaise::new(3, 100, 0);
        raise.handle(0, Err(timeout()));
        raise.handle(1, Ok(format!("{}", MAX_TOKEN + 1)));
        assert!(matches!(raise.poll(0), RaiseStep::Failed(votes) if votes[1].is_some()));
        // A late answer still lifts what the next candidate starts above.
        raise.handle(2, Ok("400".into()));
        assert_eq!(raise.fence_seen(), 400);
    }
}

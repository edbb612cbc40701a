//! Fencing tokens: numbers that only grow, so a store can refuse a stale holder.
//!
//! A holder that pauses (GC, SIGSTOP, a slow VM) past its validity still believes it
//! holds the lock when it wakes. No lock can prevent that; the protected store can
//! catch it, if every write carries a token and the store refuses any token lower
//! than one it has already seen.
//!
//! ## How a token is minted
//! Every node keeps a counter per lock (`redlock:{name}:fence`, no expiry).
//! 1. The client proposes a candidate, `max(highest counter it has seen + 1, now in Unix ms)`.
//!    The acquire script, on a grant, stores it if the node's counter is lower, and says so.
//! 2. If a quorum of counted grants stored the candidate, it is the token: one round trip.
//! 3. Otherwise some node already had a counter at least as high (two acquisitions in the
//!    same millisecond, or a client whose clock is behind). The token is then
//!    `max(highest counter seen + 1, now in Unix ms)` and is written back with set-if-greater
//!    on every node; the acquisition succeeds only once a quorum has stored it.
//! 4. Renewals write the token again, which repairs nodes that lost it in a restart.
//!
//! Either way a token is handed out only after a quorum holds a counter at least as high.

//! ## What it guarantees
//! Any two quorums share a node. The previous holder's token was stored on a quorum
//! before that holder could use it, so the next acquisition's quorum includes a node whose
//! counter is at least that token: a candidate is stored there only if it is greater, and a
//! write-back token is minted above it. **Tokens strictly increase across acquisitions** as
//! long as at least one node of the quorum that stored the previous token still remembers it.
//!
//! ## When it could go backwards
//! Only when every node of the quorum that stored the last token has lost its data
//! before the next acquisition (restarts without persistence, `FLUSHALL`, eviction
//! under a `maxmemory-policy` other than `noeviction`). Even then the wall-clock floor
//! (`now` in Unix milliseconds) keeps new tokens above old ones unless the new holder's
//! clock is behind the old holder's by more than the time between the two acquisitions.
//! Tokens stay below 2^53, the range in which the Lua scripts compare them exactly.

use std::time::{SystemTime, UNIX_EPOCH};

/// The token for an acquisition that saw `highest` as the largest counter on its quorum.
pub fn next_token(highest: u64) -> u64 {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    highest.saturating_add(1).max(now_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_token_exceeds_the_highest_seen() {
        let far_future = 1u64 << 52;
        assert_eq!(next_token(far_future), far_future + 1);
    }

    #[test]
    fn next_token_is_at_least_the_wall_clock_after_data_loss() {
        let before = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        assert!(next_token(0) >= before);
    }
}

//! Fencing tokens: numbers that only grow, so a store can refuse a stale holder.
//!
//! A holder that pauses (GC, SIGSTOP, a slow VM) past its validity still believes it
//! holds the lock when it wakes. No lock can prevent that; the protected store can
//! catch it, if every write carries a token and the store refuses any token lower
//! than one it has already seen.
//!
//! ## How a token is minted
//! Every node keeps a counter per lock (`redlock:{name}:fence`), kept for the fence
//! retention (default 24 h) after its last write; grants, restores and renewals write it (a
//! renewal every `PROOF_EVERY`th time, and wherever the key is gone).
//!
//! A lock in a **namespace** (request locks, [`RedlockConfig::fence_namespace`]) uses instead
//! the counter its namespace keeps for the lock key's hash slot, `redlock:{TAG}:fence:NS`
//! ([`counter_key`]; `TAG` hashes to that slot, so in Redis Cluster the counter sits on the
//! lock's shard). Every name of the namespace in that slot raises the same counter, so a
//! node keeps at most one counter per slot in use (16,384) per namespace however many names
//! were locked, not one per name for a day. Nothing below changes: a counter that other
//! names also raise still only grows, so the argument holds name by name; the other names'
//! raises only make a grant find the counter at or above its candidate more often, which
//! costs a raise round, not safety. Tokens of different names may be equal: they fence
//! different resources.
//!
//! [`RedlockConfig::fence_namespace`]: super::RedlockConfig::fence_namespace
//! 1. The client proposes a candidate, `max(highest counter it has seen + 1, now in Unix ms)`.
//!    "Seen" covers every answer, including those that arrive after a round was decided.
//!    The acquire script, on a grant, stores the candidate if the node's counter is lower.
//! 2. If a quorum of *counted* grants stored the candidate (each of those nodes had a lower
//!    counter), it is the token: one round trip.
//! 3. Otherwise a node already had a counter at least as high. A raise round proposes
//!    `max(highest seen + 1, now)`; every node raises its counter to it and answers with the
//!    counter it had. The token is ours only if every answer in the deciding quorum was lower;
//!    else the next raise starts above the highest answer (at most three raises).
//!
//! Either way a token is handed out only once a quorum of nodes had a lower counter and now
//! holds the token. A node that lost it lost the holder's key too: the renewal that finds the
//! key gone writes it again, and the restore.
//!
//! ## What it guarantees
//! Let A be an acquisition with token `a`, and B a later one (B's round starts after A's
//! token was stored) with token `b`. Then **`b > a`** when at least one of these holds:
//! 1. **A node of B's deciding quorum still has A's counter** (or a higher one). B's quorum
//!    and the quorum that stored `a` share at least one node; B's votes count only from nodes
//!    that kept their data for the longest ttl plus drift (see `votes`), so such a node lost
//!    nothing since then unless that loss is older than a whole ttl. This is the common case
//!    and does not depend on any clock.
//! 2. **Otherwise**, every node of B's quorum lost the counter: by data loss at least
//!    `ttl + drift` before B (the vote rule), or by the retention expiring after A's holder
//!    stopped renewing. Then `b ≥` B's client clock in Unix ms, and `a ≤` A's client clock at
//!    minting (plus one per token minted within the same millisecond). So `b > a` as long
//!    as B's clock is not behind A's by the time between the two (at least one ttl after a
//!    data loss, at least the retention after an expiry).
//!
//! ## When it could go backwards
//! Only in case 2 with clocks further apart than that: e.g. a majority of nodes flushed,
//! and the next holder's clock more than a ttl behind the previous holder's. A client clock
//! far *ahead* inflates tokens (harmless while counters live), and a later client with a
//! correct clock mints below them once every counter of its quorum is gone.
//! Tokens stay below 2^53, the range in which the Lua scripts compare them exactly.

use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use super::error::Votes;
use super::round::{FenceRaise, RaiseStep};
use super::{Op, Order, Redlock, RAISE_FENCE};

/// The key of the fencing counter of lock `name`: its own, or the one `namespace` shares
/// per hash slot (see the module documentation).
pub fn counter_key(name: &str, namespace: Option<&str>) -> String {
    match namespace {
        None => format!("redlock:{{{name}}}:fence"),
        Some(namespace) => {
            let tag = super::transport::cluster::slot_tag(super::pool::slot_of(name));
            format!("redlock:{{{tag}}}:fence:{namespace}")
        }
    }
}

pub use super::round::fence::{token_above, MAX_TOKEN};

impl Redlock {
    /// The next token to propose above `highest` (see [`next_token`]).
    pub(super) fn next_token(&self, highest: u64) -> u64 {
        next_token(highest, self.inner.cfg.wall_clock_skew_ms)
    }

    /// Mints a token of at least `token` on a quorum: each node raises its counter to it and
    /// reports the counter it had. The token is ours only if every counted node had a lower
    /// one; otherwise the next try starts above the highest reported (late answers included).
    /// The decisions are [`FenceRaise`]'s.
    pub(super) async fn raise_fence(&self, token: u64) -> Result<u64, Votes> {
        let n = self.inner.nodes.len();
        let mut raise = FenceRaise::new(n, token, 0);
        loop {
            let mut answers = self.fan_out::<String>(
                Op::Fence,
                Order::Free,
                &RAISE_FENCE,
                vec![
                    String::new(),
                    String::new(),
                    raise.token().to_string(),
                    self.inner.retention_ms(),
                ],
            );
            let mut step = raise.poll(self.wall_ms());
            while step == RaiseStep::Listen {
                let Some((index, answer)) = answers.recv().await else {
                    break;
                };
                raise.handle(index, answer.map(|(before, _)| before));
                step = raise.poll(self.wall_ms());
            }
            self.inner
                .fence_seen
                .fetch_max(raise.fence_seen(), Ordering::Relaxed);
            let attempt = raise.attempt();
            // Answers after the decision still lift what the next candidate starts above.
            let this = self.clone();
            tokio::spawn(async move {
                while let Some((index, answer)) = answers.recv().await {
                    raise.handle(index, answer.map(|(before, _)| before));
                }
                this.inner
                    .fence_seen
                    .fetch_max(raise.fence_seen(), Ordering::Relaxed);
            });
            raise = match step {
                RaiseStep::Minted(token) => return Ok(token),
                RaiseStep::Again(next) => FenceRaise::new(n, next, attempt + 1),
                RaiseStep::Failed(votes) => return Err(self.label_votes(votes)),
                // Every call ends in an answer, so a round cannot run out of them undecided.
                RaiseStep::Listen => return Err(Votes::default()),
            };
        }
    }

    /// This client's wall clock in Unix ms, shifted by the test skew.
    fn wall_ms(&self) -> u64 {
        wall_ms(self.inner.cfg.wall_clock_skew_ms)
    }
}

/// This client's wall clock in Unix ms, shifted by `skew_ms` (tests only; 0 in production).
pub fn wall_ms(skew_ms: i64) -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .saturating_add_signed(skew_ms)
}

/// The token to propose above `highest`, with the wall clock as a floor. `skew_ms` shifts
/// this client's clock (tests only; 0 in production).
pub fn next_token(highest: u64, skew_ms: i64) -> u64 {
    token_above(highest, wall_ms(skew_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_token_exceeds_the_highest_seen() {
        let far_future = 1u64 << 52;
        assert_eq!(next_token(far_future, 0), far_future + 1);
    }

    #[test]
    fn next_token_is_at_least_the_wall_clock_after_data_loss() {
        let before = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        assert!(next_token(0, 0) >= before);
        assert!(
            next_token(0, -60_000) < before,
            "a clock behind gives a lower floor"
        );
    }

    #[test]
    fn a_namespace_shares_one_counter_per_slot_on_the_lock_keys_slot() {
        use crate::redlock::transport::cluster::key_slot;
        assert_eq!(counter_key("jobs", None), "redlock:{jobs}:fence");
        let names: Vec<String> = (0..5000).map(|i| format!("app:order-{i}")).collect();
        let mut counters = std::collections::HashSet::new();
        for name in &names {
            let key = counter_key(name, Some("app"));
            assert!(key.ends_with("}:fence:app"), "{key}");
            // In Redis Cluster one script touches both: they must share a slot.
            assert_eq!(
                key_slot(&key),
                key_slot(&format!("redlock:{{{name}}}")),
                "{key}"
            );
            counters.insert(key);
        }
        // 5,000 names over 16,384 slots: many share, and never more than one per slot.
        let slots: std::collections::HashSet<u16> = names
            .iter()
            .map(|name| key_slot(&format!("redlock:{{{name}}}")))
            .collect();
        assert_eq!(counters.len(), slots.len());
        assert!(counters.len() < names.len());
        assert_ne!(
            counter_key("app:x", Some("app")),
            counter_key("app:x", Some("other"))
        );
    }
}

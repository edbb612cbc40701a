//! Which votes count: the rules that keep a node that lost data from granting a second lock.
//!
//! Redlock's safety rests on every node of a quorum remembering the keys it granted for as
//! long as they live. A node that loses data (a restart without persistence, a restart from a
//! snapshot, `FLUSHALL`/`FLUSHDB`, eviction, a failover to a replica that missed writes) may
//! grant our `SET NX` although another holder's key was on it a moment ago.
//!
//! ## The rules
//! 1. **Data age.** A grant counts only if the node proves it has kept its data for at least
//!    the longest ttl any contender of the lock uses, plus that ttl's drift. The proof is the
//!    node's epoch marker (see `scripts::ACQUIRE`): its age, on the node's own clock, is how
//!    long the node has provably kept its data. Every key another holder could still rely on
//!    was written less than one ttl ago, so it was written after the marker and would still
//!    be there.
//! 2. **The longest ttl** is the largest of our `--ttl`, `--max-ttl`, and every value any node
//!    ever reported from the lock's max-ttl register (written by every grant, renewal and
//!    restore, living twice its ttl). Mixed ttls are therefore safe as long as a contender has
//!    heard of the longest one: from its own configuration, or from any node that holds the
//!    register. `--max-ttl` closes the remaining gap (every node that holds the register lost
//!    it or is unreachable at once).
//! 3. **Eviction.** A node whose `maxmemory-policy` is not `noeviction` can drop a lock key
//!    under memory pressure without any trace; its grants never count, unless the operator
//!    accepts that with `--allow-evicting-nodes`.
//! 4. **Trusted again** once the marker is old enough: no memory of earlier verdicts is kept,
//!    each answer is judged on what the node proves in that same atomic script.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::node::NodeFacts;
use super::timing::drift;
use super::Redlock;

/// The data-age proof one node gave in one answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Proof {
    /// How long the node has provably kept its data (its epoch marker's age).
    pub data_age: Duration,
    /// The lock's max-ttl register on that node (zero if absent).
    pub max_ttl: Duration,
}

/// The data age a node must prove before its grants count, for a lock whose longest ttl
/// in use is `max_ttl`.
pub fn required_data_age(max_ttl: Duration) -> Duration {
    max_ttl + drift(max_ttl)
}

/// The expiry (`PX`) an epoch marker is stamped with, about 31 years: its age is this minus
/// its `PTTL`, measured on the node's own clock like every key's expiry.
pub const EPOCH_LIFETIME_MS: u64 = 1_000_000_000_000;

/// The data age an epoch marker holding `marker` with `pttl_ms` left proves on a node whose
/// run id is `run_id`; `None` when it was stamped by another server process (the node
/// restarted or failed over since) or carries no stamp of ours.
pub fn data_age(marker: &str, pttl_ms: i64, run_id: &str) -> Option<Duration> {
    let left = u64::try_from(pttl_ms)
        .ok()
        .filter(|left| *left <= EPOCH_LIFETIME_MS)?;
    (marker == run_id).then(|| Duration::from_millis(EPOCH_LIFETIME_MS - left))
}

/// Whether a grant from a node with `facts` and `proof` counts, when the longest ttl in use
/// is `max_ttl`; the error says why not, for `Vote::NotCounted` and the logs.
pub fn judge(
    facts: &NodeFacts,
    proof: Proof,
    max_ttl: Duration,
    allow_evicting: bool,
) -> Result<(), String> {
    if facts.may_evict() && !allow_evicting {
        return Err(format!(
            "maxmemory-policy {} can evict lock keys (see --allow-evicting-nodes)",
            facts.maxmemory_policy
        ));
    }
    let needed = required_data_age(max_ttl);
    if proof.data_age < needed {
        return Err(format!(
            "data kept for {} ms only, less than ttl + drift ({} ms)",
            proof.data_age.as_millis(),
            needed.as_millis()
        ));
    }
    Ok(())
}

impl Redlock {
    /// Whether node `index`'s grant counts, given what it proved in its answer (see
    /// the module docs). Judged on every answer, not only grants, so that the health every node
    /// reports stays current on leaders and followers alike.
    pub(super) fn judge(
        &self,
        index: usize,
        facts: &NodeFacts,
        proof: Proof,
    ) -> Result<(), String> {
        let reported = u64::try_from(proof.max_ttl.as_millis()).unwrap_or(u64::MAX);
        let seen = self
            .inner
            .max_ttl_seen
            .fetch_max(reported, Ordering::Relaxed)
            .max(reported);
        let longest = self
            .inner
            .cfg
            .longest_ttl()
            .max(Duration::from_millis(seen));
        let verdict = judge(facts, proof, longest, self.inner.cfg.allow_evicting_nodes);
        self.inner.observer.node_counted(index, verdict.is_ok());
        verdict
    }

    /// The data age a node must prove now for its grants to count.
    pub fn required_data_age(&self) -> Duration {
        let seen = Duration::from_millis(self.inner.max_ttl_seen.load(Ordering::Relaxed));
        required_data_age(self.inner.cfg.longest_ttl().max(seen))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(policy: &str) -> NodeFacts {
        NodeFacts {
            run_id: "r".into(),
            maxmemory_policy: policy.into(),
        }
    }

    fn proof(age_ms: u64) -> Proof {
        Proof {
            data_age: Duration::from_millis(age_ms),
            max_ttl: Duration::ZERO,
        }
    }

    #[test]
    fn a_node_counts_once_it_kept_its_data_for_ttl_plus_drift() {
        let ttl = Duration::from_secs(10);
        let safe = facts("noeviction");
        assert!(judge(&safe, proof(10_101), ttl, false).is_err());
        assert!(judge(&safe, proof(10_102), ttl, false).is_ok());
    }

    #[test]
    fn a_marker_proves_age_only_for_the_process_that_stamped_it() {
        let left = (EPOCH_LIFETIME_MS - 2_500) as i64;
        assert_eq!(
            data_age("abc", left, "abc"),
            Some(Duration::from_millis(2_500))
        );
        assert_eq!(data_age("abc", left, "other"), None);
        assert_eq!(data_age("abc", -1, "abc"), None, "no expiry: not our stamp");
    }

    #[test]
    fn the_scripts_stamp_the_marker_with_the_lifetime_the_age_is_read_against() {
        let lifetime = EPOCH_LIFETIME_MS.to_string();
        for script in [
            crate::redlock::scripts::ACQUIRE,
            crate::redlock::scripts::EXTEND,
        ] {
            assert_eq!(script.matches(lifetime.as_str()).count(), 3, "{script}");
        }
    }

    #[test]
    fn an_evicting_node_counts_only_when_allowed() {
        let ttl = Duration::from_secs(1);
        let lru = facts("allkeys-lru");
        assert!(judge(&lru, proof(60_000), ttl, false)
            .unwrap_err()
            .contains("allkeys-lru"));
        assert!(judge(&lru, proof(60_000), ttl, true).is_ok());
        let volatile = facts("volatile-ttl");
        assert!(judge(&volatile, proof(60_000), ttl, false).is_err());
    }
}

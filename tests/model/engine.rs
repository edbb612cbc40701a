//! The model's only coupling to the engine: the crate's own pure decision functions, called
//! on whole-millisecond ticks (one model tick is one millisecond of the engine's arithmetic).
//! When their signatures change, this file is the one to adapt.

use std::time::Duration;

use redlock_sidecar::redlock::votes::{self, DataAge, NodeSet, Proof, EPOCH_LIFETIME_MS};
use redlock_sidecar::redlock::{quorum, timing, validity, NodeFacts};

/// A marker stamped before the model's time begins proves this much (beyond `MAX_TTL` + drift).
const ANCIENT: Duration = Duration::from_secs(2 * timing::MAX_TTL.as_secs());

/// A data age as a node's clock measures it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Age {
    /// Whole ticks since the epoch marker was stamped.
    Ticks(u8),
    /// Stamped long before the model's time began.
    Ancient,
}

impl Age {
    fn duration(self) -> Duration {
        match self {
            Age::Ticks(t) => ms(t),
            Age::Ancient => ANCIENT,
        }
    }
}

/// One tick as the engine's `Duration`.
pub fn ms(ticks: u8) -> Duration {
    Duration::from_millis(u64::from(ticks))
}

/// Votes needed among `nodes` (the engine's `quorum`).
pub fn quorum_of(nodes: usize) -> usize {
    quorum(nodes)
}

/// The validity a round that took `elapsed` leaves of `ttl`, rounded up to whole ticks (the
/// app may act until any instant inside it); `None` when nothing is left. Without
/// `drift_margin` the drift term is left out (`ttl − elapsed`): the rule switched off.
pub fn validity_ticks(ttl: u8, elapsed: u8, drift_margin: bool) -> Option<u8> {
    let left = if drift_margin {
        validity(ms(ttl), ms(elapsed))?
    } else {
        ms(ttl)
            .checked_sub(ms(elapsed))
            .filter(|left| !left.is_zero())?
    };
    Some(u8::try_from(left.as_nanos().div_ceil(1_000_000)).expect("ticks fit in u8"))
}

/// Whether a grant from a node that proved `age` counts when the longest ttl known is
/// `longest` ticks (the engine's `votes::judge`, on a node that does not evict).
pub fn counts(age: Age, longest: u8) -> bool {
    let facts = NodeFacts {
        maxmemory_policy: "noeviction".to_owned(),
        role: "master".to_owned(),
        ..NodeFacts::default()
    };
    let proof = Proof {
        data_age: DataAge::Proven(age.duration()),
        max_ttl: Duration::ZERO,
    };
    votes::judge(&facts, proof, ms(longest), false).is_ok()
}

/// Whether `age` proves the node kept its data for longer than any ttl can be (`MAX_TTL` plus
/// its drift): then its grant counts without waiting for the round's other answers.
pub fn old_beyond_any_ttl(age: Age) -> bool {
    age.duration() >= votes::settled_data_age()
}

/// The age an epoch marker holding lineage `marker` proves, measured `measured` on the node's
/// clock, to a script that reads the lineage `current` (the engine's `votes::data_age`);
/// `None` when the lineages differ and the marker must be stamped again.
pub fn proven_age(marker: &str, measured: Age, current: &str) -> Option<Age> {
    let age_ms = u64::try_from(measured.duration().as_millis()).expect("age fits in u64");
    let pttl = i64::try_from(EPOCH_LIFETIME_MS - age_ms).expect("pttl fits in i64");
    let proven = votes::data_age(marker, pttl, current)?;
    Some(if proven >= ANCIENT {
        Age::Ancient
    } else {
        Age::Ticks(u8::try_from(proven.as_millis()).expect("young ages fit in u8"))
    })
}

/// Node `n`'s server while it runs as run `run`, as the engine names a server (run ids are
/// unique across servers, so the node's index is part of the model's).
fn server(n: usize, run: u8) -> String {
    votes::server_identity(&format!("n{n}r{run}"), 0).expect("a run id")
}

/// The node set of a list of nodes, each with the run id its client knows (`None`: `?`).
fn node_set(list: &[(usize, Option<u8>)]) -> NodeSet {
    NodeSet::of_servers(
        list.iter()
            .map(|(n, run)| run.map(|run| server(*n, run)))
            .collect(),
    )
}

/// The fingerprint the engine records for `list`, as a number.
pub fn fingerprint(list: &[(usize, Option<u8>)]) -> u64 {
    u64::from_str_radix(&node_set(list).fingerprint, 16).expect("a hex fingerprint")
}

/// Whether a round on `list` counts a grant from the `index`th node of the list, answered on a
/// connection to `answered` (node, run id) (the engine's `NodeSet::admits`).
pub fn admits(list: &[(usize, Option<u8>)], index: usize, answered: (usize, u8)) -> bool {
    let server = server(answered.0, answered.1);
    node_set(list).admits(index, Some(&server)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_round_the_engine_arithmetic_as_the_model_documents() {
        // ttl 6 ms: drift is 2.06 ms, so 3.94 ms are left, which the app may use up to its end.
        assert_eq!(validity_ticks(6, 0, true), Some(4));
        assert_eq!(validity_ticks(6, 1, true), Some(3));
        assert_eq!(validity_ticks(6, 4, true), None);
        assert_eq!(validity_ticks(6, 0, false), Some(6));
        // ttl 6 ms needs 8.06 ms of data age: 9 whole ticks on the node's clock.
        assert!(!counts(Age::Ticks(8), 6));
        assert!(counts(Age::Ticks(9), 6));
        assert!(counts(Age::Ancient, 60));
        assert!(old_beyond_any_ttl(Age::Ancient));
        assert!(!old_beyond_any_ttl(Age::Ticks(200)));
        assert_eq!(proven_age("a", Age::Ticks(3), "a"), Some(Age::Ticks(3)));
        assert_eq!(proven_age("a", Age::Ancient, "a"), Some(Age::Ancient));
        assert_eq!(proven_age("a", Age::Ticks(3), "b"), None);
    }
}

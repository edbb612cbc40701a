//! The verdict `check` gives for the whole node set: is the lock safe as configured, what may
//! fail without losing it, what a failover costs. Pure: a function of the nodes' standings.

use std::time::Duration;

use super::report::Standing;
use crate::redlock::quorum;

/// One configured node as the verdict sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Voter {
    /// `host:port`, or a Sentinel group's label.
    pub label: String,
    /// Whether its vote counts; `None`: unreachable now.
    pub standing: Option<Standing>,
    /// A failover can replace its data (it has replicas, or is a Sentinel group).
    pub fails_over: bool,
    /// Why it can break mutual exclusion even though its votes count, if it can.
    pub unsafe_because: Option<String>,
}

/// The one-line verdict for `voters`, where a failover costs a node's vote for `abstain`
/// (ttl + drift).
pub fn overall(voters: &[Voter], abstain: Duration) -> String {
    let n = voters.len();
    let needed = quorum(n);
    let able: Vec<&Voter> = voters
        .iter()
        .filter(|v| matches!(v.standing, Some(Standing::Counts | Standing::CountsIn(..))))
        .collect();
    let hazards: Vec<String> = able
        .iter()
        .filter_map(|v| Some(format!("{}: {}", v.label, v.unsafe_because.as_ref()?)))
        .collect();
    if !hazards.is_empty() {
        return format!("unsafe because {}", hazards.join("; "));
    }
    if able.len() < needed {
        let out: Vec<String> = voters
            .iter()
            .filter_map(|v| match &v.standing {
                None => Some(format!("{} is unreachable", v.label)),
                Some(Standing::Never(why)) => {
                    Some(format!("{}'s vote does not count ({why})", v.label))
                }
                Some(_) => None,
            })
            .collect();
        return format!(
            "unavailable: {} of {n} node{} can vote, the quorum is {needed}: {}",
            able.len(),
            plural(n),
            out.join("; ")
        );
    }
    let spare = able.len() - needed;
    let abstain = format!("~{:.1} s (ttl + drift)", abstain.as_secs_f64());
    let mut verdict = match spare {
        0 => "safe; survives no node loss".to_owned(),
        k => format!("safe; survives the loss of {k} node{}", plural(k)),
    };
    if able.iter().any(|v| v.fails_over) {
        verdict += &match spare {
            0 => format!("; one failover makes the lock unavailable for {abstain}"),
            _ => format!("; a failover costs that node's vote for {abstain}"),
        };
    }
    let counting = able
        .iter()
        .filter(|v| v.standing == Some(Standing::Counts))
        .count();
    if counting < needed {
        let mut waits: Vec<Duration> = able
            .iter()
            .filter_map(|v| match &v.standing {
                Some(Standing::CountsIn(wait, _)) => Some(*wait),
                _ => None,
            })
            .collect();
        waits.sort();
        if let Some(wait) = waits.get(needed - counting - 1) {
            verdict += &format!(
                "; not yet: a quorum counts in {:.1} s at the earliest",
                wait.as_secs_f64()
            );
        }
    }
    verdict
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ABSTAIN: Duration = Duration::from_millis(10_100);

    fn voter(label: &str, standing: Option<Standing>, fails_over: bool) -> Voter {
        Voter {
            label: label.into(),
            standing,
            fails_over,
            unsafe_because: None,
        }
    }

    #[test]
    fn three_independent_masters_survive_the_loss_of_one() {
        let voters = ["a", "b", "c"].map(|l| voter(l, Some(Standing::Counts), false));
        assert_eq!(
            overall(&voters, ABSTAIN),
            "safe; survives the loss of 1 node"
        );
    }

    #[test]
    fn one_sentinel_group_is_unavailable_for_ttl_plus_drift_after_a_failover() {
        let voters = [voter("mymaster@s1:26379", Some(Standing::Counts), true)];
        assert_eq!(
            overall(&voters, ABSTAIN),
            "safe; survives no node loss; one failover makes the lock unavailable for \
             ~10.1 s (ttl + drift)"
        );
    }

    #[test]
    fn five_replicated_primaries_lose_one_vote_per_failover() {
        let voters = ["a", "b", "c", "d", "e"].map(|l| voter(l, Some(Standing::Counts), true));
        assert_eq!(
            overall(&voters, ABSTAIN),
            "safe; survives the loss of 2 nodes; a failover costs that node's vote for \
             ~10.1 s (ttl + drift)"
        );
    }

    #[test]
    fn a_hazard_on_a_counting_node_makes_the_set_unsafe() {
        let mut voters = ["a", "b", "c"].map(|l| voter(l, Some(Standing::Counts), false));
        voters[1].unsafe_because = Some("may evict lock keys".into());
        assert_eq!(
            overall(&voters, ABSTAIN),
            "unsafe because b: may evict lock keys"
        );
    }

    #[test]
    fn too_few_voters_is_unavailable_and_says_who() {
        let voters = [
            voter("a", Some(Standing::Counts), false),
            voter("b", None, false),
            voter("c", Some(Standing::Never("a replica".into())), false),
        ];
        let verdict = overall(&voters, ABSTAIN);
        assert!(
            verdict.starts_with("unavailable: 1 of 3 nodes can vote, the quorum is 2"),
            "{verdict}"
        );
        assert!(
            verdict.contains("b is unreachable")
                && verdict.contains("c's vote does not count (a replica)")
        );
    }

    #[test]
    fn young_nodes_say_when_a_quorum_counts() {
        let wait = |s| Some(Standing::CountsIn(Duration::from_secs(s), "young".into()));
        let voters = [
            voter("a", wait(3), false),
            voter("b", wait(7), false),
            voter("c", wait(1), false),
        ];
        assert_eq!(
            overall(&voters, ABSTAIN),
            "safe; survives the loss of 1 node; not yet: a quorum counts in 3.0 s at the earliest"
        );
    }
}

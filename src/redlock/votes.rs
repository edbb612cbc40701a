//! Which votes count: the engine's side of the rules in `redlock_core::votes` (re-exported
//! here). The rules and their judges are the core's; what is left here reads the nodes: the
//! longest ttl learnt from their registers, and which configured node reaches the same server
//! as another (rule 5).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

pub use redlock_core::votes::*;

use super::round::{Connection, Rules};
use super::transport::{NodeFacts, Voter};
use super::Redlock;

/// For rule 5 (one server, one vote; judged in [`judge_vote`]): the label of a
/// node listed before node `index` of `nodes` whose connection reaches the server with
/// `run_id`, if any (one server under two names).
pub fn same_server_as(nodes: &[Voter], index: usize, run_id: &str) -> Option<String> {
    nodes[..index.min(nodes.len())]
        .iter()
        .find(|other| other.facts().is_some_and(|f| f.run_id == run_id))
        .map(|other| other.label().to_owned())
}

impl Redlock {
    /// Whether node `index`'s grant counts, given what it proved in its answer (see
    /// the module docs and [`judge_vote`]). Judged on every answer that carries
    /// a proof, not only grants, so that the health every node reports stays current on
    /// leaders and followers alike.
    pub(super) fn judge(
        &self,
        index: usize,
        facts: &Arc<NodeFacts>,
        proof: Proof,
    ) -> Result<(), NotCounted> {
        let longest = self.learn_max_ttl(proof.max_ttl);
        let conn = self.connection(index, facts.clone());
        let verdict = judge_vote(
            &conn,
            proof,
            longest,
            self.inner.cfg.allow_evicting_nodes,
            Rules::ALL,
        );
        self.inner.observer.node_counted(index, verdict.is_ok());
        self.inner.uncounted[index].store(verdict.is_err(), Ordering::Relaxed);
        verdict
    }

    /// What node `index`'s connection showed, as the vote rules judge it: its facts, the
    /// server the node set names it by, and an earlier node that reaches the same server.
    pub(super) fn connection(&self, index: usize, facts: Arc<NodeFacts>) -> Connection {
        let nodes = &self.inner.nodes;
        Connection {
            server: server_identity(&facts.run_id, nodes[index].db()),
            same_server_as: same_server_as(nodes, index, &facts.run_id),
            facts,
        }
    }

    /// Takes a node's max-ttl register into account; returns the longest ttl known now.
    pub(super) fn learn_max_ttl(&self, reported: Duration) -> Duration {
        let reported = u64::try_from(reported.as_millis()).unwrap_or(u64::MAX);
        let seen = self
            .inner
            .max_ttl_seen
            .fetch_max(reported, Ordering::Relaxed)
            .max(reported);
        self.inner
            .cfg
            .longest_ttl()
            .max(Duration::from_millis(seen))
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
    use crate::redlock::transport::voter::fake::FakeNode;
    use crate::redlock::transport::VoteNode;

    fn proof(age_ms: u64) -> Proof {
        Proof {
            data_age: DataAge::Proven(Duration::from_millis(age_ms)),
            max_ttl: Duration::ZERO,
        }
    }

    /// The set of the servers `nodes` show now (`None` for a node never reached).
    fn set_of(nodes: &[FakeNode]) -> NodeSet {
        NodeSet::of_servers(nodes.iter().map(VoteNode::server).collect())
    }

    #[test]
    fn one_server_under_two_names_is_one_vote_and_a_node_without_run_id_none() {
        let nodes = [
            Arc::new(FakeNode::new("localhost:6379", "run-a")),
            Arc::new(FakeNode::new("127.0.0.1:6379", "run-a")),
            Arc::new(FakeNode::new("b:6379", "run-b")),
        ];
        let voters: Vec<Voter> = nodes.iter().map(|node| node.clone() as Voter).collect();
        let judged = |i: usize, facts: NodeFacts| {
            let conn = Connection {
                server: server_identity(&facts.run_id, 0),
                same_server_as: same_server_as(&voters, i, &facts.run_id),
                facts: Arc::new(facts),
            };
            judge_vote(
                &conn,
                proof(60_000),
                Duration::from_secs(1),
                false,
                Rules::ALL,
            )
        };
        let shown = |i: usize| nodes[i].facts().expect("connected").as_ref().clone();
        assert!(judged(0, shown(0)).is_ok());
        let twice = judged(1, shown(1)).unwrap_err();
        assert!(twice.why.contains("localhost:6379"), "{twice:?}");
        assert!(judged(2, shown(2)).is_ok());
        let no_run_id = judged(2, NodeFacts::default()).unwrap_err();
        assert!(no_run_id.why.contains("no run_id"), "{no_run_id:?}");
        // The first name keeps its vote once the second is gone.
        nodes[0].restart("run-a2");
        assert!(judged(1, shown(1)).is_ok());
    }

    #[tokio::test]
    async fn a_node_restarted_during_a_round_counts_from_the_next_round_on() {
        let nodes = [FakeNode::new("a:1", "a"), FakeNode::new("b:1", "")];
        let round = set_of(&nodes);
        assert_eq!(
            round,
            NodeSet::of_servers(vec![Some("a/0".to_owned()), None])
        );
        nodes[0].restart("a2");
        nodes[0].connect(Duration::from_millis(10)).await;
        let (_, facts) = {
            nodes[0].answer(Ok(redis::Value::Int(1)));
            let script = redis::Script::new("return 1");
            nodes[0]
                .run_script(&script, &["k"], &[], Duration::from_millis(10))
                .await
                .expect("answered")
        };
        let shown = server_identity(&facts.run_id, nodes[0].db());
        let refused = round.admits(0, shown.as_deref()).unwrap_err();
        assert!(refused.why.contains("changed"), "{refused:?}");
        let next_round = set_of(&nodes);
        assert!(next_round.admits(0, shown.as_deref()).is_ok());
        assert_ne!(next_round.fingerprint, round.fingerprint);
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
}

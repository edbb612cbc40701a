//! The rounds over times and answers: no Redis, no clock.

use std::sync::Arc;
use std::time::Duration;

use super::acquire::{AcquireParams, AcquireStatus};
use super::extend::ExtendStatus;
use super::*;
use crate::clock::Deadline;
use crate::error::{NodeError, Vote};
use crate::votes::{self, settled_data_age, DataAge, NodeSet, Proof};

const TTL: Duration = Duration::from_secs(10);
const RECHECK_FOR: Duration = Duration::from_millis(1_000);
const CANDIDATE: u64 = 1_000;

fn at(ms: u64) -> Deadline {
    Deadline::from_boottime(Duration::from_millis(ms))
}

fn server(index: usize) -> String {
    format!("run{index}/0")
}

fn conn(index: usize) -> Connection {
    Connection {
        facts: Arc::new(NodeFacts {
            run_id: format!("run{index}"),
            maxmemory_policy: "noeviction".into(),
            role: "master".into(),
            ..NodeFacts::default()
        }),
        server: Some(server(index)),
        same_server_as: None,
    }
}

fn node_set() -> NodeSet {
    NodeSet::of_servers((0..3).map(|i| Some(server(i))).collect())
}

fn round_with(rules: Rules) -> AcquireRound {
    round_on(node_set(), rules)
}

fn round_on(node_set: NodeSet, rules: Rules) -> AcquireRound {
    let params = AcquireParams {
        ttl: TTL,
        longest_ttl: TTL,
        candidate: CANDIDATE,
        node_set,
        allow_evicting: false,
        recheck_for: RECHECK_FOR,
        rules,
    };
    AcquireRound::new(3, params, at(0))
}

fn round() -> AcquireRound {
    round_with(Rules::ALL)
}

const OLD: Duration = Duration::from_secs(100_000);
/// Long enough for a 10 s ttl, but below the settled age.
const YOUNG: Duration = Duration::from_secs(20);

fn reply(status: AcquireStatus, age: Duration) -> AcquireReply {
    AcquireReply {
        status,
        fence: 0,
        proof: Proof {
            data_age: DataAge::Proven(age),
            max_ttl: Duration::ZERO,
        },
        candidate_stored: status == AcquireStatus::Granted,
        holder_value: String::new(),
        holder_pttl: None,
        node_set: node_set().fingerprint,
        node_set_age: None,
    }
}

fn grant(age: Duration) -> AcquireReply {
    reply(AcquireStatus::Granted, age)
}

fn held_by(holder: &str) -> AcquireReply {
    AcquireReply {
        holder_value: format!("{holder}:abc"),
        holder_pttl: Some(Duration::from_secs(3)),
        ..reply(AcquireStatus::Held, OLD)
    }
}

fn answer(index: usize, reply: AcquireReply) -> Result<NodeAnswer<AcquireReply>, NodeError> {
    Ok(NodeAnswer {
        reply,
        conn: conn(index),
    })
}

fn timeout() -> Result<NodeAnswer<AcquireReply>, NodeError> {
    Err(NodeError::timeout(Duration::from_millis(50)))
}

#[test]
fn a_quorum_of_counted_grants_wins_before_the_last_node_answers() {
    let mut round = round();
    round.handle(0, answer(0, grant(OLD)));
    assert_eq!(round.poll(at(1)), AcquireStep::Listen);
    round.handle(2, answer(2, grant(OLD)));
    assert_eq!(
        round.poll(at(2)),
        AcquireStep::Won(TokenPlan::Stored(CANDIDATE))
    );
    let valid = crate::timing::validity(TTL, Duration::from_millis(2)).unwrap();
    assert_eq!(round.validity().at(at(2)), Ok(at(0) + valid));
}

#[test]
fn a_key_held_on_a_quorum_is_busy_and_our_key_is_cleaned_up_where_it_may_stand() {
    let mut round = round();
    round.handle(0, answer(0, held_by("other")));
    round.handle(1, answer(1, held_by("other")));
    // Decided, but a lost round hears every node before it reports.
    assert_eq!(round.poll(at(1)), AcquireStep::Listen);
    round.handle(2, answer(2, grant(OLD)));
    let AcquireStep::Lost { clean_up, lost } = round.poll(at(2)) else {
        panic!("lost");
    };
    assert_eq!(clean_up, vec![2]);
    assert_eq!(
        lost.why,
        Lost::Busy {
            holder: Some("other".into()),
            holder_ttl: Some(Duration::from_secs(3)),
            holder_fence: 0,
        }
    );
    assert!(
        matches!(lost.votes[2], Some(Vote::NotCounted(_))),
        "a grant after the decision does not count"
    );
}

#[test]
fn grants_of_young_nodes_are_judged_only_once_every_node_has_answered() {
    assert!(YOUNG < settled_data_age());
    let mut round = round();
    round.handle(0, answer(0, grant(YOUNG)));
    round.handle(1, answer(1, grant(YOUNG)));
    assert_eq!(
        round.poll(at(1)),
        AcquireStep::Listen,
        "two young grants wait for the third answer"
    );
    round.handle(2, answer(2, held_by("other")));
    assert_eq!(
        round.poll(at(2)),
        AcquireStep::Won(TokenPlan::Stored(CANDIDATE))
    );
}

/// Two young grants, and node 2 silent past the node timeout.
fn young_grants_and_a_silent_node(
    silent: Result<NodeAnswer<AcquireReply>, NodeError>,
) -> AcquireRound {
    let mut round = round();
    round.handle(0, answer(0, grant(YOUNG)));
    round.handle(1, answer(1, grant(YOUNG)));
    round.handle(2, silent);
    round
}

#[test]
fn young_grants_that_would_win_wait_for_a_silent_nodes_register() {
    let mut round = young_grants_and_a_silent_node(timeout());
    assert_eq!(round.poll(at(60)), AcquireStep::Recheck(vec![2]));
    assert_eq!(round.poll_timeout(), Some(at(0) + RECHECK_FOR));
    // Still paused: asked again until the window ends.
    round.handle_register(
        2,
        Err(NodeError::timeout(Duration::from_millis(50))),
        at(120),
    );
    assert_eq!(round.poll(at(120)), AcquireStep::Recheck(vec![2]));
    round.handle_timeout(at(500));
    assert_eq!(
        round.poll(at(500)),
        AcquireStep::Recheck(vec![2]),
        "not before the window ends"
    );
    // The node answers: its register names a ttl the young nodes have not outlived.
    round.handle_register(2, Ok(Duration::from_secs(60)), at(600));
    let AcquireStep::Lost { lost, clean_up } = round.poll(at(600)) else {
        panic!("lost");
    };
    assert!(
        matches!(lost.why, Lost::NotYetTrusted { .. }),
        "{:?}",
        lost.why
    );
    assert_eq!(clean_up, vec![0, 1, 2]);
    assert_eq!(round.longest_ttl(), Duration::from_secs(60));
}

#[test]
fn a_silent_nodes_register_below_the_young_nodes_age_lets_them_count() {
    let mut round = young_grants_and_a_silent_node(timeout());
    round.handle_register(2, Ok(Duration::ZERO), at(70));
    assert_eq!(
        round.poll(at(70)),
        AcquireStep::Won(TokenPlan::Stored(CANDIDATE))
    );
}

#[test]
fn a_node_silent_for_the_whole_window_or_refusing_connections_is_taken_as_unreachable() {
    let mut round = young_grants_and_a_silent_node(timeout());
    round.handle_timeout(at(0) + RECHECK_FOR);
    assert_eq!(
        round.poll(at(0) + RECHECK_FOR),
        AcquireStep::Won(TokenPlan::Stored(CANDIDATE)),
        "the case --max-ttl covers"
    );
    let broken = Err(NodeError {
        kind: crate::error::NodeErrorKind::Connection,
        message: "connection reset".into(),
    });
    let mut round = young_grants_and_a_silent_node(broken.clone());
    assert_eq!(
        round.poll(at(1)),
        AcquireStep::Recheck(vec![2]),
        "a connection being remade"
    );
    round.handle_register(2, broken.map(|_| Duration::ZERO), at(2));
    assert!(matches!(round.poll(at(2)), AcquireStep::Won(_)));
}

#[test]
fn no_recheck_when_the_young_grants_cannot_win_or_the_silent_node_answered_an_error() {
    let mut round = round();
    round.handle(0, answer(0, grant(YOUNG)));
    round.handle(1, answer(1, held_by("other")));
    round.handle(2, timeout());
    assert!(matches!(round.poll(at(60)), AcquireStep::Lost { .. }));
    let denied = Err(NodeError {
        kind: crate::error::NodeErrorKind::Auth,
        message: "WRONGPASS".into(),
    });
    let round = young_grants_and_a_silent_node(denied);
    assert!(matches!(round.poll(at(60)), AcquireStep::Won(_)));
    let mut round = round_with(Rules {
        recheck_silent: false,
        ..Rules::ALL
    });
    round.handle(0, answer(0, grant(YOUNG)));
    round.handle(1, answer(1, grant(YOUNG)));
    round.handle(2, timeout());
    assert!(
        matches!(round.poll(at(60)), AcquireStep::Won(_)),
        "without the rule"
    );
}

#[test]
fn a_longer_register_heard_last_makes_young_grants_wait() {
    let mut round = round();
    round.handle(0, answer(0, grant(YOUNG)));
    round.handle(1, answer(1, grant(YOUNG)));
    let mut long = held_by("other");
    long.proof.max_ttl = Duration::from_secs(60);
    round.handle(2, answer(2, long));
    let AcquireStep::Lost { lost, clean_up } = round.poll(at(2)) else {
        panic!("lost");
    };
    assert_eq!(clean_up, vec![0, 1]);
    let Lost::NotYetTrusted { ready_in } = lost.why else {
        panic!("{:?}", lost.why);
    };
    assert_eq!(
        ready_in,
        votes::required_data_age(Duration::from_secs(60)) - YOUNG
    );
    assert_eq!(round.longest_ttl(), Duration::from_secs(60));
}

#[test]
fn without_waiting_for_all_answers_a_young_grant_counts_before_the_register_is_heard() {
    let mut round = round_with(Rules {
        wait_for_all: false,
        ..Rules::ALL
    });
    round.handle(0, answer(0, grant(YOUNG)));
    round.handle(1, answer(1, grant(YOUNG)));
    assert!(matches!(round.poll(at(1)), AcquireStep::Won(_)));
}

#[test]
fn another_node_sets_record_makes_a_won_round_refuse_to_lead() {
    let mut round = round();
    let mut foreign = reply(AcquireStatus::OtherNodeSet, OLD);
    foreign.node_set = "theirs".into();
    round.handle(0, answer(0, foreign));
    round.handle(1, answer(1, grant(OLD)));
    round.handle(2, answer(2, grant(OLD)));
    let AcquireStep::Lost { clean_up, lost } = round.poll(at(2)) else {
        panic!("refused");
    };
    assert_eq!(clean_up, vec![0, 1, 2]);
    assert_eq!(
        lost.why,
        Lost::NodeSetConflict {
            theirs: "theirs".into()
        }
    );
}

/// Node 2 restarted (`run2b`) after the holder wrote its record (naming `run2`) and died: our
/// round (on `run0`, `run1`, `run2b`), with node 2's grant `young` and the record 30 s old.
fn after_a_restart(holder_key: bool, third: Option<Duration>) -> AcquireRound {
    let ours = NodeSet::of_servers(vec![
        Some(server(0)),
        Some(server(1)),
        Some("run2b/0".into()),
    ]);
    let mut round = round_on(ours, Rules::ALL);
    let mut stale = if holder_key {
        held_by("crashed")
    } else {
        reply(AcquireStatus::OtherNodeSet, OLD)
    };
    stale.node_set = node_set().fingerprint;
    stale.node_set_age = Some(Duration::from_secs(30));
    round.handle(0, answer(0, stale.clone()));
    round.handle(1, answer(1, stale));
    let mut restarted = conn(2);
    restarted.server = Some("run2b/0".into());
    let young = match third {
        Some(age) => Ok(NodeAnswer {
            reply: grant(age),
            conn: restarted,
        }),
        None => timeout(),
    };
    round.handle(2, young);
    round
}

fn lost_why(round: &AcquireRound) -> Lost {
    match round.poll(at(5)) {
        AcquireStep::Lost { lost, .. } => lost.why,
        step => panic!("lost, not {step:?}"),
    }
}

#[test]
fn a_record_written_before_a_restart_of_our_servers_is_stale_and_may_be_replaced_next_round() {
    let round = after_a_restart(false, Some(Duration::from_secs(1)));
    assert_eq!(lost_why(&round), Lost::Contended, "no conflict: retry");
    let stale = round.stale_record().expect("judged stale");
    assert_eq!(stale.set, node_set().fingerprint);
    assert_eq!(
        stale.after,
        Duration::from_secs(1) + crate::timing::drift(Duration::from_secs(30))
    );
}

#[test]
fn a_record_naming_a_server_ours_replaced_before_it_was_written_is_a_conflict() {
    let round = after_a_restart(false, Some(Duration::from_secs(40)));
    assert!(matches!(lost_why(&round), Lost::NodeSetConflict { .. }));
    assert_eq!(round.stale_record(), None);
}

#[test]
fn a_stale_looking_record_beside_a_held_key_is_a_conflict() {
    let round = after_a_restart(true, Some(Duration::from_secs(1)));
    assert!(matches!(lost_why(&round), Lost::NodeSetConflict { .. }));
    assert_eq!(round.stale_record(), None);
}

#[test]
fn a_record_that_cannot_be_judged_is_neither_stale_nor_a_conflict() {
    // The new server did not answer: its age is not known.
    let round = after_a_restart(false, None);
    assert!(!matches!(lost_why(&round), Lost::NodeSetConflict { .. }));
    assert_eq!(round.stale_record(), None);
}

#[test]
fn grants_that_replaced_a_stale_record_lead_only_once_every_node_answered() {
    let replaced = || {
        let mut grant = grant(OLD);
        grant.node_set = "a record judged stale".into();
        grant
    };
    let mut round = round();
    round.handle(0, answer(0, replaced()));
    round.handle(1, answer(1, replaced()));
    assert_eq!(round.poll(at(1)), AcquireStep::Listen, "hears every node");
    round.handle(2, answer(2, grant(OLD)));
    assert!(matches!(round.poll(at(2)), AcquireStep::Won(_)));

    let mut round = round_with(Rules::ALL);
    round.handle(0, answer(0, replaced()));
    round.handle(1, answer(1, replaced()));
    round.handle(2, timeout());
    assert!(matches!(round.poll(at(2)), AcquireStep::Lost { .. }));
}

#[test]
fn a_round_won_on_nodes_without_a_record_hears_every_node_first() {
    let mut round = round();
    let mut unrecorded = grant(OLD);
    unrecorded.node_set.clear();
    round.handle(0, answer(0, unrecorded.clone()));
    round.handle(1, answer(1, unrecorded));
    assert_eq!(round.poll(at(1)), AcquireStep::Listen);
    let mut theirs = held_by("other");
    theirs.node_set = "theirs".into();
    round.handle(2, answer(2, theirs));
    assert!(matches!(
        round.poll(at(2)),
        AcquireStep::Lost {
            lost: RoundLost {
                why: Lost::NodeSetConflict { .. },
                ..
            },
            ..
        }
    ));
}

#[test]
fn a_grant_from_a_server_the_node_set_did_not_name_does_not_count() {
    let mut round = round();
    let mut restarted = conn(0);
    restarted.server = Some("other-run/0".into());
    round.handle(
        0,
        Ok(NodeAnswer {
            reply: grant(OLD),
            conn: restarted,
        }),
    );
    round.handle(1, answer(1, grant(OLD)));
    round.handle(2, timeout());
    assert!(matches!(
        round.poll(at(2)),
        AcquireStep::Lost {
            lost: RoundLost {
                why: Lost::QuorumUnreachable { needed: 2 },
                ..
            },
            ..
        }
    ));
    let mut lax = round_with(Rules {
        same_server: false,
        ..Rules::ALL
    });
    let mut restarted = conn(0);
    restarted.server = None;
    lax.handle(
        0,
        Ok(NodeAnswer {
            reply: grant(OLD),
            conn: restarted,
        }),
    );
    lax.handle(1, answer(1, grant(OLD)));
    assert!(matches!(lax.poll(at(2)), AcquireStep::Won(_)));
}

#[test]
fn a_round_that_took_the_whole_validity_is_too_short() {
    let mut round = round();
    round.handle(0, answer(0, grant(OLD)));
    round.handle(1, answer(1, grant(OLD)));
    let late = at(TTL.as_millis() as u64);
    assert!(matches!(round.poll(late), AcquireStep::TooShort { .. }));
    assert!(round.validity().at(late).is_err());
}

#[test]
fn a_candidate_not_stored_on_a_quorum_is_raised_above_every_counter_seen() {
    let mut round = round();
    let mut higher = grant(OLD);
    higher.candidate_stored = false;
    higher.fence = 5_000;
    round.handle(0, answer(0, higher));
    round.handle(1, answer(1, grant(OLD)));
    assert_eq!(
        round.poll(at(1)),
        AcquireStep::Won(TokenPlan::RaiseAbove(5_000))
    );
    assert_eq!(round.fence_seen(), 5_000);
}

#[test]
fn a_counter_beyond_2_to_the_53_is_a_failed_vote() {
    let mut round = round();
    let mut garbage = grant(OLD);
    garbage.fence = 1 << 53;
    round.handle(0, answer(0, garbage));
    assert!(matches!(round.votes()[0], Some(Vote::Failed(_))));
}

#[test]
fn without_the_data_age_rule_a_flushed_node_counts() {
    let flushed = grant(Duration::ZERO);
    let mut strict = round();
    strict.handle(0, answer(0, flushed.clone()));
    strict.handle(1, answer(1, flushed.clone()));
    strict.handle(2, timeout());
    assert!(matches!(strict.poll(at(1)), AcquireStep::Lost { .. }));
    let mut lax = round_with(Rules {
        data_age: false,
        ..Rules::ALL
    });
    lax.handle(0, answer(0, flushed.clone()));
    lax.handle(1, answer(1, flushed));
    lax.handle(2, answer(2, held_by("other")));
    assert!(matches!(lax.poll(at(1)), AcquireStep::Won(_)));
}

mod extend_rounds;

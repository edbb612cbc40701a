//! The extend rounds over times and answers: renewals won, lost, superseded, and the
//! promise they keep.

use super::*;

fn extend_round(rules: Rules) -> ExtendRound {
    ExtendRound::new(3, TTL, at(3_000), at(9_000), rules)
}

fn extended(status: ExtendStatus) -> Result<ExtendReply, NodeError> {
    Ok(ExtendReply {
        status,
        proof: Proof {
            data_age: DataAge::Proven(OLD),
            max_ttl: Duration::ZERO,
        },
    })
}

#[test]
fn an_extend_won_on_a_quorum_renews_and_restores_where_our_key_was_lost() {
    let mut round = extend_round(Rules::ALL);
    round.handle(0, extended(ExtendStatus::Missing));
    assert_eq!(round.poll(at(3_001)), ExtendStep::Listen);
    round.handle(1, extended(ExtendStatus::Extended));
    round.handle(2, extended(ExtendStatus::Extended));
    let now = at(3_010);
    let valid = crate::timing::validity(TTL, Duration::from_millis(10)).unwrap();
    assert_eq!(
        round.poll(now),
        ExtendStep::Renewed {
            valid_until: at(3_000) + valid,
            proven_until: at(3_000) + valid,
            restore: vec![0],
        }
    );
}

#[test]
fn a_slow_renewal_keeps_the_longest_promise() {
    let mut round = ExtendRound::new(3, TTL, at(3_000), at(12_000), Rules::ALL);
    round.handle(0, extended(ExtendStatus::Extended));
    round.handle(1, extended(ExtendStatus::Extended));
    // The round took 4 s: it proves only up to about 8.9 s.
    let ExtendStep::Renewed {
        valid_until,
        proven_until,
        restore,
    } = round.poll(at(7_000))
    else {
        panic!("renewed");
    };
    assert_eq!(valid_until, at(12_000));
    assert!(proven_until < at(12_000));
    assert!(restore.is_empty());
    let mut short = ExtendRound::new(
        3,
        TTL,
        at(3_000),
        at(12_000),
        Rules {
            longest_promise: false,
            ..Rules::ALL
        },
    );
    short.handle(0, extended(ExtendStatus::Extended));
    short.handle(1, extended(ExtendStatus::Extended));
    let ExtendStep::Renewed { valid_until, .. } = short.poll(at(7_000)) else {
        panic!("renewed");
    };
    assert!(valid_until < at(12_000));
}

#[test]
fn an_extend_short_of_a_quorum_is_lost_and_a_quorum_of_other_keys_supersedes() {
    let mut lost = extend_round(Rules::ALL);
    lost.handle(0, Err(NodeError::timeout(Duration::ZERO)));
    lost.handle(1, extended(ExtendStatus::Held));
    assert!(matches!(lost.poll(at(3_001)), ExtendStep::Lost(_)));
    let mut gone = extend_round(Rules::ALL);
    gone.handle(0, extended(ExtendStatus::Missing));
    gone.handle(1, extended(ExtendStatus::Held));
    assert!(matches!(gone.poll(at(3_001)), ExtendStep::Superseded(_)));
}

#[test]
fn an_extend_ends_at_the_leases_validity() {
    let mut round = extend_round(Rules::ALL);
    assert_eq!(round.poll_timeout(), Some(at(9_000)));
    round.handle(0, extended(ExtendStatus::Extended));
    assert_eq!(round.poll(at(9_000)), ExtendStep::Expired);
    round.handle(1, extended(ExtendStatus::Extended));
    assert_eq!(round.poll(at(9_000)), ExtendStep::Expired, "won too late");
    let late = extend_round(Rules::ALL);
    assert_eq!(
        late.poll(at(9_500)),
        ExtendStep::Expired,
        "expired before it began"
    );
    // A late "missing" after the decision is not counted, but reported for a restore.
    let mut round = extend_round(Rules::ALL);
    round.handle(0, extended(ExtendStatus::Extended));
    round.handle(1, extended(ExtendStatus::Extended));
    assert_eq!(
        round.handle(2, extended(ExtendStatus::Missing)),
        Vote::Missing
    );
    assert!(
        matches!(round.poll(at(3_010)), ExtendStep::Renewed { restore, .. } if restore.is_empty())
    );
}

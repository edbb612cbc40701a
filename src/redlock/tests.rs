//! The engine on fake nodes: its rounds, its fan-out and its clean-up driven through the
//! transport trait, with no Redis (the same flows run against real servers in `tests/`).

use std::sync::Arc;
use std::time::Duration;

use redis::Value;

use super::transport::voter::fake::{Call, FakeNode};
use super::transport::NodeErrorKind;
use super::*;

/// Far past any data age a round asks for (the node has kept its data).
const KEPT_FOR_MS: i64 = 1_000_000_000;

/// An acquire answer: our `SET NX` stored, the node's counter at `fence`, and our candidate
/// token stored where `stored`.
fn grant(fence: i64, stored: bool) -> Value {
    acquire_reply(1, fence, i64::from(stored), "", -2)
}

/// An acquire answer: `holder` has the key for `pttl_ms` more.
fn held_by(holder: &str, fence: i64, pttl_ms: i64) -> Value {
    acquire_reply(0, fence, 0, holder, pttl_ms)
}

fn acquire_reply(granted: i64, fence: i64, stored: i64, holder: &str, pttl: i64) -> Value {
    let text = |s: &str| Value::BulkString(s.as_bytes().to_vec());
    Value::Array(vec![
        Value::Int(granted),
        Value::Int(fence),
        Value::Int(KEPT_FOR_MS),
        Value::Int(0),
        Value::Int(stored),
        text(holder),
        Value::Int(pttl),
        text(""),
        Value::Int(-1),
    ])
}

/// An engine for lock `job` on three fake nodes (whose answers the test queues).
fn engine_on_fakes() -> (Redlock, Vec<Arc<FakeNode>>) {
    let fakes: Vec<Arc<FakeNode>> = ["a:1", "b:1", "c:1"]
        .iter()
        .map(|label| Arc::new(FakeNode::new(label, &format!("run-{label}"))))
        .collect();
    let voters: Vec<Voter> = fakes.iter().map(|f| f.clone() as Voter).collect();
    let cfg = RedlockConfig::new("job", "pod-a", Vec::new());
    let redlock = Redlock::with_nodes(cfg, Arc::new(NoObserver), voters.into(), None);
    (redlock, fakes)
}

/// The scripts node `fake` was sent, as (keys, args).
fn scripts(fake: &FakeNode) -> Vec<(Vec<String>, Vec<String>)> {
    fake.calls()
        .into_iter()
        .filter_map(|call| match call {
            Call::Script(keys, args) => Some((keys, args)),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_quorum_of_grants_is_a_lease_whose_token_is_the_stored_candidate() {
    let (redlock, fakes) = engine_on_fakes();
    fakes[0].answer(Ok(grant(5, true)));
    fakes[1].answer(Ok(grant(7, true)));
    // The third node never answers (a hung node): the quorum decides without it.
    let lease = redlock.try_acquire().await.expect("a quorum granted");

    assert!(lease.value().starts_with("pod-a:"), "{}", lease.value());
    for fake in &fakes {
        let sent = scripts(fake);
        assert_eq!(sent.len(), 1, "one acquire per node: {sent:?}");
        let (keys, args) = &sent[0];
        assert_eq!(keys[0], "redlock:{job}");
        assert_eq!(
            args[0],
            lease.value(),
            "every node is asked to store one value"
        );
        assert_eq!(
            args[2],
            lease.fencing_token.to_string(),
            "the candidate minted"
        );
    }
    assert!(lease.fencing_token > 7, "above every counter seen");
    assert!(lease.remaining_at(clock::Deadline::now()) > Duration::from_secs(9));
}

#[tokio::test]
async fn a_lost_round_names_the_holder_and_cleans_up_only_where_our_key_may_be() {
    let (redlock, fakes) = engine_on_fakes();
    // Garbage: our key may or may not be there.
    fakes[0].answer(Ok(Value::Int(7)));
    fakes[1].answer(Ok(held_by("pod-b:1f", 40, 8_000)));
    fakes[2].answer(Ok(held_by("pod-b:1f", 40, 9_000)));
    fakes[0].answer(Ok(Value::Int(1)));

    let err = redlock
        .try_acquire()
        .await
        .expect_err("pod-b holds the lock");
    let LockError::Busy {
        holder,
        holder_ttl,
        holder_fence,
        votes,
        ..
    } = err
    else {
        panic!("not busy: {err:?}");
    };
    assert_eq!(holder.as_deref(), Some("pod-b"));
    assert_eq!(holder_ttl, Some(Duration::from_secs(8)));
    assert_eq!(holder_fence, 40);
    let garbage = votes
        .0
        .iter()
        .find(|(label, _)| label == "a:1")
        .expect("a vote");
    assert!(
        matches!(&garbage.1, Vote::Failed(e) if e.kind == NodeErrorKind::Protocol),
        "{garbage:?}"
    );
    assert_eq!(
        scripts(&fakes[0]).len(),
        2,
        "a clean-up where the answer was unreadable"
    );
    assert_eq!(
        scripts(&fakes[1]).len(),
        1,
        "no clean-up where another holds the key"
    );
    assert_eq!(scripts(&fakes[2]).len(), 1);
}

#[tokio::test]
async fn a_release_is_sent_to_every_node_and_counts_the_deletes() {
    let (redlock, fakes) = engine_on_fakes();
    for fake in &fakes {
        fake.answer(Ok(grant(0, true)));
    }
    let lease = redlock.try_acquire().await.expect("granted everywhere");
    fakes[0].answer(Ok(Value::Int(1)));
    fakes[1].answer(Ok(Value::Int(1)));
    fakes[2].answer(Ok(Value::Int(0)));

    assert_eq!(redlock.release(&lease).await, 2);
    for fake in &fakes {
        let sent = scripts(fake);
        assert_eq!(sent.len(), 2, "acquire, then release: {sent:?}");
        assert_eq!(sent[1].1[0], lease.value(), "owner-checked on our value");
    }
}

#[tokio::test]
async fn a_renewal_that_finds_another_holder_on_a_quorum_ends_the_lease() {
    let (redlock, fakes) = engine_on_fakes();
    for fake in &fakes {
        fake.answer(Ok(grant(0, true)));
    }
    let lease = redlock.try_acquire().await.expect("granted everywhere");
    let extend = |status: i64| {
        Value::Array(vec![
            Value::Int(status),
            Value::Int(KEPT_FOR_MS),
            Value::Int(0),
        ])
    };
    fakes[0].answer(Ok(extend(1)));
    fakes[1].answer(Ok(extend(1)));
    let renewed = redlock.extend(&lease).await.expect("extended on a quorum");
    assert!(renewed.valid_until >= lease.valid_until);

    fakes[0].answer(Ok(extend(0)));
    fakes[1].answer(Ok(extend(0)));
    fakes[2].answer(Ok(extend(1)));
    let err = redlock.extend(&renewed).await.expect_err("another holder");
    assert!(matches!(err, LockError::Superseded { .. }), "{err:?}");
}

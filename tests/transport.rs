//! The real node behind the vote layer's seam (`VoteNode`), against a real redis-server: what
//! a fake node stands in for in the unit tests is what the real one does.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::time::Duration;

use futures_util::StreamExt;
use redis::{Script, Value};
use redlock_sidecar::redlock::transport::voter::decode;
use redlock_sidecar::redlock::transport::VoteNode;
use redlock_sidecar::redlock::{ConnectSettings, Credentials, Node, NodeErrorKind, NodeSpec};
use redlock_sidecar::redlock::{EPOCH_KEY, FACTS_MAX_AGE};
use support::RedisNode;

const TIMEOUT: Duration = Duration::from_secs(2);

fn node_at(url: &str) -> Node {
    let spec = NodeSpec::parse(0, url, &Credentials::default()).expect("a valid URL");
    let settings = ConnectSettings {
        connect_timeout: TIMEOUT,
        slot: 0,
        stamp_slots: false,
    };
    Node::new(spec, settings).expect("a node")
}

/// Calls the node only through the trait, as a vote rule written against it would.
async fn script_keys_and_facts(node: &impl VoteNode) -> (Vec<String>, String) {
    let script = Script::new("return {KEYS[1], KEYS[2], ARGV[1], ARGV[#ARGV]}");
    let (reply, facts) = node
        .run_script(&script, &["k", EPOCH_KEY], &["v"], TIMEOUT)
        .await
        .expect("the script runs");
    (decode(reply).expect("four strings"), facts.run_id.clone())
}

#[tokio::test]
async fn a_real_node_runs_scripts_reads_keys_and_publishes_through_the_vote_layers_trait() {
    let server = RedisNode::start();
    let node = node_at(&format!("{}/3", server.url()));
    assert!(VoteNode::server_stale(&node), "never connected yet");
    assert_eq!(VoteNode::server(&node), None);

    let (answer, run_id) = script_keys_and_facts(&node).await;
    // A plain master: the epoch marker keeps its name; the database index is appended.
    assert_eq!(answer, ["k", EPOCH_KEY, "v", "3"]);
    assert!(!run_id.is_empty());
    assert_eq!(VoteNode::server(&node), Some(format!("{run_id}/3")));
    assert_eq!(VoteNode::epoch_key(&node), EPOCH_KEY);
    assert!(FACTS_MAX_AGE > TIMEOUT);

    let set = redis::cmd("SET")
        .arg("k")
        .arg("holder:1")
        .arg("PX")
        .arg(60_000)
        .clone();
    node.command::<()>(&set, TIMEOUT).await.expect("SET");
    let (value, left) = VoteNode::read_key(&node, "k", TIMEOUT)
        .await
        .expect("read")
        .expect("the key is there");
    assert_eq!(value, "holder:1");
    assert!(left > Duration::from_secs(50) && left <= Duration::from_secs(60));
    assert_eq!(VoteNode::read_key(&node, "absent", TIMEOUT).await, Ok(None));

    let mut pushes = node
        .subscribe(&["lock:acquired"], None, None, TIMEOUT)
        .await
        .expect("subscribed");
    let listener = node_at(&server.url());
    let publish = redis::cmd("PUBLISH")
        .arg("lock:acquired")
        .arg("v1 7")
        .clone();
    let reached: u64 = listener
        .command(&publish, TIMEOUT)
        .await
        .expect("published");
    assert_eq!(reached, 1, "the subscription is live");
    let message = tokio::time::timeout(TIMEOUT, pushes.next())
        .await
        .expect("a message in time");
    assert_eq!(
        message,
        Some(("lock:acquired".to_owned(), "v1 7".to_owned()))
    );
}

#[tokio::test]
async fn a_reply_of_another_shape_is_a_typed_protocol_error() {
    let server = RedisNode::start();
    let node = node_at(&server.url());
    let script = Script::new("return 'not a number'");
    let (reply, _) = node
        .run_script(&script, &[], &[], TIMEOUT)
        .await
        .expect("the script runs");
    assert_eq!(reply, Value::BulkString(b"not a number".to_vec()));
    let err = decode::<i64>(reply).expect_err("not an integer");
    assert_eq!(err.kind, NodeErrorKind::Protocol);
}

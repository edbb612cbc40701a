//! Contenders with different ttls, through the real binary, when the only nodes that remember
//! the longer ttl are slow: a majority of the nodes loses its data while a long-ttl leader
//! holds the lock, and the nodes still holding its key and max-ttl register answer a new
//! short-ttl contender after its node timeout (`CLIENT PAUSE`). The new contender must not
//! count the young nodes on a guess about the slow ones' register: it reads their register
//! again before it judges (`round::acquire`, rule 5), so it never leads beside the old leader.
//!
//! Every test polls both sidecars' `/leader` all along ([`Watch`]) and checks at the end that
//! no claim began before the previous one ended and that tokens grew; and that somebody leads
//! again once the young nodes have kept their data for the longest ttl.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::time::{Duration, SystemTime};

use redlock_sidecar::redlock::votes;
use support::sidecar::Sidecar;
use support::tenures::Watch;
use support::{RedisCluster, RedisNode};
use tokio::task::block_in_place;

const LOCK: &str = "mixed";
const KEY: &str = "redlock:{mixed}";
/// The leader's ttl: the longer one, known only to the nodes that keep its register.
const LONG_TTL: Duration = Duration::from_secs(12);
/// How long the flushed nodes keep their new data before the short-ttl contender starts:
/// longer than its own ttl + drift, far shorter than the leader's.
const AGED: Duration = Duration::from_millis(1_200);
/// How long before its nodes counted a winning round may have begun, on a loaded machine.
const ROUND_SLACK: Duration = Duration::from_millis(500);
/// Bound on waiting for a leader: the young nodes count once they are the long ttl + drift
/// old, plus a loaded machine.
const ELECTION: Duration = Duration::from_secs(30);

/// One run of the sequence.
struct Case {
    /// Nodes in all.
    nodes: usize,
    /// Nodes that keep the leader's key and register (the first ones); the others are flushed.
    kept: usize,
    /// The short-ttl contender's `--node-timeout`.
    node_timeout: &'static str,
    /// `CLIENT PAUSE` on the kept nodes, as the contender starts: milliseconds and mode.
    pause: (u64, &'static str),
}

/// The long-ttl leader holds the lock; the nodes past `kept` lose their data right after one
/// of its renewals (their markers stamped afresh at once, as any contact would); once their
/// data is [`AGED`], the kept nodes pause and a contender with ttl 1 s and no `--max-ttl`
/// starts. Nobody leads beside the leader; somebody leads again later.
async fn a_short_ttl_contender_meets_a_slow_register(case: Case) {
    let cluster = block_in_place(|| RedisCluster::start(case.nodes));
    block_in_place(|| cluster.backdate_epochs(LONG_TTL));
    let redis = cluster.urls().join(",");
    let mut watch = Watch::with_election(ELECTION);
    let long = Sidecar::start("long", LOCK, &redis, "12s", &["--safety-margin", "1s"]);
    watch.add(&long);
    let held = watch
        .next_tenure(SystemTime::UNIX_EPOCH, Some("long"), "long leads", &[&long])
        .await;

    // Right after a renewal: the leader's validity runs for most of the ttl from here.
    let kept = cluster.node(0);
    let pttl = |node: &RedisNode| -> i64 {
        block_in_place(|| node.command(&["PTTL", KEY]))
            .parse()
            .unwrap_or(-2)
    };
    support::wait_until_async(ELECTION, "some time passes since a renewal", || async {
        (0..11_000).contains(&pttl(kept))
    })
    .await;
    support::wait_until_async(ELECTION, "long renews", || async { pttl(kept) > 11_500 }).await;
    let flushed_at = SystemTime::now();
    block_in_place(|| {
        for i in case.kept..case.nodes {
            let node = cluster.node(i);
            assert_eq!(node.command(&["FLUSHALL"]), "OK");
            assert_eq!(
                node.data_age(),
                Some(Duration::ZERO),
                "marker stamped afresh"
            );
        }
    });
    support::wait_until_async(ELECTION, "the flushed nodes' data ages", || async {
        block_in_place(|| {
            (case.kept..case.nodes)
                .all(|i| cluster.node(i).data_age().is_some_and(|age| age >= AGED))
        })
    })
    .await;
    assert!(
        AGED > votes::required_data_age(Duration::from_secs(1)),
        "the young nodes are old enough for the short ttl alone"
    );

    let (ms, mode) = case.pause;
    block_in_place(|| {
        for i in 0..case.kept {
            let paused = cluster
                .node(i)
                .command(&["CLIENT", "PAUSE", &ms.to_string(), mode]);
            assert_eq!(paused, "OK");
        }
    });
    let short = Sidecar::start(
        "short",
        LOCK,
        &redis,
        "1s",
        &[
            "--node-timeout",
            case.node_timeout,
            "--safety-margin",
            "250ms",
        ],
    );
    watch.add(&short);

    // The old leader's next renewal finds its key gone from a majority and steps down; nobody
    // leads until the flushed nodes have kept their data for the long ttl + drift.
    let next = watch
        .next_tenure(held.since, None, "somebody leads again", &[&long, &short])
        .await;
    let tenures = watch.finish(&[&long, &short]).await;
    let old = tenures
        .iter()
        .find(|t| t.who == "long" && t.token == held.token)
        .expect("long's tenure");
    assert!(
        next.claimed_after >= old.ended_by,
        "{} led before long's claim ended: {tenures:?}",
        next.who
    );
    // The markers were stamped just after `flushed_at`; a round that won began at most a
    // round before the nodes counted.
    assert!(
        next.since + ROUND_SLACK >= flushed_at + votes::required_data_age(LONG_TTL),
        "no node that lost its data counts before it kept it for the long ttl: {tenures:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_register_s_only_holder_paused_for_writes_past_the_default_node_timeout() {
    a_short_ttl_contender_meets_a_slow_register(Case {
        nodes: 3,
        kept: 1,
        node_timeout: "50ms",
        pause: (150, "WRITE"),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_register_s_only_holder_paused_for_writes_past_a_200ms_node_timeout() {
    a_short_ttl_contender_meets_a_slow_register(Case {
        nodes: 3,
        kept: 1,
        node_timeout: "200ms",
        pause: (400, "WRITE"),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_register_s_only_holder_answering_everything_just_after_the_timeout() {
    a_short_ttl_contender_meets_a_slow_register(Case {
        nodes: 3,
        kept: 1,
        node_timeout: "50ms",
        pause: (120, "ALL"),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_register_on_two_of_five_nodes_both_paused() {
    a_short_ttl_contender_meets_a_slow_register(Case {
        nodes: 5,
        kept: 2,
        node_timeout: "50ms",
        pause: (300, "WRITE"),
    })
    .await;
}

/// A rollout that lowers the ttl from 12 s to 1 s, with the max ttl the chart passes to every
/// pod (`lock.maxTtl`, here 12 s: at least the old ttl), and a majority of the Redis nodes
/// restarted empty mid-way: old and new pods contend side by side (maxSurge 1: a new pod
/// starts, then an old one is terminated), and never two lead at once; somebody leads at the
/// end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chart_rollout_from_a_12s_to_a_1s_ttl_with_a_majority_restarted_mid_way() {
    let mut cluster = block_in_place(|| RedisCluster::start(3));
    block_in_place(|| cluster.backdate_epochs(LONG_TTL));
    let redis = cluster.urls().join(",");
    let old_flags = ["--max-ttl", "12s", "--safety-margin", "1s"];
    let new_flags = ["--max-ttl", "12s", "--node-timeout", "50ms"];
    let mut watch = Watch::with_election(ELECTION);
    let mut old = Vec::new();
    for name in ["old-0", "old-1"] {
        let pod = Sidecar::start(name, LOCK, &redis, "12s", &old_flags);
        watch.add(&pod);
        old.push(pod);
    }
    let first = watch
        .next_tenure(
            SystemTime::UNIX_EPOCH,
            None,
            "an old pod leads",
            &[&old[0], &old[1]],
        )
        .await;
    let mut new = Vec::new();
    for step in 0..2 {
        let pod = Sidecar::start(&format!("new-{step}"), LOCK, &redis, "1s", &new_flags);
        watch.add(&pod);
        pod.wait_serving().await;
        new.push(pod);
        if step == 0 {
            // Mid-way: a majority of the nodes restarts empty.
            block_in_place(|| {
                cluster.node_mut(1).restart();
                cluster.node_mut(2).restart();
            });
        }
        let mut gone = old.remove(0);
        gone.proc.sigterm();
        let status = gone.proc.wait_exit_async(Duration::from_secs(10)).await;
        assert_eq!(
            status.and_then(|s| s.code()),
            Some(0),
            "{}",
            gone.proc.output_text()
        );
        watch.keep_log(gone.name.clone(), gone.proc.stderr_text());
    }
    let running: Vec<&Sidecar> = new.iter().collect();
    let next = watch
        .next_tenure(first.since, None, "a new pod leads", &running)
        .await;
    assert!(next.who.starts_with("new-"), "{next:?}");
    watch.lasted(&next, Duration::from_secs(2)).await;
    watch.finish(&running).await;
}

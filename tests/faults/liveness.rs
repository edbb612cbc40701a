//! Regression tests for liveness bugs the scenarios found (not safety).

use super::*;

/// Restarted-node conditions without a restart: node 2 forgets the key, its script cache and its
/// client connections.
pub(crate) fn forget_like_a_restart(node: &RedisNode, key: &str) {
    node.command(&["DEL", key]);
    node.command(&["SCRIPT", "FLUSH"]);
    node.command(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]);
}

/// Makes `holder`'s key on nodes 0 and 1 (a quorum of three) outlive the test. The round was
/// decided at quorum, so the key may still be landing on one of them: waits for it first.
pub(crate) fn keep_for_the_test(cluster: &RedisCluster, key: &str, holder: &str) {
    for node in [cluster.node(0), cluster.node(1)] {
        support::wait_until(Duration::from_secs(2), "the holder's key lands", || {
            node.command(&["GET", key])
                .starts_with(&format!("{holder}:"))
        });
        assert_eq!(node.command(&["PEXPIRE", key, "120000"]), "1");
    }
}

/// A regression test for a defect these scenarios found: a lost round's cleanup overtook the
/// round's own SET on a node that had just restarted and left a key behind for a whole ttl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn a_lost_round_leaves_no_key_behind_on_a_node_that_just_restarted() {
    let cluster = ready_cluster(3, LIB_TTL);
    let urls = cluster.urls();
    let key = "redlock:{stale}";
    let client = |identity: &str| {
        Redlock::new(
            lib_config("stale", identity, &urls),
            Arc::new(VoteCounter::default()),
        )
        .expect("valid config")
    };
    let (holder, standby) = (client("holder"), client("standby"));
    holder.try_acquire().await.expect("holder acquires");
    // The holder keeps nodes 0 and 1 for the whole test.
    block_in_place(|| keep_for_the_test(&cluster, key, "holder"));
    let addr = cluster.node(2).addr();
    let mut leaked = Vec::new();
    for trial in 0..200 {
        block_in_place(|| forget_like_a_restart(cluster.node(2), key));
        // Nodes 0 and 1 answer "held" first: the round is lost before node 2 answers, and the
        // cleanup is sent to node 2 while its SET is still on the way (EVALSHA, NOSCRIPT,
        // SCRIPT LOAD, EVALSHA). The cleanup must still come after the SET.
        standby.try_acquire().await.expect_err("the lock is held");
        let cleaned = tokio::spawn(async move {
            support::wait_until_async(
                Duration::from_millis(300),
                "the lost round's key is cleaned up",
                || async {
                    !support::command_at_async(addr, &["GET", key], Duration::from_secs(1))
                        .await
                        .unwrap_or_default()
                        .starts_with("standby:")
                },
            )
            .await
        });
        if cleaned.await.is_err() {
            leaked.push(trial);
        }
    }
    assert!(
        leaked.is_empty(),
        "lost rounds left their key on node 2 (for a whole ttl) in trials {leaked:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn extend_puts_the_key_back_on_a_node_that_lost_it_even_when_that_node_is_slower()
{
    let cluster = ready_cluster(3, LIB_TTL);
    // Node 2 answers 10 ms later than the others (well within the node timeout), as a node does
    // whose connection and scripts must be set up again after a restart.
    let slow = FaultProxy::start(cluster.node(2).addr()).await;
    slow.set_latency(Duration::from_millis(5), Duration::ZERO);
    let urls = vec![cluster.node(0).url(), cluster.node(1).url(), slow.url()];
    // The proxy delays each chunk in turn, so back-to-back extends queue up behind each other
    // on the slow link: a node timeout that covers the queue.
    let mut cfg = lib_config("repair", "holder", &urls);
    cfg.node_timeout = Duration::from_millis(200);
    let redlock = Redlock::new(cfg, Arc::new(VoteCounter::default())).expect("valid config");
    let mut lease = redlock.try_acquire().await.expect("acquires");
    let key = "redlock:{repair}";
    block_in_place(|| cluster.node(2).command(&["DEL", key]));
    for _ in 0..3 {
        lease = redlock.extend(&lease).await.expect("nodes 0 and 1 grant");
    }
    let node2 = cluster.node(2).addr();
    support::wait_until_async(
        Duration::from_millis(500),
        "node 2 has the holder's key again after three extends",
        || async {
            support::command_at_async(node2, &["GET", key], Duration::from_secs(1))
                .await
                .is_ok_and(|v| v == lease.value())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn waiters_for_a_held_lock_do_not_wake_each_other() {
    let cluster = ready_cluster(3, LIB_TTL);
    let urls = cluster.urls();
    let key = "redlock:{storm}";
    let holder = Redlock::new(
        lib_config("storm", "holder", &urls),
        Arc::new(VoteCounter::default()),
    )
    .expect("valid config");
    holder.try_acquire().await.expect("holder acquires");
    // The holder has nodes 0 and 1 (a quorum) for the whole test; node 2 lost its key. Every
    // waiter's round is granted on node 2 and lost; its cleanup deletes that grant.
    block_in_place(|| {
        keep_for_the_test(&cluster, key, "holder");
        cluster.node(2).command(&["DEL", key]);
    });
    let rounds = Arc::new(AtomicUsize::new(0));
    let waiting = Duration::from_secs(3);
    let mut waiters = Vec::new();
    for i in 0..3 {
        let mut cfg = lib_config("storm", &format!("waiter{i}"), &urls);
        cfg.retry_delay = Duration::from_millis(200);
        cfg.retry_max = Duration::from_secs(1);
        let redlock = Redlock::new(cfg, Arc::new(VoteCounter::default())).expect("valid config");
        let rounds = rounds.clone();
        waiters.push(tokio::spawn(async move {
            let never = CancellationToken::new();
            redlock
                .acquire(Some(Deadline::now() + waiting), &never, |_, _| {
                    rounds.fetch_add(1, Ordering::Relaxed);
                })
                .await
                .expect_err("the lock stays held");
        }));
    }
    for waiter in waiters {
        waiter.await.expect("waiter finished");
    }
    // Polling a held lock about once per retry_max: a handful of rounds each.
    let rounds = rounds.load(Ordering::Relaxed);
    assert!(
        rounds <= 3 * 6,
        "3 waiters made {rounds} rounds in {waiting:?}: lost rounds' cleanups woke them"
    );
}

//! Redis nodes restarted empty, one by one or all in turn.

use super::*;

/// Restarts `nodes` of `cluster` (SIGKILL, then start empty on the same port) from a blocking
/// section; `down` is how long they stay down.
pub(crate) fn restart_nodes(cluster: &Mutex<RedisCluster>, nodes: &[usize], down: Duration) {
    block_in_place(|| {
        let mut cluster = cluster.lock().unwrap_or_else(|e| e.into_inner());
        for &i in nodes {
            cluster.node_mut(i).stop();
        }
        // The fault's own duration: the nodes are down this long.
        std::thread::sleep(down);
        for &i in nodes {
            cluster.node_mut(i).start_again();
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn redis_nodes_restarted_empty_under_held_locks_never_allow_two_holders() {
    let cluster = Mutex::new(ready_cluster(3, LIB_TTL));
    let urls = cluster.lock().unwrap().urls();
    let fleet = LibFleet::start(
        "restart-lib",
        "lib",
        &vec![urls.clone(); 4],
        &[LibPlan::holding(), LibPlan::quick()],
        11,
    );
    let mut rng = StdRng::seed_from_u64(11);
    let (mut faults, mut restarts) = (0, 0);
    let mut held_when_hit = 0;
    let end = Instant::now() + Duration::from_secs(12);
    let mut last_fault = Instant::now();
    while Instant::now() < end {
        // Strike while someone holds the lock (a restart loses the holder's key on that node);
        // every other time, a critical section of 2–4 × ttl that renewals carry.
        let (_, who, token) = if faults % 2 == 1 {
            long_section(&fleet, "a long critical section under restarts").await
        } else {
            open_session(
                fleet.store(),
                LIB_TTL * 3 + TAKEOVER_SLACK,
                "the lock is taken again once a quorum counts",
            )
            .await
        };
        let k = rng.random_range(1..=2);
        let mut nodes: Vec<usize> = (0..3).collect();
        while nodes.len() > k {
            nodes.remove(rng.random_range(0..nodes.len()));
        }
        restart_nodes(
            &cluster,
            &nodes,
            Duration::from_millis(rng.random_range(0..100)),
        );
        held_when_hit += usize::from(fleet.store().is_open(&who, token));
        faults += 1;
        restarts += k;
        last_fault = Instant::now();
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..1500))).await;
    }
    // Liveness: once the restarted nodes have been up for ttl + drift, the lock moves again.
    next_session(
        fleet.store(),
        last_fault,
        None,
        LIB_TTL * 3 + TAKEOVER_SLACK,
        "the lock is taken again after the last restart",
    )
    .await;
    let ctx = fleet.stop().await;
    let not_counted = ctx.votes.not_counted.load(Ordering::Relaxed);
    assert!(
        not_counted > 0,
        "the restart rule had votes to refuse (restarted nodes granted)"
    );
    assert!(held_when_hit > 0, "restarts hit held locks");
    let (_, row) = check(
        &format!("Redis restarts, 1–2 of 3 at once ({restarts} restarts)"),
        "4 library",
        faults,
        &ctx.store.records(),
        Mode::Strict,
        &[],
    );
    checker::report(vec![row]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn a_rolling_restart_of_every_node_keeps_one_holder_at_a_time() {
    let cluster = Mutex::new(ready_cluster(3, PROC_TTL));
    let urls = cluster.lock().unwrap().urls();
    let fleet = LibFleet::start(
        "roll-lib",
        "lib",
        &vec![urls.clone(); 4],
        &[LibPlan::holding(), LibPlan::quick()],
        13,
    );
    let run = RunFleet::start("roll-run", "run", &urls, 2);
    open_session(
        &run.store,
        PROC_TTL + TAKEOVER_SLACK,
        "a run sidecar leads before the rolling restart",
    )
    .await;
    // Two rounds over the nodes, one at a time, as a StatefulSet rollout does: each node is down
    // briefly, comes back empty, and the next one goes once it answers again (plus a pause).
    let mut restarts = 0;
    for _ in 0..2 {
        for node in 0..3 {
            if node == 0 {
                // The next library holder holds 2–4 × ttl, through this round's restarts.
                fleet.ctx.request_long();
            }
            restart_nodes(&cluster, &[node], Duration::from_millis(200));
            restarts += 1;
            tokio::time::sleep(Duration::from_millis(1200)).await;
        }
    }
    let rolled = Instant::now();
    // Liveness for the run lock: its leader may lose the lock during the rollout (see
    // `a_leader_keeps_its_lock_through_a_rolling_restart` below), but someone leads after it.
    support::wait_until_async(
        PROC_TTL * 2 + TAKEOVER_SLACK,
        "a run sidecar leads after the rolling restart",
        || async {
            run.leader().is_some_and(|(_, who, token)| {
                run.store.count_since(rolled, |r| {
                    r.who == who && r.token == token && r.kind != Kind::Gone
                }) > 0
            })
        },
    )
    .await;
    // Liveness for the library lock, whose handoffs need counted votes.
    next_session(
        fleet.store(),
        rolled,
        None,
        LIB_TTL * 3 + TAKEOVER_SLACK,
        "the library lock moves again after the rolling restart",
    )
    .await;
    let ctx = fleet.stop().await;
    let run_store = run.store.clone();
    run.stop().await;
    let (_, lib_row) = check(
        "rolling restart, 2 rounds (library)",
        "4 library",
        restarts,
        &ctx.store.records(),
        Mode::Strict,
        &[],
    );
    let (_, run_row) = check(
        "rolling restart, 2 rounds (run)",
        "2 run + app",
        restarts,
        &run_store.records(),
        Mode::Strict,
        &[],
    );
    checker::report(vec![lib_row, run_row]);
}

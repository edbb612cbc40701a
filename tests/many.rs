//! Many locks on one engine, against real redis-servers: every request lock of a sidecar shares
//! one connection per node, and a release wakes the waiter of its own name only.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use redlock_sidecar::clock::Deadline;
use redlock_sidecar::locks::{Locks, RedlockEngine};
use redlock_sidecar::metrics::Metrics;
use redlock_sidecar::redlock::info_field;
use support::RedisCluster;

/// Longest wait for anything these tests expect to happen.
const DEADLINE: Duration = Duration::from_secs(30);
/// The ttl of the leases here: long, so that only a release (never an expiry) frees a name.
const TTL: Duration = Duration::from_secs(60);
/// How many names one sidecar holds at once.
const NAMES: usize = 300;

fn ready_cluster() -> RedisCluster {
    let cluster = RedisCluster::start(3);
    cluster.backdate_epochs(TTL);
    cluster
}

/// A request-lock service as a sidecar named `identity` runs it, on `cluster`.
fn service(cluster: &RedisCluster, identity: &str) -> Arc<Locks<RedlockEngine>> {
    let urls = cluster.urls();
    let mut cfg = support::engine_config(&urls, "leader", identity, Duration::from_secs(2));
    // A waiter that hears nothing reads the nodes only this often: a quick wake-up is a push.
    cfg.retry_max = Duration::from_secs(5);
    let metrics = Metrics::new("leader", &urls, None);
    Locks::new(
        RedlockEngine::standalone(cfg, "app").expect("an engine"),
        10_000,
        metrics.app_locks().clone(),
    )
}

/// `connected_clients` of `INFO clients` on every node (the asking connection included).
fn clients(cluster: &RedisCluster) -> Vec<u64> {
    cluster
        .iter()
        .map(|node| {
            info_field(&node.command(&["INFO", "clients"]), "connected_clients")
                .parse()
                .expect("connected_clients")
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_leases_in_one_sidecar_use_one_connection_per_node() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let before = clients(&cluster);
    let a = service(&cluster, "sidecar-a");
    let mut leases = Vec::new();
    for i in 0..NAMES {
        let granted = a
            .acquire(&format!("order-{i}"), TTL, Duration::ZERO, None)
            .await
            .unwrap_or_else(|e| panic!("order-{i}: {e:?}"));
        leases.push(granted);
    }
    assert_eq!(a.held(), NAMES);
    let during = clients(&cluster);
    for (node, (before, during)) in before.iter().zip(&during).enumerate() {
        // One for the engine (the asking connection is counted in both), and at most one for
        // the names opened before the engine's first connection told it the node is no
        // cluster (they get a group of their slot, see `redlock::Engine`).
        assert!(
            *during <= before + 2,
            "node {node}: {during} clients with {NAMES} leases held (before: {before})"
        );
    }
    eprintln!("{NAMES} leases held: connected_clients per node {during:?} (before {before:?})");
    for node in cluster.iter() {
        assert_eq!(node.command(&["EXISTS", "redlock:{app:order-7}"]), "1");
    }
    a.shutdown().await;
    assert_eq!(a.held(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_the_waiter_of_its_name_and_no_other() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let holder = service(&cluster, "sidecar-holder");
    let waiter = service(&cluster, "sidecar-waiter");
    let mut held = Vec::new();
    for name in ["stock-1", "stock-2"] {
        let granted = holder
            .acquire(name, TTL, Duration::ZERO, None)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e:?}"));
        held.push(granted);
    }
    let wait_for = |name: &'static str| {
        let waiter = waiter.clone();
        tokio::spawn(async move { waiter.acquire(name, TTL, DEADLINE, None).await })
    };
    // Subscribers of each name's acquisition channel on each node (the holder's own included).
    let numsub = || -> Vec<u64> {
        cluster
            .iter()
            .flat_map(|node| {
                let counts = node.command(&[
                    "PUBSUB",
                    "NUMSUB",
                    "redlock:{app:stock-1}:acquired",
                    "redlock:{app:stock-2}:acquired",
                ]);
                // Lines: channel, count, channel, count.
                let counts: Vec<u64> = counts
                    .lines()
                    .skip(1)
                    .step_by(2)
                    .map(|n| n.parse().expect("a count"))
                    .collect();
                counts
            })
            .collect()
    };
    let before = numsub();
    let first = wait_for("stock-1");
    let second = wait_for("stock-2");
    // Both are waiting on the nodes: one more subscriber of each name everywhere.
    support::wait_until_async(DEADLINE, "both waiters subscribed", || async {
        numsub()
            .iter()
            .zip(&before)
            .all(|(now, before)| now > before)
    })
    .await;

    let released = Instant::now();
    holder
        .release("stock-1", held[0].lease)
        .await
        .expect("released");
    let granted = tokio::time::timeout(DEADLINE, first)
        .await
        .expect("the waiter of stock-1 answers")
        .expect("joined")
        .expect("stock-1 granted");
    let woken_in = released.elapsed();
    assert!(
        woken_in < Duration::from_secs(2),
        "woken by the release, not a read: {woken_in:?}"
    );
    assert!(granted.fencing_token > held[0].fencing_token);
    assert!(
        !second.is_finished(),
        "stock-2 is still held: its waiter waits on"
    );
    assert_eq!(
        cluster
            .node(0)
            .command(&["GET", "redlock:{app:stock-2}"])
            .split(':')
            .next(),
        Some("sidecar-holder")
    );

    let released = Instant::now();
    holder
        .release("stock-2", held[1].lease)
        .await
        .expect("released");
    tokio::time::timeout(DEADLINE, second)
        .await
        .expect("the waiter of stock-2 answers")
        .expect("joined")
        .expect("stock-2 granted");
    assert!(released.elapsed() < Duration::from_secs(2));
    waiter.shutdown().await;
    holder.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_held_leases_renew_with_about_one_request_per_node_per_interval() {
    const LEASES: usize = 1_000;
    // Renewed every two seconds (a third of the ttl).
    const SHORT_TTL: Duration = Duration::from_secs(6);
    let interval = SHORT_TTL / 3;
    let cluster = tokio::task::block_in_place(ready_cluster);
    let a = service(&cluster, "sidecar-a");
    let leases = Arc::new(std::sync::Mutex::new(Vec::new()));
    // The app keeps every lease alive, from the moment it has it.
    let keeping = {
        let (a, leases) = (a.clone(), leases.clone());
        tokio::spawn(async move {
            loop {
                let held: Vec<(String, _)> = leases.lock().unwrap().clone();
                for (name, lease) in &held {
                    a.keepalive(name, *lease).expect("still held");
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
    };
    for i in 0..LEASES {
        let name = format!("order-{i}");
        let granted = a
            .acquire(&name, SHORT_TTL, Duration::ZERO, None)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e:?}"));
        leases.lock().unwrap().push((name, granted.lease));
    }
    let scripts = |node: &support::RedisNode| node.calls("evalsha") + node.calls("eval");
    // Renewals that ended together renew together from then on: let them fall into step.
    tokio::time::sleep(interval * 6).await;
    let before: Vec<u64> = cluster.iter().map(scripts).collect();
    let window_start = Instant::now();
    tokio::time::sleep(interval * 6).await;
    let after: Vec<u64> = cluster.iter().map(scripts).collect();
    let intervals = window_start.elapsed().as_secs_f64() / interval.as_secs_f64();
    keeping.abort();
    assert_eq!(a.held(), LEASES, "every lease was renewed");
    for (node, (before, after)) in before.iter().zip(&after).enumerate() {
        let per_interval = (after - before) as f64 / intervals;
        eprintln!("L={LEASES} node {node}: {per_interval:.2} script calls per renew interval");
        // One request per lease would be 1,000; batches are at least a sixth of the ttl apart
        // (see `redlock::batch`): at most 2, and one more at the window's edge.
        assert!(
            per_interval <= 2.0 + 1.0 / intervals,
            "node {node}: {per_interval:.2} script calls per renew interval for {LEASES} leases"
        );
    }
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_renewals_keep_every_rule_of_a_single_renewal() {
    use redlock_sidecar::redlock::{Engine, LockError, NoObserver, Redlock};
    let cluster = tokio::task::block_in_place(ready_cluster);
    let urls = cluster.urls();
    let cfg = |name: &str| support::engine_config(&urls, name, "batcher", Duration::from_secs(3));
    let engine = Engine::new(&cfg("any")).expect("engine");
    engine.connect(DEADLINE).await;
    let open = |name: &str| Redlock::on(&engine, cfg(name), Arc::new(NoObserver)).expect("lock");
    let (kept, restored, taken) = (open("kept"), open("restored"), open("taken"));
    assert_eq!(
        engine.groups(),
        1,
        "no cluster: one group of nodes for every name"
    );
    let mut leases = Vec::new();
    for lock in [&kept, &restored, &taken] {
        leases.push(lock.try_acquire().await.expect("acquired"));
    }
    // Once alone, so that every node knows the batch script.
    leases[0] = kept.extend(&leases[0]).await.expect("kept renews");
    // `restored` lost its key on node 0; `taken` is held by someone else everywhere.
    cluster.node(0).command(&["DEL", "redlock:{restored}"]);
    for node in cluster.iter() {
        node.command(&["SET", "redlock:{taken}", "other:1", "PX", "60000"]);
    }
    let before: Vec<u64> = cluster
        .iter()
        .map(|n| n.calls("evalsha") + n.calls("eval"))
        .collect();
    let (a, b, c) = tokio::join!(
        kept.extend(&leases[0]),
        restored.extend(&leases[1]),
        taken.extend(&leases[2]),
    );
    let after: Vec<u64> = cluster
        .iter()
        .map(|n| n.calls("evalsha") + n.calls("eval"))
        .collect();
    let renewed = a.expect("kept renews");
    assert!(
        renewed.valid_until >= leases[0].valid_until,
        "never earlier"
    );
    b.expect("a quorum still has it: renewed");
    assert!(
        matches!(c, Err(LockError::Superseded { .. })),
        "another holder everywhere: superseded, {c:?}"
    );
    // One script per node carried the three renewals (node 0 also ran the restore).
    for (node, (before, after)) in before.iter().zip(&after).enumerate().skip(1) {
        assert_eq!(
            after - before,
            1,
            "node {node}: one batch; {}",
            cluster.node(node).command(&["INFO", "commandstats"])
        );
    }
    support::wait_until_async(
        DEADLINE,
        "the lost key is restored after the quorum",
        || async { cluster.node(0).command(&["GET", "redlock:{restored}"]) == leases[1].value() },
    )
    .await;
    assert_eq!(
        cluster.node(1).command(&["GET", "redlock:{taken}"]),
        "other:1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_mode_deployment_each_slot_in_use_gets_its_own_nodes_and_batches() {
    use redlock_sidecar::redlock::cluster::key_slot;
    use redlock_sidecar::redlock::{Engine, NoObserver, Redlock};
    use support::cluster_mode::ClusterMode;
    let cluster = tokio::task::block_in_place(|| ClusterMode::start(3, 0));
    let url = cluster.masters[0].url();
    let ttl = Duration::from_secs(1);
    let cfg = |name: &str| support::engine_config(std::slice::from_ref(&url), name, "a", ttl);
    let engine = Engine::new(&cfg("any")).expect("engine");
    engine.connect(DEADLINE).await;
    // Two names whose slots two other masters serve.
    let names: Vec<String> = [1, 2]
        .into_iter()
        .map(|master| {
            (0..)
                .map(|n| format!("job-{n}"))
                .find(|name| {
                    let slot = key_slot(&format!("redlock:{{{name}}}"));
                    cluster.master_of(slot).map(|m| m.port())
                        == Some(cluster.masters[master].port())
                })
                .expect("a name")
        })
        .collect();
    // The second takes its tokens from a namespace's counter, which must sit on its shard.
    let locks: Vec<Redlock> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut cfg = cfg(name);
            cfg.fence_namespace = (i == 1).then(|| "app".to_owned());
            Redlock::on(&engine, cfg, Arc::new(NoObserver)).expect("lock")
        })
        .collect();
    assert_eq!(
        engine.groups(),
        3,
        "the engine's own group and one per slot in use"
    );
    let deadline = Deadline::now() + DEADLINE;
    let mut leases = Vec::new();
    for lock in &locks {
        let cancel = tokio_util::sync::CancellationToken::new();
        let lease = lock
            .acquire(Some(deadline), &cancel, |_, _| {})
            .await
            .expect("the lock, once its slot's marker is ttl + drift old");
        leases.push(lease);
    }
    let (a, b) = tokio::join!(locks[0].extend(&leases[0]), locks[1].extend(&leases[1]));
    a.expect("renewed through its slot's batch");
    b.expect("renewed through its slot's batch");
    for (master, name) in [1, 2].into_iter().zip(&names) {
        let key = format!("redlock:{{{name}}}");
        assert!(cluster.masters[master]
            .command(&["GET", &key])
            .starts_with("a:"));
    }
    let shared = redlock_sidecar::redlock::fencing::counter_key(&names[1], Some("app"));
    assert_eq!(
        cluster.masters[2].command(&["GET", &shared]),
        leases[1].fencing_token.to_string(),
        "the namespace's counter of the name's slot holds its token, on its shard"
    );
}

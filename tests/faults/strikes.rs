//! Data loss under held locks: flushes, older snapshots, failovers to replicas that missed writes.

use super::*;

/// The faults the soak test picks from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Fault {
    /// One node killed and started again empty.
    RestartOne,
    /// Two of three nodes at once: a majority loses the lock and the fencing counter.
    RestartTwo,
    /// Every node at once: all data gone.
    RestartAll,
    /// A node frozen (SIGSTOP) and thawed.
    PauseNode,
    /// The holder cut off from two nodes: bytes held until healed.
    CutHolderBlackhole,
    /// The holder cut off from two nodes: connections reset.
    CutHolderRefuse,
    /// Some contender cut off from one node.
    CutMinority,
    /// Latency and jitter on every contender's every node.
    Latency,
    /// Every connection to one node dropped.
    DropConnections,
    /// The holder dies without releasing.
    CrashHolder,
    /// The holder pauses past its validity, then writes.
    PauseHolder,
    /// `FLUSHALL` on one, two or three nodes: data lost without a restart.
    FlushAll,
    /// `FLUSHDB` on one, two or three nodes.
    FlushDb,
    /// One, two or three nodes restored from a snapshot taken a moment before (the lock has
    /// moved on since): old data, a new run id.
    RestoreSnapshot,
    /// One node's address moved to a replica whose link broke a moment before: it missed the
    /// latest writes.
    Failover,
}

pub(crate) const FAULTS: [Fault; 15] = [
    Fault::RestartOne,
    Fault::RestartTwo,
    Fault::RestartAll,
    Fault::PauseNode,
    Fault::CutHolderBlackhole,
    Fault::CutHolderRefuse,
    Fault::CutMinority,
    Fault::Latency,
    Fault::DropConnections,
    Fault::CrashHolder,
    Fault::PauseHolder,
    Fault::FlushAll,
    Fault::FlushDb,
    Fault::RestoreSnapshot,
    Fault::Failover,
];

/// Picks `k` distinct nodes of three.
pub(crate) fn some_nodes(rng: &mut StdRng, k: usize) -> Vec<usize> {
    let mut nodes: Vec<usize> = (0..3).collect();
    while nodes.len() > k {
        nodes.remove(rng.random_range(0..nodes.len()));
    }
    nodes
}

/// Injects `fault`, waits out its duration and heals it.
pub(crate) async fn inject(
    fault: Fault,
    rng: &mut StdRng,
    cluster: &Mutex<RedisCluster>,
    proxies: &[Vec<FaultProxy>],
    fleet: &LibFleet,
    standbys: &Standbys,
) {
    let ms = |rng: &mut StdRng, lo: u64, hi: u64| Duration::from_millis(rng.random_range(lo..hi));
    match fault {
        Fault::RestartOne | Fault::RestartTwo | Fault::RestartAll => {
            let k = match fault {
                Fault::RestartOne => 1,
                Fault::RestartTwo => 2,
                _ => 3,
            };
            let nodes = some_nodes(rng, k);
            let down = ms(rng, 0, 200);
            restart_nodes(cluster, &nodes, down);
        }
        Fault::PauseNode => {
            let node = rng.random_range(0..3);
            let lasting = ms(rng, 200, 1500);
            block_in_place(|| cluster.lock().unwrap().node_mut(node).pause());
            tokio::time::sleep(lasting).await;
            block_in_place(|| cluster.lock().unwrap().node_mut(node).resume());
        }
        Fault::CutHolderBlackhole | Fault::CutHolderRefuse | Fault::CutMinority => {
            let (who, nodes) = if fault == Fault::CutMinority {
                (rng.random_range(0..proxies.len()), some_nodes(rng, 1))
            } else {
                let holder = fleet.holder().map_or(0, |(i, _, _)| i);
                (holder, some_nodes(rng, 2))
            };
            let lasting = ms(rng, 300, 1500);
            cut_off(&proxies[who], &nodes, fault != Fault::CutHolderRefuse);
            tokio::time::sleep(lasting).await;
            heal(&proxies[who]);
        }
        Fault::Latency => {
            let (fixed, jitter) = (ms(rng, 0, 10), ms(rng, 1, 40));
            let lasting = ms(rng, 500, 2000);
            for contender in proxies {
                for proxy in contender {
                    proxy.set_latency(fixed, jitter);
                }
            }
            tokio::time::sleep(lasting).await;
            for contender in proxies {
                heal(contender);
            }
        }
        Fault::DropConnections => {
            let node = rng.random_range(0..3);
            for contender in proxies {
                contender[node].drop_connections();
            }
        }
        Fault::CrashHolder => {
            let before = fleet.ctx.crashes().len();
            fleet.ctx.crash_requests.fetch_add(1, Ordering::SeqCst);
            support::wait_until_async(LIB_TTL * 3 + TAKEOVER_SLACK, "a holder crashes", || async {
                fleet.ctx.crashes().len() > before
            })
            .await;
        }
        Fault::FlushAll | Fault::FlushDb => {
            let command = if fault == Fault::FlushAll {
                "FLUSHALL"
            } else {
                "FLUSHDB"
            };
            let k = rng.random_range(1..=3);
            let nodes = some_nodes(rng, k);
            let cut = cut_holder_beside(rng, fleet, proxies, &nodes);
            block_in_place(|| {
                let cluster = cluster.lock().unwrap_or_else(|e| e.into_inner());
                for &i in &nodes {
                    assert_eq!(cluster.node(i).command(&[command]), "OK");
                }
            });
            heal_later(cut, ms(rng, 300, 1500)).await;
        }
        Fault::RestoreSnapshot => {
            let k = rng.random_range(1..=3);
            let nodes = some_nodes(rng, k);
            block_in_place(|| {
                let cluster = cluster.lock().unwrap_or_else(|e| e.into_inner());
                for &i in &nodes {
                    cluster.node(i).save_snapshot();
                }
            });
            // The lock moves on after the snapshot.
            tokio::time::sleep(ms(rng, 200, 1500)).await;
            let cut = cut_holder_beside(rng, fleet, proxies, &nodes);
            block_in_place(|| {
                let mut cluster = cluster.lock().unwrap_or_else(|e| e.into_inner());
                for &i in &nodes {
                    cluster.node_mut(i).restart_from_snapshot();
                }
            });
            heal_later(cut, ms(rng, 300, 1500)).await;
        }
        Fault::Failover => {
            let node = rng.random_range(0..3);
            let missed = ms(rng, 0, 500);
            let cut = cut_holder_beside(rng, fleet, proxies, &[node]);
            standbys.failover(cluster, proxies, node, missed).await;
            heal_later(cut, ms(rng, 300, 1500)).await;
        }
        Fault::PauseHolder => {
            let before = fleet.ctx.pauses().len();
            *fleet
                .ctx
                .pause_request
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(LIB_TTL + ms(rng, 0, 500));
            support::wait_until_async(
                LIB_TTL * 4 + TAKEOVER_SLACK,
                "a holder pauses and wakes",
                || async { fleet.ctx.pauses().len() > before },
            )
            .await;
        }
    }
}

/// Half the time, cuts the current holder off from one node outside `struck` (its connections
/// refused), so that its key stands on a bare majority that includes the struck nodes: losing
/// one node's data then decides who may hold the lock. Returns the proxies to heal.
pub(crate) fn cut_holder_beside<'a>(
    rng: &mut StdRng,
    fleet: &LibFleet,
    proxies: &'a [Vec<FaultProxy>],
    struck: &[usize],
) -> Option<&'a [FaultProxy]> {
    let spared: Vec<usize> = (0..3).filter(|i| !struck.contains(i)).collect();
    let (holder, _, _) = fleet.holder()?;
    if spared.is_empty() || !rng.random_bool(0.5) {
        return None;
    }
    let node = spared[rng.random_range(0..spared.len())];
    cut_off(&proxies[holder], &[node], false);
    Some(&proxies[holder])
}

/// Heals `cut` (from [`cut_holder_beside`]) after `after`.
pub(crate) async fn heal_later(cut: Option<&[FaultProxy]>, after: Duration) {
    if let Some(proxies) = cut {
        tokio::time::sleep(after).await;
        heal(proxies);
    }
}

/// One replica per node, kept in sync through a proxy (so that its link can be cut), ready to
/// take over the node's address. They start with the cluster, so that the first failover of a
/// node promotes a server that has been up for a long time (an uptime rule cannot catch it), and
/// carries a copy of the node's epoch marker.
pub(crate) struct Standbys {
    /// Per node: the replica and the proxy it replicates through (`None` while failing over).
    pub(crate) replicas: Mutex<Vec<Option<(RedisNode, FaultProxy)>>>,
}

impl Standbys {
    pub(crate) async fn start(cluster: &Mutex<RedisCluster>) -> Standbys {
        let addrs = cluster.lock().unwrap_or_else(|e| e.into_inner()).addrs();
        let mut replicas = Vec::new();
        for addr in addrs {
            replicas.push(Some(Standbys::replica_of(addr).await));
        }
        Standbys {
            replicas: Mutex::new(replicas),
        }
    }

    pub(crate) async fn replica_of(master: SocketAddr) -> (RedisNode, FaultProxy) {
        let link = FaultProxy::start(master).await;
        let replica = block_in_place(|| {
            let replica = RedisNode::start_replica();
            replica.replicate(link.addr());
            replica
        });
        (replica, link)
    }

    /// Fails node `node` over to its replica: the replica's link breaks, `missed` later
    /// (writes go on meanwhile) the old server dies, the replica is promoted and every
    /// contender's proxy for the node moves to it. The replica then is node `node`, and a new
    /// replica of it stands by.
    pub(crate) async fn failover(
        &self,
        cluster: &Mutex<RedisCluster>,
        proxies: &[Vec<FaultProxy>],
        node: usize,
        missed: Duration,
    ) {
        let (replica, link) = self.replicas.lock().unwrap_or_else(|e| e.into_inner())[node]
            .take()
            .expect("a standby for every node");
        link.refuse(true);
        link.drop_connections();
        tokio::time::sleep(missed).await;
        let promoted = replica.addr();
        block_in_place(|| {
            let mut cluster = cluster.lock().unwrap_or_else(|e| e.into_inner());
            cluster.node_mut(node).stop();
            assert_eq!(replica.command(&["REPLICAOF", "NO", "ONE"]), "OK");
            cluster.nodes[node] = replica;
        });
        for contender in proxies {
            contender[node].set_upstream(promoted);
        }
        let fresh = Standbys::replica_of(promoted).await;
        self.replicas.lock().unwrap_or_else(|e| e.into_inner())[node] = Some(fresh);
    }
}

/// A cluster of three whose votes count, and a standby replica for each node.
pub(crate) async fn ready_cluster_with_standbys(ttl: Duration) -> (Mutex<RedisCluster>, Standbys) {
    let cluster = Mutex::new(block_in_place(|| RedisCluster::start(3)));
    let standbys = Standbys::start(&cluster).await;
    block_in_place(|| cluster.lock().unwrap().wait_votes_count(ttl));
    (cluster, standbys)
}

/// Strikes held locks with faults drawn from `faults` for `lasting` (library contenders on their
/// own proxies, one fresh cluster), checks that the lock moves again after the last one, that
/// some votes were not counted, and the records. Returns the scenario's row.
pub(crate) async fn strike_held_locks(
    scenario: &str,
    lock: &str,
    faults: &[Fault],
    lasting: Duration,
    seed: u64,
) -> Row {
    let (cluster, standbys) = ready_cluster_with_standbys(LIB_TTL).await;
    let addrs = cluster.lock().unwrap().addrs();
    let mut proxies = Vec::new();
    for _ in 0..4 {
        let mut own = Vec::new();
        for &addr in &addrs {
            own.push(FaultProxy::start(addr).await);
        }
        proxies.push(own);
    }
    let urls: Vec<Vec<String>> = proxies.iter().map(|p| urls_of(p)).collect();
    let fleet = LibFleet::start(
        lock,
        "lib",
        &urls,
        &[LibPlan::holding(), LibPlan::quick()],
        seed,
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let mut injected: std::collections::BTreeMap<Fault, usize> = Default::default();
    let mut held_when_hit = 0;
    let end = Instant::now() + lasting;
    let mut last_fault = Instant::now();
    while Instant::now() < end {
        let struck = injected.values().sum::<usize>();
        // Every other fault strikes a critical section of 2–4 × ttl that renewals carry.
        if struck % 2 == 1 {
            long_section(
                &fleet,
                &format!("{scenario}: a long critical section (seed {seed})"),
            )
            .await;
        } else {
            open_session(
                fleet.store(),
                LIB_TTL * 4 + TAKEOVER_SLACK,
                &format!("{scenario}: the lock is taken again (seed {seed})"),
            )
            .await;
        }
        // In turn, so that each kind is drawn; where and how long is random.
        let fault = faults[struck % faults.len()];
        inject(fault, &mut rng, &cluster, &proxies, &fleet, &standbys).await;
        // The data is lost as `inject` ends (a restore restarts the nodes last).
        held_when_hit += usize::from(fleet.holder().is_some());
        *injected.entry(fault).or_default() += 1;
        last_fault = Instant::now();
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..1500))).await;
    }
    next_session(
        fleet.store(),
        last_fault,
        None,
        LIB_TTL * 4 + TAKEOVER_SLACK,
        &format!("{scenario}: the lock is taken again after the last fault (seed {seed})"),
    )
    .await;
    let ctx = fleet.stop().await;
    let faults: usize = injected.values().sum();
    let (_, row) = check(
        &format!("{scenario} {injected:?}"),
        "4 library, own proxies",
        faults,
        &ctx.store.records(),
        Mode::Strict,
        &[],
    );
    assert!(
        ctx.votes.not_counted.load(Ordering::Relaxed) > 0,
        "{scenario}: nodes that lost data granted votes that were not counted ({injected:?})"
    );
    assert!(held_when_hit > 0, "{scenario}: faults hit held locks");
    row
}

/// How long each data-loss scenario strikes.
pub(crate) const STRIKING: Duration = Duration::from_secs(12);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn flushes_under_held_locks_never_allow_two_holders() {
    let row = strike_held_locks(
        "FLUSHALL / FLUSHDB, 1–3 of 3 nodes",
        "flush-lib",
        &[Fault::FlushAll, Fault::FlushDb],
        STRIKING,
        17,
    )
    .await;
    checker::report(vec![row]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn restores_from_older_snapshots_under_held_locks_never_allow_two_holders() {
    let row = strike_held_locks(
        "restore from an older snapshot, 1–3 of 3 nodes",
        "snapshot-lib",
        &[Fault::RestoreSnapshot],
        STRIKING,
        19,
    )
    .await;
    checker::report(vec![row]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn failovers_to_replicas_that_missed_writes_never_allow_two_holders() {
    let row = strike_held_locks(
        "failover to a replica that missed writes",
        "failover-lib",
        &[Fault::Failover],
        STRIKING,
        23,
    )
    .await;
    checker::report(vec![row]);
}

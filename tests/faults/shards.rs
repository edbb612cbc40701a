//! Shards (`run --shards N`) under the suite's faults, every shard's writes fenced by its own
//! token in a store of its own: Redis nodes restarted empty and flushed under held shards, and
//! members cut off from a majority, paused past their leases, crashed and stopped. Per shard:
//! no two sessions overlap (or, with pauses, every overlap is fenced) and tokens only grow;
//! after the faults every shard is worked on again and the live members split them within one.

use std::collections::BTreeMap;

use super::*;

/// Shards the group splits.
const SHARDS: usize = 6;

/// Per shard: the token, the end of the validity the app was told, and its last write.
type Work = BTreeMap<u64, (u64, Instant, Instant)>;

/// The app beside a sharded member. It polls `/v1/shards`; it works on each listed shard under
/// its token (`begin`, then a write every 100 ms) and stops on one at once when it is no longer
/// listed, when a poll fails or takes over 100 ms, or when the validity it was told runs out.
/// Told to stop (the pod shuts down), it ends its work with `end` first.
async fn shard_app(
    identity: String,
    control: SocketAddr,
    stores: Arc<Vec<Arc<FencedStore>>>,
    stop: CancellationToken,
) {
    const WRITE_EVERY: Duration = Duration::from_millis(100);
    let mut work = Work::new();
    while !stop.is_cancelled() {
        let sent = Instant::now();
        let answer = tokio::time::timeout(
            Duration::from_millis(100),
            support::http::get(control, "/v1/shards"),
        )
        .await;
        let listed: BTreeMap<u64, (u64, Instant)> = match answer {
            Ok(Ok(resp)) if resp.status == 200 => resp
                .json()
                .ok()
                .and_then(|body| {
                    let owned = body["owned"].as_array()?.clone();
                    Some(
                        owned
                            .iter()
                            .filter_map(|s| {
                                let validity = Duration::from_millis(s["validity_ms"].as_u64()?);
                                Some((
                                    s["shard"].as_u64()?,
                                    (s["fencing_token"].as_u64()?, sent + validity),
                                ))
                            })
                            .collect(),
                    )
                })
                .unwrap_or_default(),
            _ => BTreeMap::new(),
        };
        let now = Instant::now();
        // Stop at once on what is no longer listed under the same token, or past its validity.
        work.retain(|shard, (token, deadline, _)| {
            let keep = listed.get(shard).is_some_and(|(t, _)| t == token) && now < *deadline;
            if !keep {
                stores[*shard as usize].gone(&identity, *token, Some(*deadline));
            }
            keep
        });
        for (shard, (token, deadline)) in listed {
            let store = &stores[shard as usize];
            match work.get_mut(&shard) {
                Some((_, known, last)) => {
                    *known = deadline;
                    if now >= *last + WRITE_EVERY {
                        store.write(&identity, token, Kind::Write, Some(deadline));
                        *last = now;
                    }
                }
                None if now < deadline => {
                    store.write(&identity, token, Kind::Begin, Some(deadline));
                    work.insert(shard, (token, deadline, now));
                }
                None => {}
            }
        }
        tokio::time::sleep(POLL).await;
    }
    for (shard, (token, deadline, _)) in work {
        if Instant::now() < deadline {
            stores[shard as usize].write(&identity, token, Kind::End, Some(deadline));
        }
    }
}

struct ShardMember {
    identity: String,
    control: SocketAddr,
    proc: Proc,
    /// Its own proxies to the nodes, when the scenario cuts members off.
    proxies: Vec<FaultProxy>,
    app_stop: CancellationToken,
    app: JoinHandle<()>,
}

/// `run --shards` members of one group, each with its app, and a store per shard.
struct ShardFleet {
    lock: String,
    cluster_addrs: Vec<SocketAddr>,
    /// Each member gets proxies of its own (to cut it off) instead of the nodes' addresses.
    proxied: bool,
    stores: Arc<Vec<Arc<FencedStore>>>,
    members: Vec<ShardMember>,
    started: u32,
}

impl ShardFleet {
    /// `n` members of group `lock` on the nodes at `addrs`.
    async fn start(lock: &str, addrs: Vec<SocketAddr>, n: usize, proxied: bool) -> ShardFleet {
        let mut fleet = ShardFleet {
            lock: lock.to_owned(),
            cluster_addrs: addrs,
            proxied,
            stores: Arc::new((0..SHARDS).map(|_| FencedStore::new()).collect()),
            members: Vec::new(),
            started: 0,
        };
        for _ in 0..n {
            fleet.add().await;
        }
        fleet
    }

    /// Starts one more member (a new pod) and its app.
    async fn add(&mut self) {
        self.started += 1;
        let identity = format!("{}-{}", self.lock, self.started);
        let mut proxies = Vec::new();
        let urls = if self.proxied {
            for addr in &self.cluster_addrs {
                proxies.push(FaultProxy::start(*addr).await);
            }
            urls_of(&proxies).join(",")
        } else {
            self.cluster_addrs
                .iter()
                .map(|a| format!("redis://{a}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        let listen = format!("127.0.0.1:{}", support::free_port());
        let control: SocketAddr = format!("127.0.0.1:{}", support::free_port())
            .parse()
            .expect("loopback address");
        let control_arg = control.to_string();
        let shards = SHARDS.to_string();
        let args: Vec<&str> = ["run", "--lock", &self.lock, "--redis", &urls]
            .into_iter()
            .chain(PROC_TIMING)
            .chain(["--listen", &listen, "--control-listen", &control_arg])
            .chain(["--identity", &identity, "--kubernetes", "off"])
            .chain(["--shards", &shards])
            .collect();
        let proc = Proc::spawn(&args, &[("REDLOCK_LOG", "info")]);
        let app_stop = CancellationToken::new();
        let app = tokio::spawn(shard_app(
            identity.clone(),
            control,
            self.stores.clone(),
            app_stop.clone(),
        ));
        self.members.push(ShardMember {
            identity,
            control,
            proc,
            proxies,
            app_stop,
            app,
        });
    }

    /// Removes member `i`: SIGTERM after its app ended its work, or a crash (`sig`).
    async fn remove(&mut self, i: usize, sig: libc::c_int) -> i32 {
        let mut member = self.members.remove(i);
        if sig == libc::SIGTERM {
            member.app_stop.cancel();
            member.app.await.expect("app did not panic");
        } else {
            member.app.abort();
            let _ = member.app.await;
        }
        member.proc.signal(sig);
        let status = member
            .proc
            .wait_exit_async(Duration::from_secs(15))
            .await
            .unwrap_or_else(|| panic!("{} did not exit", member.identity));
        println!(
            "--- {} (exit {status}) ---\n{}",
            member.identity,
            member.proc.output_text()
        );
        exit_code(status)
    }

    /// Waits until every shard has an open session and the live members hold ⌊N/k⌋ or ⌈N/k⌉
    /// each, together every shard once.
    async fn settled(&self, within: Duration, what: &str) {
        let k = self.members.len();
        support::wait_until_async(within, what, || async {
            let mut counts = Vec::new();
            let mut union = Vec::new();
            for member in &self.members {
                let Ok(resp) = support::http::get(member.control, "/v1/shards").await else {
                    return false;
                };
                let Ok(body) = resp.json() else {
                    return false;
                };
                let owned: Vec<u64> = body["owned"]
                    .as_array()
                    .map(|o| o.iter().filter_map(|s| s["shard"].as_u64()).collect())
                    .unwrap_or_default();
                counts.push(owned.len());
                union.extend(owned);
            }
            union.sort_unstable();
            union.dedup();
            let (lo, hi) = (SHARDS / k, SHARDS.div_ceil(k));
            let open = self.stores.iter().all(|store| {
                store
                    .last_begin()
                    .is_some_and(|(_, who, token)| store.is_open(&who, token))
            });
            union.len() == SHARDS && counts.iter().all(|c| (lo..=hi).contains(c)) && open
        })
        .await;
    }

    /// Stops every member (SIGTERM) and checks every shard's records; the summary rows.
    async fn stop(mut self, scenario: &str, faults: usize, mode: Mode) -> Vec<Row> {
        while !self.members.is_empty() {
            assert_eq!(self.remove(0, libc::SIGTERM).await, 0, "exit 0 on SIGTERM");
        }
        let contenders = format!("{} run --shards {SHARDS} + app", self.started);
        (0..SHARDS)
            .map(|shard| {
                let records = self.stores[shard].records();
                assert!(
                    records.iter().any(|r| r.kind == Kind::Begin),
                    "shard {shard} was worked on"
                );
                check(
                    &format!("shards: {scenario}, shard {shard}"),
                    &contenders,
                    faults,
                    &records,
                    mode,
                    &[],
                )
                .1
            })
            .collect()
    }
}

/// How long the group may take to settle after a fault: the leases of a lost holder run out
/// (a ttl), the nodes' data ages past a ttl and drift, and the cycles follow.
const SETTLE: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn shards_under_redis_restarts_and_flushes_never_have_two_owners() {
    let cluster = Mutex::new(ready_cluster(3, PROC_TTL));
    let addrs = cluster.lock().unwrap().addrs();
    let fleet = ShardFleet::start("shards-nodes", addrs, 3, false).await;
    fleet
        .settled(SETTLE, "the shards split before the faults")
        .await;
    let mut rng = StdRng::seed_from_u64(39);
    let mut faults = 0;
    for round in 0..4 {
        let mut nodes: Vec<usize> = (0..3).collect();
        nodes.remove(rng.random_range(0..3));
        if round % 2 == 0 {
            // One or two nodes restarted empty.
            nodes.truncate(1 + round / 2);
            restart_nodes(&cluster, &nodes, Duration::from_millis(100));
        } else {
            // FLUSHALL on one node, then on another while the first is still young.
            for &node in &nodes {
                let cluster = cluster.lock().unwrap();
                assert_eq!(cluster.node(node).command(&["FLUSHALL"]), "OK");
            }
        }
        faults += nodes.len();
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..1200))).await;
    }
    fleet
        .settled(SETTLE, "every shard worked on again, split within one")
        .await;
    let rows = fleet
        .stop(
            "Redis restarts and FLUSHALL, 1–2 of 3",
            faults,
            Mode::Strict,
        )
        .await;
    checker::report(rows);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn shards_under_partitions_pauses_crashes_and_stops_never_have_two_owners() {
    let cluster = ready_cluster(3, PROC_TTL);
    let mut fleet = ShardFleet::start("shards-members", cluster.addrs(), 3, true).await;
    fleet
        .settled(SETTLE, "the shards split before the faults")
        .await;
    let mut faults = 0;
    // A member cut off from a majority past its leases: it steps down, the others take over.
    cut_off(&fleet.members[0].proxies, &[0, 1], false);
    tokio::time::sleep(PROC_TTL * 2).await;
    heal(&fleet.members[0].proxies);
    faults += 1;
    fleet
        .settled(SETTLE, "the shards split after the cut-off")
        .await;
    // A member paused past its leases (its app, left alone, stops at the validity it was told).
    assert!(fleet.members[1].proc.sigstop());
    tokio::time::sleep(PROC_TTL * 2).await;
    assert!(fleet.members[1].proc.sigcont());
    faults += 1;
    fleet
        .settled(SETTLE, "the shards split after the pause")
        .await;
    // A pod crashes and another starts; then one stops on SIGTERM and another starts.
    fleet.remove(2, libc::SIGKILL).await;
    fleet.add().await;
    faults += 1;
    fleet
        .settled(SETTLE, "the shards split after a crash")
        .await;
    assert_eq!(fleet.remove(0, libc::SIGTERM).await, 0);
    fleet.add().await;
    faults += 1;
    fleet.settled(SETTLE, "the shards split after a stop").await;
    let rows = fleet
        .stop(
            "a member cut off, paused, crashed and stopped",
            faults,
            Mode::Fenced,
        )
        .await;
    checker::report(rows);
}

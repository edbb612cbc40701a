//! Redis nodes that lose data while the lock is held, through the real binary: two `run`
//! sidecars contend on three real `redis-server` nodes, and one node (or a majority) forgets the
//! lock without the holder noticing anything at the TCP level: `FLUSHALL`, `FLUSHDB`, a restart
//! without persistence, a restore from a snapshot taken before the lock was taken, a failover to
//! a replica that missed the write, eviction.
//!
//! Every test polls each sidecar's `/leader` all along, and reads each sidecar's log at the end.
//! A tenure's extent is known from what the sidecar itself reported, not from catching two 200s
//! in one poll: its claim began after the sidecar logged the acquisition of its fencing token
//! (leadership is published right after; `leader_since` is the start of that round). It lasts
//! as an app sees it: until the validity the last 200 promised runs out (`validity_ms` from
//! when it was asked), or until the sidecar logged its release on SIGTERM (the app is stopped
//! first), whichever is first. Stepping down ends the answers "leader", not the promise. A round
//! that began before the previous claim ended but took the lock after it is a handoff, not an
//! overlap. The checks, per test:
//! - no claim begins before the previous one has ended, and fencing tokens strictly increase
//!   from tenure to tenure;
//! - where a majority lost the key, the leader steps down within one renew interval, and nobody
//!   leads again until a ttl after the loss;
//! - where one node of the leader's bare majority lost it, nobody else leads before the leader
//!   has stepped down;
//! - exactly one leader emerges again.
//!
//! The sidecars reach each node through their own [`FaultProxy`]: the proxy cuts one contender
//! off a node (so its key stands on exactly two of three), and moves a node's address to a
//! replica for a failover.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use redlock_sidecar::redlock::{votes, EPOCH_KEY};
use support::tenures::{log_times, ms_between, Sidecar, Tenure, Watch};
use support::{http, FaultProxy, KeepingProxy, Proc, RedisCluster, RedisNode};
use tokio::task::block_in_place;

/// The lock every test contends for, and its key on the nodes.
const LOCK: &str = "dataloss";
const KEY: &str = "redlock:{dataloss}";
/// The sidecars' ttl and renew interval, as durations and as flags below.
const TTL: Duration = Duration::from_secs(3);
const RENEW: Duration = Duration::from_millis(500);
/// Timing flags of every sidecar: a renew interval well below ttl/3, so that a prompt step-down
/// (within one renew interval) and one at the end of the validity (ttl − safety margin after the
/// last renewal) are seconds apart.
const TIMING: [&str; 12] = [
    "--ttl",
    "3s",
    "--renew-interval",
    "500ms",
    "--safety-margin",
    "500ms",
    "--node-timeout",
    "250ms",
    "--connect-timeout",
    "500ms",
    "--retry-delay",
    "50ms",
];
/// A ttl whose validity outlasts any wait for a sidecar to exit, and timing flags with it.
const LONG_TTL: Duration = Duration::from_secs(30);
const LONG_TIMING: [&str; 12] = [
    "--ttl",
    "30s",
    "--renew-interval",
    "500ms",
    "--safety-margin",
    "1s",
    "--node-timeout",
    "250ms",
    "--connect-timeout",
    "500ms",
    "--retry-delay",
    "50ms",
];
/// After the renewal that sees the loss: the extend's own round trip, publishing, and the next
/// poll on a busy machine.
const STEP_DOWN_SLACK: Duration = Duration::from_millis(700);
/// Bound on every wait for a leader: votes count after ttl + drift, plus a loaded machine.
const ELECTION: Duration = Duration::from_secs(25);
/// How often each sidecar's `/leader` is asked.
const POLL: Duration = Duration::from_millis(10);

// ------------------------------------------------------------------------------------------------
// Sidecars
// ------------------------------------------------------------------------------------------------

/// One `run` sidecar and its proxies, one per node in node order (its only way to the nodes).
struct Contender {
    name: String,
    addr: SocketAddr,
    proc: Proc,
    proxies: Vec<FaultProxy>,
}

impl Contender {
    /// Starts a sidecar named `name` on `nodes` with [`TIMING`]; its proxies to the nodes in
    /// `cut` refuse every connection from the start.
    async fn start(
        name: &str,
        nodes: &[SocketAddr],
        cut: &[usize],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Contender {
        Contender::start_with(name, nodes, cut, &TIMING, extra, env).await
    }

    /// [`Contender::start`] with other timing flags.
    async fn start_with(
        name: &str,
        nodes: &[SocketAddr],
        cut: &[usize],
        timing: &[&str],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Contender {
        let mut proxies = Vec::new();
        for (i, &node) in nodes.iter().enumerate() {
            let proxy = FaultProxy::start(node).await;
            proxy.refuse(cut.contains(&i));
            proxies.push(proxy);
        }
        let redis = proxies
            .iter()
            .map(FaultProxy::url)
            .collect::<Vec<_>>()
            .join(",");
        let addr: SocketAddr = format!("127.0.0.1:{}", support::free_port())
            .parse()
            .expect("loopback address");
        let listen = addr.to_string();
        let mut args = vec!["run", "--lock", LOCK, "--redis", &redis];
        args.extend(timing);
        args.extend(["--listen", &listen, "--identity", name]);
        args.extend(["--kubernetes", "off"]);
        args.extend(extra);
        let mut envs = vec![("REDLOCK_LOG", "info")];
        envs.extend(env);
        let proc = Proc::spawn(&args, &envs);
        Contender {
            name: name.to_owned(),
            addr,
            proc,
            proxies,
        }
    }

    /// The node label this sidecar uses for node `i` in its metrics (its proxy's address).
    fn node_label(&self, i: usize) -> String {
        self.proxies[i].addr().to_string()
    }

    /// `redlock_node_vote_counted` for node `i`, if the sidecar answers.
    async fn vote_counted(&self, i: usize) -> Option<i64> {
        vote_counted(self.addr, &self.node_label(i)).await
    }

    /// The holder this sidecar sees, from its `/leader` body.
    async fn holder(&self) -> Option<String> {
        let body = http::get(self.addr, "/leader").await.ok()?.json().ok()?;
        body["holder"].as_str().map(str::to_owned)
    }

    /// SIGTERM and wait: the sidecar releases the lock and exits 0. Returns its log.
    async fn stop(mut self) -> String {
        self.proc.sigterm();
        let status = self
            .proc
            .wait_exit_async(Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("{} did not exit\n{}", self.name, self.proc.output_text()));
        assert_eq!(
            status.code(),
            Some(0),
            "{} exits 0 on SIGTERM\n{}",
            self.name,
            self.proc.output_text()
        );
        self.proc.stderr_text()
    }
}

/// `redlock_node_vote_counted` of `node` at the sidecar at `addr`, if it answers.
async fn vote_counted(addr: SocketAddr, node: &str) -> Option<i64> {
    metric(
        addr,
        "redlock_node_vote_counted",
        &format!("node=\"{node}\""),
    )
    .await
}

/// The sample of `family` whose labels include `label`, at the sidecar at `addr`.
async fn metric(addr: SocketAddr, family: &str, label: &str) -> Option<i64> {
    let text = http::get(addr, "/metrics").await.ok()?.body;
    text.lines()
        .filter(|l| {
            l.strip_prefix(family)
                .is_some_and(|rest| rest.starts_with('{'))
        })
        .find(|l| l.contains(label))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as i64)
}

impl Sidecar for Contender {
    fn name(&self) -> &str {
        &self.name
    }
    fn addr(&self) -> SocketAddr {
        self.addr
    }
    fn proc(&self) -> &Proc {
        &self.proc
    }
}

impl Watch {
    /// Stops `c` (see [`Contender::stop`]) and keeps its log for the analysis.
    async fn stop(&mut self, c: Contender) {
        let name = c.name.clone();
        let log = c.stop().await;
        self.keep_log(name, log);
    }
}

// ------------------------------------------------------------------------------------------------
// Scenario helpers
// ------------------------------------------------------------------------------------------------

fn cluster() -> RedisCluster {
    block_in_place(|| RedisCluster::start(3))
}

fn info_field(node: &RedisNode, section: &str, field: &str) -> String {
    let info = node.command(&["INFO", section]);
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default()
}

/// Waits until `node` holds `value` under the lock key (`(nil)` for none).
async fn key_is(node: &RedisNode, value: &str, what: &str) {
    support::wait_until_async(ELECTION, what, || async {
        block_in_place(|| node.try_command(&["GET", KEY])).is_ok_and(|v| v == value)
    })
    .await;
}

/// A takes the lock holding exactly nodes 0 and 1 (its proxy to node 2 refuses), then B, which
/// reaches all three, joins and sees A hold it. Node 2 has been up for long (its votes count at
/// once): B can win nodes 0 and 2 the moment A lets go of node 0. Returns (A, B, A's tenure).
async fn a_holds_a_bare_majority(
    cluster: &RedisCluster,
    watch: &mut Watch,
) -> (Contender, Contender, Tenure) {
    a_holds_a_bare_majority_of(cluster, &cluster.addrs(), watch).await
}

/// [`a_holds_a_bare_majority`] with the sidecars reaching the nodes at `nodes` (e.g. node 1
/// behind a proxy).
async fn a_holds_a_bare_majority_of(
    cluster: &RedisCluster,
    nodes: &[SocketAddr],
    watch: &mut Watch,
) -> (Contender, Contender, Tenure) {
    block_in_place(|| {
        cluster
            .node(2)
            .backdate_epoch(votes::required_data_age(TTL))
    });
    let (a, first) = a_leads_on_nodes_0_and_1(nodes, &TIMING, watch).await;
    let b = Contender::start("b", nodes, &[], &[], &[]).await;
    watch.add(&b);
    support::wait_until_async(ELECTION, "b sees a hold the lock", || async {
        b.holder().await.as_deref() == Some("a")
    })
    .await;
    (a, b, first)
}

/// Starts A with `timing`, its proxy to node 2 refusing, and waits for its tenure.
async fn a_leads_on_nodes_0_and_1(
    nodes: &[SocketAddr],
    timing: &[&str],
    watch: &mut Watch,
) -> (Contender, Tenure) {
    let a = Contender::start_with("a", nodes, &[2], timing, &[], &[]).await;
    watch.add(&a);
    let tenure = watch
        .next_tenure(
            SystemTime::UNIX_EPOCH,
            Some("a"),
            "a leads on nodes 0 and 1",
            &[&a],
        )
        .await;
    (a, tenure)
}

/// Node 1 of A's bare majority loses the key and A's way to node 2 (which never had it)
/// opens; waits until A's next renewal finds its key gone from a quorum and steps down.
/// Returns when the loss was complete.
async fn supersede(cluster: &RedisCluster, a: &Contender) -> SystemTime {
    block_in_place(|| assert_eq!(cluster.node(1).command(&["FLUSHALL"]), "OK"));
    a.proxies[2].refuse(false);
    let by = SystemTime::now();
    support::wait_until_async(ELECTION, "a steps down: superseded", || async {
        metric(a.addr, "redlock_lock_lost_total", "reason=\"superseded\"").await == Some(1)
    })
    .await;
    by
}

/// After one node of A's bare majority lost the key between `from` and `by`: someone leads
/// again, never while A still did (checked by [`Watch::finish`]). Returns A's tenure.
async fn after_one_node_of_a_bare_majority_lost_it(
    watch: Watch,
    running: &[&Contender],
    held: &Tenure,
    from: SystemTime,
    by: SystemTime,
) -> Tenure {
    let next = watch
        .next_tenure(
            from,
            None,
            "someone leads again after the data loss",
            running,
        )
        .await;
    // Some renewals of the new tenure, to see it alone.
    watch.lasted(&next, RENEW * 3).await;
    let tenures = watch.finish(running).await;
    let old = tenures
        .into_iter()
        .find(|t| t.who == held.who && t.token == held.token)
        .expect("a's tenure");
    assert!(
        old.stopped_by <= by + TTL,
        "a stops claiming the lock within its validity ({:.1} ms after the loss)",
        ms_between(by, old.stopped_by)
    );
    old
}

// ------------------------------------------------------------------------------------------------
// A majority loses the key: FLUSHALL, FLUSHDB
// ------------------------------------------------------------------------------------------------

/// Both sidecars reach all three nodes; once one leads, `command` wipes nodes 0 and 1.
async fn a_majority_loses_the_key(command: &str) {
    let cluster = cluster();
    let nodes = cluster.addrs();
    let mut watch = Watch::new();
    let mut a = Contender::start("a", &nodes, &[], &[], &[]).await;
    let mut b = Contender::start("b", &nodes, &[], &[], &[]).await;
    watch.add(&a);
    watch.add(&b);
    let held = watch
        .next_tenure(SystemTime::UNIX_EPOCH, None, "someone leads", &[&a, &b])
        .await;
    // Renewed a few times: the loss hits a lock in steady state.
    watch.lasted(&held, RENEW * 3).await;
    let from = SystemTime::now();
    // Both nodes lose the key at one moment for the sidecars, frozen meanwhile. A renewal
    // between the two commands would rightly put the key back on the first node and keep
    // the lock: that is one node losing it, then another, not a majority at once.
    block_in_place(|| {
        a.proc.sigstop();
        b.proc.sigstop();
        for i in [0, 1] {
            assert_eq!(cluster.node(i).command(&[command]), "OK");
        }
        a.proc.sigcont();
        b.proc.sigcont();
    });
    let by = SystemTime::now();
    // The wiped nodes' votes are not counted until their data is old enough again: looked for
    // while the test goes on, asserted after the tenures.
    let series: Vec<(SocketAddr, String)> = [&a, &b]
        .iter()
        .flat_map(|c| [0, 1].map(|i| (c.addr, c.node_label(i))))
        .collect();
    let not_counted = tokio::spawn(async move {
        let end = tokio::time::Instant::now() + TTL;
        while tokio::time::Instant::now() < end {
            for (addr, node) in &series {
                if vote_counted(*addr, node).await == Some(0) {
                    return true;
                }
            }
            tokio::time::sleep(POLL).await;
        }
        false
    });
    let next = watch
        .next_tenure(
            held.since,
            None,
            "someone leads again after the loss",
            &[&a, &b],
        )
        .await;
    watch.lasted(&next, RENEW * 3).await;
    let tenures = watch.finish(&[&a, &b]).await;

    let old = tenures
        .iter()
        .find(|t| t.who == held.who && t.token == held.token)
        .expect("the first tenure");
    assert!(
        old.ended_by > from,
        "the first leader still led when the data was lost"
    );
    assert!(
        old.stopped_by <= by + RENEW + STEP_DOWN_SLACK,
        "{command} on a majority: {} steps down at its next renewal (within {RENEW:?}), \
         not {:.1} ms after the loss",
        old.who,
        ms_between(by, old.stopped_by)
    );
    let next = tenures
        .iter()
        .find(|t| t.since > from)
        .expect("a tenure after the loss");
    println!(
        "{command} on a majority: {} stepped down at most {:.0} ms after the loss; {} led {:.0} ms \
         after it (ttl {TTL:?}, renew interval {RENEW:?})",
        old.who,
        ms_between(by, old.stopped_by),
        next.who,
        ms_between(from, next.since)
    );
    assert!(
        next.claimed_after >= from + TTL,
        "{command} on a majority: nobody leads until ttl + drift after the loss, but {} led \
         {:.1} ms after it",
        next.who,
        ms_between(from, next.since)
    );
    assert!(
        not_counted.await.expect("metrics reader did not panic"),
        "{command} on a majority: within a ttl a sidecar reports a wiped node's vote as not \
         counted (redlock_node_vote_counted 0)"
    );
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushall_on_a_majority_ends_the_tenure_at_the_next_renewal_and_nobody_leads_for_a_ttl() {
    a_majority_loses_the_key("FLUSHALL").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushdb_on_a_majority_ends_the_tenure_at_the_next_renewal_and_nobody_leads_for_a_ttl() {
    a_majority_loses_the_key("FLUSHDB").await;
}

// ------------------------------------------------------------------------------------------------
// One node of a bare majority loses the key: restarts, a snapshot, a failover
// ------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_without_persistence_does_not_vote_for_another_leader() {
    let mut cluster = cluster();
    let mut watch = Watch::new();
    let (a, b, held) = a_holds_a_bare_majority(&cluster, &mut watch).await;
    let from = SystemTime::now();
    block_in_place(|| cluster.node_mut(1).restart());
    let by = SystemTime::now();
    assert_eq!(block_in_place(|| cluster.node(1).command(&["DBSIZE"])), "0");
    after_one_node_of_a_bare_majority_lost_it(watch, &[&a, &b], &held, from, by).await;
    a.stop().await;
    b.stop().await;
}

/// Node 1 of A's bare majority loses the key, and A's way to node 2 (which never had it)
/// opens: A's next renewal finds its key gone from a quorum and steps down at once. The node
/// it still holds must keep B out until the validity A last reported has run out (an app may
/// act on it until then): B could win nodes 0 and 2 the moment A let go of node 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_superseded_by_a_data_loss_keeps_the_lock_from_others_until_its_validity_ends() {
    let cluster = cluster();
    let mut watch = Watch::new();
    let (a, b, held) = a_holds_a_bare_majority(&cluster, &mut watch).await;
    let from = SystemTime::now();
    let by = supersede(&cluster, &a).await;
    let old = after_one_node_of_a_bare_majority_lost_it(watch, &[&a, &b], &held, from, by).await;
    assert!(
        old.stopped_by <= by + RENEW + STEP_DOWN_SLACK,
        "superseded: a steps down at its next renewal (within {RENEW:?}), not {:.1} ms after \
         the loss",
        ms_between(by, old.stopped_by)
    );
    a.stop().await;
    b.stop().await;
}

/// The same loss with a 30 s ttl, and no standby: the superseded leader still holds node 0
/// long after it stepped down, and a SIGTERM during that wait releases it at once and exits
/// (within [`Contender::stop`]'s 10 s, far less than the validity left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_superseded_leader_keeps_the_node_it_holds_until_a_sigterm_releases_it() {
    let cluster = cluster();
    block_in_place(|| cluster.backdate_epochs(LONG_TTL));
    let nodes = cluster.addrs();
    let mut watch = Watch::new();
    let (a, held) = a_leads_on_nodes_0_and_1(&nodes, &LONG_TIMING, &mut watch).await;
    let value = block_in_place(|| cluster.node(0).command(&["GET", KEY]));
    assert!(value.starts_with("a:"), "a holds node 0: {value}");
    supersede(&cluster, &a).await;
    let answer = http::get(a.addr, "/leader").await.expect("a answers");
    assert_eq!(answer.status, 503, "a no longer claims the lock");
    // The same value: neither released nor taken again (nodes 0 and 2 would grant it).
    let kept = block_in_place(|| cluster.node(0).command(&["GET", KEY]));
    assert_eq!(
        kept, value,
        "a keeps node 0 while the validity it reported runs"
    );
    let sigterm = SystemTime::now();
    let log = a.stop().await;
    key_is(cluster.node(0), "(nil)", "a released node 0 on SIGTERM").await;
    let released = log_times(&log).released;
    assert_eq!(
        released.keys().collect::<Vec<_>>(),
        [&held.token],
        "one release, of the superseded tenure:\n{log}"
    );
    assert!(
        released[&held.token] >= sigterm,
        "a released the lock on SIGTERM, not when it stepped down:\n{log}"
    );
}

/// A first sidecar takes the lock on every node and releases it (SIGTERM): the nodes now carry
/// whatever the engine keeps between tenures, aged.
async fn warm_up(nodes: &[SocketAddr], watch: &mut Watch) {
    let w = Contender::start("w", nodes, &[], &[], &[]).await;
    watch.add(&w);
    let t = watch
        .next_tenure(SystemTime::UNIX_EPOCH, None, "w leads", &[&w])
        .await;
    watch.lasted(&t, RENEW * 2).await;
    watch.stop(w).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restored_from_a_snapshot_older_than_the_lock_does_not_vote_for_another_leader() {
    let mut cluster = cluster();
    let nodes = cluster.addrs();
    let mut watch = Watch::new();
    warm_up(&nodes, &mut watch).await;
    key_is(cluster.node(1), "(nil)", "w's release reached node 1").await;
    block_in_place(|| cluster.node(1).save_snapshot());
    let (a, b, held) = a_holds_a_bare_majority(&cluster, &mut watch).await;
    let from = SystemTime::now();
    block_in_place(|| cluster.node_mut(1).restart_from_snapshot());
    let by = SystemTime::now();
    block_in_place(|| {
        assert_ne!(
            cluster.node(1).command(&["DBSIZE"]),
            "0",
            "node 1 came back with the snapshot's data"
        );
        assert_eq!(
            cluster.node(1).command(&["GET", KEY]),
            "(nil)",
            "the snapshot is older than a's lock"
        );
    });
    after_one_node_of_a_bare_majority_lost_it(watch, &[&a, &b], &held, from, by).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_replica_that_missed_the_write_does_not_vote_for_another_leader() {
    let mut cluster = cluster();
    let nodes = cluster.addrs();
    // Node 1's replica, replicating through a proxy whose link is cut below.
    let replica = block_in_place(RedisNode::start_replica);
    let link = FaultProxy::start(cluster.node(1).addr()).await;
    block_in_place(|| replica.replicate(link.addr()));
    let mut watch = Watch::new();
    warm_up(&nodes, &mut watch).await;
    key_is(&replica, "(nil)", "w's release reached the replica").await;
    // The link breaks before the lock is taken: the replica misses everything from here on.
    link.refuse(true);
    link.drop_connections();
    support::wait_until_async(ELECTION, "the replica sees its link down", || async {
        block_in_place(|| info_field(&replica, "replication", "master_link_status")) == "down"
    })
    .await;
    let (a, b, held) = a_holds_a_bare_majority(&cluster, &mut watch).await;
    block_in_place(|| {
        assert!(cluster.node(1).command(&["GET", KEY]).starts_with("a:"));
        assert_eq!(
            replica.command(&["GET", KEY]),
            "(nil)",
            "the replica missed it"
        );
    });
    // Failover: the master dies, the replica is promoted and takes over node 1's address.
    let from = SystemTime::now();
    block_in_place(|| {
        cluster.node_mut(1).stop();
        assert_eq!(replica.command(&["REPLICAOF", "NO", "ONE"]), "OK");
    });
    for c in [&a, &b] {
        c.proxies[1].set_upstream(replica.addr());
    }
    let by = SystemTime::now();
    after_one_node_of_a_bare_majority_lost_it(watch, &[&a, &b], &held, from, by).await;
    a.stop().await;
    b.stop().await;
}

// ------------------------------------------------------------------------------------------------
// Data replaced inside a running server: a resync and failback, a failover behind a proxy that
// keeps client connections, SWAPDB, DEBUG RELOAD
// ------------------------------------------------------------------------------------------------

/// Waits until `node`'s epoch marker is `marker`.
async fn marker_is(node: &RedisNode, marker: &str, what: &str) {
    let key = redlock_sidecar::redlock::EPOCH_KEY;
    support::wait_until_async(ELECTION, what, || async {
        block_in_place(|| node.try_command(&["GET", key])).is_ok_and(|v| v == marker)
    })
    .await;
}

/// Node 1 resyncs from a copy of its own data taken before a's lock, then is promoted back
/// (an operator's `REPLICAOF` and `REPLICAOF NO ONE`, a restore by replication, a failback):
/// the same server process, holding its own epoch marker from before, minus a's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_resyncs_from_an_old_copy_of_itself_does_not_vote_for_another_leader() {
    let cluster = cluster();
    let nodes = cluster.addrs();
    let copy = block_in_place(RedisNode::start_replica);
    block_in_place(|| copy.replicate(cluster.node(1).addr()));
    let mut watch = Watch::new();
    warm_up(&nodes, &mut watch).await;
    let marker = block_in_place(|| cluster.node(1).command(&["GET", EPOCH_KEY]));
    marker_is(&copy, &marker, "the copy holds node 1's epoch marker").await;
    block_in_place(|| assert_eq!(copy.command(&["REPLICAOF", "NO", "ONE"]), "OK"));
    let (a, b, held) = a_holds_a_bare_majority(&cluster, &mut watch).await;
    let from = SystemTime::now();
    block_in_place(|| {
        assert!(cluster.node(1).command(&["GET", KEY]).starts_with("a:"));
        cluster.node(1).replicate(copy.addr());
    });
    key_is(cluster.node(1), "(nil)", "node 1 took the copy's data").await;
    block_in_place(|| assert_eq!(cluster.node(1).command(&["REPLICAOF", "NO", "ONE"]), "OK"));
    let by = SystemTime::now();
    after_one_node_of_a_bare_majority_lost_it(watch, &[&a, &b], &held, from, by).await;
    a.stop().await;
    b.stop().await;
}

/// Node 1 is reached through a proxy that keeps client connections across a failover: its
/// replica, which missed a's key, is promoted and the proxy re-dials it under the sidecars'
/// open connections. The replica holds node 1's epoch marker (replicated), and the connection
/// was opened to node 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_behind_a_proxy_that_keeps_client_connections_does_not_vote_for_another_leader()
{
    let mut cluster = cluster();
    let replica = block_in_place(RedisNode::start_replica);
    let link = FaultProxy::start(cluster.node(1).addr()).await;
    block_in_place(|| replica.replicate(link.addr()));
    let keeping = KeepingProxy::start(cluster.node(1).addr()).await;
    let nodes = [
        cluster.node(0).addr(),
        keeping.addr(),
        cluster.node(2).addr(),
    ];
    let mut watch = Watch::new();
    warm_up(&nodes, &mut watch).await;
    let marker = block_in_place(|| cluster.node(1).command(&["GET", EPOCH_KEY]));
    marker_is(&replica, &marker, "the replica holds node 1's epoch marker").await;
    link.refuse(true);
    link.drop_connections();
    support::wait_until_async(ELECTION, "the replica sees its link down", || async {
        block_in_place(|| info_field(&replica, "replication", "master_link_status")) == "down"
    })
    .await;
    let (a, b, held) = a_holds_a_bare_majority_of(&cluster, &nodes, &mut watch).await;
    block_in_place(|| {
        assert!(cluster.node(1).command(&["GET", KEY]).starts_with("a:"));
        assert_eq!(
            replica.command(&["GET", KEY]),
            "(nil)",
            "the replica missed it"
        );
    });
    let from = SystemTime::now();
    block_in_place(|| assert_eq!(replica.command(&["REPLICAOF", "NO", "ONE"]), "OK"));
    keeping.switch(replica.addr());
    block_in_place(|| cluster.node_mut(1).stop());
    let by = SystemTime::now();
    after_one_node_of_a_bare_majority_lost_it(watch, &[&a, &b], &held, from, by).await;
    a.stop().await;
    b.stop().await;
}

/// `SWAPDB 0 1` on node 1: database 0 now holds what database 1 held, including an epoch
/// marker stamped there (by another lock user of database 1) long enough ago to count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swapdb_on_a_node_does_not_vote_for_another_leader() {
    let cluster = cluster();
    // Another user of database 1 takes and releases a lock there: the markers of database 1
    // are stamped now, and age while a takes its lock below.
    let urls: Vec<String> = cluster.iter().map(|n| format!("{}/1", n.url())).collect();
    let db1 = support::engine_config(&urls, "other", "other", TTL);
    let other =
        redlock_sidecar::redlock::Redlock::new(db1, Arc::new(redlock_sidecar::redlock::NoObserver))
            .expect("valid config");
    let _ = other.try_acquire().await;
    let stamped = block_in_place(|| {
        cluster.node(1).command(&[
            "EVAL",
            "redis.call('SELECT', 1) return redis.call('GET', KEYS[1])",
            "1",
            EPOCH_KEY,
        ])
    });
    assert_ne!(stamped, "(nil)", "database 1 of node 1 has an epoch marker");
    drop(other);
    let mut watch = Watch::new();
    let (a, b, held) = a_holds_a_bare_majority(&cluster, &mut watch).await;
    let from = SystemTime::now();
    block_in_place(|| {
        assert_eq!(cluster.node(1).command(&["SWAPDB", "0", "1"]), "OK");
        assert_eq!(cluster.node(1).command(&["GET", KEY]), "(nil)");
        assert_eq!(cluster.node(1).command(&["GET", EPOCH_KEY]), stamped);
    });
    let by = SystemTime::now();
    after_one_node_of_a_bare_majority_lost_it(watch, &[&a, &b], &held, from, by).await;
    a.stop().await;
    b.stop().await;
}

/// `DEBUG RELOAD` (save, then load what was saved) loses nothing: the leader keeps the lock,
/// nobody else leads, and its key is still on node 1. (`DEBUG RELOAD NOSAVE`, loading an older
/// file, is listed in docs/reliability.md as data loss a client cannot see.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_reload_keeps_the_lock_with_its_holder() {
    let mut cluster = cluster();
    cluster.nodes[1] = block_in_place(|| RedisNode::start_with(&["--enable-debug-command", "yes"]));
    let mut watch = Watch::new();
    let (a, b, held) = a_holds_a_bare_majority(&cluster, &mut watch).await;
    let value = block_in_place(|| cluster.node(1).command(&["GET", KEY]));
    block_in_place(|| assert_eq!(cluster.node(1).command(&["DEBUG", "RELOAD"]), "OK"));
    assert_eq!(
        block_in_place(|| cluster.node(1).command(&["GET", KEY])),
        value,
        "the reload kept a's key"
    );
    watch.lasted(&held, TTL * 2).await;
    let tenures = watch.finish(&[&a, &b]).await;
    assert_eq!(
        tenures.len(),
        1,
        "a kept the lock through the reload: {tenures:?}"
    );
    a.stop().await;
    b.stop().await;
}

// ------------------------------------------------------------------------------------------------
// Contenders on different node sets
// ------------------------------------------------------------------------------------------------

/// P lists nodes {A, B, C}, Q lists {A, B, D} (a rolling update that replaced a node). P leads;
/// then P loses its way to A, where its key expires: Q could win A and D, a quorum of its own
/// list, while P holds B and C. Q sees P's node-set record and refuses to lead, with one log
/// line and a metric.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contenders_that_list_other_nodes_refuse_to_lead() {
    let cluster = block_in_place(|| RedisCluster::start(4));
    block_in_place(|| cluster.backdate_epochs(TTL));
    let all = cluster.addrs();
    let fingerprints = [("REDLOCK_NODE_SET", "")];
    let mut watch = Watch::new();
    let p = Contender::start("p", &all[..3], &[], &[], &fingerprints).await;
    watch.add(&p);
    let held = watch
        .next_tenure(SystemTime::UNIX_EPOCH, Some("p"), "p leads", &[&p])
        .await;
    let q = Contender::start("q", &[all[0], all[1], all[3]], &[], &[], &fingerprints).await;
    watch.add(&q);
    support::wait_until_async(ELECTION, "q counts a node-set conflict", || async {
        metric(q.addr, "redlock_node_set_conflicts_total", "lock=").await >= Some(1)
    })
    .await;
    // P's key on A expires (a ttl), then its record there (twice the ttl): from then on, only
    // the record on B, where P's key stands, keeps Q from winning A and D.
    p.proxies[0].refuse(true);
    p.proxies[0].drop_connections();
    support::wait_until_async(ELECTION, "p's key and record on A are gone", || async {
        block_in_place(|| {
            cluster
                .node(0)
                .command(&["EXISTS", KEY, "redlock:{dataloss}:nodes"])
                == "0"
        })
    })
    .await;
    watch.lasted(&held, since(held.since) + RENEW * 4).await;
    let tenures = watch.finish(&[&p, &q]).await;
    assert!(
        tenures.iter().all(|t| t.who == "p"),
        "q never leads while p does: {tenures:?}"
    );
    let log = q.stop().await;
    assert!(
        log.contains("another contender of this lock lists other Redis nodes"),
        "q says why it does not lead:\n{log}"
    );
    p.stop().await;
}

/// P and Q reach the same three servers, each through proxies of its own (other addresses),
/// with the default node set (no `--node-set`): the fingerprints name the servers, so they
/// agree. P leads and Q waits, with no node-set conflict; P is killed, and Q leads within a
/// ttl of it (P's keys expire unrenewed), with a margin for a loaded machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contenders_that_reach_the_same_servers_by_other_addresses_hand_over() {
    let cluster = cluster();
    block_in_place(|| cluster.backdate_epochs(TTL));
    let fingerprints = [("REDLOCK_NODE_SET", "")];
    let mut watch = Watch::new();
    let mut p = Contender::start("p", &cluster.addrs(), &[], &[], &fingerprints).await;
    watch.add(&p);
    let held = watch
        .next_tenure(SystemTime::UNIX_EPOCH, Some("p"), "p leads", &[&p])
        .await;
    let q = Contender::start("q", &cluster.addrs(), &[], &[], &fingerprints).await;
    watch.add(&q);
    support::wait_until_async(ELECTION, "q sees p hold the lock", || async {
        q.holder().await.as_deref() == Some("p")
    })
    .await;
    watch.lasted(&held, since(held.since) + RENEW * 2).await;
    assert_eq!(
        metric(q.addr, "redlock_node_set_conflicts_total", "lock=").await,
        Some(0),
        "q lists the same servers as p"
    );
    let killed = SystemTime::now();
    p.proc.sigkill();
    let next = watch
        .next_tenure(killed, Some("q"), "q takes over", &[&q])
        .await;
    let took = ms_between(killed, next.claimed_after);
    let bound = (TTL + Duration::from_secs(2)).as_secs_f64() * 1e3;
    assert!(
        took <= bound,
        "q led {took:.0} ms after p was killed (bound {bound:.0} ms)"
    );
    watch.keep_log("p".to_owned(), p.proc.stderr_text());
    let tenures = watch.finish(&[&q]).await;
    assert_eq!(tenures.len(), 2, "p, then q: {tenures:?}");
    q.stop().await;
}

/// As above, and node 2 restarts (a new run id) while P leads: P's renewals put its key back
/// there and record the node set with the new server, Q learns the new server as it
/// reconnects, so when P is killed Q still takes over within a ttl: no record of the old set
/// is left to keep it out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_node_restart_contenders_on_the_same_servers_still_hand_over() {
    let mut cluster = cluster();
    block_in_place(|| cluster.backdate_epochs(TTL));
    let fingerprints = [("REDLOCK_NODE_SET", "")];
    let mut watch = Watch::new();
    let mut p = Contender::start("p", &cluster.addrs(), &[], &[], &fingerprints).await;
    watch.add(&p);
    watch
        .next_tenure(SystemTime::UNIX_EPOCH, Some("p"), "p leads", &[&p])
        .await;
    let q = Contender::start("q", &cluster.addrs(), &[], &[], &fingerprints).await;
    watch.add(&q);
    support::wait_until_async(ELECTION, "q sees p hold the lock", || async {
        q.holder().await.as_deref() == Some("p")
    })
    .await;
    const RECORD: &str = "redlock:{dataloss}:nodes";
    let before = block_in_place(|| info_field(cluster.node(2), "server", "run_id"));
    let old_set = block_in_place(|| cluster.node(0).command(&["GET", RECORD]));
    assert_ne!(old_set, "(nil)", "p's record stands beside its key");
    block_in_place(|| cluster.node_mut(2).restart());
    assert_ne!(
        block_in_place(|| info_field(cluster.node(2), "server", "run_id")),
        before
    );
    support::wait_until_async(
        ELECTION,
        "p's key is back on the restarted node",
        || async {
            block_in_place(|| cluster.node(2).try_command(&["GET", KEY]))
                .is_ok_and(|v| v.starts_with("p:"))
        },
    )
    .await;
    support::wait_until_async(
        ELECTION,
        "p records the new node set everywhere",
        || async {
            let sets = block_in_place(|| cluster.command_all(&["GET", RECORD]));
            sets.iter()
                .all(|set| set.as_ref().is_ok_and(|set| *set != old_set))
                && sets.windows(2).all(|pair| pair[0] == pair[1])
        },
    )
    .await;
    let killed = SystemTime::now();
    p.proc.sigkill();
    let next = watch
        .next_tenure(killed, Some("q"), "q takes over", &[&q])
        .await;
    let took = ms_between(killed, next.claimed_after);
    let bound = (TTL + Duration::from_secs(2)).as_secs_f64() * 1e3;
    assert!(
        took <= bound,
        "q led {took:.0} ms after p was killed (bound {bound:.0} ms)"
    );
    watch.keep_log("p".to_owned(), p.proc.stderr_text());
    watch.finish(&[&q]).await;
    q.stop().await;
}

/// Node 2 restarts (a new run id) while P leads, and P is frozen through it, so no renewal of
/// its can record the new server: its record on nodes 0 and 1 still names the server as it
/// was. Q starts then, and knows the restarted server. Once P releases (SIGTERM), Q must not
/// read P's old record as another node set: the release takes the record with the key, and Q
/// leads within a round or two, not after the record's life (four ttls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_after_a_node_restart_leaves_no_record_to_keep_contenders_out() {
    let mut cluster = cluster();
    block_in_place(|| cluster.backdate_epochs(LONG_TTL));
    let fingerprints = [("REDLOCK_NODE_SET", "")];
    let mut watch = Watch::new();
    // A long ttl: P stays within its validity however long the freeze takes on a busy machine
    // (a holder frozen past it would not release, and its record would rightly stay).
    let mut p =
        Contender::start_with("p", &cluster.addrs(), &[], &LONG_TIMING, &[], &fingerprints).await;
    watch.add(&p);
    watch
        .next_tenure(SystemTime::UNIX_EPOCH, Some("p"), "p leads", &[&p])
        .await;
    const RECORD: &str = "redlock:{dataloss}:nodes";
    let old_set = block_in_place(|| cluster.node(0).command(&["GET", RECORD]));
    assert_ne!(old_set, "(nil)", "p's record stands beside its key");
    block_in_place(|| {
        p.proc.sigstop();
        cluster.node_mut(2).restart();
    });
    let q =
        Contender::start_with("q", &cluster.addrs(), &[], &LONG_TIMING, &[], &fingerprints).await;
    watch.add(&q);
    // Q names the restarted server, P's record the old one.
    support::wait_until_async(ELECTION, "q sees p's old record", || async {
        metric(q.addr, "redlock_node_set_conflicts_total", "lock=").await >= Some(1)
    })
    .await;
    p.proc.sigcont();
    let released = SystemTime::now();
    watch.stop(p).await;
    let next = watch
        .next_tenure(released, Some("q"), "q takes over", &[&q])
        .await;
    let took = ms_between(released, next.claimed_after);
    let bound = 1_500.0;
    assert!(
        took <= bound,
        "q led {took:.0} ms after p released (bound {bound:.0} ms, where p's old record would \
         keep it out for four ttls)"
    );
    watch.finish(&[&q]).await;
    q.stop().await;
}

/// P leads; frozen through it (so that none of its renewals can record the new servers), it
/// sees `restarted` nodes restart empty (new run ids), and is killed: its record on the other
/// nodes still names the servers as they were. Q, started then behind its own proxies, knows
/// only the new servers. Q must lead once P's key has expired and the restarted nodes have
/// kept their data for ttl + drift, plus a round or two: P's record predates the restarted
/// servers, so it keeps nobody out (before, it did for its whole life, four ttls).
async fn a_holder_killed_through_a_restart_leaves_no_record_to_keep_contenders_out(
    restarted: &[usize],
) {
    let mut cluster = cluster();
    block_in_place(|| cluster.backdate_epochs(TTL));
    let fingerprints = [("REDLOCK_NODE_SET", "")];
    let mut watch = Watch::new();
    let mut p = Contender::start("p", &cluster.addrs(), &[], &[], &fingerprints).await;
    watch.add(&p);
    watch
        .next_tenure(SystemTime::UNIX_EPOCH, Some("p"), "p leads", &[&p])
        .await;
    const RECORD: &str = "redlock:{dataloss}:nodes";
    let old_set = block_in_place(|| cluster.node(0).command(&["GET", RECORD]));
    assert_ne!(old_set, "(nil)", "p's record stands beside its key");
    p.proc.sigstop();
    let stopped = SystemTime::now();
    block_in_place(|| {
        for &node in restarted {
            cluster.node_mut(node).restart();
        }
    });
    let restarted_at = SystemTime::now();
    p.proc.sigkill();
    watch.keep_log("p".to_owned(), p.proc.stderr_text());
    let q = Contender::start("q", &cluster.addrs(), &[], &[], &fingerprints).await;
    watch.add(&q);
    let next = watch
        .next_tenure(stopped, Some("q"), "q takes over", &[&q])
        .await;
    let took = ms_between(restarted_at, next.claimed_after);
    let young_wait = TTL + redlock_sidecar::redlock::drift(TTL);
    let bound = (young_wait + Duration::from_millis(1_500)).as_secs_f64() * 1e3;
    let record_life = (TTL * redlock_sidecar::redlock::RECORD_LIFE).as_secs_f64() * 1e3;
    assert!(
        took <= bound,
        "q led {took:.0} ms after the restart (bound {bound:.0} ms; p's record lives \
         {record_life:.0} ms)"
    );
    // Where q's round won without node 0 (its young nodes counted by then), q's renewals
    // restore its key there, with its record.
    support::wait_until_async(ELECTION, "q's record replaces p's on node 0", || async {
        block_in_place(|| cluster.node(0).command(&["GET", RECORD])) != old_set
    })
    .await;
    let tenures = watch.finish(&[&q]).await;
    assert_eq!(tenures.len(), 2, "p, then q: {tenures:?}");
    q.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_killed_through_a_node_restart_keeps_nobody_out() {
    a_holder_killed_through_a_restart_leaves_no_record_to_keep_contenders_out(&[2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_killed_through_a_majority_restart_keeps_nobody_out() {
    a_holder_killed_through_a_restart_leaves_no_record_to_keep_contenders_out(&[1, 2]).await;
}

/// How long ago `at` was.
fn since(at: SystemTime) -> Duration {
    SystemTime::now().duration_since(at).unwrap_or_default()
}

// ------------------------------------------------------------------------------------------------
// Eviction
// ------------------------------------------------------------------------------------------------

/// Three nodes; node 1 may evict any key (`allkeys-lru` under a memory limit).
fn cluster_with_an_evicting_node() -> RedisCluster {
    block_in_place(|| {
        let mut cluster = RedisCluster::start(3);
        cluster.nodes[1] =
            RedisNode::start_with(&["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]);
        cluster
    })
}

/// `check` on `nodes`: its output, after it exited 0.
fn check(nodes: &[SocketAddr], extra: &[&str]) -> String {
    let urls = nodes
        .iter()
        .map(|a| format!("redis://{a}"))
        .collect::<Vec<_>>()
        .join(",");
    let mut args = vec!["check", "--redis", &urls, "--ttl", "3s"];
    args.extend(extra);
    let mut proc = Proc::spawn(&args, &[]);
    let status = proc
        .wait_exit(Duration::from_secs(20))
        .expect("check exits");
    assert_eq!(status.code(), Some(0), "{}", proc.output_text());
    proc.stdout_text()
}

/// `check`'s line for `node`.
fn check_line(out: &str, node: SocketAddr) -> &str {
    out.lines()
        .find(|l| l.starts_with(&node.to_string()))
        .unwrap_or_else(|| panic!("a line for {node}:\n{out}"))
}

/// What `check` says in its VOTE COUNTS column for `node`.
fn check_vote(out: &str, node: SocketAddr) -> &str {
    let header = out.lines().next().unwrap_or_default();
    let column = header.find("VOTE COUNTS").expect("a VOTE COUNTS column");
    check_line(out, node)
        .get(column..)
        .unwrap_or_default()
        .trim()
}

/// Evicts every key on `node` for real: a memory limit below its use, then the old limit back.
fn evict_everything(node: &RedisNode) {
    let before: u64 = info_field(node, "stats", "evicted_keys")
        .parse()
        .unwrap_or(0);
    assert_eq!(node.command(&["CONFIG", "SET", "maxmemory", "1"]), "OK");
    // A write makes Redis evict until it fits (it never does): every key goes.
    let _ = node.command(&["SET", "evict-now", "x"]);
    assert_eq!(node.command(&["CONFIG", "SET", "maxmemory", "64mb"]), "OK");
    let after: u64 = info_field(node, "stats", "evicted_keys")
        .parse()
        .unwrap_or(0);
    assert!(after > before, "node evicted keys ({before} → {after})");
    assert_eq!(node.command(&["GET", KEY]), "(nil)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_may_evict_keys_never_counts_by_default() {
    let cluster = cluster_with_an_evicting_node();
    let nodes = cluster.addrs();
    let mut watch = Watch::new();
    // A reaches nodes 0 and 1 only: with node 1 not counted it can never lead.
    let a = Contender::start("a", &nodes, &[2], &[], &[]).await;
    watch.add(&a);
    support::wait_until_async(ELECTION, "a counts node 0's vote", || async {
        a.vote_counted(0).await == Some(1)
    })
    .await;
    let counted_at = SystemTime::now();
    let out = block_in_place(|| {
        // A ttl + drift later, every vote that could ever count has counted: observe that long.
        std::thread::sleep(TTL);
        check(&nodes, &[])
    });
    assert_eq!(
        a.vote_counted(1).await,
        Some(0),
        "the evicting node's vote is not counted"
    );
    assert!(
        watch.tenures().is_empty(),
        "a never led on nodes 0 and 1: {:?}",
        watch.tenures()
    );
    assert!(
        check_line(&out, nodes[1]).contains("allkeys-lru"),
        "check shows the policy:\n{out}"
    );
    assert!(
        check_vote(&out, nodes[1]).starts_with("no"),
        "check says node 1 does not count:\n{out}"
    );
    assert!(
        check_vote(&out, nodes[0]).starts_with("yes"),
        "check says node 0 counts:\n{out}"
    );

    // B reaches all three: it leads on nodes 0 and 2. Evicting node 1 changes nothing.
    let b = Contender::start("b", &nodes, &[], &[], &[]).await;
    watch.add(&b);
    let held = watch
        .next_tenure(counted_at, Some("b"), "b leads on nodes 0 and 2", &[&a, &b])
        .await;
    watch.lasted(&held, RENEW * 2).await;
    block_in_place(|| evict_everything(cluster.node(1)));
    let evicted = SystemTime::now();
    // Observe a ttl after the eviction: a must still never lead.
    watch
        .lasted(&held, elapsed(held.since, evicted) + TTL)
        .await;
    let tenures = watch.finish(&[&a, &b]).await;
    assert!(
        tenures.iter().all(|t| t.who == "b"),
        "only b led: {tenures:?}"
    );
    a.stop().await;
    b.stop().await;
}

/// From `from` to `to` (zero if `to` is earlier).
fn elapsed(from: SystemTime, to: SystemTime) -> Duration {
    to.duration_since(from).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_allow_evicting_nodes_an_evicting_node_counts_and_the_risk_is_logged() {
    let cluster = cluster_with_an_evicting_node();
    let nodes = cluster.addrs();
    let mut watch = Watch::new();
    // The variable, as a Helm value would set it: A leads on nodes 0 and 1.
    let mut a = Contender::start(
        "a",
        &nodes,
        &[2],
        &[],
        &[("REDLOCK_ALLOW_EVICTING_NODES", "true")],
    )
    .await;
    watch.add(&a);
    let held = watch
        .next_tenure(
            SystemTime::UNIX_EPOCH,
            Some("a"),
            "a leads on nodes 0 and 1",
            &[&a],
        )
        .await;
    assert_eq!(a.vote_counted(1).await, Some(1), "node 1's vote counts");
    a.proc
        .wait_for_output_async("allow-evicting-nodes", Duration::from_secs(5))
        .await;
    watch.lasted(&held, RENEW * 2).await;
    watch.finish(&[&a]).await;
    let out = block_in_place(|| check(&nodes, &["--allow-evicting-nodes"]));
    assert!(
        check_line(&out, nodes[1]).contains("allkeys-lru"),
        "check shows the policy:\n{out}"
    );
    assert!(
        check_vote(&out, nodes[1]).starts_with("yes"),
        "with the flag, check says node 1 counts:\n{out}"
    );
    a.stop().await;
}

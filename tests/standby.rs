//! What a waiting standby costs and learns: real `redlock-sidecar run` processes next to a
//! leader on real redis-server nodes.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use support::{http, Proc, RedisCluster};

const LOCK: &str = "jobs";
const KEY: &str = "redlock:{jobs}";

struct Sidecar {
    proc: Proc,
    addr: SocketAddr,
}

impl Sidecar {
    fn start(name: &str, cluster: &RedisCluster, ttl: &str) -> Sidecar {
        Sidecar::start_with(name, cluster, ttl, &[])
    }

    fn start_with(name: &str, cluster: &RedisCluster, ttl: &str, extra: &[&str]) -> Sidecar {
        let port = support::free_port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let listen = addr.to_string();
        let redis = cluster.urls_joined();
        let mut args = vec![
            "run",
            "--lock",
            LOCK,
            "--redis",
            &redis,
            "--ttl",
            ttl,
            "--listen",
            &listen,
            "--identity",
            name,
            "--safety-margin",
            "300ms",
            "--retry-delay",
            "50ms",
            "--node-timeout",
            "250ms",
        ];
        args.extend_from_slice(extra);
        Sidecar {
            proc: Proc::spawn(&args, &[("REDLOCK_LOG", "debug")]),
            addr,
        }
    }

    async fn leader(&self) -> Option<serde_json::Value> {
        http::get(self.addr, "/leader").await.ok()?.json().ok()
    }

    async fn holder(&self) -> Option<String> {
        Some(self.leader().await?["holder"].as_str()?.to_owned())
    }

    async fn wait_holder(&self, holder: &str, within: Duration) {
        support::wait_until_async(within, &format!("the standby sees {holder}"), || async {
            self.holder().await.as_deref() == Some(holder)
        })
        .await;
    }

    async fn is_leader(&self) -> bool {
        http::get(self.addr, "/leader")
            .await
            .is_ok_and(|r| r.status == 200)
    }

    /// The sum of `family`'s samples whose labels include `label`.
    async fn metric(&self, family: &str, label: &str) -> f64 {
        let text = http::get(self.addr, "/metrics")
            .await
            .map(|r| r.body)
            .unwrap_or_default();
        text.lines()
            .filter(|l| l.strip_prefix(family).is_some_and(|r| r.starts_with('{')))
            .filter(|l| l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

/// Scripts run on `node` (every acquire, extend, release runs by `EVALSHA`, or `EVAL` once).
fn scripts(node: &support::RedisNode) -> u64 {
    node.calls("evalsha") + node.calls("eval")
}

async fn leader_and_standby(cluster: &RedisCluster, ttl: &str) -> (Sidecar, Sidecar) {
    let a = Sidecar::start("a", cluster, ttl);
    support::wait_until_async(Duration::from_secs(10), "a leads", || a.is_leader()).await;
    let b = Sidecar::start("b", cluster, ttl);
    b.wait_holder("a", Duration::from_secs(10)).await;
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_standby_runs_no_acquire_script_while_the_leader_renews() {
    let cluster = RedisCluster::start(3);
    cluster.backdate_epochs(Duration::from_secs(2));
    let (a, b) = leader_and_standby(&cluster, "2s").await;
    let attempts = || b.metric("redlock_acquire_attempts_total", "");
    let renewals = || a.metric("redlock_renewals_total", "");
    let before: Vec<u64> = cluster.iter().map(scripts).collect();
    let (renewed_before, tried_before) = (renewals().await, attempts().await);
    // Two ttls: an acquire round per second (the old standby) would show several times.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let tried = attempts().await - tried_before;
    let renewed = renewals().await - renewed_before;
    let after: Vec<u64> = cluster.iter().map(scripts).collect();
    assert_eq!(tried, 0.0, "the standby ran no acquire round");
    assert!(renewed >= 4.0, "the leader renewed meanwhile ({renewed})");
    for (i, (before, after)) in before.iter().zip(&after).enumerate() {
        // One extend per renewal on each node. The node counts and the leader's metric are
        // read at different moments, so on a loaded machine a renewal or two may be counted on
        // one side only (seen once in CI: 8 scripts for 6 renewals). An acquire round per
        // second (the old standby) would add four in these 4 s; `tried` above also catches it.
        let ran = (after - before) as f64;
        assert!(
            (ran - renewed).abs() <= 2.0,
            "node {i}: {ran} scripts for {renewed} renewals: only the leader's renewals run scripts"
        );
    }
    // Its reads are plain and about one per ttl (not one per second).
    let reads = b.metric("redlock_standby_reads_total", "").await;
    assert!(reads <= 6.0, "the standby read the nodes {reads} times");
    assert_eq!(b.holder().await.as_deref(), Some("a"));
    // It counted who waits with it (both sidecars listen on the lock's channels), and with
    // so few it never leaves a read to others.
    assert_eq!(b.metric("redlock_standby_waiters", "").await, 2.0);
    assert_eq!(
        b.metric("redlock_standby_reads_skipped_total", "").await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_learns_a_new_holder_by_push_without_a_round() {
    let cluster = RedisCluster::start(1);
    cluster.backdate_epochs(Duration::from_secs(4));
    // An old holder whose key lives 4 s; the standby watches it.
    cluster
        .node(0)
        .command(&["SET", KEY, "old:0123", "PX", "4000"]);
    let b = Sidecar::start("b", &cluster, "4s");
    b.wait_holder("old", Duration::from_secs(10)).await;
    let tried = b.metric("redlock_acquire_attempts_total", "").await;
    // The old holder vanishes without a word, and a guard takes the lock at once: the
    // standby's next read is seconds away, so only the guard's announcement can tell it.
    cluster.node(0).command(&["DEL", KEY]);
    let redis = cluster.urls_joined();
    let mut guard = Proc::spawn(
        &[
            "guard",
            "--lock",
            LOCK,
            "--redis",
            &redis,
            "--ttl",
            "4s",
            "--identity",
            "g",
            "--kubernetes",
            "off",
            "--",
            "sleep",
            "30",
        ],
        &[],
    );
    let handoff = std::time::SystemTime::now();
    b.wait_holder("g", Duration::from_millis(1500)).await;
    let body = b.leader().await.expect("/leader answers");
    let observed = body["holder_observed_at"].as_str().expect("observed_at");
    let observed = httpdate_ms(observed);
    let handoff_ms = handoff
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    assert!(
        observed >= handoff_ms - 1000,
        "holder_observed_at ({observed}) is when the push came, not the old read"
    );
    assert_eq!(
        b.metric("redlock_acquire_attempts_total", "").await,
        tried,
        "no acquire round was run to learn it"
    );
    guard.sigterm();
    guard.wait_exit(Duration::from_secs(5));
}

/// Milliseconds since the Unix epoch of an RFC 3339 UTC time `YYYY-MM-DDTHH:MM:SS(.fff)Z`.
fn httpdate_ms(text: &str) -> i64 {
    let parse = |range: std::ops::Range<usize>| -> i64 { text[range].parse().unwrap() };
    let (y, mo, d) = (parse(0..4), parse(5..7), parse(8..10));
    let (h, mi, s) = (parse(11..13), parse(14..16), parse(17..19));
    let frac: f64 = text[19..text.len() - 1]
        .parse::<f64>()
        .map(|f| f * 1000.0)
        .unwrap_or(0.0);
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((mo + 9) % 12) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    ((days * 86_400 + h * 3600 + mi * 60 + s) * 1000) + frac as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_is_replaced_once_its_key_expires() {
    let cluster = RedisCluster::start(3);
    cluster.backdate_epochs(Duration::from_secs(2));
    let (mut a, b) = leader_and_standby(&cluster, "2s").await;
    a.proc.sigkill();
    let killed = Instant::now();
    support::wait_until_async(Duration::from_secs(6), "b takes over", || b.is_leader()).await;
    // Not before the dead holder's keys can have expired on a quorum (ttl minus the time
    // since its last renewal, at least ttl − renew interval).
    assert!(killed.elapsed() >= Duration::from_millis(1200));
    assert_eq!(b.holder().await.as_deref(), Some("b"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_subscription_falls_back_to_reads_shows_in_metrics_and_resubscribes() {
    let cluster = RedisCluster::start(3);
    cluster.backdate_epochs(Duration::from_secs(2));
    let (_a, b) = leader_and_standby(&cluster, "2s").await;
    let subscribed = || b.metric("redlock_push_subscribed", "");
    support::wait_until_async(
        Duration::from_secs(5),
        "b subscribed on every node",
        || async { subscribed().await == 3.0 },
    )
    .await;
    let fallback = || b.metric("redlock_standby_reads_total", "reason=\"fallback\"");
    let before = fallback().await;
    for node in cluster.iter() {
        node.command(&["CLIENT", "KILL", "TYPE", "pubsub"]);
    }
    support::wait_until_async(Duration::from_secs(5), "a fallback read", || async {
        fallback().await > before
    })
    .await;
    support::wait_until_async(Duration::from_secs(5), "b subscribed again", || async {
        subscribed().await == 3.0
    })
    .await;
    // Push works again: a release reaches the standby, which takes over at once.
    assert_eq!(b.holder().await.as_deref(), Some("a"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_keyspace_events_an_idle_standby_reads_nothing_and_still_sees_a_crash() {
    let cluster = RedisCluster::start_with(1, &["--notify-keyspace-events", "Kgx"]);
    cluster.backdate_epochs(Duration::from_secs(2));
    let mut a = Sidecar::start("a", &cluster, "2s");
    support::wait_until_async(Duration::from_secs(10), "a leads", || a.is_leader()).await;
    let b = Sidecar::start_with("b", &cluster, "2s", &["--keyspace-events"]);
    b.wait_holder("a", Duration::from_secs(10)).await;
    let reads = || b.metric("redlock_standby_reads_total", "");
    // Subscribed, and past the reads of its first watch.
    support::wait_until_async(Duration::from_secs(5), "b subscribed", || async {
        b.metric("redlock_push_subscribed", "").await == 1.0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = reads().await;
    // Two ttls: without events the standby would read at each expiry it saw (about 3 times).
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        reads().await,
        before,
        "every renewal's keyspace event moved the standby's read later"
    );
    a.proc.sigkill();
    support::wait_until_async(Duration::from_secs(6), "b takes over", || b.is_leader()).await;
}

/// The clients connected to `node` other than the one asking, each as its `CLIENT LIST` line.
fn clients(node: &support::RedisNode) -> Vec<String> {
    let list = node.command(&["CLIENT", "LIST"]);
    list.lines()
        .filter(|line| line.contains("id=") && !line.contains("cmd=client|list"))
        .map(str::to_owned)
        .collect()
}

/// A leader and a standby on one node: once both wait on push, the node holds `per_sidecar`
/// connections of each, and a release still reaches the standby by push.
async fn connections_and_push(cluster: &RedisCluster, per_sidecar: usize) {
    let (a, b) = leader_and_standby(cluster, "4s").await;
    support::wait_until_async(Duration::from_secs(5), "b subscribed", || async {
        b.metric("redlock_push_subscribed", "").await == 1.0
    })
    .await;
    let node = cluster.node(0);
    support::wait_until(Duration::from_secs(5), "both sidecars connected", || {
        clients(node).len() >= 2 * per_sidecar
    });
    let listed = clients(node);
    assert_eq!(
        listed.len(),
        2 * per_sidecar,
        "connections of a leader and a standby: {listed:#?}"
    );
    assert!(
        listed.iter().filter(|l| !l.contains(" sub=0 ")).count() >= 1,
        "the standby's subscriptions are on the node: {listed:#?}"
    );
    let tried = b.metric("redlock_acquire_attempts_total", "").await;
    let mut a = a;
    a.proc.sigterm();
    // The release is pushed: the standby leads long before the 4 s key would have expired.
    support::wait_until_async(
        Duration::from_millis(2500),
        "b leads after the release",
        || b.is_leader(),
    )
    .await;
    assert!(b.metric("redlock_acquire_attempts_total", "").await > tried);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_holds_one_connection_per_node_with_its_subscriptions_on_it() {
    let cluster = RedisCluster::start(1);
    cluster.backdate_epochs(Duration::from_secs(4));
    connections_and_push(&cluster, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_refuses_resp3_gets_a_dedicated_subscription_connection() {
    // `HELLO` unknown, as on Redis 5 and some proxies.
    let cluster = RedisCluster::start_with(1, &["--rename-command", "HELLO", ""]);
    cluster.backdate_epochs(Duration::from_secs(4));
    connections_and_push(&cluster, 2).await;
}

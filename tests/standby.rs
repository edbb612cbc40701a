//! What a waiting standby costs and learns: real `redlock-sidecar run` processes next to a
//! leader on real redis-server nodes.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::time::{Duration, Instant};

use support::{Proc, RedisCluster, Sidecar};

const LOCK: &str = "jobs";
const KEY: &str = "redlock:{jobs}";

/// A sidecar for lock [`LOCK`] on `cluster`.
fn sidecar(name: &str, cluster: &RedisCluster, ttl: &str) -> Sidecar {
    sidecar_with(name, cluster, ttl, &[])
}

fn sidecar_with(name: &str, cluster: &RedisCluster, ttl: &str, extra: &[&str]) -> Sidecar {
    Sidecar::start(name, LOCK, &cluster.urls_joined(), ttl, extra)
}

/// Scripts run on `node` (every acquire, extend, release runs by `EVALSHA`, or `EVAL` once).
fn scripts(node: &support::RedisNode) -> u64 {
    node.calls("evalsha") + node.calls("eval")
}

async fn leader_and_standby(cluster: &RedisCluster, ttl: &str) -> (Sidecar, Sidecar) {
    let a = sidecar("a", cluster, ttl);
    support::wait_until_async(Duration::from_secs(10), "a leads", || a.is_leader()).await;
    let b = sidecar("b", cluster, ttl);
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
    // It counted who waits with it (both sidecars listen on the lock's channels; a count
    // taken before both subscriptions were up is taken again within 3 ttls), and with so
    // few it never leaves a read to others.
    support::wait_until_async(Duration::from_secs(7), "b counted two waiters", || async {
        b.metric("redlock_standby_waiters", "").await == 2.0
    })
    .await;
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
    let b = sidecar("b", &cluster, "4s");
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
    let mut a = sidecar("a", &cluster, "2s");
    support::wait_until_async(Duration::from_secs(10), "a leads", || a.is_leader()).await;
    let b = sidecar_with("b", &cluster, "2s", &["--keyspace-events"]);
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

/// Standbys that must not be starved: ttl 2 s, a leader and a standby on one node.
const TTL: Duration = Duration::from_secs(2);

/// How soon a standby must take over after its leader is SIGKILLed: the leader's key expires
/// within a ttl, and the standby reads within about a ttl of that, whatever it was told.
const TAKEOVER: Duration = Duration::from_millis(2 * 2000 + 700);

/// `n` connections subscribed to `channel` on `node` (a crowd of waiters, or anyone else's).
fn subscribers(node: &support::RedisNode, channel: &str, n: usize) -> Vec<support::RawConn> {
    (0..n)
        .map(|_| {
            let mut conn = node.conn().expect("connect");
            conn.command(&["SUBSCRIBE", channel]).expect("subscribe");
            conn
        })
        .collect()
}

/// SIGKILLs the leader `a` and waits until `b` leads; returns how long that took.
async fn takeover_after_kill(a: &mut Sidecar, b: &Sidecar) -> Duration {
    a.proc.sigkill();
    let killed = Instant::now();
    support::wait_until_async(TAKEOVER, "the standby takes over", || b.is_leader()).await;
    let took = killed.elapsed();
    eprintln!("takeover {took:?} after the kill");
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_that_left_does_not_silence_a_standbys_reads() {
    let cluster = RedisCluster::start(1);
    cluster.backdate_epochs(TTL);
    let node = cluster.node(0);
    // 1,000 subscribers of the acquisition channel when the standby starts: it takes turns.
    let crowd = subscribers(node, "redlock:{jobs}:acquired", 1000);
    let (mut a, b) = leader_and_standby(&cluster, "2s").await;
    support::wait_until_async(Duration::from_secs(5), "b counted the crowd", || async {
        b.metric("redlock_standby_waiters", "").await >= 1000.0
    })
    .await;
    support::wait_until_async(
        Duration::from_secs(30),
        "b leaves a read to the others",
        || async { b.metric("redlock_standby_reads_skipped_total", "").await >= 1.0 },
    )
    .await;
    // The crowd leaves, and the leader crashes.
    drop(crowd);
    takeover_after_kill(&mut a, &b).await;
    assert!(b.metric("redlock_standby_waiters", "").await <= 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_waiter_count_does_not_silence_a_standbys_reads() {
    let cluster = RedisCluster::start(1);
    cluster.backdate_epochs(TTL);
    let node = cluster.node(0);
    let (mut a, b) = leader_and_standby(&cluster, "2s").await;
    let fence: u64 = node
        .command(&["GET", "redlock:{jobs}:fence"])
        .parse()
        .unwrap();
    // Old news, and news (a token above the nodes' counter), each claiming a million waiters.
    for token in [0, fence + 1] {
        let forged = format!("v1 {token} 1 1000000 ghost");
        node.command(&["PUBLISH", "redlock:{jobs}:acquired", &forged]);
    }
    // A standby that believed it would read at the next two deadlines, and then take turns.
    let reads = || b.metric("redlock_standby_reads_total", "");
    let before = reads().await;
    support::wait_until_async(Duration::from_secs(10), "b read twice more", || async {
        reads().await >= before + 2.0
    })
    .await;
    takeover_after_kill(&mut a, &b).await;
    assert_eq!(
        b.metric("redlock_standby_reads_skipped_total", "").await,
        0.0,
        "with two waiters, no read is left to others"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_token_and_validity_do_not_silence_a_standbys_reads() {
    let cluster = RedisCluster::start(1);
    cluster.backdate_epochs(TTL);
    let node = cluster.node(0);
    let (mut a, b) = leader_and_standby(&cluster, "2s").await;
    // The highest token there is, held for an hour.
    node.command(&[
        "PUBLISH",
        "redlock:{jobs}:acquired",
        "v1 9007199254740991 3600000 1 ghost",
    ]);
    b.wait_holder("ghost", Duration::from_secs(1)).await;
    // The nodes overrule it at the next read, within the key's ttl.
    b.wait_holder("a", TTL + Duration::from_millis(500)).await;
    takeover_after_kill(&mut a, &b).await;
}

/// Stamps `node`'s epoch marker of database `db` as if it had kept its data for `age`.
fn backdate_epoch_in(node: &support::RedisNode, db: u32, age: Duration) {
    use redlock_sidecar::redlock::{votes, EPOCH_KEY};
    let lineage = votes::lineage(&node.run_id().unwrap(), &node.replid().unwrap(), db.into());
    let px = (votes::EPOCH_LIFETIME_MS - age.as_millis() as u64).to_string();
    let mut conn = node.conn().expect("connect");
    conn.command(&["SELECT", &db.to_string()]).unwrap();
    conn.command(&["SET", EPOCH_KEY, &lineage, "PX", &px])
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployments_on_two_databases_of_one_server_hear_only_their_own_announcements() {
    let cluster = RedisCluster::start(1);
    let node = cluster.node(0);
    for db in [0, 1] {
        backdate_epoch_in(node, db, Duration::from_secs(4));
    }
    let (zero, one) = (format!("{}/0", node.url()), format!("{}/1", node.url()));
    // Many waiters of the other deployment watch its releases.
    let _others = subscribers(node, "redlock:{jobs}:db1:released", 60);
    let a1 = Sidecar::start("a1", LOCK, &zero, "4s", &[]);
    support::wait_until_async(Duration::from_secs(10), "a1 leads", || a1.is_leader()).await;
    let a2 = Sidecar::start("a2", LOCK, &zero, "4s", &[]);
    a2.wait_holder("a1", Duration::from_secs(10)).await;
    let mut b1 = Sidecar::start("b1", LOCK, &one, "4s", &[]);
    support::wait_until_async(Duration::from_secs(10), "b1 leads", || b1.is_leader()).await;
    let b2 = Sidecar::start("b2", LOCK, &one, "4s", &[]);
    b2.wait_holder("b1", Duration::from_secs(10)).await;
    // b1's acquisition announcement, with a later token, did not reach a2.
    assert_eq!(a2.holder().await.as_deref(), Some("a1"));
    // Only its own deployment's subscribers count: a2 watches releases.
    support::wait_until_async(Duration::from_secs(5), "a2 watches releases", || async {
        a2.metric("redlock_release_watch", "").await == 1.0
    })
    .await;
    // b1's release does not wake a2 (nor b2, which leaves releases to the 60 that watch
    // them there: it takes over once b1's keys are read gone).
    let a2_rounds = || a2.metric("redlock_acquire_attempts_total", "");
    let rounds = a2_rounds().await;
    b1.proc.sigterm();
    support::wait_until_async(Duration::from_secs(6), "b2 takes over", || b2.is_leader()).await;
    assert_eq!(a2_rounds().await, rounds, "a2 ran no round on b1's release");
    assert_eq!(a2.holder().await.as_deref(), Some("a1"));
    // a1's release reaches a2 by push: it leads without reading the nodes first.
    let reads = a2.metric("redlock_standby_reads_total", "").await;
    let mut a1 = a1;
    a1.proc.sigterm();
    let released = Instant::now();
    support::wait_until_async(Duration::from_secs(2), "a2 takes over", || a2.is_leader()).await;
    eprintln!("a2 leads {:?} after a1's SIGTERM", released.elapsed());
    assert_eq!(
        a2.metric("redlock_standby_reads_total", "").await,
        reads,
        "the release push, not a read, woke a2"
    );
}

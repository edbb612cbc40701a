//! Fencing tokens against real redis-server processes: a randomized check of the guarantee
//! `src/redlock/fencing.rs` states, and the bound on the keys a lock name leaves behind.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redlock_sidecar::clock::{self, Deadline};
use redlock_sidecar::redlock::{votes, NoObserver, Redlock, RedlockConfig, EPOCH_KEY};
use support::{FaultProxy, RedisCluster};
use tokio_util::sync::CancellationToken;

const TTL: Duration = Duration::from_millis(600);

fn config(urls: &[String], lock: &str, identity: &str) -> RedlockConfig {
    let mut cfg = support::engine_config(urls, lock, identity, TTL);
    cfg.node_timeout = Duration::from_millis(50);
    cfg.connect_timeout = Duration::from_millis(250);
    cfg
}

/// Random rounds on five nodes: each round a random minority is cut off (so every round
/// decides on a random quorum), sometimes a random set of nodes (majorities included) is
/// flushed, and the contender is drawn from clients whose clocks are skewed by up to
/// ±ttl/2. The guarantee promises strictly increasing tokens for all of it (clocks differ
/// by less than a ttl, and a flushed node votes again only a ttl + drift after its flush).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_strictly_increase_under_random_quorums_data_loss_and_skewed_clocks() {
    let seed: u64 = std::env::var("REDLOCK_FENCING_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("REDLOCK_FENCING_SEED={seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let cluster = RedisCluster::start(5);
    cluster.wait_votes_count(TTL);
    let mut proxies = Vec::new();
    for node in cluster.iter() {
        proxies.push(FaultProxy::start(node.addr()).await);
    }
    let urls: Vec<String> = proxies.iter().map(FaultProxy::url).collect();
    let skew_bound = (TTL / 2).as_millis() as i64;
    let clients: Vec<Redlock> = (0..4)
        .map(|i| {
            let mut cfg = config(&urls, "fenced", &format!("client-{i}"));
            cfg.wall_clock_skew_ms = rng.random_range(-skew_bound..=skew_bound);
            Redlock::new(cfg, Arc::new(NoObserver)).expect("config")
        })
        .collect();
    let never = CancellationToken::new();
    let mut last = 0u64;
    let (mut flushes, mut majority_flushes) = (0, 0);
    for round in 0..60 {
        let cut = rng.random_range(0..=2usize);
        let mut order: Vec<usize> = (0..5).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.random_range(0..=i));
        }
        for (rank, &node) in order.iter().enumerate() {
            proxies[node].blackhole(rank < cut);
        }
        // Every 15th round a majority loses its data; other rounds, sometimes any number.
        let forced = round % 15 == 7;
        if forced || rng.random_bool(0.2) {
            let lost = if forced {
                rng.random_range(3..=5usize)
            } else {
                rng.random_range(1..=5usize)
            };
            for &node in order.iter().take(lost) {
                cluster.node(node).command(&["FLUSHALL"]);
            }
            flushes += 1;
            majority_flushes += usize::from(lost >= 3);
        }
        let client = &clients[rng.random_range(0..clients.len())];
        let deadline = Deadline::now() + votes::required_data_age(TTL) + Duration::from_secs(10);
        let lease = client
            .acquire(Some(deadline), &never, |_, _| {})
            .await
            .unwrap_or_else(|e| panic!("round {round} (seed {seed}): no acquisition: {e}"));
        assert!(
            lease.fencing_token > last,
            "round {round} (seed {seed}): token {} after {last}",
            lease.fencing_token
        );
        last = lease.fencing_token;
        if rng.random_bool(0.5) {
            client.release(&lease).await;
        } else {
            // Left to expire: the next holder waits out the ttl.
            clock::sleep_until_deadline(lease.valid_until).await;
        }
    }
    println!("60 acquisitions, {flushes} flushes ({majority_flushes} of a majority)");
    assert!(majority_flushes >= 4, "majority flushes were drawn");
}

/// The per-schedule-slot recipe makes a new lock name every run. Each name's keys (lock,
/// fencing counter, max-ttl register) expire; what stays on a node is its one epoch marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_slot_names_leave_no_keys_behind_after_the_retention() {
    let cluster = RedisCluster::start(3);
    cluster.wait_votes_count(TTL);
    let urls = cluster.urls();
    let retention = TTL * 2;
    let mut last_token = 0;
    for slot in 0..1000 {
        let mut cfg = config(&urls, &format!("report-{slot}"), "cron");
        cfg.fence_retention = retention;
        let lock = Redlock::new(cfg, Arc::new(NoObserver)).expect("config");
        let lease = lock.try_acquire().await.expect("a fresh slot name is free");
        assert!(lease.fencing_token > last_token, "slot {slot}");
        last_token = lease.fencing_token;
        lock.release(&lease).await;
    }
    let keys_after_slots: Vec<u64> = cluster
        .iter()
        .map(|n| n.command(&["DBSIZE"]).parse().unwrap())
        .collect();
    println!("keys per node right after 1000 slot names: {keys_after_slots:?}");
    tokio::task::block_in_place(|| {
        support::wait_until(
            retention + Duration::from_secs(10),
            "every slot's keys expire",
            || cluster.iter().all(|n| n.command(&["DBSIZE"]).trim() == "1"),
        )
    });
    for node in cluster.iter() {
        assert_ne!(
            node.command(&["GET", EPOCH_KEY]),
            "(nil)",
            "the marker stays"
        );
    }
    println!("keys per node after the retention: 1 (the epoch marker)");
}

/// Contenders with different `--fence-retention`: the longest one governs the counter, the
/// shorter never cuts it (a renewal or a grant only ever extends the counter's expiry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shorter_fence_retention_never_shortens_a_longer_one() {
    let cluster = RedisCluster::start(1);
    cluster.wait_votes_count(TTL);
    let mut long = config(&cluster.urls(), "retention", "long");
    long.fence_retention = Duration::from_secs(3600);
    let mut short = config(&cluster.urls(), "retention", "short");
    short.fence_retention = Duration::from_secs(60);
    let long = Redlock::new(long, Arc::new(NoObserver)).expect("valid config");
    let short = Redlock::new(short, Arc::new(NoObserver)).expect("valid config");
    let lease = long.try_acquire().await.expect("long takes the lock");
    long.release(&lease).await;
    let lease = short.try_acquire().await.expect("short takes the lock");
    short.extend(&lease).await.expect("short renews");
    short.release(&lease).await;
    let pttl: u64 = cluster
        .node(0)
        .command(&["PTTL", "redlock:{retention}:fence"])
        .parse()
        .expect("the counter has an expiry");
    assert!(
        pttl > 3_000_000,
        "the counter keeps the longest retention: {pttl} ms left"
    );
}

/// A counter at or above 2^53 (beyond what the scripts compare exactly) is a protocol error
/// for that node, never a number a token is built on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_beyond_two_to_the_53_is_refused() {
    let cluster = RedisCluster::start(1);
    cluster.wait_votes_count(TTL);
    cluster
        .node(0)
        .command(&["SET", "redlock:{huge}:fence", "9007199254740993"]);
    let lock = Redlock::new(config(&cluster.urls(), "huge", "a"), Arc::new(NoObserver))
        .expect("valid config");
    let err = lock.try_acquire().await.expect_err("no token above 2^53");
    assert!(err.to_string().contains("2^53"), "{err}");
}

//! What distinct lock names leave on the nodes: a lock per order id, each locked once and
//! released, then `DBSIZE` and `INFO memory` on every node.
//!
//! `cargo bench --bench names`. Three local `redis-server` nodes; every name is locked once
//! through the library on one shared engine (as the sidecar's request locks are), with a ttl
//! of 1 s, by 32 concurrent clients; then the keys and `used_memory` of each node are read
//! right after the last release, and again once the records beside the keys (twice the ttl)
//! have expired ("settled"), against the same figures before the run.
//!
//! Two arrangements, one run:
//! - **own counters**: each name keeps its own fencing counter for the fence retention (24 h),
//!   the engine's default for a lock of its own (the leadership lock);
//! - **namespace counter**: tokens from the counter the namespace shares per hash slot, as
//!   request locks do (`RedlockConfig::fence_namespace`).
//!
//! Knobs: `BENCH_NAMES` (default 1,000,000) names for the namespace counter, `BENCH_OWN_NAMES`
//! (default 20,000) for own counters (their cost grows by name, so fewer show it);
//! `BENCH_QUICK=1`: 20,000 and 5,000.
//!
//! Prints a markdown table, then, last, one line per arrangement:
//! `names=<K> counters=<own|namespace> settled_keys_per_node=<d> settled_bytes_per_node=<b>`.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redlock_sidecar::redlock::{self, NoObserver, Redlock, RedlockConfig};
use support::{env_usize, info_field, RedisServer};

/// The ttl of every lock here: short, so the records beside the keys expire soon.
const TTL: Duration = Duration::from_secs(1);
/// Clients locking names at once.
const CLIENTS: usize = 32;

/// `(DBSIZE, used_memory)` of every node.
fn footprint(servers: &[RedisServer]) -> Vec<(u64, u64)> {
    servers
        .iter()
        .map(|server| {
            let keys = server.cmd(&["DBSIZE"]).parse().expect("DBSIZE");
            let memory = server.cmd(&["INFO", "memory"]);
            let used = info_field(&memory, "used_memory")
                .and_then(|v| v.parse().ok())
                .expect("used_memory");
            (keys, used)
        })
        .collect()
}

/// The largest per-node growth from `before` to `after`: `(keys, bytes)`.
fn growth(before: &[(u64, u64)], after: &[(u64, u64)]) -> (i64, i64) {
    before
        .iter()
        .zip(after)
        .map(|(b, a)| (a.0 as i64 - b.0 as i64, a.1 as i64 - b.1 as i64))
        .fold((i64::MIN, i64::MIN), |m, g| (m.0.max(g.0), m.1.max(g.1)))
}

struct Run {
    names: usize,
    counters: &'static str,
    seconds: f64,
    failures: usize,
    right_after: (i64, i64),
    settled: (i64, i64),
}

/// Locks `names` distinct names once each (namespace `ns`, or own counters), then measures.
async fn run(
    servers: &[RedisServer],
    names: usize,
    namespace: Option<&'static str>,
    prefix: &'static str,
) -> Run {
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let mut base = support::engine_config(&urls, "names", "bench", TTL);
    base.fence_namespace = namespace.map(str::to_owned);
    let engine = Arc::new(redlock::Engine::new(&base).expect("engine"));
    let before = footprint(servers);
    let next = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (engine, base, next, failures) = (
                Arc::clone(&engine),
                base.clone(),
                Arc::clone(&next),
                Arc::clone(&failures),
            );
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= names {
                        return;
                    }
                    let cfg = RedlockConfig {
                        lock: format!("{prefix}:order-{i}"),
                        ..base.clone()
                    };
                    let lock = Redlock::on(&engine, cfg, Arc::new(NoObserver)).expect("config");
                    match lock.try_acquire().await {
                        Ok(lease) => {
                            lock.release(&lease).await;
                        }
                        Err(_) => {
                            failures.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    for client in clients {
        client.await.expect("client");
    }
    let seconds = start.elapsed().as_secs_f64();
    let right_after = growth(&before, &footprint(servers));
    // The ttl and node-set records live `RECORD_LIFE` ttls; Redis expires idle keys by
    // sampling, so wait until the key count stops falling (at most a minute).
    let deadline = Instant::now() + Duration::from_secs(60);
    tokio::time::sleep(TTL * redlock_sidecar::redlock::RECORD_LIFE).await;
    let mut last = footprint(servers);
    while Instant::now() < deadline {
        tokio::time::sleep(TTL).await;
        let now = footprint(servers);
        if now.iter().zip(&last).all(|(n, l)| n.0 >= l.0) {
            break;
        }
        last = now;
    }
    Run {
        names,
        counters: if namespace.is_some() {
            "namespace"
        } else {
            "own"
        },
        seconds,
        failures: failures.load(Ordering::Relaxed),
        right_after,
        settled: growth(&before, &footprint(servers)),
    }
}

fn main() {
    let quick = std::env::var("BENCH_QUICK").is_ok_and(|v| v == "1");
    let shared_names = env_usize("BENCH_NAMES", if quick { 20_000 } else { 1_000_000 });
    let own_names = env_usize("BENCH_OWN_NAMES", if quick { 5_000 } else { 20_000 });
    let servers = support::start_servers(3);
    support::settle(&servers);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let runs = runtime.block_on(async {
        vec![
            run(&servers, own_names, None, "own").await,
            run(&servers, shared_names, Some("app"), "app").await,
        ]
    });
    println!("{}", support::machine());
    println!(
        "\n| counters | names | cycles/s | failed | keys/node right after | keys/node settled | \
         used_memory/node settled | per name settled |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in &runs {
        println!(
            "| {} | {} | {:.0} | {} | {} | {} | {:.1} MB | {:.1} bytes |",
            r.counters,
            r.names,
            r.names as f64 / r.seconds,
            r.failures,
            r.right_after.0,
            r.settled.0,
            r.settled.1 as f64 / 1e6,
            r.settled.1 as f64 / r.names as f64,
        );
    }
    println!();
    for r in &runs {
        println!(
            "names={} counters={} settled_keys_per_node={} settled_bytes_per_node={}",
            r.names, r.counters, r.settled.0, r.settled.1
        );
    }
}

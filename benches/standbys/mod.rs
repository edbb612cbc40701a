//! Standbys on one lock: idle cost, wake-ups by a release, takeover after a crash (see the
//! module doc of `herd.rs`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redlock_sidecar::redlock::{Lease, NoObserver, NodeErrorKind, Observer, Op, Redlock};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::support::{self, env_usize, fmt_dur, RedisServer, Samples};

/// A standby that won: when, and what it holds.
struct Won {
    at: Instant,
    engine: Redlock,
    lease: Lease,
}

/// The holder: its engine, lease, and the task renewing it.
struct Holder {
    engine: Redlock,
    lease: Arc<std::sync::Mutex<Lease>>,
    stop: CancellationToken,
}

impl Holder {
    fn start(engine: Redlock, lease: Lease, ttl: Duration) -> Holder {
        let lease = Arc::new(std::sync::Mutex::new(lease));
        let stop = CancellationToken::new();
        let (e, l, s) = (engine.clone(), lease.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = s.cancelled() => return,
                    _ = tokio::time::sleep(ttl / 3) => {}
                }
                let current = l.lock().unwrap().clone();
                if let Ok(renewed) = e.extend(&current).await {
                    *l.lock().unwrap() = renewed;
                }
            }
        });
        Holder {
            engine,
            lease,
            stop,
        }
    }

    /// Stops renewing; returns the engine and the lease.
    fn stop(self) -> (Redlock, Lease) {
        self.stop.cancel();
        let lease = self.lease.lock().unwrap().clone();
        (self.engine, lease)
    }
}

/// Client-side requests of the standbys, by kind (one read is `GET` + `PTTL` pipelined).
#[derive(Default)]
struct Requests {
    reads: AtomicU64,
    acquire: AtomicU64,
    other: AtomicU64,
}

impl Observer for Requests {
    fn node_call(&self, _: usize, op: Op, _: Duration, _: Result<(), NodeErrorKind>) {
        match op {
            Op::Read => &self.reads,
            Op::Acquire => &self.acquire,
            _ => &self.other,
        }
        .fetch_add(1, Ordering::Relaxed);
    }
}

impl Requests {
    fn get(&self) -> [u64; 3] {
        [&self.reads, &self.acquire, &self.other].map(|c| c.load(Ordering::Relaxed))
    }
}

fn engine(urls: &[String], lock: &str, identity: &str, ttl: Duration) -> Redlock {
    engine_observed(urls, lock, identity, ttl, Arc::new(NoObserver))
}

fn engine_observed(
    urls: &[String],
    lock: &str,
    identity: &str,
    ttl: Duration,
    observer: Arc<dyn Observer>,
) -> Redlock {
    let mut cfg = super::support::engine_config(urls, lock, identity, ttl);
    cfg.keyspace_events = std::env::var("BENCH_KEYSPACE").as_deref() == Ok("1");
    Redlock::new(cfg, observer).expect("valid config")
}

/// Starts `engine` waiting for the lock; a win is sent on `won`.
fn wait(engine: Redlock, rounds: Arc<AtomicU64>, won: mpsc::UnboundedSender<Won>) {
    tokio::spawn(async move {
        let never = CancellationToken::new();
        let result = engine
            .acquire(None, &never, |_, _| {
                rounds.fetch_add(1, Ordering::Relaxed);
            })
            .await;
        if let Ok(lease) = result {
            let _ = won.send(Won {
                at: Instant::now(),
                engine,
                lease,
            });
        }
    });
}

/// Calls per command, summed over `servers`, and their Redis CPU seconds.
fn snapshot(servers: &[RedisServer]) -> (BTreeMap<String, u64>, f64) {
    let mut calls = BTreeMap::new();
    let mut cpu = 0.0;
    for server in servers {
        for line in server.cmd(&["INFO", "commandstats"]).lines() {
            let Some((name, fields)) = line
                .strip_prefix("cmdstat_")
                .and_then(|l| l.split_once(':'))
            else {
                continue;
            };
            let n: u64 = fields
                .split(',')
                .find_map(|f| f.strip_prefix("calls="))
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            *calls.entry(name.to_owned()).or_insert(0) += n;
        }
        let info = server.cmd(&["INFO", "cpu"]);
        for field in ["used_cpu_sys", "used_cpu_user"] {
            cpu += support::info_field(&info, field)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0);
        }
    }
    (calls, cpu)
}

/// `after − before`, without the benchmark's own `INFO` calls.
fn spent(
    before: &(BTreeMap<String, u64>, f64),
    after: &(BTreeMap<String, u64>, f64),
) -> (BTreeMap<String, u64>, f64) {
    let calls = after
        .0
        .iter()
        .filter(|(name, _)| name.as_str() != "info")
        .map(|(name, n)| (name.clone(), n - before.0.get(name).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect();
    (calls, after.1 - before.1)
}

fn scripts(calls: &BTreeMap<String, u64>) -> u64 {
    calls.get("evalsha").copied().unwrap_or(0) + calls.get("eval").copied().unwrap_or(0)
}

fn total(calls: &BTreeMap<String, u64>) -> u64 {
    calls.values().sum()
}

/// When the lock becomes free on the nodes if nobody renews it: the quorum-th last expiry.
fn free_at(servers: &[RedisServer], key: &str) -> Instant {
    let now = Instant::now();
    let mut expiries: Vec<Instant> = servers
        .iter()
        .filter_map(|s| s.cmd(&["PTTL", key]).trim().parse::<i64>().ok())
        .filter(|ms| *ms >= 0)
        .map(|ms| now + Duration::from_millis(ms as u64))
        .collect();
    expiries.sort();
    let quorum = servers.len() / 2 + 1;
    expiries[expiries.len().saturating_sub(quorum)]
}

pub fn run(servers: &[RedisServer]) {
    let sizes: Vec<usize> = std::env::var("BENCH_STANDBYS")
        .unwrap_or_else(|_| "1,1000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let ttl = Duration::from_secs(env_usize("BENCH_STANDBY_TTL", 10) as u64);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    if std::env::var("BENCH_KEYSPACE").as_deref() == Ok("1") {
        for server in servers {
            server.cmd(&["CONFIG", "SET", "notify-keyspace-events", "Kgx"]);
        }
    }
    // `CONFIG GET` answers the name, then the value (an empty line when none is set).
    let events = servers[0].cmd(&["CONFIG", "GET", "notify-keyspace-events"]);
    let events = events.lines().nth(1).map(str::trim).unwrap_or("");
    println!(
        "\n## Standbys on one lock: {} nodes, ttl {}, keyspace events {}\n",
        servers.len(),
        fmt_dur(ttl),
        if events.is_empty() { "off" } else { events }
    );
    for size in sizes {
        runtime.block_on(standbys(servers, size, ttl));
    }
}

async fn standbys(servers: &[RedisServer], size: usize, ttl: Duration) {
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let lock = format!("standbys-{size}");
    let key = format!("redlock:{{{lock}}}");
    let n = servers.len() as f64;
    let holder = engine(&urls, &lock, "holder-0", ttl);
    let lease = holder.try_acquire().await.expect("the lock is free");
    let mut holder = Holder::start(holder, lease, ttl);
    let idle_secs = env_usize("BENCH_IDLE_SECS", 30) as u64;
    let secs = idle_secs as f64;
    // The holder alone, for the baseline of Redis CPU.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = snapshot(servers);
    tokio::time::sleep(Duration::from_secs(idle_secs)).await;
    let (_, holder_cpu) = spent(&before, &snapshot(servers));
    let requests = Arc::new(Requests::default());
    let rounds = Arc::new(AtomicU64::new(0));
    let (won_tx, mut won) = mpsc::unbounded_channel();
    for i in 0..size {
        wait(
            engine_observed(&urls, &lock, &format!("standby-{i}"), ttl, requests.clone()),
            rounds.clone(),
            won_tx.clone(),
        );
    }
    // Every standby has lost its first round and subscribed on every node.
    let channel = format!("{key}:acquired");
    let ready = Instant::now();
    loop {
        let subscribed = servers.iter().all(|s| {
            s.cmd(&["PUBSUB", "NUMSUB", &channel])
                .lines()
                .nth(1)
                .and_then(|l| l.trim().parse::<usize>().ok())
                .is_some_and(|c| c >= size)
        });
        if subscribed && rounds.load(Ordering::Relaxed) >= size as u64 {
            break;
        }
        assert!(
            ready.elapsed() < Duration::from_secs(120),
            "standbys never settled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Idle, with the standbys.
    let requests0 = requests.get();
    let before = snapshot(servers);
    tokio::time::sleep(Duration::from_secs(idle_secs)).await;
    let (calls, cpu) = spent(&before, &snapshot(servers));
    let [reads, acquire, other] = {
        let now = requests.get();
        [0, 1, 2].map(|i| now[i] - requests0[i])
    };
    let per = |x: u64| x as f64 / n / secs;
    println!("### {size} standbys\n");
    println!(
        "Idle, {idle_secs} s: the standbys sent {:.3} requests per node per second ({:.4} per standby): {:.3} reads (`GET` + `PTTL` pipelined: {:.3} commands), {:.3} acquire scripts, {:.3} other. Redis CPU: {:.1} µs per node per second with them, {:.1} with the holder alone (its renewals), so {:.2} µs per node per second per standby. All commands the nodes ran (script-internal calls included): {:?}.\n",
        per(reads + acquire + other),
        per(reads + acquire + other) / size as f64,
        per(reads),
        per(reads * 2),
        per(acquire),
        per(other),
        cpu * 1e6 / n / secs,
        holder_cpu * 1e6 / n / secs,
        (cpu - holder_cpu) * 1e6 / n / secs / size as f64,
        calls,
    );

    // Wake-ups by a release.
    let wakeups = env_usize("BENCH_WAKEUPS", 20);
    let mut takeover = Samples::default();
    let (mut w_calls, mut w_scripts, mut w_cpu, mut w_rounds) = (0u64, 0u64, 0.0f64, 0u64);
    for _ in 0..wakeups {
        let (engine, lease) = holder.stop();
        let before = snapshot(servers);
        let rounds0 = rounds.load(Ordering::Relaxed);
        let start = Instant::now();
        engine.release(&lease).await;
        let w = tokio::time::timeout(Duration::from_secs(10), won.recv())
            .await
            .expect("a standby takes over")
            .expect("standbys wait");
        takeover.push(w.at.saturating_duration_since(start));
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (calls, cpu) = spent(&before, &snapshot(servers));
        w_calls += total(&calls);
        w_scripts += scripts(&calls);
        w_cpu += cpu;
        w_rounds += rounds.load(Ordering::Relaxed) - rounds0;
        holder = Holder::start(w.engine, w.lease, ttl);
        // The old holder waits again.
        wait(engine, rounds.clone(), won_tx.clone());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let per = |x: f64| x / wakeups as f64;
    println!(
        "Wake-ups by a release ({wakeups}): takeover p50 {}, p99 {}, max {}; per wake-up (all nodes, over 300 ms): {:.1} acquire rounds, {:.1} commands, {:.1} scripts, {:.0} µs Redis CPU (the old holder's waiting round included).\n",
        fmt_dur(takeover.pct(50.0)),
        fmt_dur(takeover.pct(99.0)),
        fmt_dur(takeover.max()),
        per(w_rounds as f64),
        per(w_calls as f64),
        per(w_scripts as f64),
        per(w_cpu * 1e6),
    );

    // Crashes: the holder stops renewing and never releases.
    let crashes = env_usize("BENCH_CRASHES", 3);
    let mut late = Samples::default();
    let (mut c_calls, mut c_scripts) = (0u64, 0u64);
    for _ in 0..crashes {
        let (engine, _lease) = holder.stop();
        let free = free_at(servers, &key);
        let before = snapshot(servers);
        let w = tokio::time::timeout(ttl * 2, won.recv())
            .await
            .expect("a standby takes over")
            .expect("standbys wait");
        late.push(w.at.saturating_duration_since(free));
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (calls, _) = spent(&before, &snapshot(servers));
        c_calls += total(&calls);
        c_scripts += scripts(&calls);
        holder = Holder::start(w.engine, w.lease, ttl);
        wait(engine, rounds.clone(), won_tx.clone());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "Crashes ({crashes}): takeover after the lock became free on the nodes: p50 {}, max {}; per crash (all nodes, from the crash to 300 ms after the takeover): {:.1} commands, {:.1} scripts.\n",
        fmt_dur(late.pct(50.0)),
        fmt_dur(late.max()),
        c_calls as f64 / crashes.max(1) as f64,
        c_scripts as f64 / crashes.max(1) as f64,
    );
    let (engine, lease) = holder.stop();
    engine.release(&lease).await;
}

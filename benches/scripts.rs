//! Script-cost benchmark: what the engine's renewal and granted acquire cost a node, beside
//! the classic scripts that do the least such a lock can do, at the same cadence.
//!
//! `cargo bench --bench scripts`. Prints a markdown table, then, last, the two ratios:
//! `renewal/classic=<ratio>` and `acquire/classic_fenced=<ratio>`.
//!
//! One local `redis-server` (pinned with the benchmark, as `benches/engine.rs` does;
//! `BENCH_CPU=none` to run unpinned). Five kinds of call, each made `BENCH_CALLS` (default 27,
//! `PROOF_EVERY`) times per phase, one call every `BENCH_CADENCE_MS` (default 300: a renewal's
//! cadence at a ttl of 900 ms, three calls a second):
//! - **renewal**: `Redlock::extend` of a held lease (ttl 900 ms): the engine's `EXTEND` with
//!   everything it refreshes when due, as often as it is due at this cadence. The lease is
//!   taken afresh before each phase (before the statistics are reset), so a phase of
//!   `PROOF_EVERY` renewals holds exactly the mix a long tenure has: one renewal with the
//!   data-age proof, about one in nine with the register's refresh, the rest bare.
//! - **classic renewal**: `if GET key == value then PEXPIRE key ttl` as one script, on a key
//!   set afresh before each phase.
//! - **acquire**: `Redlock::try_acquire` of a free lock (granted), then a bare `DEL` of the key.
//! - **classic fenced acquire**: `SET key value NX PX ttl` and `INCR` of a counter in one
//!   script, then a bare `DEL` of the key.
//! - **lineage read**: a script that only reads `INFO server replication`, what the acquire's
//!   data-age proof must read in the same script (`votes`, rule 2): the part of the acquire's
//!   cost no cheaper script can remove.
//!
//! `INFO commandstats` counts every `EVALSHA` under one name, so each phase runs one kind
//! only: `CONFIG RESETSTAT`, the calls, then `cmdstat_evalsha` (calls and `usec`). Phases
//! alternate (in the order above, rotated each round) for `BENCH_ROUNDS` (default 5) rounds, so
//! that whatever else loads the machine hits every kind alike; a kind's figure is the `usec` per
//! call of its median phase (the mean over all its calls is printed beside it: one disturbed
//! phase moves it far more).
//! The `DEL`s count under `cmdstat_del`, not in these figures.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::Script;
use redlock_sidecar::redlock::{NoObserver, Redlock, PROOF_EVERY};
use support::{env_usize, RedisServer};

const TTL: Duration = Duration::from_millis(900);

/// The commands a script may run inside, counted per call of each kind.
const INSIDE: [&str; 7] = ["get", "mget", "pttl", "set", "pexpire", "info", "incr"];

static CLASSIC_RENEWAL: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then \
         return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0",
    )
});
static LINEAGE_READ: LazyLock<Script> =
    LazyLock::new(|| Script::new("redis.call('INFO', 'server', 'replication') return 1"));
static CLASSIC_FENCED_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then \
         return redis.call('INCR', KEYS[2]) end return 0",
    )
});

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Renewal,
    ClassicRenewal,
    Acquire,
    ClassicFencedAcquire,
    LineageRead,
}

const KINDS: [Kind; 5] = [
    Kind::Renewal,
    Kind::ClassicRenewal,
    Kind::Acquire,
    Kind::ClassicFencedAcquire,
    Kind::LineageRead,
];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Renewal => "renewal (engine `EXTEND`)",
            Kind::ClassicRenewal => "classic owner-checked renewal (`GET` = value, `PEXPIRE`)",
            Kind::Acquire => "granted acquire (engine `ACQUIRE`)",
            Kind::ClassicFencedAcquire => "classic fenced acquire (`SET NX PX`, `INCR`)",
            Kind::LineageRead => "a script that only reads `INFO server replication` (rule 2)",
        }
    }
}

/// The clients of every kind, on one node.
struct Contenders {
    holder: Redlock,
    lease: Option<redlock_sidecar::redlock::Lease>,
    acquirer: Redlock,
    conn: MultiplexedConnection,
}

const ACQUIRE_LOCK: &str = "bench-scripts-acquire";
const CLASSIC_KEY: &str = "bench:classic";
const CLASSIC_FENCE: &str = "bench:classic:fence";

impl Contenders {
    /// Makes one call of `kind`.
    async fn call(&mut self, kind: Kind) {
        let ttl = TTL.as_millis() as u64;
        match kind {
            Kind::Renewal => {
                let lease = self.lease.take().expect("a held lease");
                match self.holder.extend(&lease).await {
                    Ok(lease) => self.lease = Some(lease),
                    // A renewal that came too late (a loaded machine): the phase goes on
                    // without the lock and says so.
                    Err(e) => panic!("renewal failed ({e}): rerun on a quieter machine"),
                }
            }
            Kind::ClassicRenewal => {
                let _: i64 = CLASSIC_RENEWAL
                    .key(CLASSIC_KEY)
                    .arg("holder")
                    .arg(ttl)
                    .invoke_async(&mut self.conn)
                    .await
                    .expect("classic renewal");
            }
            Kind::Acquire => {
                let lease = self.acquirer.try_acquire().await.expect("granted acquire");
                drop(lease);
                self.del(&format!("redlock:{{{ACQUIRE_LOCK}}}")).await;
            }
            Kind::LineageRead => {
                let _: i64 = LINEAGE_READ
                    .invoke_async(&mut self.conn)
                    .await
                    .expect("lineage read");
            }
            Kind::ClassicFencedAcquire => {
                let token: i64 = CLASSIC_FENCED_ACQUIRE
                    .key(format!("{CLASSIC_KEY}:acquire"))
                    .key(CLASSIC_FENCE)
                    .arg("holder")
                    .arg(ttl)
                    .invoke_async(&mut self.conn)
                    .await
                    .expect("classic fenced acquire");
                assert!(token > 0, "granted");
                self.del(&format!("{CLASSIC_KEY}:acquire")).await;
            }
        }
    }

    /// Puts in place, before a phase's statistics are reset, what its calls renew: the
    /// engine's lease, taken afresh (ttl-long phases apart would let it expire), or the
    /// classic key.
    async fn prepare(&mut self, kind: Kind) {
        match kind {
            Kind::Renewal => {
                if let Some(lease) = self.lease.take() {
                    self.holder.release(&lease).await;
                }
                self.lease = Some(self.holder.try_acquire().await.expect("acquire"));
            }
            Kind::ClassicRenewal => {
                let _: () = redis::cmd("SET")
                    .arg(CLASSIC_KEY)
                    .arg("holder")
                    .arg("PX")
                    .arg(TTL.as_millis() as u64)
                    .query_async(&mut self.conn)
                    .await
                    .expect("SET");
            }
            Kind::Acquire | Kind::ClassicFencedAcquire | Kind::LineageRead => {}
        }
    }

    async fn del(&mut self, key: &str) {
        let _: i64 = redis::cmd("DEL")
            .arg(key)
            .query_async(&mut self.conn)
            .await
            .expect("DEL");
    }
}

/// What each phase of one kind cost: calls, and `usec` per call.
#[derive(Default, Clone)]
struct Cost {
    calls: u64,
    usec: u64,
    per_phase: Vec<f64>,
}

impl Cost {
    /// The median phase's `usec` per call: a phase that something else on the machine
    /// disturbed moves it less than it moves the mean.
    fn median(&self) -> f64 {
        let mut v = self.per_phase.clone();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    }

    fn mean(&self) -> f64 {
        self.usec as f64 / self.calls.max(1) as f64
    }
}

fn main() {
    let calls = env_usize("BENCH_CALLS", PROOF_EVERY as usize);
    let rounds = env_usize("BENCH_ROUNDS", 5);
    let cadence = Duration::from_millis(env_usize("BENCH_CADENCE_MS", 300) as u64);
    let cpu = support::pinned_cpu();
    if let Some(cpu) = cpu {
        support::pin_to(cpu).unwrap_or_else(|e| panic!("{e} (BENCH_CPU=none to run unpinned)"));
    }
    let server = RedisServer::start_on(cpu);
    support::settle(std::slice::from_ref(&server));
    let urls = [server.url()];
    let engine = |lock: &str| {
        let cfg = support::engine_config(&urls, lock, "bench", TTL);
        Redlock::new(cfg, Arc::new(NoObserver)).expect("valid config")
    };
    let started = Instant::now();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let (costs, inside) = runtime.block_on(async {
        let holder = engine("bench-scripts-renewal");
        let conn = redis::Client::open(server.url())
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect");
        let mut contenders = Contenders {
            holder,
            lease: None,
            acquirer: engine(ACQUIRE_LOCK),
            conn,
        };
        // Warm-up: connections and script caches.
        for kind in KINDS {
            contenders.prepare(kind).await;
            for _ in 0..3 {
                contenders.call(kind).await;
                tokio::time::sleep(cadence).await;
            }
        }
        let mut costs: [Cost; 5] = Default::default();
        let mut inside = [[0u64; INSIDE.len()]; 5];
        for round in 0..rounds {
            for k in 0..KINDS.len() {
                let ki = (k + round) % KINDS.len();
                contenders.prepare(KINDS[ki]).await;
                tokio::time::sleep(cadence).await;
                server.cmd(&["CONFIG", "RESETSTAT"]);
                let mut next = tokio::time::Instant::now();
                for _ in 0..calls {
                    contenders.call(KINDS[ki]).await;
                    next += cadence;
                    tokio::time::sleep_until(next).await;
                }
                let (c, u) = support::command_stats(&server, "evalsha");
                costs[ki].calls += c;
                costs[ki].usec += u;
                costs[ki].per_phase.push(u as f64 / c.max(1) as f64);
                for (i, command) in INSIDE.iter().enumerate() {
                    inside[ki][i] += support::command_stats(&server, command).0;
                }
            }
        }
        if let Some(lease) = contenders.lease.take() {
            contenders.holder.release(&lease).await;
        }
        (costs, inside)
    });
    println!("## Script-cost benchmark\n");
    println!(
        "Machine: {}. One local node, {}; one call every {} ms (ttl {} ms); {rounds} rounds of \
         one phase per kind, {calls} calls a phase; `usec` per call from `INFO commandstats` \
         (`cmdstat_evalsha`) per phase; each kind's figure is its median phase. Run took {:.0} s.\n",
        support::machine(),
        cpu.map_or("unpinned".to_owned(), |c| format!("pinned to CPU {c}")),
        cadence.as_millis(),
        TTL.as_millis(),
        started.elapsed().as_secs_f64()
    );
    println!("| call | calls | µs per call, median phase | mean | commands run inside, per call |");
    println!("|---|---|---|---|---|");
    for ((kind, cost), inside) in KINDS.iter().zip(&costs).zip(&inside) {
        let ran: Vec<String> = INSIDE
            .iter()
            .zip(inside)
            .filter(|(_, n)| **n > 0)
            .map(|(command, n)| format!("{:.2} {command}", *n as f64 / cost.calls.max(1) as f64))
            .collect();
        println!(
            "| {} | {} | {:.1} | {:.1} | {} |",
            kind.name(),
            cost.calls,
            cost.median(),
            cost.mean(),
            ran.join(", ")
        );
    }
    let [renewal, classic, acquire, fenced, lineage] = costs.each_ref().map(Cost::median);
    println!();
    println!(
        "renewal/classic={:.2} ({renewal:.1} µs / {classic:.1} µs; goal ≤ 1.5)",
        renewal / classic
    );
    println!(
        "acquire/classic_fenced={:.2} ({acquire:.1} µs / {fenced:.1} µs; goal ≤ 2; the lineage \
         read alone {lineage:.1} µs, the acquire without it {:.2}×)",
        acquire / fenced,
        (acquire - lineage) / fenced
    );
}

//! Thundering herd at cron time: many `guard --on-busy skip` started at the same instant on
//! one lock, against local `redis-server` nodes.
//!
//! `cargo bench --bench herd`. Prints markdown tables; asserts nothing about timing.
//!
//! Each herd: every node is paused for writes (`CLIENT PAUSE … WRITE`), the guards are
//! started and send their first acquire round, which every node holds; when all rounds are
//! waiting on every node, the nodes are unpaused one right after the other, so each serves
//! the herd in its own order (split votes happen). The winner keeps the lock (`--min-hold`)
//! until every other guard has decided.
//!
//! Reports, over all herds: time to decision per guard (from the unpause to its exit for
//! the guards that skip, to its CMD starting for the winner), p50/p99/max; how many ran CMD;
//! and the Redis commands the herd spent (`INFO commandstats` delta, summed over the
//! nodes), while starting up (before the unpause) and while deciding.
//!
//! Knobs: `REDLOCK_BIN` (another binary), `BENCH_NODES` (3), `BENCH_HERD` (30 guards; 0
//! skips the guard herds), `BENCH_HERDS` (5 herds).
//!
//! **Standbys** (second part, in-process engines of the library, each with its own
//! connections and subscriptions, like one sidecar each): for each S in `BENCH_STANDBYS`
//! (`1,1000`), one holder renewing every ttl/3 and S standbys waiting on one lock (ttl
//! `BENCH_STANDBY_TTL`, default 10 s, the product default), against the same nodes. Prints:
//! - the idle cost over `BENCH_IDLE_SECS` (30): commands per node per second from the
//!   standbys (every command in `INFO commandstats` minus the holder's renewals), how many of
//!   them scripts, and Redis CPU (`used_cpu_sys + used_cpu_user`) per node per second;
//! - `BENCH_WAKEUPS` (20) releases: takeover (release call to a standby holding the lock)
//!   p50/p99, acquire rounds, commands and Redis CPU per wake-up (over the 300 ms after it);
//! - `BENCH_CRASHES` (3) holder crashes (renewals stop, no release): the takeover measured
//!   from the moment the lock became free on the nodes (the quorum-th last key expiry, from
//!   `PTTL` read right after the last renewal), and the commands spent.
//!
//! `BENCH_KEYSPACE=1` sets the nodes' `notify-keyspace-events Kgx` and the engines' `keyspace_events`.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod standbys;
mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::{env_usize, fmt_dur, RedisServer, Samples};

/// Long enough for a node timeout that covers the paused start (see the module doc).
const TTL: Duration = Duration::from_secs(13);

fn binary() -> PathBuf {
    match std::env::var_os("REDLOCK_BIN") {
        Some(bin) => PathBuf::from(bin),
        None => PathBuf::from(env!("CARGO_BIN_EXE_redlock-sidecar")),
    }
}

/// `calls` per command from `INFO commandstats`.
fn command_calls(server: &RedisServer) -> BTreeMap<String, u64> {
    server
        .cmd(&["INFO", "commandstats"])
        .lines()
        .filter_map(|line| {
            let (name, fields) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = fields
                .split(',')
                .find_map(|f| f.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// Calls per command summed over `servers`.
fn calls(servers: &[RedisServer]) -> BTreeMap<String, u64> {
    let mut total = BTreeMap::new();
    for server in servers {
        for (name, n) in command_calls(server) {
            *total.entry(name).or_insert(0) += n;
        }
    }
    total
}

/// `after − before`, without the commands this benchmark sent itself (INFO, CLIENT).
fn delta(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter(|(name, _)| !name.starts_with("client") && name.as_str() != "info")
        .map(|(name, n)| (name.clone(), n - before.get(name).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

fn blocked_clients(server: &RedisServer) -> u64 {
    support::info_field(&server.cmd(&["INFO", "clients"]), "blocked_clients")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

struct Herd {
    decisions: Samples,
    ran: usize,
    startup: BTreeMap<String, u64>,
    deciding: BTreeMap<String, u64>,
}

fn herd(servers: &[RedisServer], size: usize, round: usize) -> Herd {
    let dir = std::env::temp_dir().join(format!("redlock-herd-{}-{round}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let redis: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let redis = redis.join(",");
    let lock = format!("herd-{round}");
    let ttl = format!("{}s", TTL.as_secs());
    let min_hold = format!("{}s", TTL.as_secs() - 1);
    for server in servers {
        server.cmd(&["CLIENT", "PAUSE", "60000", "WRITE"]);
    }
    let before_start = calls(servers);
    let mut guards: Vec<(Child, PathBuf, Option<Duration>)> = (0..size)
        .map(|i| {
            let marker = dir.join(format!("ran-{i}"));
            let child = Command::new(binary())
                .args([
                    "guard",
                    "--lock",
                    &lock,
                    "--redis",
                    &redis,
                    "--ttl",
                    &ttl,
                    "--node-timeout",
                    "3s",
                    "--on-busy",
                    "skip",
                    "--min-hold",
                    &min_hold,
                    "--kubernetes",
                    "off",
                    "--identity",
                ])
                .arg(format!("herd-{i}"))
                .args(["--", "touch"])
                .arg(&marker)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("guard starts");
            (child, marker, None)
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !servers.iter().all(|s| blocked_clients(s) == size as u64) {
        assert!(
            Instant::now() < deadline,
            "the herd's rounds never all arrived"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let before_decide = calls(servers);
    let start = Instant::now();
    for server in servers {
        server.cmd(&["CLIENT", "UNPAUSE"]);
    }
    // Poll every process and marker until each guard decided: exited, or runs CMD.
    while guards.iter().any(|(_, _, decided)| decided.is_none()) {
        for (child, marker, decided) in guards.iter_mut().filter(|g| g.2.is_none()) {
            if marker.exists() || child.try_wait().ok().flatten().is_some() {
                *decided = Some(start.elapsed());
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the herd did not decide"
        );
        std::thread::sleep(Duration::from_micros(500));
    }
    let after = calls(servers);
    let mut result = Herd {
        decisions: Samples::default(),
        ran: 0,
        startup: delta(&before_start, &before_decide),
        deciding: delta(&before_decide, &after),
    };
    for (mut child, marker, decided) in guards {
        result.decisions.push(decided.expect("decided"));
        if marker.exists() {
            result.ran += 1;
        }
        // SAFETY: kill(2) on our own unreaped child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let _ = child.wait();
    }
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn main() {
    let nodes = env_usize("BENCH_NODES", 3);
    // `BENCH_HERD=0` skips the guard herds.
    let size = match std::env::var("BENCH_HERD").as_deref() {
        Ok("0") => 0,
        _ => env_usize("BENCH_HERD", 30),
    };
    let herds = env_usize("BENCH_HERDS", 5);
    let servers = support::start_servers(nodes);
    support::settle(&servers);
    if size > 0 {
        guard_herds(&servers, size, herds);
    }
    standbys::run(&servers);
}

fn guard_herds(servers: &[RedisServer], size: usize, herds: usize) {
    let nodes = servers.len();
    println!("## Thundering herd: {size} guards on one lock, {nodes} nodes, {herds} herds\n");
    println!("{}\n", support::machine());
    let mut decisions = Samples::default();
    let mut startup: BTreeMap<String, u64> = BTreeMap::new();
    let mut deciding: BTreeMap<String, u64> = BTreeMap::new();
    println!("| herd | ran CMD | decision p50 | p99 | max | commands while deciding |");
    println!("|---|---|---|---|---|---|");
    for round in 0..herds {
        let h = herd(servers, size, round);
        println!(
            "| {round} | {} | {} | {} | {} | {} |",
            h.ran,
            fmt_dur(h.decisions.pct(50.0)),
            fmt_dur(h.decisions.pct(99.0)),
            fmt_dur(h.decisions.max()),
            h.deciding.values().sum::<u64>()
        );
        decisions.0.extend(h.decisions.0);
        for (name, n) in h.startup {
            *startup.entry(name).or_insert(0) += n;
        }
        for (name, n) in h.deciding {
            *deciding.entry(name).or_insert(0) += n;
        }
    }
    println!(
        "\nTime to decision over all {} guards: p50 {}, p99 {}, max {}.\n",
        decisions.len(),
        fmt_dur(decisions.pct(50.0)),
        fmt_dur(decisions.pct(99.0)),
        fmt_dur(decisions.max())
    );
    println!("Redis commands per herd (all nodes), by command:\n");
    println!("| command | starting up | deciding |");
    println!("|---|---|---|");
    let names: std::collections::BTreeSet<&String> =
        startup.keys().chain(deciding.keys()).collect();
    for name in names {
        let per =
            |m: &BTreeMap<String, u64>| m.get(name).copied().unwrap_or(0) as f64 / herds as f64;
        println!("| {name} | {:.1} | {:.1} |", per(&startup), per(&deciding));
    }
    let total = |m: &BTreeMap<String, u64>| m.values().sum::<u64>() as f64 / herds as f64;
    println!(
        "| **total** | {:.1} | {:.1} |",
        total(&startup),
        total(&deciding)
    );
}

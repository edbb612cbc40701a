//! Shards benchmark (`run --shards N`): how fast a group rebalances and what it costs the
//! nodes, through the real binary on local `redis-server`s.
//!
//! `cargo bench --bench shards`. Prints markdown tables; it is not a timed test.
//!
//! 1. **Moves**, on `BENCH_SHARDS` (64) shards over `BENCH_MEMBERS` (4) members, ttl 2 s,
//!    `BENCH_ROUNDS` (10) rounds of: SIGTERM the newest member, then start a new one.
//!    - leave: from the SIGTERM to every one of the leaver's shards owned by another member;
//!    - join: from the joiner's first answer of `GET /v1/shards` to a balanced split (every
//!      member at ⌊N/k⌋ or ⌈N/k⌉, every shard owned);
//!    - shards that changed owner per leave and per join, against the least possible (the
//!      leaver's shards; the joiner's share).
//! 2. **A rolling update** (maxSurge 1) of `BENCH_MEMBERS` members on `BENCH_SHARDS` shards: a
//!    new member starts and the group balances, then an old one gets SIGTERM and the group
//!    balances, until every old member is gone. Each member's takes are counted from its log
//!    (`shard taken`), so no move is missed between two polls: moves per shard (the goal: at
//!    most two), against the least (every shard moves once).
//! 3. **Requests per node at steady state**, for N = 1,024 and 4,096 over `BENCH_STEADY_MEMBERS`
//!    (16) members, ttl 6 s (renew interval 2 s): once balanced, `INFO commandstats` over
//!    `BENCH_STEADY_SECS` (10) s on each node, first with the same members without
//!    `--shards` (the baseline: the leadership lock's renewal, the standbys' reads). Scripts
//!    (`EVALSHA`/`EVAL`) are requests; the commands a script runs inside are not. The goal:
//!    each member sends each node at most two requests per renew interval for its shards (one
//!    cycle, one renewal batch), whatever N. `BENCH_LOGS=DIR` keeps the members' debug logs.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::{env_usize, fmt_dur, free_port, RedisServer, Samples};

fn binary() -> PathBuf {
    std::env::var_os("REDLOCK_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_redlock-sidecar")))
}

/// One member: a `run --shards` child.
struct Member {
    child: Child,
    control: String,
    name: String,
}

impl Member {
    fn start(name: &str, urls: &str, shards: usize, ttl: &str) -> Member {
        let log = std::env::var_os("BENCH_LOGS")
            .map(|dir| PathBuf::from(dir).join(format!("{name}.log")));
        Member::start_logging(name, urls, shards, ttl, log)
    }

    /// [`Member::start`], its log (debug level) written to `log`.
    fn start_logging(
        name: &str,
        urls: &str,
        shards: usize,
        ttl: &str,
        log: Option<PathBuf>,
    ) -> Member {
        let control = format!("127.0.0.1:{}", free_port());
        let admin = format!("127.0.0.1:{}", free_port());
        let child = Command::new(binary())
            .args(["run", "--lock", "bench-shards", "--redis", urls])
            .args(["--node-set", "bench", "--identity", name])
            .args(["--kubernetes", "off", "--ttl", ttl])
            .args(if shards == 0 {
                Vec::new()
            } else {
                vec!["--shards".to_owned(), shards.to_string()]
            })
            .args(["--listen", &admin, "--control-listen", &control])
            .stdout(Stdio::null())
            .stderr(match log {
                Some(path) => {
                    std::fs::File::create(path).map_or_else(|_| Stdio::null(), Stdio::from)
                }
                None => Stdio::null(),
            })
            .env("REDLOCK_LOG", "debug")
            .spawn()
            .expect("the sidecar binary runs");
        Member {
            child,
            control,
            name: name.to_owned(),
        }
    }

    /// The shards it holds, or `None` while it does not answer.
    fn owned(&self) -> Option<Vec<u64>> {
        let mut stream = TcpStream::connect(&self.control).ok()?;
        stream.set_nodelay(true).ok()?;
        let request = "GET /v1/shards HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
        stream.write_all(request.as_bytes()).ok()?;
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader.read_line(&mut line).ok()?;
        if !line.contains(" 200 ") {
            return None;
        }
        let mut rest = String::new();
        reader.read_to_string(&mut rest).ok()?;
        let body = rest.split("\r\n\r\n").nth(1)?;
        let json: serde_json::Value = serde_json::from_str(body).ok()?;
        Some(
            json["owned"]
                .as_array()?
                .iter()
                .filter_map(|s| s["shard"].as_u64())
                .collect(),
        )
    }

    fn sigterm(&self) {
        // SAFETY: signalling our own child by its pid.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
    }

    /// SIGTERM, then waits for the exit (its shards handed over).
    fn stop(mut self) {
        self.sigterm();
        let _ = self.child.wait();
    }
}

/// The shards a member's log says it took (`shard taken ... shard=ID`), in order.
fn takes_in_log(log: &std::path::Path) -> Vec<u64> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter(|line| line.contains("shard taken"))
        .filter_map(|line| {
            let at = line.find("shard=")? + "shard=".len();
            let digits: String = line[at..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse().ok()
        })
        .collect()
}

fn rollout(urls: &str) {
    let shards = env_usize("BENCH_SHARDS", 64);
    let k = env_usize("BENCH_MEMBERS", 4);
    let dir = std::env::temp_dir().join(format!("redlock-bench-rollout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory for the members' logs");
    let log = |name: &str| dir.join(format!("{name}.log"));
    let limit = Duration::from_secs(60);
    let every = Duration::from_millis(2);
    let mut members: Vec<Member> = (0..k)
        .map(|i| {
            let name = format!("old-{i}");
            Member::start_logging(&name, urls, shards, "2s", Some(log(&name)))
        })
        .collect();
    poll(limit, every, || balanced(&members, shards));
    // The first split is no move: each member's takes so far.
    let first: Vec<usize> = (0..k)
        .map(|i| takes_in_log(&log(&format!("old-{i}"))).len())
        .collect();
    let started = Instant::now();
    for i in 0..k {
        let name = format!("new-{i}");
        members.push(Member::start_logging(
            &name,
            urls,
            shards,
            "2s",
            Some(log(&name)),
        ));
        poll(limit, every, || balanced(&members, shards));
        let old = members.remove(0);
        old.stop();
        poll(limit, every, || balanced(&members, shards));
    }
    let took = started.elapsed();
    drop(members);
    let mut moves = vec![0usize; shards];
    for (i, first) in first.into_iter().enumerate() {
        let old = takes_in_log(&log(&format!("old-{i}")));
        let new = takes_in_log(&log(&format!("new-{i}")));
        for shard in old.into_iter().skip(first).chain(new) {
            moves[shard as usize] += 1;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let most = moves.iter().max().copied().unwrap_or(0);
    let total: usize = moves.iter().sum();
    let histogram: Vec<String> = (0..=most)
        .map(|m| format!("{m}: {}", moves.iter().filter(|x| **x == m).count()))
        .collect();
    println!("\n### Rolling update, maxSurge 1 ({shards} shards, {k} members, ttl 2 s)\n");
    println!("| what | figure |");
    println!("|---|---:|");
    println!("| most moves of one shard (goal ≤ 2) | {most} |");
    println!("| shards by moves | {} |", histogram.join(", "));
    println!("| moves in all (least: {shards}, each shard once) | {total} |");
    println!(
        "| rollout ({k} joins and {k} leaves, each balanced) | {:.1} s |",
        took.as_secs_f64()
    );
    println!("\nshards_rollout most {most} total {total} least {shards}");
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Shard → owner (member index) across `members`, if every member answers.
fn ownership(members: &[Member]) -> Option<BTreeMap<u64, usize>> {
    let mut all = BTreeMap::new();
    for (index, member) in members.iter().enumerate() {
        for shard in member.owned()? {
            all.insert(shard, index);
        }
    }
    Some(all)
}

/// Whether `members` split `shards` evenly: every shard owned, each at ⌊N/k⌋ or ⌈N/k⌉.
fn balanced(members: &[Member], shards: usize) -> Option<BTreeMap<u64, usize>> {
    let owners = ownership(members)?;
    let k = members.len();
    let counts: Vec<usize> = (0..k)
        .map(|i| owners.values().filter(|o| **o == i).count())
        .collect();
    let even = counts
        .iter()
        .all(|c| *c == shards / k || *c == shards.div_ceil(k));
    (owners.len() == shards && even).then_some(owners)
}

/// Polls every `every` until `check` gives a value, for at most `limit`.
fn poll<T>(limit: Duration, every: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(start.elapsed() < limit, "not within {limit:?}");
        std::thread::sleep(every);
    }
}

/// Shards whose owner differs between `before` and `after` (by identity).
fn moved(
    before: &BTreeMap<u64, usize>,
    before_names: &[String],
    after: &BTreeMap<u64, usize>,
    after_names: &[String],
) -> usize {
    before
        .iter()
        .filter(|(shard, owner)| {
            after.get(shard).map(|o| &after_names[*o]) != Some(&before_names[**owner])
        })
        .count()
}

fn moves(urls: &str) {
    let shards = env_usize("BENCH_SHARDS", 64);
    let k = env_usize("BENCH_MEMBERS", 4);
    let rounds = env_usize("BENCH_ROUNDS", 10);
    let mut members: Vec<Member> = (0..k)
        .map(|i| Member::start(&format!("member-{i}"), urls, shards, "2s"))
        .collect();
    let (mut leaves, mut joins) = (Samples::default(), Samples::default());
    let (mut leave_moves, mut leave_least) = (0, 0);
    let (mut join_moves, mut join_least) = (0, 0);
    let limit = Duration::from_secs(60);
    let every = Duration::from_millis(2);
    for round in 0..rounds {
        let before = poll(limit, every, || balanced(&members, shards));
        let names: Vec<String> = members.iter().map(|m| m.name.clone()).collect();
        let leaver = members.pop().expect("a member");
        let its = before.values().filter(|o| **o == k - 1).count();
        let sent = Instant::now();
        leaver.sigterm();
        let after = poll(limit, Duration::from_micros(500), || {
            let owners = ownership(&members)?;
            (owners.len() == shards).then_some(owners)
        });
        leaves.push(sent.elapsed());
        let after_names: Vec<String> = members.iter().map(|m| m.name.clone()).collect();
        leave_moves += moved(&before, &names, &after, &after_names);
        leave_least += its;
        drop(leaver);

        let settled = poll(limit, every, || balanced(&members, shards));
        let settled_names: Vec<String> = members.iter().map(|m| m.name.clone()).collect();
        let joiner = Member::start(&format!("joiner-{round}"), urls, shards, "2s");
        let first = poll(limit, Duration::from_micros(500), || joiner.owned());
        let answered = Instant::now();
        let _ = first;
        members.push(joiner);
        let joined = poll(limit, Duration::from_micros(500), || {
            balanced(&members, shards)
        });
        joins.push(answered.elapsed());
        let joined_names: Vec<String> = members.iter().map(|m| m.name.clone()).collect();
        join_moves += moved(&settled, &settled_names, &joined, &joined_names);
        join_least += joined.values().filter(|o| **o == k - 1).count();
    }
    println!("### Leaves and joins ({shards} shards, {k} members, ttl 2 s, {rounds} rounds)\n");
    println!("| what | p50 | p99 | max | shards moved | least possible |");
    println!("|---|---:|---:|---:|---:|---:|");
    println!(
        "| leave: SIGTERM → every shard of the leaver owned elsewhere | {} | {} | {} | {leave_moves} | {leave_least} |",
        fmt_dur(leaves.pct(50.0)),
        fmt_dur(leaves.pct(99.0)),
        fmt_dur(leaves.max())
    );
    println!(
        "| join: first answer → balanced | {} | {} | {} | {join_moves} | {join_least} |",
        fmt_dur(joins.pct(50.0)),
        fmt_dur(joins.pct(99.0)),
        fmt_dur(joins.max())
    );
    println!(
        "\nshards_moves leave {leave_moves} (least {leave_least}) join {join_moves} (least {join_least}); leave p50 {} p99 {}; join p50 {} p99 {}",
        fmt_dur(leaves.pct(50.0)),
        fmt_dur(leaves.pct(99.0)),
        fmt_dur(joins.pct(50.0)),
        fmt_dur(joins.pct(99.0))
    );
}

/// Scripts (`EVALSHA` and `EVAL`) and all commands `server` ran so far.
fn scripts_and_commands(server: &RedisServer) -> (u64, u64) {
    let stats = server.cmd(&["INFO", "commandstats"]);
    let calls = |prefix: &str| -> u64 {
        stats
            .lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| {
                l.split_once("calls=")?
                    .1
                    .split(',')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum()
    };
    (
        calls("cmdstat_evalsha:") + calls("cmdstat_eval:"),
        calls("cmdstat_"),
    )
}

/// Scripts and all commands per node per second over `secs`, averaged over `servers`.
fn rates(servers: &[RedisServer], secs: u64) -> (f64, f64) {
    let before: Vec<(u64, u64)> = servers.iter().map(scripts_and_commands).collect();
    std::thread::sleep(Duration::from_secs(secs));
    let after: Vec<(u64, u64)> = servers.iter().map(scripts_and_commands).collect();
    let per = |pick: fn(&(u64, u64)) -> u64| {
        before
            .iter()
            .zip(&after)
            .map(|(b, a)| (pick(a) - pick(b)) as f64)
            .sum::<f64>()
            / servers.len() as f64
            / secs as f64
    };
    (per(|c| c.0), per(|c| c.1))
}

fn steady(servers: &[RedisServer], urls: &str) {
    let k = env_usize("BENCH_STEADY_MEMBERS", 16);
    let secs = env_usize("BENCH_STEADY_SECS", 10) as u64;
    let renew = Duration::from_secs(2);
    println!("\n### Requests per node at steady state ({k} members, ttl 6 s, renew interval {renew:?}, {secs} s)\n");
    println!("The same members without `--shards` first: their scripts (the leadership lock's renewal and the standbys' reads) are the baseline; the shards' part is the rest.\n");
    println!("| N | scripts / node / s | the shards' part, per member per renew interval | all commands / node / s (inside scripts too) | goal |");
    println!("|---:|---:|---:|---:|---|");
    let mut baseline = 0.0;
    for shards in [0, 1024, 4096] {
        let members: Vec<Member> = (0..k)
            .map(|i| Member::start(&format!("steady-{i}"), urls, shards, "6s"))
            .collect();
        if shards == 0 {
            std::thread::sleep(renew * 3);
        } else {
            poll(Duration::from_secs(300), Duration::from_millis(200), || {
                balanced(&members, shards)
            });
            // A cycle to settle the renewals into step.
            std::thread::sleep(renew * 2);
        }
        let (scripts, commands) = rates(servers, secs);
        if shards == 0 {
            baseline = scripts;
            println!("| none | {scripts:.1} | | {commands:.0} | |");
            continue;
        }
        let per_member = (scripts - baseline) * renew.as_secs_f64() / k as f64;
        println!(
            "| {shards} | {scripts:.1} | {per_member:.2} | {commands:.0} | ≤ 2: {} |",
            if per_member <= 2.0 { "met" } else { "NOT met" }
        );
        println!(
            "shards_requests_per_node n={shards} members={k} scripts_per_node_per_s {scripts:.1} (without shards {baseline:.1}) shards_per_member_per_interval {per_member:.2} (goal ≤ 2)"
        );
        drop(members);
    }
}

fn main() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    support::settle(&servers);
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let urls = urls.join(",");
    println!("## Shards benchmark\n\nMachine: {}.\n", support::machine());
    let started = Instant::now();
    moves(&urls);
    rollout(&urls);
    steady(&servers, &urls);
    println!("\nWhole run: {:.0} s.", started.elapsed().as_secs_f64());
}

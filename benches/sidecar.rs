//! Sidecar benchmark: the real `redlock-sidecar` binary against local `redis-server` nodes.
//!
//! `cargo bench --bench sidecar` (Cargo builds the binary first, into `target/release`).
//! Prints markdown tables.
//!
//! Measures: startup to first acquisition; an idle leader and an idle standby (resident
//! memory, CPU, Redis commands per node per second, attributed to each process through its
//! sockets and `MONITOR`); hand-off after SIGTERM (SIGTERM to the leader → the standby's
//! `/leader/watch` reports it leads); takeover after SIGKILL, against the key's remaining ttl.
//!
//! Knobs (environment):
//! - `REDLOCK_BIN`: another binary to measure (default: the one Cargo just built).
//! - `BENCH_NODES` (default 3), `BENCH_IDLE_SECS` (60), `BENCH_HANDOFFS` (100),
//!   `BENCH_KILLS` (5), `BENCH_STARTUPS` (10).
//! - `BENCH_SIDECAR_LOGS=1` shows the sidecars' logs.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

/// The engine's Lua scripts, only to name the SHA1s seen in `MONITOR`.
#[allow(dead_code)]
#[path = "../src/redlock/scripts.rs"]
mod scripts;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use rand::Rng;
use support::{env_usize, fmt_dur, RedisServer, Samples};

const LOCK: &str = "bench-sidecar";
const TTL: Duration = Duration::from_secs(2);
const TTL_FLAG: &str = "2s";
const SAFETY_MARGIN_FLAG: &str = "300ms";

fn binary() -> PathBuf {
    if let Some(bin) = std::env::var_os("REDLOCK_BIN") {
        return PathBuf::from(bin);
    }
    // Cargo builds the crate's binaries (same profile) before a benchmark and names them here.
    PathBuf::from(env!("CARGO_BIN_EXE_redlock-sidecar"))
}

/// Warns when the binary is older than the newest source file.
fn check_fresh(bin: &PathBuf) {
    let Ok(built) = std::fs::metadata(bin).and_then(|m| m.modified()) else {
        panic!(
            "{} not found: build it (`cargo build --release`) or fix REDLOCK_BIN",
            bin.display()
        );
    };
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let newest = newest_mtime(&src);
    if newest.is_some_and(|t| t > built) {
        eprintln!(
            "warning: {} is older than the sources; rebuild it (`cargo build --release`)",
            bin.display()
        );
    }
}

fn newest_mtime(dir: &PathBuf) -> Option<SystemTime> {
    let mut newest = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let t = if path.is_dir() {
            newest_mtime(&path)
        } else {
            entry.metadata().and_then(|m| m.modified()).ok()
        };
        newest = newest.max(t);
    }
    newest
}

/// One `redlock-sidecar run` child process.
struct Sidecar {
    child: Child,
    port: u16,
    exited: bool,
    /// Its stderr (info-level logs), shown when a measurement looks wrong; removed on drop.
    log: Option<PathBuf>,
}

impl Sidecar {
    fn spawn(bin: &PathBuf, urls: &str, identity: &str) -> Sidecar {
        let port = support::free_port();
        let logs = std::env::var_os("BENCH_SIDECAR_LOGS").is_some();
        let log = (!logs).then(|| {
            std::env::temp_dir().join(format!(
                "redlock-bench-{}-{identity}.log",
                std::process::id()
            ))
        });
        let stderr = match &log {
            Some(path) => Stdio::from(std::fs::File::create(path).expect("a log file")),
            None => Stdio::inherit(),
        };
        let child = Command::new(bin)
            .args([
                "run",
                "--control-listen",
                "127.0.0.1:0",
                "--lock",
                LOCK,
                "--redis",
                urls,
                "--ttl",
                TTL_FLAG,
                "--safety-margin",
                SAFETY_MARGIN_FLAG,
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--identity",
                identity,
                "--kubernetes",
                "off",
            ])
            .env("REDLOCK_LOG", "info")
            .stdin(Stdio::null())
            .stdout(if logs {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        Sidecar {
            child,
            port,
            exited: false,
            log,
        }
    }

    /// Its log so far (empty with `BENCH_SIDECAR_LOGS`, which shows logs as they come).
    fn log_text(&self) -> String {
        self.log
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn signal(&self, sig: i32) {
        // SAFETY: plain kill(2) on our own child, which has not been reaped yet.
        let rc = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(rc, 0, "kill({}, {sig}) failed", self.pid());
    }

    /// Waits for the process to exit (reaping it); `true` when it exited by itself (after a
    /// graceful shutdown) rather than being ended by a signal's default action.
    fn wait(&mut self) -> bool {
        if self.exited {
            return true;
        }
        self.exited = true;
        self.child
            .wait()
            .is_ok_and(|status| std::os::unix::process::ExitStatusExt::signal(&status).is_none())
    }

    fn stop(&mut self) {
        if !self.exited {
            self.signal(libc::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if matches!(self.child.try_wait(), Ok(Some(_))) {
                    self.exited = true;
                    return;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// utime + stime in clock ticks.
    fn cpu_ticks(&self) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).expect("stat");
        let after_comm = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after_comm.split_whitespace().collect();
        // Fields 14 and 15 of stat(5); `fields[0]` is field 3.
        fields[11].parse::<u64>().unwrap_or(0) + fields[12].parse::<u64>().unwrap_or(0)
    }

    /// A `VmRSS`-style field of /proc/PID/status, in KiB.
    fn status_kib(&self, field: &str) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("status");
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|rest| rest.trim_start_matches(':').split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// Local ports of this process' TCP sockets (its Redis connections among them).
    fn local_ports(&self) -> HashSet<u16> {
        let mut inodes = HashSet::new();
        if let Ok(fds) = std::fs::read_dir(format!("/proc/{}/fd", self.pid())) {
            for fd in fds.flatten() {
                if let Ok(target) = std::fs::read_link(fd.path()) {
                    let t = target.to_string_lossy();
                    if let Some(inode) =
                        t.strip_prefix("socket:[").and_then(|s| s.strip_suffix(']'))
                    {
                        inodes.insert(inode.to_owned());
                    }
                }
            }
        }
        let mut ports = HashSet::new();
        for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
            let Ok(text) = std::fs::read_to_string(table) else {
                continue;
            };
            for line in text.lines().skip(1) {
                let cols: Vec<&str> = line.split_whitespace().collect();
                if cols.len() > 9 && inodes.contains(cols[9]) {
                    if let Some(port) = cols[1]
                        .rsplit_once(':')
                        .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
                    {
                        ports.insert(port);
                    }
                }
            }
        }
        ports
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if !self.exited {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if let Some(log) = &self.log {
            let _ = std::fs::remove_file(log);
        }
    }
}

fn clock_ticks_per_sec() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

/// A `GET /leader/watch` server-sent-event stream, read raw.
struct Watch {
    stream: TcpStream,
    buf: Vec<u8>,
    seen: usize,
}

impl Watch {
    /// Connects (retrying every millisecond until the port is bound) and sends the request.
    fn connect(port: u16, deadline: Instant) -> Result<Watch, String> {
        let stream = loop {
            match TcpStream::connect((Ipv4Addr::LOCALHOST, port)) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => return Err(format!("connect: {e}")),
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
        };
        let _ = stream.set_nodelay(true);
        let mut w = Watch {
            stream,
            buf: Vec::new(),
            seen: 0,
        };
        w.stream
            .write_all(
                b"GET /leader/watch HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n",
            )
            .map_err(|e| e.to_string())?;
        Ok(w)
    }

    /// Reads until `needle` appears in data not yet matched; the moment it was read.
    fn wait_for(&mut self, needle: &str, deadline: Instant) -> Result<Instant, String> {
        let needle = needle.as_bytes();
        let mut chunk = [0u8; 8192];
        loop {
            if let Some(pos) = self.buf[self.seen..]
                .windows(needle.len())
                .position(|w| w == needle)
            {
                let at = Instant::now();
                self.seen += pos + needle.len();
                return Ok(at);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "no {:?} before the deadline",
                    String::from_utf8_lossy(needle)
                ));
            }
            self.stream
                .set_read_timeout(Some(left))
                .map_err(|e| e.to_string())?;
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err("stream closed".into()),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    }
}

const LEADING: &str = "\"is_leader\":true";
const FOLLOWING: &str = "\"is_leader\":false";

/// The status code of `GET path`.
fn http_status(port: u16, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).ok()?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// `MONITOR` on one node in a thread: commands counted by client port and command name.
struct Monitor {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<HashMap<(u16, String), u64>>,
}

impl Monitor {
    fn start(port: u16) -> Monitor {
        let stop = Arc::new(AtomicBool::new(false));
        let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).expect("monitor connect");
        stream
            .write_all(&support::encode_command(&["MONITOR"]))
            .expect("MONITOR");
        stream
            .set_read_timeout(Some(Duration::from_millis(100)))
            .expect("timeout");
        let mut reader = BufReader::new(stream);
        let mut ok = String::new();
        while ok.is_empty() {
            let _ = reader.read_line(&mut ok);
        }
        assert!(ok.starts_with("+OK"), "MONITOR answered {ok:?}");
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut counts: HashMap<(u16, String), u64> = HashMap::new();
            let mut line = String::new();
            while !flag.load(Ordering::Relaxed) {
                match reader.read_line(&mut line) {
                    Ok(0) => break,
                    Ok(_) if line.ends_with('\n') => {
                        // +1700000000.123456 [0 127.0.0.1:54321] "EVALSHA" "..." ...
                        let client = line
                            .split_once('[')
                            .and_then(|(_, r)| r.split_once(']'))
                            .map(|(c, _)| c.to_owned());
                        let mut quoted = line.split('"').skip(1).step_by(2);
                        let mut command = quoted
                            .next()
                            .map(|c| c.to_ascii_uppercase())
                            .unwrap_or_default();
                        if command == "EVALSHA" {
                            if let Some(sha) = quoted.next() {
                                command = script_name(sha);
                            }
                        }
                        // Commands run by Lua scripts show as `[0 lua]`: not sent by a client.
                        if let Some(client_port) = client
                            .as_deref()
                            .and_then(|c| c.rsplit_once(':'))
                            .and_then(|(_, p)| p.parse::<u16>().ok())
                        {
                            *counts.entry((client_port, command)).or_default() += 1;
                        }
                        line.clear();
                    }
                    Ok(_) => {}
                    Err(_) => {} // read timeout: check the flag; a partial line stays in `line`
                }
            }
            counts
        });
        Monitor { stop, thread }
    }

    fn finish(self) -> HashMap<(u16, String), u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("monitor thread")
    }
}

/// `EVALSHA <engine script name>` for the engine's scripts, else `EVALSHA <sha>`.
fn script_name(sha: &str) -> String {
    let known = [
        ("ACQUIRE", scripts::ACQUIRE),
        ("RAISE_FENCE", scripts::RAISE_FENCE),
        ("EXTEND", scripts::EXTEND),
        ("RESTORE", scripts::RESTORE),
        ("RELEASE", scripts::RELEASE),
        ("READ", scripts::READ),
    ];
    known
        .iter()
        .find(|(_, code)| redis::Script::new(code).get_hash() == sha)
        .map_or_else(
            || format!("EVALSHA {sha}"),
            |(name, _)| format!("EVALSHA {name}"),
        )
}

/// Waits until every node has `count` subscribers on the lock's release channel.
fn wait_subscribers(servers: &[RedisServer], count: usize) {
    let channel = format!("redlock:{{{LOCK}}}:released");
    let deadline = Instant::now() + Duration::from_secs(5);
    for s in servers {
        loop {
            let reply = s.cmd(&["PUBSUB", "NUMSUB", &channel]);
            let n: usize = reply
                .lines()
                .nth(1)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            if n == count {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "node {}: {n} subscribers on the release channel, expected {count}",
                s.port
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// Remaining ttl of the lock key on each node (ms; negative when absent).
fn key_pttls(servers: &[RedisServer]) -> Vec<i64> {
    let key = format!("redlock:{{{LOCK}}}");
    servers
        .iter()
        .map(|s| s.cmd(&["PTTL", &key]).parse().unwrap_or(-2))
        .collect()
}

struct IdleReport {
    rss_kib: [u64; 2],
    hwm_kib: [u64; 2],
    /// utime + stime over the window, % of one core.
    cpu_pct: [f64; 2],
    /// On-CPU time of all threads from `schedstat` (nanosecond resolution), % of one core.
    sched_pct: [f64; 2],
    per_node: Vec<NodeTraffic>,
    secs: f64,
}

/// Commands per second one node received from each process, and what they were.
struct NodeTraffic {
    rate: [f64; 2],
    names: [String; 2],
    /// From clients that are neither sidecar (should be 0).
    others: f64,
}

/// Nanoseconds on CPU, summed over the process' threads.
fn sched_ns(pid: i32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

fn idle(servers: &[RedisServer], leader: &Sidecar, standby: &Sidecar, secs: u64) -> IdleReport {
    let procs = [leader, standby];
    let monitors: Vec<Monitor> = servers.iter().map(|s| Monitor::start(s.port)).collect();
    let ports_before = procs.map(Sidecar::local_ports);
    let ticks_before = procs.map(Sidecar::cpu_ticks);
    let sched_before = procs.map(|p| sched_ns(p.pid()));
    let start = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    let ticks_after = procs.map(Sidecar::cpu_ticks);
    let sched_after = procs.map(|p| sched_ns(p.pid()));
    let elapsed = start.elapsed().as_secs_f64();
    let counts: Vec<_> = monitors.into_iter().map(Monitor::finish).collect();
    let ports_after = procs.map(Sidecar::local_ports);
    let ports: Vec<HashSet<u16>> = (0..2)
        .map(|i| ports_before[i].union(&ports_after[i]).copied().collect())
        .collect();
    let hz = clock_ticks_per_sec();
    let per_node = counts
        .iter()
        .map(|c| {
            let mut sums = [0u64; 2];
            let mut others = 0u64;
            let mut names: [HashMap<&str, u64>; 2] = Default::default();
            for ((port, cmd), n) in c {
                match ports.iter().position(|p| p.contains(port)) {
                    Some(i) => {
                        sums[i] += n;
                        *names[i].entry(cmd.as_str()).or_default() += n;
                    }
                    None => others += n,
                }
            }
            let names = names.map(|m| {
                let mut v: Vec<String> = m
                    .iter()
                    .map(|(cmd, n)| format!("{cmd} ×{:.2}/s", *n as f64 / elapsed))
                    .collect();
                v.sort();
                v.join(", ")
            });
            NodeTraffic {
                rate: sums.map(|n| n as f64 / elapsed),
                names,
                others: others as f64 / elapsed,
            }
        })
        .collect();
    IdleReport {
        rss_kib: procs.map(|p| p.status_kib("VmRSS")),
        hwm_kib: procs.map(|p| p.status_kib("VmHWM")),
        cpu_pct: [0, 1].map(|i| (ticks_after[i] - ticks_before[i]) as f64 / hz / elapsed * 100.0),
        sched_pct: [0, 1]
            .map(|i| sched_after[i].saturating_sub(sched_before[i]) as f64 / 1e9 / elapsed * 100.0),
        per_node,
        secs: elapsed,
    }
}

/// Spawns a sidecar and waits until its watch stream reports `needle`; returns it with
/// (time to HTTP up, time to `needle`).
fn spawn_until(
    bin: &PathBuf,
    urls: &str,
    identity: &str,
    needle: &str,
) -> Result<(Sidecar, Duration, Duration), String> {
    let t0 = Instant::now();
    let sidecar = Sidecar::spawn(bin, urls, identity);
    let deadline = t0 + Duration::from_secs(10);
    let mut watch = Watch::connect(sidecar.port, deadline)?;
    let http_up = t0.elapsed();
    let at = watch.wait_for(needle, deadline)?;
    Ok((sidecar, http_up, at.duration_since(t0)))
}

fn main() {
    let nodes = env_usize("BENCH_NODES", 3);
    let idle_secs = env_usize("BENCH_IDLE_SECS", 60) as u64;
    let handoffs = env_usize("BENCH_HANDOFFS", 100);
    let kills = env_usize("BENCH_KILLS", 5);
    let startups = env_usize("BENCH_STARTUPS", 10);
    let bin = binary();
    check_fresh(&bin);

    let servers = support::start_servers(nodes);
    let urls = servers
        .iter()
        .map(RedisServer::url)
        .collect::<Vec<_>>()
        .join(",");
    support::settle(&servers);
    let started = Instant::now();
    eprintln!("sidecar bench: {nodes} nodes up and old enough; measuring startup");

    // 1. Startup to first acquisition, nobody else contending.
    let mut startup = Samples::default();
    let mut http_up = Samples::default();
    let mut shutdown = Samples::default();
    let mut previous_log = String::new();
    // Leaders that a SIGTERM right after their first acquisition ended by the default action
    // (no graceful release): the signal came before the sidecar had installed its handler.
    let mut startup_sigterm_unhandled = 0;
    for i in 0..startups {
        let before = key_pttls(&servers);
        let holder = servers[0].cmd(&["GET", &format!("redlock:{{{LOCK}}}")]);
        let (mut s, up, lead) =
            spawn_until(&bin, &urls, &format!("start-{i}"), LEADING).expect("startup");
        http_up.push(up);
        startup.push(lead);
        let t = Instant::now();
        s.signal(libc::SIGTERM);
        if !s.wait() {
            startup_sigterm_unhandled += 1;
        }
        shutdown.push(t.elapsed());
        if lead > Duration::from_millis(500) {
            eprintln!(
                "slow startup #{i}: {lead:?}; before the spawn: lock key PTTL per node {before:?}, \
                 value {holder:?}\n--- this process:\n{}--- the one before:\n{previous_log}",
                s.log_text()
            );
        }
        previous_log = s.log_text();
    }

    // 2. Idle leader and standby.
    eprintln!("sidecar bench: idle leader and standby for {idle_secs} s");
    let (mut leader, _, _) = spawn_until(&bin, &urls, "pod-0", LEADING).expect("leader");
    let (mut standby, _, _) = spawn_until(&bin, &urls, "pod-1", FOLLOWING).expect("standby");
    wait_subscribers(&servers, 2);
    // Let the standby's retry delay grow to its steady state.
    std::thread::sleep(Duration::from_secs(3));
    let idle = idle(&servers, &leader, &standby, idle_secs);

    // 3. Hand-off after SIGTERM; the old leader is replaced by a fresh standby each time.
    eprintln!("sidecar bench: {handoffs} hand-offs after SIGTERM");
    let mut handoff = Samples::default();
    let mut handoff_errors = 0;
    let mut leader_exit = Samples::default();
    let mut handoff_sigterm_unhandled = 0;
    let mut next_id = 2;
    for _ in 0..handoffs {
        wait_subscribers(&servers, 2);
        std::thread::sleep(Duration::from_millis(rand::rng().random_range(100..400)));
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut watch = Watch::connect(standby.port, deadline).expect("watch the standby");
        watch
            .wait_for(FOLLOWING, deadline)
            .expect("the standby follows");
        let t0 = Instant::now();
        leader.signal(libc::SIGTERM);
        match watch.wait_for(LEADING, t0 + Duration::from_secs(5)) {
            Ok(at) => {
                handoff.push(at.duration_since(t0));
                if http_status(standby.port, "/leader") != Some(200) {
                    eprintln!("warning: watch said leading but GET /leader is not 200");
                }
            }
            Err(e) => {
                eprintln!("hand-off: {e}");
                handoff_errors += 1;
            }
        }
        if !leader.wait() {
            handoff_sigterm_unhandled += 1;
        }
        leader_exit.push(t0.elapsed());
        if handoff
            .0
            .last()
            .is_some_and(|d| *d > Duration::from_millis(20))
        {
            eprintln!(
                "slow hand-off: {:?}\n--- old leader:\n{}--- standby:\n{}",
                handoff.0.last(),
                leader.log_text(),
                standby.log_text()
            );
        }
        let (fresh, _, _) =
            spawn_until(&bin, &urls, &format!("pod-{next_id}"), FOLLOWING).expect("fresh standby");
        next_id += 1;
        leader = std::mem::replace(&mut standby, fresh);
    }

    // 4. Takeover after SIGKILL: the key must expire first.
    eprintln!("sidecar bench: {kills} takeovers after SIGKILL");
    let quorum = nodes / 2 + 1;
    let mut takeover = Samples::default();
    let mut expiry = Samples::default();
    let mut overshoot = Samples::default();
    for _ in 0..kills {
        wait_subscribers(&servers, 2);
        std::thread::sleep(Duration::from_millis(rand::rng().random_range(100..800)));
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut watch = Watch::connect(standby.port, deadline).expect("watch the standby");
        watch
            .wait_for(FOLLOWING, deadline)
            .expect("the standby follows");
        let mut pttls = key_pttls(&servers);
        let t0 = Instant::now();
        leader.signal(libc::SIGKILL);
        pttls.sort_unstable();
        // The standby can win once a quorum of nodes has let the key expire.
        let expires_in = Duration::from_millis(pttls[quorum - 1].max(0) as u64);
        match watch.wait_for(LEADING, t0 + TTL * 3) {
            Ok(at) => {
                let took = at.duration_since(t0);
                takeover.push(took);
                expiry.push(expires_in);
                overshoot.push(took.saturating_sub(expires_in));
            }
            Err(e) => eprintln!("takeover: {e}"),
        }
        let _ = leader.wait();
        let (fresh, _, _) =
            spawn_until(&bin, &urls, &format!("pod-{next_id}"), FOLLOWING).expect("fresh standby");
        next_id += 1;
        leader = std::mem::replace(&mut standby, fresh);
    }
    leader.stop();
    standby.stop();
    let total = started.elapsed();
    drop(servers);

    println!("## Sidecar benchmark\n");
    println!(
        "Machine: {}. {nodes} nodes on loopback; `run --ttl {TTL_FLAG} --safety-margin {SAFETY_MARGIN_FLAG}` \
         (other flags at their defaults: renew every ttl/3, node timeout 50 ms); {:.0} s in all.\n",
        support::machine(),
        total.as_secs_f64()
    );
    println!("### Idle, {:.0} s window\n", idle.secs);
    println!("| process | VmRSS | VmHWM | CPU, utime+stime | CPU, schedstat |");
    println!("|---|---|---|---|---|");
    for (i, name) in ["leader", "standby"].iter().enumerate() {
        println!(
            "| {name} | {:.1} MiB | {:.1} MiB | {:.3} % of a core | {:.3} % of a core |",
            idle.rss_kib[i] as f64 / 1024.0,
            idle.hwm_kib[i] as f64 / 1024.0,
            idle.cpu_pct[i],
            idle.sched_pct[i]
        );
    }
    println!();
    println!(
        "Commands each node received, from `MONITOR`, attributed to a process by its sockets' \
         local ports (`/proc/PID/fd`, `/proc/net/tcp`); `EVALSHA` named by script.\n"
    );
    println!("| node | leader cmds/s | leader sent | standby cmds/s | standby sent | other clients cmds/s |");
    println!("|---|---|---|---|---|---|");
    for (i, t) in idle.per_node.iter().enumerate() {
        println!(
            "| {} | {:.2} | {} | {:.2} | {} | {:.2} |",
            i + 1,
            t.rate[0],
            t.names[0],
            t.rate[1],
            t.names[1],
            t.others
        );
    }
    println!();
    println!("### Latencies\n");
    println!("| what | samples | p50 | p90 | p99 | max |");
    println!("|---|---|---|---|---|---|");
    let row = |name: &str, s: &Samples| {
        println!(
            "| {name} | {} | {} | {} | {} | {} |",
            s.len(),
            fmt_dur(s.pct(50.0)),
            fmt_dur(s.pct(90.0)),
            fmt_dur(s.pct(99.0)),
            fmt_dur(s.max())
        );
    };
    row(
        "hand-off after SIGTERM (SIGTERM → standby's /leader/watch says leading)",
        &handoff,
    );
    row("old leader exit after SIGTERM", &leader_exit);
    row("takeover after SIGKILL", &takeover);
    row("  key expiry on a quorum at the kill (PTTL)", &expiry);
    row("  takeover − key expiry", &overshoot);
    row("startup: spawn → HTTP port accepts", &http_up);
    row(
        "startup: spawn → leading (nodes already old enough)",
        &startup,
    );
    row("shutdown of a lone leader: SIGTERM → exit", &shutdown);
    println!();
    if handoff_errors > 0 {
        println!("Hand-offs that failed: {handoff_errors}.\n");
    }
    println!(
        "Processes ended by SIGTERM's default action instead of a graceful shutdown (the signal \
         came before the handler was installed): {startup_sigterm_unhandled} of {startups} \
         just-started leaders, {handoff_sigterm_unhandled} of {handoffs} hand-off leaders.\n"
    );
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    let max_rss = idle.rss_kib.iter().max().copied().unwrap_or(0);
    let max_cpu = idle
        .cpu_pct
        .iter()
        .chain(&idle.sched_pct)
        .copied()
        .fold(0.0, f64::max);
    let max_standby = idle.per_node.iter().map(|n| n.rate[1]).fold(0.0, f64::max);
    println!("### Targets\n");
    println!(
        "- resident memory < 16 MiB: {} (max {:.1} MiB)",
        verdict(max_rss < 16 * 1024),
        max_rss as f64 / 1024.0
    );
    println!(
        "- idle CPU < 1 % of a core: {} (max {max_cpu:.3} %)",
        verdict(max_cpu < 1.0)
    );
    println!(
        "- standby ≤ 1 command per node per second: {} (max {max_standby:.2}/s)",
        verdict(max_standby <= 1.0)
    );
    println!(
        "- hand-off after SIGTERM p50 and p99 < 50 ms: {} (p50 {}, p99 {})",
        verdict(handoff.pct(99.0) < Duration::from_millis(50) && handoff_errors == 0),
        fmt_dur(handoff.pct(50.0)),
        fmt_dur(handoff.pct(99.0))
    );
    println!(
        "- takeover after SIGKILL ≤ ttl ({TTL_FLAG}): {} (max {})",
        verdict(takeover.max() <= TTL && takeover.len() == kills),
        fmt_dur(takeover.max())
    );
}

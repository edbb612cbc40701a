//! Shared by the benchmarks: local `redis-server` processes, percentiles, env knobs.
//!
//! Servers listen on free loopback ports only, keep nothing on disk, and are killed *and
//! waited for* when dropped (a killed child nobody waits for stays a zombie).

#![allow(dead_code)]

use redlock_sidecar::redlock::{votes, Credentials, NodeSpec, RedlockConfig, EPOCH_KEY};
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

/// Reads a positive integer knob from the environment, or `default`.
pub fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .unwrap_or_else(|| panic!("{name}={v:?}: expected a positive integer")),
        Err(_) => default,
    }
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// One `redis-server` child on 127.0.0.1.
pub struct RedisServer {
    pub port: u16,
    child: Child,
}

impl RedisServer {
    /// Starts a server without persistence and waits until it answers PING.
    pub fn start() -> RedisServer {
        RedisServer::start_on(None)
    }

    /// [`RedisServer::start`], bound to `cpu` when given (see [`pinned_cpu`]).
    pub fn start_on(cpu: Option<usize>) -> RedisServer {
        RedisServer::start_with(cpu, &[])
    }

    /// [`RedisServer::start_on`] with more `redis-server` arguments (`--maxclients N`, ...).
    pub fn start_with(cpu: Option<usize>, extra: &[&str]) -> RedisServer {
        let port = free_port();
        let mut command = Command::new("redis-server");
        if let Some(cpu) = cpu {
            // SAFETY: sched_setaffinity on the child itself is async-signal-safe.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut command, move || {
                    pin_to(cpu).map_err(std::io::Error::other)
                });
            }
        }
        let child = command
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
            ])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "redis-server is not installed (not on PATH). Install it with \
                 `apt-get update && apt-get install -y redis-server` (Redis 7.0 or newer)."
            ),
            Err(e) => panic!("cannot start redis-server: {e}"),
        };
        let server = RedisServer { port, child };
        let deadline = Instant::now() + Duration::from_secs(5);
        while server.try_cmd(&["PING"]).as_deref() != Ok("PONG") {
            assert!(
                Instant::now() < deadline,
                "redis-server on port {port} did not answer PING within 5 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// One command over a fresh raw connection; the reply rendered as text
    /// (integers as digits, arrays one element per line).
    pub fn try_cmd(&self, args: &[&str]) -> Result<String, String> {
        raw_command(self.port, args)
    }

    /// Like [`RedisServer::try_cmd`], panicking on failure.
    pub fn cmd(&self, args: &[&str]) -> String {
        self.try_cmd(args)
            .unwrap_or_else(|e| panic!("{args:?} on port {}: {e}", self.port))
    }

    /// The lineage the engine's scripts stamp into this server's epoch marker (database 0).
    pub fn lineage(&self) -> String {
        let info = self.cmd(&["INFO", "server"]);
        let run_id = info_field(&info, "run_id").unwrap_or_default().to_owned();
        let info = self.cmd(&["INFO", "replication"]);
        let replid = info_field(&info, "master_replid").unwrap_or_default();
        votes::lineage(&run_id, replid, 0)
    }

    /// Stamps the epoch marker as if this server had kept its data for `age` already.
    pub fn backdate(&self, age: Duration) {
        let px = (votes::EPOCH_LIFETIME_MS - age.as_millis() as u64).to_string();
        self.cmd(&["SET", EPOCH_KEY, &self.lineage(), "PX", &px]);
    }

    /// Total calls over every command in `INFO commandstats`.
    pub fn total_calls(&self) -> u64 {
        self.cmd(&["INFO", "commandstats"])
            .lines()
            .filter(|l| l.starts_with("cmdstat_"))
            .filter_map(|l| {
                l.split(',')
                    .find_map(|f| f.split_once("calls=").map(|(_, n)| n))
                    .and_then(|n| n.parse::<u64>().ok())
            })
            .sum()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `n` servers.
pub fn start_servers(n: usize) -> Vec<RedisServer> {
    (0..n).map(|_| RedisServer::start()).collect()
}

/// The CPU a benchmark pins every server and itself to: `BENCH_CPU` (default `0`; `none`
/// leaves scheduling alone). On one CPU the servers' work adds up in full, as it would on
/// N busy hosts, instead of hiding on an idle second core.
pub fn pinned_cpu() -> Option<usize> {
    match std::env::var("BENCH_CPU").as_deref() {
        Ok("none") => None,
        Ok(cpu) => Some(
            cpu.parse()
                .unwrap_or_else(|_| panic!("BENCH_CPU={cpu}: not a CPU number")),
        ),
        Err(_) => Some(0),
    }
}

/// Binds the calling thread (and the threads and processes it starts later) to `cpu`.
pub fn pin_to(cpu: usize) -> Result<(), String> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and sched_setaffinity only
    // touch the set we own.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(format!("cannot pin to CPU {cpu}"));
        }
    }
    Ok(())
}

/// `(calls, usec)` of one command in `INFO commandstats` (`evalsha`, `set`, ...).
pub fn command_stats(server: &RedisServer, command: &str) -> (u64, u64) {
    commands_stats(server, &[command])
}

/// `(calls, usec)` summed over `commands`, from one `INFO commandstats` (which does not
/// count itself).
pub fn commands_stats(server: &RedisServer, commands: &[&str]) -> (u64, u64) {
    let stats = server.cmd(&["INFO", "commandstats"]);
    let mut total = (0, 0);
    for command in commands {
        let prefix = format!("cmdstat_{command}:");
        let line = stats
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .unwrap_or("");
        let field = |name: &str| -> u64 {
            line.split(',')
                .find_map(|f| f.strip_prefix(name))
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        total.0 += field("calls=");
        total.1 += field("usec=");
    }
    total
}

/// Stamps every server's epoch marker as a server in steady state has it: older than any ttl
/// may be, so rounds are decided at quorum (a younger node's grant waits for every answer).
pub fn settle(servers: &[RedisServer]) {
    for server in servers {
        server.backdate(votes::settled_data_age());
    }
}

/// The value of `field` in an `INFO` reply.
pub fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines().find_map(|l| {
        l.strip_prefix(field)
            .and_then(|rest| rest.strip_prefix(':'))
            .map(str::trim)
    })
}

/// Sends one RESP command on a fresh connection and reads one reply.
pub fn raw_command(port: u16, args: &[&str]) -> Result<String, String> {
    let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).map_err(|e| e.to_string())?;
    // Generous: a node serving thousands of clients on this 2-core machine may answer late,
    // and a measurement read must not end the run.
    stream
        .set_read_timeout(Some(Duration::from_secs(15)))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(&encode_command(args))
        .map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(stream);
    read_reply(&mut reader)
}

/// A RESP array of bulk strings.
pub fn encode_command(args: &[&str]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n{a}\r\n", a.len()).as_bytes());
    }
    out
}

fn read_line(reader: &mut impl BufRead) -> Result<String, String> {
    let mut line = String::new();
    match reader.read_line(&mut line) {
        Ok(0) => Err("connection closed".into()),
        Ok(_) => Ok(line.trim_end_matches(['\r', '\n']).to_owned()),
        Err(e) => Err(e.to_string()),
    }
}

/// Reads one RESP2 reply, rendered as text; a Redis error is `Err`.
pub fn read_reply(reader: &mut impl BufRead) -> Result<String, String> {
    let line = read_line(reader)?;
    let (kind, rest) = line.split_at(1.min(line.len()));
    match kind {
        "+" | ":" => Ok(rest.to_owned()),
        "-" => Err(rest.to_owned()),
        "$" => {
            let len: i64 = rest
                .parse()
                .map_err(|_| format!("bad bulk length {rest}"))?;
            if len < 0 {
                return Ok(String::new());
            }
            let mut buf = vec![0u8; len as usize + 2];
            std::io::Read::read_exact(reader, &mut buf).map_err(|e| e.to_string())?;
            buf.truncate(len as usize);
            Ok(String::from_utf8_lossy(&buf).into_owned())
        }
        "*" => {
            let n: i64 = rest
                .parse()
                .map_err(|_| format!("bad array length {rest}"))?;
            let items = (0..n.max(0))
                .map(|_| read_reply(reader))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(items.join("\n"))
        }
        _ => Err(format!("unexpected reply {line:?}")),
    }
}

/// Latency samples.
#[derive(Default, Clone)]
pub struct Samples(pub Vec<Duration>);

impl Samples {
    pub fn push(&mut self, d: Duration) {
        self.0.push(d);
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Nearest-rank percentile (`p` in 0..=100); zero when empty.
    pub fn pct(&self, p: f64) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        let mut v = self.0.clone();
        v.sort_unstable();
        let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
        v[rank.clamp(1, v.len()) - 1]
    }

    pub fn max(&self) -> Duration {
        self.0.iter().copied().max().unwrap_or_default()
    }

    pub fn mean(&self) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        self.0.iter().sum::<Duration>() / self.0.len() as u32
    }
}

/// `1.23 ms` or `456 µs`.
pub fn fmt_dur(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us >= 10_000.0 {
        format!("{:.1} ms", us / 1000.0)
    } else if us >= 1000.0 {
        format!("{:.2} ms", us / 1000.0)
    } else {
        format!("{us:.0} µs")
    }
}

/// `nproc` and the CPU model, for the report header.
pub fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let redis = Command::new("redis-server")
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .find_map(|w| w.strip_prefix("v=").map(str::to_owned))
        })
        .unwrap_or_else(|| "?".into());
    format!("{cpus} CPUs ({model}), redis-server {redis}")
}

/// An engine configuration for `lock` on the nodes at `urls`, with `ttl` and defaults otherwise.
pub fn engine_config(urls: &[String], lock: &str, identity: &str, ttl: Duration) -> RedlockConfig {
    let nodes = urls
        .iter()
        .enumerate()
        .map(|(i, url)| NodeSpec::parse(i, url, &Credentials::default()).expect("valid url"))
        .collect();
    let mut cfg = RedlockConfig::new(lock, identity, nodes);
    cfg.ttl = ttl;
    cfg
}

/// `SET KEYS[1] ARGV[1] NX PX ARGV[2]` in a script that also reads the server's lineage as the
/// engine's granting script does on every call (rule 2): a floor that includes that rule.
pub static SET_READING_LINEAGE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        "local set = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) \
         redis.call('INFO', 'server', 'replication') \
         if set then return 'OK' end return false",
    )
});

/// `SET key value NX PX ttl_ms` on one node, or with `lineage` through
/// [`SET_READING_LINEAGE`]: `Some("OK")` where it granted.
pub async fn set_nx(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    value: &str,
    ttl_ms: u64,
    lineage: bool,
) -> redis::RedisResult<Option<String>> {
    if lineage {
        return SET_READING_LINEAGE
            .key(key)
            .arg(value)
            .arg(ttl_ms)
            .invoke_async(conn)
            .await;
    }
    redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("NX")
        .arg("PX")
        .arg(ttl_ms)
        .query_async(conn)
        .await
}

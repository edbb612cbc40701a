//! Fleet benchmark: what many contenders cost the Redis nodes they share.
//!
//! `cargo bench --bench fleet` (several minutes: S = 10, 100, 1,000; L = 1,000 and 3,000, each
//! with its floor), or one size:
//! `cargo bench --bench fleet -- --standbys 1000`, `-- --locks 1000`; `--secs N` sets the
//! measurement window (default 10 s), `--warmup N` the warm-up before it (default 5 s),
//! `--releases N` the takeovers after a release measured per size (default 9); `--sidecars`
//! runs real sidecar processes instead of engines (see below); `--bare-locks N` runs the floor
//! of the L-locks shape (see below); without it, the floor of every `--locks` size runs.
//! Prints markdown tables and, last, one line `L=<n> engine/floor=<ratio>` per L-locks size (the
//! nodes' Redis CPU over the floor's); asserts nothing about timing.
//!
//! Three local `redis-server` nodes (`--maxclients` raised to what `ulimit -n` allows). Two
//! shapes, each with the engine's defaults (ttl 10 s, renewal every ttl/3, standby retry 1 s):
//! - **S standbys on one lock**: S + 1 contenders of one lock; one wins and renews, S wait.
//! - **L locks**: L locks with three contenders each (a leader and two standbys).
//!
//! Contenders are `Redlock` engines (the library API), hosted by worker processes this
//! benchmark starts from its own binary (`--worker`): each engine holds one connection per node
//! (RESP3: its subscriptions ride on it), and one process may hold at most `ulimit -n`
//! descriptors. S standbys: the first holder runs alone in a worker of its own and has won
//! before the standbys' workers start, at `nice 10`, so that they cannot starve its renewals
//! (or the nodes) on the machine's 2 cores, as standbys on other hosts would not.
//!
//! Per size and node, over the window after the warm-up: client requests/s (`INFO
//! commandstats`, scripts and other commands; the commands scripts run inside count apart),
//! Redis CPU µs/s (`used_cpu_sys` + `used_cpu_user`, and the commandstats `usec` of the
//! client's commands: scripts with what they ran inside, a `GET` or `PTTL` inside one counted
//! twice), memory (`used_memory`), clients; and the contenders' own CPU, summed over their processes: utime +
//! stime (`/proc/PID/stat`, whole clock ticks per process) and the on-CPU time of the threads
//! present at each reading (`/proc/PID/task/*/schedstat`, ns). Then the takeovers:
//! - **After a release**, `--releases` times, one after another: the holder releases; the time
//!   from just before its release call until another contender holds the lock (both moments
//!   stamped by the worker processes, on the machine's monotonic clock). The next release is
//!   sent 1 s after the takeover before it (so the standbys have taken in its announcement,
//!   as between releases in a fleet; earlier runs sent it at once). S standbys: on lock 0 each time; a contender
//!   that released ends, so S shrinks by one per sample, and at most S − 1 are taken (one
//!   standby stays for the crash). L locks: one release on each of locks 0, 1, ... (at most L),
//!   so two standbys wait at every sample. Printed as p50 and max over the samples (nearest
//!   rank), and each sample in order.
//! - **After a crash**, once, on lock 0 (it waits a ttl): the holder stops without releasing;
//!   the time from the moment its key has expired on a quorum of nodes, read from their `PTTL`
//!   right after the crash, until another contender holds it.
//!
//! **The floor of L locks** (`--bare-locks N`): the same clients and connections as L locks
//! (3 × L clients, one RESP2 connection per node each, in worker processes), sending bare commands
//! at the rates the L-locks goal implies: per lock, one "leader" sends each node `PEXPIRE`
//! every ttl/3 (as often as a leader renews), and two "standbys" each send each node a
//! pipelined `GET` + `PTTL` once per ttl (the read an idle standby is allowed). No scripts, no
//! subscriptions, no takeovers: what these requests cost a node whoever sends them, measured
//! the same way. Its first requests are spread evenly over each period.
//!
//! Before the sizes, once: the floor (an idle node's CPU, a bare `GET` round trip and rate)
//! and the Redis CPU per call of each script beside bare `SET NX PX`, `PEXPIRE` and `GET`.
//!
//! ## `--sidecars`
//!
//! The S-standbys shape with real sidecars: S + 1 `redlock-sidecar run` processes (the binary
//! Cargo builds beside this benchmark) on one lock, with the sidecar's defaults (no `--ttl`:
//! 10 s, renewal every ttl/3), `--kubernetes off`, each with its own `--identity` and
//! `--listen` port on 127.0.0.1, no `REDLOCK_*` variable in its environment, logs at the
//! default level to a file. Sizes S = 10 and 50 by default (`--standbys N` for others); S over
//! 50 and `--locks` are refused. Same per-node cost over the window; the contenders' CPU is
//! the sidecars'.
//!
//! Who leads, and when, comes from the lock's acquisition channel on node 0
//! (`redlock:{name}:acquired`), subscribed by the bench before the sidecars start and read by
//! one thread that stamps each message with the monotonic clock as it reads it. A winner's
//! engine announces its round there (with its identity) as soon as the round is won, from a
//! task started before the sidecar publishes its leadership; so the time is until a sidecar
//! has won the lock, plus the hop through node 0. One message per takeover, and one client
//! more on node 0, which node 0 counts among the lock's waiters (standbys spread their rounds
//! after a release by such a count). Reading the sidecars' `/leader/watch` streams
//! instead would make every standby write an event at each holder change (the release, then
//! the acquisition), in the middle of the takeover being timed. Set-up ends when a sidecar
//! has won and every sidecar is subscribed on every node (`PUBSUB NUMSUB`).
//! - **Takeover after release**: SIGTERM to the leader (a sidecar releases its lock on the way
//!   out), timed from just before the signal to the next announcement of another sidecar:
//!   unlike the engines' figure it includes the signal and the sidecar's shutdown up to its
//!   release. The signalled sidecar exits, so S shrinks by one per sample, as above.
//! - **Takeover after crash**: SIGKILL to the leader; from the moment its key has expired on a
//!   quorum (`PTTL` read right after the kill) to the next announcement of another sidecar.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redlock_sidecar::redlock::push::{Acquired, Channels};
use redlock_sidecar::redlock::{LockError, NoObserver, Redlock};
use support::{fmt_dur, RedisServer, Samples};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const NODES: usize = 3;
/// The engine's default ttl; renewals every third of it, as the sidecar's default.
const TTL: Duration = Duration::from_secs(10);
/// Engines per worker process: one connection per node each, 3 nodes, well under 20,000 fds.
const PER_WORKER: usize = 2_500;
/// The pause before each release sample, as between releases in a fleet: the standbys have
/// taken in the last takeover's acquisition announcement (S of them, on every node).
const SETTLE_BEFORE_RELEASE: Duration = Duration::from_secs(1);
/// Descriptors a server keeps for itself beyond its clients (Redis reserves 32).
const SERVER_RESERVED_FDS: u64 = 64;

fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Raises this process' soft descriptor limit to the hard one; returns the new limit.
fn raise_fd_limit() -> u64 {
    // SAFETY: getrlimit/setrlimit on a struct we own.
    unsafe {
        let mut limit: libc::rlimit = std::mem::zeroed();
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        limit.rlim_cur
    }
}

/// The runtime of the bench and of each worker process: two threads, as the machine has cores.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn engine(urls: &[String], lock: &str, identity: &str) -> Redlock {
    let cfg = support::engine_config(urls, lock, identity, TTL);
    Redlock::new(cfg, Arc::new(NoObserver)).expect("valid config")
}

// ---------------------------------------------------------------------------------------
// Worker: hosts contenders, reports on stdout, takes commands on stdin.
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Cmd {
    None,
    Release,
    Crash,
}

/// `--worker PREFIX URLS FIRST_LOCK LOCKS PER_LOCK`
fn worker(args: &[String]) {
    let [prefix, urls, first, locks, per_lock] = args else {
        panic!("--worker PREFIX URLS FIRST_LOCK LOCKS PER_LOCK");
    };
    let urls: Vec<String> = urls.split(',').map(str::to_owned).collect();
    let first: usize = first.parse().expect("FIRST_LOCK");
    let locks: usize = locks.parse().expect("LOCKS");
    let per_lock: usize = per_lock.parse().expect("PER_LOCK");
    raise_fd_limit();
    let runtime = runtime();
    let out = Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let say = move |line: String| {
        let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    };
    runtime.block_on(async move {
        let commands: Vec<watch::Sender<(u64, Cmd)>> = (0..locks)
            .map(|_| watch::channel((0, Cmd::None)).0)
            .collect();
        let started = Arc::new(AtomicUsize::new(0));
        let total = locks * per_lock;
        let mut spawned = 0;
        for (l, command) in commands.iter().enumerate() {
            let lock = first + l;
            for e in 0..per_lock {
                let redlock = engine(
                    &urls,
                    &format!("{prefix}-{lock}"),
                    &format!("w{}-{first}-{l}-{e}", std::process::id()),
                );
                let rx = command.subscribe();
                tokio::spawn(contender(redlock, lock, rx, started.clone(), say.clone()));
                spawned += 1;
                // Paced: a batch's first rounds (and connections) before the next batch.
                if spawned % 100 == 0 {
                    while started.load(Ordering::Relaxed) + 20 < spawned {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
        }
        while started.load(Ordering::Relaxed) < total {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        say("READY".into());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut seq = 0;
        while let Some(line) = rx.recv().await {
            let mut words = line.split_whitespace();
            let cmd = match words.next() {
                Some("RELEASE") => Cmd::Release,
                Some("CRASH") => Cmd::Crash,
                _ => continue,
            };
            let lock: usize = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
            if let Some(slot) = lock.checked_sub(first).and_then(|i| commands.get(i)) {
                seq += 1;
                slot.send_replace((seq, cmd));
            }
        }
        // stdin closed: the benchmark is done with this size.
        std::process::exit(0);
    });
}

/// `--bare-worker PREFIX URLS FIRST_LOCK LOCKS`: hosts the clients of [`Shape::Bare`] for
/// locks FIRST_LOCK.., reports `READY` once all are connected, exits when stdin closes.
fn bare_worker(args: &[String]) {
    let [prefix, urls, first, locks] = args else {
        panic!("--bare-worker PREFIX URLS FIRST_LOCK LOCKS");
    };
    let urls: Vec<String> = urls.split(',').map(str::to_owned).collect();
    let first: usize = first.parse().expect("FIRST_LOCK");
    let locks: usize = locks.parse().expect("LOCKS");
    raise_fd_limit();
    let runtime = runtime();
    runtime.block_on(async move {
        for lock in first..first + locks {
            let key = format!("redlock:{{{prefix}-{lock}}}");
            let mut conns = Vec::new();
            for role in 0..3 {
                let mut per_node = Vec::new();
                for url in &urls {
                    per_node.push(
                        redis::Client::open(url.as_str())
                            .expect("url")
                            .get_multiplexed_async_connection()
                            .await
                            .expect("connect"),
                    );
                }
                conns.push((role, per_node));
            }
            for (role, per_node) in conns {
                tokio::spawn(bare_client(
                    key.clone(),
                    lock * 3 + role,
                    role == 0,
                    per_node,
                ));
            }
        }
        println!("READY");
        let mut sink = String::new();
        while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {}
        std::process::exit(0);
    });
}

/// One client of the floor: a "leader" (`leads`) sets the key on every node and then sends
/// each node a bare `PEXPIRE` every ttl/3, as often as a leader renews; a "standby" sends each
/// node a pipelined `GET` + `PTTL` once per ttl, the one read per ttl an idle standby may make.
/// Their first requests are spread over the period by `index` (golden-ratio steps).
async fn bare_client(
    key: String,
    index: usize,
    leads: bool,
    mut conns: Vec<MultiplexedConnection>,
) {
    let ttl_ms = TTL.as_millis().to_string();
    let period = if leads { TTL / 3 } else { TTL };
    let phase = (index as f64 * 0.618_033_988_75).fract();
    if leads {
        for conn in &mut conns {
            let _: Result<(), _> = redis::cmd("SET")
                .arg(&key)
                .arg("bare")
                .arg("PX")
                .arg(&ttl_ms)
                .query_async(conn)
                .await;
        }
    }
    let mut next = tokio::time::Instant::now() + period.mul_f64(phase);
    loop {
        tokio::time::sleep_until(next).await;
        next += period;
        let calls = conns.iter_mut().map(|conn| {
            let (key, ttl_ms) = (&key, &ttl_ms);
            async move {
                if leads {
                    let _: Result<i64, _> = redis::cmd("PEXPIRE")
                        .arg(key)
                        .arg(ttl_ms)
                        .query_async(conn)
                        .await;
                } else {
                    let _: Result<(Option<String>, i64), _> = redis::pipe()
                        .cmd("GET")
                        .arg(key)
                        .cmd("PTTL")
                        .arg(key)
                        .query_async(conn)
                        .await;
                }
            }
        });
        futures_util::future::join_all(calls).await;
    }
}

/// One contender: waits for the lock (the engine's `acquire`), then renews every ttl/3 until
/// told to release or to crash (stop without releasing: its key expires).
async fn contender(
    redlock: Redlock,
    lock: usize,
    mut commands: watch::Receiver<(u64, Cmd)>,
    started: Arc<AtomicUsize>,
    say: impl Fn(String) + Send + Sync + 'static,
) {
    let never = CancellationToken::new();
    let mut first = true;
    loop {
        let result = redlock
            .acquire(None, &never, |_, _| {
                if std::mem::take(&mut first) {
                    started.fetch_add(1, Ordering::Relaxed);
                }
            })
            .await;
        let Ok(mut lease) = result else { return };
        // Commands sent before this point were for an earlier holder.
        commands.borrow_and_update();
        say(format!("ACQUIRED {lock} {}", mono_ns()));
        let mut next = tokio::time::Instant::now() + TTL / 3;
        loop {
            tokio::select! {
                changed = commands.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let cmd = commands.borrow_and_update().1;
                    match cmd {
                        Cmd::Release => {
                            say(format!("RELEASED {lock} {}", mono_ns()));
                            redlock.release(&lease).await;
                            return;
                        }
                        Cmd::Crash => {
                            say(format!("CRASHED {lock} {}", mono_ns()));
                            return;
                        }
                        Cmd::None => {}
                    }
                }
                _ = tokio::time::sleep_until(next) => {
                    match redlock.extend(&lease).await {
                        Ok(renewed) => lease = renewed,
                        Err(LockError::Superseded { .. }) | Err(LockError::Expired { .. }) => {
                            say(format!("LOST {lock}"));
                            break;
                        }
                        Err(_) => {}
                    }
                    next = tokio::time::Instant::now() + TTL / 3;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Main: servers, floor, script costs, sizes.
// ---------------------------------------------------------------------------------------

struct Args {
    standbys: Vec<usize>,
    locks: Vec<usize>,
    /// Sizes of the floor of the L-locks shape ([`Shape::Bare`]).
    bare_locks: Vec<usize>,
    secs: u64,
    warmup: u64,
    releases: usize,
    /// Contenders are `redlock-sidecar run` processes (S standbys only, S ≤ [`MAX_SIDECARS`]).
    sidecars: bool,
    costs_only: bool,
}

/// The most standbys `--sidecars` runs: one process each.
const MAX_SIDECARS: usize = 50;

/// Prints why the arguments are refused and exits 2.
fn refuse(why: &str) -> ! {
    eprintln!("fleet: {why}");
    std::process::exit(2);
}

fn parse_args(args: &[String]) -> Args {
    let mut parsed = Args {
        standbys: Vec::new(),
        locks: Vec::new(),
        bare_locks: Vec::new(),
        secs: 10,
        warmup: 5,
        releases: 9,
        sidecars: false,
        costs_only: false,
    };
    let mut it = args.iter();
    let number = |flag: &str, v: Option<&String>| -> u64 {
        v.and_then(|v| v.replace(['_', ','], "").parse().ok())
            .filter(|n| *n > 0)
            .unwrap_or_else(|| panic!("{flag} needs a positive number"))
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--standbys" => parsed
                .standbys
                .push(number("--standbys", it.next()) as usize),
            "--locks" => parsed.locks.push(number("--locks", it.next()) as usize),
            "--bare-locks" => parsed
                .bare_locks
                .push(number("--bare-locks", it.next()) as usize),
            "--secs" => parsed.secs = number("--secs", it.next()),
            "--warmup" => parsed.warmup = number("--warmup", it.next()),
            "--releases" => parsed.releases = number("--releases", it.next()) as usize,
            "--costs-only" => parsed.costs_only = true,
            "--sidecars" => parsed.sidecars = true,
            "--bench" => {}
            other => {
                panic!(
                    "unknown argument {other:?} (--standbys N, --locks N, --bare-locks N, --secs N, \
                     --warmup N, --releases N, --sidecars)"
                )
            }
        }
    }
    if parsed.sidecars {
        if !parsed.locks.is_empty() || !parsed.bare_locks.is_empty() {
            refuse(
                "--sidecars runs S standbys on one lock only; --locks and --bare-locks are for \
                 engines",
            );
        }
        if let Some(s) = parsed.standbys.iter().find(|s| **s > MAX_SIDECARS) {
            refuse(&format!(
                "--sidecars starts one process per contender: at most {MAX_SIDECARS} standbys, \
                 not {s} (run engines without --sidecars for more)"
            ));
        }
        if parsed.standbys.is_empty() {
            parsed.standbys = vec![10, MAX_SIDECARS];
        }
    }
    if parsed.standbys.is_empty() && parsed.locks.is_empty() && parsed.bare_locks.is_empty() {
        parsed.standbys = vec![10, 100, 1_000];
        parsed.locks = vec![1_000, 3_000];
    }
    // Every L-locks size is compared with its own floor, measured in the same run.
    if parsed.bare_locks.is_empty() {
        parsed.bare_locks = parsed.locks.clone();
    }
    parsed
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--worker") {
        worker(&args[1..]);
        return;
    }
    if args.first().map(String::as_str) == Some("--bare-worker") {
        bare_worker(&args[1..]);
        return;
    }
    let args = parse_args(&args);
    let fds = raise_fd_limit();
    let maxclients = fds.saturating_sub(SERVER_RESERVED_FDS);
    let bench_start = Instant::now();
    let servers: Vec<RedisServer> = (0..NODES)
        .map(|_| RedisServer::start_with(None, &["--maxclients", &maxclients.to_string()]))
        .collect();
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    support::settle(&servers);
    println!("## Fleet benchmark: {}\n", mode_name(&args));
    if args.sidecars {
        println!(
            "Machine: {}. {NODES} local nodes, unpinned; `redlock-sidecar run` with its defaults \
             (ttl {} s, renewal every ttl/3), one process per contender; window {} s after a {} s \
             warm-up. `ulimit -n` {fds}, so `maxclients` {maxclients} per node.\n",
            support::machine(),
            TTL.as_secs(),
            args.secs,
            args.warmup
        );
    } else {
        println!(
            "Machine: {}. {NODES} local nodes, unpinned; engine defaults (ttl {} s, renewal every \
             ttl/3, standby retry 1 s); window {} s after a {} s warm-up. `ulimit -n` {fds}, so \
             `maxclients` {maxclients} per node and at most {PER_WORKER} engines per worker \
             process.\n",
            support::machine(),
            TTL.as_secs(),
            args.secs,
            args.warmup
        );
    }
    let runtime = runtime();
    runtime.block_on(floor(&servers));
    runtime.block_on(script_costs(&servers[0]));
    if args.costs_only {
        return;
    }
    let mut rows = Vec::new();
    for &s in &args.standbys {
        if args.sidecars {
            rows.push(run_sidecars(&servers, &urls, s, &args));
            continue;
        }
        rows.push(run_size(
            &servers,
            &urls,
            Shape::Standbys(s),
            &args,
            maxclients,
        ));
    }
    let locks = args.locks.iter().map(|&l| Shape::Locks(l));
    for shape in locks.chain(args.bare_locks.iter().map(|&l| Shape::Bare(l))) {
        rows.push(run_size(&servers, &urls, shape, &args, maxclients));
    }
    print_summary(&rows, &args);
    println!("\nWhole run: {:.0} s.", bench_start.elapsed().as_secs_f64());
}

/// A node's counters at one moment.
#[derive(Clone, Default)]
struct Snapshot {
    calls: BTreeMap<String, (u64, u64)>,
    cpu_sec: f64,
    used_memory: u64,
    clients: u64,
    at: Option<Instant>,
}

fn snapshot(server: &RedisServer) -> Snapshot {
    let at = Instant::now();
    let info = server.cmd(&["INFO", "commandstats", "cpu", "memory", "clients"]);
    let mut calls = BTreeMap::new();
    for line in info.lines() {
        let Some((name, fields)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let field = |f: &str| -> u64 {
            fields
                .split(',')
                .find_map(|x| x.strip_prefix(f))
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        calls.insert(name.to_owned(), (field("calls="), field("usec=")));
    }
    let num = |f: &str| -> f64 {
        support::info_field(&info, f)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    Snapshot {
        calls,
        cpu_sec: num("used_cpu_sys") + num("used_cpu_user"),
        used_memory: num("used_memory") as u64,
        clients: num("connected_clients") as u64,
        at: Some(at),
    }
}

/// Commands a client sends itself (the rest in `INFO commandstats` run inside scripts).
/// `INFO` is left out: the scripts read the lineage with it on every grant and renewal, and an
/// engine sends its own only on a new connection and every 30 s. `GET` and `PTTL` are in: a
/// waiting standby reads with them; the scripts also run `PTTL` (up to twice per renewal) and
/// `GET` (only for a key found missing), so with renewals the "other requests" column
/// overstates by up to two per script.
const CLIENT_COMMANDS: [&str; 12] = [
    "evalsha",
    "eval",
    "script",
    "get",
    "pttl",
    "ping",
    "subscribe",
    "pubsub",
    "hello",
    "select",
    "auth",
    "client",
];

/// The commands the floor's clients send that contenders run only inside scripts.
const BARE_COMMANDS: [&str; 2] = ["pexpire", "set"];

/// What one node spent between two snapshots, per second.
#[derive(Clone, Default)]
struct NodeCost {
    scripts: f64,
    other_requests: f64,
    inside_scripts: f64,
    cpu_usec: f64,
    stats_usec: f64,
    used_memory: u64,
    clients: u64,
    /// Client commands per second, by name.
    detail: Vec<(String, f64)>,
}

/// `bare`: the clients send `PEXPIRE` and `SET` themselves ([`Shape::Bare`]); otherwise those
/// run only inside scripts.
fn cost(before: &Snapshot, after: &Snapshot, bare: bool) -> NodeCost {
    let secs = after
        .at
        .zip(before.at)
        .map_or(1.0, |(a, b)| a.duration_since(b).as_secs_f64());
    let delta = |name: &str| -> (u64, u64) {
        let (c1, u1) = after.calls.get(name).copied().unwrap_or_default();
        let (c0, u0) = before.calls.get(name).copied().unwrap_or_default();
        (c1.saturating_sub(c0), u1.saturating_sub(u0))
    };
    let (mut scripts, mut other, mut inside, mut usec) = (0u64, 0u64, 0u64, 0u64);
    let mut detail = Vec::new();
    let is_client =
        |name: &str| CLIENT_COMMANDS.contains(&name) || (bare && BARE_COMMANDS.contains(&name));
    for name in after.calls.keys() {
        let (c, u) = delta(name);
        // A script's `usec` already holds the commands it ran: count those once.
        if is_client(name) {
            usec += u;
        }
        if is_client(name) && c > 0 {
            detail.push((name.clone(), c as f64 / secs));
        }
        if name == "evalsha" || name == "eval" {
            scripts += c;
        } else if is_client(name) {
            other += c;
        } else {
            inside += c;
        }
    }
    NodeCost {
        scripts: scripts as f64 / secs,
        other_requests: other as f64 / secs,
        inside_scripts: inside as f64 / secs,
        cpu_usec: (after.cpu_sec - before.cpu_sec) * 1e6 / secs,
        stats_usec: usec as f64 / secs,
        used_memory: after.used_memory,
        clients: after.clients,
        detail,
    }
}

/// An idle node's CPU, and a bare GET round trip and rate from one client.
async fn floor(servers: &[RedisServer]) {
    println!("### Floor (same run)\n");
    let before: Vec<Snapshot> = servers.iter().map(snapshot).collect();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle: Vec<NodeCost> = servers
        .iter()
        .zip(&before)
        .map(|(s, b)| cost(b, &snapshot(s), false))
        .collect();
    let server = &servers[0];
    let mut conn = connect(server).await;
    let _: () = redis::cmd("SET")
        .arg("fleet:floor")
        .arg("x")
        .query_async(&mut conn)
        .await
        .expect("SET");
    server.cmd(&["CONFIG", "RESETSTAT"]);
    let mut samples = Samples::default();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(2) {
        let t = Instant::now();
        let _: Option<String> = redis::cmd("GET")
            .arg("fleet:floor")
            .query_async(&mut conn)
            .await
            .expect("GET");
        samples.push(t.elapsed());
    }
    let rate = samples.len() as f64 / start.elapsed().as_secs_f64();
    let (calls, usec) = support::command_stats(server, "get");
    println!("| measure | value |");
    println!("|---|---|");
    for (i, c) in idle.iter().enumerate() {
        println!(
            "| idle node {i}: Redis CPU | {:.0} µs/s ({:.3} % of a core), {:.1} MB |",
            c.cpu_usec,
            c.cpu_usec / 1e4,
            c.used_memory as f64 / 1e6
        );
    }
    println!(
        "| bare `GET`, one client, sequential | round trip p50 {}, p99 {}; {rate:.0} GET/s |",
        fmt_dur(samples.pct(50.0)),
        fmt_dur(samples.pct(99.0))
    );
    println!(
        "| bare `GET`, Redis CPU | {:.2} µs per call |",
        usec as f64 / calls.max(1) as f64
    );
    println!();
}

async fn connect(server: &RedisServer) -> MultiplexedConnection {
    redis::Client::open(server.url())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect")
}

/// Runs `$body` in [`BATCHES`] batches of [`PER_BATCH`], resetting the stats before each:
/// `(lowest, median)` µs per call of each of `$commands` over the batches (the lowest is the
/// least disturbed by whatever else runs on the machine).
macro_rules! measure {
    ($server:expr, [$($command:literal),+], $body:block) => {{
        let commands = [$($command),+];
        let mut per: Vec<Vec<f64>> = commands.iter().map(|_| Vec::new()).collect();
        for _ in 0..BATCHES {
            $server.cmd(&["CONFIG", "RESETSTAT"]);
            for _ in 0..PER_BATCH $body
            for (i, command) in commands.iter().enumerate() {
                let (calls, usec) = support::command_stats($server, command);
                per[i].push(usec as f64 / calls.max(1) as f64);
            }
        }
        per.into_iter()
            .map(|mut v| {
                v.sort_by(f64::total_cmp);
                (v[0], v[v.len() / 2])
            })
            .collect::<Vec<(f64, f64)>>()
    }};
}

const BATCHES: usize = 10;
const PER_BATCH: usize = 300;

/// Redis CPU per call of each script against bare commands, on one node (`INFO commandstats`).
async fn script_costs(server: &RedisServer) {
    let urls = [server.url()];
    let mut conn = connect(server).await;
    let mut rows: Vec<(String, (f64, f64))> = Vec::new();

    // Granted acquire: the engine's round; a plain DEL frees the lock again.
    let granted = engine(&urls, "fleet-cost-granted", "cost");
    for _ in 0..50 {
        granted.try_acquire().await.expect("warm-up acquire");
        del(&mut conn, "redlock:{fleet-cost-granted}").await;
    }
    let m = measure!(server, ["evalsha"], {
        granted.try_acquire().await.expect("uncontended acquire");
        del(&mut conn, "redlock:{fleet-cost-granted}").await;
    });
    rows.push(("acquire script, granted".into(), m[0]));

    // Busy acquire: the lock is held by another engine (so its fencing counter, ttl register
    // and node-set record exist, as they do wherever a standby waits).
    let other = engine(&urls, "fleet-cost-busy", "other");
    let held = other.try_acquire().await.expect("acquire");
    let busy = engine(&urls, "fleet-cost-busy", "cost");
    for _ in 0..50 {
        let _ = busy.try_acquire().await;
    }
    let m = measure!(server, ["evalsha"], {
        let r = busy.try_acquire().await;
        assert!(matches!(r, Err(LockError::Busy { .. })), "held elsewhere");
    });
    rows.push(("acquire script, busy (a standby's round)".into(), m[0]));
    other.release(&held).await;

    // Extend: our own lease, renewed.
    let holder = engine(&urls, "fleet-cost-extend", "cost");
    let mut lease = holder.try_acquire().await.expect("acquire");
    for _ in 0..50 {
        lease = holder.extend(&lease).await.expect("extend");
    }
    let m = measure!(server, ["evalsha"], {
        lease = holder.extend(&lease).await.expect("extend");
    });
    rows.push(("extend script".into(), m[0]));
    holder.release(&lease).await;

    // Bare commands.
    let m = measure!(server, ["set", "pexpire", "get"], {
        let _: Option<String> = redis::cmd("SET")
            .arg("fleet:bare")
            .arg("v")
            .arg("NX")
            .arg("PX")
            .arg(10_000)
            .query_async(&mut conn)
            .await
            .expect("SET");
        let _: i64 = redis::cmd("PEXPIRE")
            .arg("fleet:bare")
            .arg(10_000)
            .query_async(&mut conn)
            .await
            .expect("PEXPIRE");
        let _: Option<String> = redis::cmd("GET")
            .arg("fleet:bare")
            .query_async(&mut conn)
            .await
            .expect("GET");
        del(&mut conn, "fleet:bare").await;
    });
    rows.push(("bare `SET key value NX PX ttl`".into(), m[0]));
    rows.push(("bare `PEXPIRE key ttl`".into(), m[1]));
    rows.push(("bare `GET key`".into(), m[2]));
    // The pieces of a script: an empty one, and the lineage read alone.
    for (name, lua) in [
        ("empty script (`return 1`)", "return 1"),
        (
            "script reading `INFO server replication` only",
            "redis.call('INFO', 'server', 'replication') return 1",
        ),
        (
            "script reading `INFO server` and `INFO replication`",
            "redis.call('INFO', 'server') redis.call('INFO', 'replication') return 1",
        ),
    ] {
        let script = redis::Script::new(lua);
        let _: i64 = script.invoke_async(&mut conn).await.expect("script");
        let m = measure!(server, ["evalsha"], {
            let _: i64 = script.invoke_async(&mut conn).await.expect("script");
        });
        rows.push((name.into(), m[0]));
    }
    println!(
        "### Redis CPU per call (`INFO commandstats` `usec_per_call`, one node, {BATCHES} batches of {PER_BATCH} calls)\n"
    );
    println!("| call | µs per call, lowest batch | median batch |");
    println!("|---|---|---|");
    for (name, (low, median)) in rows {
        println!("| {name} | {low:.2} | {median:.2} |");
    }
    println!();
}

async fn del(conn: &mut MultiplexedConnection, key: &str) {
    let _: i64 = redis::cmd("DEL")
        .arg(key)
        .query_async(conn)
        .await
        .expect("DEL");
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// S standbys (and one holder) on one lock.
    Standbys(usize),
    /// L locks, three contenders each.
    Locks(usize),
    /// The floor of the L-locks shape: L × 3 clients with one connection per node each,
    /// sending bare commands at the engine's request rates (see [`bare_client`]).
    Bare(usize),
}

impl Shape {
    fn name(self) -> String {
        match self {
            Shape::Standbys(s) => format!("S = {s} standbys on one lock"),
            Shape::Locks(l) => format!("L = {l} locks × (leader + 2 standbys)"),
            Shape::Bare(l) => format!("floor of L = {l}: bare `PEXPIRE` and `GET` + `PTTL`"),
        }
    }
    fn locks(self) -> usize {
        match self {
            Shape::Standbys(_) => 1,
            Shape::Locks(l) | Shape::Bare(l) => l,
        }
    }
    fn per_lock(self) -> usize {
        match self {
            Shape::Standbys(s) => s + 1,
            Shape::Locks(_) | Shape::Bare(_) => 3,
        }
    }
}

struct Row {
    shape: Shape,
    skipped: Option<String>,
    nodes: Vec<NodeCost>,
    /// Contenders' CPU over the window, µs/s: utime + stime.
    client_cpu_usec: f64,
    /// The same from `schedstat`.
    client_sched_usec: f64,
    /// One sample per release that was followed by a takeover.
    takeover_release: Samples,
    /// Releases asked for (after the cap, see [`release_plan`]).
    releases_planned: usize,
    /// Why fewer than `--releases` were planned, or why some did not come.
    release_note: Option<String>,
    takeover_crash: Option<Duration>,
    crash_wait: Option<Duration>,
    leaders_changed: usize,
    setup: Duration,
}

impl Row {
    /// A row for `shape` with nothing measured yet.
    fn new(shape: Shape) -> Row {
        Row {
            shape,
            skipped: None,
            nodes: Vec::new(),
            client_cpu_usec: 0.0,
            client_sched_usec: 0.0,
            takeover_release: Samples::default(),
            releases_planned: 0,
            release_note: None,
            takeover_crash: None,
            crash_wait: None,
            leaders_changed: 0,
            setup: Duration::ZERO,
        }
    }
}

struct Workers {
    children: Vec<(Child, ChildStdin)>,
    lines: mpsc::Receiver<(String, u64)>,
}

impl Workers {
    fn send(&mut self, line: &str) {
        for (_, stdin) in &mut self.children {
            let _ = writeln!(stdin, "{line}");
            let _ = stdin.flush();
        }
    }

    /// The next line from any worker within `timeout`: (text, arrival in mono ns).
    fn next(&self, timeout: Duration) -> Option<(String, u64)> {
        self.lines.recv_timeout(timeout).ok()
    }

    /// CPU time of every worker, in µs (see [`process_cpu_usec`]).
    fn cpu_usec(&self) -> (f64, f64) {
        sum_cpu(
            self.children
                .iter()
                .filter_map(|(child, _)| process_cpu_usec(child.id())),
        )
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for (child, stdin) in self.children.drain(..) {
            drop(stdin);
            let mut child = child;
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn spawn_workers(urls: &[String], prefix: &str, shape: Shape) -> Workers {
    let exe = std::env::current_exe().expect("own binary");
    let (tx, rx) = mpsc::channel();
    let joined = urls.join(",");
    // One worker: (first lock, locks, engines per lock), at a lower priority when `niced`.
    let spawn = |(first, locks, per_lock): (usize, usize, usize), niced: bool| {
        let mut command = if niced {
            let mut nice = Command::new("nice");
            nice.args(["-n", "10"]).arg(&exe);
            nice
        } else {
            Command::new(&exe)
        };
        let mut args = vec![
            "--worker".to_owned(),
            prefix.to_owned(),
            joined.clone(),
            first.to_string(),
            locks.to_string(),
            per_lock.to_string(),
        ];
        if let Shape::Bare(_) = shape {
            args[0] = "--bare-worker".to_owned();
            args.pop();
        }
        let mut child = command
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start a worker");
        let stdout = child.stdout.take().expect("stdout");
        let stdin = child.stdin.take().expect("stdin");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send((line, mono_ns())).is_err() {
                    break;
                }
            }
        });
        (child, stdin)
    };
    let mut children = Vec::new();
    match shape {
        Shape::Standbys(_) => {
            // The first holder runs alone, at normal priority, and wins before any standby
            // starts: the standbys' workers (niced) then cannot starve its renewals, as
            // standbys on other hosts would not.
            children.push(spawn((0, 1, 1), false));
            let deadline = Instant::now() + Duration::from_secs(30);
            let mut seen = Vec::new();
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let (line, at) = rx.recv_timeout(left).expect("the first holder acquires");
                let won = line.starts_with("ACQUIRED");
                seen.push((line, at));
                if won {
                    break;
                }
            }
            // Seen again by whoever reads the lines.
            for line in seen {
                let _ = tx.send(line);
            }
            let mut left = shape.per_lock() - 1;
            while left > 0 {
                let n = left.min(PER_WORKER);
                children.push(spawn((0, 1, n), true));
                left -= n;
            }
        }
        Shape::Locks(l) | Shape::Bare(l) => {
            let per = PER_WORKER / 3;
            let mut first = 0;
            while first < l {
                let n = (l - first).min(per);
                children.push(spawn((first, n, 3), false));
                first += n;
            }
        }
    }
    Workers {
        children,
        lines: rx,
    }
}

/// Reads a timestamp field: `WORD LOCK NS`.
fn stamp(line: &str, word: &str, lock: usize) -> Option<u64> {
    let mut it = line.split_whitespace();
    (it.next()? == word && it.next()?.parse::<usize>().ok()? == lock)
        .then(|| it.next()?.parse().ok())
        .flatten()
}

/// How many release takeovers a size can give, and why fewer than asked. S standbys: each
/// release ends its contender, so at most S − 1 (one standby stays for the crash). L locks:
/// one release on each of locks 0..N (each keeps a standby), so at most L.
fn release_plan(shape: Shape, asked: usize) -> (usize, Option<String>) {
    let most = match shape {
        Shape::Standbys(s) => s.saturating_sub(1),
        Shape::Locks(l) => l,
        Shape::Bare(_) => return (0, None),
    };
    if asked <= most {
        return (asked, None);
    }
    let why = match shape {
        Shape::Standbys(s) => format!(
            "{asked} releases asked, {most} made: each ends its contender, and one of the {s} \
             standbys must stay for the crash"
        ),
        Shape::Locks(l) | Shape::Bare(l) => {
            format!("{asked} releases asked, {most} made: one per lock of {l}")
        }
    };
    (most, Some(why))
}

/// The measurement window: each node's cost and the contenders' CPU from when it opens until
/// it closes.
struct Window {
    before: Vec<Snapshot>,
    cpu_before: (f64, f64),
    start: Instant,
}

impl Window {
    fn open(servers: &[RedisServer], cpu_usec: (f64, f64)) -> Window {
        Window {
            before: servers.iter().map(snapshot).collect(),
            cpu_before: cpu_usec,
            start: Instant::now(),
        }
    }

    /// When a window of `secs` ends.
    fn end(&self, secs: u64) -> Instant {
        self.start + Duration::from_secs(secs)
    }

    fn close(self, servers: &[RedisServer], cpu_usec: (f64, f64), row: &mut Row) {
        row.nodes = servers
            .iter()
            .zip(&self.before)
            .map(|(s, b)| cost(b, &snapshot(s), matches!(row.shape, Shape::Bare(_))))
            .collect();
        let secs = self.start.elapsed().as_secs_f64();
        row.client_cpu_usec = (cpu_usec.0 - self.cpu_before.0) / secs;
        row.client_sched_usec = (cpu_usec.1 - self.cpu_before.1) / secs;
    }
}

fn run_size(
    servers: &[RedisServer],
    urls: &[String],
    shape: Shape,
    args: &Args,
    maxclients: u64,
) -> Row {
    let engines = shape.locks() * shape.per_lock();
    let mut row = Row::new(shape);
    println!("### {} — {}\n", shape.name(), mode_name(args));
    // Each engine: one connection per node (its subscriptions ride on it).
    let per_node = engines as u64;
    if per_node + 16 > maxclients {
        let why = format!(
            "not run: {engines} engines need {per_node} connections per node (one per \
             engine), over `maxclients` {maxclients} (`ulimit -n` hard limit)"
        );
        println!("{why}\n");
        row.skipped = Some(why);
        return row;
    }
    let prefix = format!("fleet-{}", mono_ns() % 1_000_000);
    let setup_start = Instant::now();
    let mut workers = spawn_workers(urls, &prefix, shape);
    let mut ready = 0;
    let mut acquired = 0usize;
    let setup_deadline = Instant::now() + Duration::from_secs(60 + engines as u64 / 50);
    while ready < workers.children.len() {
        let left = setup_deadline.saturating_duration_since(Instant::now());
        match workers.next(left) {
            Some((line, _)) if line == "READY" => ready += 1,
            Some((line, _)) if line.starts_with("ACQUIRED") => acquired += 1,
            Some(_) => {}
            None => panic!("{}: workers not ready within the deadline", shape.name()),
        }
    }
    row.setup = setup_start.elapsed();
    eprintln!(
        "fleet: {} — {engines} engines up in {:.1} s",
        shape.name(),
        row.setup.as_secs_f64()
    );
    // Warm-up, then the window.
    let drain = |workers: &Workers, until: Instant, acquired: &mut usize| {
        while let Some((line, _)) = workers.next(until.saturating_duration_since(Instant::now())) {
            if line.starts_with("ACQUIRED") || line.starts_with("LOST") {
                *acquired += 1;
            }
            if Instant::now() >= until {
                break;
            }
        }
    };
    drain(
        &workers,
        Instant::now() + Duration::from_secs(args.warmup),
        &mut acquired,
    );
    let window = Window::open(servers, workers.cpu_usec());
    drain(&workers, window.end(args.secs), &mut acquired);
    window.close(servers, workers.cpu_usec(), &mut row);
    row.leaders_changed = acquired.saturating_sub(shape.locks());

    // Takeovers after a release, one at a time: each waits for the previous one's ACQUIRED.
    let (planned, note) = release_plan(shape, args.releases);
    row.releases_planned = planned;
    row.release_note = note;
    for k in 0..planned {
        // Standbys: lock 0 each time (the releasing contender ends). Locks: lock k.
        let lock = match shape {
            Shape::Standbys(_) => 0,
            Shape::Locks(_) | Shape::Bare(_) => k,
        };
        std::thread::sleep(SETTLE_BEFORE_RELEASE);
        workers.send(&format!("RELEASE {lock}"));
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut released = None;
        let mut took = None;
        while took.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            let Some((line, _)) = workers.next(left) else {
                break;
            };
            if let Some(t) = stamp(&line, "RELEASED", lock) {
                released = Some(t);
            } else if let (Some(t), Some(r)) = (stamp(&line, "ACQUIRED", lock), released) {
                took = Some(Duration::from_nanos(t.saturating_sub(r)));
            }
        }
        match took {
            Some(d) => row.takeover_release.push(d),
            None => {
                let why = format!(
                    "release {} of {planned} (lock {lock}): no takeover within 30 s",
                    k + 1
                );
                eprintln!("fleet: {}: {why}", shape.name());
                row.release_note = Some(why);
                break;
            }
        }
    }
    // Takeover after a crash: from the moment the key is gone on a quorum of nodes. The
    // floor's clients hold no lock.
    if !matches!(shape, Shape::Bare(_)) {
        crash_takeover(servers, &mut workers, &prefix, &mut row);
    }
    drop(workers);
    for server in servers {
        server.cmd(&["FLUSHALL"]);
    }
    support::settle(servers);
    print_row(&row, args);
    row
}

/// Crashes lock 0's holder and times the takeover from the moment its key has expired on a
/// quorum of nodes.
fn crash_takeover(servers: &[RedisServer], workers: &mut Workers, prefix: &str, row: &mut Row) {
    workers.send("CRASH 0");
    let deadline = Instant::now() + TTL * 3;
    let mut free_at = None;
    let mut crashed_at = None;
    let key = format!("redlock:{{{prefix}-0}}");
    while row.takeover_crash.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some((line, _)) = workers.next(left) else {
            break;
        };
        if let Some(t) = stamp(&line, "CRASHED", 0) {
            crashed_at = Some(t);
            let mut expiries: Vec<u64> = servers
                .iter()
                .filter_map(|s| {
                    let read_at = mono_ns();
                    let pttl: i64 = s.cmd(&["PTTL", &key]).parse().ok()?;
                    Some(read_at + pttl.max(0) as u64 * 1_000_000)
                })
                .collect();
            expiries.sort_unstable();
            free_at = expiries.get(NODES / 2).copied();
        } else if let (Some(t), Some(free), Some(c)) =
            (stamp(&line, "ACQUIRED", 0), free_at, crashed_at)
        {
            row.takeover_crash = Some(Duration::from_nanos(t.saturating_sub(free)));
            row.crash_wait = Some(Duration::from_nanos(t.saturating_sub(c)));
        }
    }
}

/// What the contenders are, for headings.
fn mode_name(args: &Args) -> &'static str {
    if args.sidecars {
        "sidecars (`redlock-sidecar run` processes)"
    } else {
        "engines (`Redlock` in worker processes)"
    }
}

fn pct_core(usec_per_sec: f64) -> f64 {
    usec_per_sec / 1e4
}

fn print_row(row: &Row, args: &Args) {
    println!(
        "Set-up {:.1} s; window {} s. Contenders' own CPU (all {} processes): utime + stime \
         {:.0} µs/s ({:.2} % of a core); on CPU per `schedstat` {:.0} µs/s ({:.2} % of a \
         core).\n",
        row.setup.as_secs_f64(),
        args.secs,
        if args.sidecars { "sidecar" } else { "worker" },
        row.client_cpu_usec,
        pct_core(row.client_cpu_usec),
        row.client_sched_usec,
        pct_core(row.client_sched_usec)
    );
    println!(
        "| node | scripts/s | other requests/s | commands inside scripts/s | Redis CPU µs/s (`used_cpu_*`) | % of a core | commandstats µs/s | used_memory | clients |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (i, n) in row.nodes.iter().enumerate() {
        println!(
            "| {i} | {:.1} | {:.1} | {:.1} | {:.0} | {:.2} % | {:.0} | {:.1} MB | {} |",
            n.scripts,
            n.other_requests,
            n.inside_scripts,
            n.cpu_usec,
            pct_core(n.cpu_usec),
            n.stats_usec,
            n.used_memory as f64 / 1e6,
            n.clients
        );
    }
    for (i, n) in row.nodes.iter().enumerate() {
        let detail: Vec<String> = n
            .detail
            .iter()
            .map(|(name, rate)| format!("{name} {rate:.2}/s"))
            .collect();
        println!("\n- node {i} client commands: {}", detail.join(", "));
    }
    if let Shape::Bare(_) = row.shape {
        println!("\nNo takeovers: the floor's clients hold no lock.\n");
        return;
    }
    let samples: Vec<String> = row.takeover_release.0.iter().map(|d| fmt_dur(*d)).collect();
    println!(
        "\nTakeover after release, {} of {} releases: p50 {}, max {} (in order: {}).{}",
        row.takeover_release.len(),
        row.releases_planned,
        pct_or_none(&row.takeover_release, 50.0),
        pct_or_none(&row.takeover_release, 100.0),
        if samples.is_empty() {
            "none".into()
        } else {
            samples.join(", ")
        },
        row.release_note
            .as_ref()
            .map_or(String::new(), |why| format!(" Note: {why}."))
    );
    println!(
        "\nTakeover after a crash: {} after the key expired on a quorum ({} after the crash). \
         Leadership changes during warm-up and window: {}.\n",
        row.takeover_crash.map_or("none".into(), fmt_dur),
        row.crash_wait.map_or("–".into(), fmt_dur),
        row.leaders_changed
    );
}

/// A percentile of `samples` (100: the max), or `none` without samples.
fn pct_or_none(samples: &Samples, p: f64) -> String {
    if samples.len() == 0 {
        "none".into()
    } else if p >= 100.0 {
        fmt_dur(samples.max())
    } else {
        fmt_dur(samples.pct(p))
    }
}

/// `p50 / max (n)` of the takeovers after a release (`–` for the floor, which has none).
fn release_cell(row: &Row) -> String {
    if let Shape::Bare(_) = row.shape {
        return "–".into();
    }
    format!(
        "{} / {} ({})",
        pct_or_none(&row.takeover_release, 50.0),
        pct_or_none(&row.takeover_release, 100.0),
        row.takeover_release.len()
    )
}

fn print_summary(rows: &[Row], args: &Args) {
    println!(
        "### Summary: {} (mean over the {NODES} nodes, per node)\n",
        mode_name(args)
    );
    println!(
        "| size | requests/s | Redis CPU µs/s | % of a core | per contender: requests/s, µs/s | used_memory | takeover after release p50 / max (n) | after crash (past expiry) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for row in rows {
        if let Some(why) = &row.skipped {
            println!("| {} | {why} ||||||| ", row.shape.name());
            continue;
        }
        let n = row.nodes.len().max(1) as f64;
        let requests = row
            .nodes
            .iter()
            .map(|c| c.scripts + c.other_requests)
            .sum::<f64>()
            / n;
        let cpu = row.nodes.iter().map(|c| c.cpu_usec).sum::<f64>() / n;
        let memory = row.nodes.iter().map(|c| c.used_memory).sum::<u64>() as f64 / n;
        let contenders = (row.shape.locks() * row.shape.per_lock()) as f64;
        println!(
            "| {} | {requests:.0} | {cpu:.0} | {:.2} % | {:.3}, {:.2} | {:.1} MB | {} | {} |",
            row.shape.name(),
            pct_core(cpu),
            requests / contenders,
            cpu / contenders,
            memory / 1e6,
            release_cell(row),
            match row.shape {
                Shape::Bare(_) => "–".into(),
                _ => row.takeover_crash.map_or("none".into(), fmt_dur),
            },
        );
    }
    println!("\nGoals (per node): 10,000 idle standbys on one lock ≤ 1 % of a core; 10,000 locks with a leader and two standbys each ≤ 10 % of a core, renewals included.");
    for row in rows {
        if row.skipped.is_some() {
            continue;
        }
        let worst = row.nodes.iter().map(|c| c.cpu_usec).fold(0.0, f64::max);
        let (goal_at, goal, size) = match row.shape {
            Shape::Standbys(s) => (10_000.0, 1.0, s as f64),
            Shape::Locks(l) | Shape::Bare(l) => (10_000.0, 10.0, l as f64),
        };
        // Linear in the number of contenders: the cost this size would have at the goal's size.
        let scaled = pct_core(worst) * goal_at / size;
        let verdict = match row.shape {
            // Not a contender: what these requests cost whoever sends them.
            Shape::Bare(_) => "the floor of the L-locks goal".to_owned(),
            _ => format!(
                "goal {goal} %: {}",
                if scaled <= goal { "met" } else { "MISSED" }
            ),
        };
        println!(
            "- {}: busiest node {:.2} % of a core; scaled linearly to {goal_at:.0}: {scaled:.1} % ({verdict})",
            row.shape.name(),
            pct_core(worst),
        );
    }
    print_floor_ratios(rows);
}

/// Last, one line per L-locks size: the Redis CPU (`used_cpu_sys` + `used_cpu_user`, mean
/// per node) of L locks of three over that of the floor of the same L, measured in this run
/// (goal ≤ 1.25).
fn print_floor_ratios(rows: &[Row]) {
    let cpu = |shape: Shape| {
        rows.iter()
            .find(|row| row.shape == shape && row.skipped.is_none() && !row.nodes.is_empty())
            .map(|row| row.nodes.iter().map(|c| c.cpu_usec).sum::<f64>() / row.nodes.len() as f64)
    };
    let mut first = true;
    for row in rows {
        let Shape::Locks(l) = row.shape else { continue };
        if first {
            println!();
            first = false;
        }
        match (cpu(Shape::Locks(l)), cpu(Shape::Bare(l))) {
            (Some(engine), Some(floor)) => println!(
                "L={l} engine/floor={:.3} ({engine:.0} µs/s / {floor:.0} µs/s of Redis CPU per node; goal ≤ 1.25: {})",
                engine / floor,
                if engine <= floor * 1.25 { "met" } else { "missed" }
            ),
            _ => println!("L={l} engine/floor=? (not measured: run with --bare-locks {l})"),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Sidecars: S + 1 `redlock-sidecar run` processes on one lock.
// ---------------------------------------------------------------------------------------

/// A won round, as announced on the lock's acquisition channel of node 0.
struct Announced {
    /// The winner: its index among the sidecars.
    winner: usize,
    /// The moment (mono ns) the bench read the announcement.
    at: u64,
}

/// One `redlock-sidecar run` child.
struct SidecarProcess {
    child: Child,
    identity: String,
    /// Its stderr (the default info-level logs), shown when a takeover does not come.
    log: std::path::PathBuf,
    /// Signalled to end (SIGTERM or SIGKILL): it no longer counts as a contender.
    ended: bool,
}

/// The sidecars of one size, and the announcements of the rounds they win.
struct Sidecars {
    procs: Vec<SidecarProcess>,
    announced: mpsc::Receiver<Result<Announced, String>>,
    /// The subscription's socket: shut down on drop, which ends its reader thread.
    subscription: std::net::TcpStream,
    /// The last winner announced.
    leader: Option<usize>,
    /// Rounds won so far.
    tenures: usize,
}

impl Sidecars {
    /// Subscribes to `lock`'s acquisition channel on `server`, then starts `count` sidecars
    /// on the lock with the default ttl.
    fn spawn(server: &RedisServer, urls: &[String], lock: &str, count: usize) -> Sidecars {
        let (subscription, announced) = subscribe_acquired(server, lock);
        let bin = env!("CARGO_BIN_EXE_redlock-sidecar");
        let redis = urls.join(",");
        let procs = (0..count)
            .map(|i| {
                let port = support::free_port();
                let identity = format!("sidecar-{i}");
                let log = std::env::temp_dir().join(format!(
                    "redlock-fleet-{}-{identity}.log",
                    std::process::id()
                ));
                let stderr = std::fs::File::create(&log).expect("a log file");
                let mut command = Command::new(bin);
                // Defaults are the defaults: no setting comes from this environment.
                for (name, _) in std::env::vars_os() {
                    if name.to_string_lossy().starts_with("REDLOCK_") {
                        command.env_remove(name);
                    }
                }
                let child = command
                    .args([
                        "run",
                        "--control-listen",
                        "127.0.0.1:0",
                        "--lock",
                        lock,
                        "--redis",
                        &redis,
                        "--listen",
                        &format!("127.0.0.1:{port}"),
                        "--identity",
                        &identity,
                        "--kubernetes",
                        "off",
                    ])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(stderr)
                    .spawn()
                    .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
                SidecarProcess {
                    child,
                    identity,
                    log,
                    ended: false,
                }
            })
            .collect();
        Sidecars {
            procs,
            announced,
            subscription,
            leader: None,
            tenures: 0,
        }
    }

    /// The next announcement before `deadline`.
    fn next(&mut self, deadline: Instant) -> Option<Announced> {
        let left = deadline.saturating_duration_since(Instant::now());
        match self.announced.recv_timeout(left) {
            Ok(Ok(announced)) => {
                self.leader = Some(announced.winner);
                self.tenures += 1;
                Some(announced)
            }
            Ok(Err(why)) => panic!("the acquisition channel subscription ended: {why}"),
            Err(_) => None,
        }
    }

    /// The last winner announced, unless it was signalled to end since.
    fn leader(&self) -> Option<usize> {
        self.leader.filter(|&i| !self.procs[i].ended)
    }

    /// Waits until a sidecar leads and every sidecar is subscribed on every node (the
    /// acquisition channel's subscribers, the bench's own on node 0 besides).
    fn wait_ready(&mut self, servers: &[RedisServer], lock: &str, deadline: Instant) {
        while self.leader.is_none() {
            if self.next(deadline).is_none() {
                panic!("no sidecar announced a won round before the deadline");
            }
        }
        let channel = acquired_channel(lock);
        for (n, server) in servers.iter().enumerate() {
            let want = self.procs.len() + usize::from(n == 0);
            loop {
                let reply = server.cmd(&["PUBSUB", "NUMSUB", &channel]);
                let have: usize = reply
                    .lines()
                    .nth(1)
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                if have == want {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "node {n}: {have} subscribers of the acquisition channel, expected {want}"
                );
                // Subscriptions come up as the processes start: read again shortly.
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    /// Reads announcements until `deadline`.
    fn drain(&mut self, deadline: Instant) {
        while self.next(deadline).is_some() {}
    }

    /// Waits for a won round of a sidecar other than `old`: (it, when it was announced).
    fn new_leader(&mut self, old: usize, deadline: Instant) -> Option<(usize, u64)> {
        loop {
            let announced = self.next(deadline)?;
            if announced.winner != old && !self.procs[announced.winner].ended {
                return Some((announced.winner, announced.at));
            }
        }
    }

    /// Sends `sig` to sidecar `i`, which no longer counts as a contender.
    fn signal(&mut self, i: usize, sig: i32) {
        let p = &mut self.procs[i];
        p.ended = true;
        // SAFETY: kill(2) on our own child, not reaped yet (reaped on drop).
        let rc = unsafe { libc::kill(p.child.id() as i32, sig) };
        assert_eq!(rc, 0, "kill({}, {sig}) failed", p.child.id());
    }

    /// CPU time of every sidecar still running, in µs (see [`process_cpu_usec`]).
    fn cpu_usec(&self) -> (f64, f64) {
        sum_cpu(
            self.procs
                .iter()
                .filter(|p| !p.ended)
                .filter_map(|p| process_cpu_usec(p.child.id())),
        )
    }

    fn log_text(&self, i: usize) -> String {
        std::fs::read_to_string(&self.procs[i].log).unwrap_or_default()
    }
}

impl Drop for Sidecars {
    fn drop(&mut self) {
        let _ = self.subscription.shutdown(std::net::Shutdown::Both);
        for p in &mut self.procs {
            let _ = p.child.kill();
            let _ = p.child.wait();
            let _ = std::fs::remove_file(&p.log);
        }
    }
}

/// A process' CPU time so far, in µs: (utime + stime from `/proc/PID/stat`, in clock ticks;
/// on-CPU time from `/proc/PID/task/*/schedstat`, in ns, summed over its threads now).
fn process_cpu_usec(pid: u32) -> Option<(f64, f64)> {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of stat(5); `fields[0]` is field 3.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    let sched_ns: u64 = std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    Some(((utime + stime) / hz * 1e6, sched_ns as f64 / 1e3))
}

/// Sums per-process CPU times.
fn sum_cpu(times: impl Iterator<Item = (f64, f64)>) -> (f64, f64) {
    times.fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y))
}

/// The acquisition channel of `lock` (database 0).
fn acquired_channel(lock: &str) -> String {
    Channels::new(&format!("redlock:{{{lock}}}"), 0).acquired
}

/// Subscribes to `lock`'s acquisition channel on `server` (returning once the server has
/// confirmed) and reads it in a thread: every announcement of a sidecar's won round, stamped
/// with the monotonic clock as it is read. Returns a handle on the socket and the receiver.
fn subscribe_acquired(
    server: &RedisServer,
    lock: &str,
) -> (
    std::net::TcpStream,
    mpsc::Receiver<Result<Announced, String>>,
) {
    let channel = acquired_channel(lock);
    let stream = std::net::TcpStream::connect((std::net::Ipv4Addr::LOCALHOST, server.port))
        .expect("connect to node 0");
    let _ = stream.set_nodelay(true);
    (&stream)
        .write_all(&support::encode_command(&["SUBSCRIBE", &channel]))
        .expect("SUBSCRIBE");
    let mut reader = BufReader::new(stream.try_clone().expect("a second handle"));
    let confirmed = support::read_reply(&mut reader).expect("SUBSCRIBE answered");
    assert!(
        confirmed.starts_with("subscribe\n"),
        "SUBSCRIBE answered {confirmed:?}"
    );
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || loop {
        let reply = support::read_reply(&mut reader);
        let at = mono_ns();
        let text = match reply {
            Ok(text) => text,
            Err(why) => {
                let _ = tx.send(Err(why));
                return;
            }
        };
        // `message`, the channel, the payload: `v1 <token> <validity> <waiters> <identity>`.
        let mut parts = text.splitn(3, '\n');
        let (Some("message"), Some(_), Some(payload)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let winner = Acquired::parse(payload).and_then(|a| {
            a.identity
                .strip_prefix("sidecar-")
                .and_then(|i| i.parse().ok())
        });
        let Some(winner) = winner else {
            let _ = tx.send(Err(format!(
                "an announcement not from a sidecar: {payload:?}"
            )));
            return;
        };
        if tx.send(Ok(Announced { winner, at })).is_err() {
            return;
        }
    });
    (stream, rx)
}

/// S standbys and one leader as sidecar processes: per-node cost over the window, the
/// sidecars' CPU, takeovers after SIGTERM (the leader releases) and after SIGKILL.
fn run_sidecars(servers: &[RedisServer], urls: &[String], s: usize, args: &Args) -> Row {
    let shape = Shape::Standbys(s);
    let count = shape.per_lock();
    let mut row = Row::new(shape);
    println!("### {} — {}\n", shape.name(), mode_name(args));
    let lock = format!("fleet-{}", mono_ns() % 1_000_000);
    let setup_start = Instant::now();
    let mut fleet = Sidecars::spawn(&servers[0], urls, &lock, count);
    fleet.wait_ready(servers, &lock, setup_start + Duration::from_secs(60));
    row.setup = setup_start.elapsed();
    // The first tenure is the start, not a change.
    let tenures_at_start = fleet.tenures;
    eprintln!(
        "fleet: {} — {count} sidecars up in {:.1} s",
        shape.name(),
        row.setup.as_secs_f64()
    );
    fleet.drain(Instant::now() + Duration::from_secs(args.warmup));
    let window = Window::open(servers, fleet.cpu_usec());
    fleet.drain(window.end(args.secs));
    window.close(servers, fleet.cpu_usec(), &mut row);
    row.leaders_changed = fleet.tenures - tenures_at_start;

    // Takeovers after SIGTERM: the leader releases on its way out; from the signal to the
    // event of the sidecar that leads next.
    let (planned, note) = release_plan(shape, args.releases);
    row.releases_planned = planned;
    row.release_note = note;
    for k in 0..planned {
        let Some(old) = fleet.leader() else {
            row.release_note = Some(format!("release {} of {planned}: nobody leads", k + 1));
            break;
        };
        std::thread::sleep(SETTLE_BEFORE_RELEASE);
        let signalled = mono_ns();
        fleet.signal(old, libc::SIGTERM);
        match fleet.new_leader(old, Instant::now() + Duration::from_secs(30)) {
            Some((_, at)) => row
                .takeover_release
                .push(Duration::from_nanos(at.saturating_sub(signalled))),
            None => {
                let why = format!(
                    "release {} of {planned}: no sidecar led within 30 s of SIGTERM to {}",
                    k + 1,
                    fleet.procs[old].identity
                );
                eprintln!(
                    "fleet: {}: {why}; its log:\n{}",
                    shape.name(),
                    fleet.log_text(old)
                );
                row.release_note = Some(why);
                break;
            }
        }
    }

    // Takeover after SIGKILL: from the moment the key is gone on a quorum of nodes.
    if let Some(old) = fleet.leader() {
        let key = format!("redlock:{{{lock}}}");
        let crashed = mono_ns();
        fleet.signal(old, libc::SIGKILL);
        let mut expiries: Vec<u64> = servers
            .iter()
            .filter_map(|s| {
                let read_at = mono_ns();
                let pttl: i64 = s.cmd(&["PTTL", &key]).parse().ok()?;
                Some(read_at + pttl.max(0) as u64 * 1_000_000)
            })
            .collect();
        expiries.sort_unstable();
        let free_at = expiries.get(NODES / 2).copied();
        if let (Some((_, at)), Some(free)) =
            (fleet.new_leader(old, Instant::now() + TTL * 3), free_at)
        {
            row.takeover_crash = Some(Duration::from_nanos(at.saturating_sub(free)));
            row.crash_wait = Some(Duration::from_nanos(at.saturating_sub(crashed)));
        } else {
            eprintln!(
                "fleet: {}: no sidecar led within {} s of SIGKILL to {}",
                shape.name(),
                (TTL * 3).as_secs(),
                fleet.procs[old].identity
            );
        }
    }
    drop(fleet);
    for server in servers {
        server.cmd(&["FLUSHALL"]);
    }
    support::settle(servers);
    print_row(&row, args);
    row
}

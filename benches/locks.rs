//! Request-lock benchmark: lock cycles (acquire + release) per second and their p50/p99
//! through the sidecar's HTTP API, through the library, through rslock and through the floor,
//! on 1, 3 and 5 local `redis-server` nodes, with the Redis CPU each cycle costs each node;
//! then the hand-over of one hot name between waiters (in one sidecar, and between two).
//!
//! `cargo bench --bench locks` (Cargo builds the binary first, into `target/release`). Prints
//! a markdown table, then one line per goal of issue 28 with the figure and the goal. It is
//! not a timed test.
//!
//! Knobs (environment):
//! - `BENCH_QUICK=1`: a CI-sized run (4 rounds of 25 cycles, 10 hand-overs; seconds).
//! - `BENCH_ROUNDS` (default 20), `BENCH_BATCH` (default 50): each row has
//!   `BENCH_ROUNDS × BENCH_BATCH` cycles, run in interleaved batches (every path one batch,
//!   round after round, on the same nodes), so whatever else loads the machine hits every
//!   row alike.
//! - `BENCH_HANDOVERS` (default 100): hand-overs per kind per node count (the floor is a
//!   kind), in batches of 10.
//! - `BENCH_WAITER_IDLE_US` (default 30000): how long a hand-over's waiter waits, known to be
//!   waiting, before the holder releases (every kind alike; see [`waiter_idle`]).
//! - `REDLOCK_BIN`: measure another sidecar binary.
//!
//! Paths, each from one client doing sequential cycles:
//! - **floor**: `SET key val NX PX ttl` on all N nodes at once, then a compare-and-delete
//!   script (EVALSHA) on all N at once, on one `redis` `MultiplexedConnection` per node: the
//!   least any Redlock can do.
//! - **rslock 0.10**: `LockManager::lock` then `unlock` (no retries).
//! - **library**: `Redlock::try_acquire` then `release`, every lock on ONE shared
//!   `redlock::Engine` (one connection per node), as the sidecar arranges its request locks:
//!   for many names a new `Redlock::on` the engine per name, for the hot name one `Redlock`
//!   kept (what the sidecar keeps for a name in use).
//! - **service in-process**: the sidecar's request-lock service (`locks::Locks` over
//!   `RedlockEngine`) in the bench's process: `acquire` then `release`, no HTTP.
//! - **http**: `POST /v1/locks/NAME?ttl=10s` then `DELETE /v1/locks/NAME/LEASE` on one
//!   kept-alive connection with `TCP_NODELAY`, as a pooling HTTP client does.
//!
//! "Many names" takes a new name every cycle; "hot name" one name for every cycle.
//! **Redis CPU** is `used_cpu_sys + used_cpu_user` (`INFO cpu`) over each batch, summed over
//! the nodes, divided by cycles and nodes; it includes what the idle sidecars do meanwhile.
//!
//! Hand-over: a client holds the hot name, a second client waits for it (`wait=10s`) in the
//! same sidecar or in a second one; measured from the holder's `DELETE` being sent to the
//! waiter's 200. The holder releases once the waiter's sidecar counts it waiting
//! (`redlock_app_lock_waiting`) and `BENCH_WAITER_IDLE_US` later. Beside it, in batches taking turns with the sidecar's, the **hand-over
//! floor**: the least any Redlock hand-over can cost with bare commands on the same nodes. A
//! holder's compare-and-delete script that also PUBLISHes the release (EVALSHA on all N at
//! once); a waiter SUBSCRIBEd on every node (as the engine is) that, on the first
//! announcement, sends `SET NX PX` to all N at once and counts a quorum; measured from the
//! release being sent to the waiter's quorum of grants. Two more kinds take their turns
//! with them: the **floor + lineage read** (the waiter's `SET` in a script that also reads
//! `INFO server replication`, as rule 2 makes every grant do), and the **hand-over between two
//! request-lock services in this process** (no HTTP, no other process to wake: what the
//! engine's own release, announcement and round cost). A last kind is the hand-over between
//! the sidecars once more, with each sidecar's control thread answering one request without
//! Redis just before the release (**warm**): what waking idle processes costs the hand-over.
//!
//! - **HTTP, two answers without Redis**: two `POST .../keepalive` for a lease nobody has
//!   (404 from the lease table): the transport part of the HTTP hop, without the service.
//!
//! Goal lines: `http_hop_p50_us` is the HTTP p50 less the library p50 on the same arrangement
//! (one shared engine; a new name per cycle for both, or the hot name for both), in the same
//! run, with what it adds over its own floor (the two answers without Redis) and the ratio;
//! `hot_handover_p50_us` per kind; `hot_handover_floor_p50_us` and `hot_handover_over_floor`
//! (each kind's p50 over the floor's, same run); `hot_handover_floor_lineage_p50_us` with the
//! in-process services against it and what the sidecars add over those.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use futures_util::{Stream, StreamExt};
use rand::Rng;
use redis::aio::MultiplexedConnection;
use redis::Script;
use redlock_sidecar::locks::{Locks, RedlockEngine};
use redlock_sidecar::metrics::{AppLockMetrics, Metrics};
use redlock_sidecar::redlock::{Engine, NoObserver, Redlock, RedlockConfig};
use support::{env_usize, fmt_dur, free_port, info_field, RedisServer, Samples};

const NODE_COUNTS: [usize; 3] = [1, 3, 5];
const TTL: Duration = Duration::from_secs(10);
const HANDOVER_GOAL_US: f64 = 1000.0;
const HOP_GOAL_US: f64 = 100.0;
/// How long every hand-over's waiter waits, known to be waiting, before the release: the
/// same for the floor and the sidecars, so none is measured warmer (threads just woken by the
/// check that it waits) than another. Idle threads wake slower: on 2 shared cores the floor
/// took 142, 207 and 420 µs p50 (N = 1) after 0, 5 and 30 ms, and the sidecars about 2.5×
/// that each time. 30 ms by default, as the figures before the floor were measured.
fn waiter_idle() -> Duration {
    Duration::from_micros(env_usize("BENCH_WAITER_IDLE_US", 30_000) as u64)
}

/// Hand-overs per batch: the floor and the two sidecar kinds take turns by batches.
const HANDOVER_BATCH: usize = 10;
/// A keepalive for a lease nobody has: answered from the lease table alone.
const UNKNOWN_LEASE: &str = "/v1/locks/bench/00000000000000000000000000000000/keepalive";

static CAD: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
    )
});

/// Compare-and-delete that announces the release (ARGV[2]: the channel), as the engine's
/// release script does.
static CAD_PUBLISH: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) \
         redis.call('PUBLISH', ARGV[2], ARGV[1]) return 1 end return 0",
    )
});

fn binary() -> PathBuf {
    std::env::var_os("REDLOCK_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_redlock-sidecar")))
}

/// A sidecar child with its control listener's and admin listener's addresses.
struct Sidecar {
    child: Child,
    control: String,
    admin: String,
}

impl Sidecar {
    fn start(name: &str, urls: &str) -> Sidecar {
        let control = format!("127.0.0.1:{}", free_port());
        let admin = format!("127.0.0.1:{}", free_port());
        let child = Command::new(binary())
            .args(["run", "--lock", "bench-leader", "--redis", urls])
            .args([
                "--node-set",
                "bench",
                "--identity",
                name,
                "--kubernetes",
                "off",
            ])
            .args(["--listen", &admin])
            .args(["--control-listen", &control])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the sidecar binary runs");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(&control).is_err() {
            assert!(Instant::now() < deadline, "the control listener serves");
            std::thread::sleep(Duration::from_millis(10));
        }
        Sidecar {
            child,
            control,
            admin,
        }
    }

    /// Request-lock acquisitions waiting in this sidecar now (`redlock_app_lock_waiting`).
    fn waiting(&self) -> u64 {
        let (status, body) = Conn::open(&self.admin).call("GET", "/metrics");
        assert_eq!(status, 200, "/metrics");
        body.lines()
            .find(|l| {
                l.starts_with("redlock_app_lock_waiting{")
                    || l.starts_with("redlock_app_lock_waiting ")
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .expect("the waiting gauge") as u64
    }

    /// Returns once an acquisition waits in this sidecar.
    fn await_waiter(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.waiting() == 0 {
            assert!(Instant::now() < deadline, "the waiter reaches the sidecar");
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One kept-alive HTTP/1.1 connection with `TCP_NODELAY`.
struct Conn(BufReader<TcpStream>);

impl Conn {
    fn open(addr: &str) -> Conn {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_nodelay(true).unwrap();
        Conn(BufReader::new(stream))
    }

    /// Sends a request without a body; returns the status and the body.
    fn call(&mut self, method: &str, path: &str) -> (u16, String) {
        let request =
            format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n");
        self.0.get_mut().write_all(request.as_bytes()).unwrap();
        let mut line = String::new();
        self.0.read_line(&mut line).unwrap();
        let status = line.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
        let mut length = 0;
        loop {
            line.clear();
            self.0.read_line(&mut line).unwrap();
            if line == "\r\n" || line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0; length];
        self.0.read_exact(&mut body).unwrap();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    fn acquire(&mut self, path: &str) -> String {
        let (status, body) = self.call("POST", path);
        assert_eq!(status, 200, "{path}: {body}");
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        json["lease"].as_str().unwrap().to_owned()
    }

    fn release(&mut self, name: &str, lease: &str) {
        let (status, body) = self.call("DELETE", &format!("/v1/locks/{name}/{lease}"));
        assert_eq!(status, 200, "{body}");
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    Floor,
    /// The floor with its `SET NX PX` in a script that also reads the lineage (rule 2).
    FloorLineage,
    Rslock,
    Library,
    /// The sidecar's request-lock service in this process, without HTTP.
    Service,
    Http,
    /// Two requests the sidecar answers without Redis: what HTTP itself costs.
    HttpNoRedis,
}

impl Path {
    fn label(self, hot: bool) -> &'static str {
        match (self, hot) {
            (Path::Floor, false) => "floor (SET NX PX + CAD), many names",
            (Path::Floor, true) => "floor (SET NX PX + CAD), hot name",
            (Path::FloorLineage, _) => "floor + lineage read in the SET's script, hot name",
            (Path::Rslock, false) => "rslock 0.10, many names",
            (Path::Rslock, true) => "rslock 0.10, hot name",
            (Path::Library, false) => "library, many names (one shared engine)",
            (Path::Library, true) => "library, hot name (one shared engine)",
            (Path::Service, false) => "service in-process (no HTTP), many names",
            (Path::Service, true) => "service in-process (no HTTP), hot name",
            (Path::Http, false) => "HTTP, many names",
            (Path::Http, true) => "HTTP, hot name",
            (Path::HttpNoRedis, _) => "HTTP, two answers without Redis (404 keepalive)",
        }
    }
}

const PATHS: [(Path, bool); 12] = [
    (Path::Floor, false),
    (Path::Floor, true),
    (Path::FloorLineage, true),
    (Path::Rslock, false),
    (Path::Rslock, true),
    (Path::Library, false),
    (Path::Library, true),
    (Path::Service, false),
    (Path::Service, true),
    (Path::Http, false),
    (Path::Http, true),
    (Path::HttpNoRedis, false),
];

/// One row: cycle latencies, time spent in cycles, Redis CPU seconds over all nodes.
#[derive(Default)]
struct Row {
    samples: Samples,
    busy: Duration,
    redis_cpu: f64,
}

/// The clients of one node count.
struct Clients {
    urls: Vec<String>,
    conns: Vec<MultiplexedConnection>,
    rslock: rslock::LockManager,
    /// The library's engine: every library lock shares its connections.
    shared: Engine,
    hot_lock: Redlock,
    service: Arc<Locks<RedlockEngine>>,
    http: Conn,
    /// A fresh name each cycle.
    serial: usize,
}

fn library_config(urls: &[String], lock: &str) -> RedlockConfig {
    support::engine_config(urls, lock, "bench-library", TTL)
}

/// The library lock `lock` on `shared`'s connections.
fn library_lock(shared: &Engine, urls: &[String], lock: &str) -> Redlock {
    Redlock::on(shared, library_config(urls, lock), Arc::new(NoObserver)).expect("valid config")
}

/// The request-lock service as the sidecar builds it, in this process, in namespace `svc`,
/// with its metrics.
fn service(urls: &[String], identity: &str) -> (Arc<Locks<RedlockEngine>>, AppLockMetrics) {
    let cfg = support::engine_config(urls, "bench-service", identity, TTL);
    let metrics = Metrics::new(identity, &[], None).app_locks().clone();
    let locks = Locks::new(
        RedlockEngine::standalone(cfg, "svc").expect("an engine"),
        1024,
        metrics.clone(),
    );
    (locks, metrics)
}

/// The hand-over of `bench-handover` between two request-lock services in this process (no
/// HTTP, no other process to wake): the holder's release called → the waiter's grant, with
/// the same waiting and idle time as [`handovers`].
fn service_handovers(
    rt: &tokio::runtime::Runtime,
    holder: &Arc<Locks<RedlockEngine>>,
    waiter: &(Arc<Locks<RedlockEngine>>, AppLockMetrics),
    count: usize,
) -> Samples {
    const NAME: &str = "bench-handover";
    let mut samples = Samples::default();
    for _ in 0..count {
        let held = rt
            .block_on(holder.acquire(NAME, TTL, Duration::from_secs(10), None))
            .expect("the service holder gets the name");
        let (locks, metrics) = waiter;
        let waiting = rt.spawn({
            let locks = Arc::clone(locks);
            async move {
                let granted = locks
                    .acquire(NAME, TTL, Duration::from_secs(10), None)
                    .await
                    .expect("the service waiter gets the name");
                let answered = Instant::now();
                locks.release(NAME, granted.lease).await.expect("released");
                answered
            }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while metrics.waiting() == 0 {
            assert!(Instant::now() < deadline, "the service waiter waits");
            std::thread::sleep(Duration::from_micros(200));
        }
        std::thread::sleep(waiter_idle());
        let released = Instant::now();
        rt.block_on(holder.release(NAME, held.lease))
            .expect("the holder releases");
        let answered = rt.block_on(waiting).expect("the waiter does not panic");
        samples.push(answered.saturating_duration_since(released));
    }
    samples
}

fn random_value() -> String {
    format!("{:032x}", rand::rng().random::<u128>())
}

/// `SET key value NX PX ttl` on one node: whether it granted.
/// With `lineage`, in a script that also reads the server's lineage, as the engine's granting
/// script does ([`support::SET_READING_LINEAGE`]).
async fn set_nx(conn: &MultiplexedConnection, key: &str, value: &str, lineage: bool) -> bool {
    let mut c = conn.clone();
    let reply = support::set_nx(&mut c, key, value, TTL.as_millis() as u64, lineage).await;
    matches!(reply, Ok(Some(_)))
}

/// [`set_nx`] on all `conns` at once: which granted.
async fn set_nx_all(
    conns: &[MultiplexedConnection],
    key: &str,
    value: &str,
    lineage: bool,
) -> Vec<bool> {
    join_all(conns.iter().map(|c| set_nx(c, key, value, lineage))).await
}

/// Compare-and-delete of `value` on all `conns` at once (`script`: [`CAD`], or [`CAD_PUBLISH`]
/// with the channel as its second argument): on how many nodes it deleted.
async fn delete_all(
    conns: &[MultiplexedConnection],
    script: &Script,
    key: &str,
    args: &[&str],
) -> usize {
    let deleted = join_all(conns.iter().map(|c| {
        let mut c = c.clone();
        async move {
            let mut invocation = script.key(key);
            for arg in args {
                invocation.arg(*arg);
            }
            invocation.invoke_async::<i64>(&mut c).await
        }
    }))
    .await;
    deleted.iter().filter(|r| matches!(r, Ok(1))).count()
}

async fn floor_cycle(conns: &[MultiplexedConnection], key: &str, lineage: bool) {
    let value = random_value();
    let granted = set_nx_all(conns, key, &value, lineage).await;
    assert!(granted.iter().all(|g| *g), "the floor is uncontended");
    let deleted = delete_all(conns, &CAD, key, &[&value]).await;
    assert_eq!(deleted, conns.len(), "the floor deletes its own keys");
}

/// The hand-over floor's key and the channel its release announces on.
const FLOOR_HANDOVER_KEY: &str = "floor:bench-handover";
const FLOOR_HANDOVER_CHANNEL: &str = "floor:bench-handover:released";

/// Release announcements of the hand-over floor: (node, released value), from every node.
type Announcements = Pin<Box<dyn Stream<Item = (usize, String)> + Send>>;

/// A waiter SUBSCRIBEd to the floor's release channel on every node, as the engine subscribes
/// to a lock's release channel on every node.
async fn floor_subscribe(urls: &[String]) -> Announcements {
    let mut streams = Vec::new();
    for (node, url) in urls.iter().enumerate() {
        let client = redis::Client::open(url.as_str()).expect("valid url");
        let mut pubsub = client.get_async_pubsub().await.expect("pub/sub connection");
        pubsub
            .subscribe(FLOOR_HANDOVER_CHANNEL)
            .await
            .expect("subscribed");
        streams.push(
            pubsub
                .into_on_message()
                .map(move |msg| (node, msg.get_payload::<String>().unwrap_or_default())),
        );
    }
    Box::pin(futures_util::stream::select_all(streams))
}

/// The least any Redlock hand-over can cost with bare commands on these nodes: a holder's
/// compare-and-delete that PUBLISHes (on all nodes at once); the subscribed waiter, on the
/// first announcement of that release from any node, sends `SET NX PX` to all nodes at once
/// and counts a quorum (a node that refused, its release not run yet, is asked again when its
/// own announcement comes). Measured from the release being sent to the waiter's quorum.
/// With `lineage`, the waiter's `SET`s also read the server's lineage (rule 2).
/// Returns the time and whether the waiter needed a second ask.
async fn floor_handover(
    conns: &[MultiplexedConnection],
    announcements: &mut Option<Announcements>,
    lineage: bool,
) -> (Duration, bool) {
    let key = FLOOR_HANDOVER_KEY;
    let held = random_value();
    let granted = set_nx_all(conns, key, &held, false).await;
    assert!(granted.iter().all(|g| *g), "the floor holder is alone");
    let mut messages = announcements.take().expect("subscribed");
    let waiter_conns = conns.to_vec();
    let expected = held.clone();
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let waiter = tokio::spawn(async move {
        let conns = waiter_conns;
        let quorum = conns.len() / 2 + 1;
        let value = random_value();
        let _ = ready_tx.send(());
        let mut granted = vec![false; conns.len()];
        let mut asked_again = false;
        let mut first = true;
        while granted.iter().filter(|g| **g).count() < quorum {
            // Announcements of earlier hand-overs (from the other nodes) are not this one's.
            let node = loop {
                let (node, released) = messages.next().await.expect("subscribed");
                if released == expected {
                    break node;
                }
            };
            if first {
                first = false;
                granted = set_nx_all(&conns, key, &value, lineage).await;
            } else if !granted[node] {
                asked_again = true;
                granted[node] = set_nx(&conns[node], key, &value, lineage).await;
            }
        }
        let answered = Instant::now();
        let deleted = delete_all(&conns, &CAD, key, &[&value]).await;
        assert!(deleted >= quorum, "the floor waiter deletes its own keys");
        (answered, asked_again, messages)
    });
    ready_rx.await.expect("the waiter runs");
    tokio::time::sleep(waiter_idle()).await;
    let released = Instant::now();
    let deleted = delete_all(conns, &CAD_PUBLISH, key, &[&held, FLOOR_HANDOVER_CHANNEL]).await;
    assert_eq!(
        deleted,
        conns.len(),
        "the floor holder releases on every node"
    );
    let (answered, asked_again, messages) = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the floor waiter gets a quorum")
        .expect("the floor waiter does not panic");
    *announcements = Some(messages);
    (answered.saturating_duration_since(released), asked_again)
}

/// One cycle on `path`; its latency.
fn cycle(rt: &tokio::runtime::Runtime, c: &mut Clients, path: Path, hot: bool) -> Duration {
    c.serial += 1;
    let name = if hot {
        "bench-hot".to_owned()
    } else {
        format!("bench-{}", c.serial)
    };
    let start = Instant::now();
    match path {
        Path::Floor => rt.block_on(floor_cycle(&c.conns, &format!("floor:{name}"), false)),
        Path::FloorLineage => rt.block_on(floor_cycle(&c.conns, &format!("floor:{name}"), true)),
        Path::Rslock => rt.block_on(async {
            let lock = c
                .rslock
                .lock(format!("rslock:{name}").as_str(), TTL)
                .await
                .expect("rslock: uncontended");
            c.rslock.unlock(&lock).await;
        }),
        Path::Library => rt.block_on(async {
            let fresh;
            let lock = if hot {
                &c.hot_lock
            } else {
                fresh = library_lock(&c.shared, &c.urls, &format!("lib:{name}"));
                &fresh
            };
            // A first round on fresh connections may not count a node yet (its server is
            // learnt in that round): the next round does, as the sidecar's own acquisition
            // retries.
            let mut tries = 0;
            let lease = loop {
                tries += 1;
                match lock.try_acquire().await {
                    Ok(lease) => break lease,
                    Err(e) if tries >= 3 => panic!("library: uncontended: {e:?}"),
                    Err(_) => {}
                }
            };
            lock.release(&lease).await;
        }),
        Path::Service => rt.block_on(async {
            let granted = c
                .service
                .acquire(&name, TTL, Duration::ZERO, None)
                .await
                .expect("service: uncontended");
            c.service
                .release(&name, granted.lease)
                .await
                .expect("service: release");
        }),
        Path::Http => {
            let lease = c.http.acquire(&format!("/v1/locks/{name}?ttl=10s"));
            c.http.release(&name, &lease);
        }
        Path::HttpNoRedis => {
            for _ in 0..2 {
                let (status, body) = c.http.call("POST", UNKNOWN_LEASE);
                assert_eq!(status, 404, "{body}");
            }
        }
    }
    start.elapsed()
}

/// `used_cpu_sys + used_cpu_user` of every server, summed, in seconds.
fn redis_cpu(servers: &[RedisServer]) -> f64 {
    servers
        .iter()
        .map(|s| {
            let info = s.cmd(&["INFO", "cpu"]);
            let field = |f| {
                info_field(&info, f)
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .unwrap_or(0.0)
            };
            field("used_cpu_sys") + field("used_cpu_user")
        })
        .sum()
}

/// The hand-over of `bench-handover` from a holder on `from` to a waiter on `to`: DELETE sent
/// → the waiter's 200. With `warm`, each sidecar's control thread answers one request
/// without Redis just before the release (as a sidecar serving other requests would be):
/// the same hand-over without waking idle processes.
fn handovers(from: &Sidecar, to: &Sidecar, count: usize, warm: bool) -> Samples {
    let mut samples = Samples::default();
    let mut holder = Conn::open(&from.control);
    let mut waiter = Some(Conn::open(&to.control));
    // A second connection to the waiter's sidecar: the first waits in its request.
    let mut warmer = warm.then(|| Conn::open(&to.control));
    for _ in 0..count {
        let lease = holder.acquire("/v1/locks/bench-handover?ttl=10s");
        let mut conn = waiter.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiting = std::thread::spawn(move || {
            tx.send(()).unwrap();
            let lease = conn.acquire("/v1/locks/bench-handover?ttl=10s&wait=10s");
            let answered = Instant::now();
            conn.release("bench-handover", &lease);
            (answered, conn)
        });
        rx.recv().unwrap();
        // The waiter's request waits in its sidecar: counted as it enters the lease table, a
        // few steps before its engine lock takes the release announcements (on subscriptions
        // made in the warm-up, kept while the name is in use).
        to.await_waiter();
        std::thread::sleep(waiter_idle());
        if let Some(warmer) = &mut warmer {
            for conn in [&mut holder, warmer] {
                let (status, body) = conn.call("POST", UNKNOWN_LEASE);
                assert_eq!(status, 404, "{body}");
            }
        }
        let released = Instant::now();
        holder.release("bench-handover", &lease);
        let (answered, conn) = waiting.join().unwrap();
        waiter = Some(conn);
        samples.push(answered.saturating_duration_since(released));
    }
    samples
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn print_row(what: &str, nodes: usize, row: &Row) {
    let rate = row.samples.len() as f64 / row.busy.as_secs_f64().max(1e-9);
    let cpu_us = row.redis_cpu * 1e6 / (row.samples.len().max(1) * nodes) as f64;
    println!(
        "| {what} | {nodes} | {rate:.0} | {} | {} | {cpu_us:.1} µs | {} |",
        fmt_dur(row.samples.pct(50.0)),
        fmt_dur(row.samples.pct(99.0)),
        row.samples.len()
    );
}

fn print_handover(what: &str, nodes: usize, s: &Samples) {
    println!(
        "| {what} | {nodes} | | {} | {} | | {} |",
        fmt_dur(s.pct(50.0)),
        fmt_dur(s.pct(99.0)),
        s.len()
    );
}

fn met(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "NOT met"
    }
}

fn main() {
    let quick = std::env::var_os("BENCH_QUICK").is_some_and(|v| v != "0" && !v.is_empty());
    let rounds = env_usize("BENCH_ROUNDS", if quick { 4 } else { 20 });
    let batch = env_usize("BENCH_BATCH", if quick { 25 } else { 50 });
    let count = env_usize("BENCH_HANDOVERS", if quick { 10 } else { 100 });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!("{}", support::machine());
    println!(
        "{rounds} rounds × {batch} cycles per path, interleaved; {count} hand-overs per kind{}",
        if quick { " (quick mode)" } else { "" }
    );
    println!();
    println!("| path | nodes | cycles/s | p50 | p99 | Redis CPU per cycle per node | samples |");
    println!("|---|---|---|---|---|---|---|");
    let mut goals = Vec::new();
    for nodes in NODE_COUNTS {
        let servers: Vec<RedisServer> = (0..nodes).map(|_| RedisServer::start()).collect();
        support::settle(&servers);
        let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
        let joined = urls.join(",");
        let a = Sidecar::start("bench-a", &joined);
        let b = Sidecar::start("bench-b", &joined);
        let conns = rt.block_on(async {
            let mut conns = Vec::new();
            for url in &urls {
                let client = redis::Client::open(url.as_str()).expect("valid url");
                conns.push(client.get_multiplexed_async_connection().await.unwrap());
            }
            conns
        });
        let mut rslock = rslock::LockManager::new(urls.clone());
        rslock.set_retry(1, Duration::from_millis(10));
        let shared = Engine::new(&library_config(&urls, "lib")).expect("valid config");
        rt.block_on(shared.connect(Duration::from_secs(2)));
        let mut clients = Clients {
            hot_lock: rt.block_on(async { library_lock(&shared, &urls, "lib:bench-hot") }),
            shared,
            service: service(&urls, "bench-service").0,
            urls,
            conns,
            rslock,
            http: Conn::open(&a.control),
            serial: 0,
        };
        // Warm up: connections, scripts, the sidecar's first rounds.
        for &(path, hot) in &PATHS {
            for _ in 0..10 {
                cycle(&rt, &mut clients, path, hot);
            }
        }
        let mut rows: Vec<Row> = PATHS.iter().map(|_| Row::default()).collect();
        for round in 0..rounds {
            // Rotate the order each round, so no path always follows the same one.
            for k in 0..PATHS.len() {
                let i = (k + round) % PATHS.len();
                let (path, hot) = PATHS[i];
                let cpu = redis_cpu(&servers);
                let started = Instant::now();
                for _ in 0..batch {
                    let d = cycle(&rt, &mut clients, path, hot);
                    rows[i].samples.push(d);
                }
                rows[i].busy += started.elapsed();
                rows[i].redis_cpu += redis_cpu(&servers) - cpu;
            }
        }
        for (i, &(path, hot)) in PATHS.iter().enumerate() {
            print_row(path.label(hot), nodes, &rows[i]);
        }
        let cpu_per_cycle = |path, hot| {
            let row = &rows[PATHS.iter().position(|&p| p == (path, hot)).unwrap()];
            row.redis_cpu * 1e6 / (row.samples.len().max(1) * nodes) as f64
        };
        let (bare, lineage) = (
            cpu_per_cycle(Path::Floor, true),
            cpu_per_cycle(Path::FloorLineage, true),
        );
        for (kind, hot) in [("hot_name", true), ("many_names", false)] {
            let library = cpu_per_cycle(Path::Library, hot);
            goals.push(format!(
                "redis_cpu_per_cycle_per_node n={nodes} library {kind} {library:.1} µs ÷ floor {bare:.1} µs = {:.2} (goal ≤ 1.3: {}); ÷ the floor + lineage read {lineage:.1} µs = {:.2}; that floor ÷ the bare floor {:.2}",
                library / bare.max(1e-9),
                met(library <= 1.3 * bare),
                library / lineage.max(1e-9),
                lineage / bare.max(1e-9)
            ));
        }
        let mut announcements = Some(rt.block_on(floor_subscribe(&clients.urls)));
        let svc_holder = service(&clients.urls, "bench-holder").0;
        let svc_waiter = service(&clients.urls, "bench-waiter");
        // Warm up: scripts, connections, the sidecars' engine locks of the name.
        for lineage in [false, true, false] {
            rt.block_on(floor_handover(&clients.conns, &mut announcements, lineage));
        }
        service_handovers(&rt, &svc_holder, &svc_waiter, 3);
        handovers(&a, &a, 3, false);
        handovers(&a, &b, 3, false);
        // The kinds, each row filled in batches taking turns, in a rotating order, so load
        // hits them alike.
        const KINDS: [&str; 6] = [
            "hand-over floor (CAD + PUBLISH → subscribed waiter's SET NX PX quorum)",
            "hand-over floor + lineage read in the waiter's SET script (rule 2)",
            "hand-over between two services in-process (no HTTP)",
            "hand-over of the hot name, waiter in the same sidecar",
            "hand-over of the hot name, waiter in another sidecar",
            "the same between two warm sidecars (each answered a request just before the release)",
        ];
        let mut kinds: [Samples; 6] = Default::default();
        let mut floor_asked_again = 0;
        let mut done = 0;
        let mut round = 0;
        while done < count {
            let n = HANDOVER_BATCH.min(count - done);
            for k in 0..KINDS.len() {
                let kind = (k + round) % KINDS.len();
                let samples = match kind {
                    0 | 1 => {
                        let mut samples = Samples::default();
                        for _ in 0..n {
                            let (d, asked_again) = rt.block_on(floor_handover(
                                &clients.conns,
                                &mut announcements,
                                kind == 1,
                            ));
                            samples.push(d);
                            floor_asked_again += usize::from(asked_again);
                        }
                        samples
                    }
                    2 => service_handovers(&rt, &svc_holder, &svc_waiter, n),
                    3 => handovers(&a, &a, n, false),
                    4 => handovers(&a, &b, n, false),
                    _ => handovers(&a, &b, n, true),
                };
                kinds[kind].0.extend(samples.0);
            }
            done += n;
            round += 1;
        }
        for (what, samples) in KINDS.iter().zip(&kinds) {
            print_handover(what, nodes, samples);
        }
        let [handover_floor, handover_floor_lineage, in_process, within, between, warm] = &kinds;
        let p50 = |path, hot| {
            let i = PATHS.iter().position(|&p| p == (path, hot)).unwrap();
            us(rows[i].samples.pct(50.0))
        };
        let hop = p50(Path::Http, false) - p50(Path::Library, false);
        let hop_hot = p50(Path::Http, true) - p50(Path::Library, true);
        let floor = p50(Path::Floor, true);
        let library = p50(Path::Library, true);
        // The hop's own floor: two requests the sidecar answers without Redis.
        let hop_floor = p50(Path::HttpNoRedis, false);
        for (kind, hop, hot) in [("many_names", hop, false), ("hot_name", hop_hot, true)] {
            goals.push(format!(
                "http_hop_p50_us n={nodes} {kind} {hop:.0} (HTTP {:.0} − library {:.0}, one shared engine each, same run) goal ≤ {HOP_GOAL_US:.0}: {}; over its floor (two answers without Redis, {hop_floor:.0}) {:.0}, ratio {:.2}",
                p50(Path::Http, hot),
                p50(Path::Library, hot),
                met(hop <= HOP_GOAL_US),
                hop - hop_floor,
                hop / hop_floor.max(1.0)
            ));
        }
        goals.push(format!(
            "service_over_library_p50_us n={nodes} {:.0} (the service in-process, no HTTP, less the library; many names)",
            p50(Path::Service, false) - p50(Path::Library, false)
        ));
        goals.push(format!(
            "http_over_service_p50_us n={nodes} {:.0} (HTTP less the service in-process; many names)",
            p50(Path::Http, false) - p50(Path::Service, false)
        ));
        goals.push(format!(
            "http_two_requests_without_redis_p50_us n={nodes} {:.0} (what HTTP itself costs here)",
            p50(Path::HttpNoRedis, false)
        ));
        goals.push(format!(
            "service_hot_over_library_hot_p50_us n={nodes} {:.0} (the service in-process, no HTTP, less the library; hot name)",
            p50(Path::Service, true) - p50(Path::Library, true)
        ));
        goals.push(format!(
            "library_over_floor_p50 n={nodes} {:.2} (library hot {library:.0} µs, floor hot {floor:.0} µs, rslock hot {:.0} µs)",
            library / floor.max(1.0),
            p50(Path::Rslock, true)
        ));
        for (kind, s) in [("same_sidecar", within), ("between_sidecars", between)] {
            let v = us(s.pct(50.0));
            goals.push(format!(
                "hot_handover_p50_us n={nodes} {kind} {v:.0} goal < {HANDOVER_GOAL_US:.0}: {}",
                met(v < HANDOVER_GOAL_US)
            ));
        }
        let floor_p50 = us(handover_floor.pct(50.0));
        goals.push(format!(
            "hot_handover_floor_p50_us n={nodes} {floor_p50:.0} (p99 {:.0}; the waiter asked a node again in {floor_asked_again} of {})",
            us(handover_floor.pct(99.0)),
            handover_floor.len()
        ));
        goals.push(format!(
            "hot_handover_over_floor n={nodes} same_sidecar {:.2} between_sidecars {:.2}",
            us(within.pct(50.0)) / floor_p50.max(1.0),
            us(between.pct(50.0)) / floor_p50.max(1.0)
        ));
        let lineage_p50 = us(handover_floor_lineage.pct(50.0));
        let warm_p50 = us(warm.pct(50.0));
        goals.push(format!(
            "hot_handover_warm_p50_us n={nodes} between_sidecars {warm_p50:.0} ({:.2}× the floor + lineage read {lineage_p50:.0}, same run; both sidecars answered a request just before the release; waking the idle ones cost {:.0} µs of the p50)",
            warm_p50 / lineage_p50.max(1.0),
            us(between.pct(50.0)) - warm_p50
        ));
        let in_process_p50 = us(in_process.pct(50.0));
        goals.push(format!(
            "hot_handover_floor_lineage_p50_us n={nodes} {lineage_p50:.0} (the floor with rule 2's read in the waiter's SET); services in-process {in_process_p50:.0} ({:.2}× that floor); the sidecars over the services in-process: same {:.0} µs, between {:.0} µs",
            in_process_p50 / lineage_p50.max(1.0),
            us(within.pct(50.0)) - in_process_p50,
            us(between.pct(50.0)) - in_process_p50
        ));
    }
    println!();
    for goal in goals {
        println!("{goal}");
    }
}

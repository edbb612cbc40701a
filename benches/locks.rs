//! Request-lock benchmark: lock cycles (acquire + release) through the sidecar's HTTP API
//! beside the library path, on 1 and 3 local `redis-server` nodes, and the hand-over of one
//! hot name between waiters in two sidecars.
//!
//! `cargo bench --bench locks` (Cargo builds the binary first, into `target/release`). Prints
//! a markdown table; it is not a timed test.
//!
//! Rows, each `BENCH_CYCLES` (default 500) sequential cycles from one client:
//! - **http, many names**: `POST /v1/locks/bench-N` then `DELETE`, a new name every cycle, over
//!   one kept-alive connection to the control listener.
//! - **http, hot name**: the same, one name.
//! - **library, many names**: what the sidecar does per name today: a new `Redlock` for the
//!   name, `try_acquire`, `release` (the engine is dropped after each cycle).
//! - **library, hot name**: one `Redlock`, `try_acquire` then `release`.
//! - **hand-over**: sidecar A holds the hot name, sidecar B waits for it (`wait=10s`); the time
//!   from A's `DELETE` being sent to B's 200 (`BENCH_HANDOVERS`, default 50).
//!
//! `REDLOCK_BIN` measures another binary.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redlock_sidecar::redlock::{Credentials, NoObserver, NodeSpec, Redlock, RedlockConfig};
use support::{env_usize, fmt_dur, free_port, RedisServer, Samples};

const NODE_COUNTS: [usize; 2] = [1, 3];
const TTL: Duration = Duration::from_secs(10);

fn binary() -> PathBuf {
    std::env::var_os("REDLOCK_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_redlock-sidecar")))
}

/// A sidecar child with its control listener's address.
struct Sidecar {
    child: Child,
    control: String,
}

impl Sidecar {
    fn start(name: &str, urls: &str) -> Sidecar {
        let control = format!("127.0.0.1:{}", free_port());
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
            .args(["--listen", &format!("127.0.0.1:{}", free_port())])
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
        Sidecar { child, control }
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One kept-alive HTTP/1.1 connection.
struct Conn(BufReader<TcpStream>);

impl Conn {
    fn open(addr: &str) -> Conn {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_nodelay(true).unwrap();
        Conn(BufReader::new(stream))
    }

    /// Sends a request without a body; returns the status and the body.
    fn call(&mut self, method: &str, path: &str) -> (u16, String) {
        let request = format!("{method} {path} HTTP/1.1\r\nHost: b\r\nContent-Length: 0\r\n\r\n");
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
}

fn http_cycles(control: &str, cycles: usize, hot: bool) -> (Samples, Duration) {
    let mut conn = Conn::open(control);
    let mut samples = Samples::default();
    let started = Instant::now();
    for i in 0..cycles {
        let name = if hot {
            "bench-hot".to_owned()
        } else {
            format!("bench-{i}")
        };
        let cycle = Instant::now();
        let lease = conn.acquire(&format!("/v1/locks/{name}?ttl=10s"));
        let (status, body) = conn.call("DELETE", &format!("/v1/locks/{name}/{lease}"));
        assert_eq!(status, 200, "{body}");
        samples.push(cycle.elapsed());
    }
    (samples, started.elapsed())
}

fn config(urls: &[String], lock: &str) -> RedlockConfig {
    let nodes = urls
        .iter()
        .enumerate()
        .map(|(i, url)| NodeSpec::parse(i, url, &Credentials::default()).unwrap())
        .collect();
    let mut cfg = RedlockConfig::new(lock, "bench-library", nodes);
    cfg.ttl = TTL;
    cfg.node_set = Some("bench".to_owned());
    cfg
}

async fn library_cycles(urls: &[String], cycles: usize, hot: bool) -> (Samples, Duration) {
    let mut samples = Samples::default();
    let shared = Redlock::new(config(urls, "app:bench-lib-hot"), Arc::new(NoObserver)).unwrap();
    let started = Instant::now();
    for i in 0..cycles {
        let cycle = Instant::now();
        let lock = if hot {
            shared.clone()
        } else {
            Redlock::new(
                config(urls, &format!("app:bench-lib-{i}")),
                Arc::new(NoObserver),
            )
            .unwrap()
        };
        let lease = lock.try_acquire().await.expect("uncontended");
        lock.release(&lease).await;
        samples.push(cycle.elapsed());
    }
    (samples, started.elapsed())
}

fn handovers(a: &Sidecar, b: &Sidecar, count: usize) -> Samples {
    let mut samples = Samples::default();
    let mut holder = Conn::open(&a.control);
    for _ in 0..count {
        let lease = holder.acquire("/v1/locks/bench-handover?ttl=10s");
        let control = b.control.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let mut conn = Conn::open(&control);
            tx.send(()).unwrap();
            let lease = conn.acquire("/v1/locks/bench-handover?ttl=10s&wait=10s");
            let answered = Instant::now();
            let (status, _) = conn.call("DELETE", &format!("/v1/locks/bench-handover/{lease}"));
            assert_eq!(status, 200);
            answered
        });
        rx.recv().unwrap();
        // Let B's request reach the nodes and wait there (a benchmark, not a test).
        std::thread::sleep(Duration::from_millis(50));
        let released = Instant::now();
        let (status, _) = holder.call("DELETE", &format!("/v1/locks/bench-handover/{lease}"));
        assert_eq!(status, 200);
        let answered = waiter.join().unwrap();
        samples.push(answered.saturating_duration_since(released));
    }
    samples
}

fn row(what: &str, nodes: usize, samples: &Samples, total: Duration) {
    let rate = samples.len() as f64 / total.as_secs_f64();
    println!(
        "| {what} | {nodes} | {rate:.0} | {} | {} | {} |",
        fmt_dur(samples.pct(50.0)),
        fmt_dur(samples.pct(99.0)),
        samples.len()
    );
}

fn main() {
    let cycles = env_usize("BENCH_CYCLES", 500);
    let count = env_usize("BENCH_HANDOVERS", 50);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!("| path | nodes | cycles/s | p50 | p99 | samples |");
    println!("|---|---|---|---|---|---|");
    for nodes in NODE_COUNTS {
        let servers: Vec<RedisServer> = (0..nodes).map(|_| RedisServer::start()).collect();
        for server in &servers {
            server.backdate(Duration::from_secs(120));
        }
        let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
        let joined = urls.join(",");
        let a = Sidecar::start("bench-a", &joined);
        // Warm up: connections, scripts.
        http_cycles(&a.control, 20, true);
        let (s, t) = http_cycles(&a.control, cycles, false);
        row("http, many names", nodes, &s, t);
        let (s, t) = http_cycles(&a.control, cycles, true);
        row("http, hot name", nodes, &s, t);
        runtime.block_on(library_cycles(&urls, 20, true));
        let (s, t) = runtime.block_on(library_cycles(&urls, cycles, false));
        row("library, many names (a new engine per name)", nodes, &s, t);
        let (s, t) = runtime.block_on(library_cycles(&urls, cycles, true));
        row("library, hot name", nodes, &s, t);
        let b = Sidecar::start("bench-b", &joined);
        let s = handovers(&a, &b, count);
        println!(
            "| hand-over between sidecars (DELETE sent → waiter's 200) | {nodes} | | {} | {} | {} |",
            fmt_dur(s.pct(50.0)),
            fmt_dur(s.pct(99.0)),
            s.len()
        );
    }
}

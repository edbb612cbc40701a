//! The control listener takes requests from this pod's processes only, and its answers tell
//! the truth; `run` raises its open-files limit; the start-up checks of `--control-listen` and
//! `--slot-retention`. Through the real binary, on real redis-server nodes where a leader or a
//! lock is needed.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use support::{http, RedisCluster, Sidecar};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest wait for anything these tests expect to happen.
const DEADLINE: Duration = Duration::from_secs(30);
const DAPR_LOCK: &str = "/v1.0-alpha1/lock/redlock";
const DAPR_UNLOCK: &str = "/v1.0-alpha1/unlock/redlock";

/// Nodes whose votes count at once for the leadership ttl and the request locks' default.
fn ready_cluster() -> RedisCluster {
    let cluster = RedisCluster::start(3);
    cluster.backdate_epochs(Duration::from_secs(60));
    cluster
}

fn leader_of(cluster: &RedisCluster) -> Sidecar {
    Sidecar::start(
        "a",
        "work",
        &cluster.urls_joined(),
        "2s",
        &["--kubernetes", "off"],
    )
}

/// Request headers, as sent.
type Headers<'a> = &'a [(&'a str, &'a str)];

/// One request with exactly these headers (plus `Connection: close` and the body's length).
async fn raw(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> http::Response {
    let mut request = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.unwrap();
        answer
    };
    let answer = tokio::time::timeout(DEADLINE, exchange)
        .await
        .unwrap_or_else(|_| panic!("{method} {path}: no answer"));
    let text = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("a response head");
    let status = head[9..12].parse().unwrap();
    let body = if head.to_lowercase().contains("transfer-encoding: chunked") {
        let (bytes, _, _) = http::decode_chunks(body.as_bytes()).unwrap();
        String::from_utf8_lossy(&bytes).into_owned()
    } else {
        body.to_owned()
    };
    http::Response {
        status,
        headers: Vec::new(),
        body,
    }
}

fn json(response: &http::Response) -> serde_json::Value {
    response.json().unwrap()
}

/// On how many nodes the request lock `name` has a key.
fn held_on(cluster: &RedisCluster, name: &str) -> usize {
    let key = format!("redlock:{{app:{name}}}");
    cluster
        .iter()
        .filter(|node| node.command(&["EXISTS", &key]) == "1")
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_hosts_origins_and_non_json_bodies_are_refused_and_change_nothing() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let a = leader_of(&cluster);
    support::leads(&[&a], 0, DEADLINE).await;
    let control = a.control;
    let own_host = control.to_string();
    let host = ("Host", own_host.as_str());
    let json_type = ("Content-Type", "application/json");

    // The issue's request: all three at once.
    let forged = raw(
        control,
        "POST",
        "/v1/leader/resign",
        &[
            ("Host", "evil.example"),
            ("Origin", "http://evil.example"),
            ("Content-Type", "text/plain"),
        ],
        "x",
    )
    .await;
    assert_eq!(forged.status, 421, "{forged:?}");
    // Each alone.
    let refused: &[(Headers, &str, u16)] = &[
        (&[("Host", "evil.example")], "", 421),
        (&[("Host", "evil.example:9708")], "", 421),
        (&[("Host", "127.0.0.1.nip.io")], "", 421),
        (&[("Host", "localhost.")], "", 421),
        (&[host, ("Origin", "http://evil.example")], "", 403),
        (&[host, ("Origin", "null")], "", 403),
        (&[host, ("Content-Type", "text/plain")], "x", 415),
        (
            &[host, ("Content-Type", "application/x-www-form-urlencoded")],
            "a=b",
            415,
        ),
        (&[host], "{}", 415),
    ];
    for (headers, body, status) in refused {
        let answer = raw(control, "POST", "/v1/leader/resign", headers, body).await;
        assert_eq!(answer.status, *status, "{headers:?}: {answer:?}");
        assert!(json(&answer)["error"].is_string(), "{answer:?}");
    }
    assert!(a.is_leader().await, "a refused resign steps nobody down");

    // The request-lock routes: refused before they take anything.
    for (headers, body, status) in refused {
        let answer = raw(control, "POST", "/v1/locks/order-1", headers, body).await;
        assert_eq!(answer.status, *status, "{headers:?}: {answer:?}");
        assert!(json(&answer)["error"].is_string(), "{answer:?}");
    }
    // Dapr's routes: refused in Dapr's shape.
    let vader = r#"{"resourceId": "order-2", "lockOwner": "vader", "expiryInSeconds": 30}"#;
    for (headers, code, status) in [
        (
            &[("Host", "evil.example"), json_type][..],
            "ERR_PERMISSION_DENIED",
            421,
        ),
        (
            &[host, json_type, ("Origin", "http://evil.example")][..],
            "ERR_PERMISSION_DENIED",
            403,
        ),
        (
            &[host, ("Content-Type", "text/plain")][..],
            "ERR_MALFORMED_REQUEST",
            415,
        ),
    ] {
        let answer = raw(control, "POST", DAPR_LOCK, headers, vader).await;
        assert_eq!(answer.status, status, "{headers:?}: {answer:?}");
        assert_eq!(json(&answer)["errorCode"], code, "{answer:?}");
        assert!(json(&answer)["message"].is_string(), "{answer:?}");
    }
    for name in ["order-1", "order-2"] {
        assert_eq!(held_on(&cluster, name), 0, "{name}: no lock was taken");
    }

    // What curl and Dapr's SDKs send works: loopback Hosts, JSON bodies, body-less POSTs.
    let dapr_host = format!("localhost:{}", control.port());
    let taken = raw(
        control,
        "POST",
        DAPR_LOCK,
        &[
            ("Host", &dapr_host),
            ("Content-Type", "application/json; charset=utf-8"),
        ],
        vader,
    )
    .await;
    assert_eq!(
        (taken.status, json(&taken)),
        (200, serde_json::json!({"success": true}))
    );
    let unlocked = raw(
        control,
        "POST",
        DAPR_UNLOCK,
        &[host, json_type],
        r#"{"resourceId": "order-2", "lockOwner": "vader"}"#,
    )
    .await;
    assert_eq!(json(&unlocked), serde_json::json!({"status": 0}));
    for lock_host in [
        "127.0.0.1",
        "[::1]:9708",
        "[::ffff:127.0.0.1]:9708",
        "LOCALHOST",
    ] {
        let lease = raw(
            control,
            "POST",
            "/v1/locks/order-3",
            &[("Host", lock_host)],
            "",
        )
        .await;
        assert_eq!(lease.status, 200, "Host {lock_host}: {lease:?}");
        let id = json(&lease)["lease"].as_str().unwrap().to_owned();
        let released = raw(
            control,
            "DELETE",
            &format!("/v1/locks/order-3/{id}"),
            &[("Host", lock_host)],
            "",
        )
        .await;
        assert_eq!(released.status, 200, "{released:?}");
    }
    // A plain `curl -X POST http://127.0.0.1:PORT/v1/leader/resign`.
    let resigned = raw(
        control,
        "POST",
        "/v1/leader/resign",
        &[host, ("User-Agent", "curl/8.5.0"), ("Accept", "*/*")],
        "",
    )
    .await;
    assert_eq!(resigned.status, 200, "{resigned:?}");
    assert!(!a.is_leader().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resign_answers_200_only_once_it_no_longer_leads_and_hold_0_is_refused() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let a = leader_of(&cluster);
    support::leads(&[&a], 0, DEADLINE).await;

    // hold=0 would answer "resigned" and change nothing: refused, naming hold.
    for path in [
        "/v1/leader/resign?hold=0",
        "/v1/leader/resign?hold=0s",
        "/v1/leader/resign?hold=500ms",
        "/v1/leader/resign?hold=2s&hold=3s",
    ] {
        let started = Instant::now();
        let answer = http::request("POST", a.control, path).await.unwrap();
        assert_eq!(answer.status, 400, "{path}: {answer:?}");
        let error = json(&answer)["error"].as_str().unwrap().to_owned();
        assert!(error.starts_with("hold: "), "{path}: {error}");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{path}: at once"
        );
    }
    let twice = http::request("POST", a.control, "/v1/leader/resign?hold=2s&hold=3s")
        .await
        .unwrap();
    assert!(json(&twice)["error"]
        .as_str()
        .unwrap()
        .contains("more than once"));
    assert!(a.is_leader().await, "a refused resign steps nobody down");
    let token = a.token().await.expect("a fencing token");

    // The shortest hold: 200 once it no longer leads, then it contends again and leads in a
    // new tenure.
    let answer = http::request("POST", a.control, "/v1/leader/resign?hold=1s")
        .await
        .unwrap();
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(
        json(&answer),
        serde_json::json!({"resigned": true, "hold_ms": 1000, "to": null})
    );
    let answered = Instant::now();
    let leader = a.leader().await.expect("a /leader body");
    assert_eq!(leader["is_leader"], false, "{leader}");
    support::leads(&[&a], 0, DEADLINE).await;
    assert!(answered.elapsed() >= Duration::from_millis(900));
    assert!(a.token().await.expect("a new tenure") > token);

    // Duplicate request-lock parameters name the parameter too.
    for (path, name) in [
        ("/v1/locks/x?wait=1s&wait=2s", "wait"),
        ("/v1/locks/x?ttl=5s&ttl=6s", "ttl"),
    ] {
        let answer = http::request("POST", a.control, path).await.unwrap();
        assert_eq!(answer.status, 400, "{path}: {answer:?}");
        let error = json(&answer)["error"].as_str().unwrap().to_owned();
        assert!(error.starts_with(&format!("{name}: ")), "{path}: {error}");
    }
    assert_eq!(held_on(&cluster, "x"), 0);
}

/// A `run` sidecar on a closed Redis port (no quorum: it serves, leads nothing).
fn sidecar_without_redis(
    program: &Path,
    args: &[&str],
    extra: &[&str],
) -> (support::Proc, SocketAddr) {
    let admin = support::sidecar::loopback();
    let listen = admin.to_string();
    let mut all: Vec<&str> = args.to_vec();
    all.extend([
        "run",
        "--lock",
        "limits",
        "--redis",
        "redis://127.0.0.1:1",
        "--listen",
        &listen,
        "--kubernetes",
        "off",
    ]);
    all.extend_from_slice(extra);
    (support::Proc::spawn_program(program, &all, &[]), admin)
}

async fn wait_serving(addr: SocketAddr, path: &str, status: u16) {
    support::wait_until_async(DEADLINE, "the listener serves", || async {
        http::get(addr, path)
            .await
            .is_ok_and(|r| r.status == status)
    })
    .await;
}

/// `Max open files` of `pid`: (soft, hard).
fn open_files_limit(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a Max open files line")
        .to_owned();
    let fields: Vec<&str> = line.split_whitespace().collect();
    (fields[3].to_owned(), fields[4].to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_raises_its_soft_open_files_limit_to_the_hard_limit_and_says_nothing() {
    // The limits containerd gives a container by default, or lower ones where the test's own
    // hard limit is lower.
    let mut own = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid rlimit for getrlimit to fill.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut own) }, 0);
    let hard = own.rlim_max.min(4096);
    let soft = (hard / 4).min(1024);
    let nofile = format!("--nofile={soft}:{hard}");
    let prlimit = Path::new("/usr/bin/prlimit");
    assert!(prlimit.exists(), "prlimit (util-linux) is needed");
    let bin = support::bin();
    let bin = bin.to_str().unwrap();
    let (proc, admin) = sidecar_without_redis(prlimit, &[&nofile, bin], &[]);
    wait_serving(admin, "/healthz", 200).await;
    assert_eq!(
        open_files_limit(proc.pid()),
        (hard.to_string(), hard.to_string()),
        "{}",
        proc.output_text()
    );
    assert!(
        !proc.output_text().contains("open files"),
        "nothing said on success: {}",
        proc.output_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv4_mapped_loopback_control_address_is_loopback() {
    let port = support::free_port();
    let mapped = format!("[::ffff:127.0.0.1]:{port}");
    let (proc, admin) = sidecar_without_redis(&support::bin(), &[], &["--control-listen", &mapped]);
    wait_serving(admin, "/healthz", 200).await;
    // Served on 127.0.0.1, where IPv4 clients and mapped IPv6 ones both arrive.
    let control = SocketAddr::from(([127, 0, 0, 1], port));
    wait_serving(control, "/nope", 404).await;
    let answer = http::request("POST", control, "/v1/leader/resign")
        .await
        .unwrap();
    assert_eq!(answer.status, 409, "{answer:?}: {}", proc.output_text());
}

#[test]
fn a_slot_retention_shorter_than_the_tenure_exits_2_naming_the_flag_and_the_bound() {
    let base = [
        "guard",
        "--lock",
        "x",
        "--redis",
        "redis://127.0.0.1:1",
        "--slot",
        "s",
    ];
    for (extra, bound) in [
        (&["--slot-retention", "1ms"][..], "10s"),
        (&["--slot-retention", "9s"][..], "10s"),
        (&["--ttl", "2s", "--slot-retention", "1s"][..], "2s"),
        (
            &["--min-hold", "1m", "--slot-retention", "1m"][..],
            "1m 10s",
        ),
    ] {
        let args = [&base[..], extra, &["--", "true"]].concat();
        let line = support::process::assert_invalid_config(&args, "--slot-retention");
        assert!(
            line.contains("at least") && line.contains(&format!("({bound})")),
            "{extra:?}: {line}"
        );
    }
}

/// The chart's probe timeout (`timeoutSeconds: 2`): what a probe, a resign's answer or a new
/// lock request may take however the listeners are loaded.
const ANSWER_WITHIN: Duration = Duration::from_secs(2);
/// What a slow client sends, a byte a second after this, never finishing the head.
const SLOW_HEAD: &[u8] = b"POST /v1/leader/resign HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";

/// `method path` answered within [`ANSWER_WITHIN`]: the answer and how long it took.
async fn in_time(addr: SocketAddr, method: &str, path: &str) -> (http::Response, Duration) {
    let asked = Instant::now();
    let answer = http::request(method, addr, path)
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let took = asked.elapsed();
    assert!(took < ANSWER_WITHIN, "{method} {path}: {took:?}");
    (answer, took)
}

/// Under load: a probe, a new request lock and its release, and a resign all answer within
/// [`ANSWER_WITHIN`] (each one's time is printed).
async fn still_answers(a: &Sidecar, what: &str) {
    let (health, probe) = in_time(a.addr, "GET", "/healthz").await;
    assert_eq!(health.status, 200, "{health:?}");
    let name = format!("fresh-{}", support::free_port());
    let (taken, acquire) = in_time(a.control, "POST", &format!("/v1/locks/{name}")).await;
    assert_eq!(taken.status, 200, "{taken:?}");
    let lease = json(&taken)["lease"].as_str().unwrap().to_owned();
    let (released, release) =
        in_time(a.control, "DELETE", &format!("/v1/locks/{name}/{lease}")).await;
    assert_eq!(released.status, 200, "{released:?}");
    assert!(a.is_leader().await);
    let (resigned, resign) = in_time(a.control, "POST", "/v1/leader/resign?hold=1s").await;
    assert_eq!(resigned.status, 200, "{resigned:?}");
    eprintln!(
        "{what}: /healthz {probe:?}, acquire {acquire:?}, release {release:?}, resign {resign:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_300_slowloris_connections_on_each_listener_probes_locks_and_resign_answer_in_time() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let a = leader_of(&cluster);
    support::leads(&[&a], 0, DEADLINE).await;
    let mut slow = support::http::slowloris(a.control, 300, SLOW_HEAD);
    slow.extend(support::http::slowloris(a.addr, 300, SLOW_HEAD));
    // All connected and sending (64 of them held every slot of a listener before).
    tokio::time::sleep(Duration::from_secs(2)).await;
    still_answers(&a, "under 2 x 300 slowloris connections").await;
    for task in &slow {
        task.abort();
    }
}

/// Opens `GET path` as an event stream and reads its status; the stream stays open.
async fn open_stream(addr: SocketAddr, path: &str) -> (u16, TcpStream) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while head.len() < 12 {
        let n = tokio::time::timeout(ANSWER_WITHIN, stream.read(&mut buf))
            .await
            .expect("a response head in time")
            .unwrap();
        assert!(n > 0, "closed before a response head");
        head.extend_from_slice(&buf[..n]);
    }
    let status = String::from_utf8_lossy(&head[9..12]).parse().unwrap();
    (status, stream)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_streams_past_their_bound_answer_429_and_never_keep_resign_or_a_request_waiting() {
    use redlock_sidecar::locks::service::MAX_WATCHES;
    let cluster = tokio::task::block_in_place(ready_cluster);
    let a = leader_of(&cluster);
    support::leads(&[&a], 0, DEADLINE).await;
    let held = http::request("POST", a.control, "/v1/locks/watched")
        .await
        .unwrap();
    let lease = json(&held)["lease"].as_str().unwrap().to_owned();
    let path = format!("/v1/locks/watched/{lease}/watch");
    let mut streams = Vec::new();
    for _ in 0..MAX_WATCHES {
        let (status, stream) = open_stream(a.control, &path).await;
        assert_eq!(status, 200);
        streams.push(stream);
    }
    let asked = Instant::now();
    let (status, _) = open_stream(a.control, &path).await;
    assert_eq!(status, 429, "past {MAX_WATCHES} streams");
    assert!(asked.elapsed() < ANSWER_WITHIN);
    still_answers(&a, &format!("with {MAX_WATCHES} watch streams open")).await;
    // A stream that closes makes room for another.
    drop(streams.pop());
    support::wait_until_async(DEADLINE, "a watch place is free again", || async {
        open_stream(a.control, &path).await.0 == 200
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_past_their_bound_answer_429_and_never_keep_resign_or_a_request_waiting() {
    use redlock_sidecar::locks::service::MAX_WAITING;
    let cluster = tokio::task::block_in_place(ready_cluster);
    let a = leader_of(&cluster);
    support::leads(&[&a], 0, DEADLINE).await;
    let held = http::request("POST", a.control, "/v1/locks/hot?ttl=30s")
        .await
        .unwrap();
    assert_eq!(held.status, 200, "{held:?}");
    // Each waits on its own connection for a name held here.
    let waiting: Vec<_> = (0..MAX_WAITING)
        .map(|_| {
            let control = a.control;
            tokio::spawn(async move {
                let mut stream = TcpStream::connect(control).await.unwrap();
                let request =
                    format!("POST /v1/locks/hot?wait=60s HTTP/1.1\r\nHost: {control}\r\n\r\n");
                stream.write_all(request.as_bytes()).await.unwrap();
                let mut answer = [0u8; 64];
                let _ = stream.read(&mut answer).await;
            })
        })
        .collect();
    support::wait_until_async(DEADLINE, "every acquisition waits", || async {
        a.metric("redlock_app_lock_waiting", "").await >= MAX_WAITING as f64
    })
    .await;
    let (refused, took) = in_time(a.control, "POST", "/v1/locks/other?wait=5s").await;
    assert_eq!(refused.status, 429, "{refused:?}");
    assert!(
        json(&refused)["error"]
            .as_str()
            .unwrap()
            .contains("waiting"),
        "{refused:?}"
    );
    eprintln!("a wait past {MAX_WAITING} waiting: 429 in {took:?}");
    still_answers(&a, &format!("with {MAX_WAITING} acquisitions waiting")).await;
    for task in &waiting {
        task.abort();
    }
}

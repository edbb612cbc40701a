//! The control listener takes requests from this pod's processes only, and its answers tell
//! the truth; `run` raises its open-files limit; the start-up checks of `--control-listen` and
//! `--slot-retention`. Through the real binary, on real redis-server nodes where a leader or a
//! lock is needed.

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
        serde_json::json!({"resigned": true, "hold_ms": 1000})
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

//! Tests of the integration-test harness itself (`tests/support/`): each one fails if the
//! helper it covers is broken.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::time::{Duration, Instant};

use support::http;
use support::{
    command_at, command_at_async, command_at_timeout, free_port, wait_until, wait_until_async,
    FaultProxy, Proc, RawConn, RedisCluster, RedisNode,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

// ------------------------------------------------------------------------------------------
// Redis nodes
// ------------------------------------------------------------------------------------------

#[test]
fn node_starts_and_answers_commands() {
    let node = RedisNode::start();
    assert_eq!(node.command(&["PING"]), "PONG");
    assert!(node.is_running());
    assert_eq!(node.url(), format!("redis://127.0.0.1:{}", node.port()));
    assert_eq!(
        node.addr(),
        SocketAddr::from((Ipv4Addr::LOCALHOST, node.port()))
    );
    assert_eq!(node.command(&["SET", "k", "v", "PX", "30000"]), "OK");
    assert_eq!(node.command(&["GET", "k"]), "v");
    let pttl: i64 = node
        .command(&["PTTL", "k"])
        .parse()
        .expect("PTTL is an integer");
    assert!(pttl > 0 && pttl <= 30_000, "pttl {pttl}");
    assert_eq!(node.command(&["GET", "missing"]), "(nil)");
    assert!(node.command(&["INFO", "server"]).contains("redis_version:"));
    // DEBUG is enabled (Redis 7 disables it by default).
    assert_eq!(node.command(&["DEBUG", "SLEEP", "0"]), "OK");
    assert!(node.command(&["NOSUCHCMD"]).starts_with("(error) ERR"));
    // No persistence configured.
    assert_eq!(node.command(&["CONFIG", "GET", "save"]), "save\n");
    assert_eq!(
        node.command(&["CONFIG", "GET", "appendonly"]),
        "appendonly\nno"
    );
}

#[test]
fn restart_comes_back_on_same_port_and_empty() {
    let mut node = RedisNode::start();
    let port = node.port();
    let pid = node.pid();
    assert_eq!(node.command(&["SET", "survivor", "1"]), "OK");
    node.restart();
    assert_eq!(node.port(), port);
    assert_ne!(node.pid(), pid, "a new process");
    assert!(node.is_running());
    assert_eq!(node.command(&["GET", "survivor"]), "(nil)");
    assert_eq!(node.command(&["DBSIZE"]), "0");
}

#[test]
fn restart_from_snapshot_brings_back_what_was_saved_and_only_once() {
    let mut node = RedisNode::start();
    node.command(&["SET", "before", "1"]);
    node.save_snapshot();
    node.command(&["SET", "after", "2"]);
    node.restart_from_snapshot();
    assert_eq!(node.command(&["GET", "before"]), "1");
    assert_eq!(node.command(&["GET", "after"]), "(nil)");
    // The snapshot was consumed: a plain restart is empty again.
    node.restart();
    assert_eq!(node.command(&["DBSIZE"]), "0");
}

#[test]
fn a_replica_copies_its_master_and_stops_when_promoted() {
    let master = RedisNode::start();
    master.command(&["SET", "k", "v"]);
    let replica = RedisNode::start_replica();
    replica.replicate(master.addr());
    assert_eq!(replica.command(&["GET", "k"]), "v", "the initial sync");
    assert_eq!(replica.command(&["REPLICAOF", "NO", "ONE"]), "OK");
    master.command(&["SET", "k", "later"]);
    assert_eq!(replica.command(&["GET", "k"]), "v");
    assert_eq!(replica.command(&["SET", "k", "mine"]), "OK", "a master now");
}

#[test]
fn pause_and_resume() {
    let mut node = RedisNode::start();
    node.command(&["SET", "k", "v"]);
    node.pause();
    assert!(node.is_paused());
    assert!(!node.is_running(), "a SIGSTOPped server must not answer");
    let err = command_at_timeout(node.addr(), &["PING"], Duration::from_millis(100))
        .expect_err("no reply while paused");
    assert!(err.contains("timed out"), "{err}");
    node.resume();
    assert!(node.is_running());
    assert_eq!(node.command(&["GET", "k"]), "v", "data survives a pause");
}

#[test]
fn stop_frees_the_port_and_start_again_reuses_it() {
    let mut node = RedisNode::start();
    let port = node.port();
    node.stop();
    assert!(!node.is_running());
    assert!(node.pid().is_none());
    assert!(command_at(node.addr(), &["PING"]).is_err());
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, port)).expect("port is free after stop");
    drop(listener);
    node.start_again();
    assert_eq!(node.port(), port);
    assert_eq!(node.command(&["PING"]), "PONG");
}

#[test]
fn drop_kills_the_server_even_when_paused() {
    let mut node = RedisNode::start();
    let addr = node.addr();
    node.pause();
    drop(node);
    // Connection refused (nobody listens) rather than a hang.
    let err = command_at_timeout(addr, &["PING"], Duration::from_millis(500)).unwrap_err();
    assert!(!err.contains("timed out"), "{err}");
}

#[test]
fn requirepass_is_used_by_command() {
    let node = RedisNode::start_with(&["--requirepass", "secret"]);
    assert!(node.is_running());
    assert_eq!(node.command(&["SET", "k", "v"]), "OK");
    let raw = command_at(node.addr(), &["GET", "k"]).unwrap();
    assert!(raw.starts_with("(error) NOAUTH"), "{raw}");
}

#[test]
fn config_file_with_acl_user() {
    let mut node =
        RedisNode::start_with_config("user default off\nuser alice on >pw ~lock:* +@all\n");
    assert!(node.is_running(), "NOAUTH counts as running");
    node.set_auth(Some("alice"), "pw");
    assert_eq!(node.command(&["SET", "lock:x", "1"]), "OK");
    let denied = node.command(&["SET", "other:x", "1"]);
    assert!(denied.starts_with("(error) NOPERM"), "{denied}");
}

#[test]
fn cluster_of_independent_nodes() {
    let mut cluster = RedisCluster::start(3);
    assert_eq!(cluster.len(), 3);
    let urls = cluster.urls();
    assert_eq!(urls.len(), 3);
    assert_eq!(cluster.urls_joined(), urls.join(","));
    let mut ports = cluster.ports();
    ports.sort_unstable();
    ports.dedup();
    assert_eq!(ports.len(), 3);
    cluster[0].command(&["SET", "only-on-0", "1"]);
    assert_eq!(cluster[1].command(&["GET", "only-on-0"]), "(nil)");
    cluster[2].stop();
    let replies = cluster.command_all(&["PING"]);
    assert_eq!(replies[0].as_deref(), Ok("PONG"));
    assert!(replies[2].is_err());
    cluster.flush_all();
    assert_eq!(cluster.node(0).command(&["DBSIZE"]), "0");
    cluster.node_mut(2).start_again();
    assert!(cluster[2].is_running());
}

#[test]
fn free_port_is_bindable() {
    let port = free_port();
    assert_ne!(port, 0);
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).expect("free port binds");
}

#[test]
fn wait_until_returns_when_condition_holds() {
    let start = Instant::now();
    let mut calls = 0;
    wait_until(Duration::from_secs(2), "third call", || {
        calls += 1;
        calls >= 3
    });
    assert_eq!(calls, 3);
    assert!(start.elapsed() < Duration::from_secs(2));
}

#[test]
#[should_panic(expected = "waiting for: the impossible")]
fn wait_until_panics_with_its_description() {
    wait_until(Duration::from_millis(30), "the impossible", || false);
}

#[tokio::test]
async fn wait_until_async_awaits_the_condition() {
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let setter = flag.clone();
    tokio::spawn(async move {
        tokio::task::yield_now().await;
        setter.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    wait_until_async(Duration::from_secs(2), "flag set", || {
        let flag = flag.clone();
        async move { flag.load(std::sync::atomic::Ordering::SeqCst) }
    })
    .await;
}

// ------------------------------------------------------------------------------------------
// FaultProxy (multi_thread: the raw client blocks its thread while the proxy works)
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_forwards_traffic() {
    let node = RedisNode::start();
    let proxy = FaultProxy::start(node.addr()).await;
    assert_eq!(
        proxy.url(),
        format!("redis://127.0.0.1:{}", proxy.addr().port())
    );
    assert_eq!(
        command_at(proxy.addr(), &["SET", "via", "proxy"]).unwrap(),
        "OK"
    );
    assert_eq!(command_at(proxy.addr(), &["GET", "via"]).unwrap(), "proxy");
    assert_eq!(
        node.command(&["GET", "via"]),
        "proxy",
        "it reached the real node"
    );
    assert_eq!(proxy.connections_accepted(), 2);
    assert!(proxy.bytes_forwarded() > 0);
}

#[tokio::test]
async fn proxy_works_with_async_client_on_current_thread() {
    let node = RedisNode::start();
    let proxy = FaultProxy::start(node.addr()).await;
    let reply = command_at_async(proxy.addr(), &["PING"], Duration::from_secs(2)).await;
    assert_eq!(reply.as_deref(), Ok("PONG"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_latency_delays_round_trips() {
    let node = RedisNode::start();
    let proxy = FaultProxy::start(node.addr()).await;
    let mut conn = RawConn::connect(proxy.addr()).unwrap();
    assert_eq!(conn.command(&["PING"]).unwrap(), "PONG");
    proxy.set_latency(Duration::from_millis(50), Duration::ZERO);
    let t = Instant::now();
    assert_eq!(conn.command(&["PING"]).unwrap(), "PONG");
    let rtt = t.elapsed();
    // 50 ms each way.
    assert!(rtt >= Duration::from_millis(100), "round trip {rtt:?}");
    proxy.heal();
    assert_eq!(conn.command(&["PING"]).unwrap(), "PONG");
}

#[tokio::test]
async fn proxy_jitter_preserves_order() {
    let node = RedisNode::start();
    let proxy = FaultProxy::start(node.addr()).await;
    proxy.set_latency(Duration::from_millis(1), Duration::from_millis(20));
    let mut stream = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let mut expected = String::new();
    for i in 0..20 {
        let cmd = support::redis::encode_command(&["APPEND", "seq", &format!("{i},")]);
        stream.write_all(&cmd).await.unwrap();
        expected.push_str(&format!("{i},"));
        // Separate reads at the proxy: give it the chance to see separate chunks.
        tokio::task::yield_now().await;
    }
    // 20 integer replies.
    let mut buf = Vec::new();
    let mut replies = 0;
    while replies < 20 {
        let mut chunk = [0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut chunk))
            .await
            .expect("replies arrive")
            .unwrap();
        assert!(n > 0, "connection closed");
        buf.extend_from_slice(&chunk[..n]);
        replies = buf.iter().filter(|&&b| b == b'\n').count();
    }
    proxy.heal();
    let got = command_at_async(proxy.addr(), &["GET", "seq"], Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(got, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_blackhole_times_out_and_heal_restores() {
    let node = RedisNode::start();
    let proxy = FaultProxy::start(node.addr()).await;
    let mut old = RawConn::connect_timeout(proxy.addr(), Duration::from_millis(300)).unwrap();
    assert_eq!(old.command(&["PING"]).unwrap(), "PONG");
    proxy.blackhole(true);
    let err = old.command(&["SET", "held", "1"]).unwrap_err();
    assert!(err.contains("timed out"), "{err}");
    let err = command_at_timeout(proxy.addr(), &["PING"], Duration::from_millis(300)).unwrap_err();
    assert!(err.contains("timed out"), "{err}");
    assert_eq!(
        node.command(&["GET", "held"]),
        "(nil)",
        "nothing reached the node"
    );
    proxy.heal();
    assert_eq!(command_at(proxy.addr(), &["PING"]).unwrap(), "PONG");
    // Held bytes are delivered after the heal, like a partition that TCP survives.
    wait_until(
        Duration::from_secs(2),
        "held SET delivered after heal",
        || node.command(&["GET", "held"]) == "1",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_set_upstream_moves_new_connections_and_closes_old_ones() {
    let (first, second) = (RedisNode::start(), RedisNode::start());
    first.command(&["SET", "who", "first"]);
    second.command(&["SET", "who", "second"]);
    let proxy = FaultProxy::start(first.addr()).await;
    let timeout = Duration::from_secs(2);
    let ask = || command_at_async(proxy.addr(), &["GET", "who"], timeout);
    assert_eq!(ask().await.as_deref(), Ok("first"));
    wait_until_async(timeout, "the first connection is closed", || async {
        proxy.active_connections() == 0
    })
    .await;
    // An open connection to the old upstream is closed by the move.
    let mut open = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    wait_until_async(timeout, "the open connection is served", || async {
        proxy.active_connections() == 1
    })
    .await;
    proxy.set_upstream(second.addr());
    assert_eq!(proxy.upstream(), second.addr());
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(timeout, open.read(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "the old connection was closed: {read:?}"
    );
    assert_eq!(ask().await.as_deref(), Ok("second"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_refuse_resets_new_connections() {
    let node = RedisNode::start();
    let proxy = FaultProxy::start(node.addr()).await;
    proxy.refuse(true);
    let err = command_at(proxy.addr(), &["PING"]).unwrap_err();
    assert!(
        !err.contains("timed out"),
        "refused fast, not a timeout: {err}"
    );
    assert_eq!(proxy.connections_refused(), 1);
    proxy.refuse(false);
    assert_eq!(command_at(proxy.addr(), &["PING"]).unwrap(), "PONG");
    assert_eq!(proxy.connections_accepted(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_drop_connections_breaks_open_ones_only() {
    let node = RedisNode::start();
    let proxy = FaultProxy::start(node.addr()).await;
    let mut conn = RawConn::connect(proxy.addr()).unwrap();
    assert_eq!(conn.command(&["PING"]).unwrap(), "PONG");
    assert_eq!(proxy.active_connections(), 1);
    proxy.drop_connections();
    let err = conn.command(&["PING"]).unwrap_err();
    assert!(!err.contains("timed out"), "closed, not hung: {err}");
    assert_eq!(command_at(proxy.addr(), &["PING"]).unwrap(), "PONG");
    wait_until(
        Duration::from_secs(2),
        "no active proxy connections",
        || proxy.active_connections() == 0,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_closes_client_when_upstream_is_down() {
    let mut node = RedisNode::start();
    let proxy = FaultProxy::start(node.addr()).await;
    node.stop();
    let err = command_at(proxy.addr(), &["PING"]).unwrap_err();
    assert!(!err.contains("timed out"), "{err}");
    node.start_again();
    assert_eq!(command_at(proxy.addr(), &["PING"]).unwrap(), "PONG");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_drop_closes_its_connections() {
    let node = RedisNode::start();
    let proxy = FaultProxy::start(node.addr()).await;
    let addr = proxy.addr();
    let mut conn = RawConn::connect(addr).unwrap();
    assert_eq!(conn.command(&["PING"]).unwrap(), "PONG");
    drop(proxy);
    let err = conn.command(&["PING"]).unwrap_err();
    assert!(!err.contains("timed out"), "{err}");
}

// ------------------------------------------------------------------------------------------
// HTTP client, against a tiny server started here
// ------------------------------------------------------------------------------------------

/// One chunk of a chunked body.
fn chunk(data: &str) -> String {
    format!("{:x}\r\n{data}\r\n", data.len())
}

fn parts(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// Serves one connection: reads the request head (and a Content-Length body), sends the
/// `parts` with a yield between them, returns the request text.
async fn one_shot_server(parts: Vec<String>) -> (SocketAddr, tokio::task::JoinHandle<String>) {
    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut req = Vec::new();
        let mut chunk = [0u8; 1024];
        loop {
            let n = sock.read(&mut chunk).await.unwrap();
            req.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&req).to_string();
            if let Some(head_end) = text.find("\r\n\r\n") {
                let len = text
                    .lines()
                    .find_map(|l| l.strip_prefix("Content-Length: "))
                    .map_or(0, |v| v.trim().parse::<usize>().unwrap());
                if text.len() >= head_end + 4 + len {
                    break;
                }
            }
            assert!(n > 0, "client closed early");
        }
        for p in parts {
            sock.write_all(p.as_bytes()).await.unwrap();
            sock.flush().await.unwrap();
            tokio::task::yield_now().await;
        }
        // Keep the socket open a moment: the client must not rely on EOF for framed bodies.
        let mut rest = [0u8; 16];
        let _ = tokio::time::timeout(Duration::from_millis(500), sock.read(&mut rest)).await;
        String::from_utf8_lossy(&req).to_string()
    });
    (addr, task)
}

#[tokio::test]
async fn http_content_length_response() {
    let (addr, server) = one_shot_server(parts(&[
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n",
        "{\"leader\":true}",
        "trailing garbage that is not part of the body",
    ]))
    .await;
    let resp = http::get(addr, "/status").await.unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("content-type"), Some("application/json"));
    assert_eq!(resp.body, "{\"leader\":true}");
    assert_eq!(resp.json().unwrap()["leader"], true);
    let req = server.await.unwrap();
    assert!(req.starts_with("GET /status HTTP/1.1\r\n"), "{req}");
    assert!(req.contains("Connection: close\r\n"), "{req}");
}

#[tokio::test]
async fn http_chunked_response() {
    let (addr, _server) = one_shot_server(parts(&[
        "HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n",
        "5\r\nhello\r\n",
        "7;ext=1\r\n, world\r\n",
        "0\r\nX-Trailer: 1\r\n\r\n",
    ]))
    .await;
    let resp = http::get(addr, "/readyz").await.unwrap();
    assert_eq!(resp.status, 503);
    assert_eq!(resp.body, "hello, world");
}

#[tokio::test]
async fn http_post_sends_body() {
    let (addr, server) = one_shot_server(parts(&["HTTP/1.1 204 No Content\r\n\r\n"])).await;
    let resp = http::request_with_body("POST", addr, "/release", Some(("text/plain", "bye")))
        .await
        .unwrap();
    assert_eq!(resp.status, 204);
    assert_eq!(resp.body, "");
    let req = server.await.unwrap();
    assert!(req.starts_with("POST /release HTTP/1.1\r\n"), "{req}");
    assert!(req.ends_with("Content-Length: 3\r\n\r\nbye"), "{req}");
}

#[tokio::test]
async fn http_times_out_on_silent_server() {
    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let t = Instant::now();
    let err = http::get(addr, "/").await.unwrap_err();
    assert!(err.contains("timed out"), "{err}");
    assert!(t.elapsed() >= http::TIMEOUT);
    drop(listener);
}

#[tokio::test]
async fn sse_events_returns_data_payloads() {
    let (addr, server) = one_shot_server(vec![
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            .to_string(),
        chunk(": keepalive\n"),
        chunk("event: leadership\ndata: {\"a\":1}\n\n"),
        // One event split across two chunks (mid-line), two data lines, CRLF line ends.
        chunk("data: line1\r"),
        chunk("\ndata:line2\r\n\r\n"),
        chunk("data: 3\n\ndata: 4\n\n"),
        "0\r\n\r\n".to_string(),
    ])
    .await;
    let events = http::sse_events(addr, "/events", 3, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(events, vec!["{\"a\":1}", "line1\nline2", "3"]);
    let req = server.await.unwrap();
    assert!(req.contains("Accept: text/event-stream\r\n"), "{req}");
}

#[tokio::test]
async fn sse_events_reports_too_few() {
    let (addr, _server) = one_shot_server(parts(&[
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n",
        "data: only\n\n",
    ]))
    .await;
    let err = http::sse_events(addr, "/events", 2, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(err.contains("only"), "{err}");
}

// ------------------------------------------------------------------------------------------
// Processes
// ------------------------------------------------------------------------------------------

#[test]
fn the_binary_under_test_exists() {
    assert!(support::bin().is_file(), "{}", support::bin().display());
}

#[test]
fn proc_captures_output_and_takes_signals() {
    let mut p = Proc::spawn_program(
        Path::new("sh"),
        &[
            "-c",
            "echo \"hello $GREETING\"; echo oops >&2; exec sleep 30",
        ],
        &[("GREETING", "world")],
    );
    p.wait_for_output("hello world", Duration::from_secs(5));
    wait_until(Duration::from_secs(5), "stderr captured", || {
        p.stderr_text().contains("oops")
    });
    assert!(p.sigstop());
    assert_eq!(support::proc_state(p.pid()), Some('T'));
    assert!(p.sigcont());
    assert_ne!(support::proc_state(p.pid()), Some('T'));
    assert!(
        p.wait_exit(Duration::from_millis(50)).is_none(),
        "still running"
    );
    assert!(p.sigterm());
    let status = p
        .wait_exit(Duration::from_secs(5))
        .expect("exits on SIGTERM");
    assert_eq!(status.signal(), Some(libc::SIGTERM));
    assert!(!p.sigkill(), "never signals a reaped child");
}

#[test]
fn proc_drop_kills_and_reaps() {
    let p = Proc::spawn_program(Path::new("sleep"), &["30"], &[]);
    let pid = p.pid();
    assert!(support::proc_state(pid).is_some());
    drop(p);
    // Killed and reaped: the pid is gone (a killed but unreaped child would linger as 'Z').
    assert_eq!(support::proc_state(pid), None, "killed and reaped");
}

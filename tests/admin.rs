//! The admin port's limits, through the real binary: watch-stream cap, header timeout,
//! connection cap, probes under slow clients. The sidecar runs against a closed port (no
//! Redis needed): it stays a follower and serves its endpoint, which is all these tests look
//! at.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use redlock_sidecar::http::{HEADER_READ_TIMEOUT, MAX_CONNECTIONS, MAX_WATCHERS};
use support::{http, Proc};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest wait for anything these tests expect to happen.
const DEADLINE: Duration = Duration::from_secs(30);

/// A `run` sidecar whose Redis node is a closed port, serving on a free loopback port.
async fn sidecar() -> (Proc, SocketAddr) {
    let addr: SocketAddr = format!("127.0.0.1:{}", support::free_port())
        .parse()
        .unwrap();
    let listen = addr.to_string();
    let proc = Proc::spawn(
        &[
            "run",
            "--lock",
            "admin",
            "--redis",
            "redis://127.0.0.1:1",
            "--listen",
            &listen,
            "--kubernetes",
            "off",
        ],
        &[],
    );
    support::wait_until_async(DEADLINE, "the admin endpoint serves", || async {
        http::get(addr, "/healthz")
            .await
            .is_ok_and(|r| r.status == 200)
    })
    .await;
    (proc, addr)
}

/// Sends `GET /leader/watch` and reads the status line; the stream stays open.
async fn open_watch(addr: SocketAddr) -> (u16, String, TcpStream) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /leader/watch HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(DEADLINE, stream.read(&mut buf))
            .await
            .expect("a response head")
            .unwrap();
        assert!(n > 0, "closed before a response head");
        head.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&head).into_owned();
    let status = text[9..12].parse().unwrap();
    (status, text, stream)
}

/// Reads until the server closes `stream` (EOF or reset); returns what was read.
async fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(DEADLINE, stream.read(&mut buf))
            .await
            .expect("the server closes the connection")
        {
            Ok(0) | Err(_) => return all,
            Ok(n) => all.extend_from_slice(&buf[..n]),
        }
    }
}

/// True if the server has closed `stream` already (a non-blocking read, no waiting).
fn is_closed(stream: &std::net::TcpStream) -> bool {
    use std::io::Read;
    stream.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 1];
    match (&*stream).read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

#[tokio::test]
async fn watch_streams_beyond_the_cap_answer_503_and_a_closed_one_frees_its_slot() {
    let (_proc, addr) = sidecar().await;
    let mut streams = Vec::new();
    for _ in 0..MAX_WATCHERS {
        let (status, head, stream) = open_watch(addr).await;
        assert_eq!(status, 200, "{head}");
        streams.push(stream);
    }
    let (status, text, _) = open_watch(addr).await;
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("too many /leader/watch streams"), "{text}");
    // Other routes still answer.
    assert_eq!(http::get(addr, "/leader").await.unwrap().status, 503);

    drop(streams.pop());
    support::wait_until_async(DEADLINE, "a watch slot is free again", || async {
        open_watch(addr).await.0 == 200
    })
    .await;
}

#[tokio::test]
async fn a_client_that_sends_half_a_request_head_is_cut_off_after_the_header_timeout() {
    let (_proc, addr) = sidecar().await;
    // Half a head, never finished.
    let mut half = TcpStream::connect(addr).await.unwrap();
    let sent = Instant::now();
    half.write_all(b"GET /healthz HTTP/1.1\r\nHost: te")
        .await
        .unwrap();
    // A kept-alive connection that goes idle after one answer.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();

    let got = read_until_closed(&mut half).await;
    assert!(
        sent.elapsed() >= HEADER_READ_TIMEOUT,
        "closed by the timeout, not before it: {:?}",
        sent.elapsed()
    );
    assert!(
        !String::from_utf8_lossy(&got).contains("200 OK"),
        "no answer to half a request"
    );
    let got = String::from_utf8_lossy(&read_until_closed(&mut idle).await).into_owned();
    assert!(got.starts_with("HTTP/1.1 200 OK"), "answered once: {got}");
}

#[tokio::test]
async fn at_the_cap_a_new_connection_takes_the_place_of_the_longest_silent_one() {
    let (_proc, addr) = sidecar().await;
    // Fill every place with a connection that sends nothing (the test's own open-files limit
    // is far above the cap: the sidecar's cap is MAX_CONNECTIONS).
    let mut silent = Vec::new();
    for _ in 0..MAX_CONNECTIONS {
        silent.push(std::net::TcpStream::connect(addr).unwrap());
    }
    // Let the sidecar accept them all.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // One more, with a complete request: served at once, not after a silent one timed out.
    let asked = Instant::now();
    let mut extra = TcpStream::connect(addr).await.unwrap();
    extra
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let answer = String::from_utf8_lossy(&read_until_closed(&mut extra).await).into_owned();
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert!(
        asked.elapsed() < HEADER_READ_TIMEOUT / 2,
        "answered in {:?}",
        asked.elapsed()
    );
    // The one that made room is the first opened, the longest without a request.
    support::wait_until(DEADLINE, "the oldest silent connection is closed", || {
        is_closed(&silent[0])
    });
    let closed = silent.iter().filter(|s| is_closed(s)).count();
    assert!(
        closed <= 2,
        "{closed} silent connections closed for one new one"
    );
}

/// The chart's probe timeout (`timeoutSeconds: 2`).
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Six probes of `path` a second apart, as a kubelet sends them: each answer and how long it
/// took (`None`: no answer within [`PROBE_TIMEOUT`]).
pub async fn probe_six_times(addr: SocketAddr, path: &str) -> Vec<Option<(u16, Duration)>> {
    let mut answers = Vec::new();
    for _ in 0..6 {
        let asked = Instant::now();
        let answer = tokio::time::timeout(PROBE_TIMEOUT, http::get(addr, path)).await;
        answers.push(match answer {
            Ok(Ok(response)) => Some((response.status, asked.elapsed())),
            _ => None,
        });
        tokio::time::sleep(Duration::from_secs(1).saturating_sub(asked.elapsed())).await;
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_answer_within_their_timeout_under_300_slowloris_connections() {
    let (_proc, addr) = sidecar().await;
    let slow = support::http::slowloris(
        addr,
        300,
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ",
    );
    // All connected and sending (they were 0 of 6 within 2 s when 64 of them held every slot).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let healthz = probe_six_times(addr, "/healthz").await;
    let leader = probe_six_times(addr, "/leader").await;
    for task in &slow {
        task.abort();
    }
    eprintln!("under 300 slowloris connections: /healthz {healthz:?}, /leader {leader:?}");
    assert!(
        healthz.iter().all(|a| matches!(a, Some((200, _)))),
        "/healthz: {healthz:?}"
    );
    // A follower without Redis: 503, but an answer, in time.
    assert!(
        leader.iter().all(|a| matches!(a, Some((503, _)))),
        "/leader: {leader:?}"
    );
}

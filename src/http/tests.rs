use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::resign::{resign_query, Resign};
use super::server::Connections;
use super::*;
use crate::clock::{self, Deadline};
use crate::config::ReadyWhen;
use crate::leadership::Leadership;
use crate::leadership::{HolderView, Role, Term};
use crate::metrics::Metrics;

fn leader(step_down_in: Duration) -> (Leadership, Deadline) {
    let now = Deadline::from_boottime(Duration::from_secs(1_000));
    let mut state = Leadership::new("jobs", "pod-a");
    state.role = Role::Leader(Term {
        fencing_token: 7,
        since: SystemTime::now(),
        step_down_at: now + step_down_in,
        valid_until: now + step_down_in + Duration::from_secs(1),
    });
    state.holder = Some(HolderView {
        identity: "pod-a".into(),
        fencing_token: Some(7),
        observed_at: SystemTime::now(),
    });
    (state, now)
}

#[test]
fn a_leader_reports_its_token_and_validity() {
    let (state, now) = leader(Duration::from_secs(5));
    let body = LeaderBody::new(&state, now);
    assert!(body.is_leader);
    assert_eq!(body.fencing_token, Some(7));
    assert_eq!(body.validity_ms, Some(6000));
    assert_eq!(body.holder.as_deref(), Some("pod-a"));
}

#[test]
fn a_leader_past_its_step_down_point_is_not_leader_even_unpublished() {
    let (state, now) = leader(Duration::from_millis(10));
    let body = LeaderBody::new(&state, now + Duration::from_millis(11));
    assert!(!body.is_leader);
    assert_eq!(body.fencing_token, None);
    assert!(!is_ready(
        &state,
        ReadyWhen::Leader,
        now + Duration::from_millis(11)
    ));
}

/// A server on a loopback port for `state`, and the sender that keeps its channel open.
async fn server(
    shutdown: CancellationToken,
) -> (
    SocketAddr,
    crate::leadership::LeadershipTx,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let (tx, rx) = tokio::sync::watch::channel(Leadership::new("jobs", "pod-a"));
    let state = AdminState {
        leadership: rx,
        metrics: Metrics::new("jobs", &["n1".to_owned()], None),
        ready_when: ReadyWhen::Quorum,
        shutdown,
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (addr, tx, tokio::spawn(serve(listener, state)))
}

/// Opens `/leader/watch` and reads until the server closes the connection.
async fn watch_until_closed(addr: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /leader/watch HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let mut text = Vec::new();
    stream.read_to_end(&mut text).await.unwrap();
    String::from_utf8_lossy(&text).into_owned()
}

#[tokio::test(start_paused = true)]
async fn an_event_stream_ends_and_its_connection_closes_at_the_maximum_age() {
    let (addr, _tx, _server) = server(CancellationToken::new()).await;
    let opened = tokio::time::Instant::now();
    let text = clock::within(
        MAX_CONNECTION_AGE + CLOSE_GRACE + Duration::from_secs(60),
        watch_until_closed(addr),
    )
    .await
    .expect("the connection is closed");
    assert!(
        opened.elapsed() >= MAX_CONNECTION_AGE,
        "{:?}",
        opened.elapsed()
    );
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("event: leadership"), "{text}");
    // The stream ended cleanly (last chunk), not cut off.
    assert!(text.ends_with("\r\n0\r\n\r\n"), "{text:?}");
}

#[tokio::test(start_paused = true)]
async fn shutdown_ends_the_event_streams_and_the_server() {
    let shutdown = CancellationToken::new();
    let (addr, _tx, server) = server(shutdown.clone()).await;
    let stream = tokio::spawn(watch_until_closed(addr));
    clock::pause(Duration::from_secs(1)).await;
    shutdown.cancel();
    let text = clock::within(Duration::from_secs(1), stream)
        .await
        .expect("closed at once")
        .unwrap();
    assert!(text.ends_with("\r\n0\r\n\r\n"), "{text:?}");
    clock::within(Duration::from_secs(1), server)
        .await
        .expect("the server returns once its connections are closed")
        .unwrap()
        .unwrap();
}

#[test]
fn at_the_cap_the_connection_waiting_longest_for_a_head_makes_room() {
    let connections = Connections::new(3);
    let first = Arc::new(connections.admit().expect("room"));
    let second = Arc::new(connections.admit().expect("room"));
    let third = Arc::new(connections.admit().expect("room"));
    // The first is serving a request; the second and third wait for one, the second
    // the longest.
    let request = first.request();
    let fourth = Arc::new(connections.admit().expect("the second makes room"));
    assert!(second.displaced.is_cancelled());
    assert!(!first.displaced.is_cancelled() && !third.displaced.is_cancelled());
    // A connection whose request was answered waits for its next head from then on: the
    // third has waited longer.
    drop(request);
    let fifth = Arc::new(connections.admit().expect("the third makes room"));
    assert!(third.displaced.is_cancelled());
    assert!(!first.displaced.is_cancelled());
    // With every connection serving a request, a new one is refused.
    let _busy = [first.request(), fourth.request(), fifth.request()];
    assert!(connections.admit().is_none());
    drop((first, second, third, fourth, fifth));
}

#[test]
fn the_connection_cap_follows_the_open_files_limit() {
    assert_eq!(connection_cap(1_024), 448);
    assert_eq!(connection_cap(100), MIN_CONNECTIONS);
    assert_eq!(connection_cap(1 << 20), MAX_CONNECTIONS);
    assert_eq!(connection_cap(u64::MAX), MAX_CONNECTIONS);
}

#[test]
fn loopback_hosts_with_or_without_a_port() {
    for good in [
        "127.0.0.1",
        "127.0.0.1:9708",
        "127.8.9.10:1",
        "localhost",
        "LocalHost:9708",
        "[::1]",
        "[::1]:9708",
        "[::ffff:127.0.0.1]:9708",
        "[::ffff:7f00:1]",
    ] {
        assert!(is_loopback_host(good), "{good}");
    }
    for bad in [
        "",
        "evil.example",
        "evil.example:9708",
        "localhost.",
        "localhost.evil.example",
        "127.0.0.1.nip.io",
        "10.0.0.1:9708",
        "0.0.0.0",
        "[::]:9708",
        "[::ffff:10.0.0.1]",
        "::1",
        "[::1",
        "[::1]9708",
        "127.0.0.1:",
        "127.0.0.1:99999",
        "127.0.0.1:x",
        "localhost:9708:1",
        "127.1",
    ] {
        assert!(!is_loopback_host(bad), "{bad}");
    }
}

fn headers(pairs: &[(&str, &str)]) -> axum::http::HeaderMap {
    let mut map = axum::http::HeaderMap::new();
    for (name, value) in pairs {
        map.append(
            axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    map
}

#[test]
fn the_control_listener_takes_this_pods_requests_only() {
    let path: axum::http::Uri = "/v1/leader/resign".parse().unwrap();
    let refused = |pairs: &[(&str, &str)], uri: &axum::http::Uri| {
        control_refusal(&headers(pairs), uri).map(|r| r.status.as_u16())
    };
    let host = ("host", "127.0.0.1:9708");
    let json = ("content-type", "application/json");
    // What curl and Dapr's SDKs send.
    assert_eq!(refused(&[host], &path), None);
    assert_eq!(refused(&[host, ("content-length", "0")], &path), None);
    assert_eq!(
        refused(
            &[("host", "localhost:3500"), json, ("content-length", "12")],
            &path
        ),
        None
    );
    assert_eq!(
        refused(
            &[
                host,
                ("content-type", "Application/JSON; charset=utf-8"),
                ("content-length", "2")
            ],
            &path
        ),
        None
    );
    // A body-less POST with a form type (curl -d '') carries nothing to misread.
    assert_eq!(
        refused(
            &[
                host,
                ("content-type", "application/x-www-form-urlencoded"),
                ("content-length", "0")
            ],
            &path
        ),
        None
    );
    assert_eq!(refused(&[], &path), None, "no Host: not a browser");

    assert_eq!(refused(&[("host", "evil.example")], &path), Some(421));
    assert_eq!(refused(&[host, ("host", "evil.example")], &path), Some(421));
    let absolute: axum::http::Uri = "http://evil.example/v1/leader/resign".parse().unwrap();
    assert_eq!(refused(&[host], &absolute), Some(421));
    assert_eq!(
        refused(&[host, ("origin", "http://evil.example")], &path),
        Some(403)
    );
    assert_eq!(refused(&[host, ("origin", "null")], &path), Some(403));
    for body in [
        &[("content-type", "text/plain"), ("content-length", "2")][..],
        &[("content-length", "2")][..],
        &[
            ("content-type", "application/jsonx"),
            ("content-length", "2"),
        ][..],
        &[
            ("content-type", "text/plain"),
            ("transfer-encoding", "chunked"),
        ][..],
        &[json, json, ("content-length", "2")][..],
    ] {
        let pairs = [&[host][..], body].concat();
        assert_eq!(refused(&pairs, &path), Some(415), "{body:?}");
    }
}

#[test]
fn a_resign_hold_is_one_duration_from_a_second_to_an_hour_and_to_names_one_identity() {
    let default = Duration::from_secs(10);
    let hold = |query: Option<&str>| resign_query(query, default).map(|r| r.hold);
    assert_eq!(hold(None), Ok(default));
    assert_eq!(hold(Some("hold=3s")), Ok(Duration::from_secs(3)));
    assert_eq!(hold(Some("hold=1h")), Ok(Duration::from_secs(3600)));
    for bad in [
        "hold=0",
        "hold=0s",
        "hold=999ms",
        "hold=61m",
        "hold=soon",
        "hold=1s&hold=2s",
    ] {
        let why = resign_query(Some(bad), default).unwrap_err();
        assert!(why.starts_with("hold: "), "{bad}: {why}");
    }
    assert!(resign_query(Some("force=1"), default).is_err());
    assert_eq!(
        resign_query(Some("to=app-7d9f%2Dx2&hold=2s"), default),
        Ok(Resign {
            hold: Duration::from_secs(2),
            to: Some("app-7d9f-x2".into())
        })
    );
    for bad in [
        "to=",
        "to=a%0Ab",
        "to=%zz",
        "to=a&to=b",
        &format!("to={}", "x".repeat(254)),
    ] {
        let why = resign_query(Some(bad), default).unwrap_err();
        assert!(why.starts_with("to: "), "{bad}: {why}");
    }
}

#[test]
fn readiness_follows_quorum_or_leadership() {
    let mut follower = Leadership::new("jobs", "pod-b");
    let now = Deadline::from_boottime(Duration::from_secs(1_000));
    assert!(!is_ready(&follower, ReadyWhen::Quorum, now));
    follower.quorum_reachable = true;
    assert!(is_ready(&follower, ReadyWhen::Quorum, now));
    assert!(!is_ready(&follower, ReadyWhen::Leader, now));
}

//! The HTTP fencing recipe of docs/locks.md: a service that takes the token in a header and
//! answers 409 to a token older than one it accepted. A paused holder whose lock moved on comes
//! back and writes with its old token, and the service refuses it. Tokens come from real locks on
//! real redis-server nodes. (The PostgreSQL and Redis recipes run in `tests/locks.rs`, with
//! tokens from the sidecar's lock API.)

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use redlock_sidecar::clock::Deadline;
use redlock_sidecar::redlock::{Lease, NoObserver, Redlock};
use support::RedisCluster;
use tokio_util::sync::CancellationToken;

const TTL: Duration = Duration::from_millis(600);

/// Two clients of the lock `stock`: the first takes it and "pauses" (stops renewing); once its
/// validity is over the second takes it. Returns both leases, oldest first.
async fn a_holder_and_its_successor(cluster: &RedisCluster) -> (Lease, Lease) {
    let client = |identity: &str| {
        let cfg = support::engine_config(&cluster.urls(), "stock", identity, TTL);
        Redlock::new(cfg, Arc::new(NoObserver)).expect("valid config")
    };
    let (paused, next) = (client("paused"), client("next"));
    let old = paused
        .try_acquire()
        .await
        .expect("the first holder acquires");
    let never = CancellationToken::new();
    let deadline = Some(Deadline::now() + TTL * 10);
    let new = next
        .acquire(deadline, &never, |_, _| {})
        .await
        .expect("the successor acquires once the paused holder's key expired");
    assert!(new.fencing_token > old.fencing_token, "tokens grow");
    (old, new)
}

/// An HTTP resource with the recipe's conditional write: `PUT /items/{id}` with a
/// `Fencing-Token` header is applied only if the token is at least the highest one seen for the
/// item (then 200); an older one gets 409, a missing or malformed one 400.
async fn fenced_http_resource() -> SocketAddr {
    type Items = Arc<Mutex<std::collections::HashMap<String, (u64, String)>>>;
    async fn put(
        State(items): State<Items>,
        Path(id): Path<String>,
        headers: HeaderMap,
        body: String,
    ) -> StatusCode {
        let Some(token) = headers
            .get("fencing-token")
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        else {
            return StatusCode::BAD_REQUEST;
        };
        let mut items = items.lock().unwrap();
        let last = items.get(&id).map_or(0, |(t, _)| *t);
        if token < last {
            return StatusCode::CONFLICT;
        }
        items.insert(id, (token, body));
        StatusCode::OK
    }
    let app = axum::Router::new()
        .route("/items/{id}", axum::routing::put(put))
        .with_state(Items::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_conditional_write_refuses_a_holder_whose_token_is_older() {
    let cluster = tokio::task::block_in_place(|| RedisCluster::ready(3, TTL));
    let addr = fenced_http_resource().await;
    let put = |token: Option<u64>, body: &'static str| async move {
        let header = token
            .map(|t| format!("fencing-token: {t}\r\n"))
            .unwrap_or_default();
        let request = format!(
            "PUT /items/last HTTP/1.1\r\nhost: resource\r\n{header}content-length: {}\r\n\
             connection: close\r\n\r\n{body}",
            body.len()
        );
        status_of(addr, &request).await
    };
    let (old, new) = a_holder_and_its_successor(&cluster).await;
    assert_eq!(put(Some(new.fencing_token), "sold to next").await, 200);
    assert_eq!(put(Some(old.fencing_token), "sold to paused").await, 409);
    assert_eq!(put(None, "no token").await, 400);
}

/// Sends one raw HTTP/1.1 request and returns the status of the answer.
async fn status_of(addr: SocketAddr, request: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut conn = tokio::net::TcpStream::connect(addr).await?;
        conn.write_all(request.as_bytes()).await?;
        let mut answer = String::new();
        conn.read_to_string(&mut answer).await?;
        Ok::<_, std::io::Error>(answer)
    };
    let answer = tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .expect("the resource answers within 5 s")
        .expect("the resource answers");
    answer
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"))
}

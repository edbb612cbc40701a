//! The fencing recipes of docs/locks.md, each against a real resource: a paused holder whose
//! lock moved on comes back and writes with its old token, and the resource refuses it.
//!
//! Tokens come from real locks on real redis-server nodes. The resources: a PostgreSQL server
//! (a conditional `UPDATE`), a Redis server (a script that writes only if the token is at least
//! the last one seen) and an HTTP service (a conditional write that answers 409 to an old token).

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use redlock_sidecar::redlock::{Lease, NoObserver, Redlock};
use support::postgres::Postgres;
use support::{RedisCluster, RedisNode};
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
    let deadline = Some(std::time::Instant::now() + TTL * 10);
    let new = next
        .acquire(deadline, &never, |_, _| {})
        .await
        .expect("the successor acquires once the paused holder's key expired");
    assert!(new.fencing_token > old.fencing_token, "tokens grow");
    (old, new)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_refuses_the_update_of_a_holder_whose_token_is_older() {
    let (cluster, pg) =
        tokio::task::block_in_place(|| (RedisCluster::ready(3, TTL), Postgres::start()));
    pg.sql(
        "CREATE TABLE stock (item text PRIMARY KEY, quantity int NOT NULL CHECK (quantity >= 0), \
         fence bigint NOT NULL DEFAULT 0); INSERT INTO stock VALUES ('last-item', 1, 0)",
    );
    // The recipe: write only while no newer token has written; RETURNING says whether it did.
    let sell = |token: u64| {
        pg.sql(&format!(
            "UPDATE stock SET quantity = quantity - 1, fence = {token} \
             WHERE item = 'last-item' AND fence <= {token} AND quantity > 0 RETURNING quantity"
        ))
    };
    let restock = |token: u64| {
        pg.sql(&format!(
            "UPDATE stock SET quantity = quantity + 1, fence = {token} \
             WHERE item = 'last-item' AND fence <= {token} RETURNING quantity"
        ))
    };
    let (old, new) = a_holder_and_its_successor(&cluster).await;
    assert_eq!(
        sell(new.fencing_token),
        "0",
        "the holder sells the last item"
    );
    assert_eq!(
        restock(new.fencing_token),
        "1",
        "and writes again with its token"
    );
    // The paused holder wakes up, still believing it holds the lock.
    assert_eq!(
        sell(old.fencing_token),
        "",
        "the old token's write is refused"
    );
    assert_eq!(
        restock(old.fencing_token),
        "",
        "every write of the old token is refused"
    );
    assert_eq!(
        pg.sql("SELECT quantity || ' ' || fence FROM stock"),
        format!("1 {}", new.fencing_token)
    );
}

/// The Redis recipe: KEYS[1] the value, KEYS[2] the highest token that wrote it; ARGV[1] the
/// token, ARGV[2] the value. 1 if written, 0 if refused.
const FENCED_SET: &str = r#"
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[1]) < last then return 0 end
redis.call('SET', KEYS[2], ARGV[1])
redis.call('SET', KEYS[1], ARGV[2])
return 1
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_script_refuses_the_write_of_a_holder_whose_token_is_older() {
    let (cluster, store) =
        tokio::task::block_in_place(|| (RedisCluster::ready(3, TTL), RedisNode::start()));
    let write = |token: u64, value: &str| {
        store.command(&[
            "EVAL",
            FENCED_SET,
            "2",
            "stock:last-item",
            "stock:last-item:fence",
            &token.to_string(),
            value,
        ])
    };
    let (old, new) = a_holder_and_its_successor(&cluster).await;
    assert_eq!(write(new.fencing_token, "sold to next"), "1");
    assert_eq!(write(new.fencing_token, "shipped"), "1", "same token again");
    assert_eq!(write(old.fencing_token, "sold to paused"), "0");
    assert_eq!(store.command(&["GET", "stock:last-item"]), "shipped");
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

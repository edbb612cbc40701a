//! The admin endpoint: one port, read-only views of the leadership state.
//!
//! | route | answers |
//! |---|---|
//! | `GET /healthz` | 200 while the lock loop runs (liveness; never depends on Redis), else 503 |
//! | `GET /readyz` | 200 while a quorum of nodes is reachable, or with `--ready-when leader` only while leading; else 503 |
//! | `GET`/`HEAD /leader` | 200 while this process leads, else 503; JSON body (see [`LeaderBody`]) |
//! | `GET /leader/watch` | server-sent events: the current state first, then one event per leadership change |
//! | `GET /metrics` | Prometheus text format |
//!
//! Unknown paths answer 404, other methods 405; request bodies are limited to 1 KiB.
//! No route changes any state.
//!
//! Routes that change state live on a second listener, the **control listener**
//! (`--control-listen`, loopback only, [`control_router`]):
//!
//! | route | answers |
//! |---|---|
//! | `POST /v1/leader/resign[?hold=DURATION][&to=IDENTITY]` | with `to`, a waiting candidate (404 if none has that identity) is announced as the successor first; then, leading: steps down, releases the lock at once and does not contend for `hold` (default one ttl; from [`MIN_RESIGN_HOLD`] to an hour); 200 `{"resigned": true, "hold_ms"}` once no longer leading, 503 `{"error"}` if the lock loop has not stepped down within [`RESIGN_ANSWER_WITHIN`]. Not leading: 409 `{"error"}`. A bad `hold` (`0` included) or `to`, or one given twice: 400 `{"error"}` naming it |
//! | `/v1/locks/...`, `/v1.0-alpha1/lock/...`, `/v1.0-alpha1/unlock/...` | request locks and Dapr's lock API, unless `--locks off`: see `crate::locks::routes` |
//!
//! Its errors are JSON (`{"error": "..."}`): 404 for unknown paths, 405 for other methods.
//!
//! **This pod only.** Loopback keeps other hosts out, not a browser or an HTML renderer in
//! the pod, nor a page that rebinds its DNS name to 127.0.0.1. Before any route, the control
//! listener refuses ([`control_refusal`]):
//! - a `Host` (or an absolute request URI) that is not `localhost` or a loopback address
//!   (127.0.0.0/8, `[::1]`, `[::ffff:127.x.y.z]`), with or without a port: 421;
//! - any request with an `Origin` header (browsers send it; the pod's processes do not): 403;
//! - a request with a body whose `Content-Type` is not `application/json` (parameters
//!   allowed): 415. A body-less POST (a resign, a keepalive) needs no content type.
//!
//! Dapr's routes answer these in Dapr's shape (`{"errorCode", "message"}`:
//! `ERR_PERMISSION_DENIED` for 421 and 403, `ERR_MALFORMED_REQUEST` for 415), the others as
//! `{"error"}`. Dapr's SDKs send `Host: 127.0.0.1:PORT` or `localhost:PORT` and JSON: they pass.
//!
//! ## Behaviour
//! The port is meant for probes and scrapers next to the pod; the limits keep a slow or
//! hostile client from holding it, and nothing a client does before its request is complete
//! holds anything another client needs (HTTP/1.1 only). The control listener has the same
//! limits.
//! - **Connections are accepted at once**, up to a cap per listener ([`connection_cap`]: at
//!   most [`MAX_CONNECTIONS`], fewer where the open-files limit is low). At the cap, a new
//!   connection takes the place of the one that has waited longest for a request head (idle
//!   between requests, or sending its head slowly: it is closed); only connections with a
//!   request in progress are never displaced. Probes (`/healthz`, `/readyz`, `/leader`) thus
//!   answer however many slow or idle connections are open, with no queue before them.
//! - A request's head must arrive within [`HEADER_READ_TIMEOUT`] of the connection opening
//!   (or of the previous response, on a kept-alive connection), and fit in [`MAX_HEAD_BYTES`];
//!   else the connection is closed (431 for a head too large). On the control listener, a
//!   request's body must arrive within [`BODY_READ_TIMEOUT`] (else 408).
//! - Long requests have bounds of their own, below the connection cap, so that they never
//!   take every connection: at most [`MAX_WATCHERS`] `/leader/watch` streams at once (one more
//!   answers 503); on the control listener, the request locks' waits and watch streams (see
//!   `crate::locks::service::MAX_WAITING` and `MAX_WATCHES`, 429 past them).
//! - A connection, event streams included, lives at most [`MAX_CONNECTION_AGE`]: then the
//!   stream ends (an SSE client reconnects), the connection is closed after the response in
//!   flight, and dropped if that takes more than [`CLOSE_GRACE`] (a client that stopped reading).
//! - When `accept` fails for want of descriptors, the connection waiting longest for a head is
//!   closed to make room.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::extract::{DefaultBodyLimit, RawQuery, State};
use axum::http::{header, Request, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures_util::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Serialize;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::candidacy::{presence, CandidacyTx};
use crate::clock::{self, Deadline};
use crate::config::ReadyWhen;
use crate::leadership::{Leadership, LeadershipRx};
use crate::metrics::Metrics;

/// Most connections open at once on one listener (see [`connection_cap`]).
pub const MAX_CONNECTIONS: usize = 512;
/// Fewest connections a listener takes, however low the open-files limit.
pub const MIN_CONNECTIONS: usize = 64;
/// Descriptors left to everything but the two listeners' connections (the nodes' connections,
/// the Kubernetes client, the shared timer, logs) when the cap follows the open-files limit.
pub const RESERVED_DESCRIPTORS: u64 = 128;
/// Longest wait for a request's head.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest request head (hyper's read buffer): 431 past it.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Longest wait for a request's body once its head arrived (control listener).
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Most `/leader/watch` streams at once.
pub const MAX_WATCHERS: usize = 16;
/// Longest life of one connection (and of an event stream on it).
pub const MAX_CONNECTION_AGE: Duration = Duration::from_secs(600);
/// How long a closing connection may take to finish its response before it is dropped.
pub const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// What the handlers read.
#[derive(Clone)]
pub struct AdminState {
    /// The leadership channel.
    pub leadership: LeadershipRx,
    /// The metrics registry.
    pub metrics: Arc<Metrics>,
    /// The readiness rule.
    pub ready_when: ReadyWhen,
    /// Ends the event streams on shutdown.
    pub shutdown: CancellationToken,
}

/// The `/leader` JSON body.
#[derive(Debug, Serialize, PartialEq)]
pub struct LeaderBody {
    /// The lock name.
    pub lock: String,
    /// This process' identity.
    pub identity: String,
    /// Whether this process leads now.
    pub is_leader: bool,
    /// The current holder's identity as last read from a quorum; `null` if none.
    pub holder: Option<String>,
    /// When `holder` was read (RFC 3339).
    pub holder_observed_at: Option<String>,
    /// This leader's fencing token; `null` when not leading.
    pub fencing_token: Option<u64>,
    /// Milliseconds of validity left; `null` when not leading.
    pub validity_ms: Option<u64>,
    /// When this tenure began (RFC 3339); `null` when not leading.
    pub leader_since: Option<String>,
    /// Whether the last round reached a quorum of nodes.
    pub quorum_reachable: bool,
}

impl LeaderBody {
    /// The body for `state` as of `now`.
    pub fn new(state: &Leadership, now: Deadline) -> LeaderBody {
        let term = state.leading_at(now);
        let holder = state.holder.as_ref();
        LeaderBody {
            lock: state.lock.clone(),
            identity: state.identity.clone(),
            is_leader: term.is_some(),
            holder: holder.map(|h| h.identity.clone()),
            holder_observed_at: holder.map(|h| rfc3339(h.observed_at)),
            fencing_token: term.map(|t| t.fencing_token),
            validity_ms: term
                .map(|t| t.valid_until.saturating_duration_since(now).as_millis() as u64),
            leader_since: term.map(|t| rfc3339(t.since)),
            quorum_reachable: state.quorum_reachable,
        }
    }
}

/// Whether `/readyz` answers 200 for `state` as of `now`.
pub fn is_ready(state: &Leadership, when: ReadyWhen, now: Deadline) -> bool {
    let leading = state.leading_at(now).is_some();
    match when {
        ReadyWhen::Quorum => leading || state.quorum_reachable,
        ReadyWhen::Leader => leading,
    }
}

fn rfc3339(at: SystemTime) -> String {
    humantime::format_rfc3339_millis(at).to_string()
}

/// The slots for `/leader/watch` streams (one set per router).
#[derive(Clone)]
struct Watchers(Arc<Semaphore>);

/// Fires when the connection a request came on starts closing (age, or shutdown).
#[derive(Clone)]
struct ConnectionEnding(CancellationToken);

/// The router for the admin endpoint.
pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/leader", get(leader))
        .route("/leader/watch", get(watch))
        .route("/metrics", get(metrics))
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found\n") })
        .layer(DefaultBodyLimit::max(1024))
        .layer(Extension(Watchers(Arc::new(Semaphore::new(MAX_WATCHERS)))))
        .with_state(state)
}

/// Serves the admin endpoint on `listener` until `shutdown` fires, within the limits in the
/// module doc; then lets the open connections close (each within [`CLOSE_GRACE`]).
pub async fn serve(listener: TcpListener, state: AdminState) -> std::io::Result<()> {
    let shutdown = state.shutdown.clone();
    serve_router(listener, router(state), shutdown).await
}

/// What the control routes read and change.
#[derive(Clone)]
pub struct ControlState {
    /// The leadership channel (read).
    pub leadership: LeadershipRx,
    /// Whether this sidecar stands for leadership (written by a resign).
    pub candidacy: CandidacyTx,
    /// A resign's hold when the request names none: one ttl.
    pub default_hold: Duration,
}

/// The router for the control listener (routes that change state), with the request-lock
/// routes (`crate::locks::router`) when they are on, behind [`this_pod_only`].
pub fn control_router(state: ControlState, locks: Option<Router>) -> Router {
    let mut router = Router::new()
        .route("/v1/leader/resign", post(resign))
        .with_state(state);
    if let Some(locks) = locks {
        router = router.merge(locks);
    }
    router
        .fallback(|| async { json_error(StatusCode::NOT_FOUND, "no such route") })
        .method_not_allowed_fallback(|| async {
            json_error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        })
        .layer(DefaultBodyLimit::max(1024))
        .layer(axum::middleware::from_fn(body_within_timeout))
        .layer(axum::middleware::from_fn(this_pod_only))
}

/// Reads a request's body (at most 1 KiB, as every control route takes) within
/// [`BODY_READ_TIMEOUT`] before any route sees it: a client that sends its body slowly gets
/// 408 instead of keeping its connection busy. Body-less requests pass as they are; so do
/// bodies announced larger (the routes answer 413 without reading them).
async fn body_within_timeout(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let announced = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    // Without a body, or with one announced too large (the routes refuse it unread).
    if !has_body(request.headers()) || announced.is_some_and(|n| n > 1024) {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    let read = axum::body::to_bytes(body, 1024);
    match clock::within(BODY_READ_TIMEOUT, read).await {
        Ok(Ok(bytes)) => {
            let request = axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes));
            next.run(request).await
        }
        Ok(Err(_)) => json_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request body larger than 1024 bytes",
        ),
        Err(_) => json_error(
            StatusCode::REQUEST_TIMEOUT,
            "the request body did not arrive in time",
        ),
    }
}

/// Why the control listener refuses a request before any route sees it: the answer's status
/// and message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// 421, 403 or 415.
    pub status: StatusCode,
    /// The `error` (or Dapr's `message`).
    pub message: &'static str,
}

/// What the control listener takes, from the processes of this pod only (see the module doc).
/// `None`: the request may go on to its route.
pub fn control_refusal(headers: &axum::http::HeaderMap, uri: &axum::http::Uri) -> Option<Refusal> {
    let hosts = headers.get_all(header::HOST).iter().collect::<Vec<_>>();
    let host_ok = hosts.len() <= 1
        && hosts
            .iter()
            .all(|host| host.to_str().is_ok_and(is_loopback_host))
        && uri.authority().is_none_or(|a| is_loopback_host(a.as_str()));
    if !host_ok {
        return Some(Refusal {
            status: StatusCode::MISDIRECTED_REQUEST,
            message: "the Host must be a loopback address or localhost: this listener serves \
                      the processes of this pod",
        });
    }
    if headers.contains_key(header::ORIGIN) {
        return Some(Refusal {
            status: StatusCode::FORBIDDEN,
            message: "requests with an Origin header are refused: this listener serves the \
                      processes of this pod, not web pages",
        });
    }
    if has_body(headers) && !is_json(headers) {
        return Some(Refusal {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            message: "a request body must be JSON (Content-Type: application/json)",
        });
    }
    None
}

/// `host[:port]` names this machine's loopback: `localhost`, an address in 127.0.0.0/8,
/// `[::1]`, or `[::ffff:127.x.y.z]`; with or without a port.
pub fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        // [v6] or [v6]:port
        Some(rest) => match rest.split_once(']') {
            Some((v6, port)) if port.is_empty() || port.strip_prefix(':').is_some_and(is_port) => {
                return v6
                    .parse::<std::net::Ipv6Addr>()
                    .is_ok_and(|ip| crate::config::is_loopback(ip.into()));
            }
            _ => return false,
        },
        None => match host.rsplit_once(':') {
            Some((name, port)) if is_port(port) => name,
            Some(_) => return false,
            None => host,
        },
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether `text` is a port number (digits only).
fn is_port(text: &str) -> bool {
    !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) && text.parse::<u16>().is_ok()
}

/// Whether the request announces a body: a non-zero `Content-Length`, or any
/// `Transfer-Encoding`.
fn has_body(headers: &axum::http::HeaderMap) -> bool {
    headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get_all(header::CONTENT_LENGTH)
            .iter()
            .any(|length| {
                length
                    .to_str()
                    .ok()
                    .and_then(|l| l.trim().parse::<u64>().ok())
                    != Some(0)
            })
}

/// Whether the one `Content-Type` is `application/json` (parameters such as a charset allowed).
fn is_json(headers: &axum::http::HeaderMap) -> bool {
    let types = headers
        .get_all(header::CONTENT_TYPE)
        .iter()
        .collect::<Vec<_>>();
    match types.as_slice() {
        [one] => one.to_str().is_ok_and(|text| {
            let essence = text.split(';').next().unwrap_or_default().trim();
            essence.eq_ignore_ascii_case("application/json")
        }),
        _ => false,
    }
}

/// The control listener's gate: see [`control_refusal`]. Dapr's routes answer in Dapr's error
/// shape, the others in this listener's.
async fn this_pod_only(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let Some(refusal) = control_refusal(request.headers(), request.uri()) else {
        return next.run(request).await;
    };
    if request.uri().path().starts_with("/v1.0-alpha1/") {
        let code = if refusal.status == StatusCode::UNSUPPORTED_MEDIA_TYPE {
            "ERR_MALFORMED_REQUEST"
        } else {
            "ERR_PERMISSION_DENIED"
        };
        return (
            refusal.status,
            Json(serde_json::json!({ "errorCode": code, "message": refusal.message })),
        )
            .into_response();
    }
    json_error(refusal.status, refusal.message)
}

/// How many connections one listener takes at once when the process may open
/// `open_files` descriptors: half of what [`RESERVED_DESCRIPTORS`] leaves (two listeners), from
/// [`MIN_CONNECTIONS`] to [`MAX_CONNECTIONS`].
pub fn connection_cap(open_files: u64) -> usize {
    let half = open_files.saturating_sub(RESERVED_DESCRIPTORS) / 2;
    usize::try_from(half)
        .unwrap_or(usize::MAX)
        .clamp(MIN_CONNECTIONS, MAX_CONNECTIONS)
}

/// The soft open-files limit now (`run` raises it to the hard one at start).
fn open_files_limit() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the rlimit we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 1024;
    }
    if limit.rlim_cur == libc::RLIM_INFINITY {
        return u64::MAX;
    }
    limit.rlim_cur
}

/// The open connections of one listener: which have a request in progress, and which has
/// waited longest for a request head (the one a new connection displaces at the cap).
struct Connections {
    cap: usize,
    open: std::sync::Mutex<Open>,
    /// Notified when the last connection closes.
    all_closed: tokio::sync::Notify,
}

#[derive(Default)]
struct Open {
    /// Each open connection: requests in progress, when it began waiting for a head (an
    /// ever-growing count, not a clock: only the order matters), and what closes it.
    by_id: std::collections::HashMap<u64, OpenConnection>,
    next: u64,
}

struct OpenConnection {
    requests: usize,
    waiting_since: u64,
    displace: CancellationToken,
}

impl Connections {
    fn new(cap: usize) -> Arc<Connections> {
        Arc::new(Connections {
            cap,
            open: std::sync::Mutex::new(Open::default()),
            all_closed: tokio::sync::Notify::new(),
        })
    }

    fn open(&self) -> std::sync::MutexGuard<'_, Open> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a new connection: at the cap, in place of the one waiting longest for a head;
    /// `None` when every connection has a request in progress.
    fn admit(self: &Arc<Self>) -> Option<Connection> {
        let mut open = self.open();
        if open.by_id.len() >= self.cap && !Connections::displace_one(&mut open) {
            return None;
        }
        open.next += 1;
        let id = open.next;
        let displace = CancellationToken::new();
        open.by_id.insert(
            id,
            OpenConnection {
                requests: 0,
                waiting_since: id,
                displace: displace.clone(),
            },
        );
        Some(Connection {
            id,
            connections: Arc::clone(self),
            displaced: displace,
            requests: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// Closes the connection that has waited longest for a request head; whether there was one.
    fn displace_one(open: &mut Open) -> bool {
        let oldest = open
            .by_id
            .iter()
            .filter(|(_, c)| c.requests == 0)
            .min_by_key(|(_, c)| c.waiting_since)
            .map(|(id, _)| *id);
        let Some(oldest) = oldest.and_then(|id| open.by_id.remove(&id)) else {
            return false;
        };
        oldest.displace.cancel();
        true
    }

    /// Closes the connection waiting longest for a head, to free its descriptor.
    fn make_room(&self) -> bool {
        Connections::displace_one(&mut self.open())
    }

    /// Returns once no connection is open.
    async fn closed(&self) {
        loop {
            let closed = self.all_closed.notified();
            tokio::pin!(closed);
            closed.as_mut().enable();
            if self.open().by_id.is_empty() {
                return;
            }
            closed.await;
        }
    }
}

/// One accepted connection, counted until dropped.
struct Connection {
    id: u64,
    connections: Arc<Connections>,
    /// Fires when a new connection takes its place.
    displaced: CancellationToken,
    /// Requests in progress on it (also once displaced).
    requests: std::sync::atomic::AtomicUsize,
}

impl Connection {
    /// A request on it has arrived whole: it is in progress until the returned guard (held by
    /// its response body) is dropped.
    fn request(self: &Arc<Self>) -> InProgress {
        self.requests
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if let Some(c) = self.connections.open().by_id.get_mut(&self.id) {
            c.requests += 1;
        }
        InProgress(Arc::clone(self))
    }

    /// Whether a request is in progress on it.
    fn busy(&self) -> bool {
        self.requests.load(std::sync::atomic::Ordering::SeqCst) > 0
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        let mut open = self.connections.open();
        open.by_id.remove(&self.id);
        if open.by_id.is_empty() {
            self.connections.all_closed.notify_waiters();
        }
    }
}

/// A request in progress, until its response has been written.
struct InProgress(Arc<Connection>);

impl Drop for InProgress {
    fn drop(&mut self) {
        let connection = &self.0;
        connection
            .requests
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        let mut open = connection.connections.open();
        open.next += 1;
        let now = open.next;
        if let Some(c) = open.by_id.get_mut(&connection.id) {
            c.requests = c.requests.saturating_sub(1);
            if c.requests == 0 {
                c.waiting_since = now;
            }
        }
    }
}

/// A response body that keeps its request counted as in progress until it has been sent
/// (an event stream: until it ends).
struct Counted<B> {
    body: B,
    _request: InProgress,
}

impl<B: hyper::body::Body + Unpin> hyper::body::Body for Counted<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<B::Data>, B::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Serves `app` on `listener` until `shutdown` fires, within the limits in the module doc;
/// then lets the open connections close (each within [`CLOSE_GRACE`]).
pub async fn serve_router(
    listener: TcpListener,
    app: Router,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let connections = Connections::new(connection_cap(open_files_limit()));
    loop {
        let stream = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    accept_failed(err, &connections).await;
                    continue;
                }
            },
        };
        // Every connection has a request in progress, the streams and waits within their own
        // bounds: this one is closed at once.
        let Some(connection) = connections.admit() else {
            continue;
        };
        let ending = shutdown.child_token();
        tokio::spawn(serve_connection(stream, app.clone(), ending, connection));
    }
    connections.closed().await;
    Ok(())
}

/// After a failed accept: at once for a connection that died in the queue; out of
/// descriptors, after closing the connection waiting longest for a head (or a pause if there
/// is none); after a pause for anything else, so the loop does not spin.
async fn accept_failed(err: std::io::Error, connections: &Connections) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        err.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    let out_of_descriptors = matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
    if out_of_descriptors && connections.make_room() {
        // Its task closes it on its next turn.
        clock::pause(Duration::from_millis(1)).await;
        return;
    }
    warn!(error = %err, "an HTTP listener cannot accept a connection");
    clock::pause(Duration::from_secs(1)).await;
}

/// Serves one connection: HTTP/1.1 with the header timeout, closed at [`MAX_CONNECTION_AGE`],
/// when `ending` fires, or at once when a new connection takes its place.
async fn serve_connection(
    stream: TcpStream,
    app: Router,
    ending: CancellationToken,
    connection: Connection,
) {
    // Small answers go out at once, not held back waiting for the client's ACK (Nagle).
    let _ = stream.set_nodelay(true);
    let tag = ConnectionEnding(ending.clone());
    let connection = Arc::new(connection);
    let counts = Arc::clone(&connection);
    let service = hyper::service::service_fn(move |mut request: Request<hyper::body::Incoming>| {
        let in_progress = counts.request();
        request.extensions_mut().insert(tag.clone());
        let mut app = app.clone();
        async move {
            let response = tower_service::Service::call(&mut app, request).await?;
            Ok::<_, std::convert::Infallible>(response.map(|body| Counted {
                body,
                _request: in_progress,
            }))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_HEAD_BYTES);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => return,
        _ = clock::pause(MAX_CONNECTION_AGE) => {}
        _ = ending.cancelled() => {}
        _ = connection.displaced.cancelled() => {
            // Waiting for a head: closed at once. (A request that arrived meanwhile is
            // answered first.)
            if !connection.busy() {
                return;
            }
        }
    }
    // End this connection's event stream, finish the response in flight, then close.
    ending.cancel();
    conn.as_mut().graceful_shutdown();
    let _ = clock::within(CLOSE_GRACE, conn).await;
}

/// Binds the admin address (before anything else starts, so a busy port fails fast).
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

fn status(ok: bool) -> StatusCode {
    if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn healthz(State(state): State<AdminState>) -> impl IntoResponse {
    // The sender lives as long as the lock loop.
    let running = state.leadership.has_changed().is_ok();
    (status(running), if running { "ok\n" } else { "stopped\n" })
}

async fn readyz(State(state): State<AdminState>) -> impl IntoResponse {
    let ready = is_ready(
        &state.leadership.borrow(),
        state.ready_when,
        Deadline::now(),
    );
    (status(ready), if ready { "ready\n" } else { "not ready\n" })
}

async fn leader(State(state): State<AdminState>) -> impl IntoResponse {
    let body = LeaderBody::new(&state.leadership.borrow(), Deadline::now());
    (status(body.is_leader), Json(body))
}

async fn metrics(State(state): State<AdminState>) -> Response {
    let text = state.metrics.render(&state.leadership.borrow());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

fn json_error(status: StatusCode, error: &str) -> Response {
    (status, Json(serde_json::json!({ "error": error }))).into_response()
}

/// The longest a resign waits for the lock loop to step down before it answers.
pub const RESIGN_ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// The shortest resign hold. A hold must outlast the lock loop's noticing it (else the loop
/// finds the hold over and leads on), and a sidecar that contends again at once wins the lock
/// back before a standby, woken by the release, has finished its round: `hold=0` would answer
/// "resigned" and change nothing, so it is refused.
pub const MIN_RESIGN_HOLD: Duration = Duration::from_secs(1);

async fn resign(State(state): State<ControlState>, RawQuery(query): RawQuery) -> Response {
    let Resign { hold, to } = match resign_query(query.as_deref(), state.default_hold) {
        Ok(asked) => asked,
        Err(why) => return json_error(StatusCode::BAD_REQUEST, &why),
    };
    let Some(token) = state
        .leadership
        .borrow()
        .leading_at(Deadline::now())
        .map(|t| t.fencing_token)
    else {
        return json_error(StatusCode::CONFLICT, "not leading");
    };
    if let Some(to) = &to {
        if !state.candidacy.borrow().waits_as(to) {
            return json_error(
                StatusCode::NOT_FOUND,
                "no waiting candidate of this lock has that identity (see the other sidecars' /leader and redlock_candidacy)",
            );
        }
        if let Err(why) = name_successor(&state.candidacy, to).await {
            return json_error(StatusCode::SERVICE_UNAVAILABLE, why);
        }
    }
    state
        .candidacy
        .send_modify(|c| c.resign(hold, Deadline::now()));
    // Stepped down: not leading, or leading in a later tenure (after the hold) than the one
    // resigned from.
    let mut leadership = state.leadership.clone();
    let stepped_down = leadership.wait_for(|l| {
        l.leading_at(Deadline::now())
            .is_none_or(|t| t.fencing_token != token)
    });
    let stepped_down = matches!(
        clock::within(RESIGN_ANSWER_WITHIN, stepped_down).await,
        Ok(Ok(_))
    );
    if !stepped_down {
        return json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "still leading: the lock loop did not step down in time; the hold stands, see /leader",
        );
    }
    let hold_ms = u64::try_from(hold.as_millis()).unwrap_or(u64::MAX);
    (
        StatusCode::OK,
        Json(serde_json::json!({ "resigned": true, "hold_ms": hold_ms, "to": to })),
    )
        .into_response()
}

/// Announces `to` as the successor on the nodes (through the presence task), then gives the
/// other candidates a presence period to read it, so that they defer to it when the lock is
/// released; or why it could not be announced.
async fn name_successor(candidacy: &CandidacyTx, to: &str) -> Result<(), &'static str> {
    let mut changes = candidacy.subscribe();
    candidacy.send_modify(|c| c.hand_over_to(to));
    let announced = changes.wait_for(|c| c.successor_announced());
    match clock::within(RESIGN_ANSWER_WITHIN, announced).await {
        Ok(Ok(_)) => {}
        _ => return Err("the successor could not be announced on the nodes; still leading"),
    }
    clock::pause(presence::PERIOD + SUCCESSOR_READ_SLACK).await;
    Ok(())
}

/// A resign's query.
#[derive(Debug, PartialEq, Eq)]
struct Resign {
    hold: Duration,
    /// The waiting candidate to hand over to.
    to: Option<String>,
}

/// A resign's query (`hold=DURATION`, `to=IDENTITY`, each at most once, nothing else), or why
/// it is refused.
fn resign_query(query: Option<&str>, default: Duration) -> Result<Resign, String> {
    let mut asked = Resign {
        hold: default,
        to: None,
    };
    let (mut seen_hold, mut seen_to) = (false, false);
    for pair in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        match pair.split_once('=') {
            Some(("hold", text)) => {
                crate::locks::bounds::once("hold", &mut seen_hold)?;
                asked.hold = humantime::parse_duration(text)
                    .ok()
                    .filter(|d| (MIN_RESIGN_HOLD..=crate::config::MAX_APP_WAIT).contains(d))
                    .ok_or_else(|| {
                        "hold: a duration from 1s to 1h such as 30s or 2m (hold=0 is refused: \
                         contending again at once would win the lock back)"
                            .to_owned()
                    })?;
            }
            Some(("to", text)) => {
                crate::locks::bounds::once("to", &mut seen_to)?;
                let identity = percent_decode(text)
                    .filter(|id| {
                        !id.is_empty()
                            && id.len() <= MAX_IDENTITY_LEN
                            && !id.chars().any(char::is_control)
                    })
                    .ok_or_else(|| {
                        format!("to: a sidecar's identity, 1 to {MAX_IDENTITY_LEN} characters without control characters")
                    })?;
                asked.to = Some(identity);
            }
            _ => return Err("the query parameters are hold=DURATION and to=IDENTITY".to_owned()),
        }
    }
    Ok(asked)
}

/// Longest identity `to` may name (a pod name is at most 253 characters).
const MAX_IDENTITY_LEN: usize = 253;
/// What a candidate's reading of a newly named successor may take past a presence period.
const SUCCESSOR_READ_SLACK: Duration = Duration::from_millis(300);

/// `text` with `%XX` escapes (and `+` as a space) decoded, if it is valid UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = text.get(i + 1..i + 3)?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            byte => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

async fn watch(
    State(state): State<AdminState>,
    Extension(watchers): Extension<Watchers>,
    ending: Option<Extension<ConnectionEnding>>,
) -> Response {
    let Ok(slot) = watchers.0.try_acquire_owned() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("too many /leader/watch streams (at most {MAX_WATCHERS})\n"),
        )
            .into_response();
    };
    // The connection's own signal is a child of the shutdown token: it fires on both.
    let end = ending.map_or_else(|| state.shutdown.clone(), |Extension(e)| e.0);
    let changes = WatchStream::new(state.leadership.clone())
        .map(|leadership| LeaderBody::new(&leadership, Deadline::now()))
        .scan(
            None,
            |last: &mut Option<(bool, Option<String>, Option<u64>)>, body| {
                // One event per change of who leads, not per renewal or holder refresh.
                let key = (body.is_leader, body.holder.clone(), body.fencing_token);
                let changed = last.as_ref() != Some(&key);
                *last = Some(key);
                std::future::ready(Some(changed.then_some(body)))
            },
        )
        .filter_map(std::future::ready)
        .map(|body| {
            let data = serde_json::to_string(&body).unwrap_or_default();
            Ok(Event::default().event("leadership").data(data))
        })
        .take_until(end.cancelled_owned())
        .map(move |event: Result<Event, std::convert::Infallible>| {
            // The stream owns its slot: dropping the stream frees it.
            let _slot: &OwnedSemaphorePermit = &slot;
            event
        });
    Sse::new(changes)
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::leadership::{HolderView, Role, Term};

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
}

//! The connections of one listener: accepted at once up to a cap, each with its head timeout
//! and its age, displaced at the cap when waiting longest for a head, and closed gracefully
//! at shutdown (the limits of the module doc of [`crate::http`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::Request;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{
    CLOSE_GRACE, HEADER_READ_TIMEOUT, MAX_CONNECTIONS, MAX_CONNECTION_AGE, MAX_HEAD_BYTES,
    MIN_CONNECTIONS, RESERVED_DESCRIPTORS,
};
use crate::clock;

/// Fires when the connection a request came on starts closing (age, or shutdown).
#[derive(Clone)]
pub(super) struct ConnectionEnding(pub(super) CancellationToken);

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
pub(super) struct Connections {
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
    pub(super) fn new(cap: usize) -> Arc<Connections> {
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
    pub(super) fn admit(self: &Arc<Self>) -> Option<Connection> {
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
pub(super) struct Connection {
    id: u64,
    connections: Arc<Connections>,
    /// Fires when a new connection takes its place.
    pub(super) displaced: CancellationToken,
    /// Requests in progress on it (also once displaced).
    requests: std::sync::atomic::AtomicUsize,
}

impl Connection {
    /// A request on it has arrived whole: it is in progress until the returned guard (held by
    /// its response body) is dropped.
    pub(super) fn request(self: &Arc<Self>) -> InProgress {
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
pub(super) struct InProgress(Arc<Connection>);

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

/// Serves `app` on `listener` until `shutdown` fires, within the limits in the module doc of
/// [`crate::http`]; then lets the open connections close (each within [`CLOSE_GRACE`]).
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

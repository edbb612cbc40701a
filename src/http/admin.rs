//! The admin endpoint's routes: read-only views of the leadership state (see the module doc
//! of [`crate::http`] for what each answers).

use std::sync::Arc;
use std::time::SystemTime;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use futures_util::StreamExt;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::CancellationToken;

use super::server::{serve_router, ConnectionEnding};
use super::MAX_WATCHERS;
use crate::clock::Deadline;
use crate::config::ReadyWhen;
use crate::leadership::{Leadership, LeadershipRx};
use crate::metrics::Metrics;

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
/// module doc of [`crate::http`]; then lets the open connections close (each within
/// [`CLOSE_GRACE`](super::CLOSE_GRACE)).
pub async fn serve(listener: TcpListener, state: AdminState) -> std::io::Result<()> {
    let shutdown = state.shutdown.clone();
    serve_router(listener, router(state), shutdown).await
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

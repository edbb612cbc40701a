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

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use futures_util::{Stream, StreamExt};
use serde::Serialize;
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::CancellationToken;

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
    pub fn new(state: &Leadership, now: Instant) -> LeaderBody {
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
pub fn is_ready(state: &Leadership, when: ReadyWhen, now: Instant) -> bool {
    let leading = state.leading_at(now).is_some();
    match when {
        ReadyWhen::Quorum => leading || state.quorum_reachable,
        ReadyWhen::Leader => leading,
    }
}

fn rfc3339(at: SystemTime) -> String {
    humantime::format_rfc3339_millis(at).to_string()
}

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
        .with_state(state)
}

/// Serves the admin endpoint on `listener` until `shutdown` fires.
pub async fn serve(listener: tokio::net::TcpListener, state: AdminState) -> std::io::Result<()> {
    let shutdown = state.shutdown.clone();
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
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
        crate::clock::now(),
    );
    (status(ready), if ready { "ready\n" } else { "not ready\n" })
}

async fn leader(State(state): State<AdminState>) -> impl IntoResponse {
    let body = LeaderBody::new(&state.leadership.borrow(), crate::clock::now());
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
) -> Sse<impl Stream<Item = Result<Event, std::convert::Infallible>>> {
    let changes = WatchStream::new(state.leadership.clone())
        .map(|leadership| LeaderBody::new(&leadership, crate::clock::now()))
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
        .take_until(state.shutdown.cancelled_owned());
    Sse::new(changes).keep_alive(KeepAlive::default())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::leadership::{HolderView, Role, Term};

    fn leader(step_down_in: Duration) -> (Leadership, Instant) {
        let now = Instant::now();
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

    #[test]
    fn readiness_follows_quorum_or_leadership() {
        let mut follower = Leadership::new("jobs", "pod-b");
        let now = Instant::now();
        assert!(!is_ready(&follower, ReadyWhen::Quorum, now));
        follower.quorum_reachable = true;
        assert!(is_ready(&follower, ReadyWhen::Quorum, now));
        assert!(!is_ready(&follower, ReadyWhen::Leader, now));
    }
}

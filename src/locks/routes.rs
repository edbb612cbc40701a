//! The request-lock routes of the control listener (loopback only).
//!
//! | route | answers |
//! |---|---|
//! | `POST /v1/locks/{name}?wait=DURATION&ttl=DURATION` | 200 `{"lease", "fencing_token", "validity_ms"}`; 409 `{"error", "holder"}` still held elsewhere after `wait`; 503 `{"error", "kind"}` without a quorum or while shutting down; 429 at once past the bound on leases (`--locks-max-leases`) or, with a wait, past [`MAX_WAITING`] acquisitions waiting; 400 for a bad name, ttl or wait |
//! | `POST /v1/locks/{name}/{lease}/keepalive` | 200 as above (validity as last renewed); 404 unknown lease; 410 `{"error", "ended"}` for a lease that ended (`lost`, `abandoned`, `shutdown`) |
//! | `GET /v1/locks/{name}/{lease}/watch` | server-sent events: `held` now and after every renewal, then `lost` (before the validity ends) or `released`, and the stream ends. An open stream keeps the lease alive. 404 / 410 as above; 429 past [`MAX_WATCHES`] streams open |
//! | `DELETE /v1/locks/{name}/{lease}` | 200 `{"released": true}` once released on the nodes; 404 unknown lease; 410 for a lease that had ended (then forgotten) |
//! | `POST /v1.0-alpha1/lock/{store}`, `POST /v1.0-alpha1/unlock/{store}` | Dapr's lock API (see [`super::dapr`]) |
//!
//! Every error is JSON. Request bodies over [`MAX_BODY`] bytes answer 413.

use std::sync::Arc;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde_json::json;

use super::api::Api;
use super::bounds;
use super::engine::LockEngine;
use super::lease_id::LeaseId;
use super::service::{End, Found, Granted, LeaseState, Refused};
#[cfg(doc)]
use super::service::{MAX_WAITING, MAX_WATCHES};
use crate::clock::Deadline;

/// Largest request body, in bytes (a Dapr request with the longest name and owner fits).
pub const MAX_BODY: usize = 1024;

/// The request-lock routes (merged into the control router).
pub fn router<E: LockEngine>(api: Api<E>) -> Router {
    Router::new()
        .route("/v1/locks/{name}", post(acquire::<E>))
        .route("/v1/locks/{name}/{lease}/keepalive", post(keepalive::<E>))
        .route("/v1/locks/{name}/{lease}/watch", get(watch::<E>))
        .route("/v1/locks/{name}/{lease}", delete(release::<E>))
        .route("/v1.0-alpha1/lock/{store}", post(super::dapr::lock::<E>))
        .route(
            "/v1.0-alpha1/unlock/{store}",
            post(super::dapr::unlock::<E>),
        )
        .layer(middleware::from_fn(refuse_large_bodies))
        .with_state(Arc::new(api))
}

/// 413 for a body announced larger than [`MAX_BODY`] (routes that read a body also stop
/// reading there).
async fn refuse_large_bodies(request: Request, next: Next) -> Response {
    let announced = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > MAX_BODY as u64) {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("request body larger than {MAX_BODY} bytes"),
        );
    }
    next.run(request).await
}

/// A JSON error.
pub fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

fn granted(granted: &Granted, now: Deadline) -> serde_json::Value {
    json!({
        "lease": granted.lease.to_string(),
        "fencing_token": granted.fencing_token,
        "validity_ms": millis(granted.valid_until, now),
    })
}

fn millis(until: Deadline, now: Deadline) -> u64 {
    u64::try_from(until.saturating_duration_since(now).as_millis()).unwrap_or(u64::MAX)
}

/// The answer for a refused acquisition.
pub fn refused(refused: Refused) -> Response {
    match refused {
        Refused::Held { holder } => (
            StatusCode::CONFLICT,
            Json(json!({ "error": "held elsewhere", "holder": holder })),
        )
            .into_response(),
        Refused::NoQuorum { kind } => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "error": "no quorum of Redis nodes", "kind": kind })),
        )
            .into_response(),
        Refused::TooMany { max } => error(StatusCode::TOO_MANY_REQUESTS, &too_many_leases(max)),
        Refused::TooManyWaiting { max } => error(
            StatusCode::TOO_MANY_REQUESTS,
            &format!(
                "too many acquisitions waiting in this sidecar (at most {max} with a wait at \
                 once); retry later or with wait=0"
            ),
        ),
        Refused::Invalid(why) => error(StatusCode::BAD_REQUEST, &why),
        Refused::ShuttingDown => error(StatusCode::SERVICE_UNAVAILABLE, "shutting down"),
        Refused::Cancelled => error(StatusCode::SERVICE_UNAVAILABLE, "cancelled"),
    }
}

/// The 429 message past `--locks-max-leases`.
pub fn too_many_leases(max: usize) -> String {
    format!(
        "too many leases in this sidecar (at most {max}: held, waiting, ending and recently \
         ended ones count)"
    )
}

fn not_found(found: Found) -> Response {
    match found {
        Found::Unknown => error(StatusCode::NOT_FOUND, "unknown lease"),
        Found::Ended(end) => ended(end),
        Found::TooManyWatches { max } => error(
            StatusCode::TOO_MANY_REQUESTS,
            &format!("too many watch streams in this sidecar (at most {max} at once)"),
        ),
    }
}

fn ended(end: End) -> Response {
    (
        StatusCode::GONE,
        Json(json!({ "error": end.explain(), "ended": end.as_str() })),
    )
        .into_response()
}

fn bad_path(rejection: PathRejection) -> Response {
    error(StatusCode::BAD_REQUEST, &format!("bad path: {rejection}"))
}

/// The name and lease of a lease route; an id that is no id of ours is an unknown lease.
fn lease_path(
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<(String, LeaseId), Box<Response>> {
    let Path((name, lease)) = path.map_err(|e| Box::new(bad_path(e)))?;
    bounds::name(&name).map_err(|why| Box::new(error(StatusCode::BAD_REQUEST, &why)))?;
    let id = LeaseId::parse(&lease).ok_or_else(|| Box::new(not_found(Found::Unknown)))?;
    Ok((name, id))
}

async fn acquire<E: LockEngine>(
    State(api): State<Arc<Api<E>>>,
    path: Result<Path<String>, PathRejection>,
    RawQuery(query): RawQuery,
) -> Response {
    let name = match path {
        Ok(Path(name)) => name,
        Err(rejection) => return bad_path(rejection),
    };
    if let Err(why) = bounds::name(&name) {
        return error(StatusCode::BAD_REQUEST, &why);
    }
    let asked = match bounds::acquire_query(query.as_deref()) {
        Ok(asked) => asked,
        Err(why) => return error(StatusCode::BAD_REQUEST, &why),
    };
    match api.locks.acquire(&name, asked.ttl, asked.wait, None).await {
        Ok(lease) => Json(granted(&lease, Deadline::now())).into_response(),
        Err(why) => refused(why),
    }
}

async fn keepalive<E: LockEngine>(
    State(api): State<Arc<Api<E>>>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    let (name, id) = match lease_path(path) {
        Ok(found) => found,
        Err(response) => return *response,
    };
    match api.locks.keepalive(&name, id) {
        Ok(lease) => Json(granted(&lease, Deadline::now())).into_response(),
        Err(found) => not_found(found),
    }
}

async fn release<E: LockEngine>(
    State(api): State<Arc<Api<E>>>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    let (name, id) = match lease_path(path) {
        Ok(found) => found,
        Err(response) => return *response,
    };
    match api.locks.release(&name, id).await {
        Ok(()) => Json(json!({ "released": true })).into_response(),
        Err(found) => not_found(found),
    }
}

async fn watch<E: LockEngine>(
    State(api): State<Arc<Api<E>>>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    let (name, id) = match lease_path(path) {
        Ok(found) => found,
        Err(response) => return *response,
    };
    let watching = match api.locks.watch(&name, id) {
        Ok(watching) => watching,
        Err(found) => return not_found(found),
    };
    let lease = id.to_string();
    // State: the watch (dropping it ends the keepalive it gives), and whether the stream
    // has said its last word. The first state is sent at once.
    let events = futures_util::stream::unfold(
        (watching, false, true),
        move |(mut watching, done, first)| {
            let lease = lease.clone();
            async move {
                if done {
                    return None;
                }
                if !first && watching.states.changed().await.is_err() {
                    return None;
                }
                let state = *watching.states.borrow_and_update();
                let now = Deadline::now();
                let token = watching.fencing_token;
                let (event, last) = match state {
                    LeaseState::Held { valid_until } => (
                        Event::default().event("held").data(
                            json!({
                                "lease": lease,
                                "fencing_token": token,
                                "validity_ms": millis(valid_until, now),
                            })
                            .to_string(),
                        ),
                        false,
                    ),
                    LeaseState::Ended(End::Lost) => (
                        Event::default()
                            .event("lost")
                            .data(json!({ "lease": lease, "fencing_token": token }).to_string()),
                        true,
                    ),
                    LeaseState::Ended(end) => (
                        Event::default()
                            .event("released")
                            .data(json!({ "lease": lease, "reason": end.as_str() }).to_string()),
                        true,
                    ),
                };
                Some((
                    Ok::<_, std::convert::Infallible>(event),
                    (watching, last, false),
                ))
            }
        },
    );
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

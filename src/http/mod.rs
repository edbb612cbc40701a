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
//!
//! | file | concern |
//! |---|---|
//! | [`admin`] | the admin routes: health, readiness, `/leader`, its event stream, metrics |
//! | [`control`] | the control listener's router and its gate: this pod's requests only |
//! | [`resign`] | `POST /v1/leader/resign`: its query, the successor, the step-down |
//! | [`server`] | the connections of a listener: the cap, the timeouts, the age, closing |

use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

pub mod admin;
pub mod control;
pub mod resign;
pub mod server;

pub use admin::{is_ready, router, serve, AdminState, LeaderBody};
pub use control::{control_refusal, control_router, is_loopback_host, Refusal};
pub use resign::{ControlState, MIN_RESIGN_HOLD, RESIGN_ANSWER_WITHIN};
pub use server::{bind, connection_cap, serve_router};

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

/// A JSON error answer: `{"error": ...}` with `status`.
fn json_error(status: StatusCode, error: &str) -> Response {
    (status, Json(serde_json::json!({ "error": error }))).into_response()
}

#[cfg(test)]
mod tests;

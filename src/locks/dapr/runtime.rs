//! This sidecar as a Dapr runtime: what Dapr's metadata and health routes answer.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::http::dapr_error;
use super::{RUNTIME_VERSION, STORE_TYPE, STORE_VERSION};
use crate::leadership::LeadershipRx;

/// What Dapr's metadata and health answers read: this sidecar as a Dapr runtime.
#[derive(Clone)]
pub struct Runtime {
    /// Reported as the app id: this sidecar's identity (`--identity`, the pod's name).
    pub identity: String,
    /// The lock store's name (`--locks-dapr-store`).
    pub store: String,
    /// `--dapr-grpc-listen`, if Dapr's gRPC API is served.
    pub grpc_listen: Option<SocketAddr>,
    /// The leadership state: whether a round reached a quorum of nodes.
    leadership: LeadershipRx,
    /// Cancelled when the sidecar begins shutting down.
    closing: CancellationToken,
    /// Set once a round of this sidecar reached a quorum of nodes.
    initialised: Arc<AtomicBool>,
}

impl Runtime {
    /// This sidecar as a Dapr runtime: its identity, its store, where its gRPC API listens;
    /// its health follows `leadership` and `closing`.
    pub fn new(
        identity: &str,
        store: &str,
        grpc_listen: Option<SocketAddr>,
        leadership: LeadershipRx,
        closing: CancellationToken,
    ) -> Runtime {
        Runtime {
            identity: identity.to_owned(),
            store: store.to_owned(),
            grpc_listen,
            leadership,
            closing,
            initialised: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Whether this sidecar serves Dapr's lock API: once a round reached a quorum of nodes
    /// (daprd is healthy once its lock store has connected), until the sidecar begins shutting
    /// down. `Err` says why not.
    ///
    /// A quorum lost later does not change it, as daprd's health does not follow Redis: a lock
    /// call then answers at once, `ERR_TRY_LOCK_FAILED` with `REDLOCK_NO_QUORUM`, where a
    /// failing health check would hold every new client of Dapr's Python SDK (which checks
    /// `/v1.0/healthz/outbound` each time one is made, often once per request) for its
    /// `DAPR_HEALTH_TIMEOUT`, a minute by default.
    pub fn serving(&self) -> Result<(), &'static str> {
        if self.closing.is_cancelled() {
            return Err("the sidecar is shutting down");
        }
        if !self.initialised.load(Ordering::Relaxed) {
            let reached = self.leadership.borrow().quorum_reachable;
            if !reached {
                return Err("no round has reached a quorum of Redis nodes yet");
            }
            self.initialised.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Notes the first round that reaches a quorum, even if nobody asks for the health then
    /// (runs until it has, or the leadership channel closes).
    pub async fn follow(self) {
        let mut leadership = self.leadership.clone();
        if leadership
            .wait_for(|state| state.quorum_reachable)
            .await
            .is_ok()
        {
            self.initialised.store(true, Ordering::Relaxed);
        }
    }

    /// The extended metadata: this sidecar's version, and where its gRPC API listens.
    pub fn extended(&self) -> Vec<(&'static str, String)> {
        let mut extended = vec![(
            "redlock-sidecar.version",
            env!("CARGO_PKG_VERSION").to_owned(),
        )];
        if let Some(addr) = self.grpc_listen {
            extended.push(("redlock-sidecar.grpc-listen", addr.to_string()));
        }
        extended
    }

    /// `GET /v1.0/metadata`'s body, in daprd's shape (empty lists and unset fields left out,
    /// as daprd leaves them out): the identity as `id`, [`RUNTIME_VERSION`], one lock store
    /// component of type [`STORE_TYPE`], the actor runtime disabled.
    pub fn metadata_json(&self) -> serde_json::Value {
        let extended: serde_json::Map<String, serde_json::Value> = self
            .extended()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), serde_json::Value::from(v)))
            .collect();
        json!({
            "id": self.identity,
            "runtimeVersion": RUNTIME_VERSION,
            "components": [{
                "name": self.store,
                "type": STORE_TYPE,
                "version": STORE_VERSION,
            }],
            "extended": extended,
            "actorRuntime": { "runtimeStatus": "DISABLED", "hostReady": false },
        })
    }
}

/// `GET /v1.0/metadata`, `/v1.0/healthz` and `/v1.0/healthz/outbound` (merged into the
/// control router beside the lock routes). Spawns [`Runtime::follow`] on the current runtime.
pub fn runtime_router(runtime: Runtime) -> Router {
    tokio::spawn(runtime.clone().follow());
    Router::new()
        .route("/v1.0/metadata", get(metadata))
        .route("/v1.0/healthz", get(healthz))
        .route("/v1.0/healthz/outbound", get(healthz_outbound))
        .with_state(Arc::new(runtime))
}

async fn metadata(State(runtime): State<Arc<Runtime>>) -> Response {
    Json(runtime.metadata_json()).into_response()
}

async fn healthz(State(runtime): State<Arc<Runtime>>) -> Response {
    match runtime.serving() {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(why) => dapr_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "ERR_HEALTH_NOT_READY",
            &format!("dapr is not ready: {why}"),
        ),
    }
}

async fn healthz_outbound(State(runtime): State<Arc<Runtime>>) -> Response {
    match runtime.serving() {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(why) => dapr_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "ERR_OUTBOUND_HEALTH_NOT_READY",
            &format!("dapr outbound is not ready: {why}"),
        ),
    }
}

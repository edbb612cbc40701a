//! Dapr's distributed lock API (v1.0-alpha1), answer for answer, and the routes Dapr's SDKs
//! call before they lock: an app written for Dapr switches by changing the port.
//!
//! | request | answer |
//! |---|---|
//! | `POST /v1.0-alpha1/lock/{store}` `{"resourceId", "lockOwner", "expiryInSeconds"}` | 200 `{"success": true}` when taken, `{"success": false}` when held (also by the same owner: Dapr's try-lock does not re-enter) |
//! | `POST /v1.0-alpha1/unlock/{store}` `{"resourceId", "lockOwner"}` | 200 `{"status": 0}` unlocked, `1` no such lock, `2` it belongs to another owner (here or through another sidecar), `3` internal error (no quorum, shutting down) |
//! | `GET /v1.0/metadata` | 200: this sidecar as Dapr describes a sidecar (see [`Runtime::metadata_json`]) |
//! | `GET /v1.0/healthz`, `GET /v1.0/healthz/outbound` | 204 while this sidecar serves Dapr's lock API ([`Runtime::serving`]: from its first round that reached a quorum of nodes until it begins shutting down); else 500 `ERR_HEALTH_NOT_READY` / `ERR_OUTBOUND_HEALTH_NOT_READY` |
//!
//! The lock and unlock rules live here once ([`try_lock`], [`unlock_owned`]), for these routes and for
//! Dapr's gRPC API ([`super::dapr_grpc`]) alike; each transport only reads its request and writes
//! the answer.
//!
//! A Dapr lock is a lease of ttl `expiryInSeconds` that nobody keeps alive: it is renewed on
//! the nodes until its expiry, then released, as Dapr's lock expires.
//!
//! `expiryInSeconds` is taken as Dapr takes it (a number, or a string of one such as `"30"`)
//! up to this sidecar's longest ttl, an hour; a longer one is refused, never cut short.
//!
//! ## What Dapr's answers have no room for
//! Dapr's SDKs read `success` and `status` only; what else this sidecar knows travels beside
//! them, where they do not look (response headers over HTTP, response metadata over gRPC):
//! - a lock taken: [`FENCING_TOKEN`] (the fencing token, only growing for the name) and
//!   [`VALIDITY_MS`] (milliseconds of validity left when the answer was written);
//! - an answer that is not a lock taken or released: [`REASON`] says why, one word: `held`
//!   (another owner holds it; [`HOLDER`] names the sidecar holding it when the nodes told),
//!   `no_quorum`, `shutting_down`, `cancelled`, `too_many_leases`, and for an unlock status 3
//!   `unavailable`.
//!
//! Errors use Dapr's shape, `{"errorCode", "message"}`, in Dapr's order of checks: 400
//! `ERR_MALFORMED_REQUEST` (not JSON, an `expiryInSeconds` that is not positive, an empty
//! `resourceId` or `lockOwner`, then this sidecar's bounds), 400 `ERR_LOCK_STORE_NOT_FOUND`
//! (another store name than `--locks-dapr-store`), 500 `ERR_TRY_LOCK_FAILED` (no quorum,
//! shutting down), 429 `ERR_TOO_MANY_LEASES`, 413 for a body over [`super::routes::MAX_BODY`]
//! bytes. The 500 and 429 answers add Dapr's rich-error `details`: one
//! `google.rpc.ErrorInfo` of domain [`ERROR_DOMAIN`] whose `reason` tells a quorum that could
//! not be reached (`REDLOCK_NO_QUORUM`, with the engine's `kind`) from a shutdown
//! (`REDLOCK_SHUTTING_DOWN`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::api::Api;
use super::bounds;
use super::engine::LockEngine;
use super::service::{Refused, Unlock};
use crate::clock::Deadline;
use crate::leadership::LeadershipRx;

/// The component type this sidecar's lock store reports (Dapr's Redis store reports `lock.redis`).
pub const STORE_TYPE: &str = "lock.redlock-sidecar";
/// The component version it reports.
pub const STORE_VERSION: &str = "v1";
/// What this sidecar reports as its runtime version (`runtimeVersion`).
pub const RUNTIME_VERSION: &str = concat!("redlock-sidecar/", env!("CARGO_PKG_VERSION"));
/// The domain of the `google.rpc.ErrorInfo` details of its errors.
pub const ERROR_DOMAIN: &str = "redlock-sidecar";
/// The `@type` of an `ErrorInfo` detail, as Dapr writes it.
pub const ERROR_INFO_TYPE: &str = "type.googleapis.com/google.rpc.ErrorInfo";

/// Header (HTTP) and metadata key (gRPC): the fencing token of a lock taken.
pub const FENCING_TOKEN: &str = "x-redlock-fencing-token";
/// Header and metadata key: milliseconds of validity left of a lock taken.
pub const VALIDITY_MS: &str = "x-redlock-validity-ms";
/// Header and metadata key: why the answer is not a lock taken or released.
pub const REASON: &str = "x-redlock-reason";
/// Header and metadata key: the identity of the sidecar holding a lock, when the nodes told.
pub const HOLDER: &str = "x-redlock-holder";

/// What a try-lock that was answered found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TryLocked {
    /// Taken, with its fencing token, valid until then.
    Taken {
        fencing_token: u64,
        valid_until: Deadline,
    },
    /// Held by another owner (or by the same one: no re-entry), held by this sidecar if known.
    Held { holder: Option<String> },
}

/// Why a lock store could not answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// Too few nodes answered or counted; the engine's error kind.
    NoQuorum { kind: &'static str },
    /// The sidecar is shutting down.
    ShuttingDown,
    /// The request was cancelled before it was answered.
    Cancelled,
}

impl Unavailable {
    /// The [`REASON`] word.
    pub fn word(self) -> &'static str {
        match self {
            Unavailable::NoQuorum { .. } => "no_quorum",
            Unavailable::ShuttingDown => "shutting_down",
            Unavailable::Cancelled => "cancelled",
        }
    }

    /// The `ErrorInfo` reason.
    fn reason(self) -> &'static str {
        match self {
            Unavailable::NoQuorum { .. } => "REDLOCK_NO_QUORUM",
            Unavailable::ShuttingDown => "REDLOCK_SHUTTING_DOWN",
            Unavailable::Cancelled => "REDLOCK_CANCELLED",
        }
    }

    fn explain(self) -> String {
        match self {
            Unavailable::NoQuorum { kind } => format!("no quorum of Redis nodes ({kind})"),
            Unavailable::ShuttingDown => "the sidecar is shutting down".to_owned(),
            Unavailable::Cancelled => "the request was cancelled".to_owned(),
        }
    }
}

/// Why a Dapr lock request got no answer from the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DaprError {
    /// A field missing, empty or out of this sidecar's bounds (Dapr's message where Dapr has one).
    Malformed(String),
    /// Another store name than this sidecar's.
    StoreNotFound(String),
    /// The bound on leases of this sidecar is reached.
    TooMany { max: usize },
    /// The store could not answer.
    Unavailable(Unavailable),
}

/// A `google.rpc.ErrorInfo`: a machine-readable reason beside Dapr's error code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorInfo {
    /// `REDLOCK_…`, in upper snake case as Google's error model asks.
    pub reason: &'static str,
    /// Details, e.g. the engine's error `kind`.
    pub metadata: Vec<(&'static str, String)>,
}

impl DaprError {
    /// Dapr's `errorCode`.
    pub fn error_code(&self) -> &'static str {
        match self {
            DaprError::Malformed(_) => "ERR_MALFORMED_REQUEST",
            DaprError::StoreNotFound(_) => "ERR_LOCK_STORE_NOT_FOUND",
            DaprError::TooMany { .. } => "ERR_TOO_MANY_LEASES",
            DaprError::Unavailable(_) => "ERR_TRY_LOCK_FAILED",
        }
    }

    /// The message (Dapr's where Dapr has one).
    pub fn message(&self) -> String {
        match self {
            DaprError::Malformed(why) => why.clone(),
            DaprError::StoreNotFound(store) => format!("lock store {store} not found"),
            DaprError::TooMany { max } => {
                format!("too many leases and waits in this sidecar (at most {max})")
            }
            DaprError::Unavailable(why) => {
                format!("failed to try acquiring lock: {}", why.explain())
            }
        }
    }

    /// The [`REASON`] word, for the errors of the store (none for a request's own fault).
    pub fn word(&self) -> Option<&'static str> {
        match self {
            DaprError::Malformed(_) | DaprError::StoreNotFound(_) => None,
            DaprError::TooMany { .. } => Some("too_many_leases"),
            DaprError::Unavailable(why) => Some(why.word()),
        }
    }

    /// The `ErrorInfo` detail, for the errors of the store.
    pub fn info(&self) -> Option<ErrorInfo> {
        match self {
            DaprError::Malformed(_) | DaprError::StoreNotFound(_) => None,
            DaprError::TooMany { max } => Some(ErrorInfo {
                reason: "REDLOCK_TOO_MANY_LEASES",
                metadata: vec![("max", max.to_string())],
            }),
            DaprError::Unavailable(why) => Some(ErrorInfo {
                reason: why.reason(),
                metadata: match why {
                    Unavailable::NoQuorum { kind } => vec![("kind", (*kind).to_owned())],
                    _ => Vec::new(),
                },
            }),
        }
    }
}

/// Dapr's checks of a try-lock, with its messages, in its order (expiry, resource, owner,
/// store), then this sidecar's bounds; the ttl asked for.
pub fn check_try_lock(
    served: &str,
    store: &str,
    resource_id: &str,
    lock_owner: &str,
    expiry_in_seconds: i64,
) -> Result<Duration, DaprError> {
    if expiry_in_seconds <= 0 {
        return Err(DaprError::Malformed(format!(
            "ExpiryInSeconds is not positive in lock store {store}"
        )));
    }
    check_unlock(served, store, resource_id, lock_owner)?;
    let max = bounds::MAX_TTL.as_secs();
    if expiry_in_seconds.unsigned_abs() > max {
        // Dapr sets no bound: a longer expiry is refused rather than cut short.
        return Err(DaprError::Malformed(format!(
            "expiryInSeconds: at most {max} ({}, the longest ttl of this sidecar)",
            humantime::format_duration(bounds::MAX_TTL)
        )));
    }
    bounds::ttl(Duration::from_secs(expiry_in_seconds.unsigned_abs())).map_err(DaprError::Malformed)
}

/// Dapr's checks of an unlock (resource, owner, store), then this sidecar's bounds.
pub fn check_unlock(
    served: &str,
    store: &str,
    resource_id: &str,
    lock_owner: &str,
) -> Result<(), DaprError> {
    if resource_id.is_empty() {
        return Err(DaprError::Malformed(format!(
            "ResourceId is empty in lock store {store}"
        )));
    }
    if lock_owner.is_empty() {
        return Err(DaprError::Malformed(format!(
            "LockOwner is empty in lock store {store}"
        )));
    }
    if store != served {
        return Err(DaprError::StoreNotFound(store.to_owned()));
    }
    bounds::name(resource_id)
        .and_then(|_| bounds::owner(lock_owner))
        .map(|_| ())
        .map_err(DaprError::Malformed)
}

/// Dapr's try-lock: `lock_owner` takes `resource_id` for `expiry_in_seconds`, without waiting.
pub async fn try_lock<E: LockEngine>(
    api: &Api<E>,
    store: &str,
    resource_id: &str,
    lock_owner: &str,
    expiry_in_seconds: i64,
) -> Result<TryLocked, DaprError> {
    let ttl = check_try_lock(
        &api.dapr_store,
        store,
        resource_id,
        lock_owner,
        expiry_in_seconds,
    )?;
    let result = api
        .locks
        .acquire(
            resource_id,
            ttl,
            Duration::ZERO,
            Some(lock_owner.to_owned()),
        )
        .await;
    match result {
        Ok(granted) => Ok(TryLocked::Taken {
            fencing_token: granted.fencing_token,
            valid_until: granted.valid_until,
        }),
        Err(Refused::Held { holder }) => Ok(TryLocked::Held { holder }),
        Err(Refused::TooMany { max }) => Err(DaprError::TooMany { max }),
        // A try-lock never waits: only the bound on leases applies to it.
        Err(Refused::TooManyWaiting { max }) => Err(DaprError::TooMany { max }),
        Err(Refused::Invalid(why)) => Err(DaprError::Malformed(why)),
        Err(Refused::NoQuorum { kind }) => {
            Err(DaprError::Unavailable(Unavailable::NoQuorum { kind }))
        }
        Err(Refused::ShuttingDown) => Err(DaprError::Unavailable(Unavailable::ShuttingDown)),
        Err(Refused::Cancelled) => Err(DaprError::Unavailable(Unavailable::Cancelled)),
    }
}

/// Dapr's unlock: releases the lock `lock_owner` holds on `resource_id` through this sidecar.
pub async fn unlock_owned<E: LockEngine>(
    api: &Api<E>,
    store: &str,
    resource_id: &str,
    lock_owner: &str,
) -> Result<Unlock, DaprError> {
    check_unlock(&api.dapr_store, store, resource_id, lock_owner)?;
    Ok(api.locks.unlock_owned(resource_id, lock_owner).await)
}

/// What travels beside a try-lock's answer: headers over HTTP, metadata over gRPC (see the
/// module doc). Values that are not visible ASCII (a holder's identity may be any UTF-8) are
/// left out.
pub fn try_lock_extras(
    answer: &Result<TryLocked, DaprError>,
    now: Deadline,
) -> Vec<(&'static str, String)> {
    let mut extras = Vec::new();
    match answer {
        Ok(TryLocked::Taken {
            fencing_token,
            valid_until,
        }) => {
            let validity = valid_until.saturating_duration_since(now).as_millis();
            extras.push((FENCING_TOKEN, fencing_token.to_string()));
            extras.push((VALIDITY_MS, validity.to_string()));
        }
        Ok(TryLocked::Held { holder }) => {
            extras.push((REASON, "held".to_owned()));
            if let Some(holder) = holder.as_ref().filter(|h| visible_ascii(h)) {
                extras.push((HOLDER, holder.clone()));
            }
        }
        Err(err) => extras.extend(err.word().map(|word| (REASON, word.to_owned()))),
    }
    extras
}

/// What travels beside an unlock's answer.
pub fn unlock_extras(answer: &Result<Unlock, DaprError>) -> Vec<(&'static str, String)> {
    match answer {
        Ok(Unlock::InternalError) => vec![(REASON, "unavailable".to_owned())],
        Ok(_) => Vec::new(),
        Err(err) => err
            .word()
            .map(|word| (REASON, word.to_owned()))
            .into_iter()
            .collect(),
    }
}

/// Whether `text` is a header value as is: 1 or more printable ASCII characters.
fn visible_ascii(text: &str) -> bool {
    !text.is_empty() && text.bytes().all(|b| (0x20..0x7f).contains(&b))
}

/// Dapr's lock request.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LockRequest {
    resource_id: String,
    lock_owner: String,
    /// A number or a string of one, as Dapr's JSON reading (protobuf's) takes an int32;
    /// absent or `null` is 0, as there.
    #[serde(default)]
    expiry_in_seconds: serde_json::Value,
}

/// Dapr's unlock request.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct UnlockRequest {
    resource_id: String,
    lock_owner: String,
}

fn dapr_error(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        Json(json!({ "errorCode": code, "message": message })),
    )
        .into_response()
}

fn malformed(message: &str) -> Response {
    dapr_error(StatusCode::BAD_REQUEST, "ERR_MALFORMED_REQUEST", message)
}

/// The HTTP answer for `err`, with its `ErrorInfo` in Dapr's `details`.
fn error_response(err: &DaprError) -> Response {
    let status = match err {
        DaprError::Malformed(_) | DaprError::StoreNotFound(_) => StatusCode::BAD_REQUEST,
        DaprError::TooMany { .. } => StatusCode::TOO_MANY_REQUESTS,
        DaprError::Unavailable(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    let mut body = json!({ "errorCode": err.error_code(), "message": err.message() });
    if let Some(info) = err.info() {
        let metadata: serde_json::Map<String, serde_json::Value> = info
            .metadata
            .iter()
            .map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(v.as_str())))
            .collect();
        body["details"] = json!([{
            "@type": ERROR_INFO_TYPE,
            "reason": info.reason,
            "domain": ERROR_DOMAIN,
            "metadata": metadata,
        }]);
    }
    (status, Json(body)).into_response()
}

/// `response` with `extras` as headers.
fn with_headers(mut response: Response, extras: Vec<(&'static str, String)>) -> Response {
    for (name, value) in extras {
        if let Ok(value) = HeaderValue::from_str(&value) {
            response
                .headers_mut()
                .insert(HeaderName::from_static(name), value);
        }
    }
    response
}

/// The seconds an `expiryInSeconds` says: a whole number written as a JSON number (`30`,
/// `30.0`, `3e1`) or a string of one (`"30"`), within an int32, as Dapr (protobuf's JSON
/// reading) takes it; absent or `null` is 0. Whether it is positive and within this
/// sidecar's bounds is [`check_try_lock`]'s to say.
fn seconds(value: &serde_json::Value) -> Result<i64, String> {
    let number = match value {
        serde_json::Value::Null => serde_json::Number::from(0),
        serde_json::Value::Number(number) => number.clone(),
        serde_json::Value::String(text) => {
            serde_json::from_str::<serde_json::Number>(text).map_err(|_| not_seconds(value))?
        }
        _ => return Err(not_seconds(value)),
    };
    let seconds = match number.as_i64() {
        Some(seconds) => seconds,
        None => number
            .as_f64()
            .filter(|f| f.fract() == 0.0 && f.abs() <= i32::MAX as f64)
            // Whole and within an int32: the conversion is exact.
            .map(|f| f as i64)
            .ok_or_else(|| not_seconds(value))?,
    };
    i32::try_from(seconds)
        .map(i64::from)
        .map_err(|_| not_seconds(value))
}

fn not_seconds(value: &serde_json::Value) -> String {
    format!("expiryInSeconds: a whole number of seconds (an int32, as a number or a string), not {value}")
}

/// The store named in the path and the request's JSON.
fn parse<T: for<'de> Deserialize<'de>>(
    store: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(String, T), Box<Response>> {
    let Path(store) = store.map_err(|e| Box::new(malformed(&e.to_string())))?;
    let body = body.map_err(|rejection| {
        let status = rejection.status();
        Box::new(if status == StatusCode::PAYLOAD_TOO_LARGE {
            dapr_error(status, "ERR_MALFORMED_REQUEST", "request body too large")
        } else {
            malformed(&rejection.body_text())
        })
    })?;
    let request = serde_json::from_slice(&body)
        .map_err(|e| Box::new(malformed(&format!("bad JSON body: {e}"))))?;
    Ok((store, request))
}

/// `POST /v1.0-alpha1/lock/{store}`.
pub async fn lock<E: LockEngine>(
    State(api): State<Arc<Api<E>>>,
    store: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let (store, request): (String, LockRequest) = match parse(store, body) {
        Ok(parsed) => parsed,
        Err(response) => return *response,
    };
    let expiry = match seconds(&request.expiry_in_seconds) {
        Ok(expiry) => expiry,
        Err(why) => return malformed(&why),
    };
    let answer = try_lock(
        &api,
        &store,
        &request.resource_id,
        &request.lock_owner,
        expiry,
    )
    .await;
    let extras = try_lock_extras(&answer, Deadline::now());
    let response = match &answer {
        Ok(TryLocked::Taken { .. }) => Json(json!({ "success": true })).into_response(),
        Ok(TryLocked::Held { .. }) => Json(json!({ "success": false })).into_response(),
        Err(err) => error_response(err),
    };
    with_headers(response, extras)
}

/// `POST /v1.0-alpha1/unlock/{store}`.
pub async fn unlock<E: LockEngine>(
    State(api): State<Arc<Api<E>>>,
    store: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let (store, request): (String, UnlockRequest) = match parse(store, body) {
        Ok(parsed) => parsed,
        Err(response) => return *response,
    };
    let answer = unlock_owned(&api, &store, &request.resource_id, &request.lock_owner).await;
    let extras = unlock_extras(&answer);
    let response = match &answer {
        Ok(status) => Json(json!({ "status": *status as u8 })).into_response(),
        Err(err) => error_response(err),
    };
    with_headers(response, extras)
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn expiry_is_read_as_dapr_reads_it() {
        for (value, seconds_read) in [
            (json!(30), 30),
            (json!("30"), 30),
            (json!(30.0), 30),
            (json!("3e1"), 30),
            (json!(601), 601),
            (json!("3600"), 3600),
            (json!(3601), 3601),
            (json!(0), 0),
            (json!(-5), -5),
            (json!(null), 0),
        ] {
            assert_eq!(seconds(&value), Ok(seconds_read), "{value}");
        }
        for value in [
            json!(1.5),
            json!("soon"),
            json!(""),
            json!(true),
            json!([30]),
            json!(1u64 << 40),
            json!(-(1i64 << 40)),
            json!(1e300),
        ] {
            assert!(seconds(&value).is_err(), "{value}");
        }
    }

    #[test]
    fn a_try_lock_is_checked_in_daprs_order_with_daprs_messages_then_up_to_an_hour() {
        let check = |store, resource, owner, expiry| {
            check_try_lock("redlock", store, resource, owner, expiry)
        };
        assert_eq!(check("redlock", "r", "o", 30), Ok(Duration::from_secs(30)));
        assert_eq!(check("redlock", "r", "o", 3600), Ok(bounds::MAX_TTL));
        // Dapr checks the expiry first, then the resource, the owner and the store.
        assert_eq!(
            check("other", "", "", 0),
            Err(DaprError::Malformed(
                "ExpiryInSeconds is not positive in lock store other".into()
            ))
        );
        assert_eq!(
            check("other", "", "", 5),
            Err(DaprError::Malformed(
                "ResourceId is empty in lock store other".into()
            ))
        );
        assert_eq!(
            check("other", "r", "", 5),
            Err(DaprError::Malformed(
                "LockOwner is empty in lock store other".into()
            ))
        );
        assert_eq!(
            check("other", "r", "o", 5),
            Err(DaprError::StoreNotFound("other".into()))
        );
        let long = check("redlock", "r", "o", 3601).unwrap_err();
        assert!(long.message().contains("at most 3600"), "{long:?}");
        for (resource, owner) in [("a b", "o"), ("r", &*"o".repeat(129)), ("r", "o\n")] {
            assert!(
                matches!(
                    check("redlock", resource, owner, 5),
                    Err(DaprError::Malformed(_))
                ),
                "{resource:?} {owner:?}"
            );
        }
    }

    #[test]
    fn the_answers_say_what_dapr_has_no_field_for() {
        let now = Deadline::from_boottime(Duration::from_secs(100));
        let taken = Ok(TryLocked::Taken {
            fencing_token: 42,
            valid_until: now + Duration::from_millis(2500),
        });
        assert_eq!(
            try_lock_extras(&taken, now),
            vec![
                (FENCING_TOKEN, "42".to_owned()),
                (VALIDITY_MS, "2500".to_owned())
            ]
        );
        let held = Ok(TryLocked::Held {
            holder: Some("pod-b".into()),
        });
        assert_eq!(
            try_lock_extras(&held, now),
            vec![(REASON, "held".to_owned()), (HOLDER, "pod-b".to_owned())]
        );
        let not_ascii = Ok(TryLocked::Held {
            holder: Some("pöd".into()),
        });
        assert_eq!(
            try_lock_extras(&not_ascii, now),
            vec![(REASON, "held".to_owned())]
        );
        let no_quorum = Err(DaprError::Unavailable(Unavailable::NoQuorum {
            kind: "no_quorum",
        }));
        assert_eq!(
            try_lock_extras(&no_quorum, now),
            vec![(REASON, "no_quorum".to_owned())]
        );
        assert_eq!(
            unlock_extras(&Ok(Unlock::InternalError)),
            vec![(REASON, "unavailable".to_owned())]
        );
        assert!(unlock_extras(&Ok(Unlock::BelongsToOthers)).is_empty());
        assert!(try_lock_extras(&Err(DaprError::Malformed("x".into())), now).is_empty());
    }

    #[test]
    fn a_store_failure_keeps_daprs_code_and_says_which_failure_it_is() {
        let err = DaprError::Unavailable(Unavailable::NoQuorum {
            kind: "node_set_conflict",
        });
        assert_eq!(err.error_code(), "ERR_TRY_LOCK_FAILED");
        assert_eq!(
            err.info(),
            Some(ErrorInfo {
                reason: "REDLOCK_NO_QUORUM",
                metadata: vec![("kind", "node_set_conflict".to_owned())]
            })
        );
        let down = DaprError::Unavailable(Unavailable::ShuttingDown);
        assert_eq!(down.error_code(), "ERR_TRY_LOCK_FAILED");
        assert_eq!(down.info().map(|i| i.reason), Some("REDLOCK_SHUTTING_DOWN"));
        assert_eq!(DaprError::Malformed("x".into()).info(), None);
    }

    #[test]
    fn the_health_checks_answer_from_the_first_quorum_until_the_shutdown() {
        let (tx, rx) = tokio::sync::watch::channel(crate::leadership::Leadership::new("l", "me"));
        let closing = CancellationToken::new();
        let runtime = Runtime::new("me", "redlock", None, rx, closing.clone());
        assert!(runtime.serving().is_err(), "no round reached a quorum yet");
        tx.send_modify(|state| state.quorum_reachable = true);
        assert_eq!(runtime.serving(), Ok(()));
        // A quorum lost later: the lock calls say so, the health checks do not.
        tx.send_modify(|state| state.quorum_reachable = false);
        assert_eq!(runtime.serving(), Ok(()));
        closing.cancel();
        assert_eq!(runtime.serving(), Err("the sidecar is shutting down"));
    }

    #[test]
    fn the_metadata_names_this_sidecar_and_its_store() {
        let (_tx, rx) = tokio::sync::watch::channel(crate::leadership::Leadership::new("l", "me"));
        let grpc = Some("127.0.0.1:50001".parse().unwrap());
        let runtime = Runtime::new("pod-a", "locks", grpc, rx, CancellationToken::new());
        let json = runtime.metadata_json();
        assert_eq!(json["id"], "pod-a");
        assert_eq!(json["runtimeVersion"], RUNTIME_VERSION);
        assert!(RUNTIME_VERSION.starts_with("redlock-sidecar/"));
        assert_eq!(json["components"][0]["name"], "locks");
        assert_eq!(json["components"][0]["type"], "lock.redlock-sidecar");
        assert_eq!(
            json["extended"]["redlock-sidecar.grpc-listen"],
            "127.0.0.1:50001"
        );
    }

    proptest! {
        /// Whatever a request holds, the checks answer (no panic), and a ttl comes out only
        /// for a request that Dapr's rules and this sidecar's bounds both take.
        #[test]
        fn the_checks_take_exactly_what_dapr_and_the_bounds_take(
            store in prop_oneof![Just("redlock".to_owned()), "\\PC{0,8}"],
            resource in prop_oneof![Just(String::new()), "\\PC{0,140}", "[a-z:-]{1,20}"],
            owner in prop_oneof![Just(String::new()), "\\PC{0,140}", "[a-z0-9-]{1,20}"],
            expiry in prop_oneof![any::<i64>(), -5i64..4000],
        ) {
            let checked = check_try_lock("redlock", &store, &resource, &owner, expiry);
            let takes = expiry > 0
                && store == "redlock"
                && bounds::name(&resource).is_ok()
                && bounds::owner(&owner).is_ok()
                && expiry <= 3600;
            prop_assert_eq!(checked.is_ok(), takes, "{:?}", checked);
            if let Ok(ttl) = checked {
                prop_assert_eq!(ttl, Duration::from_secs(expiry.unsigned_abs()));
            }
        }

        /// Every JSON value is read as seconds or refused, never a panic; a number within an
        /// int32 is read as itself.
        #[test]
        fn any_expiry_value_is_read_or_refused(n in any::<i64>(), f in any::<f64>(), text in "\\PC{0,12}") {
            let read = seconds(&json!(n));
            prop_assert_eq!(read.is_ok(), i32::try_from(n).is_ok());
            let _ = seconds(&json!(f));
            let _ = seconds(&json!(text));
        }
    }
}

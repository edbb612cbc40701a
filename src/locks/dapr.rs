//! Dapr's distributed lock API (v1.0-alpha1), answer for answer: an app written for Dapr's
//! lock building block switches by changing the port.
//!
//! | request | answer |
//! |---|---|
//! | `POST /v1.0-alpha1/lock/{store}` `{"resourceId", "lockOwner", "expiryInSeconds"}` | 200 `{"success": true}` when taken, `{"success": false}` when held (also by the same owner: Dapr's try-lock does not re-enter) |
//! | `POST /v1.0-alpha1/unlock/{store}` `{"resourceId", "lockOwner"}` | 200 `{"status": 0}` unlocked, `1` no such lock, `2` it belongs to another owner (here or through another sidecar), `3` internal error (no quorum, shutting down) |
//!
//! A Dapr lock is a lease of ttl `expiryInSeconds` that nobody keeps alive: it is renewed on
//! the nodes until its expiry, then released, as Dapr's lock expires. It has a fencing token
//! on the nodes like any lease, but Dapr's answer has no field for it.
//!
//! `expiryInSeconds` is taken as Dapr takes it (a number, or a string of one such as `"30"`)
//! up to this sidecar's longest ttl, an hour; a longer one is refused, never cut short.
//!
//! Errors use Dapr's shape, `{"errorCode", "message"}`: 400 `ERR_MALFORMED_REQUEST` (not JSON,
//! a missing field, a value out of bounds), 400 `ERR_LOCK_STORE_NOT_FOUND` (another store name
//! than `--locks-dapr-store`), 500 `ERR_TRY_LOCK_FAILED` (no quorum), 429 `ERR_TOO_MANY_LEASES`,
//! 413 for a body over [`super::routes::MAX_BODY`] bytes.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use super::bounds;
use super::engine::LockEngine;
use super::routes::Api;
use super::service::Refused;

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

/// Dapr's own checks of both requests, with its messages, in its order.
fn present(resource_id: &str, lock_owner: &str) -> Result<(), &'static str> {
    if resource_id.is_empty() {
        return Err("ResourceId is empty");
    }
    if lock_owner.is_empty() {
        return Err("LockOwner is empty");
    }
    Ok(())
}

/// This sidecar's bounds on a lock name and an owner (see [`bounds`]).
fn bounded(resource_id: &str, lock_owner: &str) -> Result<(), String> {
    bounds::name(resource_id)
        .and_then(|_| bounds::owner(lock_owner))
        .map(|_| ())
}

/// The ttl a lock request's `expiryInSeconds` asks for: a whole number of seconds, written as
/// a JSON number (`30`, `30.0`, `3e1`) or a string of one (`"30"`), as Dapr takes it; positive
/// (Dapr's check and message); at most [`bounds::MAX_TTL`], this sidecar's longest ttl (Dapr
/// itself has no bound: a longer expiry is refused rather than cut short).
fn expiry(value: &serde_json::Value) -> Result<Duration, String> {
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
    if i32::try_from(seconds).is_err() {
        return Err(not_seconds(value));
    }
    if seconds <= 0 {
        return Err("ExpiryInSeconds is not positive".to_owned());
    }
    let ttl = Duration::from_secs(seconds.unsigned_abs());
    if ttl > bounds::MAX_TTL {
        return Err(format!(
            "expiryInSeconds: at most {} ({}, the longest ttl of this sidecar)",
            bounds::MAX_TTL.as_secs(),
            humantime::format_duration(bounds::MAX_TTL)
        ));
    }
    bounds::ttl(ttl)
}

fn not_seconds(value: &serde_json::Value) -> String {
    format!("expiryInSeconds: a whole number of seconds (an int32, as a number or a string), not {value}")
}

/// The request's JSON, after the store name is checked.
fn parse<T: for<'de> Deserialize<'de>, E: LockEngine>(
    api: &Api<E>,
    store: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, Box<Response>> {
    let Path(store) = store.map_err(|e| Box::new(malformed(&e.to_string())))?;
    if store != api.dapr_store {
        return Err(Box::new(dapr_error(
            StatusCode::BAD_REQUEST,
            "ERR_LOCK_STORE_NOT_FOUND",
            &format!("lock store {store} not found"),
        )));
    }
    let body = body.map_err(|rejection| {
        let status = rejection.status();
        Box::new(if status == StatusCode::PAYLOAD_TOO_LARGE {
            dapr_error(status, "ERR_MALFORMED_REQUEST", "request body too large")
        } else {
            malformed(&rejection.body_text())
        })
    })?;
    serde_json::from_slice(&body).map_err(|e| Box::new(malformed(&format!("bad JSON body: {e}"))))
}

/// `POST /v1.0-alpha1/lock/{store}`.
pub async fn lock<E: LockEngine>(
    State(api): State<Arc<Api<E>>>,
    store: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let request: LockRequest = match parse(&api, store, body) {
        Ok(request) => request,
        Err(response) => return *response,
    };
    if let Err(why) = present(&request.resource_id, &request.lock_owner) {
        return malformed(why);
    }
    let ttl = match expiry(&request.expiry_in_seconds) {
        Ok(ttl) => ttl,
        Err(why) => return malformed(&why),
    };
    let checked = bounded(&request.resource_id, &request.lock_owner).map(|()| ttl);
    let ttl = match checked {
        Ok(ttl) => ttl,
        Err(why) => return malformed(&why),
    };
    let result = api
        .locks
        .acquire(
            &request.resource_id,
            ttl,
            Duration::ZERO,
            Some(request.lock_owner),
        )
        .await;
    match result {
        Ok(_) => Json(json!({ "success": true })).into_response(),
        Err(Refused::Held { .. }) => Json(json!({ "success": false })).into_response(),
        Err(Refused::TooMany { max }) => dapr_error(
            StatusCode::TOO_MANY_REQUESTS,
            "ERR_TOO_MANY_LEASES",
            &super::routes::too_many_leases(max),
        ),
        Err(Refused::Invalid(why)) => malformed(&why),
        Err(other) => dapr_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "ERR_TRY_LOCK_FAILED",
            &format!("failed to try acquiring lock: {other:?}"),
        ),
    }
}

/// `POST /v1.0-alpha1/unlock/{store}`.
pub async fn unlock<E: LockEngine>(
    State(api): State<Arc<Api<E>>>,
    store: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let request: UnlockRequest = match parse(&api, store, body) {
        Ok(request) => request,
        Err(response) => return *response,
    };
    if let Err(why) = present(&request.resource_id, &request.lock_owner) {
        return malformed(why);
    }
    if let Err(why) = bounded(&request.resource_id, &request.lock_owner) {
        return malformed(&why);
    }
    let status = api
        .locks
        .unlock_owned(&request.resource_id, &request.lock_owner)
        .await;
    Json(json!({ "status": status as u8 })).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn expiry_is_taken_as_dapr_takes_it_up_to_an_hour() {
        for (value, seconds) in [
            (json!(30), 30),
            (json!("30"), 30),
            (json!(30.0), 30),
            (json!("3e1"), 30),
            (json!(601), 601),
            (json!("3600"), 3600),
        ] {
            assert_eq!(expiry(&value), Ok(Duration::from_secs(seconds)), "{value}");
        }
        for value in [json!(0), json!(-5), json!("0"), json!(null)] {
            assert_eq!(
                expiry(&value).unwrap_err(),
                "ExpiryInSeconds is not positive",
                "{value}"
            );
        }
        for value in [
            json!(3601),
            json!("3601"),
            json!(1.5),
            json!("soon"),
            json!(""),
            json!(true),
            json!([30]),
            json!(1u64 << 40),
            json!(-(1i64 << 40)),
            json!(1e300),
        ] {
            assert!(expiry(&value).is_err(), "{value}");
        }
        assert!(expiry(&json!(3601)).unwrap_err().contains("at most 3600"));
    }
}

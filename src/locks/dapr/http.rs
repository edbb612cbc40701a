//! Dapr's lock API over HTTP: the JSON requests read as Dapr reads them, the answers and
//! errors in Dapr's shape, the extras as response headers.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use super::rules::{try_lock, try_lock_extras, unlock_extras, unlock_owned, DaprError, TryLocked};
use super::{ERROR_DOMAIN, ERROR_INFO_TYPE};
use crate::clock::Deadline;
use crate::locks::api::Api;
use crate::locks::engine::LockEngine;

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

/// An error in Dapr's shape: `{"errorCode", "message"}` with `status`.
pub(super) fn dapr_error(status: StatusCode, code: &str, message: &str) -> Response {
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
pub(super) fn seconds(value: &serde_json::Value) -> Result<i64, String> {
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

//! The control listener's router and its gate: requests from the processes of this pod only,
//! bodies within their timeout (see the module doc of [`crate::http`]).

use axum::extract::DefaultBodyLimit;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};

use super::resign::{resign, ControlState};
use super::{json_error, BODY_READ_TIMEOUT};
use crate::clock;

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

/// What the control listener takes, from the processes of this pod only (see the module doc of [`crate::http`]).
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

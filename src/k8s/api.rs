//! The one road to the API server: the client this sidecar builds, and every request.
//!
//! [`client`] builds a client for a configuration with kube's own parts (base URL, service
//! account token that is re-read as the kubelet rotates it, TLS with the cluster's CA) but
//! without the two layers kube adds by default: its retry layer (429/503/504 retried after
//! 5 ms, doubling, up to 15 tries, each failed try logged as an ERROR by its trace layer) and
//! that trace layer. Retrying is this module's decision ([`super::retry`]), taken per
//! operation with the server's `Retry-After` in hand, and failures are logged once per change
//! ([`super::retry::Health`]).
//!
//! Every request then goes through [`Kube::exchange`]: it carries `User-Agent:
//! redlock-sidecar/VERSION`, waits at most [`API_TIMEOUT`] for the response head, and reads
//! an error's body to its end, so that the connection goes back to the pool instead of being
//! closed (one kept-alive connection for the calls, one for the watch).

use std::pin::Pin;
use std::time::Duration;

use hyper::body::{Body as HttpBody, Bytes};
use hyper::header::{HeaderMap, HeaderValue, ACCEPT, RETRY_AFTER, USER_AGENT};
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::{Body, ConfigExt};
use kube::core::Status;
use serde::de::DeserializeOwned;
use tower::{BoxError, ServiceBuilder};

use super::{Kube, KubeError, Op};

/// The `User-Agent` of every request: the sidecar and its version.
pub const USER_AGENT_VALUE: &str = concat!("redlock-sidecar/", env!("CARGO_PKG_VERSION"));
/// Upper bound on one API call; for a watch, on the arrival of its response head.
pub const API_TIMEOUT: Duration = Duration::from_secs(10);
/// Upper bound on opening a connection (TCP; TLS counts against [`API_TIMEOUT`]).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// TCP keepalive on connections to the API server, so that a peer gone silent (a node or
/// network lost under an open watch) is noticed within about a minute.
const TCP_KEEPALIVE: Duration = Duration::from_secs(30);
/// Largest response body read (a pod object is at most about 1.5 MB in etcd).
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// A client for `config` (the in-cluster one in production) without kube's retry and trace
/// layers; see the module documentation.
pub fn client(config: kube::Config) -> Result<kube::Client, kube::Error> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    http.set_keepalive(Some(TCP_KEEPALIVE));
    http.set_nodelay(true);
    let https = config.rustls_https_connector_with_connector(http)?;
    let hyper = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(https);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(hyper);
    Ok(kube::Client::new(service, config.default_namespace))
}

impl Kube {
    /// Sends `request` with this sidecar's headers and waits for the response head (at most
    /// [`API_TIMEOUT`]). A status other than 2xx is an error carrying the server's `Status`
    /// and `Retry-After`, its body read to the end. Nothing is counted here: the caller knows
    /// which answers are failures (a Lease that is not there yet is not).
    pub(super) async fn exchange(
        &self,
        op: Op,
        mut request: Request<Vec<u8>>,
    ) -> Result<Response<Body>, KubeError> {
        let headers = request.headers_mut();
        headers.insert(USER_AGENT, HeaderValue::from_static(USER_AGENT_VALUE));
        headers.insert(ACCEPT, HeaderValue::from_static("application/json"));
        let deadline = self.clock.now() + API_TIMEOUT;
        let sent = self
            .clock
            .timeout_at(deadline, self.client.send(request.map(Body::from)))
            .await;
        let response = match sent {
            Ok(Ok(response)) => response,
            Ok(Err(source)) => return Err(KubeError::api(op, source)),
            Err(_) => return Err(KubeError::timeout(op)),
        };
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let retry_after = retry_after(response.headers());
        let body = self
            .clock
            .timeout_at(deadline, read_body(response.into_body()))
            .await;
        let text = match body {
            Ok(Ok(bytes)) => String::from_utf8_lossy(&bytes).into_owned(),
            // The status says enough; a body cut short only loses the message.
            Ok(Err(_)) | Err(_) => String::new(),
        };
        Err(failure(op, status, &text, retry_after))
    }

    /// One call answered with a `T` (2xx), within [`API_TIMEOUT`]; every failure counted.
    pub(super) async fn call<T: DeserializeOwned>(
        &self,
        op: Op,
        request: Result<Request<Vec<u8>>, kube::core::request::Error>,
    ) -> Result<T, KubeError> {
        let result = match request {
            Ok(request) => self.fetch(op, request).await,
            Err(err) => Err(KubeError::api(op, kube::Error::BuildRequest(err))),
        };
        self.counted(op, result)
    }

    /// [`Kube::call`] where 404 means "not there" (`None`), not a failure.
    pub(super) async fn call_opt<T: DeserializeOwned>(
        &self,
        op: Op,
        request: Result<Request<Vec<u8>>, kube::core::request::Error>,
    ) -> Result<Option<T>, KubeError> {
        let result = match request {
            Ok(request) => self.fetch(op, request).await.map(Some),
            Err(err) => Err(KubeError::api(op, kube::Error::BuildRequest(err))),
        };
        match result {
            Err(err) if err.status() == Some(StatusCode::NOT_FOUND.as_u16()) => Ok(None),
            other => self.counted(op, other),
        }
    }

    /// Counts a failure of `op` in `redlock_kubernetes_errors_total`.
    pub(super) fn counted<T>(&self, op: Op, result: Result<T, KubeError>) -> Result<T, KubeError> {
        if result.is_err() {
            self.errors.with_label_values(&[op.as_str()]).inc();
        }
        result
    }

    /// One call answered with a `T` (2xx), within [`API_TIMEOUT`]; not counted.
    pub(super) async fn fetch<T: DeserializeOwned>(
        &self,
        op: Op,
        request: Request<Vec<u8>>,
    ) -> Result<T, KubeError> {
        let deadline = self.clock.now() + API_TIMEOUT;
        let call = async {
            let response = self.exchange(op, request).await?;
            let bytes = read_body(response.into_body())
                .await
                .map_err(|source| KubeError::api(op, source))?;
            serde_json::from_slice(&bytes)
                .map_err(|err| KubeError::api(op, kube::Error::SerdeError(err)))
        };
        match self.clock.timeout_at(deadline, call).await {
            Ok(result) => result,
            Err(_) => Err(KubeError::timeout(op)),
        }
    }
}

/// The next data of `body`: `None` at its end.
pub(super) async fn next_chunk(body: &mut Body) -> Option<Result<Bytes, kube::Error>> {
    loop {
        let frame = std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await?;
        match frame {
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    return Some(Ok(data));
                }
                // Trailers: nothing to read.
            }
            Err(err) => return Some(Err(err)),
        }
    }
}

/// All of `body`, up to [`MAX_BODY_BYTES`].
async fn read_body(mut body: Body) -> Result<Vec<u8>, kube::Error> {
    let mut bytes = Vec::new();
    while let Some(chunk) = next_chunk(&mut body).await {
        bytes.extend_from_slice(&chunk?);
        if bytes.len() > MAX_BODY_BYTES {
            return Err(kube::Error::Service(
                format!("response body over {MAX_BODY_BYTES} bytes").into(),
            ));
        }
    }
    Ok(bytes)
}

/// `Retry-After` in seconds (the form the API server sends); a date is not read.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?;
    value.trim().parse::<u64>().ok().map(Duration::from_secs)
}

/// The error for a response with `status` and body `text` (a `Status` object, or anything a
/// proxy in between may send).
fn failure(op: Op, status: StatusCode, text: &str, retry_after: Option<Duration>) -> KubeError {
    let parsed = serde_json::from_str::<Status>(text).ok();
    let details_after = parsed
        .as_ref()
        .and_then(|s| s.details.as_ref())
        .map(|d| d.retry_after_seconds)
        .filter(|&secs| secs > 0)
        .map(|secs| Duration::from_secs(u64::from(secs)));
    let mut body = parsed.unwrap_or_else(|| {
        let text: String = text.trim().chars().take(200).collect();
        Status::failure(&text, "")
    });
    body.code = status.as_u16();
    KubeError::Api {
        op: op.as_str(),
        source: kube::Error::Api(body.boxed()),
        retry_after: retry_after.or(details_after),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_user_agent_names_the_sidecar_and_its_version() {
        assert_eq!(
            USER_AGENT_VALUE,
            format!("redlock-sidecar/{}", env!("CARGO_PKG_VERSION"))
        );
        assert!(HeaderValue::from_str(USER_AGENT_VALUE).is_ok());
    }

    #[test]
    fn retry_after_comes_from_the_header_or_the_status_details() {
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_static("7"));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(7)));
        headers.insert(
            RETRY_AFTER,
            HeaderValue::from_static("Wed, 21 Oct 2026 07:28:00 GMT"),
        );
        assert_eq!(retry_after(&headers), None);

        let body = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"TooManyRequests",
            "message":"please try again later","details":{"retryAfterSeconds":3},"code":429}"#;
        let err = failure(Op::WatchPod, StatusCode::TOO_MANY_REQUESTS, body, None);
        assert_eq!(err.retry_after(), Some(Duration::from_secs(3)));
        assert_eq!(err.status(), Some(429));
        assert_eq!(err.reason(), "throttled");
        let err = failure(
            Op::WatchPod,
            StatusCode::TOO_MANY_REQUESTS,
            body,
            Some(Duration::from_secs(9)),
        );
        assert_eq!(
            err.retry_after(),
            Some(Duration::from_secs(9)),
            "the header first"
        );
    }

    #[test]
    fn an_error_body_that_is_not_a_status_keeps_the_http_status() {
        let err = failure(
            Op::PatchLabel,
            StatusCode::BAD_GATEWAY,
            "<html>bad gateway</html>",
            None,
        );
        assert_eq!(err.status(), Some(502));
        assert_eq!(err.reason(), "server_error");
        assert!(err.cause().contains("bad gateway"), "{}", err.cause());
    }
}

//! Dapr's gRPC API (`dapr.proto.runtime.v1.Dapr`) for Dapr's SDKs, on a loopback port of its
//! own (`--dapr-grpc-listen`, off unless given).
//!
//! | method | answer |
//! |---|---|
//! | `TryLockAlpha1` | `{success}`, as `POST /v1.0-alpha1/lock/{store}` answers (one code path: [`dapr::try_lock`]) |
//! | `UnlockAlpha1` | `{status}`: `SUCCESS`, `LOCK_DOES_NOT_EXIST`, `LOCK_BELONGS_TO_OTHERS`, `INTERNAL_ERROR` ([`dapr::unlock_owned`]) |
//! | `GetMetadata` | this sidecar as Dapr describes a sidecar ([`dapr::Runtime`]); Dapr's JavaScript SDK calls it before anything else |
//! | any other method, of this service or another | UNIMPLEMENTED, the message naming what is served |
//!
//! Status codes are daprd's: INVALID_ARGUMENT for a request Dapr refuses (an expiry that is not
//! positive, an empty resource or owner, another store) and for one out of this sidecar's
//! bounds; INTERNAL for a store that cannot answer (`ERR_TRY_LOCK_FAILED`), RESOURCE_EXHAUSTED
//! past `--locks-max-leases`. Beside the answer, in the response metadata (headers), travel the
//! fencing token and validity of a lock taken and the reason of any other answer (see
//! [`dapr`]); a store failure carries a `google.rpc.ErrorInfo` in `grpc-status-details-bin`
//! (Dapr's rich error model, which Dapr's SDKs read) whose reason tells a quorum that could not
//! be reached from a shutdown.
//!
//! A message that does not decode as the method's request (bad protobuf, a string that is not
//! UTF-8, a frame cut short or with a flag that is neither 0 nor 1, no message at all) answers
//! INVALID_ARGUMENT, never a panic ([`Codec`], [`malformed_as_invalid_argument`]); a message
//! over [`MAX_MESSAGE`] bytes OUT_OF_RANGE. A frame flagged compressed is refused as gRPC
//! requires (INTERNAL without a `grpc-encoding`, UNIMPLEMENTED with one: none is served).
//!
//! ## This pod only
//! The port is loopback only (checked at start-up, as `--control-listen`). It speaks HTTP/2
//! without TLS and nothing else: a browser cannot reach it (browsers speak gRPC only as
//! gRPC-web over HTTP/1.1 or TLS), and a request whose `:authority` is not `localhost` or a
//! loopback address is refused with PERMISSION_DENIED before any method runs. Dapr's
//! `dapr-api-token` is not asked for: like the control listener, the port serves the
//! processes of this pod.
//!
//! ## Behaviour
//! Bounds of its own (the timeouts are the control listener's): at most [`MAX_CONNECTIONS`]
//! connections at once (more wait in the kernel's accept queue), the first bytes of a
//! connection within [`HEADER_READ_TIMEOUT`], a connection lives at most
//! [`MAX_CONNECTION_AGE`] (then `GOAWAY`, dropped after [`CLOSE_GRACE`]), at most
//! [`MAX_STREAMS`] calls at once on one connection, each answered within [`CALL_TIMEOUT`];
//! HTTP/2 pings find dead peers. It runs on the control listener's thread, beside the lock
//! service it calls, and stops with the control listener at shutdown.
//!
//! [`HEADER_READ_TIMEOUT`]: crate::http::HEADER_READ_TIMEOUT
//! [`MAX_CONNECTION_AGE`]: crate::http::MAX_CONNECTION_AGE
//! [`CLOSE_GRACE`]: crate::http::CLOSE_GRACE

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::Stream;
use prost::Message;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tonic::codec::{DecodeBuf, EncodeBuf};
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::{Code, Status};
use tower::ServiceExt;

use super::api::Api;
use super::dapr::{self, DaprError, Runtime, TryLocked};
use super::engine::LockEngine;
use crate::clock::{self, Deadline};
use crate::http::{CLOSE_GRACE, HEADER_READ_TIMEOUT, MAX_CONNECTION_AGE};

/// Dapr's messages and its service, compiled by `build.rs` from `proto/` (see
/// proto/README.md): the server this module serves, and a client for tests and tools.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    rustdoc::invalid_html_tags,
    rustdoc::bare_urls,
    rustdoc::broken_intra_doc_links
)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/dapr.proto.runtime.v1.rs"));
}

use proto::dapr_server::{Dapr, DaprServer};

/// The service's full name.
pub const SERVICE: &str = "dapr.proto.runtime.v1.Dapr";
/// The methods served; every other answers UNIMPLEMENTED.
pub const SERVED: [&str; 3] = ["TryLockAlpha1", "UnlockAlpha1", "GetMetadata"];
/// Largest request message, in bytes: a request with the longest store, name and owner fits
/// many times over; a longer owner still decodes and is refused by name (INVALID_ARGUMENT).
pub const MAX_MESSAGE: usize = 4096;
/// Most connections served at once: a client of Dapr's SDKs holds one connection and carries
/// all its calls on it.
pub const MAX_CONNECTIONS: usize = 64;
/// Most calls at once on one connection.
pub const MAX_STREAMS: usize = 64;
/// Longest a call may take before it is answered DEADLINE_EXCEEDED (a try-lock is one round,
/// an unlock at most a release and a read of the nodes).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How often an idle connection is pinged, and how long the answer may take.
const KEEPALIVE: (Duration, Duration) = (Duration::from_secs(30), Duration::from_secs(10));

/// tonic's codec with prost's encoding, except that a request that does not decode is the
/// caller's error: INVALID_ARGUMENT (tonic answers INTERNAL).
#[derive(Debug)]
pub struct Codec<T, U>(PhantomData<fn(T, U)>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Codec(PhantomData)
    }
}

/// [`Codec`]'s encoder.
#[derive(Debug)]
pub struct Encoder<T>(PhantomData<fn(T)>);

/// [`Codec`]'s decoder.
#[derive(Debug)]
pub struct Decoder<U>(PhantomData<fn() -> U>);

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = Encoder<T>;
    type Decoder = Decoder<U>;

    fn encoder(&mut self) -> Encoder<T> {
        Encoder(PhantomData)
    }

    fn decoder(&mut self) -> Decoder<U> {
        Decoder(PhantomData)
    }
}

impl<T: Message> tonic::codec::Encoder for Encoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst)
            .map_err(|e| Status::internal(format!("cannot encode the answer: {e}")))
    }
}

impl<U: Message + Default> tonic::codec::Decoder for Decoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        decode_message(src).map(Some)
    }
}

/// One message of type `U` from `src`, or INVALID_ARGUMENT saying why it does not decode.
pub fn decode_message<U: Message + Default>(src: impl prost::bytes::Buf) -> Result<U, Status> {
    U::decode(src).map_err(|e| Status::invalid_argument(format!("malformed request message: {e}")))
}

/// `google.rpc.Status`, as `grpc-status-details-bin` carries it.
#[derive(Clone, PartialEq, Message)]
pub struct RpcStatus {
    /// The gRPC status code (the same as the call's).
    #[prost(int32, tag = "1")]
    pub code: i32,
    /// The message (the same as the call's).
    #[prost(string, tag = "2")]
    pub message: String,
    /// The details.
    #[prost(message, repeated, tag = "3")]
    pub details: Vec<Any>,
}

/// `google.protobuf.Any`.
#[derive(Clone, PartialEq, Message)]
pub struct Any {
    /// `type.googleapis.com/<full message name>`.
    #[prost(string, tag = "1")]
    pub type_url: String,
    /// The message, encoded.
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

/// `google.rpc.ErrorInfo`.
#[derive(Clone, PartialEq, Message)]
pub struct RpcErrorInfo {
    /// `REDLOCK_…`.
    #[prost(string, tag = "1")]
    pub reason: String,
    /// [`dapr::ERROR_DOMAIN`].
    #[prost(string, tag = "2")]
    pub domain: String,
    /// Details such as the engine's error `kind`.
    #[prost(map = "string, string", tag = "3")]
    pub metadata: HashMap<String, String>,
}

/// `extras` as gRPC metadata (values that are no ASCII metadata are left out).
fn metadata(extras: Vec<(&'static str, String)>) -> MetadataMap {
    let mut map = MetadataMap::new();
    for (name, value) in extras {
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(name.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            map.insert(key, value);
        }
    }
    map
}

/// The gRPC status for `err`: daprd's code, the message, the reason in the metadata and, for a
/// store's failure, an `ErrorInfo` in the details.
pub fn status(err: &DaprError, extras: Vec<(&'static str, String)>) -> Status {
    let code = match err {
        DaprError::Malformed(_) | DaprError::StoreNotFound(_) => Code::InvalidArgument,
        DaprError::TooMany { .. } => Code::ResourceExhausted,
        DaprError::Unavailable(_) => Code::Internal,
    };
    let message = err.message();
    let Some(info) = err.info() else {
        return Status::with_metadata(code, message, metadata(extras));
    };
    let info = RpcErrorInfo {
        reason: info.reason.to_owned(),
        domain: dapr::ERROR_DOMAIN.to_owned(),
        metadata: info
            .metadata
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
    };
    let details = RpcStatus {
        code: code as i32,
        message: message.clone(),
        details: vec![Any {
            type_url: dapr::ERROR_INFO_TYPE.to_owned(),
            value: info.encode_to_vec(),
        }],
    };
    Status::with_details_and_metadata(
        code,
        message,
        details.encode_to_vec().into(),
        metadata(extras),
    )
}

/// `answer` with `extras` in its metadata.
fn answer<T>(message: T, extras: Vec<(&'static str, String)>) -> tonic::Response<T> {
    let mut response = tonic::Response::new(message);
    *response.metadata_mut() = metadata(extras);
    response
}

/// The methods of `dapr.proto.runtime.v1.Dapr` this sidecar serves.
pub struct DaprGrpc<E: LockEngine> {
    api: Arc<Api<E>>,
    runtime: Runtime,
}

impl<E: LockEngine> DaprGrpc<E> {
    /// Locks through `api`, described as `runtime`.
    pub fn new(api: Api<E>, runtime: Runtime) -> DaprGrpc<E> {
        DaprGrpc {
            api: Arc::new(api),
            runtime,
        }
    }

    /// The `GetMetadata` answer.
    pub fn metadata(&self) -> proto::GetMetadataResponse {
        proto::GetMetadataResponse {
            id: self.runtime.identity.clone(),
            registered_components: vec![proto::RegisteredComponents {
                name: self.runtime.store.clone(),
                r#type: dapr::STORE_TYPE.to_owned(),
                version: dapr::STORE_VERSION.to_owned(),
                capabilities: Vec::new(),
            }],
            extended_metadata: self
                .runtime
                .extended()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
            runtime_version: dapr::RUNTIME_VERSION.to_owned(),
            actor_runtime: Some(proto::ActorRuntime {
                runtime_status: proto::actor_runtime::ActorRuntimeStatus::Disabled as i32,
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

#[tonic::async_trait]
impl<E: LockEngine> Dapr for DaprGrpc<E> {
    async fn try_lock_alpha1(
        &self,
        request: tonic::Request<proto::TryLockRequest>,
    ) -> Result<tonic::Response<proto::TryLockResponse>, Status> {
        let request = request.into_inner();
        let found = dapr::try_lock(
            &self.api,
            &request.store_name,
            &request.resource_id,
            &request.lock_owner,
            i64::from(request.expiry_in_seconds),
        )
        .await;
        let extras = dapr::try_lock_extras(&found, Deadline::now());
        match found {
            Ok(found) => Ok(answer(
                proto::TryLockResponse {
                    success: matches!(found, TryLocked::Taken { .. }),
                },
                extras,
            )),
            Err(err) => Err(status(&err, extras)),
        }
    }

    async fn unlock_alpha1(
        &self,
        request: tonic::Request<proto::UnlockRequest>,
    ) -> Result<tonic::Response<proto::UnlockResponse>, Status> {
        let request = request.into_inner();
        let found = dapr::unlock_owned(
            &self.api,
            &request.store_name,
            &request.resource_id,
            &request.lock_owner,
        )
        .await;
        let extras = dapr::unlock_extras(&found);
        match found {
            // The same numbers in Dapr's enum and in its HTTP answer.
            Ok(unlocked) => Ok(answer(
                proto::UnlockResponse {
                    status: unlocked as i32,
                },
                extras,
            )),
            Err(err) => Err(status(&err, extras)),
        }
    }

    async fn get_metadata(
        &self,
        _request: tonic::Request<proto::GetMetadataRequest>,
    ) -> Result<tonic::Response<proto::GetMetadataResponse>, Status> {
        Ok(tonic::Response::new(self.metadata()))
    }
}

/// What an unserved method is told.
pub fn unimplemented(path: &str) -> Status {
    // The path is the client's: bounded in the answer.
    let path: String = path.chars().take(200).collect();
    Status::unimplemented(format!(
        "{path} is not served here: this is redlock-sidecar's Dapr lock API, serving only \
         TryLockAlpha1, UnlockAlpha1 and GetMetadata of {SERVICE}"
    ))
}

fn grpc_response(status: Status) -> Response {
    status.into_http::<axum::body::Body>().into_response()
}

/// The routes: each served method to the generated server, everything else UNIMPLEMENTED,
/// behind the `:authority` check and [`malformed_as_invalid_argument`].
pub fn router<E: LockEngine>(grpc: DaprGrpc<E>) -> axum::Router {
    let server = DaprServer::new(grpc).max_decoding_message_size(MAX_MESSAGE);
    let mut router = axum::Router::new();
    for method in SERVED {
        let served = server
            .clone()
            .map_request(|request: Request| request.map(tonic::body::Body::new));
        router = router.route_service(&format!("/{SERVICE}/{method}"), served);
    }
    router
        .fallback(
            |request: Request| async move { grpc_response(unimplemented(request.uri().path())) },
        )
        .layer(axum::middleware::from_fn(malformed_as_invalid_argument))
        .layer(axum::middleware::from_fn(this_pod_only))
}

/// Refuses a request whose `:authority` (or `Host`) is not `localhost` or a loopback address.
async fn this_pod_only(request: Request, next: Next) -> Response {
    let authority = request
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| {
            request
                .headers()
                .get(axum::http::header::HOST)
                .map(|h| h.to_str().unwrap_or("?").to_owned())
        });
    if authority.is_some_and(|a| !crate::http::is_loopback_host(&a)) {
        return grpc_response(Status::permission_denied(
            "the :authority must be a loopback address or localhost: this port serves the \
             processes of this pod",
        ));
    }
    next.run(request).await
}

/// tonic's INTERNAL answers for a request body that is no whole message (none at all, a
/// frame cut short, a frame flag that is neither 0 nor 1) become INVALID_ARGUMENT: the request, not the server, is at fault. No
/// method of this module answers INTERNAL with these messages.
pub async fn malformed_as_invalid_argument(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response
        .extensions()
        .get::<Status>()
        .map(|s| (s.code(), s.message().to_owned()))
        .or_else(|| {
            Status::from_header_map(response.headers()).map(|s| (s.code(), s.message().to_owned()))
        });
    match status {
        Some((Code::Internal, message)) if is_framing_error(&message) => grpc_response(
            Status::invalid_argument(format!("malformed request: {message}")),
        ),
        _ => response,
    }
}

/// tonic's messages for a request body that holds no whole message, or a frame whose
/// compressed flag is neither 0 nor 1.
fn is_framing_error(message: &str) -> bool {
    message.starts_with("Missing request message")
        || message.starts_with("Unexpected EOF")
        || message.contains("received message with invalid compression flag")
}

/// Serves `grpc` on `listener` until `shutdown` fires, within the bounds in the module doc;
/// then lets the open connections finish their calls and close.
pub async fn serve<E: LockEngine>(
    listener: TcpListener,
    grpc: DaprGrpc<E>,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .concurrency_limit_per_connection(MAX_STREAMS)
        .max_concurrent_streams(u32::try_from(MAX_STREAMS).unwrap_or(u32::MAX))
        .timeout(CALL_TIMEOUT)
        .http2_keepalive_interval(Some(KEEPALIVE.0))
        .http2_keepalive_timeout(Some(KEEPALIVE.1))
        .max_connection_age(MAX_CONNECTION_AGE)
        .max_connection_age_grace(CLOSE_GRACE)
        .add_routes(tonic::service::Routes::from(router(grpc)))
        .serve_with_incoming_shutdown(incoming(listener), shutdown.cancelled_owned())
        .await
}

/// The connections of `listener`, at most [`MAX_CONNECTIONS`] open at once.
fn incoming(listener: TcpListener) -> impl Stream<Item = io::Result<Conn>> {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    futures_util::stream::unfold((listener, slots), |(listener, slots)| async move {
        // A slot first: while all are taken, new connections wait in the accept queue.
        let slot = Arc::clone(&slots).acquire_owned().await.ok()?;
        let accepted = match listener.accept().await {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                Ok(Conn::new(stream, slot))
            }
            Err(err) => {
                // Out of descriptors, say: do not spin on it.
                clock::pause(Duration::from_millis(100)).await;
                Err(err)
            }
        };
        Some((accepted, (listener, slots)))
    })
}

/// An accepted connection: holds its slot, and fails a read if no byte came within
/// [`HEADER_READ_TIMEOUT`] of the accept.
pub struct Conn {
    stream: TcpStream,
    first_bytes: Option<Pin<Box<tokio::time::Sleep>>>,
    _slot: OwnedSemaphorePermit,
}

impl Conn {
    fn new(stream: TcpStream, slot: OwnedSemaphorePermit) -> Conn {
        Conn {
            stream,
            first_bytes: Some(Box::pin(clock::pause(HEADER_READ_TIMEOUT))),
            _slot: slot,
        }
    }
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.first_bytes = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                let late = this
                    .first_bytes
                    .as_mut()
                    .is_some_and(|deadline| deadline.as_mut().poll(cx).is_ready());
                if late {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no request within the header read timeout",
                    )));
                }
                Poll::Pending
            }
            other => other,
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Decodes `bytes` as `U` as [`Codec`]'s decoder does.
    fn decode<U: Message + Default>(bytes: &[u8]) -> Result<Option<U>, Status> {
        decode_message(bytes).map(Some)
    }

    #[test]
    fn a_request_that_does_not_decode_is_an_invalid_argument() {
        let good = proto::TryLockRequest {
            store_name: "redlock".into(),
            resource_id: "order-1".into(),
            lock_owner: "vader".into(),
            expiry_in_seconds: 30,
        };
        assert_eq!(
            decode::<proto::TryLockRequest>(&good.encode_to_vec()).unwrap(),
            Some(good)
        );
        // A field's length past the end; a string that is not UTF-8; a bad wire type.
        for bad in [&[0x0a, 0x05, b'a'][..], &[0x12, 0x01, 0xff], &[0x0f]] {
            let err = decode::<proto::TryLockRequest>(bad).unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{bad:?}: {err:?}");
        }
    }

    #[test]
    fn a_store_failure_carries_an_error_info_with_the_calls_code_and_message() {
        let err = DaprError::Unavailable(dapr::Unavailable::NoQuorum { kind: "no_quorum" });
        let status = status(&err, vec![(dapr::REASON, "no_quorum".into())]);
        assert_eq!(status.code(), Code::Internal);
        assert_eq!(
            status
                .metadata()
                .get(dapr::REASON)
                .and_then(|v| v.to_str().ok()),
            Some("no_quorum")
        );
        let details = RpcStatus::decode(status.details()).unwrap();
        assert_eq!(details.code, Code::Internal as i32);
        assert_eq!(details.message, status.message());
        assert_eq!(details.details[0].type_url, dapr::ERROR_INFO_TYPE);
        let info = RpcErrorInfo::decode(&*details.details[0].value).unwrap();
        assert_eq!(info.reason, "REDLOCK_NO_QUORUM");
        assert_eq!(info.domain, dapr::ERROR_DOMAIN);
        assert_eq!(
            info.metadata.get("kind").map(String::as_str),
            Some("no_quorum")
        );

        let refused = status_of_malformed();
        assert_eq!(refused.code(), Code::InvalidArgument);
        assert!(refused.details().is_empty());
    }

    fn status_of_malformed() -> Status {
        status(
            &DaprError::Malformed("LockOwner is empty in lock store redlock".into()),
            Vec::new(),
        )
    }

    #[test]
    fn an_unserved_method_is_told_what_is_served() {
        let status = unimplemented("/dapr.proto.runtime.v1.Dapr/GetState");
        assert_eq!(status.code(), Code::Unimplemented);
        for name in [
            "GetState",
            "TryLockAlpha1",
            "UnlockAlpha1",
            "GetMetadata",
            SERVICE,
        ] {
            assert!(status.message().contains(name), "{}", status.message());
        }
        let long = unimplemented(&"x".repeat(10_000));
        assert!(long.message().len() < 500);
    }

    proptest! {
        /// Any bytes decode as a request or are an INVALID_ARGUMENT; never a panic.
        #[test]
        fn any_bytes_decode_or_are_an_invalid_argument(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            for result in [
                decode::<proto::TryLockRequest>(&bytes).map(|_| ()),
                decode::<proto::UnlockRequest>(&bytes).map(|_| ()),
                decode::<proto::GetMetadataRequest>(&bytes).map(|_| ()),
            ] {
                if let Err(err) = result {
                    prop_assert_eq!(err.code(), Code::InvalidArgument);
                }
            }
        }
    }
}

//! The gRPC server: its router and gate (this pod only, framing errors as INVALID_ARGUMENT,
//! UNIMPLEMENTED for what is not served), the listener and its bounded connections.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::{Code, Status};
use tower::ServiceExt;

use super::proto::dapr_server::DaprServer;
use super::service::DaprGrpc;
use super::{CALL_TIMEOUT, KEEPALIVE, MAX_CONNECTIONS, MAX_MESSAGE, MAX_STREAMS, SERVED, SERVICE};
use crate::clock;
use crate::http::{CLOSE_GRACE, HEADER_READ_TIMEOUT, MAX_CONNECTION_AGE};
use crate::locks::engine::LockEngine;

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

//! Dapr's gRPC API (`dapr.proto.runtime.v1.Dapr`) for Dapr's SDKs, on a loopback port of its
//! own (`--dapr-grpc-listen`, off unless given).
//!
//! | method | answer |
//! |---|---|
//! | `TryLockAlpha1` | `{success}`, as `POST /v1.0-alpha1/lock/{store}` answers (one code path: [`dapr::try_lock`](super::dapr::try_lock)) |
//! | `UnlockAlpha1` | `{status}`: `SUCCESS`, `LOCK_DOES_NOT_EXIST`, `LOCK_BELONGS_TO_OTHERS`, `INTERNAL_ERROR` ([`dapr::unlock_owned`](super::dapr::unlock_owned)) |
//! | `GetMetadata` | this sidecar as Dapr describes a sidecar ([`dapr::Runtime`](super::dapr::Runtime)); Dapr's JavaScript SDK calls it before anything else |
//! | any other method, of this service or another | UNIMPLEMENTED, the message naming what is served |
//!
//! Status codes are daprd's: INVALID_ARGUMENT for a request Dapr refuses (an expiry that is not
//! positive, an empty resource or owner, another store) and for one out of this sidecar's
//! bounds; INTERNAL for a store that cannot answer (`ERR_TRY_LOCK_FAILED`), RESOURCE_EXHAUSTED
//! past `--locks-max-leases`. Beside the answer, in the response metadata (headers), travel the
//! fencing token and validity of a lock taken and the reason of any other answer (see
//! [`dapr`](super::dapr)); a store failure carries a `google.rpc.ErrorInfo` in
//! `grpc-status-details-bin` (Dapr's rich error model, which Dapr's SDKs read) whose reason
//! tells a quorum that could not be reached from a shutdown.
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
//! | file | concern |
//! |---|---|
//! | [`codec`] | prost's encoding, with a request that does not decode the caller's error |
//! | [`service`] | the three methods, their answers and statuses with Dapr's rich errors |
//! | [`server`] | the router, its gate and its framing errors, the listener and connections |
//!
//! [`HEADER_READ_TIMEOUT`]: crate::http::HEADER_READ_TIMEOUT
//! [`MAX_CONNECTION_AGE`]: crate::http::MAX_CONNECTION_AGE
//! [`CLOSE_GRACE`]: crate::http::CLOSE_GRACE

use std::time::Duration;

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

pub mod codec;
pub mod server;
pub mod service;

pub use codec::{decode_message, Codec, Decoder, Encoder};
pub use server::{malformed_as_invalid_argument, router, serve, unimplemented, Conn};
pub use service::{status, Any, DaprGrpc, RpcErrorInfo, RpcStatus};

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

#[cfg(test)]
mod tests;

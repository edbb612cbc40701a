//! The bottom of the transport: the core's error types (`redlock_core::error`), and the one
//! place a client library error becomes a [`NodeError`], its text scrubbed of the password.

use redis::RedisError;

pub use redlock_core::error::{ConfigError, NodeError, NodeErrorKind};

/// `err` as a [`NodeError`]: classified, with any `password` removed from its text.
pub(crate) fn node_error(err: &RedisError, password: Option<&str>) -> NodeError {
    let code = err.code().unwrap_or_default();
    let kind = if err.is_timeout() {
        NodeErrorKind::Timeout
    } else if matches!(err.kind(), redis::ErrorKind::AuthenticationFailed)
        || matches!(code, "NOAUTH" | "WRONGPASS" | "NOPERM")
    {
        NodeErrorKind::Auth
    } else if matches!(
        err.kind(),
        redis::ErrorKind::Parse | redis::ErrorKind::UnexpectedReturnType
    ) {
        NodeErrorKind::Protocol
    } else if err.is_io_error() || err.is_connection_refusal() || err.is_connection_dropped() {
        NodeErrorKind::Connection
    } else {
        NodeErrorKind::Other
    };
    let mut message = err.to_string();
    if let Some(password) = password.filter(|p| !p.is_empty()) {
        message = message.replace(password, "<redacted>");
    }
    NodeError { kind, message }
}

//! The bottom of the transport: what can go wrong, as types every layer above shares.
//!
//! A [`ConfigError`] is a flag that breaks a rule (exit 2); a [`NodeError`] is one failed call
//! to one node, classified in a small fixed set ([`NodeErrorKind`], a metric label) with the
//! client library's text scrubbed of the password.

use std::fmt;
use std::time::Duration;

use redis::RedisError;

/// A configuration value that breaks a rule. Displayed as `--flag: why`, one line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{flag}: {reason}")]
pub struct ConfigError {
    /// The command-line flag at fault (its environment variable is documented beside it).
    pub flag: &'static str,
    /// The rule it breaks, with the values involved.
    pub reason: String,
}

impl ConfigError {
    /// A new error for `flag`.
    pub fn new(flag: &'static str, reason: impl Into<String>) -> ConfigError {
        ConfigError {
            flag,
            reason: reason.into(),
        }
    }
}

/// Why a call to one node failed, in a small fixed set (used as a metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NodeErrorKind {
    /// No answer within the per-node timeout.
    Timeout,
    /// Refused, reset, unreachable or unknown host.
    Connection,
    /// Wrong password or user, or a password is required.
    Auth,
    /// The peer answered something that is not the expected Redis reply.
    Protocol,
    /// Any other error the node returned.
    Other,
}

impl NodeErrorKind {
    /// Every kind, for pre-initialising metrics.
    pub const ALL: [NodeErrorKind; 5] = [
        NodeErrorKind::Timeout,
        NodeErrorKind::Connection,
        NodeErrorKind::Auth,
        NodeErrorKind::Protocol,
        NodeErrorKind::Other,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeErrorKind::Timeout => "timeout",
            NodeErrorKind::Connection => "connection",
            NodeErrorKind::Auth => "auth",
            NodeErrorKind::Protocol => "protocol",
            NodeErrorKind::Other => "other",
        }
    }
}

impl fmt::Display for NodeErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed call to one node: its kind and a scrubbed message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct NodeError {
    /// The class of failure.
    pub kind: NodeErrorKind,
    /// What the client library said, with any password removed.
    pub message: String,
}

impl NodeError {
    /// Whether the node refused a command because the ACL user may not run it (`NOPERM`).
    pub fn is_acl_denial(&self) -> bool {
        self.kind == NodeErrorKind::Auth && self.message.to_ascii_lowercase().contains("noperm")
    }

    pub(crate) fn timeout(after: Duration) -> NodeError {
        NodeError {
            kind: NodeErrorKind::Timeout,
            message: format!("no answer within {after:?}"),
        }
    }

    pub(crate) fn from_redis(err: &RedisError, password: Option<&str>) -> NodeError {
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
}

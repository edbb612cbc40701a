//! The request-lock API's flags (`run`): served or not, its namespace, its bounds, Dapr's
//! store name and gRPC listener.

use std::net::SocketAddr;

use clap::Args;

use super::values::is_loopback;
use crate::redlock::ConfigError;

/// On or off.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Switch {
    On,
    Off,
}

/// The request-lock API on the control listener (see `docs/locks.md`).
#[derive(Args, Debug)]
pub struct LocksArgs {
    /// Serve locks for the app's requests on the control listener (/v1/locks, Dapr's
    /// /v1.0-alpha1/lock and unlock).
    #[arg(long, env = "REDLOCK_LOCKS", value_enum, default_value_t = Switch::On)]
    pub locks: Switch,
    /// Namespace of the request locks on the nodes: lock NAME is the engine lock
    /// PREFIX:NAME (key redlock:{PREFIX:NAME}; fencing tokens from one counter per hash slot
    /// of the namespace, so names do not pile up); --lock may not start with PREFIX:.
    #[arg(long, env = "REDLOCK_LOCKS_PREFIX", default_value = "app")]
    pub locks_prefix: String,
    /// Most request-lock leases at once: held, waiting, ending (a lost lease keeping its promise) and remembered (an ended lease, for a minute); past it, 429 at once.
    #[arg(long, env = "REDLOCK_LOCKS_MAX_LEASES", default_value_t = 1000)]
    pub locks_max_leases: usize,
    /// The store name Dapr's lock API answers to (/v1.0-alpha1/lock/STORE).
    #[arg(long, env = "REDLOCK_LOCKS_DAPR_STORE", default_value = "redlock")]
    pub locks_dapr_store: String,
    /// Loopback address of Dapr's gRPC API for Dapr's SDKs (dapr.proto.runtime.v1.Dapr:
    /// TryLockAlpha1, UnlockAlpha1, GetMetadata), e.g. 127.0.0.1:50001, Dapr's own gRPC port;
    /// off when not given, empty or `off` (see docs/locks.md).
    #[arg(long, env = "REDLOCK_DAPR_GRPC_LISTEN", value_name = "ADDR")]
    pub dapr_grpc_listen: Option<String>,
}

/// Most `--locks-max-leases`.
pub const MAX_LOCKS_MAX_LEASES: usize = 100_000;

/// The request-lock API's settings, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocksConfig {
    /// `--locks-prefix`.
    pub prefix: String,
    /// `--locks-max-leases`.
    pub max_leases: usize,
    /// `--locks-dapr-store`.
    pub dapr_store: String,
    /// `--dapr-grpc-listen`: loopback, bound as its IPv4 address when IPv4-mapped.
    pub dapr_grpc_listen: Option<SocketAddr>,
}

impl LocksArgs {
    /// The settings, `None` with `--locks off`; `lock` is the leadership lock's name.
    pub fn config(&self, lock: &str) -> Result<Option<LocksConfig>, ConfigError> {
        // Empty (an unset value passed on by a template) or `off`: not served.
        let dapr_grpc_listen = match self.dapr_grpc_listen.as_deref().map(str::trim) {
            None | Some("" | "off") => None,
            Some(text) => Some(text.parse::<SocketAddr>().map_err(|_| {
                ConfigError::new(
                    "--dapr-grpc-listen",
                    format!("{text:?} is not an address such as 127.0.0.1:50001 (or off)"),
                )
            })?),
        };
        if self.locks == Switch::Off {
            if dapr_grpc_listen.is_some() {
                return Err(ConfigError::new(
                    "--dapr-grpc-listen",
                    "serves Dapr's lock API: it needs the request locks (--locks on)",
                ));
            }
            return Ok(None);
        }
        let word = |text: &str| {
            !text.is_empty()
                && text.len() <= 64
                && text
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        };
        if !word(&self.locks_prefix) {
            return Err(ConfigError::new(
                "--locks-prefix",
                "1 to 64 characters of A-Z a-z 0-9 - _ .",
            ));
        }
        if lock.starts_with(&format!("{}:", self.locks_prefix)) {
            return Err(ConfigError::new(
                "--locks-prefix",
                format!(
                    "--lock {lock:?} starts with \"{}:\", the request locks' namespace: choose another prefix or lock name",
                    self.locks_prefix
                ),
            ));
        }
        if self.locks_max_leases == 0 || self.locks_max_leases > MAX_LOCKS_MAX_LEASES {
            return Err(ConfigError::new(
                "--locks-max-leases",
                format!("from 1 to {MAX_LOCKS_MAX_LEASES}"),
            ));
        }
        if !word(&self.locks_dapr_store) {
            return Err(ConfigError::new(
                "--locks-dapr-store",
                "1 to 64 characters of A-Z a-z 0-9 - _ .",
            ));
        }
        let dapr_grpc_listen = match dapr_grpc_listen {
            Some(addr) if !is_loopback(addr.ip()) => {
                return Err(ConfigError::new(
                    "--dapr-grpc-listen",
                    "must be a loopback address (e.g. 127.0.0.1:50001): its methods take and release locks",
                ))
            }
            // Bound as its IPv4 address when IPv4-mapped, as --control-listen.
            Some(addr) => Some(SocketAddr::new(addr.ip().to_canonical(), addr.port())),
            None => None,
        };
        Ok(Some(LocksConfig {
            prefix: self.locks_prefix.clone(),
            max_leases: self.locks_max_leases,
            dapr_store: self.locks_dapr_store.clone(),
            dapr_grpc_listen,
        }))
    }
}

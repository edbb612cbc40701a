//! The lock's flags, shared by `run`, `guard` and `status`, and `check`'s: the engine
//! config they describe.

use std::time::Duration;

use clap::Args;

use super::nodes::RedisArgs;
use super::values::{duration_at_most, env_nonempty};
use crate::redlock::timing::{MAX_FENCE_RETENTION, MAX_RETRY_DELAY, MAX_TTL};
use crate::redlock::{ConfigError, RedlockConfig};

/// Longest `--identity`, in bytes (a DNS name's length; pod and host names fit).
pub const MAX_IDENTITY_LEN: usize = 253;

/// The lock and its timing, shared by `run`, `guard` and `status`.
#[derive(Args, Debug, Clone)]
pub struct LockArgs {
    /// Lock name; all contenders for the same work use the same name.
    #[arg(long, env = "REDLOCK_LOCK")]
    pub lock: String,
    /// How long the lock lives on a node without renewal.
    #[arg(long, env = "REDLOCK_TTL", value_parser = duration_at_most(MAX_TTL), default_value = "10s")]
    pub ttl: Duration,
    /// The longest ttl any contender of this lock uses, if ttls differ. Default: --ttl.
    /// Contenders also learn it from the nodes; this covers nodes that lost it.
    #[arg(long, env = "REDLOCK_MAX_TTL", value_parser = duration_at_most(MAX_TTL))]
    pub max_ttl: Option<Duration>,
    /// How long a lock's fencing counter stays on the nodes after its last use.
    #[arg(long, env = "REDLOCK_FENCE_RETENTION", value_parser = duration_at_most(MAX_FENCE_RETENTION), default_value = "24h")]
    pub fence_retention: Duration,
    /// First delay before retrying a failed attempt (random, growing up to 1s).
    #[arg(long, env = "REDLOCK_RETRY_DELAY", value_parser = duration_at_most(MAX_RETRY_DELAY), default_value = "200ms")]
    pub retry_delay: Duration,
    /// Who we are (written into the lock value). Default: $POD_NAME, then the host name.
    #[arg(long, env = "REDLOCK_IDENTITY")]
    pub identity: Option<String>,
    /// Name of the node set, recorded beside the lock so that contenders on other servers
    /// refuse to lead. Default: a fingerprint of the servers the --redis nodes reach (each
    /// server's run id and the db), whatever their addresses. Set one name everywhere only for
    /// what the servers cannot show (e.g. servers that report no run id).
    #[arg(long, env = "REDLOCK_NODE_SET")]
    pub node_set: Option<String>,
    #[command(flatten)]
    pub redis: RedisArgs,
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    #[command(flatten)]
    pub redis: RedisArgs,
    /// The longest ttl of the locks on these nodes: a node must prove it kept its data
    /// this long (plus drift) for its votes to count.
    #[arg(long, env = "REDLOCK_TTL", value_parser = duration_at_most(MAX_TTL), default_value = "10s")]
    pub ttl: Duration,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub lock: LockArgs,
}

impl LockArgs {
    /// The engine config these flags describe, validated.
    pub fn redlock(&self) -> Result<RedlockConfig, ConfigError> {
        let nodes = self.redis.nodes()?;
        let identity = match &self.identity {
            Some(identity) => identity.clone(),
            None => default_identity(),
        };
        if identity.len() > MAX_IDENTITY_LEN {
            return Err(ConfigError::new(
                "--identity",
                format!("must be at most {MAX_IDENTITY_LEN} bytes"),
            ));
        }
        let mut cfg = RedlockConfig::new(self.lock.clone(), identity, nodes);
        cfg.ttl = self.ttl;
        cfg.max_ttl = self.max_ttl;
        cfg.fence_retention = self.fence_retention;
        cfg.node_set = self.node_set.clone();
        cfg.allow_evicting_nodes = self.redis.allow_evicting_nodes;
        cfg.keyspace_events = self.redis.keyspace_events;
        cfg.node_timeout = self.redis.node_timeout;
        cfg.connect_timeout = self.redis.connect_timeout;
        cfg.retry_delay = self.retry_delay;
        cfg.retry_max = cfg.retry_max.max(self.retry_delay);
        cfg.validate()?;
        Ok(cfg)
    }
}

impl CheckArgs {
    /// The engine config `check` runs with, validated (the lock name is a placeholder).
    pub fn config(&self) -> Result<RedlockConfig, ConfigError> {
        let nodes = self.redis.nodes()?;
        let mut cfg = RedlockConfig::new("check", "check", nodes);
        cfg.stamp_cluster_markers = false;
        cfg.ttl = self.ttl;
        cfg.allow_evicting_nodes = self.redis.allow_evicting_nodes;
        cfg.node_timeout = self.redis.node_timeout;
        cfg.connect_timeout = self.redis.connect_timeout;
        cfg.validate()?;
        Ok(cfg)
    }
}

impl StatusArgs {
    /// The engine config `status` reads with, validated.
    pub fn config(&self) -> Result<RedlockConfig, ConfigError> {
        let mut cfg = self.lock.redlock()?;
        cfg.stamp_cluster_markers = false;
        Ok(cfg)
    }
}

/// `$POD_NAME`, else the host name, else `redlock-sidecar`.
fn default_identity() -> String {
    env_nonempty("POD_NAME")
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
        })
        .unwrap_or_else(|| "redlock-sidecar".to_owned())
}

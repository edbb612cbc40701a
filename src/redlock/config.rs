//! The engine's configuration and the rules it must meet before a lock is built.

use std::time::Duration;

use super::timing::{self, drift};
use super::{ConfigError, NodeSpec};

/// Everything the engine needs; validated by [`RedlockConfig::validate`].
#[derive(Clone, Debug)]
pub struct RedlockConfig {
    /// The lock name; its key is `redlock:{name}`, and the keys beside it share its hash tag
    /// (the fencing counter too, see `fence_namespace`). It must not start
    /// with `}` (the keys' cluster hash tag would be empty).
    pub lock: String,
    /// Who we are, written into the lock value so others can see the holder.
    pub identity: String,
    /// The voters: independent Redis masters (no replication between them), or Sentinel
    /// groups, each followed to its current master.
    pub nodes: Vec<NodeSpec>,
    /// How long a key lives without renewal.
    pub ttl: Duration,
    /// The longest ttl any contender of this lock uses, when ttls differ (see [`votes`]).
    pub max_ttl: Option<Duration>,
    /// How long a fencing counter is kept after its last use; then the Unix-ms floor of the
    /// next token takes over (see [`fencing`]).
    pub fence_retention: Duration,
    /// `None`: the lock has a fencing counter of its own, `redlock:{name}:fence`. `Some(ns)`:
    /// it takes its tokens from the counter that namespace `ns` shares per hash slot,
    /// `redlock:{TAG}:fence:ns` (see [`fencing`]), so locking a million distinct names
    /// leaves a bounded number of counters instead of one per name for the retention.
    ///
    /// [`fencing`]: super::fencing
    pub fence_namespace: Option<String>,
    /// The name of the node set recorded beside the lock; `None`: the fingerprint of the
    /// servers `nodes` reach (see [`votes::NodeSet`]).
    pub node_set: Option<String>,
    /// Count votes of nodes whose `maxmemory-policy` may evict lock keys (unsafe).
    pub allow_evicting_nodes: bool,
    /// Whether a waiter subscribes to the lock key's keyspace events too (see [`push`]).
    pub keyspace_events: bool,
    /// Whether connecting to a cluster-mode node stamps the epoch markers of every slot (see
    /// [`cluster`]); the operator commands, which never write, turn it off.
    pub stamp_cluster_markers: bool,
    /// Tests only: pretend this client's wall clock is off by this many milliseconds, to
    /// check the fencing guarantee under clock skew.
    #[doc(hidden)]
    pub wall_clock_skew_ms: i64,
    /// Bound on each call to each node.
    pub node_timeout: Duration,
    /// Bound on making a connection.
    pub connect_timeout: Duration,
    /// First retry delay after a failed round; it grows up to `retry_max`.
    pub retry_delay: Duration,
    /// Longest wait between two attempts while waiting; a standby with no live push
    /// subscription reads the nodes at least this often.
    pub retry_max: Duration,
}

impl RedlockConfig {
    /// A config with the defaults for everything but the lock, identity and nodes.
    pub fn new(lock: impl Into<String>, identity: impl Into<String>, nodes: Vec<NodeSpec>) -> Self {
        RedlockConfig {
            lock: lock.into(),
            identity: identity.into(),
            nodes,
            ttl: Duration::from_secs(10),
            max_ttl: None,
            fence_retention: DEFAULT_FENCE_RETENTION,
            fence_namespace: None,
            node_set: None,
            allow_evicting_nodes: false,
            keyspace_events: false,
            stamp_cluster_markers: true,
            wall_clock_skew_ms: 0,
            node_timeout: Duration::from_millis(50),
            connect_timeout: Duration::from_secs(1),
            retry_delay: Duration::from_millis(200),
            retry_max: Duration::from_secs(1),
        }
    }

    /// Checks the rules the algorithm depends on; the error names the flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.lock.is_empty() {
            return Err(ConfigError::new("--lock", "must not be empty"));
        }
        if self.lock.len() > 200
            || self
                .lock
                .chars()
                .any(|c| c.is_control() || c.is_whitespace())
        {
            return Err(ConfigError::new(
                "--lock",
                "must be at most 200 characters without spaces or control characters",
            ));
        }
        if self.lock.starts_with('}') {
            // The keys' hash tag `{NAME}` would be empty: in Redis Cluster each key would hash
            // to its own slot, and every script fail with CROSSSLOT. Braces elsewhere keep a
            // non-empty tag shared by all the lock's keys, and work everywhere.
            return Err(ConfigError::new(
                "--lock",
                "must not start with '}': in Redis Cluster the keys' hash tag {NAME} would be empty",
            ));
        }
        if self.fence_namespace.as_ref().is_some_and(|ns| {
            ns.is_empty()
                || ns.len() > 64
                || !ns
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
        }) {
            return Err(ConfigError::new(
                "--locks-prefix",
                "must be 1 to 64 letters, digits, '-', '_', '.' or ':'",
            ));
        }
        if self.identity.is_empty() || self.identity.chars().any(char::is_control) {
            return Err(ConfigError::new(
                "--identity",
                "must be non-empty printable text",
            ));
        }
        if self.nodes.is_empty() {
            return Err(ConfigError::new("--redis", "at least one node is required"));
        }
        let mut seen = std::collections::HashSet::new();
        for node in &self.nodes {
            if !seen.insert(node.identity()) {
                return Err(ConfigError::new(
                    "--redis",
                    format!(
                        "node {} is listed twice; the nodes must be independent masters",
                        node.label()
                    ),
                ));
            }
        }
        if self.node_set.as_ref().is_some_and(|name| {
            name.is_empty() || name.len() > 200 || name.chars().any(char::is_control)
        }) {
            return Err(ConfigError::new(
                "--node-set",
                "must be 1 to 200 printable characters",
            ));
        }
        // Bounded before any rule below computes with them.
        check_bounds(self)?;
        self.validate_durations()
    }

    /// The rules between the durations: a round leaves most of the ttl, the longest ttl is
    /// at least the ttl, counters outlive two ttls, retries wait.
    fn validate_durations(&self) -> Result<(), ConfigError> {
        if self.node_timeout.is_zero() {
            return Err(ConfigError::new("--node-timeout", "must be greater than 0"));
        }
        let drift = drift(self.ttl);
        // A round that uses the whole node timeout must still leave most of the ttl.
        if self.ttl < (self.node_timeout + drift) * 4 {
            return Err(ConfigError::new(
                "--ttl",
                format!(
                    "{} is too short: it must be at least 4 × (node timeout {} + drift {})",
                    humantime::format_duration(self.ttl),
                    humantime::format_duration(self.node_timeout),
                    humantime::format_duration(drift)
                ),
            ));
        }
        if let Some(max_ttl) = self.max_ttl.filter(|max| *max < self.ttl) {
            return Err(ConfigError::new(
                "--max-ttl",
                format!(
                    "{} is shorter than --ttl {}: it is the longest ttl any contender uses",
                    humantime::format_duration(max_ttl),
                    humantime::format_duration(self.ttl)
                ),
            ));
        }
        if self.fence_retention < self.longest_ttl() * 2 {
            return Err(ConfigError::new(
                "--fence-retention",
                format!(
                    "{} is too short: it must be at least twice the longest ttl ({})",
                    humantime::format_duration(self.fence_retention),
                    humantime::format_duration(self.longest_ttl())
                ),
            ));
        }
        if self.retry_delay.is_zero() || self.retry_delay > self.retry_max.max(self.retry_delay) {
            return Err(ConfigError::new("--retry-delay", "must be greater than 0"));
        }
        Ok(())
    }
}

impl RedlockConfig {
    /// The longest ttl this contender knows to be in use: `--max-ttl`, else `--ttl`.
    pub fn longest_ttl(&self) -> Duration {
        self.max_ttl.unwrap_or(self.ttl).max(self.ttl)
    }
}

/// Default of [`RedlockConfig::fence_retention`]: a day, so client clocks would have to be
/// off by a day for the Unix-ms floor to fail once a counter is gone.
pub const DEFAULT_FENCE_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// Checks every duration of `cfg` against its bound in `timing`, before any rule computes with
/// them (the command line checks the same bounds as it parses; this covers library users).
fn check_bounds(cfg: &RedlockConfig) -> Result<(), ConfigError> {
    let bounds = [
        ("--ttl", cfg.ttl, timing::MAX_TTL),
        (
            "--max-ttl",
            cfg.max_ttl.unwrap_or_default(),
            timing::MAX_TTL,
        ),
        ("--node-timeout", cfg.node_timeout, timing::MAX_NODE_TIMEOUT),
        (
            "--connect-timeout",
            cfg.connect_timeout,
            timing::MAX_CONNECT_TIMEOUT,
        ),
        ("--retry-delay", cfg.retry_delay, timing::MAX_RETRY_DELAY),
        ("retry_max", cfg.retry_max, timing::MAX_RETRY_DELAY),
        (
            "--fence-retention",
            cfg.fence_retention,
            timing::MAX_FENCE_RETENTION,
        ),
    ];
    for (flag, value, max) in bounds {
        timing::at_most(value, max).map_err(|reason| ConfigError::new(flag, reason))?;
    }
    Ok(())
}

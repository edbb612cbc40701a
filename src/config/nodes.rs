//! `--redis` and the credentials and TLS files of the nodes: the node specs, whose errors
//! name a node by position and never print its URL.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::values::duration_at_most;
use crate::redlock::secrets::SecretFiles;
use crate::redlock::timing::{MAX_CONNECT_TIMEOUT, MAX_NODE_TIMEOUT};
use crate::redlock::{ConfigError, Credentials, NodeSpec};

/// How to reach the Redis nodes. `Debug` shows each node as `host:port` and no password.
#[derive(Args, Clone)]
pub struct RedisArgs {
    /// Redis node URL, repeat for each node; N = 1, 3, 5, ... A node is a master
    /// (redis://, rediss://; any node of a cluster-mode deployment stands for the cluster) or
    /// a Sentinel group followed across failovers
    /// (redis+sentinel://[user:pass@]s1[:26379],s2,.../MASTER[/DB]; rediss+sentinel:// for TLS).
    #[arg(
        long = "redis",
        env = "REDLOCK_REDIS",
        value_delimiter = ',',
        required = true,
        hide_env_values = true
    )]
    pub redis: Vec<String>,
    /// ACL user for nodes whose URL has none.
    #[arg(long, env = "REDLOCK_REDIS_USERNAME")]
    pub redis_username: Option<String>,
    /// Password for nodes whose URL has none (prefer the environment variable).
    #[arg(long, env = "REDLOCK_REDIS_PASSWORD", hide_env_values = true)]
    pub redis_password: Option<String>,
    /// File holding that password, e.g. a mounted Secret (a trailing newline is ignored).
    #[arg(
        long,
        env = "REDLOCK_REDIS_PASSWORD_FILE",
        conflicts_with = "redis_password"
    )]
    pub redis_password_file: Option<PathBuf>,
    /// ACL user for the Sentinels of redis+sentinel:// nodes (the URL's user is the master's).
    #[arg(long, env = "REDLOCK_SENTINEL_USERNAME")]
    pub sentinel_username: Option<String>,
    /// Password for the Sentinels of redis+sentinel:// nodes, if they require one (a
    /// Sentinel's requirepass is its own; the URL's password is the master's).
    #[arg(long, env = "REDLOCK_SENTINEL_PASSWORD", hide_env_values = true)]
    pub sentinel_password: Option<String>,
    /// File holding the Sentinels' password (a trailing newline is ignored).
    #[arg(
        long,
        env = "REDLOCK_SENTINEL_PASSWORD_FILE",
        conflicts_with = "sentinel_password"
    )]
    pub sentinel_password_file: Option<PathBuf>,
    /// PEM file of CA certificates for rediss:// nodes with a private CA.
    #[arg(long, env = "REDLOCK_REDIS_CA_FILE")]
    pub redis_ca_file: Option<PathBuf>,
    /// PEM file of the TLS client certificate, for nodes with `tls-auth-clients yes`.
    #[arg(long, env = "REDLOCK_REDIS_CLIENT_CERT", requires = "redis_client_key")]
    pub redis_client_cert: Option<PathBuf>,
    /// PEM file of the TLS client certificate's private key.
    #[arg(long, env = "REDLOCK_REDIS_CLIENT_KEY", requires = "redis_client_cert")]
    pub redis_client_key: Option<PathBuf>,
    /// Bound on each request to each node.
    #[arg(long, env = "REDLOCK_NODE_TIMEOUT", value_parser = duration_at_most(MAX_NODE_TIMEOUT), default_value = "50ms")]
    pub node_timeout: Duration,
    /// Bound on connecting to a node (TCP, TLS, AUTH).
    #[arg(long, env = "REDLOCK_CONNECT_TIMEOUT", value_parser = duration_at_most(MAX_CONNECT_TIMEOUT), default_value = "1s")]
    pub connect_timeout: Duration,
    /// Count the votes of nodes whose maxmemory-policy may evict lock keys. UNSAFE: an
    /// evicted key lets a second holder in; use only if memory can never run out.
    #[arg(long, env = "REDLOCK_ALLOW_EVICTING_NODES")]
    pub allow_evicting_nodes: bool,
    /// While waiting, also subscribe to the lock key's keyspace events on nodes that publish
    /// them (notify-keyspace-events): no reads while the holder renews, but every write to the
    /// key is one message per waiter; keep it for locks with few waiters.
    #[arg(long, env = "REDLOCK_KEYSPACE_EVENTS")]
    pub keyspace_events: bool,
}

impl fmt::Debug for RedisArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A URL may carry a password: show only what `NodeSpec` shows, `host:port`.
        let nodes: Vec<String> = node_urls(&self.redis)
            .iter()
            .enumerate()
            .map(
                |(i, url)| match NodeSpec::parse(i, url, &Credentials::default()) {
                    Ok(node) => node.label().to_owned(),
                    Err(_) => "<not a valid URL>".to_owned(),
                },
            )
            .collect();
        f.debug_struct("RedisArgs")
            .field("redis", &nodes)
            .field("redis_username", &self.redis_username)
            .field(
                "redis_password",
                &self.redis_password.as_ref().map(|_| "<redacted>"),
            )
            .field("redis_password_file", &self.redis_password_file)
            .field("sentinel_username", &self.sentinel_username)
            .field(
                "sentinel_password",
                &self.sentinel_password.as_ref().map(|_| "<redacted>"),
            )
            .field("sentinel_password_file", &self.sentinel_password_file)
            .field("redis_ca_file", &self.redis_ca_file)
            .field("redis_client_cert", &self.redis_client_cert)
            .field("redis_client_key", &self.redis_client_key)
            .field("node_timeout", &self.node_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("allow_evicting_nodes", &self.allow_evicting_nodes)
            .field("keyspace_events", &self.keyspace_events)
            .finish()
    }
}

impl RedisArgs {
    /// Parses every URL; errors name the node by position, never print the URL.
    pub fn nodes(&self) -> Result<Vec<NodeSpec>, ConfigError> {
        let files = SecretFiles {
            password: self.redis_password_file.clone(),
            ca: self.redis_ca_file.clone(),
            client_cert: self
                .redis_client_cert
                .clone()
                .zip(self.redis_client_key.clone()),
            sentinel_password: self.sentinel_password_file.clone(),
        };
        // Read once now (a bad file is a configuration error), and again by every connection.
        let loaded = files.load()?;
        let sentinel_password = loaded
            .sentinel_password
            .or_else(|| self.sentinel_password.clone());
        let creds = Credentials {
            username: self.redis_username.clone(),
            password: loaded.password.or_else(|| self.redis_password.clone()),
            ca_pem: loaded.ca_pem,
            client_cert: loaded.client_cert,
            files,
            sentinel_username: self.sentinel_username.clone(),
            sentinel_password,
        };
        let urls = node_urls(&self.redis);
        if urls.is_empty() {
            return Err(ConfigError::new("--redis", "at least one node is required"));
        }
        if self.connect_timeout.is_zero() {
            return Err(ConfigError::new(
                "--connect-timeout",
                "must be greater than 0",
            ));
        }
        urls.iter()
            .enumerate()
            .map(|(i, url)| NodeSpec::parse(i, url, &creds))
            .collect()
    }
}

/// The node URLs of `--redis`, trimmed, empty ones dropped. The list is split at commas, and
/// so are a Sentinel URL's hosts (`redis+sentinel://s1,s2/master`): a piece without a scheme
/// that follows a Sentinel URL whose master is not named yet is joined back onto it.
fn node_urls(list: &[String]) -> Vec<String> {
    let mut urls: Vec<String> = Vec::new();
    for piece in list.iter().map(|u| u.trim()).filter(|u| !u.is_empty()) {
        match urls.last_mut() {
            Some(last)
                if !piece.contains("://")
                    && crate::redlock::sentinel::is_sentinel_url(last)
                    && !last
                        .split_once("://")
                        .is_some_and(|(_, rest)| rest.contains('/')) =>
            {
                last.push(',');
                last.push_str(piece);
            }
            _ => urls.push(piece.to_owned()),
        }
    }
    urls
}

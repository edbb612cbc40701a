//! `run`'s flags: the listeners, readiness, the app's readiness check, Kubernetes, and
//! everything `run` needs, validated.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, ValueEnum};

use super::lock::LockArgs;
use super::locks::{LocksArgs, LocksConfig};
use super::renew::{RenewArgs, Renewal};
use super::values::{
    duration_at_most, fmt, is_dns_label, is_label_key, is_loopback, kube_settings,
};
use crate::k8s::KubeMode;
use crate::redlock::{ConfigError, RedlockConfig};

/// Longest `--shutdown-timeout`: an hour (a release takes at most twice the node timeout).
pub const MAX_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(3600);

/// Default admin port for `run`.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:9707";
/// Where the routes that change state listen by default: loopback only.
pub const DEFAULT_CONTROL_LISTEN: &str = "127.0.0.1:9708";
/// The longest `--app-ready-interval`, `--app-unready-after` and resign hold.
pub const MAX_APP_WAIT: Duration = Duration::from_secs(3600);
/// The shortest `--app-ready-interval`: a probe every 50 ms is already more than any app needs.
pub const MIN_APP_READY_INTERVAL: Duration = Duration::from_millis(50);

/// When `/readyz` answers 200.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ReadyWhen {
    /// While a quorum of nodes is reachable (rolling updates proceed).
    Quorum,
    /// Only while leading (blocks rolling updates of followers; see docs/reference.md).
    Leader,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub lock: LockArgs,
    #[command(flatten)]
    pub renew: RenewArgs,
    /// Address of the HTTP endpoint (/healthz /readyz /leader /leader/watch /metrics).
    #[arg(long, env = "REDLOCK_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// When /readyz answers 200.
    #[arg(long, env = "REDLOCK_READY_WHEN", value_enum, default_value_t = ReadyWhen::Quorum)]
    pub ready_when: ReadyWhen,
    /// Loopback address (127.0.0.0/8, [::1], [::ffff:127.0.0.1]) of the routes that change
    /// state: resign, request locks, Dapr's lock API.
    #[arg(long, env = "REDLOCK_CONTROL_LISTEN", default_value = DEFAULT_CONTROL_LISTEN)]
    pub control_listen: SocketAddr,
    /// Contend only while this URL of the app answers 2xx (http://HOST[:PORT][/PATH]).
    #[arg(long, env = "REDLOCK_APP_READY", conflicts_with = "follow_container")]
    pub app_ready: Option<String>,
    /// Contend only while this container of the pod is ready (from the pod's status); `*`:
    /// every regular container of the pod (the app's, beside a native sidecar).
    #[arg(long, env = "REDLOCK_FOLLOW_CONTAINER")]
    pub follow_container: Option<String>,
    /// How often the app is probed; also the bound on each probe.
    #[arg(long, env = "REDLOCK_APP_READY_INTERVAL", value_parser = duration_at_most(MAX_APP_WAIT), default_value = "1s")]
    pub app_ready_interval: Duration,
    /// A leader whose app has failed for this long steps down and releases at once.
    #[arg(long, env = "REDLOCK_APP_UNREADY_AFTER", value_parser = duration_at_most(MAX_APP_WAIT), default_value = "5s")]
    pub app_unready_after: Duration,
    /// Bound on the graceful release at SIGTERM; keep it below terminationGracePeriodSeconds.
    #[arg(long, env = "REDLOCK_SHUTDOWN_TIMEOUT", value_parser = duration_at_most(MAX_SHUTDOWN_TIMEOUT), default_value = "10s")]
    pub shutdown_timeout: Duration,
    /// Kubernetes integration: auto (on when in a cluster), on, off.
    #[arg(long, env = "REDLOCK_KUBERNETES", default_value = "auto")]
    pub kubernetes: KubeMode,
    /// Pod label set to "true" on the leader and "false" elsewhere.
    #[arg(
        long,
        env = "REDLOCK_LEADER_LABEL",
        default_value = "redlock.io/leader"
    )]
    pub leader_label: String,
    /// Mirror the holder into a coordination.k8s.io Lease named after the lock.
    #[arg(long, env = "REDLOCK_MIRROR_LEASE", default_value_t = false)]
    pub mirror_lease: bool,
    /// The workload this sidecar runs in (e.g. its Deployment), exported as
    /// `redlock_info{workload}`: alerts then see two locks led at once within one workload.
    #[arg(long, env = "REDLOCK_WORKLOAD", default_value = "")]
    pub workload: String,
    /// Split this many shards among the sidecars of the lock, each a lock of its own with its
    /// own fencing token (1 to 16384); the app reads its shards from GET /v1/shards.
    #[arg(long, env = "REDLOCK_SHARDS")]
    pub shards: Option<u32>,
    /// How long a member waits, before it releases a shard, for its app to acknowledge the
    /// `revoking` event (POST /v1/shards/ID/ack); only while the app watches with
    /// /v1/shards/watch?ack=true, and never past the shard's step-down. Default: 5s, or half of
    /// --shutdown-timeout if less.
    #[arg(long, env = "REDLOCK_SHARD_REVOKE_TIMEOUT", value_parser = duration_at_most(MAX_SHUTDOWN_TIMEOUT))]
    pub shard_revoke_timeout: Option<Duration>,
    #[command(flatten)]
    pub locks: LocksArgs,
}

/// Everything `run` needs.
#[derive(Debug)]
pub struct RunConfig {
    pub redlock: RedlockConfig,
    pub renewal: Renewal,
    pub listen: SocketAddr,
    /// `--control-listen`: loopback.
    pub control_listen: SocketAddr,
    pub ready_when: ReadyWhen,
    pub shutdown_timeout: Duration,
    /// How the app's readiness is checked, if it is.
    pub app_check: Option<AppCheck>,
    pub kubernetes: crate::k8s::KubeSettings,
    /// `--workload` (empty: not set).
    pub workload: String,
    /// The request-lock API; `None` with `--locks off`.
    pub locks: Option<LocksConfig>,
    /// `--shards`: how many shards the group splits, and how; `None`: no shards.
    pub shards: Option<ShardsConfig>,
}

/// `--shards` and how the member gives shards up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardsConfig {
    /// How many shards the group splits.
    pub count: u32,
    /// `--shard-revoke-timeout`, given or derived.
    pub revoke_timeout: Duration,
}

/// The default `--shard-revoke-timeout`, when `--shutdown-timeout` leaves room for it.
pub const DEFAULT_SHARD_REVOKE_TIMEOUT: Duration = Duration::from_secs(5);

/// How the app's readiness is checked, and how often.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppCheck {
    pub probe: AppProbe,
    pub interval: Duration,
    pub unready_after: Duration,
}

/// `--app-ready` or `--follow-container`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AppProbe {
    /// An HTTP GET of the app's readiness URL.
    Http(crate::candidacy::probe::AppUrl),
    /// The readiness of a container of this pod, from the pod's status.
    Container(String),
}

impl RunArgs {
    /// Validates everything `run` needs.
    pub fn config(&self) -> Result<RunConfig, ConfigError> {
        let redlock = self.lock.redlock()?;
        let renewal = self.renew.renewal(&redlock)?;
        if self.shutdown_timeout <= 2 * redlock.node_timeout {
            return Err(ConfigError::new(
                "--shutdown-timeout",
                format!(
                    "must exceed twice the node timeout ({}): a release waits for a call still \
                     in flight on a node, then for its own answer",
                    fmt(redlock.node_timeout)
                ),
            ));
        }
        if !is_label_key(&self.leader_label) {
            return Err(ConfigError::new(
                "--leader-label",
                "must be a Kubernetes label key: [DNS-subdomain/]name, the name at most 63 \
                 characters of A-Z a-z 0-9 - _ . starting and ending alphanumeric",
            ));
        }
        if self.workload.len() > 253 || self.workload.chars().any(char::is_control) {
            return Err(ConfigError::new(
                "--workload",
                "must be at most 253 characters without control characters",
            ));
        }
        if !is_loopback(self.control_listen.ip()) {
            return Err(ConfigError::new(
                "--control-listen",
                "must be a loopback address (e.g. 127.0.0.1:9708): its routes change state",
            ));
        }
        // An IPv4-mapped address is its IPv4 address: bound as such, it needs no IPv6 socket
        // (a pod without IPv6 could not open one) and serves the same connections.
        let control_listen = SocketAddr::new(
            self.control_listen.ip().to_canonical(),
            self.control_listen.port(),
        );
        let app_check = self.app_check()?;
        let shards = self.shards(&redlock)?;
        let locks = self.locks.config(&redlock.lock)?;
        if let Some(grpc) = locks.as_ref().and_then(|l| l.dapr_grpc_listen) {
            if [control_listen, self.listen].contains(&grpc) {
                return Err(ConfigError::new(
                    "--dapr-grpc-listen",
                    format!(
                        "{grpc} is already --listen or --control-listen: give it a port of its own"
                    ),
                ));
            }
        }
        let kubernetes = kube_settings(
            self.kubernetes,
            self.leader_label.clone(),
            self.mirror_lease,
            renewal.interval,
        );
        Ok(RunConfig {
            redlock,
            renewal,
            listen: self.listen,
            control_listen,
            ready_when: self.ready_when,
            shutdown_timeout: self.shutdown_timeout,
            app_check,
            kubernetes,
            workload: self.workload.clone(),
            locks,
            shards,
        })
    }

    /// `--shards`, validated against the bound and the lock name's length.
    fn shards(&self, redlock: &RedlockConfig) -> Result<Option<ShardsConfig>, ConfigError> {
        let Some(count) = self.shards else {
            if self.shard_revoke_timeout.is_some() {
                return Err(ConfigError::new(
                    "--shard-revoke-timeout",
                    "needs --shards: only shards are revoked",
                ));
            }
            return Ok(None);
        };
        let max = redlock_core::shards::MAX_SHARDS;
        if count == 0 || count > max {
            return Err(ConfigError::new(
                "--shards",
                format!("must be from 1 to {max} (got {count})"),
            ));
        }
        let longest = crate::shards::view::shard_lock(&redlock.lock, count - 1);
        if longest.len() > 200 {
            return Err(ConfigError::new(
                "--shards",
                format!(
                    "the shard locks' names ({longest}) would pass 200 characters: shorten --lock"
                ),
            ));
        }
        // At shutdown the wait comes before the releases, within --shutdown-timeout.
        let room = self
            .shutdown_timeout
            .saturating_sub(2 * redlock.node_timeout);
        let revoke_timeout = match self.shard_revoke_timeout {
            None => {
                let half = DEFAULT_SHARD_REVOKE_TIMEOUT.min(self.shutdown_timeout / 2);
                if half < room {
                    half
                } else {
                    room / 2
                }
            }
            Some(given) if given >= room => {
                return Err(ConfigError::new(
                    "--shard-revoke-timeout",
                    format!(
                        "must be below --shutdown-timeout less twice the node timeout ({}): \
                         at shutdown the releases follow the wait",
                        fmt(room)
                    ),
                ));
            }
            Some(given) => given,
        };
        Ok(Some(ShardsConfig {
            count,
            revoke_timeout,
        }))
    }

    fn app_check(&self) -> Result<Option<AppCheck>, ConfigError> {
        // An empty value (an unset annotation through the downward API) is no check.
        let follow = self
            .follow_container
            .as_ref()
            .filter(|name| !name.is_empty());
        let probe = match (&self.app_ready, follow) {
            (Some(url), _) => AppProbe::Http(
                crate::candidacy::probe::AppUrl::parse(url)
                    .map_err(|why| ConfigError::new("--app-ready", why))?,
            ),
            (None, Some(name)) if name == "*" || is_dns_label(name) => {
                AppProbe::Container(name.clone())
            }
            (None, Some(_)) => {
                return Err(ConfigError::new(
                    "--follow-container",
                    "must be * or a container name: at most 63 characters of a-z 0-9 -, starting and ending alphanumeric",
                ))
            }
            (None, None) => return Ok(None),
        };
        if self.app_ready_interval < MIN_APP_READY_INTERVAL {
            return Err(ConfigError::new(
                "--app-ready-interval",
                format!("must be at least {}", fmt(MIN_APP_READY_INTERVAL)),
            ));
        }
        if self.app_unready_after < self.app_ready_interval {
            return Err(ConfigError::new(
                "--app-unready-after",
                format!(
                    "must be at least --app-ready-interval ({}): one slow answer must not move the work",
                    fmt(self.app_ready_interval)
                ),
            ));
        }
        Ok(Some(AppCheck {
            probe,
            interval: self.app_ready_interval,
            unready_after: self.app_unready_after,
        }))
    }
}

//! Command line and environment: parsed once here, validated into typed configs.
//!
//! Every flag has an environment variable. Invalid input ends the process with exit
//! code 2 and one line naming the flag and the rule it breaks, before anything connects.
//!
//! ## Behaviour
//! - Every duration has an upper bound, checked as it is parsed (the message names the
//!   bound): `--ttl`, `--max-ttl`, `--renew-interval`, `--safety-margin`, `--kill-grace` at
//!   most [`MAX_TTL`]; `--node-timeout` and `--connect-timeout` at most a minute;
//!   `--retry-delay` at most a minute; `--fence-retention` at most a year;
//!   `--shutdown-timeout` at most an hour; `--wait`, `--min-hold`, `--max-hold`,
//!   `--slot-retention` at most [`MAX_GUARD_DURATION`]. With these, every deadline the
//!   process computes (`now + x`, `x × n`) stays far inside what `Instant` and `Duration` can
//!   represent.
//! - `--slot` is 1 to [`MAX_SLOT_LEN`] bytes without spaces or control characters (it is part
//!   of a Redis key), and `--slot-retention` is at least the ttl + `--min-hold` (and 1 s):
//!   see [`min_slot_retention`].
//! - `--control-listen` is a loopback address (IPv4-mapped `[::ffff:127.0.0.1]` included,
//!   bound as its IPv4 address).
//! - `--renew-interval` (given or the ttl/3 default) is at least [`MIN_RENEW_INTERVAL`], in
//!   `run` and `guard` alike.
//! - Files are read up to a bound (password 64 KiB, PEM 4 MiB): a device never hangs start-up.
//! - `Debug` of every type here shows no password: node URLs print as `host:port`.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::k8s::KubeMode;
use crate::redlock::secrets::SecretFiles;
use crate::redlock::timing::{
    self, MAX_CONNECT_TIMEOUT, MAX_FENCE_RETENTION, MAX_NODE_TIMEOUT, MAX_RETRY_DELAY, MAX_TTL,
};
use crate::redlock::{drift, ConfigError, Credentials, NodeSpec, RedlockConfig};

use crate::exit::EXIT_CODES;

/// `--safety-margin` when the ttl leaves room for it.
const DEFAULT_SAFETY_MARGIN: Duration = Duration::from_secs(1);
/// `--kill-grace` when the ttl leaves room for it.
const DEFAULT_KILL_GRACE: Duration = Duration::from_secs(2);

/// Longest `--wait`, `--min-hold` and `--max-hold`: 30 days. Every deadline `guard` computes is
/// then at most "now + 30 days + a few ttls" (`--ttl` is at most [`MAX_TTL`]), far from the
/// overflow of `Instant` arithmetic.
pub const MAX_GUARD_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);
/// Longest `--shutdown-timeout`: an hour (a release takes at most twice the node timeout).
pub const MAX_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(3600);
/// Longest `--identity`, in bytes (a DNS name's length; pod and host names fit).
pub const MAX_IDENTITY_LEN: usize = 253;

/// Default admin port for `run`.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:9707";
/// Where the routes that change state listen by default: loopback only.
pub const DEFAULT_CONTROL_LISTEN: &str = "127.0.0.1:9708";
/// The longest `--app-ready-interval`, `--app-unready-after` and resign hold.
pub const MAX_APP_WAIT: Duration = Duration::from_secs(3600);
/// The shortest `--app-ready-interval`: a probe every 50 ms is already more than any app needs.
pub const MIN_APP_READY_INTERVAL: Duration = Duration::from_millis(50);

#[derive(Parser, Debug)]
#[command(name = "redlock-sidecar", version, about = "Hold a Redlock (a lock on a quorum of independent Redis masters) for the app next to you, with fencing tokens.", after_help = EXIT_CODES)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Log format.
    #[arg(long, global = true, env = "REDLOCK_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Hold leadership for this pod: renew, serve /leader, /readyz and /metrics, release on SIGTERM.
    Run(RunArgs),
    /// Run CMD only while the lock is held: `redlock-sidecar guard [OPTIONS] -- CMD [ARGS...]`.
    #[command(after_help = EXIT_CODES)]
    Guard(GuardArgs),
    /// Check every Redis node: reachable, latency, version, uptime, persistence, eviction, role.
    Check(CheckArgs),
    /// Show each node's view of a lock: holder, remaining ttl, fencing counter.
    Status(StatusArgs),
    /// Copy this binary into DIR (e.g. a volume shared with a CronJob's container).
    Install(InstallArgs),
    /// Internal: the process between guard and CMD (see the guard module).
    #[command(hide = true)]
    Supervise(SuperviseArgs),
}

/// `supervise` options (started by guard only).
#[derive(Args, Debug)]
pub struct SuperviseArgs {
    /// guard's pid: when this process' parent is no longer it, guard has died.
    #[arg(long)]
    pub parent: i32,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// `install` options.
#[derive(Args, Debug)]
pub struct InstallArgs {
    /// An existing directory; the binary is written to DIR/redlock-sidecar.
    #[arg(value_name = "DIR")]
    pub dir: std::path::PathBuf,
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// When `/readyz` answers 200.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ReadyWhen {
    /// While a quorum of nodes is reachable (rolling updates proceed).
    Quorum,
    /// Only while leading (blocks rolling updates of followers; see docs/reference.md).
    Leader,
}

/// What `guard` does when the lock is held elsewhere after waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnBusy {
    /// Exit 0 without running CMD (what a cron job wants).
    Skip,
    /// Exit 75.
    Fail,
}

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

/// The shortest `--renew-interval`: every renewal runs a script (with an `INFO`) on every
/// node, so 10 ms already costs each node 100 calls a second per holder; a shorter interval
/// would only queue renewals behind a network round trip, not renew any sooner.
pub const MIN_RENEW_INTERVAL: Duration = Duration::from_millis(10);

/// Renewal timing, shared by `run` and `guard`.
#[derive(Args, Debug, Clone)]
pub struct RenewArgs {
    /// How often the held lock is extended, at least 10ms. Default: ttl/3.
    #[arg(long, env = "REDLOCK_RENEW_INTERVAL", value_parser = duration_at_most(MAX_TTL))]
    pub renew_interval: Option<Duration>,
    /// Stop claiming the lock this long before its validity ends. Default: 1s, or midway
    /// between its bounds when 1s does not fit the ttl.
    #[arg(long, env = "REDLOCK_SAFETY_MARGIN", value_parser = duration_at_most(MAX_TTL))]
    pub safety_margin: Option<Duration>,
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
    #[command(flatten)]
    pub locks: LocksArgs,
}

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

#[derive(Args, Debug)]
pub struct GuardArgs {
    #[command(flatten)]
    pub lock: LockArgs,
    #[command(flatten)]
    pub renew: RenewArgs,
    /// How long to wait for the lock; 0 = one attempt.
    #[arg(long, env = "REDLOCK_WAIT", value_parser = duration_at_most(MAX_GUARD_DURATION), default_value = "0")]
    pub wait: Duration,
    /// What to do when the lock is still held elsewhere after --wait.
    #[arg(long, env = "REDLOCK_ON_BUSY", value_enum, default_value_t = OnBusy::Skip)]
    pub on_busy: OnBusy,
    /// Keep the lock at least this long after CMD starts, even if CMD ends sooner.
    #[arg(long, env = "REDLOCK_MIN_HOLD", value_parser = duration_at_most(MAX_GUARD_DURATION), default_value = "0")]
    pub min_hold: Duration,
    /// Stop renewing and stop CMD after this long (exit 124).
    #[arg(long, env = "REDLOCK_MAX_HOLD", value_parser = duration_at_most(MAX_GUARD_DURATION))]
    pub max_hold: Option<Duration>,
    /// Time between SIGTERM and SIGKILL when CMD must be stopped. Default: 2s, or half the
    /// room the ttl leaves when 2s does not fit.
    #[arg(long, env = "REDLOCK_KILL_GRACE", value_parser = duration_at_most(MAX_TTL))]
    pub kill_grace: Option<Duration>,
    /// Serve /healthz, /leader and /metrics here while guard runs (off by default).
    #[arg(long, env = "REDLOCK_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// At exit, write one line here: `outcome=… exit_code=… lock=…` (and `fencing_token=…`).
    #[arg(long, env = "REDLOCK_OUTCOME_FILE")]
    pub outcome_file: Option<PathBuf>,
    /// Kubernetes Events: auto (on when in a cluster), on, off.
    #[arg(long, env = "REDLOCK_KUBERNETES", default_value = "auto")]
    pub kubernetes: KubeMode,
    /// The schedule slot this run is for (e.g. the Job's name, whose suffix a CronJob sets to
    /// the scheduled minute): a run of it that ends with CMD's exit 0 is recorded beside the
    /// lock, and later runs of the same slot skip (exit 0, outcome `already-ran`).
    #[arg(long, env = "REDLOCK_SLOT")]
    pub slot: Option<String>,
    /// How long a slot's record is kept: at least the ttl + --min-hold (and 1s), so that a
    /// run of the same slot waiting for the lock still finds the record when it takes the lock.
    #[arg(long, env = "REDLOCK_SLOT_RETENTION", value_parser = duration_at_most(MAX_GUARD_DURATION), default_value = "24h")]
    pub slot_retention: Duration,
    /// The command and its arguments (after --); run without a shell.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
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

/// Whether `name` is a DNS-1123 label, as container names are.
fn is_dns_label(name: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    (1..=63).contains(&name.len())
        && name.chars().all(|c| alnum(c) || c == '-')
        && name.starts_with(alnum)
        && name.ends_with(alnum)
}

/// Parses `500ms`, `10s`, `2m`, and a bare `0`.
fn parse_duration(text: &str) -> Result<Duration, String> {
    if text.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(text).map_err(|e| format!("{e} (use e.g. 500ms, 10s, 2m)"))
}

/// [`parse_duration`], refusing durations above `max` (the message names the bound).
fn duration_at_most(
    max: Duration,
) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync + 'static {
    move |text| {
        let duration = parse_duration(text)?;
        timing::at_most(duration, max)?;
        Ok(duration)
    }
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

/// Parses the command line; on error prints one line and exits 2 (help and version exit 0).
pub fn parse_or_exit() -> Cli {
    match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) if !err.use_stderr() => {
            let _ = err.print();
            crate::exit::now(crate::exit::OK);
        }
        Err(err) => exit_invalid(&one_line(&err.to_string())),
    }
}

/// Prints `redlock-sidecar: <message>` on one line (see [`invalid_line`]) and exits 2.
pub fn exit_invalid(message: &str) -> ! {
    eprintln!("{}", invalid_line(message));
    crate::exit::now(crate::exit::INVALID)
}

/// The line [`exit_invalid`] prints: control characters a value may carry (a path with a
/// line break) are escaped, so the message stays one line.
pub fn invalid_line(message: &str) -> String {
    let mut line = String::from("redlock-sidecar: ");
    for c in message.chars() {
        if c.is_control() {
            line.extend(c.escape_default());
        } else {
            line.push(c);
        }
    }
    line
}

/// Folds clap's multi-line message into one line without usage boilerplate.
fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .take_while(|line| !line.starts_with("Usage:") && !line.starts_with("For more information"))
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Renewal timing, validated against the ttl.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Renewal {
    /// Time between extends while holding.
    pub interval: Duration,
    /// Step down this long before validity ends.
    pub safety_margin: Duration,
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
}

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

/// Longest `--slot`, in bytes: a Job name (63) with room to spare, and a short key.
pub const MAX_SLOT_LEN: usize = 128;

/// A schedule slot whose successful run is recorded (see `guard::slot`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    /// The slot's name, as given: 1 to [`MAX_SLOT_LEN`] bytes, no spaces or control characters.
    pub id: String,
    /// How long its record is kept.
    pub retention: Duration,
}

/// The shortest `--slot-retention`: a holder records the slot, keeps the lock for `--min-hold`
/// and releases it, or dies and leaves it to expire within a ttl of its last renewal; a run of
/// the same slot waiting for the lock takes it within `min_hold + ttl` of the record, and must
/// still read it then. Never less than [`MIN_SLOT_RETENTION`].
pub fn min_slot_retention(ttl: Duration, min_hold: Duration) -> Duration {
    (ttl + min_hold).max(MIN_SLOT_RETENTION)
}

/// The floor of [`min_slot_retention`], whatever the ttl.
pub const MIN_SLOT_RETENTION: Duration = Duration::from_secs(1);

/// Whether `ip` is a loopback address: 127.0.0.0/8, `::1`, or an IPv4-mapped
/// `::ffff:127.x.y.z`.
pub fn is_loopback(ip: std::net::IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

/// Checks `--slot`: it becomes part of a Redis key and of log lines.
fn slot_id(id: &str) -> Result<String, ConfigError> {
    if id.is_empty()
        || id.len() > MAX_SLOT_LEN
        || id.chars().any(|c| c.is_control() || c.is_whitespace())
    {
        return Err(ConfigError::new(
            "--slot",
            format!("must be 1 to {MAX_SLOT_LEN} bytes without spaces or control characters"),
        ));
    }
    Ok(id.to_owned())
}

/// Everything `guard` needs.
#[derive(Debug)]
pub struct GuardConfig {
    pub redlock: RedlockConfig,
    pub renewal: Renewal,
    pub wait: Duration,
    pub on_busy: OnBusy,
    pub min_hold: Duration,
    pub max_hold: Option<Duration>,
    pub kill_grace: Duration,
    pub listen: Option<SocketAddr>,
    pub command: Vec<String>,
    pub outcome_file: Option<PathBuf>,
    /// `--slot` and `--slot-retention`, when a slot is given.
    pub slot: Option<Slot>,
    /// For Events only: no label, no Lease mirror.
    pub kubernetes: crate::k8s::KubeSettings,
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

impl RenewArgs {
    /// Validates the renewal timing against the engine's ttl and node timeout.
    fn renewal(&self, cfg: &RedlockConfig) -> Result<Renewal, ConfigError> {
        let ttl = cfg.ttl;
        let interval = self.renew_interval.unwrap_or(ttl / 3);
        if interval < MIN_RENEW_INTERVAL {
            return Err(ConfigError::new(
                "--renew-interval",
                format!(
                    "{} is below {} (default: ttl/3)",
                    fmt(interval),
                    fmt(MIN_RENEW_INTERVAL)
                ),
            ));
        }
        if interval >= ttl / 2 {
            return Err(ConfigError::new(
                "--renew-interval",
                format!("must be less than ttl/2 ({})", fmt(ttl / 2)),
            ));
        }
        // The margin must cover a call (node timeout) and drift, and leave the first
        // renewal time to happen before the step-down point.
        let floor = cfg.node_timeout + drift(ttl);
        let room = ttl.saturating_sub(interval + drift(ttl));
        let midway = floor + room.saturating_sub(floor) / 2;
        let safety_margin = self
            .safety_margin
            .unwrap_or(if floor < DEFAULT_SAFETY_MARGIN {
                DEFAULT_SAFETY_MARGIN.min(midway)
            } else {
                midway
            });
        if safety_margin <= floor {
            return Err(ConfigError::new(
                "--safety-margin",
                format!("must exceed node timeout + drift ({})", fmt(floor)),
            ));
        }
        if safety_margin >= room {
            return Err(ConfigError::new(
                "--safety-margin",
                format!("must be less than ttl − renew interval − drift ({}), or no renewal can happen in time", fmt(room)),
            ));
        }
        Ok(Renewal {
            interval,
            safety_margin,
        })
    }
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
        let kubernetes = crate::k8s::KubeSettings {
            mode: self.kubernetes,
            label_key: self.leader_label.clone(),
            mirror_lease: self.mirror_lease,
            pod_name: env_nonempty("POD_NAME"),
            pod_uid: env_nonempty("POD_UID"),
            namespace: env_nonempty("POD_NAMESPACE"),
            renew_interval: renewal.interval,
        };
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
        })
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

impl GuardArgs {
    /// Validates everything `guard` needs.
    pub fn config(&self) -> Result<GuardConfig, ConfigError> {
        let redlock = self.lock.redlock()?;
        let renewal = self.renew.renewal(&redlock)?;
        // CMD gets SIGTERM kill_grace before the step-down point, and that must come
        // after the first renewal had its chance.
        let room = redlock
            .ttl
            .saturating_sub(renewal.interval + drift(redlock.ttl) + renewal.safety_margin);
        let kill_grace = self
            .kill_grace
            .unwrap_or_else(|| DEFAULT_KILL_GRACE.min(room / 2));
        if kill_grace.is_zero() {
            return Err(ConfigError::new("--kill-grace", "must be greater than 0"));
        }
        if kill_grace >= room {
            return Err(ConfigError::new(
                "--kill-grace",
                format!(
                    "must be less than ttl − renew interval − drift − safety margin ({})",
                    fmt(room)
                ),
            ));
        }
        if let Some(max_hold) = self.max_hold {
            if max_hold.is_zero() {
                return Err(ConfigError::new("--max-hold", "must be greater than 0"));
            }
            if self.min_hold > max_hold {
                return Err(ConfigError::new(
                    "--min-hold",
                    format!("must not exceed --max-hold ({})", fmt(max_hold)),
                ));
            }
        }
        let shortest_retention = min_slot_retention(redlock.ttl, self.min_hold);
        if self.slot_retention < shortest_retention {
            return Err(ConfigError::new(
                "--slot-retention",
                format!(
                    "must be at least the ttl + --min-hold, and 1s ({}): the record must \
                     outlive the tenure it was written in, or a run of the same slot waiting \
                     for the lock would not find it",
                    fmt(shortest_retention)
                ),
            ));
        }
        let slot = match &self.slot {
            Some(id) => Some(Slot {
                id: slot_id(id)?,
                retention: self.slot_retention,
            }),
            None => None,
        };
        if self.command.first().is_none_or(|c| c.is_empty()) {
            return Err(ConfigError::new(
                "CMD",
                "a command to run is required after --",
            ));
        }
        Ok(GuardConfig {
            redlock,
            renewal,
            wait: self.wait,
            on_busy: self.on_busy,
            min_hold: self.min_hold,
            max_hold: self.max_hold,
            kill_grace,
            listen: self.listen,
            command: self.command.clone(),
            outcome_file: self.outcome_file.clone(),
            slot,
            kubernetes: crate::k8s::KubeSettings {
                mode: self.kubernetes,
                label_key: String::new(),
                mirror_lease: false,
                pod_name: env_nonempty("POD_NAME"),
                pod_uid: env_nonempty("POD_UID"),
                namespace: env_nonempty("POD_NAMESPACE"),
                renew_interval: renewal.interval,
            },
        })
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

/// A Kubernetes label key: an optional DNS-subdomain prefix and `/`, then a name of at most
/// 63 characters `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`.
fn is_label_key(key: &str) -> bool {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    let alnum = |c: char| c.is_ascii_alphanumeric();
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(alnum)
        && name.ends_with(alnum)
        && name
            .chars()
            .all(|c| alnum(c) || matches!(c, '-' | '_' | '.'));
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|part| {
                let lower = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
                !part.is_empty()
                    && part.len() <= 63
                    && part.starts_with(lower)
                    && part.ends_with(lower)
                    && part.chars().all(|c| lower(c) || c == '-')
            })
    });
    name_ok && prefix_ok
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

fn fmt(d: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(Duration::from_millis(d.as_millis() as u64))
}

fn env_nonempty(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("redlock-sidecar").chain(args.iter().copied()))
    }

    fn run_config(extra: &[&str]) -> Result<RunConfig, ConfigError> {
        let mut args = vec![
            "run",
            "--lock",
            "l",
            "--redis",
            "redis://127.0.0.1:1",
            "--identity",
            "me",
        ];
        args.extend_from_slice(extra);
        match parse(&args).expect("parses").command {
            Command::Run(run) => run.config(),
            _ => unreachable!(),
        }
    }

    #[test]
    fn sentinel_urls_survive_the_comma_split_of_the_node_list() {
        let Command::Check(check) = parse(&[
            "check",
            "--redis",
            "redis+sentinel://:pw@s1,s2:26380,s3/mymaster,redis://h:1,rediss+sentinel://t1,t2/other/2",
        ])
        .unwrap()
        .command
        else {
            unreachable!()
        };
        let nodes = check.redis.nodes().expect("valid");
        let labels: Vec<&str> = nodes.iter().map(|n| n.label()).collect();
        assert_eq!(
            labels,
            [
                "mymaster@s1:26379,s2:26380,s3:26379",
                "h:1",
                "other@t1:26379,t2:26379"
            ]
        );
        assert_eq!(nodes[2].identity().1, 2);
        assert!(!format!("{:?}", check.redis).contains("pw"));
        // The same group, its Sentinels listed in another order, is one node listed twice.
        let err = run_config(&[
            "--redis",
            "redis+sentinel://s2,s1/m,redis+sentinel://s1,s2/m",
        ])
        .unwrap_err();
        assert_eq!(err.flag, "--redis");
        assert!(err.reason.contains("listed twice"), "{err}");
        let err = run_config(&["--redis", "redis+sentinel://s1,s2"]).unwrap_err();
        assert!(
            err.reason.contains("node #2: the master's name is missing"),
            "{err}"
        );
    }

    #[test]
    fn defaults_give_a_valid_timing_model() {
        let cfg = run_config(&[]).expect("valid");
        assert_eq!(cfg.renewal.interval, Duration::from_secs(10) / 3);
        assert_eq!(cfg.listen.port(), 9707);
    }

    fn guard_config(extra: &[&str]) -> Result<GuardConfig, ConfigError> {
        let mut args = vec!["guard", "--lock", "l", "--redis", "redis://127.0.0.1:1"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "true"]);
        match parse(&args).expect("parses").command {
            Command::Guard(guard) => guard.config(),
            _ => unreachable!(),
        }
    }

    #[test]
    fn any_valid_ttl_alone_gives_valid_run_and_guard_configs() {
        let smallest = 217;
        let mut ttls: Vec<u64> = (smallest..5_000).step_by(7).collect();
        ttls.extend([10_000, 60_000, 3_600_000]);
        for ms in ttls {
            let ttl = format!("{ms}ms");
            let run = run_config(&["--ttl", &ttl]).unwrap_or_else(|e| panic!("run {ttl}: {e}"));
            let guard =
                guard_config(&["--ttl", &ttl]).unwrap_or_else(|e| panic!("guard {ttl}: {e}"));
            assert_eq!(run.renewal, guard.renewal);
        }
        let err = guard_config(&["--ttl", &format!("{}ms", smallest - 1)]).unwrap_err();
        assert_eq!(err.flag, "--ttl");
    }

    #[test]
    fn derived_defaults_keep_the_documented_values_where_they_fit() {
        let cfg = guard_config(&[]).expect("valid");
        assert_eq!(cfg.renewal.safety_margin, Duration::from_secs(1));
        assert_eq!(cfg.kill_grace, Duration::from_secs(2));
        // ttl 2s: floor 72 ms, room 1311 ms → margin midway (691 ms); kill grace half the 619 ms left.
        let cfg = guard_config(&["--ttl", "2s"]).expect("valid");
        assert_eq!(cfg.renewal.safety_margin.as_millis(), 691);
        assert_eq!(cfg.kill_grace.as_millis(), 309);
        let err = guard_config(&["--ttl", "2s", "--kill-grace", "2s"]).unwrap_err();
        assert_eq!(err.flag, "--kill-grace");
    }

    #[test]
    fn renew_interval_must_be_under_half_the_ttl() {
        let err = run_config(&["--renew-interval", "5s"]).unwrap_err();
        assert_eq!(err.flag, "--renew-interval");
    }

    #[test]
    fn renew_interval_has_a_floor_in_run_and_guard() {
        for interval in ["1ns", "9ms", "0"] {
            let run = run_config(&["--renew-interval", interval]).unwrap_err();
            let guard = guard_config(&["--renew-interval", interval]).unwrap_err();
            for err in [run, guard] {
                assert_eq!(err.flag, "--renew-interval");
                assert!(err.reason.contains("below 10ms"), "{err}");
            }
        }
        let cfg = guard_config(&["--ttl", "1s", "--renew-interval", "10ms"]).expect("valid");
        assert_eq!(cfg.renewal.interval, MIN_RENEW_INTERVAL);
    }

    #[test]
    fn a_lock_name_may_hold_braces_but_not_start_with_a_closing_one() {
        let status = |lock: &str| {
            let args = ["status", "--lock", lock, "--redis", "redis://127.0.0.1:1"];
            match parse(&args).expect("parses").command {
                Command::Status(status) => status.config(),
                _ => unreachable!(),
            }
        };
        let err = status("}x").unwrap_err();
        assert_eq!(err.flag, "--lock");
        assert!(err.reason.contains("hash tag"), "{err}");
        for lock in ["a}b", "a{b}", "{x}", "x{"] {
            status(lock).unwrap_or_else(|e| panic!("{lock}: {e}"));
        }
    }

    #[test]
    fn safety_margin_must_exceed_node_timeout_and_drift() {
        let err = run_config(&["--safety-margin", "100ms"]).unwrap_err();
        assert_eq!(err.flag, "--safety-margin");
        assert!(err.reason.contains("node timeout + drift"), "{err}");
    }

    #[test]
    fn duplicate_nodes_are_refused() {
        let err = run_config(&["--redis", "redis://127.0.0.1:1"]).unwrap_err();
        assert_eq!(err.flag, "--redis");
        assert!(err.reason.contains("listed twice"), "{err}");
    }

    #[test]
    fn a_bad_url_error_never_shows_the_url() {
        let err = run_config(&["--redis", "http://user:hunter2@host"]).unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
        assert!(err.reason.contains("node #2"), "{err}");
    }

    #[test]
    fn clap_errors_fold_into_one_line_naming_the_flag() {
        let err = parse(&[
            "run",
            "--lock",
            "l",
            "--redis",
            "redis://h",
            "--ttl",
            "soon",
        ])
        .unwrap_err();
        let line = one_line(&err.to_string());
        assert!(!line.contains('\n'));
        assert!(line.contains("--ttl"), "{line}");
    }

    #[test]
    fn every_duration_flag_names_its_bound() {
        let cases: &[(&str, &str, &str)] = &[
            ("--ttl", "61m", "1h"),
            ("--max-ttl", "2h", "1h"),
            ("--node-timeout", "61s", "1m"),
            ("--connect-timeout", "18446744073709551615s", "1m"),
            ("--retry-delay", "2m", "1m"),
            ("--fence-retention", "366d", "1year"),
            ("--fence-retention", "1y 1s", "1year"),
            ("--renew-interval", "2h", "1h"),
            ("--safety-margin", "2h", "1h"),
            ("--shutdown-timeout", "2h", "1h"),
        ];
        for (flag, value, bound) in cases {
            let err = parse(&["run", "--lock", "l", "--redis", "redis://h", flag, value])
                .expect_err(flag);
            let line = one_line(&err.to_string());
            assert!(line.contains(flag), "{line}");
            assert!(line.contains(&format!("must be at most {bound}")), "{line}");
        }
        for flag in [
            "--wait",
            "--min-hold",
            "--max-hold",
            "--kill-grace",
            "--slot-retention",
        ] {
            let args = ["guard", "--lock", "l", "--redis", "redis://h", flag, "31d"];
            let err = parse(&[&args[..], &["--", "true"]].concat()).expect_err(flag);
            let line = one_line(&err.to_string());
            assert!(
                line.contains(flag) && line.contains("must be at most"),
                "{line}"
            );
        }
        // At the bound itself: accepted.
        let cfg = guard_config(&["--ttl", "1h", "--max-ttl", "1h", "--wait", "30d"]).unwrap();
        assert_eq!(cfg.redlock.ttl, MAX_TTL);
        assert_eq!(cfg.wait, MAX_GUARD_DURATION);
    }

    #[test]
    fn a_slot_is_short_printable_text_kept_for_a_bounded_time() {
        let cfg = guard_config(&["--slot", "nightly-29412345"]).unwrap();
        let slot = cfg.slot.expect("a slot");
        assert_eq!(slot.id, "nightly-29412345");
        assert_eq!(slot.retention, Duration::from_secs(24 * 3600));
        assert_eq!(guard_config(&[]).unwrap().slot, None);
        let longest = "x".repeat(MAX_SLOT_LEN);
        assert!(guard_config(&["--slot", &longest]).is_ok());
        for bad in ["", "a b", "a\tb", "a\nb", &"x".repeat(MAX_SLOT_LEN + 1)] {
            let err = guard_config(&["--slot", bad]).unwrap_err();
            assert_eq!(err.flag, "--slot", "{bad:?}");
        }
        let err = guard_config(&["--slot", "s", "--slot-retention", "0"]).unwrap_err();
        assert_eq!(err.flag, "--slot-retention");
        let cfg = guard_config(&["--slot", "s", "--slot-retention", "30d"]).unwrap();
        assert_eq!(cfg.slot.unwrap().retention, MAX_GUARD_DURATION);
    }

    #[test]
    fn a_slot_record_outlives_the_tenure_it_was_written_in() {
        // The default ttl is 10s: the record must outlive it, and --min-hold on top.
        for (retention, min_hold, ok) in [
            ("1ms", "0", false),
            ("9s", "0", false),
            ("10s", "0", true),
            ("39s", "30s", false),
            ("40s", "30s", true),
        ] {
            let args = ["--slot", "s", "--slot-retention", retention];
            let result = guard_config(&[&args[..], &["--min-hold", min_hold]].concat());
            match result {
                Ok(cfg) => assert!(ok, "{retention} with --min-hold {min_hold}: {cfg:?}"),
                Err(err) => {
                    assert!(!ok, "{retention} with --min-hold {min_hold}: {err}");
                    assert_eq!(err.flag, "--slot-retention");
                    assert!(err.to_string().contains("at least"), "{err}");
                }
            }
        }
        // A short ttl still keeps the record a second.
        assert_eq!(
            min_slot_retention(Duration::from_millis(100), Duration::ZERO),
            MIN_SLOT_RETENTION
        );
    }

    #[test]
    fn loopback_means_127_0_0_0_8_and_the_ipv6_loopback_mapped_or_not() {
        for good in [
            "127.0.0.1",
            "127.1.2.3",
            "::1",
            "::ffff:127.0.0.1",
            "::ffff:127.9.9.9",
        ] {
            assert!(is_loopback(good.parse().unwrap()), "{good}");
        }
        for bad in [
            "0.0.0.0",
            "10.0.0.1",
            "::",
            "::ffff:10.0.0.1",
            "::2",
            "fe80::1",
        ] {
            assert!(!is_loopback(bad.parse().unwrap()), "{bad}");
        }
        // A mapped address is bound as its IPv4 address.
        let cfg = run_config(&["--control-listen", "[::ffff:127.0.0.1]:9708"]).unwrap();
        assert_eq!(cfg.control_listen, "127.0.0.1:9708".parse().unwrap());
        let cfg = run_config(&["--control-listen", "[::1]:9708"]).unwrap();
        assert_eq!(cfg.control_listen, "[::1]:9708".parse().unwrap());
        let err = run_config(&["--control-listen", "[::ffff:10.0.0.1]:9708"]).unwrap_err();
        assert_eq!(err.flag, "--control-listen");
    }

    #[test]
    fn dapr_grpc_is_off_unless_given_and_then_on_a_loopback_port_of_its_own() {
        let grpc = |args: &[&str]| {
            run_config(args).map(|cfg| cfg.locks.and_then(|locks| locks.dapr_grpc_listen))
        };
        assert_eq!(grpc(&[]).unwrap(), None);
        assert_eq!(grpc(&["--dapr-grpc-listen", ""]).unwrap(), None);
        assert_eq!(grpc(&["--dapr-grpc-listen", "off"]).unwrap(), None);
        assert_eq!(
            grpc(&["--dapr-grpc-listen", "off", "--locks", "off"]).unwrap(),
            None
        );
        for (given, bound) in [
            ("127.0.0.1:50001", "127.0.0.1:50001"),
            ("[::1]:50001", "[::1]:50001"),
            ("[::ffff:127.0.0.1]:50001", "127.0.0.1:50001"),
        ] {
            assert_eq!(
                grpc(&["--dapr-grpc-listen", given]).unwrap(),
                Some(bound.parse().unwrap())
            );
        }
        for bad in [
            &["--dapr-grpc-listen", "0.0.0.0:50001"][..],
            &["--dapr-grpc-listen", "10.0.0.1:50001"],
            &["--dapr-grpc-listen", "[::ffff:10.0.0.1]:50001"],
            &["--dapr-grpc-listen", "127.0.0.1:9708"],
            &["--dapr-grpc-listen", "127.0.0.1:50001", "--locks", "off"],
            &["--dapr-grpc-listen", "localhost:50001"],
            &["--dapr-grpc-listen", "50001"],
        ] {
            assert_eq!(grpc(bad).unwrap_err().flag, "--dapr-grpc-listen", "{bad:?}");
        }
    }

    #[test]
    fn leader_label_must_be_a_kubernetes_label_key() {
        for good in ["redlock.io/leader", "leader", "a", "x.y-z/A_b.c-9", "L1"] {
            assert!(is_label_key(good), "{good}");
        }
        let long_name = "a".repeat(64);
        for bad in [
            "",
            "/x",
            "x/",
            "é",
            "a b",
            "-a",
            "a-",
            "Redlock.io/leader",
            "a..b/c",
            "a/b/c",
            long_name.as_str(),
        ] {
            assert!(!is_label_key(bad), "{bad:?}");
        }
        let err = run_config(&["--leader-label", "not a label"]).unwrap_err();
        assert_eq!(err.flag, "--leader-label");
    }

    #[test]
    fn a_file_that_never_ends_is_refused_not_read_forever() {
        let err = run_config(&["--redis-password-file", "/dev/zero"]).unwrap_err();
        assert_eq!(err.flag, "--redis-password-file");
        assert!(err.reason.contains("larger than"), "{err}");
        let err = run_config(&["--redis-ca-file", "/dev/zero"]).unwrap_err();
        assert_eq!(err.flag, "--redis-ca-file");
    }

    #[test]
    fn an_error_line_stays_one_line_whatever_the_value_holds() {
        let err = run_config(&["--redis-password-file", "/nonexistent/a\nb\r"]).unwrap_err();
        assert!(
            err.to_string().contains('\n'),
            "the raw message has the path's line break"
        );
        let line = invalid_line(&err.to_string());
        assert_eq!(line.lines().count(), 1, "{line}");
        assert!(
            line.starts_with("redlock-sidecar: --redis-password-file: "),
            "{line}"
        );
    }

    /// Each public config type, formatted with `{:?}`, from flags carrying passwords in a node
    /// URL and as `--redis-password`, and from `--redis-password-file`: no password shows.
    #[test]
    fn debug_output_never_shows_a_password() {
        const IN_URL: &str = "UrlSecret-4711";
        const IN_FLAG: &str = "FlagSecret-4712";
        const IN_FILE: &str = "FileSecret-4713";
        let url = format!(
            "redis://user:{IN_URL}@127.0.0.1:1,redis://127.0.0.1:2,\
             redis+sentinel://user:{IN_URL}@127.0.0.1:3,127.0.0.1:4/m"
        );
        let file = std::env::temp_dir().join(format!("redlock-debug-test-{}", std::process::id()));
        std::fs::write(&file, format!("{IN_FILE}\n")).unwrap();
        let file = file.to_str().unwrap().to_owned();
        let mut printed = Vec::new();
        for secret_flags in [
            ["--redis-password", IN_FLAG],
            ["--redis-password-file", file.as_str()],
            ["--sentinel-password", IN_FLAG],
            ["--sentinel-password-file", file.as_str()],
        ] {
            let lock = ["--lock", "l", "--identity", "me", "--redis", url.as_str()];
            let args = |cmd: &'static str| {
                let mut args = vec![cmd];
                args.extend(lock);
                args.extend(secret_flags);
                args
            };
            let cli = parse(&args("run")).unwrap();
            printed.push(format!("{cli:?}"));
            let Command::Run(run) = cli.command else {
                unreachable!()
            };
            printed.push(format!("{run:?} {:?} {:?}", run.lock, run.lock.redis));
            let cfg = run.config().unwrap();
            printed.push(format!("{cfg:?} {:?} {:?}", cfg.redlock, cfg.redlock.nodes));

            let mut guard = args("guard");
            guard.extend(["--", "true"]);
            let Command::Guard(guard) = parse(&guard).unwrap().command else {
                unreachable!()
            };
            printed.push(format!("{guard:?} {:?}", guard.config().unwrap()));

            let Command::Status(status) = parse(&args("status")).unwrap().command else {
                unreachable!()
            };
            printed.push(format!("{status:?} {:?}", status.config().unwrap()));

            let check = ["check", "--redis", url.as_str()];
            let Command::Check(check) = parse(&[&check[..], &secret_flags[..]].concat())
                .unwrap()
                .command
            else {
                unreachable!()
            };
            printed.push(format!("{check:?} {:?}", check.config().unwrap()));
            let creds = Credentials {
                password: check.redis.redis_password.clone().or(Some(IN_FILE.into())),
                ..Credentials::default()
            };
            printed.push(format!("{creds:?} {:?}", check.redis));
        }
        std::fs::remove_file(&file).ok();
        for text in &printed {
            for secret in [IN_URL, IN_FLAG, IN_FILE] {
                assert!(!text.contains(secret), "{secret} shows in {text}");
            }
            assert!(text.contains("127.0.0.1:1"), "the nodes still show: {text}");
        }
        assert!(printed.iter().any(|t| t.contains("<redacted>")));
    }

    /// Values a user (or a fuzzer) may put after any flag.
    fn any_value() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let units = prop::sample::select(vec![
            "", "ns", "us", "ms", "s", "sec", "m", "min", "h", "d", "days", "w", "M", "y", "x",
        ]);
        prop_oneof![
            // Durations of every size and unit, in and far out of bounds.
            (any::<u64>(), units.clone()).prop_map(|(n, u)| format!("{n}{u}")),
            (0u64..5_000, units.clone()).prop_map(|(n, u)| format!("{n}{u}")),
            (0u64..100, units.clone(), 0u64..1000, units)
                .prop_map(|(a, u, b, v)| format!("{a}{u} {b}{v}")),
            prop::sample::select(vec![
                "18446744073709551615s",
                "18446744073709551616s",
                "18446744073709551615ns",
                "99999999999999999999999999h",
                "9223372036854775807s",
                "-1s",
                "-0",
                "0",
                "",
                " ",
                "1e9s",
                "0x10s",
                "1.5s",
                "NaN",
                "inf",
                "∞s",
                "１０s",
                "10s\n",
                "\u{0}",
                "redis://127.0.0.1:1",
                "redis://:pw@127.0.0.1:2",
                "rediss://h:6380/0",
                "a/b",
                "auto",
                "on",
                "off",
                "quorum",
                "leader",
                "skip",
                "fail",
                "json",
                "text",
                "127.0.0.1:0",
                "[::1]:65535",
                "0.0.0.0:65536",
                "--",
                "-",
                "--ttl",
            ])
            .prop_map(str::to_owned),
            "-?[0-9]{1,30}",
            "[a-z0-9:/@.,_ -]{0,40}",
            "rediss?(\\+sentinel)?://[a-z0-9:/@.,\\[\\]_-]{0,40}",
            any::<String>(),
        ]
    }

    const LOCK_FLAGS: &[&str] = &[
        "--lock",
        "--ttl",
        "--max-ttl",
        "--fence-retention",
        "--retry-delay",
        "--identity",
        "--redis",
        "--redis-username",
        "--redis-password",
        "--redis-password-file",
        "--sentinel-username",
        "--sentinel-password",
        "--sentinel-password-file",
        "--redis-ca-file",
        "--redis-client-cert",
        "--redis-client-key",
        "--node-timeout",
        "--connect-timeout",
        "--allow-evicting-nodes",
        "--keyspace-events",
        "--log-format",
    ];
    const RENEW_FLAGS: &[&str] = &["--renew-interval", "--safety-margin"];
    const RUN_FLAGS: &[&str] = &[
        "--listen",
        "--ready-when",
        "--shutdown-timeout",
        "--kubernetes",
        "--leader-label",
        "--mirror-lease",
    ];
    const GUARD_FLAGS: &[&str] = &[
        "--wait",
        "--on-busy",
        "--min-hold",
        "--max-hold",
        "--kill-grace",
        "--listen",
        "--outcome-file",
        "--kubernetes",
        "--slot",
        "--slot-retention",
    ];
    const CHECK_FLAGS: &[&str] = &[
        "--redis",
        "--redis-username",
        "--redis-password",
        "--redis-password-file",
        "--sentinel-username",
        "--sentinel-password",
        "--sentinel-password-file",
        "--node-timeout",
        "--connect-timeout",
        "--allow-evicting-nodes",
        "--keyspace-events",
        "--ttl",
        "--log-format",
    ];

    /// The flags of `command`.
    fn flags_of(command: &str) -> Vec<&'static str> {
        match command {
            "run" => [LOCK_FLAGS, RENEW_FLAGS, RUN_FLAGS].concat(),
            "guard" => [LOCK_FLAGS, RENEW_FLAGS, GUARD_FLAGS].concat(),
            "check" => CHECK_FLAGS.to_vec(),
            _ => LOCK_FLAGS.to_vec(),
        }
    }

    /// A command line: one subcommand, maybe its required flags, then flags with arbitrary
    /// values (as `--flag value`, `--flag=value`, or the flag alone), maybe a CMD.
    fn any_command_line() -> impl proptest::strategy::Strategy<Value = Vec<String>> {
        use proptest::prelude::*;
        let command = prop::sample::select(vec!["run", "guard", "check", "status"]);
        command.prop_flat_map(|command| {
            let flags = flags_of(command);
            let pair = (prop::sample::select(flags), any_value(), 0u8..4);
            (
                any::<bool>(),
                prop::collection::vec(pair, 1..5),
                any::<bool>(),
            )
                .prop_map(move |(base, pairs, cmd)| {
                    let mut args = vec![command.to_owned()];
                    if base {
                        args.extend(["--redis", "redis://127.0.0.1:1"].map(String::from));
                        if command != "check" {
                            args.extend(["--lock", "l"].map(String::from));
                        }
                    }
                    for (flag, value, form) in pairs {
                        match form {
                            0 => args.push(format!("{flag}={value}")),
                            1 => args.push(flag.to_owned()),
                            _ => args.extend([flag.to_owned(), value]),
                        }
                    }
                    if command == "guard" && cmd {
                        args.extend(["--", "true"].map(String::from));
                    }
                    args
                })
        })
    }

    /// What `main` does before anything starts: parse, then validate the chosen command.
    /// `Ok(true)` for a valid config; `Err(line)` with the line it prints before exit 2.
    fn validate_like_main(args: &[String]) -> Result<bool, String> {
        let cli = Cli::try_parse_from(
            std::iter::once("redlock-sidecar".to_owned()).chain(args.iter().cloned()),
        );
        let cli = match cli {
            Ok(cli) => cli,
            Err(err) if !err.use_stderr() => return Ok(false), // --help, --version: exit 0
            Err(err) => return Err(invalid_line(&one_line(&err.to_string()))),
        };
        let checked = match &cli.command {
            Command::Run(run) => run
                .config()
                .map(|cfg| assert_deadlines_fit(&cfg.redlock, &[cfg.shutdown_timeout])),
            Command::Guard(guard) => guard.config().map(|cfg| {
                let holds = [
                    cfg.wait,
                    cfg.min_hold,
                    cfg.max_hold.unwrap_or_default(),
                    cfg.kill_grace,
                ];
                assert_deadlines_fit(&cfg.redlock, &holds)
            }),
            Command::Check(check) => check.config().map(|cfg| assert_deadlines_fit(&cfg, &[])),
            Command::Status(status) => status.config().map(|cfg| assert_deadlines_fit(&cfg, &[])),
            _ => unreachable!("only run, guard, check and status are generated"),
        };
        checked
            .map(|()| true)
            .map_err(|err| invalid_line(&err.to_string()))
    }

    /// Every duration of a valid config, summed as deadlines would sum them (several ttls,
    /// timeouts, waits and holds at once), stays far from what an `Instant` can hold.
    fn assert_deadlines_fit(cfg: &RedlockConfig, more: &[Duration]) {
        let parts = [
            cfg.longest_ttl() * 4,
            cfg.node_timeout * 4,
            cfg.connect_timeout * 4,
            cfg.retry_delay * 4,
            cfg.retry_max * 4,
            cfg.fence_retention,
        ];
        let total: Duration = parts.iter().chain(more).sum();
        let century = Duration::from_secs(100 * 365 * 24 * 3600);
        assert!(total < century / 10, "{total:?} from {cfg:?} and {more:?}");
        assert!(std::time::Instant::now().checked_add(century).is_some());
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config {
            cases: 2000,
            failure_persistence: None,
            ..proptest::test_runner::Config::default()
        })]

        /// No command line panics: it parses and validates, or it fails with one line.
        #[test]
        fn any_command_line_is_valid_or_refused_in_one_line(args in any_command_line()) {
            match validate_like_main(&args) {
                Ok(_) => {}
                Err(line) => {
                    proptest::prop_assert_eq!(line.lines().count(), 1, "{:?}: {}", args, line);
                    proptest::prop_assert!(line.len() > "redlock-sidecar: ".len(), "{:?}", args);
                }
            }
        }

        /// A value out of bounds, or not a duration, is refused naming the flag.
        #[test]
        fn a_bad_duration_names_its_flag(
            flag in prop::sample::select(vec![
                "--ttl", "--max-ttl", "--fence-retention", "--retry-delay", "--node-timeout",
                "--connect-timeout", "--renew-interval", "--safety-margin", "--wait",
                "--min-hold", "--max-hold", "--kill-grace",
            ]),
            value in any_value(),
        ) {
            let mut args: Vec<String> = ["guard", "--lock", "l", "--redis", "redis://127.0.0.1:1"]
                .map(String::from)
                .to_vec();
            // `--flag=value`: a value starting with `-` is still this flag's value.
            args.extend([format!("{flag}={value}"), "--".into(), "true".into()]);
            if parse_duration(&value).is_err() {
                let line = validate_like_main(&args).expect_err("refused");
                proptest::prop_assert!(line.contains(flag), "{}", line);
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config {
            cases: 200,
            failure_persistence: None,
            ..proptest::test_runner::Config::default()
        })]

        /// Any renew interval below the floor is refused by `run` and `guard` alike, naming
        /// the flag; any at or above it that fits the ttl is taken as given.
        #[test]
        fn the_renew_interval_floor_holds_for_any_value(nanos in 0u64..40_000_000) {
            let interval = format!("{nanos}ns");
            let ttl = ["--ttl", "1s", "--renew-interval", interval.as_str()];
            for verdict in [
                run_config(&ttl).map(|cfg| cfg.renewal.interval),
                guard_config(&ttl).map(|cfg| cfg.renewal.interval),
            ] {
                match verdict {
                    Ok(got) => {
                        proptest::prop_assert!(got >= MIN_RENEW_INTERVAL);
                        proptest::prop_assert_eq!(got, Duration::from_nanos(nanos));
                    }
                    Err(err) => {
                        proptest::prop_assert!(Duration::from_nanos(nanos) < MIN_RENEW_INTERVAL);
                        proptest::prop_assert_eq!(err.flag, "--renew-interval");
                    }
                }
            }
        }
    }

    use proptest::prelude::prop;

    #[test]
    fn zero_parses_as_a_duration() {
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
    }
}

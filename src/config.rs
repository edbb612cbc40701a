//! Command line and environment: parsed once here, validated into typed configs.
//!
//! Every flag has an environment variable. Invalid input ends the process with exit
//! code 2 and one line naming the flag and the rule it breaks, before anything connects.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::k8s::KubeMode;
use crate::redlock::{drift, ClientCert, ConfigError, Credentials, NodeSpec, RedlockConfig};

/// Exit codes, shared by `--help` and README.
pub const EXIT_CODES: &str = "\
Exit codes:
  0    success (guard: CMD exited 0, or the lock was busy with --on-busy skip)
  2    invalid options or configuration
  69   Redis quorum unreachable
  71   no random source (getrandom denied and no /dev/urandom)
  74   install: the copy failed
  75   lock busy (guard with --on-busy fail)
  76   lock lost while CMD ran (guard stopped CMD before the lock could expire)
  124  --max-hold reached (guard stopped CMD)
  126  CMD could not be executed; 127 CMD not found
  N    guard: CMD's own exit code; 128+S if CMD was killed by signal S
       (or guard got signal S before CMD started)";

/// `--safety-margin` when the ttl leaves room for it.
const DEFAULT_SAFETY_MARGIN: Duration = Duration::from_secs(1);
/// `--kill-grace` when the ttl leaves room for it.
const DEFAULT_KILL_GRACE: Duration = Duration::from_secs(2);

/// Default admin port for `run`.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:9707";

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
    /// Only while leading (blocks rolling updates of followers; see README).
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

/// How to reach the Redis nodes.
#[derive(Args, Debug, Clone)]
pub struct RedisArgs {
    /// Redis master URL (redis:// or rediss://), repeat for each node; N = 1, 3, 5, ...
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
    /// Unlike the environment variable, it is not inherited by guard's CMD.
    #[arg(
        long,
        env = "REDLOCK_REDIS_PASSWORD_FILE",
        conflicts_with = "redis_password"
    )]
    pub redis_password_file: Option<PathBuf>,
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
    #[arg(long, env = "REDLOCK_NODE_TIMEOUT", value_parser = parse_duration, default_value = "50ms")]
    pub node_timeout: Duration,
    /// Bound on connecting to a node (TCP, TLS, AUTH).
    #[arg(long, env = "REDLOCK_CONNECT_TIMEOUT", value_parser = parse_duration, default_value = "1s")]
    pub connect_timeout: Duration,
    /// Count the votes of nodes whose maxmemory-policy may evict lock keys. UNSAFE: an
    /// evicted key lets a second holder in; use only if memory can never run out.
    #[arg(long, env = "REDLOCK_ALLOW_EVICTING_NODES")]
    pub allow_evicting_nodes: bool,
}

/// The lock and its timing, shared by `run`, `guard` and `status`.
#[derive(Args, Debug, Clone)]
pub struct LockArgs {
    /// Lock name; all contenders for the same work use the same name.
    #[arg(long, env = "REDLOCK_LOCK")]
    pub lock: String,
    /// How long the lock lives on a node without renewal.
    #[arg(long, env = "REDLOCK_TTL", value_parser = parse_duration, default_value = "10s")]
    pub ttl: Duration,
    /// The longest ttl any contender of this lock uses, if ttls differ. Default: --ttl.
    /// Contenders also learn it from the nodes; this covers nodes that lost it.
    #[arg(long, env = "REDLOCK_MAX_TTL", value_parser = parse_duration)]
    pub max_ttl: Option<Duration>,
    /// How long a lock's fencing counter stays on the nodes after its last use.
    #[arg(long, env = "REDLOCK_FENCE_RETENTION", value_parser = parse_duration, default_value = "24h")]
    pub fence_retention: Duration,
    /// First delay before retrying a failed attempt (random, growing up to 1s).
    #[arg(long, env = "REDLOCK_RETRY_DELAY", value_parser = parse_duration, default_value = "200ms")]
    pub retry_delay: Duration,
    /// Who we are (written into the lock value). Default: $POD_NAME, then the host name.
    #[arg(long, env = "REDLOCK_IDENTITY")]
    pub identity: Option<String>,
    #[command(flatten)]
    pub redis: RedisArgs,
}

/// Renewal timing, shared by `run` and `guard`.
#[derive(Args, Debug, Clone)]
pub struct RenewArgs {
    /// How often the held lock is extended. Default: ttl/3.
    #[arg(long, env = "REDLOCK_RENEW_INTERVAL", value_parser = parse_duration)]
    pub renew_interval: Option<Duration>,
    /// Stop claiming the lock this long before its validity ends. Default: 1s, or midway
    /// between its bounds when 1s does not fit the ttl.
    #[arg(long, env = "REDLOCK_SAFETY_MARGIN", value_parser = parse_duration)]
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
    /// Bound on the graceful release at SIGTERM; keep it below terminationGracePeriodSeconds.
    #[arg(long, env = "REDLOCK_SHUTDOWN_TIMEOUT", value_parser = parse_duration, default_value = "10s")]
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
}

#[derive(Args, Debug)]
pub struct GuardArgs {
    #[command(flatten)]
    pub lock: LockArgs,
    #[command(flatten)]
    pub renew: RenewArgs,
    /// How long to wait for the lock; 0 = one attempt.
    #[arg(long, env = "REDLOCK_WAIT", value_parser = parse_duration, default_value = "0")]
    pub wait: Duration,
    /// What to do when the lock is still held elsewhere after --wait.
    #[arg(long, env = "REDLOCK_ON_BUSY", value_enum, default_value_t = OnBusy::Skip)]
    pub on_busy: OnBusy,
    /// Keep the lock at least this long after CMD starts, even if CMD ends sooner.
    #[arg(long, env = "REDLOCK_MIN_HOLD", value_parser = parse_duration, default_value = "0")]
    pub min_hold: Duration,
    /// Stop renewing and stop CMD after this long (exit 124).
    #[arg(long, env = "REDLOCK_MAX_HOLD", value_parser = parse_duration)]
    pub max_hold: Option<Duration>,
    /// Time between SIGTERM and SIGKILL when CMD must be stopped. Default: 2s, or half the
    /// room the ttl leaves when 2s does not fit.
    #[arg(long, env = "REDLOCK_KILL_GRACE", value_parser = parse_duration)]
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
    #[arg(long, env = "REDLOCK_TTL", value_parser = parse_duration, default_value = "10s")]
    pub ttl: Duration,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub lock: LockArgs,
}

/// Parses `500ms`, `10s`, `2m`, and a bare `0`.
fn parse_duration(text: &str) -> Result<Duration, String> {
    if text.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(text).map_err(|e| format!("{e} (use e.g. 500ms, 10s, 2m)"))
}

/// Parses the command line; on error prints one line and exits 2 (help and version exit 0).
pub fn parse_or_exit() -> Cli {
    match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) if !err.use_stderr() => {
            let _ = err.print();
            std::process::exit(0);
        }
        Err(err) => exit_invalid(&one_line(&err.to_string())),
    }
}

/// Prints `redlock-sidecar: <message>` and exits 2.
pub fn exit_invalid(message: &str) -> ! {
    eprintln!("redlock-sidecar: {message}");
    std::process::exit(2)
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
    pub ready_when: ReadyWhen,
    pub shutdown_timeout: Duration,
    pub kubernetes: crate::k8s::KubeSettings,
    /// `--workload` (empty: not set).
    pub workload: String,
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
        let mut cfg = RedlockConfig::new(self.lock.clone(), identity, nodes);
        cfg.ttl = self.ttl;
        cfg.max_ttl = self.max_ttl;
        cfg.fence_retention = self.fence_retention;
        cfg.allow_evicting_nodes = self.redis.allow_evicting_nodes;
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
        let ca_pem = read_pem("--redis-ca-file", self.redis_ca_file.as_ref())?;
        let client_cert = match (&self.redis_client_cert, &self.redis_client_key) {
            (Some(cert), Some(key)) => Some(ClientCert {
                cert_pem: std::fs::read(cert)
                    .map_err(|e| unreadable("--redis-client-cert", cert, e))?,
                key_pem: std::fs::read(key)
                    .map_err(|e| unreadable("--redis-client-key", key, e))?,
            }),
            _ => None,
        };
        let password = match &self.redis_password_file {
            Some(path) => Some(read_password(path)?),
            None => self.redis_password.clone(),
        };
        let creds = Credentials {
            username: self.redis_username.clone(),
            password,
            ca_pem,
            client_cert,
        };
        let urls: Vec<&str> = self
            .redis
            .iter()
            .map(|u| u.trim())
            .filter(|u| !u.is_empty())
            .collect();
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
        if interval.is_zero() || interval >= ttl / 2 {
            return Err(ConfigError::new(
                "--renew-interval",
                format!(
                    "must be greater than 0 and less than ttl/2 ({})",
                    fmt(ttl / 2)
                ),
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
        if self.leader_label.is_empty() || self.leader_label.len() > 316 {
            return Err(ConfigError::new(
                "--leader-label",
                "must be a valid label key",
            ));
        }
        if self.workload.len() > 253 || self.workload.chars().any(char::is_control) {
            return Err(ConfigError::new(
                "--workload",
                "must be at most 253 characters without control characters",
            ));
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
            ready_when: self.ready_when,
            shutdown_timeout: self.shutdown_timeout,
            kubernetes,
            workload: self.workload.clone(),
        })
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

fn read_pem(flag: &'static str, path: Option<&PathBuf>) -> Result<Option<Vec<u8>>, ConfigError> {
    path.map(|path| std::fs::read(path).map_err(|e| unreadable(flag, path, e)))
        .transpose()
}

/// The password in `path`, without its trailing line break; never echoed in an error.
fn read_password(path: &std::path::Path) -> Result<String, ConfigError> {
    let text =
        std::fs::read_to_string(path).map_err(|e| unreadable("--redis-password-file", path, e))?;
    let password = text.trim_end_matches(['\n', '\r']);
    if password.is_empty() {
        return Err(ConfigError::new(
            "--redis-password-file",
            format!("{} is empty", path.display()),
        ));
    }
    Ok(password.to_owned())
}

fn unreadable(flag: &'static str, path: &std::path::Path, err: std::io::Error) -> ConfigError {
    ConfigError::new(flag, format!("cannot read {}: {err}", path.display()))
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
    fn zero_parses_as_a_duration() {
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
    }
}

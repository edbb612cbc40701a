//! The command line: the subcommands, the global `--log-format`, and what an invalid one
//! does (one line, exit 2).

use clap::{Args, Parser, Subcommand, ValueEnum};

use super::guard::GuardArgs;
use super::lock::{CheckArgs, StatusArgs};
use super::run::RunArgs;
use crate::exit::EXIT_CODES;

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
pub(super) fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .take_while(|line| !line.starts_with("Usage:") && !line.starts_with("For more information"))
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

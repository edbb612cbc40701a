//! Command line and environment: parsed once here, validated into typed configs.
//!
//! Every flag has an environment variable. Invalid input ends the process with exit
//! code 2 and one line naming the flag and the rule it breaks, before anything connects.
//!
//! ## Behaviour
//! - Every duration has an upper bound, checked as it is parsed (the message names the
//!   bound): `--ttl`, `--max-ttl`, `--renew-interval`, `--safety-margin`, `--kill-grace` at
//!   most [`MAX_TTL`](crate::redlock::timing::MAX_TTL); `--node-timeout` and `--connect-timeout` at most a minute;
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
//!
//! | file | concern |
//! |---|---|
//! | [`cli`] | the command line: subcommands, `--log-format`, and the one-line exit 2 |
//! | [`values`] | durations and their bounds, loopback and label checks, the environment |
//! | [`nodes`] | `--redis` and its credentials and TLS files: the node specs |
//! | [`lock`] | the lock's flags (`run`, `guard`, `status`) and `check`'s: the engine config |
//! | [`renew`] | the renewal timing of `run` and `guard` |
//! | [`run`] | `run`'s flags: listeners, the app's readiness, Kubernetes |
//! | [`locks`] | the request-lock API's flags (`run`) |
//! | [`guard`] | `guard`'s flags: waits, holds, kill grace, the schedule slot |

pub mod cli;
pub mod guard;
pub mod lock;
pub mod locks;
pub mod nodes;
pub mod renew;
pub mod run;
pub mod values;

pub use cli::{
    exit_invalid, invalid_line, parse_or_exit, Cli, Command, InstallArgs, LogFormat, SuperviseArgs,
};
pub use guard::{
    min_slot_retention, GuardArgs, GuardConfig, OnBusy, Slot, MAX_GUARD_DURATION, MAX_SLOT_LEN,
    MIN_SLOT_RETENTION,
};
pub use lock::{CheckArgs, LockArgs, StatusArgs, MAX_IDENTITY_LEN};
pub use locks::{LocksArgs, LocksConfig, Switch, MAX_LOCKS_MAX_LEASES};
pub use nodes::RedisArgs;
pub use renew::{RenewArgs, Renewal, MIN_RENEW_INTERVAL};
pub use run::{
    AppCheck, AppProbe, ReadyWhen, RunArgs, RunConfig, ShardsConfig, DEFAULT_CONTROL_LISTEN,
    DEFAULT_LISTEN, DEFAULT_SHARD_REVOKE_TIMEOUT, MAX_APP_WAIT, MAX_SHUTDOWN_TIMEOUT,
    MIN_APP_READY_INTERVAL,
};
pub use values::is_loopback;

#[cfg(test)]
mod tests;

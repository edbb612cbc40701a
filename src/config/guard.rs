//! `guard`'s flags: the wait, the holds, the kill grace, the outcome file, the schedule slot;
//! and everything `guard` needs, validated.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use super::lock::LockArgs;
use super::renew::{RenewArgs, Renewal};
use super::values::{duration_at_most, fmt, kube_settings};
use crate::k8s::KubeMode;
use crate::redlock::timing::MAX_TTL;
use crate::redlock::{drift, ConfigError, RedlockConfig};

/// `--kill-grace` when the ttl leaves room for it.
const DEFAULT_KILL_GRACE: Duration = Duration::from_secs(2);

/// Longest `--wait`, `--min-hold` and `--max-hold`: 30 days. Every deadline `guard` computes is
/// then at most "now + 30 days + a few ttls" (`--ttl` is at most [`MAX_TTL`]), far from the
/// overflow of `Instant` arithmetic.
pub const MAX_GUARD_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

/// What `guard` does when the lock is held elsewhere after waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnBusy {
    /// Exit 0 without running CMD (what a cron job wants).
    Skip,
    /// Exit 75.
    Fail,
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

impl GuardArgs {
    /// Validates everything `guard` needs.
    pub fn config(&self) -> Result<GuardConfig, ConfigError> {
        let redlock = self.lock.redlock()?;
        let renewal = self.renew.renewal(&redlock)?;
        let kill_grace = self.kill_grace(&redlock, &renewal)?;
        self.check_holds()?;
        let slot = self.slot(redlock.ttl)?;
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
            kubernetes: kube_settings(self.kubernetes, String::new(), false, renewal.interval),
        })
    }

    /// `--kill-grace`, given or derived: CMD gets SIGTERM this long before the step-down
    /// point, and that must come after the first renewal had its chance.
    fn kill_grace(
        &self,
        redlock: &RedlockConfig,
        renewal: &Renewal,
    ) -> Result<Duration, ConfigError> {
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
        Ok(kill_grace)
    }

    /// `--max-hold`, if given, is positive and at least `--min-hold`.
    fn check_holds(&self) -> Result<(), ConfigError> {
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
        Ok(())
    }

    /// `--slot` and `--slot-retention` (the retention is checked whether a slot is given or
    /// not).
    fn slot(&self, ttl: Duration) -> Result<Option<Slot>, ConfigError> {
        let shortest_retention = min_slot_retention(ttl, self.min_hold);
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
        match &self.slot {
            Some(id) => Ok(Some(Slot {
                id: slot_id(id)?,
                retention: self.slot_retention,
            })),
            None => Ok(None),
        }
    }
}

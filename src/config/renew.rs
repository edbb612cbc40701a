//! Renewal timing, shared by `run` and `guard`: the interval and the safety margin,
//! validated against the ttl.

use std::time::Duration;

use clap::Args;

use super::values::{duration_at_most, fmt};
use crate::redlock::timing::MAX_TTL;
use crate::redlock::{drift, ConfigError, RedlockConfig};

/// `--safety-margin` when the ttl leaves room for it.
const DEFAULT_SAFETY_MARGIN: Duration = Duration::from_secs(1);

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

/// Renewal timing, validated against the ttl.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Renewal {
    /// Time between extends while holding.
    pub interval: Duration,
    /// Step down this long before validity ends.
    pub safety_margin: Duration,
}

impl RenewArgs {
    /// Validates the renewal timing against the engine's ttl and node timeout.
    pub(super) fn renewal(&self, cfg: &RedlockConfig) -> Result<Renewal, ConfigError> {
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

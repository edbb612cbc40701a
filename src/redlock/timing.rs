//! The engine's timing: the core's arithmetic (`redlock_core::timing`, re-exported) plus what
//! needs more than arithmetic: a random retry delay, and bounds named in flag errors.

use std::time::Duration;

use rand::Rng;

pub use redlock_core::timing::*;

/// `Ok` if `value` is at most `max`; else the reason, naming the bound.
pub fn at_most(value: Duration, max: Duration) -> Result<(), String> {
    if value > max {
        Err(format!(
            "must be at most {}",
            humantime::format_duration(max)
        ))
    } else {
        Ok(())
    }
}

/// A random delay before retry `attempt` (0-based): [`backoff_delay`] with a fresh draw.
pub fn retry_delay(base: Duration, max: Duration, attempt: u32) -> Duration {
    backoff_delay(base, max, attempt, rand::rng().random_range(0.0..=1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scripts_write_the_records_for_the_life_the_engine_assumes() {
        use super::super::scripts;
        assert_eq!(scripts::RECORD_LIFE_IN_SCRIPTS, RECORD_LIFE.to_string());
        for script in [scripts::ACQUIRE, scripts::EXTEND, scripts::EXTEND_MANY] {
            assert!(
                !script.contains("2 * "),
                "a record written for two ttls: {script}"
            );
        }
        assert!(scripts::EXTEND.contains(&format!("'PX', {RECORD_LIFE} * ttl")));
    }

    #[test]
    fn every_duration_of_the_engine_config_is_bounded() {
        use super::super::{Credentials, NodeSpec, RedlockConfig};
        let node = NodeSpec::parse(0, "redis://127.0.0.1:1", &Credentials::default()).unwrap();
        let cfg = || RedlockConfig::new("l", "me", vec![node.clone()]);
        assert!(cfg().validate().is_ok(), "the defaults are in bounds");
        let huge = Duration::from_secs(u64::MAX);
        type Set = fn(&mut RedlockConfig, Duration);
        let cases: [(&str, Set); 7] = [
            ("--ttl", |c, d| c.ttl = d),
            ("--max-ttl", |c, d| c.max_ttl = Some(d)),
            ("--node-timeout", |c, d| c.node_timeout = d),
            ("--connect-timeout", |c, d| c.connect_timeout = d),
            ("--retry-delay", |c, d| c.retry_delay = d),
            ("retry_max", |c, d| c.retry_max = d),
            ("--fence-retention", |c, d| c.fence_retention = d),
        ];
        for (flag, set) in cases {
            let mut c = cfg();
            set(&mut c, huge);
            let err = c.validate().expect_err(flag);
            assert_eq!(err.flag, flag);
            assert!(err.reason.starts_with("must be at most "), "{err}");
        }
        let mut c = cfg();
        c.ttl = MAX_TTL + Duration::from_millis(1);
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "--ttl: must be at most 1h"
        );
    }

    #[test]
    fn retry_delay_grows_and_stays_bounded() {
        let base = Duration::from_millis(100);
        let max = Duration::from_secs(1);
        for attempt in 0..40 {
            let cap = (base * 2u32.pow(attempt.min(10))).min(max);
            let d = retry_delay(base, max, attempt);
            assert!(
                d >= cap / 2 && d <= cap,
                "attempt {attempt}: {d:?} vs cap {cap:?}"
            );
        }
    }
}

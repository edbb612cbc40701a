//! Values the flags share: durations and their bounds, addresses, names, the environment.

use std::time::Duration;

use crate::k8s::{KubeMode, KubeSettings};
use crate::redlock::timing;

/// Parses `500ms`, `10s`, `2m`, and a bare `0`.
pub(super) fn parse_duration(text: &str) -> Result<Duration, String> {
    if text.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(text).map_err(|e| format!("{e} (use e.g. 500ms, 10s, 2m)"))
}

/// [`parse_duration`], refusing durations above `max` (the message names the bound).
pub(super) fn duration_at_most(
    max: Duration,
) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync + 'static {
    move |text| {
        let duration = parse_duration(text)?;
        timing::at_most(duration, max)?;
        Ok(duration)
    }
}

/// Whether `ip` is a loopback address: 127.0.0.0/8, `::1`, or an IPv4-mapped
/// `::ffff:127.x.y.z`.
pub fn is_loopback(ip: std::net::IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

/// Whether `name` is a DNS-1123 label, as container names are.
pub(super) fn is_dns_label(name: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    (1..=63).contains(&name.len())
        && name.chars().all(|c| alnum(c) || c == '-')
        && name.starts_with(alnum)
        && name.ends_with(alnum)
}

/// A Kubernetes label key: an optional DNS-subdomain prefix and `/`, then a name of at most
/// 63 characters `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`.
pub(super) fn is_label_key(key: &str) -> bool {
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

/// `d` for a message, to the millisecond.
pub(super) fn fmt(d: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(Duration::from_millis(d.as_millis() as u64))
}

/// The environment variable `name`, unless unset or empty.
pub(super) fn env_nonempty(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The Kubernetes settings of a command: its mode and what it asks of the API, and this pod
/// as the downward API's environment names it (`POD_NAME`, `POD_UID`, `POD_NAMESPACE`).
pub(super) fn kube_settings(
    mode: KubeMode,
    label_key: String,
    mirror_lease: bool,
    renew_interval: Duration,
) -> KubeSettings {
    KubeSettings {
        mode,
        label_key,
        mirror_lease,
        pod_name: env_nonempty("POD_NAME"),
        pod_uid: env_nonempty("POD_UID"),
        namespace: env_nonempty("POD_NAMESPACE"),
        renew_interval,
    }
}

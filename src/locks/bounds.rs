//! What a request may ask for: names, ttls and waits, each bounded.
//!
//! | parameter | bound | default |
//! |---|---|---|
//! | name (`{name}`, Dapr `resourceId`) | 1 to [`MAX_NAME_LEN`] bytes, no whitespace, control characters, `{` or `}` | — |
//! | `ttl` (Dapr `expiryInSeconds`) | [`MIN_TTL`] to [`MAX_TTL`] | [`DEFAULT_TTL`] |
//! | `wait` | 0 to [`MAX_WAIT`] | 0 (one attempt) |
//! | Dapr `lockOwner` | 1 to [`MAX_NAME_LEN`] bytes, no control characters | — |

use std::time::Duration;

/// Longest lock name or owner, in bytes: an order id or a SKU with room to spare.
pub const MAX_NAME_LEN: usize = 128;
/// Shortest ttl: keepalives and renewals need room for a few round trips.
pub const MIN_TTL: Duration = Duration::from_secs(1);
/// Longest ttl: the engine's own bound (an hour), so a Dapr app's `expiryInSeconds` of up to
/// an hour is taken as asked, never cut short (a lock that ended before the app's expiry
/// would let another owner in while the app still works).
pub const MAX_TTL: Duration = crate::redlock::timing::MAX_TTL;
/// The ttl when a request names none.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);
/// Longest wait for a lock held elsewhere.
pub const MAX_WAIT: Duration = Duration::from_secs(300);

/// Checks a lock name.
pub fn name(text: &str) -> Result<&str, String> {
    if text.is_empty()
        || text.len() > MAX_NAME_LEN
        || text
            .chars()
            .any(|c| c.is_control() || c.is_whitespace() || c == '{' || c == '}')
    {
        return Err(format!(
            "name: 1 to {MAX_NAME_LEN} bytes without whitespace, control characters, '{{' or '}}'"
        ));
    }
    Ok(text)
}

/// Checks a Dapr lock owner.
pub fn owner(text: &str) -> Result<&str, String> {
    if text.is_empty() || text.len() > MAX_NAME_LEN || text.chars().any(char::is_control) {
        return Err(format!(
            "lockOwner: 1 to {MAX_NAME_LEN} bytes without control characters"
        ));
    }
    Ok(text)
}

/// Checks a ttl.
pub fn ttl(ttl: Duration) -> Result<Duration, String> {
    if ttl < MIN_TTL || ttl > MAX_TTL {
        return Err(format!(
            "ttl: from {} to {}",
            humantime::format_duration(MIN_TTL),
            humantime::format_duration(MAX_TTL)
        ));
    }
    Ok(ttl)
}

/// What `POST /v1/locks/{name}` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AcquireQuery {
    /// How long to wait for a holder elsewhere.
    pub wait: Duration,
    /// How long the lease lives without a keepalive.
    pub ttl: Duration,
}

/// Refuses a query parameter given twice: which one counts would be a guess.
pub fn once(name: &str, seen: &mut bool) -> Result<(), String> {
    if std::mem::replace(seen, true) {
        return Err(format!("{name}: given more than once"));
    }
    Ok(())
}

/// Parses `wait=DURATION&ttl=DURATION` (either may be left out, neither given twice; nothing
/// else is allowed).
pub fn acquire_query(query: Option<&str>) -> Result<AcquireQuery, String> {
    let mut asked = AcquireQuery {
        wait: Duration::ZERO,
        ttl: DEFAULT_TTL,
    };
    let (mut wait_seen, mut ttl_seen) = (false, false);
    for pair in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        match pair.split_once('=') {
            Some(("wait", text)) => {
                once("wait", &mut wait_seen)?;
                asked.wait = humantime::parse_duration(text)
                    .ok()
                    .filter(|d| *d <= MAX_WAIT)
                    .ok_or_else(|| {
                        format!(
                            "wait: a duration such as 0, 500ms or 5s, at most {}",
                            humantime::format_duration(MAX_WAIT)
                        )
                    })?;
            }
            Some(("ttl", text)) => {
                once("ttl", &mut ttl_seen)?;
                asked.ttl = humantime::parse_duration(text)
                    .map_err(|_| "ttl: a duration such as 10s or 1m".to_owned())
                    .and_then(ttl)?;
            }
            _ => return Err("the query parameters are wait=DURATION and ttl=DURATION".to_owned()),
        }
    }
    Ok(asked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_bounded_and_printable() {
        assert!(name("order:42").is_ok());
        assert!(name(&"a".repeat(MAX_NAME_LEN)).is_ok());
        for bad in [
            "",
            "a b",
            "a\nb",
            "{a}",
            "a}",
            &"a".repeat(MAX_NAME_LEN + 1),
        ] {
            assert!(name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_query_has_defaults_and_bounds() {
        assert_eq!(
            acquire_query(None),
            Ok(AcquireQuery {
                wait: Duration::ZERO,
                ttl: DEFAULT_TTL
            })
        );
        assert_eq!(
            acquire_query(Some("wait=2s&ttl=30s")),
            Ok(AcquireQuery {
                wait: Duration::from_secs(2),
                ttl: Duration::from_secs(30)
            })
        );
        for bad in [
            "wait=soon",
            "wait=6m",
            "ttl=10ms",
            "ttl=61m",
            "ttl=",
            "x=1",
            "wait",
        ] {
            assert!(acquire_query(Some(bad)).is_err(), "{bad}");
        }
        assert_eq!(acquire_query(Some("ttl=1h")).map(|q| q.ttl), Ok(MAX_TTL));
    }

    #[test]
    fn a_parameter_given_twice_is_refused_by_name() {
        for (query, name) in [
            ("wait=1s&wait=2s", "wait"),
            ("wait=1s&ttl=5s&wait=1s", "wait"),
            ("ttl=5s&ttl=5s", "ttl"),
        ] {
            let why = acquire_query(Some(query)).unwrap_err();
            assert!(
                why.starts_with(&format!("{name}: given more than once")),
                "{why}"
            );
        }
    }
}

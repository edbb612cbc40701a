//! The lock and unlock rules, once for Dapr's HTTP and gRPC APIs: the checks in Dapr's
//! order, the answers, and what travels beside them.

use std::time::Duration;

use super::{FENCING_TOKEN, HOLDER, REASON, VALIDITY_MS};
use crate::clock::Deadline;
use crate::locks::api::Api;
use crate::locks::bounds;
use crate::locks::engine::LockEngine;
use crate::locks::service::{Refused, Unlock};

/// What a try-lock that was answered found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TryLocked {
    /// Taken, with its fencing token, valid until then.
    Taken {
        fencing_token: u64,
        valid_until: Deadline,
    },
    /// Held by another owner (or by the same one: no re-entry), held by this sidecar if known.
    Held { holder: Option<String> },
}

/// Why a lock store could not answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// Too few nodes answered or counted; the engine's error kind.
    NoQuorum { kind: &'static str },
    /// The sidecar is shutting down.
    ShuttingDown,
    /// The request was cancelled before it was answered.
    Cancelled,
}

impl Unavailable {
    /// The [`REASON`] word.
    pub fn word(self) -> &'static str {
        match self {
            Unavailable::NoQuorum { .. } => "no_quorum",
            Unavailable::ShuttingDown => "shutting_down",
            Unavailable::Cancelled => "cancelled",
        }
    }

    /// The `ErrorInfo` reason.
    fn reason(self) -> &'static str {
        match self {
            Unavailable::NoQuorum { .. } => "REDLOCK_NO_QUORUM",
            Unavailable::ShuttingDown => "REDLOCK_SHUTTING_DOWN",
            Unavailable::Cancelled => "REDLOCK_CANCELLED",
        }
    }

    fn explain(self) -> String {
        match self {
            Unavailable::NoQuorum { kind } => format!("no quorum of Redis nodes ({kind})"),
            Unavailable::ShuttingDown => "the sidecar is shutting down".to_owned(),
            Unavailable::Cancelled => "the request was cancelled".to_owned(),
        }
    }
}

/// Why a Dapr lock request got no answer from the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DaprError {
    /// A field missing, empty or out of this sidecar's bounds (Dapr's message where Dapr has one).
    Malformed(String),
    /// Another store name than this sidecar's.
    StoreNotFound(String),
    /// The bound on leases of this sidecar is reached.
    TooMany { max: usize },
    /// The store could not answer.
    Unavailable(Unavailable),
}

/// A `google.rpc.ErrorInfo`: a machine-readable reason beside Dapr's error code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorInfo {
    /// `REDLOCK_…`, in upper snake case as Google's error model asks.
    pub reason: &'static str,
    /// Details, e.g. the engine's error `kind`.
    pub metadata: Vec<(&'static str, String)>,
}

impl DaprError {
    /// Dapr's `errorCode`.
    pub fn error_code(&self) -> &'static str {
        match self {
            DaprError::Malformed(_) => "ERR_MALFORMED_REQUEST",
            DaprError::StoreNotFound(_) => "ERR_LOCK_STORE_NOT_FOUND",
            DaprError::TooMany { .. } => "ERR_TOO_MANY_LEASES",
            DaprError::Unavailable(_) => "ERR_TRY_LOCK_FAILED",
        }
    }

    /// The message (Dapr's where Dapr has one).
    pub fn message(&self) -> String {
        match self {
            DaprError::Malformed(why) => why.clone(),
            DaprError::StoreNotFound(store) => format!("lock store {store} not found"),
            DaprError::TooMany { max } => {
                format!("too many leases and waits in this sidecar (at most {max})")
            }
            DaprError::Unavailable(why) => {
                format!("failed to try acquiring lock: {}", why.explain())
            }
        }
    }

    /// The [`REASON`] word, for the errors of the store (none for a request's own fault).
    pub fn word(&self) -> Option<&'static str> {
        match self {
            DaprError::Malformed(_) | DaprError::StoreNotFound(_) => None,
            DaprError::TooMany { .. } => Some("too_many_leases"),
            DaprError::Unavailable(why) => Some(why.word()),
        }
    }

    /// The `ErrorInfo` detail, for the errors of the store.
    pub fn info(&self) -> Option<ErrorInfo> {
        match self {
            DaprError::Malformed(_) | DaprError::StoreNotFound(_) => None,
            DaprError::TooMany { max } => Some(ErrorInfo {
                reason: "REDLOCK_TOO_MANY_LEASES",
                metadata: vec![("max", max.to_string())],
            }),
            DaprError::Unavailable(why) => Some(ErrorInfo {
                reason: why.reason(),
                metadata: match why {
                    Unavailable::NoQuorum { kind } => vec![("kind", (*kind).to_owned())],
                    _ => Vec::new(),
                },
            }),
        }
    }
}

/// Dapr's checks of a try-lock, with its messages, in its order (expiry, resource, owner,
/// store), then this sidecar's bounds; the ttl asked for.
pub fn check_try_lock(
    served: &str,
    store: &str,
    resource_id: &str,
    lock_owner: &str,
    expiry_in_seconds: i64,
) -> Result<Duration, DaprError> {
    if expiry_in_seconds <= 0 {
        return Err(DaprError::Malformed(format!(
            "ExpiryInSeconds is not positive in lock store {store}"
        )));
    }
    check_unlock(served, store, resource_id, lock_owner)?;
    let max = bounds::MAX_TTL.as_secs();
    if expiry_in_seconds.unsigned_abs() > max {
        // Dapr sets no bound: a longer expiry is refused rather than cut short.
        return Err(DaprError::Malformed(format!(
            "expiryInSeconds: at most {max} ({}, the longest ttl of this sidecar)",
            humantime::format_duration(bounds::MAX_TTL)
        )));
    }
    bounds::ttl(Duration::from_secs(expiry_in_seconds.unsigned_abs())).map_err(DaprError::Malformed)
}

/// Dapr's checks of an unlock (resource, owner, store), then this sidecar's bounds.
pub fn check_unlock(
    served: &str,
    store: &str,
    resource_id: &str,
    lock_owner: &str,
) -> Result<(), DaprError> {
    if resource_id.is_empty() {
        return Err(DaprError::Malformed(format!(
            "ResourceId is empty in lock store {store}"
        )));
    }
    if lock_owner.is_empty() {
        return Err(DaprError::Malformed(format!(
            "LockOwner is empty in lock store {store}"
        )));
    }
    if store != served {
        return Err(DaprError::StoreNotFound(store.to_owned()));
    }
    bounds::name(resource_id)
        .and_then(|_| bounds::owner(lock_owner))
        .map(|_| ())
        .map_err(DaprError::Malformed)
}

/// Dapr's try-lock: `lock_owner` takes `resource_id` for `expiry_in_seconds`, without waiting.
pub async fn try_lock<E: LockEngine>(
    api: &Api<E>,
    store: &str,
    resource_id: &str,
    lock_owner: &str,
    expiry_in_seconds: i64,
) -> Result<TryLocked, DaprError> {
    let ttl = check_try_lock(
        &api.dapr_store,
        store,
        resource_id,
        lock_owner,
        expiry_in_seconds,
    )?;
    let result = api
        .locks
        .acquire(
            resource_id,
            ttl,
            Duration::ZERO,
            Some(lock_owner.to_owned()),
        )
        .await;
    match result {
        Ok(granted) => Ok(TryLocked::Taken {
            fencing_token: granted.fencing_token,
            valid_until: granted.valid_until,
        }),
        Err(Refused::Held { holder }) => Ok(TryLocked::Held { holder }),
        Err(Refused::TooMany { max }) => Err(DaprError::TooMany { max }),
        // A try-lock never waits: only the bound on leases applies to it.
        Err(Refused::TooManyWaiting { max }) => Err(DaprError::TooMany { max }),
        Err(Refused::Invalid(why)) => Err(DaprError::Malformed(why)),
        Err(Refused::NoQuorum { kind }) => {
            Err(DaprError::Unavailable(Unavailable::NoQuorum { kind }))
        }
        Err(Refused::ShuttingDown) => Err(DaprError::Unavailable(Unavailable::ShuttingDown)),
        Err(Refused::Cancelled) => Err(DaprError::Unavailable(Unavailable::Cancelled)),
    }
}

/// Dapr's unlock: releases the lock `lock_owner` holds on `resource_id` through this sidecar.
pub async fn unlock_owned<E: LockEngine>(
    api: &Api<E>,
    store: &str,
    resource_id: &str,
    lock_owner: &str,
) -> Result<Unlock, DaprError> {
    check_unlock(&api.dapr_store, store, resource_id, lock_owner)?;
    Ok(api.locks.unlock_owned(resource_id, lock_owner).await)
}

/// What travels beside a try-lock's answer: headers over HTTP, metadata over gRPC (see the
/// module doc). Values that are not visible ASCII (a holder's identity may be any UTF-8) are
/// left out.
pub fn try_lock_extras(
    answer: &Result<TryLocked, DaprError>,
    now: Deadline,
) -> Vec<(&'static str, String)> {
    let mut extras = Vec::new();
    match answer {
        Ok(TryLocked::Taken {
            fencing_token,
            valid_until,
        }) => {
            let validity = valid_until.saturating_duration_since(now).as_millis();
            extras.push((FENCING_TOKEN, fencing_token.to_string()));
            extras.push((VALIDITY_MS, validity.to_string()));
        }
        Ok(TryLocked::Held { holder }) => {
            extras.push((REASON, "held".to_owned()));
            if let Some(holder) = holder.as_ref().filter(|h| visible_ascii(h)) {
                extras.push((HOLDER, holder.clone()));
            }
        }
        Err(err) => extras.extend(err.word().map(|word| (REASON, word.to_owned()))),
    }
    extras
}

/// What travels beside an unlock's answer.
pub fn unlock_extras(answer: &Result<Unlock, DaprError>) -> Vec<(&'static str, String)> {
    match answer {
        Ok(Unlock::InternalError) => vec![(REASON, "unavailable".to_owned())],
        Ok(_) => Vec::new(),
        Err(err) => err
            .word()
            .map(|word| (REASON, word.to_owned()))
            .into_iter()
            .collect(),
    }
}

/// Whether `text` is a header value as is: 1 or more printable ASCII characters.
fn visible_ascii(text: &str) -> bool {
    !text.is_empty() && text.bytes().all(|b| (0x20..0x7f).contains(&b))
}

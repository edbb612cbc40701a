//! Dapr's distributed lock API (v1.0-alpha1), answer for answer, and the routes Dapr's SDKs
//! call before they lock: an app written for Dapr switches by changing the port.
//!
//! | request | answer |
//! |---|---|
//! | `POST /v1.0-alpha1/lock/{store}` `{"resourceId", "lockOwner", "expiryInSeconds"}` | 200 `{"success": true}` when taken, `{"success": false}` when held (also by the same owner: Dapr's try-lock does not re-enter) |
//! | `POST /v1.0-alpha1/unlock/{store}` `{"resourceId", "lockOwner"}` | 200 `{"status": 0}` unlocked, `1` no such lock, `2` it belongs to another owner (here or through another sidecar), `3` internal error (no quorum, shutting down) |
//! | `GET /v1.0/metadata` | 200: this sidecar as Dapr describes a sidecar (see [`Runtime::metadata_json`]) |
//! | `GET /v1.0/healthz`, `GET /v1.0/healthz/outbound` | 204 while this sidecar serves Dapr's lock API ([`Runtime::serving`]: from its first round that reached a quorum of nodes until it begins shutting down); else 500 `ERR_HEALTH_NOT_READY` / `ERR_OUTBOUND_HEALTH_NOT_READY` |
//!
//! The lock and unlock rules live here once ([`try_lock`], [`unlock_owned`]), for these routes and for
//! Dapr's gRPC API ([`super::dapr_grpc`]) alike; each transport only reads its request and writes
//! the answer.
//!
//! A Dapr lock is a lease of ttl `expiryInSeconds` that nobody keeps alive: it is renewed on
//! the nodes until its expiry, then released, as Dapr's lock expires.
//!
//! `expiryInSeconds` is taken as Dapr takes it (a number, or a string of one such as `"30"`)
//! up to this sidecar's longest ttl, an hour; a longer one is refused, never cut short.
//!
//! ## What Dapr's answers have no room for
//! Dapr's SDKs read `success` and `status` only; what else this sidecar knows travels beside
//! them, where they do not look (response headers over HTTP, response metadata over gRPC):
//! - a lock taken: [`FENCING_TOKEN`] (the fencing token, only growing for the name) and
//!   [`VALIDITY_MS`] (milliseconds of validity left when the answer was written);
//! - an answer that is not a lock taken or released: [`REASON`] says why, one word: `held`
//!   (another owner holds it; [`HOLDER`] names the sidecar holding it when the nodes told),
//!   `no_quorum`, `shutting_down`, `cancelled`, `too_many_leases`, and for an unlock status 3
//!   `unavailable`.
//!
//! Errors use Dapr's shape, `{"errorCode", "message"}`, in Dapr's order of checks: 400
//! `ERR_MALFORMED_REQUEST` (not JSON, an `expiryInSeconds` that is not positive, an empty
//! `resourceId` or `lockOwner`, then this sidecar's bounds), 400 `ERR_LOCK_STORE_NOT_FOUND`
//! (another store name than `--locks-dapr-store`), 500 `ERR_TRY_LOCK_FAILED` (no quorum,
//! shutting down), 429 `ERR_TOO_MANY_LEASES`, 413 for a body over [`super::routes::MAX_BODY`]
//! bytes. The 500 and 429 answers add Dapr's rich-error `details`: one
//! `google.rpc.ErrorInfo` of domain [`ERROR_DOMAIN`] whose `reason` tells a quorum that could
//! not be reached (`REDLOCK_NO_QUORUM`, with the engine's `kind`) from a shutdown
//! (`REDLOCK_SHUTTING_DOWN`).
//!
//! | file | concern |
//! |---|---|
//! | [`rules`] | the lock and unlock rules and answers, shared with the gRPC API |
//! | [`http`] | the HTTP routes: Dapr's JSON requests in, Dapr's answers and headers out |
//! | [`runtime`] | this sidecar as a Dapr runtime: metadata and health routes |

pub mod http;
pub mod rules;
pub mod runtime;

pub use http::{lock, unlock};
pub use rules::{
    check_try_lock, check_unlock, try_lock, try_lock_extras, unlock_extras, unlock_owned,
    DaprError, ErrorInfo, TryLocked, Unavailable,
};
pub use runtime::{runtime_router, Runtime};

/// The component type this sidecar's lock store reports (Dapr's Redis store reports `lock.redis`).
pub const STORE_TYPE: &str = "lock.redlock-sidecar";
/// The component version it reports.
pub const STORE_VERSION: &str = "v1";
/// What this sidecar reports as its runtime version (`runtimeVersion`).
pub const RUNTIME_VERSION: &str = concat!("redlock-sidecar/", env!("CARGO_PKG_VERSION"));
/// The domain of the `google.rpc.ErrorInfo` details of its errors.
pub const ERROR_DOMAIN: &str = "redlock-sidecar";
/// The `@type` of an `ErrorInfo` detail, as Dapr writes it.
pub const ERROR_INFO_TYPE: &str = "type.googleapis.com/google.rpc.ErrorInfo";

/// Header (HTTP) and metadata key (gRPC): the fencing token of a lock taken.
pub const FENCING_TOKEN: &str = "x-redlock-fencing-token";
/// Header and metadata key: milliseconds of validity left of a lock taken.
pub const VALIDITY_MS: &str = "x-redlock-validity-ms";
/// Header and metadata key: why the answer is not a lock taken or released.
pub const REASON: &str = "x-redlock-reason";
/// Header and metadata key: the identity of the sidecar holding a lock, when the nodes told.
pub const HOLDER: &str = "x-redlock-holder";

#[cfg(test)]
mod tests;

//! redlock-sidecar: hold a Redlock (a lock on a quorum of independent Redis masters)
//! for the app next to it, with fencing tokens, and publish who leads.

// Unit tests may use Tokio's and std's timers directly (clippy.toml keeps them out of the
// code itself).
#![cfg_attr(test, allow(clippy::disallowed_methods))]

/// Whether this sidecar stands for leadership: the app's readiness and hand-overs.
pub mod candidacy;
/// The clock of every timer and deadline (`Deadline`): monotonic, counting host suspends.
pub mod clock;
/// Command line and environment, validated into typed configs.
pub mod config;
/// The control listener and the request locks on a thread of their own.
pub mod control_thread;
/// The OS random source, checked at start-up.
pub mod entropy;
/// Every exit code, in one table, and the one way to exit early.
pub mod exit;
/// `guard`: run a command only while the lock is held.
pub mod guard;
/// The admin HTTP endpoint: health, readiness, leader, events, metrics.
pub mod http;
/// `install`: copy the binary into a shared volume.
pub mod install;
/// Kubernetes integration: pod label, Events and Lease mirror, driven by the leadership channel.
pub mod k8s;
/// The one leadership state and its `watch` channel.
pub mod leadership;
/// The leadership loop: acquire, renew, step down, contend again.
pub mod lease;
/// Locks for the app's requests over the control listener (and Dapr's lock API).
pub mod locks;
/// Logging that drops lines rather than block when stderr does not drain.
pub mod logging;
/// Prometheus metrics.
pub mod metrics;
/// Operator commands: `check` and `status`.
pub mod ops;
/// The Redlock engine: quorum lock, fencing tokens, votes only from nodes that kept their data.
pub mod redlock;
/// `run --shards`: the sidecars of a lock split N fenced shards among themselves.
pub mod shards;
/// Signals and the second-signal exit.
pub mod shutdown;
/// `run`: the sidecar composition and its ordered shutdown.
pub mod sidecar;

//! The transport: everything below the votes. It reaches nodes, keeps one connection per node
//! with its subscriptions, and offers the engine what it needs behind [`VoteNode`].
//!
//! ## Layers (each imports only from those below it; `tests/layers.rs` checks it)
//! 1. [`error`]: what can go wrong ([`ConfigError`], [`NodeError`]).
//! 2. [`secrets`], [`sentinel`] URLs, [`spec`]: where a node is and how to authenticate
//!    (URLs, credentials, TLS); no network I/O.
//! 3. [`facts`], [`dial`], [`cluster`]: reaching a server (direct, the master a Sentinel group
//!    names, the master of the lock's slot in a Redis Cluster) and what it says about itself.
//!    The cluster key layout (the epoch marker per slot) lives in [`cluster`], the one layer
//!    that knows cluster mode.
//! 4. [`node`], [`pushes`], `hub`: one self-reconnecting connection per node, its facts, the
//!    calls the engine makes, and the pushes that ride on it, routed by channel to every lock
//!    that listens (one connection and one router per node, whatever the number of locks).
//! 5. [`voter`]: the trait the engine holds every node through ([`Voter`]), so its rounds,
//!    fan-out and vote rules can be tested on fake nodes.
//!
//! ## Time
//! What outlives one call is a [`crate::clock::Deadline`] on `CLOCK_BOOTTIME` (the age of a
//! connection's facts, the backoff of a Sentinel subscription). One call's own bound (the
//! caller's `timeout`, the connect timeout) stays a Tokio timeout: it is a relative bound on
//! work in flight that no vote reads time from (the rounds measure elapsed time on the boot
//! clock themselves), and a boot-clock timer per request would cost a timerfd (four system
//! calls) on the path every vote takes.
//!
//! Nothing here knows locks, votes or leaders.

pub mod cluster;
pub mod dial;
pub mod error;
pub mod facts;
mod hub;
mod link;
pub mod node;
pub mod pushes;
pub mod secrets;
pub mod sentinel;
pub mod spec;
pub mod voter;

pub use cluster::EPOCH_KEY;
pub use dial::ConnectSettings;
pub use error::{ConfigError, NodeError, NodeErrorKind};
pub use facts::{info_field, server_identity, NodeFacts, FACTS_MAX_AGE};
pub use node::Node;
pub use pushes::Pushes;
pub use secrets::{ClientCert, SecretFiles};
pub use spec::{Credentials, NodeSpec};
pub use voter::{VoteNode, Voter};

//! The transport: everything below the votes. It reaches nodes, keeps one connection per node
//! with its subscriptions, and offers the vote layer what it needs behind [`VoteNode`].
//!
//! ## Layers (each imports only from those below it; `tests/layers.rs` checks it)
//! 1. [`error`]: what can go wrong ([`ConfigError`], [`NodeError`]).
//! 2. [`secrets`], [`sentinel`] URLs, [`spec`]: where a node is and how to authenticate
//!    (URLs, credentials, TLS); no network I/O.
//! 3. [`facts`], [`dial`], [`cluster`]: reaching a server (direct, the master a Sentinel group
//!    names, the master of the lock's slot in a Redis Cluster) and what it says about itself.
//!    The cluster key layout (the epoch marker per slot) lives in [`cluster`], the one layer
//!    that knows cluster mode.
//! 4. [`node`], [`pushes`]: one self-reconnecting connection per node, its facts, the calls
//!    the engine makes, and the pushes that ride on it.
//! 5. [`voter`]: the trait the vote layer sees a node through, so vote rules can be tested
//!    with a fake node.
//!
//! Nothing here knows locks, votes or leaders.

pub mod cluster;
pub mod dial;
pub mod error;
pub mod facts;
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
pub use voter::VoteNode;

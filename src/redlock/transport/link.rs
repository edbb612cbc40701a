//! The state of a node's one connection, shared by the node and the push routes on it.

use std::sync::Arc;

use redis::aio::MultiplexedConnection;

use super::error::NodeError;
use super::facts::NodeFacts;
use crate::clock::Deadline;

/// The state of a node's one connection.
#[derive(Clone)]
pub(super) enum Link {
    /// No connection; the next call makes one.
    Idle,
    /// A connection is being made (by a background task, so a short node timeout cannot
    /// cancel a slow TLS handshake half-way).
    Connecting,
    /// Connected (connection number `u64`), with the facts read on it and when they were read.
    Up(MultiplexedConnection, Arc<NodeFacts>, u64, Deadline),
    /// The last attempt failed; the next call tries again.
    Down(NodeError),
}

//! What the lock routes share, over HTTP (`routes`, `dapr`) and gRPC (`dapr_grpc`).

use std::sync::Arc;

use super::engine::LockEngine;
use super::service::Locks;

/// The lease table and the Dapr store name, for every transport's handlers.
pub struct Api<E: LockEngine> {
    /// The lease table.
    pub locks: Arc<Locks<E>>,
    /// The store name Dapr requests must name.
    pub dapr_store: String,
}

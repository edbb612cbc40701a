//! Reading what a node says about itself on each new connection (the facts themselves are
//! the core's, `redlock_core::facts`).

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::RedisError;

pub use redlock_core::facts::{info_field, server_identity, NodeFacts};

/// How old a connection's eviction policy may get before it is read again in the background
/// (one `INFO memory`): the run id cannot change under a live connection, but the policy can
/// (`CONFIG SET`). 30 s keeps an idle standby under one command per node per second.
pub const FACTS_MAX_AGE: Duration = Duration::from_secs(30);

/// Reads a node's [`NodeFacts`] on `conn`.
pub(super) async fn read_facts(conn: &mut MultiplexedConnection) -> Result<NodeFacts, RedisError> {
    let (server, replication, memory, cluster): (String, String, String, String) = redis::pipe()
        .cmd("INFO")
        .arg("server")
        .cmd("INFO")
        .arg("replication")
        .cmd("INFO")
        .arg("memory")
        .cmd("INFO")
        .arg("cluster")
        .query_async(conn)
        .await?;
    let mut facts = NodeFacts::parse(&server, &replication, &memory);
    facts.cluster = info_field(&cluster, "cluster_enabled") == "1";
    Ok(facts)
}

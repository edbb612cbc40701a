//! What a node says about itself ([`NodeFacts`]), as read from its `INFO` on each new
//! connection, and the name a node's server goes by ([`server_identity`]).

/// What a node says about itself, read once per connection: a restart always drops the
/// connection, so these facts stay true for as long as it lives.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// The server process' id (`INFO server`): new with every restart.
    pub run_id: String,
    /// `maxmemory-policy` (`INFO memory`): anything but `noeviction` may evict lock keys.
    pub maxmemory_policy: String,
    /// `role` (`INFO replication`): `master`, or `slave` for a replica.
    pub role: String,
    /// The `host:port` the connection reaches: the URL's, the master a Sentinel named, or the
    /// cluster master serving the lock's slot.
    pub address: String,
    /// `cluster_enabled:1` (`INFO cluster`): the connection reaches the master of the lock's
    /// slot, and the epoch marker is that slot's (see `cluster`).
    pub cluster: bool,
    /// The connection speaks RESP3 and carries the node's pushed messages.
    pub push: bool,
}

impl NodeFacts {
    /// Whether the node may evict keys that have a ttl, such as lock keys.
    pub fn may_evict(&self) -> bool {
        self.maxmemory_policy != "noeviction"
    }

    /// The facts in the text of `INFO server`, `INFO replication` and `INFO memory` (any of
    /// them may be one text holding several sections).
    pub fn parse(server: &str, replication: &str, memory: &str) -> NodeFacts {
        NodeFacts {
            run_id: info_field(server, "run_id"),
            maxmemory_policy: info_field(memory, "maxmemory_policy"),
            role: info_field(replication, "role"),
            address: String::new(),
            cluster: false,
            push: false,
        }
    }
}

/// The value of `name` in an `INFO` text, empty when absent.
pub fn info_field(text: &str, name: &str) -> String {
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default()
}

/// A node's server as the node-set fingerprint names it: the run id the connection shows
/// (new with every restart; for a Sentinel group or a cluster, the master reached) and the
/// database (two databases of one server are two keyspaces). `None` without a run id.
pub fn server_identity(run_id: &str, db: i64) -> Option<String> {
    (!run_id.is_empty()).then(|| format!("{run_id}/{db}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_come_from_the_info_sections() {
        let facts = NodeFacts::parse(
            "# Server\r\nredis_version:7.0.15\r\nrun_id:abc123\r\n",
            "# Replication\r\nrole:slave\r\n",
            "# Memory\r\nmaxmemory:0\r\nmaxmemory_policy:allkeys-lru\r\n",
        );
        assert_eq!(facts.run_id, "abc123");
        assert_eq!(facts.role, "slave");
        assert_eq!(facts.maxmemory_policy, "allkeys-lru");
        assert!(facts.may_evict());
        assert!(!NodeFacts::parse("", "", "maxmemory_policy:noeviction").may_evict());
    }
}

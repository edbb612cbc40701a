//! What one node is, as `check` reads it from `INFO` (no `CONFIG`: managed services refuse it),
//! and whether its vote counts. Pure: built from the texts a node answered, unit-tested here.

use std::collections::HashMap;
use std::time::Duration;

use crate::redlock::votes::{self, DataAge, Proof};
use crate::redlock::{Access, NodeFacts};

/// How `check` reached the node, besides what the node says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dialled {
    /// The `host:port` the connection reaches (a Sentinel group: its master now).
    pub address: String,
    /// The group's name, when the node is a Sentinel group.
    pub sentinel_group: Option<String>,
    /// Over TLS: `INFO` shows no TLS port to compare with.
    pub tls: bool,
    /// In cluster mode: the lock's hash slot, served by the master reached.
    pub cluster_slot: Option<u16>,
}

/// What `INFO` and the node's epoch marker tell about one node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeReport {
    /// Round-trip time of a `PING`.
    pub rtt: Duration,
    /// `redis 7.0.15`, `valkey 8.1.1`: the server's name and version.
    pub server: String,
    /// `uptime_in_seconds`.
    pub uptime_secs: u64,
    /// `redis_mode`: `standalone`, `cluster` or `sentinel` (empty if absent).
    pub mode: String,
    /// `cluster_enabled:1`.
    pub cluster: bool,
    /// What the vote rules read: run id, eviction policy, role, address.
    pub facts: NodeFacts,
    /// `master_replid` (empty if absent).
    pub replid: String,
    /// `connected_slaves`.
    pub replicas: u32,
    /// For a replica, its master's `host:port`.
    pub master_of: Option<String>,
    /// `INFO replication` shows `min_slaves_good_slaves`: the master refuses writes without
    /// enough replicas (`min-replicas-to-write` and `min-replicas-max-lag` are set).
    pub min_replicas_to_write: bool,
    /// `aof`, `rdb`, `aof+rdb` or `none seen` (no AOF, no snapshot since start).
    pub persistence: String,
    /// `tcp_port` as the server reports it.
    pub tcp_port: Option<u16>,
    /// How the node was reached.
    pub dialled: Dialled,
    /// How long the node has provably kept its data (its epoch marker's age); `None` when
    /// no contender has stamped the marker since the node last lost data.
    pub data_age: Option<Duration>,
    /// What its ACL user may run of what the engine needs; `None` if not asked.
    pub access: Option<Access>,
}

/// Whether a node's vote counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Standing {
    /// Its grants count now.
    Counts,
    /// Its grants will count once it has kept its data this much longer (or, without an epoch
    /// marker yet, this long after the first contender meets it).
    CountsIn(Duration, String),
    /// Its grants never count as it is: why.
    Never(String),
}

impl NodeReport {
    /// The report of a node that answered `info` (all default sections) to a `PING` in `rtt`.
    pub fn from_info(info: &str, rtt: Duration, dialled: Dialled) -> NodeReport {
        let fields: HashMap<&str, &str> = info
            .lines()
            .filter_map(|line| line.trim_end().split_once(':'))
            .collect();
        let field = |name: &str| fields.get(name).copied().unwrap_or_default().to_owned();
        let server = match (fields.get("server_name"), fields.get("valkey_version")) {
            (Some(name), _) => format!("{name} {}", field(&format!("{name}_version"))),
            (None, Some(version)) => format!("valkey {version}"),
            (None, None) => format!("redis {}", field("redis_version")),
        };
        let aof = field("aof_enabled") == "1";
        let rdb = field("rdb_saves").parse::<u64>().is_ok_and(|n| n > 0);
        let persistence = match (aof, rdb) {
            (true, true) => "aof+rdb",
            (true, false) => "aof",
            (false, true) => "rdb",
            (false, false) => "none seen",
        };
        let master_of = (field("role") == "slave")
            .then(|| format!("{}:{}", field("master_host"), field("master_port")));
        let mut facts = NodeFacts::parse(info, info, info);
        facts.address = dialled.address.clone();
        NodeReport {
            rtt,
            server,
            uptime_secs: field("uptime_in_seconds").parse().unwrap_or(0),
            mode: field("redis_mode"),
            cluster: field("cluster_enabled") == "1",
            facts,
            replid: field("master_replid"),
            replicas: field("connected_slaves").parse().unwrap_or(0),
            master_of,
            min_replicas_to_write: fields.contains_key("min_slaves_good_slaves"),
            persistence: persistence.to_owned(),
            tcp_port: field("tcp_port").parse().ok(),
            dialled,
            data_age: None,
            access: None,
        }
    }

    /// The data age of the epoch marker holding `marker` with `pttl_ms` left, for this node in
    /// database `db`.
    pub fn set_marker(&mut self, marker: Option<&str>, pttl_ms: i64, db: i64) {
        let lineage = votes::lineage(&self.facts.run_id, &self.replid, db);
        self.data_age = marker.and_then(|marker| votes::data_age(marker, pttl_ms, &lineage));
    }

    /// Whether this node's grants count for a lock whose longest ttl is `max_ttl`, and why not.
    pub fn standing(&self, max_ttl: Duration, allow_evicting: bool) -> Standing {
        if self.mode == "sentinel" {
            return Standing::Never(
                "this is a Sentinel, not a data node: name its group with \
                 redis+sentinel://HOST[:PORT],.../MASTER"
                    .to_owned(),
            );
        }
        if let Some(master) = &self.master_of {
            return Standing::Never(format!(
                "a replica (of {master}) refuses writes: list its master, or its Sentinel group"
            ));
        }
        if let Some(access) = self.access.as_ref().filter(|a| !a.denied.is_empty()) {
            return Standing::Never(format!(
                "the ACL user may not run what the engine needs: {}",
                access.denied.join(", ")
            ));
        }
        let no_lineage = self.facts.run_id.is_empty() || self.replid.is_empty();
        let data_age = match self.data_age {
            _ if no_lineage => DataAge::NoLineage,
            Some(age) => DataAge::Proven(age),
            // Judged as if just stamped: the eviction rule first, then the wait.
            None => DataAge::Proven(Duration::ZERO),
        };
        let proof = Proof {
            data_age,
            max_ttl: Duration::ZERO,
        };
        match votes::judge(&self.facts, proof, max_ttl, allow_evicting) {
            Ok(()) => Standing::Counts,
            Err(not) => match (not.ready_in, self.data_age) {
                (Some(wait), Some(_)) => Standing::CountsIn(wait, not.why),
                (Some(wait), None) => Standing::CountsIn(
                    wait,
                    "no epoch marker yet: it counts ttl + drift after the first contender \
                     stamps it"
                        .to_owned(),
                ),
                (None, _) => Standing::Never(not.why),
            },
        }
    }

    /// Whether a failover can replace this node's data with a replica's: it has replicas.
    pub fn fails_over(&self) -> bool {
        self.replicas > 0 || self.dialled.sentinel_group.is_some()
    }

    /// What kind of node this is, in words a user can act on; `abstain` is ttl + drift.
    pub fn kind(&self, abstain: Duration) -> String {
        let abstain = format!("~{:.1} s (ttl + drift)", abstain.as_secs_f64());
        let replicas = |n: u32| format!("{n} replica{}", if n == 1 { "" } else { "s" });
        if self.mode == "sentinel" {
            return "a Sentinel process, not a data node".to_owned();
        }
        if self.cluster {
            let slot = self
                .dialled
                .cluster_slot
                .map_or(String::new(), |slot| format!(" of the lock's slot {slot}"));
            return format!(
                "cluster shard: master {}{slot} with {}; after a failover the new master \
                 abstains for {abstain}",
                self.dialled.address,
                replicas(self.replicas)
            );
        }
        if let Some(master) = &self.master_of {
            return format!("a replica of {master}");
        }
        match (&self.dialled.sentinel_group, self.replicas) {
            (Some(group), n) => format!(
                "Sentinel group {group}: master {} with {}; after a failover the new master \
                 abstains for {abstain}",
                self.dialled.address,
                replicas(n)
            ),
            (None, 0) => "independent master".to_owned(),
            (None, n) => format!(
                "primary with {}: after a failover the new primary abstains for {abstain}",
                replicas(n)
            ),
        }
    }

    /// Why this node could break mutual exclusion or availability, as warnings.
    pub fn hazards(&self, allow_evicting: bool) -> Vec<String> {
        let mut hazards = Vec::new();
        if self.facts.may_evict() && !self.facts.maxmemory_policy.is_empty() {
            hazards.push(format!(
                "maxmemory-policy {} can evict lock keys; its votes {}",
                self.facts.maxmemory_policy,
                if allow_evicting {
                    "COUNT because --allow-evicting-nodes is set (unsafe)"
                } else {
                    "never count (use noeviction)"
                }
            ));
        }
        // A cluster master cut off from the majority of masters stops taking writes after the
        // cluster's node timeout, before a replica can be elected on the other side.
        if self.fails_over()
            && !self.min_replicas_to_write
            && self.master_of.is_none()
            && !self.cluster
        {
            hazards.push(
                "the master takes writes without any replica (min-replicas-to-write 0): if a \
                 network partition cuts it off and a replica is promoted, a leader cut off with \
                 it keeps renewing there (set min-replicas-to-write 1 and min-replicas-max-lag \
                 below the failover's down-after time)"
                    .to_owned(),
            );
        }
        if let Some(access) = &self.access {
            if !access.denied_optional.is_empty() {
                hazards.push(format!(
                    "the ACL user may not run {}: without PUBLISH/SUBSCRIBE waiters are not \
                     woken by a release and retry on their timer (grant the channel, e.g. \
                     &redlock:*); without TIME/HSET/HGETALL/HDEL/MULTI/EXEC candidates cannot rank \
                     themselves (every sidecar contends as an equal)",
                    access.denied_optional.join(", ")
                ));
            }
            if !access.checked {
                hazards.push(
                    "the server cannot check ACL permissions from a script (before Redis 7): \
                     run `status` to see that the scripts run"
                        .to_owned(),
                );
            }
        }
        if let Some(port) = self.proxied_port() {
            hazards.push(format!(
                "the server reports tcp_port {port}, not the port dialled: a proxy, NAT or \
                 port mapping is in between. Fine if it always reaches this one server (a \
                 re-dial to another is seen as a new lineage and abstains); a proxy that spreads \
                 one connection over several servers is not supported"
            ));
        }
        hazards
    }

    /// The server's `tcp_port`, when it is not the port dialled (plain TCP only).
    fn proxied_port(&self) -> Option<u16> {
        let dialled = self
            .dialled
            .address
            .rsplit_once(':')?
            .1
            .parse::<u16>()
            .ok()?;
        let reported = self.tcp_port?;
        (!self.dialled.tls && reported != dialled).then_some(reported)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MASTER: &str = "# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n\
        run_id:abc\r\ntcp_port:6379\r\nuptime_in_seconds:42\r\n# Replication\r\nrole:master\r\n\
        connected_slaves:0\r\nmaster_replid:r1\r\n# Memory\r\nmaxmemory_policy:noeviction\r\n\
        # Persistence\r\nrdb_saves:0\r\naof_enabled:0\r\n# Cluster\r\ncluster_enabled:0\r\n";

    fn dialled(address: &str) -> Dialled {
        Dialled {
            address: address.into(),
            ..Dialled::default()
        }
    }

    fn report(info: &str) -> NodeReport {
        NodeReport::from_info(info, Duration::from_millis(1), dialled("h:6379"))
    }

    const TTL: Duration = Duration::from_secs(10);

    #[test]
    fn an_independent_master_counts_once_its_marker_is_old_enough() {
        let mut r = report(MASTER);
        assert_eq!(r.server, "redis 7.0.15");
        assert_eq!(r.uptime_secs, 42);
        assert_eq!(r.persistence, "none seen");
        assert_eq!(r.kind(TTL), "independent master");
        assert!(r.hazards(false).is_empty(), "{:?}", r.hazards(false));
        assert!(matches!(r.standing(TTL, false), Standing::CountsIn(wait, _) if wait > TTL));
        let lineage = votes::lineage("abc", "r1", 0);
        let left = (votes::EPOCH_LIFETIME_MS - 20_000) as i64;
        r.set_marker(Some(&lineage), left, 0);
        assert_eq!(r.data_age, Some(Duration::from_secs(20)));
        assert_eq!(r.standing(TTL, false), Standing::Counts);
        r.set_marker(Some(&lineage), left, 1);
        assert_eq!(r.data_age, None, "another database's marker proves nothing");
    }

    #[test]
    fn a_missing_run_id_or_replid_never_counts() {
        for missing in ["run_id:abc\r\n", "master_replid:r1\r\n"] {
            let mut r = report(&MASTER.replace(missing, ""));
            r.data_age = Some(Duration::from_secs(3600));
            let Standing::Never(why) = r.standing(TTL, false) else {
                panic!("{missing} missing must never count");
            };
            assert!(why.contains("no run_id or master_replid"), "{why}");
        }
    }

    #[test]
    fn replicas_sentinels_and_denied_acls_never_count() {
        let replica = report(&MASTER.replace(
            "role:master",
            "role:slave\r\nmaster_host:10.0.0.1\r\nmaster_port:6380",
        ));
        assert_eq!(replica.kind(TTL), "a replica of 10.0.0.1:6380");
        assert!(
            matches!(replica.standing(TTL, false), Standing::Never(why) if why.contains("replica"))
        );
        let sentinel = report(&MASTER.replace("redis_mode:standalone", "redis_mode:sentinel"));
        assert!(
            matches!(sentinel.standing(TTL, false), Standing::Never(why) if why.contains("redis+sentinel://"))
        );
        let mut denied = report(MASTER);
        denied.data_age = Some(Duration::from_secs(3600));
        denied.access = Some(Access {
            denied: vec!["info server".into()],
            denied_optional: vec![],
            checked: true,
        });
        assert!(
            matches!(denied.standing(TTL, false), Standing::Never(why) if why.contains("info server"))
        );
    }

    #[test]
    fn a_primary_with_replicas_is_told_about_failovers_and_min_replicas_to_write() {
        let primary = report(&MASTER.replace("connected_slaves:0", "connected_slaves:2"));
        assert!(primary.fails_over());
        assert!(primary.kind(TTL).starts_with("primary with 2 replicas"));
        assert!(primary.hazards(false)[0].contains("min-replicas-to-write 0"));
        let guarded = report(&MASTER.replace(
            "connected_slaves:0",
            "connected_slaves:2\r\nmin_slaves_good_slaves:2",
        ));
        assert!(guarded.hazards(false).is_empty());
        let mut group = report(MASTER);
        group.dialled.sentinel_group = Some("mymaster".into());
        assert!(group
            .kind(TTL)
            .starts_with("Sentinel group mymaster: master h:6379"));
    }

    #[test]
    fn a_cluster_shard_is_a_voter_that_can_fail_over_and_fences_itself() {
        let mut shard = report(
            &MASTER
                .replace("cluster_enabled:0", "cluster_enabled:1")
                .replace("connected_slaves:0", "connected_slaves:1"),
        );
        shard.dialled.cluster_slot = Some(16287);
        shard.data_age = Some(Duration::from_secs(3600));
        assert_eq!(shard.standing(TTL, false), Standing::Counts);
        assert!(shard.fails_over());
        assert!(shard
            .kind(TTL)
            .starts_with("cluster shard: master h:6379 of the lock's slot 16287 with 1 replica"));
        assert!(
            shard.hazards(false).is_empty(),
            "{:?}",
            shard.hazards(false)
        );
    }

    #[test]
    fn a_port_other_than_the_one_dialled_means_something_in_between() {
        let r = NodeReport::from_info(MASTER, Duration::ZERO, dialled("proxy:7000"));
        assert!(r.hazards(false)[0].contains("tcp_port 6379"));
        let tls = NodeReport::from_info(
            MASTER,
            Duration::ZERO,
            Dialled {
                tls: true,
                ..dialled("h:6380")
            },
        );
        assert!(tls.hazards(false).is_empty(), "INFO shows no TLS port");
    }

    #[test]
    fn valkey_names_itself() {
        let r = report(&MASTER.replace(
            "redis_version:7.0.15",
            "redis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:8.1.1",
        ));
        assert_eq!(r.server, "valkey 8.1.1");
    }

    proptest::proptest! {
        #[test]
        fn any_info_text_gives_a_report_without_panicking(info in "(?s).{0,300}", port in 0u32..70000) {
            let r = NodeReport::from_info(&info, Duration::ZERO, dialled(&format!("h:{port}")));
            let _ = (r.standing(TTL, false), r.kind(TTL), r.hazards(true), r.fails_over());
        }
    }

    #[test]
    fn persistence_comes_from_info_persistence() {
        let aof = report(&MASTER.replace("aof_enabled:0", "aof_enabled:1"));
        assert_eq!(aof.persistence, "aof");
        let rdb = report(&MASTER.replace("rdb_saves:0", "rdb_saves:3"));
        assert_eq!(rdb.persistence, "rdb");
    }
}

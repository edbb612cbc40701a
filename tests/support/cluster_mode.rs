//! A real Redis Cluster (cluster mode) on loopback: masters and their replicas, built with the
//! cluster commands themselves (`CLUSTER ADDSLOTSRANGE`, `MEET`, `REPLICATE`), so it needs no
//! `redis-cli` and runs on whatever `$REDLOCK_TEST_REDIS_SERVER` names. A cluster node timeout
//! of 1 s makes failovers take a couple of seconds.

use std::time::Duration;

use super::{wait_until, RedisNode};

/// Bound on the cluster forming, and on a failover completing.
pub const CLUSTER_DEADLINE: Duration = Duration::from_secs(30);

/// The arguments every cluster node starts with (each has its own directory for nodes.conf).
const CLUSTER_ARGS: [&str; 8] = [
    "--cluster-enabled",
    "yes",
    "--cluster-config-file",
    "nodes.conf",
    "--cluster-node-timeout",
    "1000",
    "--repl-diskless-load",
    "swapdb",
];

/// `masters` masters splitting the slots evenly, each with `replicas` replicas.
pub struct ClusterMode {
    /// Masters at start, in slot order.
    pub masters: Vec<RedisNode>,
    /// `replicas[i]` replicate `masters[i]` at start.
    pub replicas: Vec<Vec<RedisNode>>,
}

impl ClusterMode {
    pub fn start(masters: usize, replicas: usize) -> ClusterMode {
        let start = || RedisNode::start_with(&CLUSTER_ARGS);
        let cluster = ClusterMode {
            masters: (0..masters).map(|_| start()).collect(),
            replicas: (0..masters)
                .map(|_| (0..replicas).map(|_| start()).collect())
                .collect(),
        };
        let per = 16384 / masters;
        for (i, master) in cluster.masters.iter().enumerate() {
            let first = (i * per).to_string();
            let last = if i + 1 == masters {
                16383
            } else {
                (i + 1) * per - 1
            }
            .to_string();
            assert_eq!(
                master.command(&["CLUSTER", "ADDSLOTSRANGE", &first, &last]),
                "OK"
            );
            master.command(&["CONFIG", "SET", "repl-diskless-sync-delay", "0"]);
        }
        let first = &cluster.masters[0];
        for node in cluster.all().skip(1) {
            let port = node.port().to_string();
            assert_eq!(
                first.command(&["CLUSTER", "MEET", "127.0.0.1", &port]),
                "OK"
            );
        }
        let total = cluster.all().count();
        wait_until(CLUSTER_DEADLINE, "every node knows every other", || {
            cluster.all().all(|n| {
                n.try_command(&["CLUSTER", "NODES"])
                    .is_ok_and(|nodes| nodes.lines().count() == total)
            })
        });
        for (master, replicas) in cluster.masters.iter().zip(&cluster.replicas) {
            let id = master.command(&["CLUSTER", "MYID"]);
            for replica in replicas {
                wait_until(CLUSTER_DEADLINE, "CLUSTER REPLICATE is accepted", || {
                    replica
                        .try_command(&["CLUSTER", "REPLICATE", &id])
                        .is_ok_and(|r| r == "OK")
                });
            }
        }
        wait_until(
            CLUSTER_DEADLINE,
            "the cluster is ok and replicas synced",
            || {
                cluster.all().all(|n| {
                    n.try_command(&["CLUSTER", "INFO"])
                        .is_ok_and(|info| info.contains("cluster_state:ok"))
                }) && cluster.replicas.iter().flatten().all(|r| {
                    r.try_command(&["INFO", "replication"])
                        .is_ok_and(|info| info.contains("master_link_status:up"))
                })
            },
        );
        cluster
    }

    /// Every node, masters first.
    pub fn all(&self) -> impl Iterator<Item = &RedisNode> {
        self.masters.iter().chain(self.replicas.iter().flatten())
    }

    /// The node that serves `slot` as master now: the one running master that answers a read
    /// of a key in that slot instead of redirecting it.
    pub fn master_of(&self, slot: u16) -> Option<&RedisNode> {
        let key = redlock_sidecar::redlock::cluster::epoch_key(slot);
        self.all().find(|n| {
            n.try_command(&["INFO", "replication"])
                .is_ok_and(|info| info.contains("role:master"))
                && n.try_command(&["GET", &key])
                    .is_ok_and(|r| !r.starts_with("(error)"))
        })
    }

    /// Waits until every running node agrees that the node on `port` is a master and the
    /// cluster is ok.
    pub fn wait_master(&self, port: u16) {
        let what = format!("127.0.0.1:{port} is a master and the cluster is ok");
        wait_until(CLUSTER_DEADLINE, &what, || {
            self.all().filter(|n| n.is_running()).all(|n| {
                let nodes = n.try_command(&["CLUSTER", "NODES"]).unwrap_or_default();
                let ok = n
                    .try_command(&["CLUSTER", "INFO"])
                    .is_ok_and(|info| info.contains("cluster_state:ok"));
                ok && nodes.lines().any(|l| {
                    l.contains(&format!("127.0.0.1:{port}@"))
                        && l.contains("master")
                        && !l.contains("fail")
                })
            })
        });
    }
}

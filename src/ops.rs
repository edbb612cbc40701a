//! Operator commands: `check` (is every node fit to vote?) and `status` (who holds a lock?).
//! Neither prints a password: nodes are shown as `host:port`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::redlock::votes::{self, Proof};
use crate::redlock::{quorum, Node, NodeError, NodeFacts, Redlock, EPOCH_KEY};

/// What `INFO`, `CONFIG GET` and the node's epoch marker tell about one node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeReport {
    /// Round-trip time of a `PING`.
    pub rtt: Duration,
    /// `redis_version`.
    pub version: String,
    /// `uptime_in_seconds`.
    pub uptime_secs: u64,
    /// `role` (master or slave).
    pub role: String,
    /// What the vote rules read: run id and eviction policy.
    pub facts: NodeFacts,
    /// `aof`, `rdb`, `aof+rdb`, `none` or `unknown`.
    pub persistence: String,
    /// How long the node has provably kept its data (its epoch marker's age); `None` when
    /// no contender has stamped the marker since the node last lost data.
    pub data_age: Option<Duration>,
}

impl NodeReport {
    /// Whether a grant from this node counts now, and why not (see `redlock::votes`).
    pub fn verdict(&self, max_ttl: Duration, allow_evicting: bool) -> Result<(), String> {
        let Some(data_age) = self.data_age else {
            if self.facts.may_evict() && !allow_evicting {
                return votes::judge(&self.facts, proof(Duration::ZERO), max_ttl, false)
                    .map_err(|e| e.why);
            }
            return Err("no epoch marker yet: the first contender stamps it".to_owned());
        };
        votes::judge(&self.facts, proof(data_age), max_ttl, allow_evicting).map_err(|e| e.why)
    }

    /// Why this node could break mutual exclusion, if it could.
    pub fn hazards(&self, allow_evicting: bool) -> Vec<String> {
        let mut hazards = Vec::new();
        if self.role != "master" {
            hazards.push(format!(
                "role is {}: lock nodes must be independent masters",
                self.role
            ));
        }
        if self.facts.may_evict() {
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
        hazards
    }
}

fn proof(data_age: Duration) -> Proof {
    Proof {
        data_age: votes::DataAge::Proven(data_age),
        max_ttl: Duration::ZERO,
    }
}

/// Reads the report of one node, each call bounded by `timeout`. Read-only: it never
/// stamps the epoch marker.
pub async fn node_report(node: &Node, timeout: Duration) -> Result<NodeReport, NodeError> {
    let start = Instant::now();
    node.command::<String>(&redis::cmd("PING"), timeout).await?;
    let rtt = start.elapsed();
    let info: String = node.command(&redis::cmd("INFO"), timeout).await?;
    let fields: HashMap<&str, &str> = info
        .lines()
        .filter_map(|line| line.trim_end().split_once(':'))
        .collect();
    let field = |name: &str| fields.get(name).copied().unwrap_or("unknown").to_owned();
    let aof = fields.get("aof_enabled") == Some(&"1");
    let save: Option<Vec<String>> = node
        .command(redis::cmd("CONFIG").arg("GET").arg("save"), timeout)
        .await
        .ok();
    let rdb = save
        .as_ref()
        .map(|pair| pair.get(1).is_some_and(|s| !s.is_empty()));
    let persistence = match (aof, rdb) {
        (true, Some(true)) => "aof+rdb",
        (true, _) => "aof",
        (false, Some(true)) => "rdb",
        (false, Some(false)) => "none",
        (false, None) => "unknown",
    };
    let facts = NodeFacts {
        run_id: field("run_id"),
        maxmemory_policy: field("maxmemory_policy"),
    };
    let marker: Option<String> = node
        .command(redis::cmd("GET").arg(EPOCH_KEY), timeout)
        .await?;
    let pttl: i64 = node
        .command(redis::cmd("PTTL").arg(EPOCH_KEY), timeout)
        .await?;
    let lineage = votes::lineage(&facts.run_id, &field("master_replid"), node.db());
    let data_age = marker
        .as_deref()
        .and_then(|marker| votes::data_age(marker, pttl, &lineage));
    Ok(NodeReport {
        rtt,
        version: field("redis_version"),
        uptime_secs: field("uptime_in_seconds").parse().unwrap_or(0),
        role: field("role"),
        facts,
        persistence: persistence.to_owned(),
        data_age,
    })
}

/// Logs a warning for every node that could break mutual exclusion (run at startup).
pub async fn warn_about_nodes(redlock: Redlock) {
    let timeout = redlock.config().connect_timeout;
    let allow_evicting = redlock.config().allow_evicting_nodes;
    for node in redlock.nodes() {
        match node_report(node, timeout).await {
            Ok(report) => {
                for hazard in report.hazards(allow_evicting) {
                    warn!(node = %node.label(), "{hazard}");
                }
            }
            Err(err) => warn!(node = %node.label(), error = %err, "node not reachable at startup"),
        }
    }
}

/// `check`: a table of every node; `true` when a quorum is reachable.
pub async fn check(redlock: &Redlock) -> (String, bool) {
    let cfg = redlock.config();
    let timeout = cfg.connect_timeout;
    let reports =
        futures_util::future::join_all(redlock.nodes().iter().map(|n| node_report(n, timeout)))
            .await;
    let mut out = format!(
        "{:<28} {:<9} {:>9} {:<8} {:>9} {:>10} {:<11} {:<16} {:<7} {}\n",
        "NODE",
        "REACHABLE",
        "RTT",
        "VERSION",
        "UPTIME",
        "DATA AGE",
        "PERSISTENCE",
        "MAXMEMORY-POLICY",
        "ROLE",
        "VOTE COUNTS"
    );
    let mut reachable = 0;
    let max_ttl = cfg.longest_ttl();
    for (node, report) in redlock.nodes().iter().zip(&reports) {
        match report {
            Ok(r) => {
                reachable += 1;
                let _ = writeln!(
                    out,
                    "{:<28} {:<9} {:>9} {:<8} {:>8}s {:>10} {:<11} {:<16} {:<7} {}",
                    node.label(),
                    "yes",
                    format!("{:.2}ms", r.rtt.as_secs_f64() * 1000.0),
                    r.version,
                    r.uptime_secs,
                    r.data_age
                        .map_or("-".to_owned(), |age| format!("{}s", age.as_secs())),
                    r.persistence,
                    r.facts.maxmemory_policy,
                    r.role,
                    match r.verdict(max_ttl, cfg.allow_evicting_nodes) {
                        Ok(()) => "yes".to_owned(),
                        Err(why) => format!("no ({why})"),
                    }
                );
                for hazard in r.hazards(cfg.allow_evicting_nodes) {
                    let _ = writeln!(out, "  warning: {hazard}");
                }
            }
            Err(err) => {
                let _ = writeln!(out, "{:<28} {:<9} {err}", node.label(), "no");
            }
        }
    }
    let needed = quorum(redlock.nodes().len());
    let ok = reachable >= needed;
    let _ = writeln!(
        out,
        "{reachable} of {} nodes reachable; quorum is {needed}: {}",
        redlock.nodes().len(),
        if ok { "OK" } else { "NO QUORUM" }
    );
    (out, ok)
}

/// `status`: each node's view of the lock and the quorum's; `true` when a quorum answered.
pub async fn status(redlock: &Redlock) -> (String, bool) {
    let views = redlock.inspect().await;
    let mut out = format!(
        "{:<28} {:<24} {:>10} {:>16}\n",
        "NODE", "HOLDER", "PTTL", "FENCING COUNTER"
    );
    let mut votes: HashMap<String, usize> = HashMap::new();
    let mut answered = 0;
    for (label, view) in &views {
        match view {
            Ok(v) => {
                answered += 1;
                let holder = v.holder.clone().unwrap_or_else(|| "-".to_owned());
                *votes.entry(holder.clone()).or_default() += 1;
                let pttl = v
                    .pttl
                    .map_or("-".to_owned(), |d| format!("{}ms", d.as_millis()));
                let _ = writeln!(out, "{label:<28} {holder:<24} {pttl:>10} {:>16}", v.fence);
            }
            Err(err) => {
                let _ = writeln!(out, "{label:<28} error: {err}");
            }
        }
    }
    let needed = quorum(views.len());
    let holder = votes
        .iter()
        .find(|(holder, n)| **n >= needed && holder.as_str() != "-")
        .map(|(holder, _)| holder.clone());
    let _ = writeln!(
        out,
        "quorum view of {:?}: {}",
        redlock.config().lock,
        match (&holder, answered >= needed) {
            (Some(holder), _) => format!("held by {holder}"),
            (None, true) => "not held by anyone on a quorum".to_owned(),
            (None, false) => format!("unknown: only {answered} of {} nodes answered", views.len()),
        }
    );
    (out, answered >= needed)
}

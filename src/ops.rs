//! Operator commands: `check` (is every node fit to vote?) and `status` (who holds a lock?).
//! Neither prints a password: nodes are shown as `host:port`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::redlock::{drift, quorum, Node, NodeError, Redlock};

/// What `INFO` and `CONFIG GET` tell about one node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// Round-trip time of a `PING`.
    pub rtt: Duration,
    /// `redis_version`.
    pub version: String,
    /// `uptime_in_seconds`.
    pub uptime_secs: u64,
    /// `role` (master or slave).
    pub role: String,
    /// `maxmemory_policy`.
    pub maxmemory_policy: String,
    /// `aof`, `rdb`, `aof+rdb`, `none` or `unknown`.
    pub persistence: String,
}

impl NodeFacts {
    /// Whether a vote from this node counts for a lock of `ttl` (the delayed-restart rule).
    pub fn vote_counts(&self, ttl: Duration) -> bool {
        Duration::from_secs(self.uptime_secs.saturating_sub(1)) >= ttl + drift(ttl)
    }

    /// Why this node could break mutual exclusion, if it could.
    pub fn hazards(&self) -> Vec<String> {
        let mut hazards = Vec::new();
        if self.role != "master" {
            hazards.push(format!(
                "role is {}: lock nodes must be independent masters",
                self.role
            ));
        }
        if self.maxmemory_policy != "noeviction" {
            hazards.push(format!(
                "maxmemory-policy {} can evict lock keys or fencing counters; use noeviction",
                self.maxmemory_policy
            ));
        }
        hazards
    }
}

/// Reads the facts of one node, each call bounded by `timeout`.
pub async fn node_facts(node: &Node, timeout: Duration) -> Result<NodeFacts, NodeError> {
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
    Ok(NodeFacts {
        rtt,
        version: field("redis_version"),
        uptime_secs: field("uptime_in_seconds").parse().unwrap_or(0),
        role: field("role"),
        maxmemory_policy: field("maxmemory_policy"),
        persistence: persistence.to_owned(),
    })
}

/// Logs a warning for every node that could break mutual exclusion (run at startup).
pub async fn warn_about_nodes(redlock: Redlock) {
    let timeout = redlock.config().connect_timeout;
    for node in redlock.nodes() {
        match node_facts(node, timeout).await {
            Ok(facts) => {
                for hazard in facts.hazards() {
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
    let facts =
        futures_util::future::join_all(redlock.nodes().iter().map(|n| node_facts(n, timeout)))
            .await;
    let mut out = format!(
        "{:<28} {:<9} {:>9} {:<8} {:>9} {:<11} {:<16} {:<7} {}\n",
        "NODE",
        "REACHABLE",
        "RTT",
        "VERSION",
        "UPTIME",
        "PERSISTENCE",
        "MAXMEMORY-POLICY",
        "ROLE",
        "VOTE COUNTS"
    );
    let mut reachable = 0;
    for (node, facts) in redlock.nodes().iter().zip(&facts) {
        match facts {
            Ok(f) => {
                reachable += 1;
                let _ = writeln!(
                    out,
                    "{:<28} {:<9} {:>9} {:<8} {:>8}s {:<11} {:<16} {:<7} {}",
                    node.label(),
                    "yes",
                    format!("{:.2}ms", f.rtt.as_secs_f64() * 1000.0),
                    f.version,
                    f.uptime_secs,
                    f.persistence,
                    f.maxmemory_policy,
                    f.role,
                    if f.vote_counts(cfg.ttl) {
                        "yes"
                    } else {
                        "no (restarted within ttl + drift)"
                    }
                );
                for hazard in f.hazards() {
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

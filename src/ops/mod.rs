//! Operator commands: `check` (is every node fit to vote, and is the set safe?) and `status`
//! (who holds a lock?). Neither prints a password: nodes are shown as `host:port`.
//!
//! ## Behaviour
//! - `check` reads each node with `PING`, `INFO`, a `GET`/`PTTL` of the epoch marker and the
//!   read-only ACL probe (`Redlock::probe_access`); never `CONFIG`, which managed services
//!   refuse, and nothing that writes.
//! - Each node gets a kind (independent master, primary with replicas, Sentinel group,
//!   cluster shard, replica, a Sentinel dialled as a node), whether its vote counts and why
//!   not, and warnings; the set gets one verdict line ([`verdict::overall`]).
//! - At startup the same report is logged as warnings for every node whose vote does not
//!   count or that could break mutual exclusion.

mod report;
mod verdict;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

use tracing::warn;

pub use report::{Dialled, NodeReport, Standing};
pub use verdict::{overall, Voter};

use crate::clock;
use crate::redlock::votes::required_data_age;
use crate::redlock::{quorum, Access, Node, NodeError, NodeErrorKind, Redlock};

/// Reads the report of node `index`, each call bounded by `timeout`. Read-only: it never
/// stamps the epoch marker.
pub async fn node_report(
    redlock: &Redlock,
    index: usize,
    timeout: Duration,
) -> Result<NodeReport, NodeError> {
    let node = &redlock.nodes()[index];
    // A round trip to report, not a deadline.
    let start = clock::Stopwatch::start();
    node.command::<String>(&redis::cmd("PING"), timeout).await?;
    let rtt = start.elapsed();
    let info: String = node.command(&redis::cmd("INFO"), timeout).await?;
    let dialled = Dialled {
        address: node
            .facts()
            .map_or_else(|| node.label().to_owned(), |f| f.address.clone()),
        sentinel_group: node.sentinel_master().map(str::to_owned),
        tls: node.is_tls(),
        cluster_slot: None,
    };
    let mut report = NodeReport::from_info(&info, rtt, dialled);
    if report.mode == "sentinel" {
        return Ok(report);
    }
    if report.cluster {
        report.dialled.cluster_slot = Some(node.slot());
    }
    let epoch_key = node.epoch_key();
    let marker: Option<String> = node
        .command(redis::cmd("GET").arg(&epoch_key), timeout)
        .await?;
    let pttl: i64 = node
        .command(redis::cmd("PTTL").arg(&epoch_key), timeout)
        .await?;
    report.set_marker(marker.as_deref(), pttl, node.db());
    report.access = match redlock.probe_access(index, timeout).await {
        Ok(access) => Some(access),
        // A server or proxy that cannot run the scripts at all: no vote, and why.
        Err(err) if matches!(err.kind, NodeErrorKind::Other | NodeErrorKind::Protocol) => {
            Some(Access {
                denied: vec![format!("the scripts ({})", err.message)],
                denied_optional: Vec::new(),
                checked: true,
            })
        }
        Err(err) => return Err(err),
    };
    Ok(report)
}

/// Logs a warning for every node whose vote does not count or that could break mutual
/// exclusion (run at startup).
pub async fn warn_about_nodes(redlock: Redlock) {
    let cfg = redlock.config();
    let timeout = cfg.connect_timeout;
    for (index, node) in redlock.nodes().iter().enumerate() {
        match node_report(&redlock, index, timeout).await {
            Ok(report) => {
                if let Standing::Never(why) =
                    report.standing(cfg.longest_ttl(), cfg.allow_evicting_nodes)
                {
                    warn!(node = %node.label(), "vote does not count: {why}");
                }
                for hazard in report.hazards(cfg.allow_evicting_nodes) {
                    warn!(node = %node.label(), "{hazard}");
                }
            }
            Err(err) if err.is_acl_denial() => warn!(
                node = %node.label(),
                "vote does not count: the ACL user may not run what the engine needs: {}",
                err.message
            ),
            Err(err) => warn!(node = %node.label(), error = %err, "node not reachable at startup"),
        }
    }
}

/// Why a node whose votes count could still break mutual exclusion, for the verdict.
fn unsafe_because(report: &NodeReport, allow_evicting: bool) -> Option<String> {
    if report.facts.may_evict() && allow_evicting {
        return Some(format!(
            "maxmemory-policy {} may evict lock keys and --allow-evicting-nodes counts its votes",
            report.facts.maxmemory_policy
        ));
    }
    if report.fails_over() && !report.min_replicas_to_write && !report.cluster {
        return Some(
            "under a network partition, a failover can leave a cut-off leader renewing on the \
             old master (min-replicas-to-write is 0; see docs/redis.md)"
                .to_owned(),
        );
    }
    None
}

/// `check`: a table of every node, each node's kind and standing, and the verdict for the set;
/// `true` when a quorum of nodes is reachable and able to vote (now, or once their data is old
/// enough).
pub async fn check(redlock: &Redlock) -> (String, bool) {
    let cfg = redlock.config();
    let timeout = cfg.connect_timeout;
    let reports = futures_util::future::join_all(
        (0..redlock.nodes().len()).map(|index| node_report(redlock, index, timeout)),
    )
    .await;
    let mut out = format!(
        "{:<28} {:<9} {:>9} {:<13} {:>9} {:>10} {:<11} {:<16} {:<7} {}\n",
        "NODE",
        "REACHABLE",
        "RTT",
        "SERVER",
        "UPTIME",
        "DATA AGE",
        "PERSISTENCE",
        "MAXMEMORY-POLICY",
        "ROLE",
        "VOTE COUNTS"
    );
    let mut reachable = 0;
    let max_ttl = cfg.longest_ttl();
    let abstain = required_data_age(max_ttl);
    let mut voters = Vec::new();
    for (node, report) in redlock.nodes().iter().zip(&reports) {
        let voter = match report {
            Ok(r) => {
                reachable += 1;
                reachable_row(&mut out, node, r, max_ttl, cfg.allow_evicting_nodes)
            }
            Err(err) if err.is_acl_denial() => {
                let why = format!(
                    "the ACL user may not run what the engine needs: {}",
                    err.message
                );
                let _ = writeln!(out, "{:<28} {:<9} {err}", node.label(), "denied");
                let _ = writeln!(out, "  vote does not count: {why}");
                Voter {
                    label: node.label().to_owned(),
                    standing: Some(Standing::Never(why)),
                    fails_over: false,
                    unsafe_because: None,
                }
            }
            Err(err) => {
                let _ = writeln!(out, "{:<28} {:<9} {err}", node.label(), "no");
                Voter {
                    label: node.label().to_owned(),
                    standing: None,
                    fails_over: node.sentinel_master().is_some(),
                    unsafe_because: None,
                }
            }
        };
        voters.push(voter);
    }
    let needed = quorum(redlock.nodes().len());
    let able = voters
        .iter()
        .filter(|v| matches!(v.standing, Some(Standing::Counts | Standing::CountsIn(..))))
        .count();
    let _ = writeln!(
        out,
        "{reachable} of {} nodes reachable; quorum is {needed}: {}",
        redlock.nodes().len(),
        if reachable >= needed {
            "OK"
        } else {
            "NO QUORUM"
        }
    );
    let ok = able >= needed;
    let _ = writeln!(out, "verdict: {}", overall(&voters, abstain));
    (out, ok)
}

/// `check`'s lines for a node that answered (`r`): its row, its kind, whether and when its
/// vote counts, its warnings; and the node as the verdict sees it.
fn reachable_row(
    out: &mut String,
    node: &Node,
    r: &NodeReport,
    max_ttl: Duration,
    allow_evicting_nodes: bool,
) -> Voter {
    let standing = r.standing(max_ttl, allow_evicting_nodes);
    let _ = writeln!(
        out,
        "{:<28} {:<9} {:>9} {:<13} {:>8}s {:>10} {:<11} {:<16} {:<7} {}",
        node.label(),
        "yes",
        format!("{:.2}ms", r.rtt.as_secs_f64() * 1000.0),
        r.server,
        r.uptime_secs,
        r.data_age
            .map_or("-".to_owned(), |age| format!("{}s", age.as_secs())),
        r.persistence,
        r.facts.maxmemory_policy,
        r.facts.role,
        match &standing {
            Standing::Counts => "yes".to_owned(),
            Standing::CountsIn(wait, _) => format!("not yet (in {:.1}s)", wait.as_secs_f64()),
            Standing::Never(_) => "no".to_owned(),
        }
    );
    let _ = writeln!(out, "  {}", r.kind(required_data_age(max_ttl)));
    match &standing {
        Standing::Counts => {}
        Standing::CountsIn(wait, why) => {
            let _ = writeln!(out, "  vote counts in {:.1} s: {why}", wait.as_secs_f64());
        }
        Standing::Never(why) => {
            let _ = writeln!(out, "  vote does not count: {why}");
        }
    }
    for hazard in r.hazards(allow_evicting_nodes) {
        let _ = writeln!(out, "  warning: {hazard}");
    }
    Voter {
        label: node.label().to_owned(),
        fails_over: r.fails_over(),
        unsafe_because: unsafe_because(r, allow_evicting_nodes),
        standing: Some(standing),
    }
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

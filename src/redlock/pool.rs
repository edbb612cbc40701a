//! The nodes many locks share: one connection per node for every lock of a process.
//!
//! ## Behaviour
//! - An [`Engine`] holds one [`Node`] per configured node; every [`super::Redlock`] built on it
//!   ([`super::Redlock::on`]) calls, subscribes (see `transport::hub`) and renews over those
//!   connections. Each lock keeps its own per-node write order (`KeyWrite`), so a release still
//!   waits only for its own lock's writes.
//! - **Cluster mode.** A cluster-mode node is reached at the master of one hash slot, so its
//!   connection serves the locks of that slot only: there the engine keeps one group of nodes
//!   per slot in use, shared by the names of that slot and dropped with the last of them. A
//!   node's mode is learnt on its first connection; until every node is known not to be a
//!   cluster, locks get a group of their slot (the safe choice: right in both modes).
//! - **Renewals go together**: the locks of a group renew through its batches (see
//!   `batch`), one script per node carrying every renewal that is due.
//! - Cheap to clone; the connections close when the engine and its last lock are dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::batch::Batches;
use super::transport::{cluster, ConnectSettings, Node, NodeSpec, Voter};
use super::{ConfigError, RedlockConfig};

/// Nodes shared by many locks. Cheap to clone.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Shared>,
}

struct Shared {
    specs: Vec<NodeSpec>,
    settings: ConnectSettings,
    /// The group of every lock while no node is in cluster mode.
    shared: Arc<[Voter]>,
    /// Its renewal batches.
    shared_batches: Arc<Batches>,
    /// Per node: whether it is a cluster (learnt from its connection's facts).
    cluster: Mutex<Vec<Option<bool>>>,
    /// Cluster mode (or not known yet): the group of each slot in use.
    by_slot: Mutex<HashMap<u16, Group>>,
}

/// The nodes of one slot and their renewal batches, kept while a lock uses them.
struct Group {
    nodes: Weak<[Voter]>,
    batches: Weak<Batches>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let labels: Vec<&str> = self.inner.shared.iter().map(|node| node.label()).collect();
        write!(f, "Engine({labels:?})")
    }
}

impl Engine {
    /// An engine on `cfg`'s nodes (its lock name is not used). Nothing is connected until the
    /// first lock opens (a sidecar whose app takes no lock keeps no connection for it).
    pub fn new(cfg: &RedlockConfig) -> Result<Engine, ConfigError> {
        let settings = ConnectSettings {
            connect_timeout: cfg.connect_timeout,
            slot: 0,
            stamp_slots: cfg.stamp_cluster_markers,
        };
        let shared = nodes(&cfg.nodes, settings)?;
        Ok(Engine {
            inner: Arc::new(Shared {
                cluster: Mutex::new(vec![None; cfg.nodes.len()]),
                specs: cfg.nodes.clone(),
                settings,
                shared_batches: Arc::new(Batches::new(&shared)),
                shared,
                by_slot: Mutex::default(),
            }),
        })
    }

    /// Connects every node now (bounded by `timeout`), so that the nodes' mode is known before
    /// the first lock opens: until then, locks get a group of their own slot.
    pub async fn connect(&self, timeout: Duration) {
        let connects = self.inner.shared.iter().map(|node| node.connect(timeout));
        futures_util::future::join_all(connects).await;
    }

    /// Whether `nodes` are the ones this engine connects to (same servers, same order).
    pub fn serves(&self, nodes: &[NodeSpec]) -> bool {
        nodes.len() == self.inner.specs.len()
            && nodes
                .iter()
                .zip(&self.inner.specs)
                .all(|(a, b)| a.identity() == b.identity())
    }

    /// The nodes a lock whose keys hash to `slot` uses, and their renewal batches.
    pub(super) fn nodes_for(&self, slot: u16) -> Result<(Arc<[Voter]>, Arc<Batches>), ConfigError> {
        let inner = &self.inner;
        let all_direct = {
            let mut known = inner.cluster.lock().unwrap_or_else(|e| e.into_inner());
            if known.iter().any(Option::is_none) {
                // Learns the modes (in the background; a no-op for nodes already connected).
                warm_up(&inner.shared, inner.settings.connect_timeout);
            }
            for (mode, node) in known.iter_mut().zip(inner.shared.iter()) {
                if let Some(facts) = node.facts() {
                    *mode = Some(facts.cluster);
                }
            }
            known.iter().all(|mode| *mode == Some(false))
        };
        if all_direct {
            return Ok((inner.shared.clone(), inner.shared_batches.clone()));
        }
        let mut groups = inner.by_slot.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(group) = groups.get(&slot) {
            if let (Some(nodes), Some(batches)) = (group.nodes.upgrade(), group.batches.upgrade()) {
                return Ok((nodes, batches));
            }
        }
        let settings = ConnectSettings {
            slot,
            ..inner.settings
        };
        let group = nodes(&inner.specs, settings)?;
        warm_up(&group, inner.settings.connect_timeout);
        let batches = Arc::new(Batches::new(&group));
        groups.retain(|_, group| group.nodes.strong_count() > 0);
        groups.insert(
            slot,
            Group {
                nodes: Arc::downgrade(&group),
                batches: Arc::downgrade(&batches),
            },
        );
        Ok((group, batches))
    }

    /// How many groups of nodes are open (1 without cluster mode; tests and metrics).
    pub fn groups(&self) -> usize {
        let groups = self.inner.by_slot.lock().unwrap_or_else(|e| e.into_inner());
        1 + groups
            .values()
            .filter(|g| g.nodes.strong_count() > 0)
            .count()
    }
}

/// The hash slot of lock `name`'s keys.
pub(super) fn slot_of(name: &str) -> u16 {
    cluster::key_slot(&format!("redlock:{{{name}}}"))
}

/// One node per spec with `settings`.
pub(super) fn nodes(
    specs: &[NodeSpec],
    settings: ConnectSettings,
) -> Result<Arc<[Voter]>, ConfigError> {
    specs
        .iter()
        .map(|spec| Node::new(spec.clone(), settings).map(|node| Arc::new(node) as Voter))
        .collect::<Result<Vec<_>, _>>()
        .map(Arc::from)
        .map_err(|e| ConfigError::new("--redis", e.to_string()))
}

/// Connects to every node in the background (a per-node call is bounded by the node timeout,
/// which may be shorter than a connection takes to establish).
pub(super) fn warm_up(nodes: &Arc<[Voter]>, timeout: Duration) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    for index in 0..nodes.len() {
        let nodes = Arc::downgrade(nodes);
        runtime.spawn(async move {
            if let Some(nodes) = nodes.upgrade() {
                let _ = nodes[index]
                    .command::<String>(&redis::cmd("PING"), timeout)
                    .await;
            }
        });
    }
}

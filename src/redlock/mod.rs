//! The Redlock engine: a lock held on a quorum of independent Redis masters.
//!
//! It knows nothing of HTTP, metrics or Kubernetes; observers hook in through
//! [`Observer`].
//!
//! ## Behaviour
//! - **Acquire** sends `SET key value NX PX ttl` (inside [`scripts::ACQUIRE`]) to every node at
//!   once, each call under the per-node timeout, and decides as soon as a quorum for or against
//!   is certain. The value is `identity:` plus 128 random bits, new for every acquisition.
//!   Success needs a quorum of *counted* votes and a positive validity
//!   (`ttl − elapsed − drift`); otherwise, once every node has answered or timed out, our
//!   key is deleted again (silently, without waking waiters) on every node that may have it.
//!   Deletes (clean-up, release) wait on each node until no call that may write our key
//!   there is in flight, so a late `SET` cannot land after them (see `Order`).
//! - **Votes that count.** A grant counts only from a node that proves, in the same atomic
//!   script, that it has kept its data for the longest ttl in use plus drift; nodes that may
//!   evict keys never count unless allowed. See [`votes`].
//! - **One node set per lock.** Every grant and renewal records the fingerprint of the servers
//!   the contender's nodes reach (run ids and databases, not addresses); a round that sees
//!   another set's live record refuses to lead. See [`votes`], rule 7.
//! - **Fencing tokens.** See [`fencing`].
//! - **Extend** runs an owner-checked `PEXPIRE` on all nodes and succeeds only on a quorum
//!   within the lease's remaining validity. A node that lost our key gets it back
//!   (`SET NX`, never over another holder's key) only after the quorum has been proven.
//!   A quorum that shows another holder's key or none ends the lease for good
//!   ([`LockError::Superseded`]).
//! - **Clocks.** Validity and deadlines are on [`clock`] (`CLOCK_BOOTTIME`), so time the host
//!   spends suspended counts against the lease.
//! - **Release** deletes the key only where it still holds our value, and `PUBLISH`es on
//!   the lock's channel in the same script. A won round announces itself from Rust on the
//!   acquisition channel (see [`push`]). Waiters listen on every node; while the lock is held
//!   they run no round until reads of the key's expiry, a keyspace event or an announcement say
//!   it may be free (see [`standby`]).
//! - **Slot records** (`guard --slot`): written beside the lock by its holder, owner-checked;
//!   read on every node. See `slot`.
//! - Nothing here panics on what a node answers: garbage, wrong passwords, dead hosts
//!   and hung nodes all end as typed [`Vote::Failed`] entries within the node timeout.

mod acquire;
mod batch;
mod config;
mod error;
mod fanout;
pub mod fencing;
pub(crate) mod finish;
mod pool;
pub mod push;
mod renew;
mod scripts;
mod slot;
pub mod standby;
#[cfg(test)]
mod tests;
pub mod timing;
pub mod transport;
pub mod votes;
mod wait;

pub use redlock_core::{round, tenure};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, SystemTime};

use redis::Script;
use tokio::sync::{broadcast, watch};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::clock;
pub use config::{RedlockConfig, DEFAULT_FENCE_RETENTION};
pub use error::{ConfigError, LockError, Vote, Votes};
use fanout::{Answers, KeyWrite, Order};
pub use pool::Engine;
pub use round::acquire::identity_of;
pub use slot::{slot_seen, SlotSeen};
pub use timing::{drift, quorum, validity, RECORD_LIFE};
pub use transport::{cluster, secrets, sentinel};
pub use transport::{
    info_field, ClientCert, ConnectSettings, Credentials, Node, NodeError, NodeErrorKind,
    NodeFacts, NodeSpec, Voter, EPOCH_KEY, FACTS_MAX_AGE,
};
use votes::NodeSet;
pub use wait::HolderSeen;

static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(scripts::ACQUIRE));
static RAISE_FENCE: LazyLock<Script> = LazyLock::new(|| Script::new(scripts::RAISE_FENCE));
static EXTEND: LazyLock<Script> = LazyLock::new(|| Script::new(scripts::EXTEND));
static RESTORE: LazyLock<Script> = LazyLock::new(|| Script::new(scripts::RESTORE));
static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(scripts::RELEASE));
static CLEANUP: LazyLock<Script> = LazyLock::new(|| Script::new(scripts::CLEANUP));
static READ: LazyLock<Script> = LazyLock::new(|| Script::new(scripts::READ));
static PROBE: LazyLock<Script> = LazyLock::new(|| Script::new(scripts::PROBE));
static RECORD_SLOT: LazyLock<Script> = LazyLock::new(|| Script::new(scripts::RECORD_SLOT));

/// The kind of request sent to a node (a metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `SET NX PX` with the data-age proof.
    Acquire,
    /// Raising the fencing counter.
    Fence,
    /// Owner-checked `PEXPIRE` (and restore).
    Extend,
    /// Owner-checked `DEL` and `PUBLISH`.
    Release,
    /// Reading the holder.
    Read,
    /// Reading or writing a schedule slot's record (`guard --slot`).
    Slot,
}

impl Op {
    /// Every op, for pre-initialising metrics.
    pub const ALL: [Op; 6] = [
        Op::Acquire,
        Op::Fence,
        Op::Extend,
        Op::Release,
        Op::Read,
        Op::Slot,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Acquire => "acquire",
            Op::Fence => "fence",
            Op::Extend => "extend",
            Op::Release => "release",
            Op::Read => "read",
            Op::Slot => "slot",
        }
    }
}

/// Hooks for metrics; every method has a no-op default.
pub trait Observer: Send + Sync + 'static {
    /// One call to node `index` finished after `elapsed`.
    fn node_call(
        &self,
        _index: usize,
        _op: Op,
        _elapsed: Duration,
        _result: Result<(), NodeErrorKind>,
    ) {
    }
    /// Node `index`'s vote was or was not counted in an acquire round.
    fn node_counted(&self, _index: usize, _counted: bool) {}
    /// A round refused to lead: another contender of the lock lists other nodes.
    fn node_set_conflict(&self) {}
    /// Node `index`'s push subscription came up or went away.
    fn subscription(&self, _index: usize, _up: bool) {}
    /// A waiting standby read the nodes; `fallback` when a push subscription was missing.
    fn standby_read(&self, _fallback: bool) {}
    /// A waiting standby left a read to others (they take turns past 50 waiters).
    fn standby_read_skipped(&self) {}
    /// A waiting standby counted `waiters` subscribers of the lock's channel on a node.
    fn waiters_counted(&self, _waiters: u64) {}
    /// Whether this contender subscribes to release announcements on node `index` (past
    /// 50 waiters, only about 50 do).
    fn release_watch(&self, _index: usize, _watching: bool) {}
}

/// An observer that records nothing.
pub struct NoObserver;
impl Observer for NoObserver {}

/// A held lock: proof of one acquisition. Pass it back to extend or release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    value: String,
    /// The fencing token of this acquisition: greater than every earlier one.
    pub fencing_token: u64,
    /// When the acquiring round started.
    pub acquired_at: clock::Deadline,
    /// Wall-clock time of the acquisition, for display.
    pub since: SystemTime,
    /// The end of validity: no node keeps our key past it without a renewal.
    pub valid_until: clock::Deadline,
    /// Renewals so far: every [`PROOF_EVERY`]th one asks the nodes for their data-age proof.
    renewals: u32,
}

/// A renewal asks the nodes to prove their data age (their `INFO`, see `scripts::EXTEND`)
/// once in this many renewals (about every 9 ttl at the default cadence), and on every renewal
/// while a node's last verdict was "not counted", so that a node that recovers is reported
/// counted again within a renewal: extend votes need no proof, it only keeps the nodes'
/// reported health current, and it is the costliest part.
pub const PROOF_EVERY: u32 = 27;

impl Lease {
    /// The validity left at `now`.
    pub fn remaining_at(&self, now: clock::Deadline) -> Duration {
        self.valid_until.saturating_duration_since(now)
    }

    /// The value written to the nodes (identity and random part).
    pub fn value(&self) -> &str {
        &self.value
    }
}

/// The holder as one node sees it (for `status`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeView {
    /// The holder's identity, if the key is set.
    pub holder: Option<String>,
    /// The key's remaining ttl, if set.
    pub pttl: Option<Duration>,
    /// The fencing counter.
    pub fence: u64,
}

/// What a node's ACL lets this client run of what the engine needs (see [`Redlock::probe_access`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Access {
    /// Denied commands without which no vote can be given (`evalsha`, `info`, a lock key...).
    pub denied: Vec<String>,
    /// Denied commands that only slow hand-overs (the release announcement).
    pub denied_optional: Vec<String>,
    /// False when the server cannot tell (before Redis 7): nothing is known.
    pub checked: bool,
}

/// A Redlock client for one lock name. Cheap to clone; clones share connections.
#[derive(Clone)]
pub struct Redlock {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: RedlockConfig,
    key: String,
    fence_key: String,
    ttl_key: String,
    node_set_key: String,
    /// Holds the fingerprint while the register and the node-set record need no refresh (see
    /// `scripts`).
    refreshed_key: String,
    /// Shared with the other locks of an [`Engine`], or this lock's own.
    nodes: Arc<[Voter]>,
    /// On an [`Engine`]: the renewal batches shared with its other locks (see [`batch`]).
    batches: Option<Arc<batch::Batches>>,
    /// Per node: whether its last judged answer did not count (see [`PROOF_EVERY`]).
    uncounted: Vec<std::sync::atomic::AtomicBool>,
    /// When a node-set conflict was last logged.
    conflict_logged_at: std::sync::Mutex<Option<clock::Deadline>>,
    /// Another set's record the last round judged stale, and when (see
    /// `round::acquire::StaleRecord`): the next round may replace it.
    stale_record: std::sync::Mutex<Option<(round::StaleRecord, clock::Deadline)>>,
    /// The highest fencing counter seen, so the next candidate token starts above it.
    fence_seen: AtomicU64,
    /// The longest ttl (ms) any node's max-ttl register ever reported for this lock.
    max_ttl_seen: AtomicU64,
    /// How much later (ms) each round of a wait starts: a candidate that defers to a
    /// preferred one (see `candidacy`); 0 for everyone else.
    handicap_ms: AtomicU64,
    /// What the nodes push (see [`push`]); made when first listened to or waited on (see
    /// [`Inner::pushes`]).
    pushes: std::sync::OnceLock<broadcast::Sender<push::Push>>,
    /// How many waiters the lock had when last counted (see `standby`), announced with an
    /// acquisition: older versions spread their rounds by it (this one takes counts only
    /// from the nodes).
    waiters_seen: AtomicU64,
    /// This lock's last acquisition announcement: when, and the most subscribers it reached
    /// on one node (`None` until a node answered), see [`push::worth_announcing`].
    last_announcement: std::sync::Mutex<Option<(clock::Deadline, Option<u64>)>>,
    /// Per node: whether its push subscription is live.
    subscribed: watch::Sender<Vec<bool>>,
    /// Per node: whether this contender subscribes to release announcements there (see
    /// `standby::watches_releases`).
    watching_releases: watch::Sender<Vec<bool>>,
    /// Per node: calls in flight that may still write our key there (acquire, restore,
    /// an extend whose answer may call for a restore). Deletes wait for them to settle.
    key_writes: Vec<watch::Sender<usize>>,
    listening: std::sync::Once,
    observer: Arc<dyn Observer>,
    stop: CancellationToken,
    _stop_on_drop: DropGuard,
}

impl Redlock {
    /// Validates `cfg` and prepares one connection per node. Inside a Tokio runtime, each
    /// node is sent a `PING` at once (bounded by the connect timeout) so that connections
    /// are made before the first round needs them; a node that is down now can join later.
    pub fn new(cfg: RedlockConfig, observer: Arc<dyn Observer>) -> Result<Redlock, ConfigError> {
        cfg.validate()?;
        let settings = ConnectSettings {
            connect_timeout: cfg.connect_timeout,
            slot: pool::slot_of(&cfg.lock),
            stamp_slots: cfg.stamp_cluster_markers,
        };
        let nodes = pool::nodes(&cfg.nodes, settings)?;
        pool::warm_up(&nodes, cfg.connect_timeout);
        Ok(Redlock::with_nodes(cfg, observer, nodes, None))
    }

    /// [`Redlock::new`] on the connections of `engine`, shared with every other lock built
    /// on it (see [`Engine`]), renewing in the engine's batches; `cfg.nodes` must be the
    /// engine's.
    pub fn on(
        engine: &Engine,
        cfg: RedlockConfig,
        observer: Arc<dyn Observer>,
    ) -> Result<Redlock, ConfigError> {
        Redlock::on_engine(engine, cfg, observer, true)
    }

    /// [`Redlock::on`], renewing on its own rather than in the engine's batches: a leadership
    /// lock's renewal goes out when it is due, never held back for others' (its step-down
    /// deadline is its own).
    pub fn on_unbatched(
        engine: &Engine,
        cfg: RedlockConfig,
        observer: Arc<dyn Observer>,
    ) -> Result<Redlock, ConfigError> {
        Redlock::on_engine(engine, cfg, observer, false)
    }

    fn on_engine(
        engine: &Engine,
        cfg: RedlockConfig,
        observer: Arc<dyn Observer>,
        batched: bool,
    ) -> Result<Redlock, ConfigError> {
        cfg.validate()?;
        if !engine.serves(&cfg.nodes) {
            return Err(ConfigError::new(
                "--redis",
                "the lock's nodes are not the engine's",
            ));
        }
        let (nodes, batches) = engine.nodes_for(pool::slot_of(&cfg.lock))?;
        Ok(Redlock::with_nodes(
            cfg,
            observer,
            nodes,
            batched.then_some(batches),
        ))
    }

    fn with_nodes(
        cfg: RedlockConfig,
        observer: Arc<dyn Observer>,
        nodes: Arc<[Voter]>,
        batches: Option<Arc<batch::Batches>>,
    ) -> Redlock {
        let stop = CancellationToken::new();
        let name = &cfg.lock;
        Redlock {
            inner: Arc::new(Inner {
                key: format!("redlock:{{{name}}}"),
                fence_key: fencing::counter_key(name, cfg.fence_namespace.as_deref()),
                ttl_key: format!("redlock:{{{name}}}:ttl"),
                node_set_key: format!("redlock:{{{name}}}:nodes"),
                refreshed_key: format!("redlock:{{{name}}}:refreshed"),
                conflict_logged_at: std::sync::Mutex::new(None),
                stale_record: std::sync::Mutex::new(None),
                fence_seen: AtomicU64::new(0),
                max_ttl_seen: AtomicU64::new(0),
                handicap_ms: AtomicU64::new(0),
                key_writes: (0..nodes.len()).map(|_| watch::channel(0).0).collect(),
                uncounted: (0..nodes.len()).map(|_| Default::default()).collect(),
                subscribed: watch::channel(vec![false; nodes.len()]).0,
                watching_releases: watch::channel(vec![false; nodes.len()]).0,
                nodes,
                batches,
                pushes: std::sync::OnceLock::new(),
                waiters_seen: AtomicU64::new(0),
                last_announcement: std::sync::Mutex::new(None),
                listening: std::sync::Once::new(),
                observer,
                _stop_on_drop: stop.clone().drop_guard(),
                stop,
                cfg,
            }),
        }
    }

    /// The node set as known now: the `--node-set` name, or the servers the nodes' last
    /// connections reached (see [`votes::NodeSet`]). No I/O.
    pub fn node_set(&self) -> NodeSet {
        match &self.inner.cfg.node_set {
            Some(name) => NodeSet::named(name),
            None => {
                NodeSet::of_servers(self.inner.nodes.iter().map(|node| node.server()).collect())
            }
        }
    }

    /// [`Redlock::node_set`] for a round about to start: nodes never reached, or whose
    /// connection was dropped, are connected first (concurrently, bounded by the node
    /// timeout), so the set names the servers that answer now.
    async fn round_node_set(&self) -> NodeSet {
        if self.inner.cfg.node_set.is_none() {
            let timeout = self.inner.cfg.node_timeout;
            let unknown = self
                .inner
                .nodes
                .iter()
                .filter(|node| node.server_stale())
                .map(|node| node.connect(timeout));
            futures_util::future::join_all(unknown).await;
        }
        self.node_set()
    }

    /// From now on, each round of a wait starts `handicap` late (zero: at once), so that a
    /// preferred contender's round comes first when the lock comes free.
    pub fn set_handicap(&self, handicap: Duration) {
        let ms = u64::try_from(handicap.as_millis()).unwrap_or(u64::MAX);
        self.inner.handicap_ms.store(ms, Ordering::Relaxed);
    }

    /// The handicap in force (see [`Redlock::set_handicap`]).
    pub fn handicap(&self) -> Duration {
        Duration::from_millis(self.inner.handicap_ms.load(Ordering::Relaxed))
    }

    /// The configuration in force.
    pub fn config(&self) -> &RedlockConfig {
        &self.inner.cfg
    }

    /// The node connections, in configured order.
    pub fn nodes(&self) -> &[Voter] {
        &self.inner.nodes
    }

    /// What every node says about the lock: holder, remaining ttl, fencing counter.
    pub async fn inspect(&self) -> Vec<(String, Result<NodeView, NodeError>)> {
        let mut answers =
            self.fan_out::<(String, i64, String)>(Op::Read, Order::Free, &READ, Vec::new());
        let mut views: Vec<Option<Result<NodeView, NodeError>>> =
            vec![None; self.inner.nodes.len()];
        while let Some((index, answer)) = answers.recv().await {
            views[index] = Some(answer.map(|((value, pttl, fence), _)| NodeView {
                holder: (!value.is_empty()).then(|| identity_of(&value).to_owned()),
                pttl: u64::try_from(pttl).ok().map(Duration::from_millis),
                fence: fence.parse().unwrap_or(0),
            }));
        }
        self.inner
            .nodes
            .iter()
            .zip(views)
            .map(|(node, view)| {
                (
                    node.label().to_owned(),
                    view.unwrap_or_else(|| Err(lost_answer())),
                )
            })
            .collect()
    }

    /// Asks node `index` which commands the engine needs its ACL user may not run, with this
    /// lock's own keys and channel (see `scripts::PROBE`); writes nothing. A user who may not
    /// run scripts at all is told by the node's `NOPERM`, reported as denied `evalsha`.
    pub async fn probe_access(&self, index: usize, timeout: Duration) -> Result<Access, NodeError> {
        let inner = &self.inner;
        let channel = inner.channels(index).released;
        let answer = inner.nodes[index]
            .eval::<(Vec<String>, Vec<String>, i64)>(&PROBE, &inner.keys(), &[&channel], timeout)
            .await;
        match answer {
            Ok(((denied, denied_optional, checked), _)) => Ok(Access {
                denied,
                denied_optional,
                checked: checked == 1,
            }),
            Err(err) if err.is_acl_denial() => Ok(Access {
                denied: vec![err.message],
                denied_optional: Vec::new(),
                checked: true,
            }),
            Err(err) => Err(err),
        }
    }

    /// Starts, once, one task per node that listens for release announcements.
    fn listen_for_releases(&self) {
        self.inner.listening.call_once(|| {
            for index in 0..self.inner.nodes.len() {
                let inner = Arc::downgrade(&self.inner);
                let stop = self.inner.stop.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        _ = push::listen(inner, index) => {}
                    }
                });
            }
        });
    }

    /// Reads the lock key on every node with plain commands (`GET` + `PTTL`, pipelined; no
    /// script): per node, the holder's identity and the key's remaining time, `None` if no key.
    async fn read_keys(&self) -> Vec<Result<Option<(String, Duration)>, NodeError>> {
        self.read_everywhere(&self.inner.key, Op::Read)
            .await
            .into_iter()
            .map(|result| {
                result.map(|read| read.map(|(value, pttl)| (identity_of(&value).to_owned(), pttl)))
            })
            .collect()
    }

    /// Announces a won round on every node's acquisition channel (see [`push::Acquired`]), in
    /// the background: waiters stand down and learn the new holder without asking. The
    /// announcement carries the number of waiters last counted; `PUBLISH` answers with the
    /// number it reached, kept for the next announcement. Skipped while nobody listens (see
    /// [`push::worth_announcing`]).
    fn announce_acquired(&self, lease: &Lease) {
        let now = clock::Deadline::now();
        {
            let mut last = self
                .inner
                .last_announcement
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if !push::worth_announcing(*last, now) {
                return;
            }
            *last = Some((now, None));
        }
        let inner = self.inner.clone();
        let message = push::Acquired {
            identity: inner.cfg.identity.clone(),
            fencing_token: lease.fencing_token,
            validity: lease.remaining_at(now),
            waiters: inner
                .waiters_seen
                .load(std::sync::atomic::Ordering::Relaxed),
        }
        .encode();
        tokio::spawn(async move {
            let timeout = inner.cfg.node_timeout;
            let inner = &inner;
            let message = &message;
            let announce = inner
                .nodes
                .iter()
                .enumerate()
                .map(|(index, node)| async move {
                    let channel = inner.channels(index).acquired;
                    let reached = node
                        .command::<u64>(redis::cmd("PUBLISH").arg(&channel).arg(message), timeout)
                        .await;
                    let reached = reached.ok()?;
                    inner
                        .waiters_seen
                        .store(reached, std::sync::atomic::Ordering::Relaxed);
                    Some(reached)
                });
            let most = futures_util::future::join_all(announce)
                .await
                .into_iter()
                .flatten()
                .max();
            let mut last = inner
                .last_announcement
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if matches!(*last, Some((at, _)) if at == now) {
                *last = Some((now, most));
            }
        });
    }

    fn label_votes(&self, votes: Vec<Option<Vote>>) -> Votes {
        Votes(
            self.inner
                .nodes
                .iter()
                .zip(votes)
                .filter_map(|(node, vote)| Some((node.label().to_owned(), vote?)))
                .collect(),
        )
    }
}

fn lost_answer() -> NodeError {
    NodeError {
        kind: NodeErrorKind::Other,
        message: "no answer".to_owned(),
    }
}

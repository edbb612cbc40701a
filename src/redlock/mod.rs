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
pub mod cluster;
mod error;
pub mod fencing;
mod node;
pub mod push;
mod scripts;
pub mod secrets;
pub mod sentinel;
mod slot;
pub mod standby;
pub mod timing;
pub mod votes;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant, SystemTime};

use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use redis::Script;
use tokio::sync::{broadcast, watch};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::clock;
pub use acquire::HolderSeen;
use error::Tally;
pub use error::{ConfigError, LockError, Vote, Votes};
pub use node::{
    info_field, ClientCert, ConnectSettings, Credentials, Node, NodeError, NodeErrorKind,
    NodeFacts, NodeSpec, FACTS_MAX_AGE,
};
pub use slot::{slot_seen, SlotSeen};
pub use timing::{drift, quorum, validity};
use votes::{NodeSet, Proof};

/// The key of each node's epoch marker (see [`votes`]): the lineage `<run id>:<replication
/// id>:<db>`, stamped with an expiry its age is read from.
pub const EPOCH_KEY: &str = "redlock:epoch";

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

/// Everything the engine needs; validated by [`RedlockConfig::validate`].
#[derive(Clone, Debug)]
pub struct RedlockConfig {
    /// The lock name; keys are `redlock:{name}` and `redlock:{name}:fence`. It must not start
    /// with `}` (the keys' cluster hash tag would be empty).
    pub lock: String,
    /// Who we are, written into the lock value so others can see the holder.
    pub identity: String,
    /// The voters: independent Redis masters (no replication between them), or Sentinel
    /// groups, each followed to its current master.
    pub nodes: Vec<NodeSpec>,
    /// How long a key lives without renewal.
    pub ttl: Duration,
    /// The longest ttl any contender of this lock uses, when ttls differ (see [`votes`]).
    pub max_ttl: Option<Duration>,
    /// How long a fencing counter is kept after its last use; then the Unix-ms floor of the
    /// next token takes over (see [`fencing`]).
    pub fence_retention: Duration,
    /// The name of the node set recorded beside the lock; `None`: the fingerprint of the
    /// servers `nodes` reach (see [`votes::NodeSet`]).
    pub node_set: Option<String>,
    /// Count votes of nodes whose `maxmemory-policy` may evict lock keys (unsafe).
    pub allow_evicting_nodes: bool,
    /// Whether a waiter subscribes to the lock key's keyspace events too (see [`push`]).
    pub keyspace_events: bool,
    /// Whether connecting to a cluster-mode node stamps the epoch markers of every slot (see
    /// [`cluster`]); the operator commands, which never write, turn it off.
    pub stamp_cluster_markers: bool,
    /// Tests only: pretend this client's wall clock is off by this many milliseconds, to
    /// check the fencing guarantee under clock skew.
    #[doc(hidden)]
    pub wall_clock_skew_ms: i64,
    /// Bound on each call to each node.
    pub node_timeout: Duration,
    /// Bound on making a connection.
    pub connect_timeout: Duration,
    /// First retry delay after a failed round; it grows up to `retry_max`.
    pub retry_delay: Duration,
    /// Longest wait between two attempts while waiting; a standby with no live push
    /// subscription reads the nodes at least this often.
    pub retry_max: Duration,
}

impl RedlockConfig {
    /// A config with the defaults for everything but the lock, identity and nodes.
    pub fn new(lock: impl Into<String>, identity: impl Into<String>, nodes: Vec<NodeSpec>) -> Self {
        RedlockConfig {
            lock: lock.into(),
            identity: identity.into(),
            nodes,
            ttl: Duration::from_secs(10),
            max_ttl: None,
            fence_retention: DEFAULT_FENCE_RETENTION,
            node_set: None,
            allow_evicting_nodes: false,
            keyspace_events: false,
            stamp_cluster_markers: true,
            wall_clock_skew_ms: 0,
            node_timeout: Duration::from_millis(50),
            connect_timeout: Duration::from_secs(1),
            retry_delay: Duration::from_millis(200),
            retry_max: Duration::from_secs(1),
        }
    }

    /// Checks the rules the algorithm depends on; the error names the flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.lock.is_empty() {
            return Err(ConfigError::new("--lock", "must not be empty"));
        }
        if self.lock.len() > 200
            || self
                .lock
                .chars()
                .any(|c| c.is_control() || c.is_whitespace())
        {
            return Err(ConfigError::new(
                "--lock",
                "must be at most 200 characters without spaces or control characters",
            ));
        }
        if self.lock.starts_with('}') {
            // The keys' hash tag `{NAME}` would be empty: in Redis Cluster each key would hash
            // to its own slot, and every script fail with CROSSSLOT. Braces elsewhere keep a
            // non-empty tag shared by all the lock's keys, and work everywhere.
            return Err(ConfigError::new(
                "--lock",
                "must not start with '}': in Redis Cluster the keys' hash tag {NAME} would be empty",
            ));
        }
        if self.identity.is_empty() || self.identity.chars().any(char::is_control) {
            return Err(ConfigError::new(
                "--identity",
                "must be non-empty printable text",
            ));
        }
        if self.nodes.is_empty() {
            return Err(ConfigError::new("--redis", "at least one node is required"));
        }
        let mut seen = std::collections::HashSet::new();
        for node in &self.nodes {
            if !seen.insert(node.identity()) {
                return Err(ConfigError::new(
                    "--redis",
                    format!(
                        "node {} is listed twice; the nodes must be independent masters",
                        node.label()
                    ),
                ));
            }
        }
        // Bounded before any rule below computes with them.
        timing::check_bounds(self)?;
        if self.node_set.as_ref().is_some_and(|name| {
            name.is_empty() || name.len() > 200 || name.chars().any(char::is_control)
        }) {
            return Err(ConfigError::new(
                "--node-set",
                "must be 1 to 200 printable characters",
            ));
        }
        if self.node_timeout.is_zero() {
            return Err(ConfigError::new("--node-timeout", "must be greater than 0"));
        }
        let drift = drift(self.ttl);
        // A round that uses the whole node timeout must still leave most of the ttl.
        if self.ttl < (self.node_timeout + drift) * 4 {
            return Err(ConfigError::new(
                "--ttl",
                format!(
                    "{} is too short: it must be at least 4 × (node timeout {} + drift {})",
                    humantime::format_duration(self.ttl),
                    humantime::format_duration(self.node_timeout),
                    humantime::format_duration(drift)
                ),
            ));
        }
        if let Some(max_ttl) = self.max_ttl.filter(|max| *max < self.ttl) {
            return Err(ConfigError::new(
                "--max-ttl",
                format!(
                    "{} is shorter than --ttl {}: it is the longest ttl any contender uses",
                    humantime::format_duration(max_ttl),
                    humantime::format_duration(self.ttl)
                ),
            ));
        }
        if self.fence_retention < self.longest_ttl() * 2 {
            return Err(ConfigError::new(
                "--fence-retention",
                format!(
                    "{} is too short: it must be at least twice the longest ttl ({})",
                    humantime::format_duration(self.fence_retention),
                    humantime::format_duration(self.longest_ttl())
                ),
            ));
        }
        if self.retry_delay.is_zero() || self.retry_delay > self.retry_max.max(self.retry_delay) {
            return Err(ConfigError::new("--retry-delay", "must be greater than 0"));
        }
        Ok(())
    }
}

impl RedlockConfig {
    /// The longest ttl this contender knows to be in use: `--max-ttl`, else `--ttl`.
    pub fn longest_ttl(&self) -> Duration {
        self.max_ttl.unwrap_or(self.ttl).max(self.ttl)
    }
}

/// Default of [`RedlockConfig::fence_retention`]: a day, so client clocks would have to be
/// off by a day for the Unix-ms floor to fail once a counter is gone.
pub const DEFAULT_FENCE_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// A held lock: proof of one acquisition. Pass it back to extend or release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    value: String,
    /// The fencing token of this acquisition: greater than every earlier one.
    pub fencing_token: u64,
    /// When the acquiring round started (monotonic).
    pub acquired_at: Instant,
    /// Wall-clock time of the acquisition, for display.
    pub since: SystemTime,
    /// The end of validity (monotonic): no node keeps our key past it without a renewal.
    pub valid_until: Instant,
    /// Renewals so far: every [`PROOF_EVERY`]th one asks the nodes for their data-age proof.
    renewals: u32,
}

/// A renewal asks the nodes to prove their data age (their `INFO`, see `scripts::EXTEND`)
/// once in this many renewals (about every 9 ttl at the default cadence): extend votes need no
/// proof, it only keeps the nodes' reported health current, and it is the costliest part.
pub const PROOF_EVERY: u32 = 27;

impl Lease {
    /// The validity left at `now`.
    pub fn remaining_at(&self, now: Instant) -> Duration {
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
    nodes: Vec<Node>,
    /// When a node-set conflict was last logged.
    conflict_logged_at: std::sync::Mutex<Option<Instant>>,
    /// The highest fencing counter seen, so the next candidate token starts above it.
    fence_seen: AtomicU64,
    /// The longest ttl (ms) any node's max-ttl register ever reported for this lock.
    max_ttl_seen: AtomicU64,
    /// What the nodes push (see [`push`]).
    pushes: broadcast::Sender<push::Push>,
    /// How many waiters the lock had when last counted (see `standby`), announced with an
    /// acquisition: older versions spread their rounds by it (this one takes counts only
    /// from the nodes).
    waiters_seen: AtomicU64,
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

/// `{status, epoch_age_ms, max_ttl_ms}`.
type ExtendReply = (i64, i64, u64);

/// One node's answer to a script, with the facts of the connection it came on.
type Answer<T> = (usize, Result<(T, Arc<NodeFacts>), NodeError>);

/// The answers of one round, in the order they come.
///
/// Dropped while calls are still running (a round decided at quorum), it hands them to a
/// task: every request is finished, so no node is left with a half-done call and every
/// `KeyWrite` is released when its answer arrives.
struct Answers<T: Send + 'static> {
    calls: FuturesUnordered<BoxFuture<'static, Answer<T>>>,
}

impl<T: Send + 'static> Answers<T> {
    /// The next answer, or `None` once every node has answered or timed out.
    async fn recv(&mut self) -> Option<Answer<T>> {
        self.calls.next().await
    }
}

impl<T: Send + 'static> Drop for Answers<T> {
    fn drop(&mut self) {
        if self.calls.is_empty() {
            return;
        }
        let mut calls = std::mem::take(&mut self.calls);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { while calls.next().await.is_some() {} });
        }
    }
}

/// How a call is ordered against the others that touch our key on the same node.
///
/// A round is decided at quorum, so a slow node's `SET` may not even be sent when the
/// holder releases. Were the delete sent first, the late `SET` would leave a key that
/// blocks that node's vote for a whole ttl. Deletes therefore wait (bounded by the node
/// timeout) until no call that may write the key there is in flight; from then on, the
/// connection's own order keeps them behind it. And a delete is never given up before it is
/// sent (see `Inner::delete_on`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Order {
    /// Touches nothing a delete could race with.
    Free,
    /// May write our key: tracked until its answer arrives.
    MayWrite,
    /// Deletes our key: sent only after the node's writes have settled.
    AfterWrites,
}

/// One call that may still write our key on a node; counted until dropped.
struct KeyWrite {
    inner: Arc<Inner>,
    index: usize,
}

impl KeyWrite {
    fn start(inner: &Arc<Inner>, index: usize) -> KeyWrite {
        inner.key_writes[index].send_modify(|n| *n += 1);
        KeyWrite {
            inner: inner.clone(),
            index,
        }
    }
}

impl Drop for KeyWrite {
    fn drop(&mut self) {
        self.inner.key_writes[self.index].send_modify(|n| *n -= 1);
    }
}

impl Inner {
    /// The keys every script gets, in the order `scripts` documents.
    fn keys(&self) -> [&str; 5] {
        [
            &self.key,
            &self.fence_key,
            &self.ttl_key,
            EPOCH_KEY,
            &self.node_set_key,
        ]
    }

    /// The lock's channels on node `index` (they are scoped by its database).
    fn channels(&self, index: usize) -> push::Channels {
        push::Channels::new(&self.key, self.nodes[index].db())
    }

    /// Arguments 4 on of the scripts that keep the fencing counter: its retention in ms.
    fn retention_ms(&self) -> String {
        self.cfg.fence_retention.as_millis().to_string()
    }

    /// Waits until no call that may write our key on node `index` is in flight. Each such
    /// call is bounded by the node timeout, and so is this wait.
    async fn key_writes_settled(&self, index: usize) {
        if *self.key_writes[index].borrow() == 0 {
            return;
        }
        let mut writes = self.key_writes[index].subscribe();
        let _ = tokio::time::timeout(self.cfg.node_timeout, writes.wait_for(|n| *n == 0)).await;
    }

    /// Runs `script`, a delete of our key, on node `index` once the node's writes have settled,
    /// and waits for its answer for up to twice the node timeout. The call runs in its own
    /// task, bounded by the ttl: the client sheds a request whose caller has given up before
    /// its connection wrote it, and a delete so shed (on a busy client) left our key, and so a
    /// lost round's split or an old holder's lock, for a whole ttl.
    async fn delete_on<T: redis::FromRedisValue + Send + 'static>(
        self: Arc<Self>,
        index: usize,
        script: &'static Script,
        args: Arc<[String]>,
    ) -> Result<(T, Arc<NodeFacts>), NodeError> {
        let wait = self.cfg.node_timeout.saturating_mul(2);
        let bound = self.cfg.ttl.max(wait);
        let call = tokio::spawn(async move {
            self.key_writes_settled(index).await;
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            self.nodes[index]
                .eval::<T>(script, &self.keys(), &args, bound)
                .await
        });
        match tokio::time::timeout(wait, call).await {
            Ok(Ok(answer)) => answer,
            _ => Err(NodeError::timeout(wait)),
        }
    }
}

impl Redlock {
    /// Validates `cfg` and prepares one connection per node. Inside a Tokio runtime, each
    /// node is sent a `PING` at once (bounded by the connect timeout) so that connections
    /// are made before the first round needs them; a node that is down now can join later.
    pub fn new(cfg: RedlockConfig, observer: Arc<dyn Observer>) -> Result<Redlock, ConfigError> {
        cfg.validate()?;
        let settings = ConnectSettings {
            connect_timeout: cfg.connect_timeout,
            slot: cluster::key_slot(&format!("redlock:{{{}}}", cfg.lock)),
            stamp_slots: cfg.stamp_cluster_markers,
        };
        let nodes = cfg
            .nodes
            .iter()
            .map(|spec| Node::new(spec.clone(), settings))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ConfigError::new("--redis", e.to_string()))?;
        let stop = CancellationToken::new();
        let name = &cfg.lock;
        let redlock = Redlock {
            inner: Arc::new(Inner {
                key: format!("redlock:{{{name}}}"),
                fence_key: format!("redlock:{{{name}}}:fence"),
                ttl_key: format!("redlock:{{{name}}}:ttl"),
                node_set_key: format!("redlock:{{{name}}}:nodes"),
                conflict_logged_at: std::sync::Mutex::new(None),
                fence_seen: AtomicU64::new(0),
                max_ttl_seen: AtomicU64::new(0),
                key_writes: (0..nodes.len()).map(|_| watch::channel(0).0).collect(),
                subscribed: watch::channel(vec![false; nodes.len()]).0,
                watching_releases: watch::channel(vec![false; nodes.len()]).0,
                nodes,
                pushes: broadcast::channel(1024).0,
                waiters_seen: AtomicU64::new(0),
                listening: std::sync::Once::new(),
                observer,
                _stop_on_drop: stop.clone().drop_guard(),
                stop,
                cfg,
            }),
        };
        redlock.warm_up();
        Ok(redlock)
    }

    /// Connects to every node in the background (a per-node call is bounded by the node
    /// timeout, which may be shorter than a connection takes to establish).
    fn warm_up(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        for index in 0..self.inner.nodes.len() {
            let inner = Arc::downgrade(&self.inner);
            runtime.spawn(async move {
                if let Some(inner) = inner.upgrade() {
                    let timeout = inner.cfg.connect_timeout;
                    let _ = inner.nodes[index]
                        .command::<String>(&redis::cmd("PING"), timeout)
                        .await;
                }
            });
        }
    }

    /// The node set as known now: the `--node-set` name, or the servers the nodes' last
    /// connections reached (see [`votes::NodeSet`]). No I/O.
    pub fn node_set(&self) -> NodeSet {
        match &self.inner.cfg.node_set {
            Some(name) => NodeSet::named(name),
            None => NodeSet::of_servers(self.inner.nodes.iter().map(Node::server).collect()),
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

    /// The configuration in force.
    pub fn config(&self) -> &RedlockConfig {
        &self.inner.cfg
    }

    /// The node connections, in configured order.
    pub fn nodes(&self) -> &[Node] {
        &self.inner.nodes
    }

    /// Sends `script` to every node at once; answers arrive in the order they come. The
    /// calls are polled by whoever awaits the answers, with no task hop on the hot path; see
    /// [`Answers`] for what happens to calls still running when the answers are dropped.
    fn fan_out<T>(
        &self,
        op: Op,
        order: Order,
        script: &'static Script,
        args: Vec<String>,
    ) -> Answers<T>
    where
        T: redis::FromRedisValue + Send + 'static,
    {
        let args: Arc<[String]> = args.into();
        self.fan_out_each(op, order, script, |_| args.clone())
    }

    /// [`Redlock::fan_out`] with arguments of each node's own (`args(index)`).
    fn fan_out_each<T>(
        &self,
        op: Op,
        order: Order,
        script: &'static Script,
        args: impl Fn(usize) -> Arc<[String]>,
    ) -> Answers<T>
    where
        T: redis::FromRedisValue + Send + 'static,
    {
        let calls = (0..self.inner.nodes.len())
            .map(|index| {
                let inner = self.inner.clone();
                let args = args(index);
                // Counted now, so that a delete issued right after this returns waits for it.
                let write = (order == Order::MayWrite).then(|| KeyWrite::start(&inner, index));
                let call: BoxFuture<'static, Answer<T>> = Box::pin(async move {
                    let start = Instant::now();
                    let result = if order == Order::AfterWrites {
                        inner.clone().delete_on::<T>(index, script, args).await
                    } else {
                        let args: Vec<&str> = args.iter().map(String::as_str).collect();
                        inner.nodes[index]
                            .eval::<T>(script, &inner.keys(), &args, inner.cfg.node_timeout)
                            .await
                    };
                    drop(write);
                    let outcome = result.as_ref().map(|_| ()).map_err(|e| e.kind);
                    inner
                        .observer
                        .node_call(index, op, start.elapsed(), outcome);
                    (index, result)
                });
                call
            })
            .collect();
        Answers { calls }
    }

    /// Extends `lease` to a fresh ttl on a quorum, within its remaining validity.
    ///
    /// Returns the lease with its new validity. Nodes that lost our key get it back only
    /// after the quorum is proven, and only where nobody else has the key. When a quorum
    /// shows another holder's key or none at all, the lease is gone for good:
    /// [`LockError::Superseded`], so the holder steps down at once instead of retrying.
    pub async fn extend(&self, lease: &Lease) -> Result<Lease, LockError> {
        let cfg = &self.inner.cfg;
        let expired = || LockError::Expired {
            lock: cfg.lock.clone(),
        };
        let start = clock::now();
        if start >= lease.valid_until {
            return Err(expired());
        }
        let args = vec![
            lease.value.clone(),
            cfg.ttl.as_millis().to_string(),
            lease.fencing_token.to_string(),
            self.inner.retention_ms(),
            self.node_set().fingerprint,
            u8::from(lease.renewals.wrapping_add(1).is_multiple_of(PROOF_EVERY)).to_string(),
        ];
        // An answer "key missing" calls for a restore: each node counts as writing our key
        // until its answer has been handled.
        let mut writes: Vec<Option<KeyWrite>> = (0..self.inner.nodes.len())
            .map(|index| Some(KeyWrite::start(&self.inner, index)))
            .collect();
        let mut answers =
            self.fan_out::<ExtendReply>(Op::Extend, Order::Free, &EXTEND, args.clone());
        let mut tally = Tally::new(self.inner.nodes.len());
        let expiry = clock::sleep_until(lease.valid_until);
        tokio::pin!(expiry);
        while !tally.decided() {
            let (index, answer) = tokio::select! {
                biased;
                answer = answers.recv() => match answer { Some(a) => a, None => break },
                _ = &mut expiry => return Err(expired()),
            };
            tally.record(index, self.extend_vote(index, answer));
        }
        if !tally.won() {
            let contrary = tally
                .votes
                .iter()
                .filter(|v| matches!(v, Some(Vote::HeldBy(_) | Vote::Missing)))
                .count();
            let votes = self.label_votes(tally.votes);
            let lock = cfg.lock.clone();
            return Err(if contrary >= quorum(self.inner.nodes.len()) {
                LockError::Superseded { lock, votes }
            } else {
                LockError::Lost { lock, votes }
            });
        }
        if clock::now() >= lease.valid_until {
            return Err(expired());
        }
        let Some(valid) = validity(cfg.ttl, clock::now().saturating_duration_since(start)) else {
            return Err(expired());
        };
        // A node that lost our key (data loss) gets it back, now the quorum is proven. The
        // slowest nodes answer after the quorum, so their answers are awaited in the background.
        let args: Arc<[String]> = args.into();
        for (index, vote) in tally.votes.iter().enumerate() {
            if vote == &Some(Vote::Missing) {
                self.spawn_on(index, &RESTORE, args.clone());
            }
            if vote.is_some() {
                writes[index] = None;
            }
        }
        let this = self.clone();
        tokio::spawn(async move {
            while let Some((index, answer)) = answers.recv().await {
                if this.extend_vote(index, answer) == Vote::Missing {
                    this.spawn_on(index, &RESTORE, args.clone());
                }
                writes[index] = None;
            }
        });
        Ok(Lease {
            valid_until: timing::renewed_until(lease.valid_until, start, valid),
            renewals: lease.renewals.wrapping_add(1),
            ..lease.clone()
        })
    }

    /// The vote in node `index`'s extend answer. Extend votes need no data-age rule (a node
    /// that lost our key says so), but an answer with a proof keeps the node's reported health
    /// current (most renewals carry none, see [`PROOF_EVERY`]).
    fn extend_vote(
        &self,
        index: usize,
        answer: Result<(ExtendReply, Arc<NodeFacts>), NodeError>,
    ) -> Vote {
        match answer {
            Ok(((status, age, max_ttl), facts)) => {
                let proof = Proof {
                    data_age: votes::DataAge::from_script(age),
                    max_ttl: Duration::from_millis(max_ttl),
                };
                if proof.data_age == votes::DataAge::NotProven {
                    self.learn_max_ttl(proof.max_ttl);
                } else {
                    let _ = self.judge(index, &facts, proof);
                }
                match status {
                    1 => Vote::Granted,
                    0 => Vote::HeldBy("another holder".to_owned()),
                    _ => Vote::Missing,
                }
            }
            Err(err) => Vote::Failed(err),
        }
    }

    /// Releases `lease` on every node (owner-checked) and announces it to waiters, on each
    /// node's own release channel (see [`push::Channels`]).
    ///
    /// Returns how many nodes deleted our key. Bounded by twice the node timeout: on each
    /// node, a call that may still write our key there is let finish first (see [`Order`]).
    pub async fn release(&self, lease: &Lease) -> usize {
        let mut answers =
            self.fan_out_each::<i64>(Op::Release, Order::AfterWrites, &RELEASE, |index| {
                vec![lease.value.clone(), self.inner.channels(index).released].into()
            });
        let mut deleted = 0;
        while let Some((_, answer)) = answers.recv().await {
            deleted += usize::from(matches!(answer, Ok((1, _))));
        }
        deleted
    }

    /// Deletes `value` on the nodes `which` selects, and the node-set record `fingerprint`
    /// where no lock key is left, and waits for the answers (each bounded by the node
    /// timeout). Owner-checked, and silent: a lost round must not wake the waiters.
    async fn clean_up(
        &self,
        value: &str,
        fingerprint: &str,
        which: impl Fn(&Option<Vote>) -> bool,
        votes: &[Option<Vote>],
    ) {
        let args: Arc<[String]> = vec![value.to_owned(), fingerprint.to_owned()].into();
        let calls = votes
            .iter()
            .enumerate()
            .filter(|(_, vote)| which(vote))
            .map(|(index, _)| {
                self.inner
                    .clone()
                    .delete_on::<i64>(index, &CLEANUP, args.clone())
            });
        futures_util::future::join_all(calls).await;
    }

    /// Runs `script`, which may write our key, on node `index` in the background, bounded
    /// by the node timeout.
    fn spawn_on(&self, index: usize, script: &'static Script, args: Arc<[String]>) {
        let inner = self.inner.clone();
        let write = KeyWrite::start(&inner, index);
        tokio::spawn(async move {
            let _write = write;
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let _ = inner.nodes[index]
                .eval::<i64>(script, &inner.keys(), &args, inner.cfg.node_timeout)
                .await;
        });
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

    /// Reads `key` on every node at once (`GET` + `PTTL`, each bounded by the node timeout),
    /// timed and counted as `op`: per node, the value and its remaining time, `None` if absent.
    async fn read_everywhere(
        &self,
        key: &str,
        op: Op,
    ) -> Vec<Result<Option<(String, Duration)>, NodeError>> {
        let inner = &self.inner;
        let reads = inner
            .nodes
            .iter()
            .enumerate()
            .map(|(index, node)| async move {
                let start = Instant::now();
                let result = node.read_key(key, inner.cfg.node_timeout).await;
                let outcome = result.as_ref().map(|_| ()).map_err(|e| e.kind);
                inner
                    .observer
                    .node_call(index, op, start.elapsed(), outcome);
                result
            });
        futures_util::future::join_all(reads).await
    }

    /// Announces a won round on every node's acquisition channel (see [`push::Acquired`]), in
    /// the background: waiters stand down and learn the new holder without asking. The
    /// announcement carries the number of waiters last counted; `PUBLISH` answers with the
    /// number it reached, kept for the next announcement.
    fn announce_acquired(&self, lease: &Lease) {
        let inner = self.inner.clone();
        let message = push::Acquired {
            identity: inner.cfg.identity.clone(),
            fencing_token: lease.fencing_token,
            validity: lease.valid_until.saturating_duration_since(clock::now()),
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
                    if let Ok(reached) = reached {
                        inner
                            .waiters_seen
                            .store(reached, std::sync::atomic::Ordering::Relaxed);
                    }
                });
            futures_util::future::join_all(announce).await;
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

/// The identity part of a lock value (`identity:random`).
fn identity_of(value: &str) -> &str {
    value
        .rsplit_once(':')
        .map_or(value, |(identity, _)| identity)
}

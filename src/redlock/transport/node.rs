//! One Redis master as the vote layer sees it: a self-reconnecting connection, the node's
//! facts, and the calls the engine makes (scripts, plain reads, commands).
//!
//! ## Behaviour
//! - One multiplexed connection per node, made lazily (in the background, bounded by the
//!   connect timeout) and remade after I/O errors.
//! - On every new connection the node's [`NodeFacts`] (run id, eviction policy) are read
//!   once; a restart always drops the connection, so the run id is never stale. The server
//!   the last connection reached is kept after it drops ([`Node::server`]): the node-set
//!   fingerprint names the node by it (see `votes`, rule 7). The
//!   eviction policy can change under a live connection: it is read again in the
//!   background once it is older than [`FACTS_MAX_AGE`].
//! - Every call is bounded by the caller's timeout: a hung node costs at most that. The bound
//!   is relative, on Tokio's timer (cheap on every call); a host suspend can only make a
//!   call fail, never stretch a lease: validity is judged on the boot clock.
//! - Scripts go by `EVALSHA`, falling back to `EVAL` when the node does not know them
//!   (after a restart, say).
//! - A node may be a Sentinel group (`redis+sentinel://`): each connection is made to the
//!   master the Sentinels name, and is dropped when the group fails over (see `sentinel`).
//! - An answer `READONLY` or `MASTERDOWN` drops the connection: the server is no longer a
//!   master that can grant, and the next call dials (or resolves) again.
//! - In cluster mode the connection reaches the master of the lock's slot, and the keys a
//!   script names are laid out for it (see `cluster`).
//! - **One connection carries pushes too** (see `pushes`).

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{FromRedisValue, RedisError, Script};
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::cluster;
use super::dial::{open, open_any, ConnectSettings, Dial, PushTag};
use super::error::{node_error, NodeError, NodeErrorKind};
use super::facts::{info_field, server_identity, NodeFacts, FACTS_MAX_AGE};
use super::link::Link;
use super::spec::NodeSpec;
use crate::clock::{self, Deadline};

/// A live node: its address and its self-reconnecting connection.
pub struct Node {
    pub(super) spec: NodeSpec,
    pub(super) dial: Arc<Dial>,
    pub(super) settings: ConnectSettings,
    pub(super) link: Arc<watch::Sender<Link>>,
    pub(super) connections: Arc<AtomicU64>,
    pub(super) refreshing: Arc<AtomicBool>,
    /// The server the last connection reached ([`super::votes::server_identity`]), kept after
    /// the connection is gone: the node-set fingerprint names a node by it.
    pub(super) server: Arc<Mutex<Option<String>>>,
    /// Set once the Sentinel group's `+switch-master` subscription runs.
    pub(super) following: AtomicBool,
    /// Cluster mode: the masters the last `CLUSTER SLOTS` listed, dialled when the URL's node
    /// does not answer.
    pub(super) seeds: Arc<Mutex<Vec<(String, u16)>>>,
    /// Routes what the node's RESP3 connections push to the streams that subscribed (see
    /// `hub`).
    pub(super) hub: Arc<super::hub::Hub>,
    /// The runtime the node was made on, which drives its connections (see [`Node::spawn`]).
    runtime: Option<tokio::runtime::Handle>,
    pub(super) stop: CancellationToken,
    pub(super) _stop_on_drop: DropGuard,
}

/// What [`Node::read_key`] reports as the remaining time of a key without expiry.
const NO_EXPIRY: Duration = Duration::from_secs(365 * 24 * 3600);

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Node({})", self.spec.label)
    }
}

impl Node {
    /// Prepares the connection; nothing is sent until the first call.
    pub fn new(spec: NodeSpec, settings: ConnectSettings) -> Result<Node, NodeError> {
        let dial = Dial::new(&spec)?;
        let stop = CancellationToken::new();
        Ok(Node {
            spec,
            dial: Arc::new(dial),
            settings,
            link: Arc::new(watch::channel(Link::Idle).0),
            connections: Arc::new(AtomicU64::new(0)),
            refreshing: Arc::new(AtomicBool::new(false)),
            server: Arc::default(),
            following: AtomicBool::new(false),
            seeds: Arc::default(),
            hub: Arc::default(),
            runtime: tokio::runtime::Handle::try_current().ok(),
            _stop_on_drop: stop.clone().drop_guard(),
            stop,
        })
    }

    /// Runs `task` (a connection being made, and so the connection's own driver; a watch of
    /// the node) on the runtime the node was made on, wherever the call that needs it runs: a
    /// node shared by locks on other threads (see `pool::Engine`) keeps its I/O on the one
    /// runtime of its owner.
    fn spawn<F>(&self, task: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        match &self.runtime {
            Some(runtime) => drop(runtime.spawn(task)),
            None => drop(tokio::spawn(task)),
        }
    }

    /// The name of the master, if this node is a Sentinel group.
    pub fn sentinel_master(&self) -> Option<&str> {
        self.spec.sentinel_master()
    }

    /// Whether the node is reached over TLS.
    pub fn is_tls(&self) -> bool {
        self.spec.tls
    }

    /// `host:port`.
    pub fn label(&self) -> &str {
        self.spec.label()
    }

    /// The database index the node's URL selects.
    pub fn db(&self) -> i64 {
        self.spec.info.redis_settings().db()
    }

    /// The facts of the live connection, if there is one (no I/O).
    pub fn facts(&self) -> Option<Arc<NodeFacts>> {
        match &*self.link.borrow() {
            Link::Up(_, facts, _, _) => Some(facts.clone()),
            _ => None,
        }
    }

    /// The server the node's last connection reached (kept after it is gone), `None` before
    /// the first connection or when the server shows no run id (no I/O).
    pub fn server(&self) -> Option<String> {
        self.server
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether [`Node::server`] may be out of date: no connection was ever made, or the last
    /// one was dropped (a restart, a failover) and none has been tried since.
    pub fn server_stale(&self) -> bool {
        matches!(*self.link.borrow(), Link::Idle) || self.server().is_none()
    }

    /// Connects if no connection is up, within `timeout`; errors are left to the next call.
    pub async fn connect(&self, timeout: Duration) {
        let _ = self.connection(timeout).await;
    }

    /// The live connection and its facts, connecting first if needed (within `timeout`).
    async fn connection(
        &self,
        timeout: Duration,
    ) -> Result<(MultiplexedConnection, Arc<NodeFacts>, u64), NodeError> {
        if let Some(up) = self.up(&self.link.borrow()) {
            return Ok(up);
        }
        self.connection_quiet(timeout).await
    }

    /// The connection, made if needed, without refreshing stale facts: plain reads need none,
    /// so an idle standby sends nothing else.
    pub(super) async fn connection_quiet(
        &self,
        timeout: Duration,
    ) -> Result<(MultiplexedConnection, Arc<NodeFacts>, u64), NodeError> {
        if let Link::Up(conn, facts, id, _) = &*self.link.borrow() {
            return Ok((conn.clone(), facts.clone(), *id));
        }
        let start_connecting = |link: &mut Link| {
            let idle = matches!(link, Link::Idle | Link::Down(_));
            if idle {
                *link = Link::Connecting;
            }
            idle
        };
        if self.link.send_if_modified(start_connecting) {
            self.connect_in_background();
        }
        let mut link = self.link.subscribe();
        let settled = clock::within(
            timeout,
            link.wait_for(|link| !matches!(link, Link::Connecting)),
        )
        .await;
        match settled {
            Ok(Ok(link)) => match (self.up(&link), &*link) {
                (Some(up), _) => Ok(up),
                (None, Link::Down(err)) => Err(err.clone()),
                (None, _) => Err(NodeError::timeout(timeout)),
            },
            _ => Err(NodeError::timeout(timeout)),
        }
    }

    /// The connection `link` holds, if it is up; starts a refresh of stale facts.
    fn up(&self, link: &Link) -> Option<(MultiplexedConnection, Arc<NodeFacts>, u64)> {
        let Link::Up(conn, facts, id, read_at) = link else {
            return None;
        };
        if Deadline::now().saturating_duration_since(*read_at) > FACTS_MAX_AGE {
            self.refresh_facts(conn.clone(), *id);
        }
        Some((conn.clone(), facts.clone(), *id))
    }

    /// Connects (for a Sentinel group: to the master the Sentinels name now) and reads the
    /// node's facts, bounded by the connect timeout; publishes the result on the link.
    fn connect_in_background(&self) {
        self.follow_failovers();
        let dial = self.dial.clone();
        let spec = self.spec.clone();
        let link = self.link.clone();
        let server = self.server.clone();
        let db = self.db();
        let settings = self.settings;
        let id = self.connections.fetch_add(1, Ordering::Relaxed) + 1;
        let seeds = self.seeds.clone();
        let tag = PushTag {
            id,
            hub: self.hub.clone(),
            link: self.link.clone(),
        };
        let connect = reach(dial, spec, settings, seeds, tag);
        let connect_timeout = settings.connect_timeout;
        self.spawn(async move {
            let next = match clock::within(connect_timeout, connect).await {
                Ok(Ok((conn, facts))) => {
                    *server.lock().unwrap_or_else(|e| e.into_inner()) =
                        server_identity(&facts.run_id, db);
                    Link::Up(conn, Arc::new(facts), id, Deadline::now())
                }
                Ok(Err(err)) => Link::Down(err),
                Err(_) => Link::Down(NodeError::timeout(connect_timeout)),
            };
            link.send_replace(next);
        });
    }

    /// For a Sentinel group, starts (once) the subscription that drops the connection when
    /// the group's master changes.
    fn follow_failovers(&self) {
        let Dial::Sentinel(group) = &*self.dial else {
            return;
        };
        if self.following.swap(true, Ordering::AcqRel) {
            return;
        }
        let link = self.link.clone();
        let switched = move || {
            link.send_if_modified(|link| {
                let settled = matches!(link, Link::Up(..) | Link::Down(_));
                if settled {
                    *link = Link::Idle;
                }
                settled
            });
        };
        let follow =
            group
                .clone()
                .follow(self.settings.connect_timeout, self.stop.clone(), switched);
        self.spawn(follow);
    }

    /// Reads the eviction policy of connection `id` again in the background (one refresh at a
    /// time).
    fn refresh_facts(&self, mut conn: MultiplexedConnection, id: u64) {
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let (link, refreshing) = (self.link.clone(), self.refreshing.clone());
        let timeout = self.settings.connect_timeout;
        self.spawn(async move {
            let mut info = redis::cmd("INFO");
            info.arg("memory");
            let read = info.query_async::<String>(&mut conn);
            if let Ok(Ok(memory)) = clock::within(timeout, read).await {
                link.send_if_modified(|link| match link {
                    Link::Up(_, facts, current, read_at) if *current == id => {
                        *facts = Arc::new(NodeFacts {
                            maxmemory_policy: info_field(&memory, "maxmemory_policy"),
                            ..NodeFacts::clone(facts)
                        });
                        *read_at = Deadline::now();
                        true
                    }
                    _ => false,
                });
            }
            refreshing.store(false, Ordering::Release);
        });
    }

    /// Forgets connection `id` after an error that means it is broken, or that the server is
    /// no longer the master to ask (`READONLY`, `MASTERDOWN`, `MOVED`); the next call
    /// reconnects (for a Sentinel group: to the master named then; in cluster mode: to the
    /// slot's master then) and reads the node's facts again.
    pub(super) fn drop_if_broken(&self, id: u64, err: &RedisError) {
        let demoted = matches!(err.code(), Some("READONLY" | "MASTERDOWN" | "MOVED"));
        if demoted
            || err.is_io_error()
            || err.is_connection_dropped()
            || err.is_connection_refusal()
        {
            self.link.send_if_modified(|link| match link {
                Link::Up(_, _, current, _) if *current == id => {
                    *link = Link::Idle;
                    true
                }
                _ => false,
            });
        }
    }

    /// After a call on connection `id` failed with `e`: drops the connection if broken, and
    /// returns the error to give, or `None` to retry once on the new owner (`MOVED`).
    fn failed(&self, id: u64, e: &RedisError, retried: &mut bool) -> Option<NodeError> {
        self.drop_if_broken(id, e);
        if e.code() == Some("MOVED") && !*retried {
            *retried = true;
            return None;
        }
        Some(node_error(e, self.spec.password()))
    }

    /// Runs `script` with `keys` and `args`, bounded by `timeout` (connecting included).
    /// The node's database index is appended as the last argument (the scripts' data-age proof
    /// names it), and the connection's facts are returned with the answer. In cluster mode the
    /// epoch marker among `keys` is replaced by the lock slot's, a `MOVED` answer is retried
    /// once on the new owner, and an `ASK` answer is followed for this call.
    pub async fn eval<T: FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
        timeout: Duration,
    ) -> Result<(T, Arc<NodeFacts>), NodeError> {
        let bound = clock::CallBound::after(timeout);
        let mut retried = false;
        loop {
            let left = bound.left();
            let (mut conn, facts, id) = self.connection(left).await?;
            let slot_marker = facts
                .cluster
                .then(|| cluster::epoch_key(self.settings.slot));
            let keys = cluster::keys_on_node(keys, slot_marker.as_deref());
            let mut invocation = script.prepare_invoke();
            for key in &keys {
                invocation.key(*key);
            }
            for arg in args {
                invocation.arg(*arg);
            }
            invocation.arg(self.db());
            match bound.run(invocation.invoke_async(&mut conn)).await {
                Ok(Ok(value)) => return Ok((value, facts)),
                Ok(Err(e)) if e.code() == Some("ASK") => {
                    let asked = cluster::ask(&self.spec, &e, script, &keys, args, self.db());
                    return match bound.run(asked).await {
                        Ok(result) => result.map(|value| (value, facts)),
                        Err(_) => Err(NodeError::timeout(timeout)),
                    };
                }
                Ok(Err(e)) => match self.failed(id, &e, &mut retried) {
                    None => continue,
                    Some(err) => return Err(err),
                },
                Err(_) => return Err(NodeError::timeout(timeout)),
            }
        }
    }

    /// The key of the epoch marker this node's scripts use: the node's, or in cluster mode the
    /// lock slot's (known once connected).
    pub fn epoch_key(&self) -> String {
        cluster::epoch_key_for(self.facts().as_deref(), self.settings.slot)
    }

    /// The hash slot of the lock's keys (used in cluster mode).
    pub fn slot(&self) -> u16 {
        self.settings.slot
    }

    /// Runs one plain command, bounded by `timeout` (used by the operator commands).
    pub async fn command<T: FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        timeout: Duration,
    ) -> Result<T, NodeError> {
        let bound = clock::CallBound::after(timeout);
        let (mut conn, _, id) = self.connection(timeout).await?;
        match bound.run(cmd.query_async(&mut conn)).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                self.drop_if_broken(id, &e);
                Err(node_error(&e, self.spec.password()))
            }
            Err(_) => Err(NodeError::timeout(timeout)),
        }
    }

    /// A fingerprint of the credentials the node's next connection uses (its password file
    /// read again, see `secrets`), salted with `salt` (the lock's name, shared by every
    /// contender): 16 hex digits of SHA-256, so pods can be compared during a rotation without
    /// showing the secret. `None` without a password, or when the file cannot be read now.
    pub async fn credentials_fingerprint(&self, salt: &str) -> Option<String> {
        let spec = self.spec.current().await.ok()?;
        let settings = spec.info.redis_settings();
        let password = settings.password()?;
        let user = settings.username().unwrap_or_default();
        let mut context = ring::digest::Context::new(&ring::digest::SHA256);
        for part in ["redlock-sidecar credentials", salt, user, password] {
            context.update(part.as_bytes());
            context.update(&[0]);
        }
        let digest = context.finish();
        Some(
            digest.as_ref()[..8]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect(),
        )
    }

    /// Runs `pipe` (plain commands, one round trip; atomic if `pipe` is) on the node's
    /// connection, made if needed without refreshing stale facts, bounded by `timeout`. A
    /// `MOVED` answer (cluster mode) is retried once on the new owner.
    pub async fn query_pipeline<T: FromRedisValue>(
        &self,
        pipe: &redis::Pipeline,
        timeout: Duration,
    ) -> Result<T, NodeError> {
        let bound = clock::CallBound::after(timeout);
        let mut retried = false;
        loop {
            let left = bound.left();
            let (mut conn, _, id) = self.connection_quiet(left).await?;
            match bound.run(pipe.query_async::<T>(&mut conn)).await {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(e)) => match self.failed(id, &e, &mut retried) {
                    None => continue,
                    Some(err) => return Err(err),
                },
                Err(_) => return Err(NodeError::timeout(timeout)),
            }
        }
    }

    /// Reads `key` with plain commands (`GET` and `PTTL`, pipelined in one round trip),
    /// bounded by `timeout`: its value and remaining time, or `None` if there is none. A
    /// `MOVED` answer (cluster mode) is retried once on the new owner.
    pub async fn read_key(
        &self,
        key: &str,
        timeout: Duration,
    ) -> Result<Option<(String, Duration)>, NodeError> {
        let mut pipe = redis::pipe();
        pipe.cmd("GET").arg(key).cmd("PTTL").arg(key);
        let read = self
            .query_pipeline::<(Option<String>, i64)>(&pipe, timeout)
            .await?;
        Ok(match read {
            // −1: no expiry (not a key of ours); −2: gone between the two commands.
            (Some(value), pttl) => match u64::try_from(pttl) {
                Ok(ms) => Some((value, Duration::from_millis(ms))),
                Err(_) if pttl == -1 => Some((value, NO_EXPIRY)),
                Err(_) => None,
            },
            (None, _) => None,
        })
    }
}

/// Dials `dial` and reads the node's facts: in cluster mode, then routes to the master of the
/// lock's slot (another master of the cluster if the URL's is down); a Sentinel's pick must
/// report `role:master`.
async fn reach(
    dial: Arc<Dial>,
    spec: NodeSpec,
    settings: ConnectSettings,
    seeds: Arc<Mutex<Vec<(String, u16)>>>,
    tag: PushTag,
) -> Result<(MultiplexedConnection, NodeFacts), NodeError> {
    let (client, address) = dial.client(&spec, settings.connect_timeout).await?;
    let (conn, mut facts) = match open(&spec, &client, settings, Some(&tag)).await {
        Ok(opened) => opened,
        // A cluster node that is down: another master of the cluster will do.
        Err(err) => open_any(&spec, &seeds, settings, &tag).await.ok_or(err)?,
    };
    if facts.address.is_empty() {
        facts.address = address;
    }
    let (conn, facts) = if facts.cluster {
        cluster::route(&spec, conn, facts, settings, &seeds, &tag).await?
    } else {
        (conn, facts)
    };
    if let Some(group) = spec.sentinel_master() {
        if facts.role != "master" {
            return Err(NodeError {
                kind: NodeErrorKind::Other,
                message: format!(
                    "a Sentinel named {} as master of {group}, but it reports role:{}",
                    facts.address, facts.role
                ),
            });
        }
    }
    Ok((conn, facts))
}

//! The seam between the request-lock service and the Redlock engine.
//!
//! The service sees a lock engine only through [`LockEngine`] and [`NameLock`]: open a name,
//! acquire it with a deadline, extend, release. [`RedlockEngine`] opens one [`Redlock`] per
//! name (and ttl), all on one [`redlock::Engine`]: every name shares one connection per node
//! (its subscriptions ride on it), however many leases the sidecar holds.
//!
//! ## Namespace
//! A request lock `NAME` is the engine lock `<prefix>:NAME` (`--locks-prefix`, default
//! `app`), so its key is `redlock:{<prefix>:NAME}`; its fencing tokens come from the counter
//! the namespace shares per hash slot, `redlock:{TAG}:fence:<prefix>` (see
//! [`redlock::fencing`]).
//! The leadership lock (`--lock`) may not start with `<prefix>:` (checked at start-up), so the
//! two never share a key.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::clock::{self, Deadline};
use crate::redlock::timing::backoff_delay;
use crate::redlock::{self, LockError, Observer, Redlock, RedlockConfig};

/// Why an acquisition ended without a lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AcquireFailed {
    /// Still held elsewhere at the deadline; the holder's identity if a node told it.
    Held { holder: Option<String> },
    /// Too few nodes answered (or counted) for a quorum; the engine's error kind.
    NoQuorum { kind: &'static str },
    /// The caller cancelled (its client went away, or the sidecar is shutting down).
    Cancelled,
}

/// Why an extension failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtendFailed {
    /// A quorum shows another holder or no key, or the validity ended: the lock is gone.
    Gone,
    /// No quorum this time; a later attempt may still succeed within the validity.
    Retry,
}

/// What a held engine lease tells the service.
pub trait EngineLease: Send + Sync + 'static {
    /// The fencing token: it only grows for the name.
    fn fencing_token(&self) -> u64;
    /// When the validity ends.
    fn valid_until(&self) -> Deadline;
}

/// One name's lock in the engine.
pub trait NameLock: Send + Sync + 'static {
    /// A held lease.
    type Lease: EngineLease;
    /// Waits for the lock until `deadline` or `cancel`; `on_holder` sees the holders learnt
    /// meanwhile. Must be run to completion (cancel through `cancel`, never by dropping it).
    fn acquire(
        &self,
        deadline: Deadline,
        cancel: CancellationToken,
        on_holder: impl FnMut(Option<String>) + Send + 'static,
    ) -> impl Future<Output = Result<Self::Lease, AcquireFailed>> + Send;
    /// Extends `lease` by the name's ttl.
    fn extend(
        &self,
        lease: &Self::Lease,
    ) -> impl Future<Output = Result<Self::Lease, ExtendFailed>> + Send;
    /// Releases `lease` and wakes the waiters (pub/sub); calls `gone` once a round of this
    /// process can win (see [`Redlock::release_then`]), at the latest when it returns.
    ///
    /// [`Redlock::release_then`]: crate::redlock::Redlock::release_then
    fn release(
        &self,
        lease: &Self::Lease,
        gone: impl FnOnce() + Send,
    ) -> impl Future<Output = ()> + Send;
    /// Who holds the name on a quorum of nodes (`Ok(None)`: nobody); `Err` without a quorum
    /// of answers.
    fn holder(&self) -> impl Future<Output = Result<Option<String>, ()>> + Send;
}

/// Opens names.
pub trait LockEngine: Send + Sync + 'static {
    /// One name's lock; dropping it frees what the engine kept for the name.
    type Name: NameLock;
    /// The lock for `name` with keys that live `ttl` without renewal; an error says why the
    /// engine cannot take it (e.g. a ttl too short for the node timeout).
    fn open(&self, name: &str, ttl: Duration) -> Result<Self::Name, String>;
}

/// One [`Redlock`] per name, built from the sidecar's own nodes and identity, all on the
/// connections of the process' one [`redlock::Engine`] (the leadership lock's too), renewing
/// in its batches.
pub struct RedlockEngine {
    base: RedlockConfig,
    prefix: String,
    shared: redlock::Engine,
    /// The nodes' health, as the request locks' rounds see it (see [`NodeHealth`]).
    observer: Arc<dyn Observer>,
}

impl RedlockEngine {
    /// Request locks on `shared`, `base`'s nodes, as `base`'s identity, in the namespace
    /// `prefix`; what their calls and votes say of each node goes to `nodes`.
    pub fn new(
        shared: redlock::Engine,
        base: RedlockConfig,
        prefix: &str,
        nodes: Arc<dyn Observer>,
    ) -> RedlockEngine {
        RedlockEngine {
            shared,
            base,
            prefix: prefix.to_owned(),
            observer: Arc::new(NodeHealth(nodes)),
        }
    }

    /// Request locks on an engine of their own, reporting nothing: for a process whose only
    /// locks they are (tests, embedding).
    pub fn standalone(base: RedlockConfig, prefix: &str) -> Result<RedlockEngine, String> {
        let shared = redlock::Engine::new(&base).map_err(|e| e.to_string())?;
        Ok(RedlockEngine::new(
            shared,
            base,
            prefix,
            Arc::new(redlock::NoObserver),
        ))
    }

    /// The engine's lock name for the request lock `name`.
    pub fn engine_name(&self, name: &str) -> String {
        format!("{}:{name}", self.prefix)
    }
}

impl LockEngine for RedlockEngine {
    type Name = RedlockName;

    fn open(&self, name: &str, ttl: Duration) -> Result<RedlockName, String> {
        let mut cfg = self.base.clone();
        cfg.lock = self.engine_name(name);
        cfg.ttl = ttl;
        // The leadership lock's --max-ttl says nothing about request locks: each records
        // its own ttl beside its key (see `redlock::votes`).
        cfg.max_ttl = None;
        cfg.fence_retention = cfg.fence_retention.max(ttl * 2);
        // One counter per hash slot for the whole namespace: a lock per order id must not
        // leave a counter per order on every node for the retention.
        cfg.fence_namespace = Some(self.prefix.clone());
        let redlock = Redlock::on(&self.shared, cfg, self.observer.clone());
        let redlock = redlock.map_err(|e| e.reason)?;
        Ok(RedlockName { redlock })
    }
}

/// What a request lock reports: only what its calls and votes say of each node (latency,
/// errors, whether its vote counts), which is the same node whichever lock asked. What is
/// the lock's own (node-set conflicts, standby reads, waiters) would be read as the
/// leadership lock's, so it stays out.
struct NodeHealth(Arc<dyn Observer>);

impl Observer for NodeHealth {
    fn node_call(
        &self,
        index: usize,
        op: redlock::Op,
        elapsed: Duration,
        result: Result<(), redlock::NodeErrorKind>,
    ) {
        self.0.node_call(index, op, elapsed, result);
    }

    fn node_counted(&self, index: usize, counted: bool) {
        self.0.node_counted(index, counted);
    }
}

/// One name on [`RedlockEngine`].
pub struct RedlockName {
    redlock: Redlock,
}

impl EngineLease for redlock::Lease {
    fn fencing_token(&self) -> u64 {
        self.fencing_token
    }
    fn valid_until(&self) -> Deadline {
        self.valid_until
    }
}

/// What a request hears of a wait (or a single round) that ended in `err`: busy (a holder, or a
/// split among contenders), cancelled, or unavailable.
fn failed(err: LockError) -> AcquireFailed {
    match err {
        LockError::Busy { holder, .. } => AcquireFailed::Held { holder },
        LockError::Contended { .. } => AcquireFailed::Held { holder: None },
        LockError::Cancelled => AcquireFailed::Cancelled,
        other => AcquireFailed::NoQuorum { kind: other.kind() },
    }
}

impl NameLock for RedlockName {
    type Lease = redlock::Lease;

    async fn acquire(
        &self,
        deadline: Deadline,
        cancel: CancellationToken,
        mut on_holder: impl FnMut(Option<String>) + Send + 'static,
    ) -> Result<redlock::Lease, AcquireFailed> {
        // A free name is won by one round, without the subscriptions a wait needs (through
        // them every later announcement of the name would reach this sidecar): the common,
        // uncontended case. With no time left to wait (`wait=0`, Dapr's TryLock), that round
        // is the answer, whatever it says: busy, or unavailable (nodes down, or young nodes
        // whose votes count only later), never a wait for them. Anything else goes on to
        // wait, which starts with a round of its own.
        match self.redlock.try_acquire().await {
            Ok(lease) => return Ok(lease),
            Err(err) if Deadline::now() >= deadline => return Err(failed(err)),
            Err(LockError::Busy { .. }) => {}
            Err(_) => {
                // The first backoff pause the wait would take after such a round (a split
                // vote, nodes down): contenders that split do not meet again at once.
                let cfg = self.redlock.config();
                let pause = backoff_delay(cfg.retry_delay, cfg.retry_max, 0, rand::random());
                tokio::select! {
                    biased;
                    _ = cancel.cancelled() => return Err(AcquireFailed::Cancelled),
                    _ = clock::sleep_until_deadline(Deadline::now() + pause) => {}
                }
            }
        }
        let result = self
            .redlock
            .acquire_watching(
                Some(deadline),
                &cancel,
                |_, _| {},
                |seen| on_holder(seen.map(|h| h.identity)),
            )
            .await;
        result.map_err(failed)
    }

    async fn extend(&self, lease: &redlock::Lease) -> Result<redlock::Lease, ExtendFailed> {
        self.redlock.extend(lease).await.map_err(|err| match err {
            LockError::Superseded { .. }
            | LockError::Expired { .. }
            | LockError::ValidityTooShort { .. } => ExtendFailed::Gone,
            _ => ExtendFailed::Retry,
        })
    }

    async fn release(&self, lease: &redlock::Lease, gone: impl FnOnce() + Send) {
        self.redlock.release_then(lease, gone).await;
    }

    async fn holder(&self) -> Result<Option<String>, ()> {
        let views = self.redlock.inspect().await;
        let needed = redlock::quorum(views.len());
        let answered: Vec<Option<String>> = views
            .into_iter()
            .filter_map(|(_, view)| view.ok().map(|v| v.holder))
            .collect();
        if answered.len() < needed {
            return Err(());
        }
        let holder = answered.iter().flatten().find(|h| {
            answered
                .iter()
                .filter(|other| other.as_ref() == Some(*h))
                .count()
                >= needed
        });
        Ok(holder.cloned())
    }
}

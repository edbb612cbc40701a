//! Publishing leadership: the pod label, Events and the Lease mirror (see the module above).

use std::time::{Duration, SystemTime};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::GetParams;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::retry::{jitter, Health, Retry, RetryPolicy};
use super::{lease_name, lease_write_interval, Kube, KubeError, Op, LEASE_DURATION_INTERVALS};
use crate::clock::Deadline;
use crate::leadership::{Leadership, LeadershipRx, Term};

/// How writes back off: from 1 s doubling to 60 s; the attempt window only while failing, so
/// a write that worked never holds back the next change.
const WRITE_RETRY: RetryPolicy = RetryPolicy {
    first: Duration::from_secs(1),
    factor: 2,
    cap: Duration::from_secs(60),
    window_always: false,
};

impl Kube {
    /// Publishes every leadership change until the sender is dropped or `cancel` fires.
    ///
    /// ## Behavior
    /// - Running: applies the latest state whenever it changes, when a retry is due, when the
    ///   Lease needs renewing and at `step_down_at`.
    /// - After `cancel` (pass the token that stops the lock loop): a step-down is reported as
    ///   `LockReleased`; keeps observing until the state is not-leader and applied, or the
    ///   sender is dropped and its final state applied.
    /// - After the sender is dropped: applies its final state (a not-leader state after having
    ///   led reads as `LockReleased`, also when it was published just before the drop) and
    ///   returns.
    /// - Everything after `cancel` or the drop is bounded by `flush_timeout` (a call in flight
    ///   when `cancel` fires is finished within it); each pending retry is tried once at once
    ///   when that phase starts (backoff, window and `Retry-After` apply again after it).
    pub async fn observe(
        self,
        mut rx: LeadershipRx,
        cancel: CancellationToken,
        flush_timeout: Duration,
    ) {
        let clock = self.clock;
        let mut observer = Observer::new(self);
        let flush_deadline = || clock.now() + flush_timeout;
        let (mut sender_gone, deadline) = loop {
            // A state published just before the sender was dropped is a final state: let the
            // flush below apply it (so a release reads as `LockReleased`, not a loss).
            if rx.has_changed().is_err() {
                break (true, flush_deadline());
            }
            let leadership = rx.borrow_and_update().clone();
            {
                let pass = observer.reconcile(&leadership, false);
                tokio::pin!(pass);
                let cancelled = tokio::select! {
                    biased;
                    _ = &mut pass => false,
                    _ = cancel.cancelled() => true,
                };
                if cancelled {
                    // Finish the call in flight (so its outcome is recorded), within the
                    // shutdown deadline.
                    let deadline = flush_deadline();
                    if clock.timeout_at(deadline, pass).await.is_err() {
                        warn!(timeout = ?flush_timeout, "kubernetes state not flushed in time");
                        return;
                    }
                    break (false, deadline);
                }
            }
            let wake = observer.next_wake(&leadership);
            tokio::select! {
                biased;
                _ = cancel.cancelled() => break (false, flush_deadline()),
                changed = rx.changed() => if changed.is_err() {
                    break (true, flush_deadline());
                },
                _ = clock.sleep_until_some(wake) => {}
            }
        };

        debug!(sender_gone, "kubernetes observer flushing the final state");
        observer.retry_now();
        let flush = async {
            loop {
                let leadership = rx.borrow_and_update().clone();
                let settled = observer.reconcile(&leadership, true).await;
                let leading = leadership.leading_at(Deadline::now()).is_some();
                if settled && (sender_gone || !leading) {
                    return;
                }
                let wake = observer.next_wake(&leadership);
                tokio::select! {
                    biased;
                    changed = rx.changed(), if !sender_gone => sender_gone = changed.is_err(),
                    _ = clock.sleep_until_some(wake) => {}
                }
            }
        };
        match clock.timeout_at(deadline, flush).await {
            Ok(()) => info!("kubernetes state flushed"),
            Err(_) => warn!(
                timeout = ?flush_timeout,
                "kubernetes state not flushed in time; the pod label or Lease may be stale"
            ),
        }
    }

    fn lease_duration_seconds(&self) -> i32 {
        let duration =
            lease_write_interval(self.settings.renew_interval) * LEASE_DURATION_INTERVALS;
        let seconds = duration.as_millis().div_ceil(1000).max(1);
        i32::try_from(seconds).unwrap_or(i32::MAX)
    }
}

/// What the Lease mirror last wrote.
#[derive(Default)]
struct LeaseMirror {
    /// The Lease as last returned by the API server (its `resourceVersion` guards the next write).
    cached: Option<Lease>,
    /// The fencing token of the term last written as holder.
    term: Option<u64>,
    /// When the holder was last written.
    renewed_at: Option<Deadline>,
    /// Whether the Lease names this process, as far as we know.
    names_us: bool,
}

/// Retry and log state of one write operation.
struct Track {
    retry: Retry,
    health: Health,
}

impl Default for Track {
    fn default() -> Self {
        Track {
            retry: Retry::new(WRITE_RETRY),
            health: Health::default(),
        }
    }
}

/// The observer's memory of what the API server already has.
struct Observer {
    kube: Kube,
    lease_name: Option<String>,
    /// The label value last accepted.
    label: Option<bool>,
    /// The term the Event history says we hold (`None`: none, or its loss was recorded).
    announced: Option<u64>,
    lease: LeaseMirror,
    /// Per write operation: `PatchLabel`, `CreateEvent`, `UpdateLease`.
    tracks: [Track; 3],
}

impl Observer {
    fn new(kube: Kube) -> Self {
        Observer {
            kube,
            lease_name: None,
            label: None,
            announced: None,
            lease: LeaseMirror::default(),
            tracks: Default::default(),
        }
    }

    fn track(&mut self, op: Op) -> &mut Track {
        &mut self.tracks[op as usize]
    }

    /// Whether `op` may be attempted now; if so, the attempt is recorded as started.
    fn start(&mut self, op: Op) -> bool {
        let now = self.kube.clock.now();
        let track = self.track(op);
        if !track.retry.due(now) {
            return false;
        }
        track.retry.started(now);
        true
    }

    fn retry_now(&mut self) {
        for track in &mut self.tracks {
            track.retry.forget();
        }
    }

    fn succeeded(&mut self, op: Op) {
        let track = self.track(op);
        track.retry.succeeded();
        track.health.succeeded(op.as_str());
    }

    fn failed(&mut self, op: Op, err: &KubeError) {
        let now = self.kube.clock.now();
        let track = self.track(op);
        let next = track.retry.failed(now, err.retry_after(), jitter());
        track.health.failed(op.as_str(), err, Some(next - now));
    }

    /// One pass over label, Event and Lease, in that order; each is attempted only if it
    /// differs from the desired state and is not backing off. Returns whether nothing is left
    /// to do for `leadership`.
    async fn reconcile(&mut self, leadership: &Leadership, shutting_down: bool) -> bool {
        let term = leadership.leading_at(Deadline::now()).cloned();
        let leading = term.is_some();
        let mut settled = true;

        if self.label != Some(leading) {
            settled &= self.sync_label(leading).await;
        }

        let wanted = term.as_ref().map(|t| t.fencing_token);
        if self.announced != wanted {
            settled &= self.sync_event(leadership, wanted, shutting_down).await;
        }

        if self.kube.settings.mirror_lease {
            settled &= self.sync_lease(leadership, term.as_ref()).await;
        }
        settled
    }

    async fn sync_label(&mut self, leading: bool) -> bool {
        if !self.start(Op::PatchLabel) {
            return false;
        }
        match self.kube.patch_label(leading).await {
            Ok(()) => {
                self.succeeded(Op::PatchLabel);
                self.label = Some(leading);
                info!(label = %self.kube.settings.label_key, value = leading, "pod label set");
                true
            }
            Err(err) => {
                self.failed(Op::PatchLabel, &err);
                false
            }
        }
    }

    async fn sync_event(
        &mut self,
        leadership: &Leadership,
        wanted: Option<u64>,
        shutting_down: bool,
    ) -> bool {
        let (lock, identity) = (&leadership.lock, &leadership.identity);
        let (reason, message, warning) = match (wanted, self.announced) {
            (Some(token), _) => (
                "LeaderElected",
                format!("{identity} acquired lock {lock} with fencing token {token}"),
                false,
            ),
            (None, Some(token)) if shutting_down => (
                "LockReleased",
                format!("{identity} released lock {lock} (fencing token {token})"),
                false,
            ),
            (None, Some(token)) => (
                "LeadershipLost",
                format!("{identity} lost lock {lock} (fencing token {token})"),
                true,
            ),
            (None, None) => return true,
        };
        if !self.start(Op::CreateEvent) {
            return false;
        }
        match self.kube.create_event(reason, &message, warning).await {
            Ok(()) => {
                self.succeeded(Op::CreateEvent);
                self.announced = wanted;
                debug!(reason, %message, "kubernetes event recorded");
                true
            }
            Err(err) => {
                self.failed(Op::CreateEvent, &err);
                false
            }
        }
    }

    fn lease_interval(&self) -> Duration {
        lease_write_interval(self.kube.settings.renew_interval)
    }

    async fn sync_lease(&mut self, leadership: &Leadership, term: Option<&Term>) -> bool {
        let needed = match term {
            Some(term) => {
                self.lease.term != Some(term.fencing_token)
                    || self
                        .lease
                        .renewed_at
                        .is_none_or(|at| self.kube.clock.now() >= at + self.lease_interval())
            }
            None => self.lease.names_us,
        };
        if !needed {
            return true;
        }
        if !self.start(Op::UpdateLease) {
            return false;
        }
        let result = match term {
            Some(term) => self.write_lease(leadership, term).await,
            None => self.vacate_lease(leadership).await,
        };
        match result {
            Ok(()) => {
                self.succeeded(Op::UpdateLease);
                true
            }
            Err(err) => {
                // Re-read before the next write: the cached resourceVersion may be stale.
                self.lease.cached = None;
                self.failed(Op::UpdateLease, &err);
                false
            }
        }
    }

    fn lease_name(&mut self, lock: &str) -> String {
        self.lease_name
            .get_or_insert_with(|| lease_name(lock))
            .clone()
    }

    /// The Lease as the server has it: the cached copy, or a fresh GET.
    async fn current_lease(&mut self, name: &str) -> Result<Option<Lease>, KubeError> {
        if let Some(lease) = self.lease.cached.take() {
            return Ok(Some(lease));
        }
        let request = self
            .kube
            .requests::<Lease>()
            .get(name, &GetParams::default());
        self.kube.call_opt(Op::UpdateLease, request).await
    }

    /// Sends `lease` (create, or update on the `resourceVersion` it carries).
    async fn send_lease(&self, lease: &Lease, create: bool) -> Result<Lease, KubeError> {
        let body = serde_json::to_vec(lease)
            .map_err(|err| KubeError::api(Op::UpdateLease, kube::Error::SerdeError(err)))?;
        let requests = self.kube.requests::<Lease>();
        let params = Kube::post_params();
        let request = if create {
            requests.create(&params, body)
        } else {
            let name = lease.metadata.name.as_deref().unwrap_or_default();
            requests.replace(name, &params, body)
        };
        self.kube.call(Op::UpdateLease, request).await
    }

    /// Writes this process as holder (create, or update on the known `resourceVersion`).
    async fn write_lease(&mut self, leadership: &Leadership, term: &Term) -> Result<(), KubeError> {
        let name = self.lease_name(&leadership.lock);
        let current = self.current_lease(&name).await?;
        let new_term = self.lease.term != Some(term.fencing_token);
        let now = MicroTime(Timestamp::now());
        let identity = &leadership.identity;

        let written = match current {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        namespace: Some(self.kube.namespace.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(identity.clone()),
                        lease_duration_seconds: Some(self.kube.lease_duration_seconds()),
                        acquire_time: Some(micro_time(term.since)),
                        renew_time: Some(now),
                        lease_transitions: Some(0),
                        ..LeaseSpec::default()
                    }),
                };
                self.send_lease(&lease, true).await?
            }
            Some(mut lease) => {
                let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
                let changed_hands = spec.holder_identity.as_deref() != Some(identity.as_str());
                if changed_hands {
                    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                }
                if changed_hands || new_term {
                    spec.acquire_time = Some(micro_time(term.since));
                }
                spec.holder_identity = Some(identity.clone());
                spec.lease_duration_seconds = Some(self.kube.lease_duration_seconds());
                spec.renew_time = Some(now);
                lease.metadata.name = Some(name.clone());
                self.send_lease(&lease, false).await?
            }
        };
        if new_term {
            info!(lease = %name, token = term.fencing_token, "lease mirror names this process");
        }
        self.lease = LeaseMirror {
            cached: Some(written),
            term: Some(term.fencing_token),
            renewed_at: Some(self.kube.clock.now()),
            names_us: true,
        };
        Ok(())
    }

    /// Clears `holderIdentity` if (and only if) the Lease still names this process.
    async fn vacate_lease(&mut self, leadership: &Leadership) -> Result<(), KubeError> {
        let name = self.lease_name(&leadership.lock);
        let current = self.current_lease(&name).await?;
        let ours = |lease: &Lease| {
            lease
                .spec
                .as_ref()
                .and_then(|s| s.holder_identity.as_deref())
                == Some(leadership.identity.as_str())
        };
        let cached = match current {
            Some(mut lease) if ours(&lease) => {
                let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
                spec.holder_identity = None;
                spec.renew_time = Some(MicroTime(Timestamp::now()));
                lease.metadata.name = Some(name.clone());
                let written = self.send_lease(&lease, false).await?;
                info!(lease = %name, "lease mirror vacated");
                Some(written)
            }
            other => other,
        };
        self.lease = LeaseMirror {
            cached,
            ..LeaseMirror::default()
        };
        Ok(())
    }

    /// The next moment something may need doing without a new state: a retry, a Lease
    /// renewal, or the end of the current term. Only future moments count (anything already
    /// due was just attempted).
    fn next_wake(&self, leadership: &Leadership) -> Option<Deadline> {
        let now = self.kube.clock.now();
        let term = leadership.leading_at(Deadline::now());
        let retries = self.tracks.iter().filter_map(|t| t.retry.next_at());
        let renewal = match term {
            Some(_) if self.kube.settings.mirror_lease => {
                self.lease.renewed_at.map(|at| at + self.lease_interval())
            }
            _ => None,
        };
        let step_down = term.map(|t| t.step_down_at);
        retries
            .chain(renewal)
            .chain(step_down)
            .filter(|&at| at > now)
            .min()
    }
}

fn micro_time(at: SystemTime) -> MicroTime {
    MicroTime(Timestamp::try_from(at).unwrap_or_else(|_| Timestamp::now()))
}

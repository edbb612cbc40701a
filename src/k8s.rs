//! Kubernetes integration: publish who leads on the pod, as Events, and (optionally) as a Lease.
//!
//! [`Kube::observe`] reads the leadership `watch` channel (it never writes it) and, each time
//! "leading" flips for this process, does in this order:
//!
//! 1. **Pod label.** A JSON merge patch on its own pod sets `<label_key>: "true"` or `"false"`,
//!    so `kubectl get pods -L <label_key>` shows the leader and a Service can select only the
//!    leader pod. The label is also set once at start (to clear a stale `"true"` left by a
//!    previous run of this container).
//! 2. **Event.** A core/v1 Event on the pod: `LeaderElected` (Normal) on gain, `LeadershipLost`
//!    (Warning) on a loss while running, `LockReleased` (Normal) when the state after shutdown
//!    began is not-leader after having led. The message names the lock, the identity and the
//!    fencing token.
//! 3. **Lease mirror** (`mirror_lease`). A `coordination.k8s.io/v1` Lease named
//!    [`lease_name`]`(lock)`, written only by the leader: `holderIdentity` is its identity,
//!    `renewTime` is now, `leaseDurationSeconds` is three renew intervals (rounded up to whole
//!    seconds), `leaseTransitions` counts changes of holder. It is rewritten when a term starts
//!    and then once per renew interval while leading. On a step-down the former leader clears
//!    `holderIdentity`, but only if the Lease still names it (optimistic concurrency on
//!    `resourceVersion`); followers never write it, so two pods never fight over it.
//!
//! "Leading" is always `Leadership::leading_at(Deadline::now())`, and the observer also wakes at
//! `step_down_at`, so a lock loop that stalls without publishing still clears the label.
//!
//! ## Behavior on API errors
//! - They never affect the lock: this module only reads the leadership state.
//! - Each failure is logged (warn) and counted in `redlock_kubernetes_errors_total{op}` with
//!   `op` one of `patch_label`, `create_event`, `update_lease`, `get_pod`; each call has a 10 s
//!   timeout.
//! - Each of the three operations retries on its own backoff: 200 ms doubling to 30 s, with
//!   jitter. A change of leadership does not reset it (no hammering of a failing API server).
//! - The desired state is always the *latest* leadership: after an outage the label catches up
//!   to the current state, and intermediate states are not replayed (so an Event for a term that
//!   began and ended during the outage is never written).
//!
//! ## RBAC
//! A Role in the pod's namespace, bound to the pod's service account:
//! ```yaml
//! rules:
//!   - apiGroups: [""]
//!     resources: ["pods"]
//!     verbs: ["patch"]            # its own pod; the name is only known at run time
//!   - apiGroups: [""]
//!     resources: ["events"]
//!     verbs: ["create"]
//!   - apiGroups: ["coordination.k8s.io"]   # only with mirror_lease
//!     resources: ["leases"]
//!     resourceNames: ["redlock-<lock>"]    # lease_name(lock)
//!     verbs: ["get", "update"]
//!   - apiGroups: ["coordination.k8s.io"]   # create cannot be limited by resourceNames
//!     resources: ["leases"]
//!     verbs: ["create"]
//! ```
//! The pod needs `POD_NAME` from the downward API (`fieldRef: metadata.name`); the namespace
//! defaults to the service account's namespace (the client's default namespace). `POD_UID`
//! (`fieldRef: metadata.uid`) puts the pod's uid on Events from the first one on, so that
//! `kubectl describe pod` lists them; without it only Events after the first label patch
//! carry it (guard never patches the label).

use std::fmt;
use std::future::Future;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use crate::clock::{Clock, Deadline};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use prometheus::{IntCounterVec, Opts};
use rand::Rng;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::leadership::{Leadership, LeadershipRx, Term};

/// The component name on Events, and the field manager of every write.
pub const COMPONENT: &str = "redlock-sidecar";
/// Upper bound on one API call.
const API_TIMEOUT: Duration = Duration::from_secs(10);
/// First retry delay after a failed call (before jitter).
const BACKOFF_MIN: Duration = Duration::from_millis(200);
/// Largest retry delay (before jitter).
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// `leaseDurationSeconds` is this many renew intervals, so readers see a live Lease between writes.
const LEASE_DURATION_INTERVALS: u32 = 3;
/// Longest Lease name we produce: a DNS-1123 label, which is also a valid subdomain.
const LEASE_NAME_MAX: usize = 63;

/// Whether to use the Kubernetes API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KubeMode {
    /// On when running in a cluster with `POD_NAME` set, off otherwise.
    Auto,
    /// Required: failing to set it up is an error.
    On,
    /// Never.
    Off,
}

impl FromStr for KubeMode {
    type Err = KubeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(KubeMode::Auto),
            "on" => Ok(KubeMode::On),
            "off" => Ok(KubeMode::Off),
            other => Err(KubeError::InvalidMode(other.to_string())),
        }
    }
}

impl fmt::Display for KubeMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KubeMode::Auto => "auto",
            KubeMode::On => "on",
            KubeMode::Off => "off",
        })
    }
}

/// How the integration behaves (parsed by the caller's config).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeSettings {
    /// Whether to use the API at all.
    pub mode: KubeMode,
    /// The pod label that says whether this pod leads (`"true"` / `"false"`).
    pub label_key: String,
    /// Whether to mirror leadership into a `coordination.k8s.io/v1` Lease.
    pub mirror_lease: bool,
    /// This pod's name (from `POD_NAME`); without it the integration is off.
    pub pod_name: Option<String>,
    /// This pod's uid (from `POD_UID`, the downward API's `metadata.uid`), for the Events'
    /// `involvedObject`. Without it the uid is learnt from the first label patch, which guard
    /// never makes.
    pub pod_uid: Option<String>,
    /// This pod's namespace; defaults to the service account's namespace.
    pub namespace: Option<String>,
    /// How often the leader rewrites the mirrored Lease; its duration is three of these.
    pub renew_interval: Duration,
}

/// What went wrong setting up or calling the Kubernetes API.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// A mode other than `auto`, `on` or `off`.
    #[error("invalid kubernetes mode {0:?}: expected auto, on or off")]
    InvalidMode(String),
    /// Mode `on`, but no pod name was given.
    #[error("kubernetes integration is on but the pod name is not set (POD_NAME)")]
    MissingPodName,
    /// Mode `on`, but there is no in-cluster configuration.
    #[error("kubernetes integration is on but no in-cluster configuration was found")]
    NotInCluster(#[source] kube::config::InClusterError),
    /// The client could not be built from the in-cluster configuration.
    #[error("could not build the kubernetes client")]
    Client(#[source] kube::Error),
    /// An API call failed.
    #[error("kubernetes {op} failed")]
    Api {
        /// The operation (`patch_label`, `create_event`, `update_lease`).
        op: &'static str,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// An API call did not answer in time.
    #[error("kubernetes {op} timed out after {after:?}")]
    Timeout {
        /// The operation (`patch_label`, `create_event`, `update_lease`).
        op: &'static str,
        /// The time limit.
        after: Duration,
    },
}

impl KubeError {
    /// A short, fixed name for logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            KubeError::InvalidMode(_) => "invalid_mode",
            KubeError::MissingPodName => "missing_pod_name",
            KubeError::NotInCluster(_) => "not_in_cluster",
            KubeError::Client(_) => "client",
            KubeError::Api { .. } => "api",
            KubeError::Timeout { .. } => "timeout",
        }
    }
}

/// The API operations, as counted in `redlock_kubernetes_errors_total{op}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    PatchLabel,
    CreateEvent,
    UpdateLease,
    GetPod,
}

impl Op {
    const ALL: [Op; 4] = [Op::PatchLabel, Op::CreateEvent, Op::UpdateLease, Op::GetPod];

    fn as_str(self) -> &'static str {
        match self {
            Op::PatchLabel => "patch_label",
            Op::CreateEvent => "create_event",
            Op::UpdateLease => "update_lease",
            Op::GetPod => "get_pod",
        }
    }
}

/// The metric family for API errors, `redlock_kubernetes_errors_total{op}`, with every `op`
/// present at 0, for the caller to register.
pub fn errors_counter() -> IntCounterVec {
    let counter = IntCounterVec::new(
        Opts::new(
            "redlock_kubernetes_errors_total",
            "Kubernetes API calls that failed, by operation",
        ),
        &["op"],
    )
    .expect("static metric definition is valid");
    for op in Op::ALL {
        counter.with_label_values(&[op.as_str()]);
    }
    counter
}

/// The name of the Lease mirroring `lock`: `redlock-<lock>` as a DNS-1123 label.
///
/// Characters other than `[a-z0-9-]` become `-` and upper case is lowered; when that changed
/// the name (or it had to be shortened), a hash of the original is appended so that two locks
/// never share a Lease.
pub fn lease_name(lock: &str) -> String {
    const PREFIX: &str = "redlock-";
    let mapped: String = lock
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '-' => c,
            'A'..='Z' => c.to_ascii_lowercase(),
            _ => '-',
        })
        .collect();
    let trimmed = mapped.trim_end_matches('-');
    let room = LEASE_NAME_MAX - PREFIX.len();
    if trimmed == lock && !trimmed.is_empty() && trimmed.len() <= room {
        return format!("{PREFIX}{trimmed}");
    }
    let hash = format!("{:08x}", fnv1a(lock.as_bytes()));
    let keep = room - hash.len() - 1;
    let head = trimmed[..trimmed.len().min(keep)].trim_end_matches('-');
    if head.is_empty() {
        format!("{PREFIX}{hash}")
    } else {
        format!("{PREFIX}{head}-{hash}")
    }
}

/// 32-bit FNV-1a: a stable, dependency-free hash for name suffixes.
fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |hash, &b| {
        (hash ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// A handle on the Kubernetes API for this pod. Cheap to clone (the guard keeps one for
/// [`Kube::event`] while [`Kube::observe`] consumes another).
#[derive(Clone)]
pub struct Kube {
    client: kube::Client,
    pod: String,
    namespace: String,
    settings: KubeSettings,
    errors: IntCounterVec,
    /// The pod's uid: from the settings, else learnt from the first label patch response.
    pod_uid: Arc<OnceLock<String>>,
    /// What retries, renewals, API timeouts and the step-down wake-up are measured on.
    clock: Clock,
}

impl Kube {
    /// Sets up the integration according to `settings.mode`.
    ///
    /// Off, or (in `auto`) no `POD_NAME` / no in-cluster configuration / no usable client:
    /// `Ok(None)` and one info line saying the integration is off and why. Mode `on` without a
    /// cluster: `Err` (the caller exits 2). Makes no API call: an unreachable API server
    /// must not delay the lock.
    pub async fn connect(
        settings: KubeSettings,
        errors: IntCounterVec,
    ) -> Result<Option<Kube>, KubeError> {
        let required = match settings.mode {
            KubeMode::Off => {
                info!("kubernetes integration off: disabled by configuration");
                return Ok(None);
            }
            KubeMode::On => true,
            KubeMode::Auto => false,
        };
        let Some(pod) = settings.pod_name.clone() else {
            if required {
                return Err(KubeError::MissingPodName);
            }
            info!("kubernetes integration off: the pod name (POD_NAME) is not set");
            return Ok(None);
        };
        let config = match kube::Config::incluster() {
            Ok(config) => config,
            Err(err) if required => return Err(KubeError::NotInCluster(err)),
            Err(err) => {
                info!(error = %err, "kubernetes integration off: not running in a cluster");
                return Ok(None);
            }
        };
        let client = match kube::Client::try_from(config) {
            Ok(client) => client,
            Err(err) if required => return Err(KubeError::Client(err)),
            Err(err) => {
                warn!(error = %err, "kubernetes integration off: could not build the client");
                return Ok(None);
            }
        };
        let kube = Kube::with_client(client, settings, pod, errors);
        info!(
            pod = %kube.pod,
            namespace = %kube.namespace,
            label = %kube.settings.label_key,
            mirror_lease = kube.settings.mirror_lease,
            "kubernetes integration on"
        );
        Ok(Some(kube))
    }

    /// A handle over a given client (a real one from [`Kube::connect`], or a mock in tests).
    /// The namespace is `settings.namespace`, else the client's default: in a cluster, the
    /// service account's namespace file.
    pub fn with_client(
        client: kube::Client,
        settings: KubeSettings,
        pod: String,
        errors: IntCounterVec,
    ) -> Kube {
        let namespace = settings
            .namespace
            .clone()
            .unwrap_or_else(|| client.default_namespace().to_owned());
        let pod_uid = Arc::new(OnceLock::new());
        if let Some(uid) = settings.pod_uid.clone() {
            let _ = pod_uid.set(uid);
        }
        Kube {
            client,
            pod,
            namespace,
            settings,
            errors,
            pod_uid,
            clock: Clock::Boot,
        }
    }

    /// This integration with its deadlines measured on `clock` (the boot clock by default;
    /// Tokio's for tests that pause time).
    pub fn with_clock(mut self, clock: Clock) -> Kube {
        self.clock = clock;
        self
    }

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
    ///   when `cancel` fires is finished within it); pending retries are tried at once when
    ///   that phase starts.
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

    /// Records one Event on this pod (e.g. the guard's `RunSkipped`, `LockLost`,
    /// `RunStarted`). Type `Warning` if `warning`, else `Normal`. A failure is logged, counted
    /// under `create_event` and returned; it is not retried.
    pub async fn event(&self, reason: &str, message: &str, warning: bool) -> Result<(), KubeError> {
        self.create_event(reason, message, warning)
            .await
            .inspect_err(|err| {
                let cause = source_of(err);
                warn!(reason, error = %err, %cause, "kubernetes event not recorded");
            })
    }

    /// Whether container `name` of this pod is ready, from the pod's status (its own
    /// readinessProbe decides; a container not started yet is not ready); `*`: every regular
    /// container (not the init containers, where a native sidecar runs). `None`: the pod has no
    /// such container.
    pub async fn container_ready(&self, name: &str) -> Result<Option<bool>, KubeError> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let pod = self.call(Op::GetPod, pods.get(&self.pod)).await?;
        let followed: Vec<String> = pod
            .spec
            .iter()
            .flat_map(|spec| spec.containers.iter())
            .map(|c| c.name.clone())
            .filter(|c| name == "*" || c == name)
            .collect();
        if followed.is_empty() {
            return Ok(None);
        }
        let statuses = pod
            .status
            .and_then(|status| status.container_statuses)
            .unwrap_or_default();
        let ready = followed.iter().all(|name| {
            statuses
                .iter()
                .any(|c| &c.name == name && c.ready && c.started != Some(false))
        });
        Ok(Some(ready))
    }

    /// Feeds `candidacy` with container `name`'s readiness every `interval`, until the
    /// channel's reader is gone. An answer that cannot be had (API error, timeout) changes
    /// nothing: the last known readiness stands, so an API outage moves no leadership.
    pub async fn follow_container(
        self,
        name: String,
        interval: Duration,
        candidacy: crate::candidacy::CandidacyTx,
    ) {
        let mut last = None;
        loop {
            let started = self.clock.now();
            let answer = self
                .clock
                .timeout_at(started + interval, self.container_ready(&name))
                .await;
            let ready = match answer {
                Ok(Ok(Some(ready))) => Some(ready),
                Ok(Ok(None)) => {
                    warn!(container = %name, "the pod has no container of this name; not contending");
                    Some(false)
                }
                Ok(Err(err)) => {
                    debug!(container = %name, error = %err, "cannot read the pod's status; the last known readiness stands");
                    None
                }
                Err(_) => None,
            };
            if let Some(ready) = ready {
                if last != Some(ready) {
                    info!(container = %name, ready, "the app container's readiness changed");
                    last = Some(ready);
                }
                candidacy.send_modify(|c| c.answered(ready, Deadline::now()));
            }
            if candidacy.is_closed() {
                return;
            }
            self.clock.sleep_until(started + interval).await;
        }
    }

    /// Runs one API call under [`API_TIMEOUT`], counting its failure under `op`.
    async fn call<T>(
        &self,
        op: Op,
        request: impl Future<Output = kube::Result<T>>,
    ) -> Result<T, KubeError> {
        let result = match self.clock.timeout(API_TIMEOUT, request).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(source)) => Err(KubeError::Api {
                op: op.as_str(),
                source,
            }),
            Err(_) => Err(KubeError::Timeout {
                op: op.as_str(),
                after: API_TIMEOUT,
            }),
        };
        if result.is_err() {
            self.errors.with_label_values(&[op.as_str()]).inc();
        }
        result
    }

    fn post_params() -> PostParams {
        PostParams {
            field_manager: Some(COMPONENT.to_string()),
            ..PostParams::default()
        }
    }

    async fn patch_label(&self, leading: bool) -> Result<(), KubeError> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let patch = serde_json::json!({
            "metadata": { "labels": { self.settings.label_key.as_str(): leading.to_string() } }
        });
        let params = PatchParams {
            field_manager: Some(COMPONENT.to_string()),
            ..PatchParams::default()
        };
        let pod = self
            .call(
                Op::PatchLabel,
                pods.patch(&self.pod, &params, &Patch::Merge(&patch)),
            )
            .await?;
        if let Some(uid) = pod.metadata.uid {
            let _ = self.pod_uid.set(uid);
        }
        Ok(())
    }

    async fn create_event(
        &self,
        reason: &str,
        message: &str,
        warning: bool,
    ) -> Result<(), KubeError> {
        let now = Timestamp::now();
        let event = Event {
            metadata: ObjectMeta {
                // client-go's convention: <object>.<unix nanos in hex>
                name: Some(format!("{}.{:x}", self.pod, now.as_nanosecond())),
                namespace: Some(self.namespace.clone()),
                ..ObjectMeta::default()
            },
            involved_object: ObjectReference {
                api_version: Some("v1".to_string()),
                kind: Some("Pod".to_string()),
                name: Some(self.pod.clone()),
                namespace: Some(self.namespace.clone()),
                uid: self.pod_uid.get().cloned(),
                ..ObjectReference::default()
            },
            reason: Some(reason.to_string()),
            message: Some(message.to_string()),
            type_: Some(if warning { "Warning" } else { "Normal" }.to_string()),
            count: Some(1),
            first_timestamp: Some(Time(now)),
            last_timestamp: Some(Time(now)),
            source: Some(EventSource {
                component: Some(COMPONENT.to_string()),
                host: None,
            }),
            reporting_component: Some(COMPONENT.to_string()),
            reporting_instance: Some(self.pod.clone()),
            ..Event::default()
        };
        let events: Api<Event> = Api::namespaced(self.client.clone(), &self.namespace);
        self.call(Op::CreateEvent, events.create(&Self::post_params(), &event))
            .await
            .map(drop)
    }

    fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    fn lease_duration_seconds(&self) -> i32 {
        let duration = self.settings.renew_interval * LEASE_DURATION_INTERVALS;
        let seconds = duration.as_millis().div_ceil(1000).max(1);
        i32::try_from(seconds).unwrap_or(i32::MAX)
    }
}

/// The error's cause (the API server's message), for log lines.
fn source_of(err: &KubeError) -> String {
    std::error::Error::source(err)
        .map(ToString::to_string)
        .unwrap_or_default()
}

/// Retry state of one operation.
#[derive(Default)]
struct Backoff {
    failures: u32,
    not_before: Option<Deadline>,
}

impl Backoff {
    fn due(&self, now: Deadline) -> bool {
        self.not_before.is_none_or(|at| now >= at)
    }

    /// Records a failure; returns the delay before the next attempt.
    fn failed(&mut self, now: Deadline) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let doublings = self.failures.saturating_sub(1).min(16);
        let ceiling = BACKOFF_MIN.saturating_mul(1 << doublings).min(BACKOFF_MAX);
        // "Equal jitter": half fixed, half random, so retries spread but never come too soon.
        let half = ceiling / 2;
        let delay = half + half.mul_f64(rand::rng().random::<f64>());
        self.not_before = Some(now + delay);
        delay
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

/// The observer's memory of what the API server already has.
struct Observer {
    kube: Kube,
    lease_name: Option<String>,
    /// The label value last accepted.
    label: Option<bool>,
    /// The term the Event history says we hold (`None`: none, or its loss was recorded).
    announced: Option<u64>,
    lease: LeaseMirror,
    backoff: [Backoff; 3],
}

impl Observer {
    fn new(kube: Kube) -> Self {
        Observer {
            kube,
            lease_name: None,
            label: None,
            announced: None,
            lease: LeaseMirror::default(),
            backoff: Default::default(),
        }
    }

    fn backoff(&mut self, op: Op) -> &mut Backoff {
        &mut self.backoff[op as usize]
    }

    fn due(&self, op: Op) -> bool {
        self.backoff[op as usize].due(self.kube.clock.now())
    }

    fn retry_now(&mut self) {
        for backoff in &mut self.backoff {
            backoff.not_before = None;
        }
    }

    fn succeeded(&mut self, op: Op) {
        *self.backoff(op) = Backoff::default();
    }

    fn failed(&mut self, op: Op, err: &KubeError) {
        let now = self.kube.clock.now();
        let retry_in = self.backoff(op).failed(now);
        warn!(
            op = op.as_str(),
            error = %err,
            cause = %source_of(err),
            ?retry_in,
            "kubernetes API call failed; will retry with the latest leadership"
        );
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
        if !self.due(Op::PatchLabel) {
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
        if !self.due(Op::CreateEvent) {
            return false;
        }
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

    async fn sync_lease(&mut self, leadership: &Leadership, term: Option<&Term>) -> bool {
        let needed = match term {
            Some(term) => {
                self.lease.term != Some(term.fencing_token)
                    || self.lease.renewed_at.is_none_or(|at| {
                        self.kube.clock.now() >= at + self.kube.settings.renew_interval
                    })
            }
            None => self.lease.names_us,
        };
        if !needed {
            return true;
        }
        if !self.due(Op::UpdateLease) {
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
        let leases = self.kube.leases();
        self.kube.call(Op::UpdateLease, leases.get_opt(name)).await
    }

    /// Writes this process as holder (create, or update on the known `resourceVersion`).
    async fn write_lease(&mut self, leadership: &Leadership, term: &Term) -> Result<(), KubeError> {
        let name = self.lease_name(&leadership.lock);
        let current = self.current_lease(&name).await?;
        let new_term = self.lease.term != Some(term.fencing_token);
        let now = MicroTime(Timestamp::now());
        let identity = &leadership.identity;
        let leases = self.kube.leases();
        let params = Kube::post_params();

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
                self.kube
                    .call(Op::UpdateLease, leases.create(&params, &lease))
                    .await?
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
                self.kube
                    .call(Op::UpdateLease, leases.replace(&name, &params, &lease))
                    .await?
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
                let leases = self.kube.leases();
                let written = self
                    .kube
                    .call(
                        Op::UpdateLease,
                        leases.replace(&name, &Kube::post_params(), &lease),
                    )
                    .await?;
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
        let retries = self.backoff.iter().filter_map(|b| b.not_before);
        let renewal = match term {
            Some(_) if self.kube.settings.mirror_lease => self
                .lease
                .renewed_at
                .map(|at| at + self.kube.settings.renew_interval),
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

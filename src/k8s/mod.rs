//! Kubernetes integration: publish who leads on the pod, as Events, and (optionally) as a Lease;
//! follow the app container's readiness from the pod's status.
//!
//! [`Kube::observe`] ([`observe`]) reads the leadership `watch` channel (it never writes it)
//! and, each time "leading" flips for this process, does in this order:
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
//!    `renewTime` is now, `leaseTransitions` counts changes of holder. It is written when a
//!    term starts, then renewed every [`lease_write_interval`] (the renew interval, but never
//!    more often than every [`LEASE_MIN_WRITE_INTERVAL`], 5 s: at most 12 writes a minute), and
//!    `leaseDurationSeconds` is three of those intervals (15 s at least, client-go's default).
//!    On a step-down the former leader clears `holderIdentity`, but only if the Lease still
//!    names it (optimistic concurrency on `resourceVersion`); followers never write it, so two
//!    pods never fight over it.
//!
//! "Leading" is always `Leadership::leading_at(Deadline::now())`, and the observer also wakes at
//! `step_down_at`, so a lock loop that stalls without publishing still clears the label.
//!
//! [`Kube::follow_container`] ([`pod`]) reads the pod's status from one list and then one watch
//! of the pod (field selector `metadata.name=POD`), resumed from its `resourceVersion`.
//!
//! ## Behavior toward the API server
//! - **Steady rate.** Per pod: one list at start, then one watch request every 5 to 10
//!   minutes (the watch's `timeoutSeconds`, drawn at random so a fleet does not reconnect in
//!   step), re-listing only on `410 Gone`. The leader adds its label patch and Event on each
//!   change of leadership and, with the Lease mirror, at most 12 Lease writes a minute.
//! - **Failures** (any status other than 2xx, a connection error, no response head within
//!   10 s, a watch silent past its own timeout) back off per operation ([`retry`]) with equal
//!   jitter: writes from 1 s doubling to 60 s; the pod's watch once after 0.5 to 1 s, then every
//!   1 to 2 minutes. Never before the server's `Retry-After`, and never more than two attempts of
//!   an operation in any minute (the pod's watch: ever; writes: while they fail). The pod's
//!   status thus stays within its steady budget of one request a minute, and the leader's writes
//!   fall below their steady rate.
//! - **No client-side retries** beyond those: kube's default retry layer is not used (see
//!   [`api`]); each request carries `User-Agent: redlock-sidecar/VERSION`.
//! - **Counted and logged once.** Every failed call is counted in
//!   `redlock_kubernetes_errors_total{op}`, `op` one of `patch_label`, `create_event`,
//!   `update_lease`, `watch_pod` (a `410 Gone` on the watch is the protocol's "list again", not
//!   a failure; a Lease not found is not one either). A warning is logged when an operation
//!   starts failing or fails for a new reason, an info line when it works again, debug lines
//!   in between.
//! - **They never affect the lock**: this module only reads the leadership state. An
//!   unreadable pod status is reported to the candidacy (`Candidacy::unreadable`), which
//!   decides how long the last known readiness stands.
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
//!   - apiGroups: [""]             # only with --follow-container: list + watch of its own pod
//!     resources: ["pods"]         # (field selector metadata.name)
//!     verbs: ["list", "watch"]
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

pub mod api;
pub mod observe;
pub mod pod;
pub mod retry;

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{PatchParams, PostParams};
use kube::Resource;
use prometheus::{IntCounterVec, Opts};
use tracing::{info, warn};

use crate::clock::Clock;

pub use api::{client, USER_AGENT_VALUE};
pub use pod::container_ready;

/// The component name on Events, and the field manager of every write.
pub const COMPONENT: &str = "redlock-sidecar";
/// The Lease mirror is renewed at most this often, whatever the renew interval.
pub const LEASE_MIN_WRITE_INTERVAL: Duration = Duration::from_secs(5);
/// `leaseDurationSeconds` is this many write intervals, so readers see a live Lease between writes.
const LEASE_DURATION_INTERVALS: u32 = 3;
/// Longest Lease name we produce: a DNS-1123 label, which is also a valid subdomain.
const LEASE_NAME_MAX: usize = 63;

/// How often the leader renews the mirrored Lease: the renew interval, but not more often
/// than every [`LEASE_MIN_WRITE_INTERVAL`].
pub fn lease_write_interval(renew_interval: Duration) -> Duration {
    renew_interval.max(LEASE_MIN_WRITE_INTERVAL)
}

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
    /// The lock's renew interval; the mirrored Lease is renewed at this pace, but at most
    /// every [`LEASE_MIN_WRITE_INTERVAL`] ([`lease_write_interval`]).
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
    /// An API call failed: an answer other than 2xx, a connection error, a bad response.
    #[error("kubernetes {op} failed")]
    Api {
        /// The operation, as counted (`patch_label`, `create_event`, `update_lease`,
        /// `watch_pod`).
        op: &'static str,
        /// The client's error; for an HTTP error, `kube::Error::Api` with the server's
        /// `Status` and the HTTP status as its code.
        #[source]
        source: kube::Error,
        /// How long the server asked to wait (`Retry-After`, or the Status'
        /// `retryAfterSeconds`).
        retry_after: Option<Duration>,
    },
    /// An API call did not answer in time.
    #[error("kubernetes {op} timed out after {after:?}")]
    Timeout {
        /// The operation, as counted.
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

    /// Why a call failed, from a small fixed set (for log lines): `throttled` (429),
    /// `unavailable` (503), `server_error` (other 5xx), `unauthorized` (401), `forbidden`
    /// (403), `not_found`, `conflict` (409), `gone` (410), `rejected` (other 4xx),
    /// `timeout`, `connection`, `bad_response`, `other`.
    pub fn reason(&self) -> &'static str {
        match self {
            KubeError::Timeout { .. } => "timeout",
            KubeError::Api { source, .. } => match source {
                kube::Error::Api(status) => match status.code {
                    429 => "throttled",
                    503 => "unavailable",
                    500..=599 => "server_error",
                    401 => "unauthorized",
                    403 => "forbidden",
                    404 => "not_found",
                    409 => "conflict",
                    410 => "gone",
                    _ => "rejected",
                },
                kube::Error::HyperError(_) | kube::Error::Service(_) => "connection",
                kube::Error::SerdeError(_)
                | kube::Error::FromUtf8(_)
                | kube::Error::ReadEvents(_)
                | kube::Error::LinesCodecMaxLineLengthExceeded => "bad_response",
                _ => "other",
            },
            _ => self.kind(),
        }
    }

    /// The HTTP status of a call the server answered with an error.
    pub fn status(&self) -> Option<u16> {
        match self {
            KubeError::Api {
                source: kube::Error::Api(status),
                ..
            } => Some(status.code),
            _ => None,
        }
    }

    /// How long the server asked to wait before the next attempt.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            KubeError::Api { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// The error's cause (the API server's message), for log lines.
    pub fn cause(&self) -> String {
        match self {
            KubeError::Api {
                source: kube::Error::Api(status),
                ..
            } => format!("{} {}: {}", status.code, status.reason, status.message),
            _ => std::error::Error::source(self)
                .map(ToString::to_string)
                .unwrap_or_default(),
        }
    }

    fn api(op: Op, source: kube::Error) -> KubeError {
        KubeError::Api {
            op: op.as_str(),
            source,
            retry_after: None,
        }
    }

    fn timeout(op: Op) -> KubeError {
        KubeError::Timeout {
            op: op.as_str(),
            after: api::API_TIMEOUT,
        }
    }
}

/// The API operations, as counted in `redlock_kubernetes_errors_total{op}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    PatchLabel,
    CreateEvent,
    UpdateLease,
    WatchPod,
}

impl Op {
    const ALL: [Op; 4] = [
        Op::PatchLabel,
        Op::CreateEvent,
        Op::UpdateLease,
        Op::WatchPod,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Op::PatchLabel => "patch_label",
            Op::CreateEvent => "create_event",
            Op::UpdateLease => "update_lease",
            Op::WatchPod => "watch_pod",
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
    /// must not delay the lock. The client is [`client`]'s: no retry layer of its own.
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
        let client = match client(config) {
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
            user_agent = USER_AGENT_VALUE,
            "kubernetes integration on"
        );
        Ok(Some(kube))
    }

    /// A handle over a given client (a real one from [`Kube::connect`] or [`client`], or a mock
    /// in tests). The namespace is `settings.namespace`, else the client's default: in a
    /// cluster, the service account's namespace file.
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

    /// Records one Event on this pod (e.g. the guard's `RunSkipped`, `LockLost`,
    /// `RunStarted`). Type `Warning` if `warning`, else `Normal`. A failure is logged, counted
    /// under `create_event` and returned; it is not retried.
    pub async fn event(&self, reason: &str, message: &str, warning: bool) -> Result<(), KubeError> {
        self.create_event(reason, message, warning)
            .await
            .inspect_err(|err| {
                warn!(reason, error = %err, cause = %err.cause(), "kubernetes event not recorded");
            })
    }

    fn post_params() -> PostParams {
        PostParams {
            field_manager: Some(COMPONENT.to_string()),
            ..PostParams::default()
        }
    }

    fn patch_params() -> PatchParams {
        PatchParams {
            field_manager: Some(COMPONENT.to_string()),
            ..PatchParams::default()
        }
    }

    /// Requests on resources of kind `K` in this pod's namespace.
    fn requests<K: Resource<DynamicType = ()>>(&self) -> kube::core::Request {
        kube::core::Request::new(K::url_path(&(), Some(&self.namespace)))
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
        let body = serde_json::to_vec(&event)
            .map_err(|err| KubeError::api(Op::CreateEvent, kube::Error::SerdeError(err)))?;
        let request = self.requests::<Event>().create(&Self::post_params(), body);
        self.call::<Event>(Op::CreateEvent, request).await.map(drop)
    }

    async fn patch_label(&self, leading: bool) -> Result<(), KubeError> {
        let patch = serde_json::json!({
            "metadata": { "labels": { self.settings.label_key.as_str(): leading.to_string() } }
        });
        let request = self.requests::<Pod>().patch(
            &self.pod,
            &Self::patch_params(),
            &kube::api::Patch::Merge(&patch),
        );
        let pod: Pod = self.call(Op::PatchLabel, request).await?;
        if let Some(uid) = pod.metadata.uid {
            let _ = self.pod_uid.set(uid);
        }
        Ok(())
    }
}

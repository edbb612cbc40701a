//! Following the app container's readiness from the pod's status: one list, then one watch of
//! this pod, resumed from its `resourceVersion`.
//!
//! ## Behavior
//! - **Start:** a list of the pod (field selector `metadata.name=POD`, `resourceVersion=0`, so
//!   the API server answers from its watch cache, as client-go's reflector does), then a watch
//!   from the list's `resourceVersion` with bookmarks and a `timeoutSeconds` drawn between 5 and
//!   10 minutes. Each `ADDED`/`MODIFIED` answers the candidacy (`Candidacy::answered`) with the
//!   container's readiness; bookmarks move the `resourceVersion` on.
//! - **A watch that ends** (its timeout) is opened again at once from the last
//!   `resourceVersion`: at steady state one request per pod every 5 to 10 minutes.
//! - **`410 Gone`** (the `resourceVersion` left the server's history) lists again, this time
//!   without `resourceVersion=0` (a consistent read). It is not a failure.
//! - **A failure** (an error status, a connection error, no response head within 10 s, an
//!   `ERROR` event, a stream silent 30 s past its own timeout, the pod missing from the list) is
//!   counted under `watch_pod`, logged once per change ([`Health`]), reported to the candidacy
//!   as `Candidacy::unreadable(now)`, and retried after the backoff of [`super::retry`].
//! - **Never more than two requests in any minute**, steady or failing ([`WATCH_RETRY`]).
//! - A watch the server accepts again is a readable answer: the last known readiness is
//!   answered again at once (events since the `resourceVersion` follow in the stream).
//! - A pod without a container of that name answers "not ready", with a warning.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, WatchParams};
use kube::core::{ObjectList, WatchEvent};
use rand::Rng;
use tracing::{debug, info, warn};

use super::api::{next_chunk, MAX_BODY_BYTES};
use super::retry::{jitter, Health, Retry, RetryPolicy};
use super::{Kube, KubeError, Op};
use crate::candidacy::CandidacyTx;
use crate::clock::Deadline;

/// How the pod's list and watch back off: one quick retry (0.5 to 1 s, for a blip), then every
/// 1 to 2 minutes (less than once a minute, the steady budget of this read), and at most two
/// requests in any minute, ever.
pub const WATCH_RETRY: RetryPolicy = RetryPolicy {
    first: Duration::from_secs(1),
    factor: 120,
    cap: Duration::from_secs(120),
    window_always: true,
};
/// The shortest `timeoutSeconds` asked of a watch.
pub const WATCH_TIMEOUT_MIN: Duration = Duration::from_secs(300);
/// The longest `timeoutSeconds` asked of a watch (exclusive).
pub const WATCH_TIMEOUT_MAX: Duration = Duration::from_secs(600);
/// How long a watch may stay silent past its own timeout before it counts as hung.
pub const WATCH_GRACE: Duration = Duration::from_secs(30);

/// Whether container `name` is ready in `pod`'s status (its own readinessProbe decides; a
/// container not started yet is not ready); `*`: every regular container (not the init
/// containers, where a native sidecar runs). `None`: the pod has no such container.
pub fn container_ready(pod: &Pod, name: &str) -> Option<bool> {
    let followed: Vec<&str> = pod
        .spec
        .iter()
        .flat_map(|spec| spec.containers.iter())
        .map(|c| c.name.as_str())
        .filter(|c| name == "*" || *c == name)
        .collect();
    if followed.is_empty() {
        return None;
    }
    let statuses = pod
        .status
        .as_ref()
        .and_then(|status| status.container_statuses.as_ref());
    let ready = followed.iter().all(|name| {
        statuses.is_some_and(|statuses| {
            statuses
                .iter()
                .any(|c| c.name == *name && c.ready && c.started != Some(false))
        })
    });
    Some(ready)
}

impl Kube {
    /// Feeds `candidacy` with container `name`'s readiness, read from one watch of this pod,
    /// until the channel's reader is gone (see the module documentation). `_interval`
    /// (`--app-ready-interval`) paces nothing here: changes arrive as they happen.
    pub async fn follow_container(self, name: String, _interval: Duration, candidacy: CandidacyTx) {
        let closed = candidacy.clone();
        let mut watch = PodWatch {
            kube: self,
            container: name,
            candidacy,
            retry: Retry::new(WATCH_RETRY),
            health: Health::default(),
            resource_version: None,
            consistent_list: false,
            ready: None,
            warned_missing: false,
        };
        tokio::select! {
            _ = closed.closed() => {}
            () = watch.run() => {}
        }
    }
}

/// How one list or watch ended, when it did not fail.
enum Ended {
    /// Read; go on watching.
    Read,
    /// `410 Gone`: list again.
    Relist,
}

struct PodWatch {
    kube: Kube,
    container: String,
    candidacy: CandidacyTx,
    retry: Retry,
    health: Health,
    /// Where the next watch resumes; `None`: list first.
    resource_version: Option<String>,
    /// Whether the next list must be a consistent read (after `410 Gone`).
    consistent_list: bool,
    /// The readiness last answered.
    ready: Option<bool>,
    /// Whether the missing container was already warned about.
    warned_missing: bool,
}

impl PodWatch {
    async fn run(&mut self) {
        let clock = self.kube.clock;
        loop {
            if let Some(at) = self.retry.next_at() {
                clock.sleep_until(at).await;
            }
            let now = clock.now();
            self.retry.started(now);
            let outcome = match self.resource_version.clone() {
                None => self.list().await,
                Some(version) => self.watch(&version).await,
            };
            match outcome {
                Ok(Ended::Read) => {}
                Ok(Ended::Relist) => {
                    debug!("the pod's resourceVersion is gone from the API server's history; listing again");
                    self.resource_version = None;
                    self.consistent_list = true;
                }
                Err(err) => self.failed(&err),
            }
        }
    }

    /// A request answered: the pod's status is readable again.
    fn readable(&mut self) {
        self.retry.succeeded();
        self.health.succeeded(Op::WatchPod.as_str());
    }

    fn failed(&mut self, err: &KubeError) {
        self.kube
            .errors
            .with_label_values(&[Op::WatchPod.as_str()])
            .inc();
        let now = self.kube.clock.now();
        let next = self.retry.failed(now, err.retry_after(), jitter());
        self.health
            .failed(Op::WatchPod.as_str(), err, Some(next - now));
        self.candidacy
            .send_modify(|c| c.unreadable(Deadline::now()));
    }

    fn selector(&self) -> String {
        format!("metadata.name={}", self.kube.pod)
    }

    async fn list(&mut self) -> Result<Ended, KubeError> {
        let params = ListParams {
            field_selector: Some(self.selector()),
            resource_version: (!self.consistent_list).then(|| "0".to_string()),
            ..ListParams::default()
        };
        let request = self.kube.requests::<Pod>().list(&params);
        let list: ObjectList<Pod> = match request {
            Ok(request) => self.kube.fetch(Op::WatchPod, request).await?,
            Err(err) => return Err(KubeError::api(Op::WatchPod, kube::Error::BuildRequest(err))),
        };
        let pod = list
            .items
            .into_iter()
            .find(|pod| pod.metadata.name.as_deref() == Some(self.kube.pod.as_str()));
        let Some(pod) = pod else {
            return Err(KubeError::Api {
                op: Op::WatchPod.as_str(),
                source: kube::Error::Api(
                    kube::core::Status::failure(
                        &format!(
                            "pod {} not found in namespace {}",
                            self.kube.pod, self.kube.namespace
                        ),
                        "NotFound",
                    )
                    .with_code(404)
                    .boxed(),
                ),
                retry_after: None,
            });
        };
        self.readable();
        self.consistent_list = false;
        self.resource_version = list.metadata.resource_version.clone();
        self.observe(&pod);
        Ok(Ended::Read)
    }

    async fn watch(&mut self, version: &str) -> Result<Ended, KubeError> {
        let timeout = rand::rng().random_range(WATCH_TIMEOUT_MIN..WATCH_TIMEOUT_MAX);
        let params = WatchParams {
            field_selector: Some(self.selector()),
            timeout: Some(u32::try_from(timeout.as_secs()).unwrap_or(u32::MAX)),
            bookmarks: true,
            ..WatchParams::default()
        };
        let request = match self.kube.requests::<Pod>().watch(&params, version) {
            Ok(request) => request,
            Err(err) => return Err(KubeError::api(Op::WatchPod, kube::Error::BuildRequest(err))),
        };
        let mut body = match self.kube.exchange(Op::WatchPod, request).await {
            Ok(response) => response.into_body(),
            Err(err) if err.status() == Some(410) => return Ok(Ended::Relist),
            Err(err) => return Err(err),
        };
        self.readable();
        if let Some(ready) = self.ready {
            self.candidacy
                .send_modify(|c| c.answered(ready, Deadline::now()));
        }
        let hung_at = self.kube.clock.now() + timeout + WATCH_GRACE;
        let mut pending: Vec<u8> = Vec::new();
        loop {
            let chunk = match self
                .kube
                .clock
                .timeout_at(hung_at, next_chunk(&mut body))
                .await
            {
                Ok(Some(Ok(chunk))) => chunk,
                // The server ended the watch (its timeout): resume from where it left off.
                Ok(None) => return Ok(Ended::Read),
                Ok(Some(Err(source))) => return Err(KubeError::api(Op::WatchPod, source)),
                Err(_) => {
                    return Err(KubeError::Timeout {
                        op: Op::WatchPod.as_str(),
                        after: timeout + WATCH_GRACE,
                    })
                }
            };
            pending.extend_from_slice(&chunk);
            while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                if let Some(ended) = self.event(&line)? {
                    return Ok(ended);
                }
            }
            if pending.len() > MAX_BODY_BYTES {
                return Err(KubeError::api(
                    Op::WatchPod,
                    kube::Error::LinesCodecMaxLineLengthExceeded,
                ));
            }
        }
    }

    /// One line of the watch; `Some` when the watch must end there.
    fn event(&mut self, line: &[u8]) -> Result<Option<Ended>, KubeError> {
        let event: WatchEvent<Pod> = serde_json::from_slice(line)
            .map_err(|err| KubeError::api(Op::WatchPod, kube::Error::SerdeError(err)))?;
        match event {
            WatchEvent::Added(pod) | WatchEvent::Modified(pod) => {
                self.resource_version = pod.metadata.resource_version.clone();
                self.observe(&pod);
            }
            WatchEvent::Deleted(pod) => {
                // The pod object is gone (a forced deletion): an app that no longer has a pod
                // is not ready.
                self.resource_version = None;
                warn!(pod = ?pod.metadata.name, "this pod was deleted from the API server");
                self.answer(false);
            }
            WatchEvent::Bookmark(bookmark) => {
                self.resource_version = Some(bookmark.metadata.resource_version);
            }
            WatchEvent::Error(status) if status.code == 410 => return Ok(Some(Ended::Relist)),
            WatchEvent::Error(status) => {
                return Err(KubeError::Api {
                    op: Op::WatchPod.as_str(),
                    source: kube::Error::Api(status),
                    retry_after: None,
                })
            }
        }
        Ok(None)
    }

    /// Answers the candidacy from `pod`'s status.
    fn observe(&mut self, pod: &Pod) {
        match container_ready(pod, &self.container) {
            Some(ready) => self.answer(ready),
            None => {
                if !self.warned_missing {
                    warn!(container = %self.container, "the pod has no container of this name; not ready");
                    self.warned_missing = true;
                }
                self.answer(false);
            }
        }
    }

    fn answer(&mut self, ready: bool) {
        if self.ready != Some(ready) {
            info!(container = %self.container, ready, "the app container's readiness changed");
            self.ready = Some(ready);
        }
        self.candidacy
            .send_modify(|c| c.answered(ready, Deadline::now()));
    }
}

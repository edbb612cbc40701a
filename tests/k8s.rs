//! The Kubernetes integration against a mocked API server (controller-rs' fixtures pattern).
//!
//! A `tower_test` mock stands in for the API server. For each [`Scenario`], a verifier task
//! plays the lock loop (it owns the leadership sender) and the API server: it publishes
//! leadership, then asserts method, path, query and JSON body of each expected request in
//! order and answers with a realistic response. A missing call fails after [`CALL_TIMEOUT`];
//! "no further call" is asserted by waiting for the next request under [`QUIET`] and
//! requiring that none arrives. Time is paused (auto-advancing) wherever backoff or renewal
//! timing is involved, so no test waits real seconds.
//!
//! One test runs the real lock loop against a real `redis-server` while the mocked API server
//! refuses everything, to show that API failures never reach the lock.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use http::{header, Method, Request, Response, StatusCode};
use hyper::body::{Bytes, Frame};
use kube::client::Body;
use prometheus::IntCounterVec;
use redlock_sidecar::candidacy::Candidacy;
use redlock_sidecar::clock::{Clock, Deadline};
use redlock_sidecar::config::Renewal;
use redlock_sidecar::k8s::{
    container_ready, errors_counter, lease_name, Kube, KubeMode, KubeSettings, USER_AGENT_VALUE,
};
use redlock_sidecar::leadership::{HolderView, Leadership, LeadershipTx, Role, Term};
use redlock_sidecar::lease;
use redlock_sidecar::redlock::{Credentials, NodeSpec, RedlockConfig};
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower_test::mock::{self, Handle, SendResponse};

const NAMESPACE: &str = "shop";
const POD: &str = "orders-7d9f-0";
const POD_UID: &str = "5b0e6c1e-3f4a-4c8e-9a51-2d7b8f0c1a23";
const LOCK: &str = "orders-cron";
const IDENTITY: &str = "orders-7d9f-0";
const OTHER: &str = "orders-7d9f-1";
const LABEL: &str = "redlock.io/leader";
const FIELD_MANAGER_QUERY: &str = "&fieldManager=redlock-sidecar";
const RENEW_INTERVAL: Duration = Duration::from_secs(1);
/// How often the leader rewrites the Lease with [`RENEW_INTERVAL`]: not more often than 5 s.
const LEASE_WRITE_INTERVAL: Duration = Duration::from_secs(5);
/// How long the verifier waits for an expected call.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the verifier listens to assert that no call arrives.
const QUIET: Duration = Duration::from_millis(500);
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

type ApiHandle = Handle<Request<Body>, Response<ApiBody>>;
type Responder = SendResponse<Response<ApiBody>>;

// ---------------------------------------------------------------------------------------------
// Leadership states

fn follower() -> Leadership {
    Leadership::new(LOCK, IDENTITY)
}

/// A follower that sees another pod holding the lock.
fn follower_of(holder: &str) -> Leadership {
    Leadership {
        holder: Some(HolderView {
            identity: holder.to_string(),
            fencing_token: Some(41),
            observed_at: SystemTime::now(),
        }),
        quorum_reachable: true,
        ..follower()
    }
}

/// A leader whose term lasts `for_` from now (on the boot clock, as `leading_at` is read).
fn leader_for(token: u64, for_: Duration) -> Leadership {
    let now = Deadline::now();
    Leadership {
        role: Role::Leader(Term {
            fencing_token: token,
            since: SystemTime::now(),
            step_down_at: now + for_,
            valid_until: now + for_ + Duration::from_secs(1),
        }),
        holder: Some(HolderView {
            identity: IDENTITY.to_string(),
            fencing_token: Some(token),
            observed_at: SystemTime::now(),
        }),
        quorum_reachable: true,
        ..follower()
    }
}

/// A leader whose term outlasts any test.
fn leader(token: u64) -> Leadership {
    leader_for(token, Duration::from_secs(3600))
}

fn settings(mirror_lease: bool) -> KubeSettings {
    KubeSettings {
        mode: KubeMode::On,
        label_key: LABEL.to_string(),
        mirror_lease,
        pod_name: Some(POD.to_string()),
        pod_uid: None,
        namespace: Some(NAMESPACE.to_string()),
        renew_interval: RENEW_INTERVAL,
    }
}

fn errors_for(errors: &IntCounterVec, op: &str) -> u64 {
    errors.with_label_values(&[op]).get()
}

// ---------------------------------------------------------------------------------------------
// The mocked API server

/// What the verifier expects, from start to end of one observer's life.
enum Scenario {
    /// Starts as follower of another pod: label `false`, nothing else (never the Lease).
    FollowerOnly,
    /// Follower, then leader: label `true`, then `LeaderElected`; then the sender is dropped.
    Gain,
    /// Leader from the start, then loses the lock while running: label `false`, `LeadershipLost`.
    GainThenLoss,
    /// Leader with the Lease mirrored: created, renewed once per interval, vacated on loss.
    MirroredLease,
    /// Leader taking over a Lease another pod held: update with one more transition.
    LeaseTakeover,
    /// The first label patch answers 500; it is counted and retried.
    LabelPatchFailsOnce,
    /// The label patch fails, then the state flips three times before the retry: the retry
    /// applies only the latest state.
    OutageWithFlips,
    /// Leader; the lock loop publishes its release and drops the sender.
    SenderDroppedAfterRelease,
    /// Leader with the Lease mirrored; `cancel` fires, then the lock loop releases.
    CancelledWhileLeading,
    /// Leader whose term runs out without any new publish.
    TermRunsOut,
    /// Leader; the Lease create answers 409 (another pod created it first): counted, re-read,
    /// then taken over with one more transition.
    LeaseCreateConflict,
    /// Leader; the Lease renewal answers 409 (someone else wrote it): counted, re-read, and the
    /// leader writes itself again on the fresh resourceVersion.
    LeaseReplaceConflict,
    /// Leader, then follower; vacating answers 409, and the re-read Lease names another holder:
    /// it is left alone.
    VacateFindsAnotherHolder,
    /// The label patch answers 403 twice (RBAC missing): retried after 0.5 to 1 s, then not
    /// again within a minute of the first; it then succeeds;
    /// the Event is recorded meanwhile.
    LabelPatchForbidden,
    /// The Lease read answers 403; label and Event go on, the Lease is retried.
    LeaseForbidden,
    /// The API server never answers the label patch: the call times out, is counted, retried.
    ApiTimeout,
}

struct ApiServerVerifier {
    handle: ApiHandle,
    /// The lock loop's sender; `None` once dropped.
    tx: Option<LeadershipTx>,
    cancel: CancellationToken,
    errors: IntCounterVec,
}

impl ApiServerVerifier {
    /// Plays `scenario`; returns the sender if the scenario kept it alive.
    fn run(mut self, scenario: Scenario) -> JoinHandle<Option<LeadershipTx>> {
        tokio::spawn(async move {
            match scenario {
                Scenario::FollowerOnly => {
                    self.expect_label("false").await;
                    self.lock_loop_ends().await;
                    None
                }
                Scenario::Gain => {
                    self.expect_label("false").await;
                    self.expect_quiet().await;
                    self.publish(leader(7));
                    self.expect_label("true").await;
                    let event = self.expect_event("LeaderElected", "Normal").await;
                    assert_eq!(
                        event["involvedObject"]["uid"], POD_UID,
                        "uid from the patched pod"
                    );
                    assert_message_names(&event, "7");
                    self.lock_loop_ends().await;
                    None
                }
                Scenario::GainThenLoss => {
                    self.expect_label("true").await;
                    self.expect_event("LeaderElected", "Normal").await;
                    self.publish(follower_of(OTHER));
                    self.expect_label("false").await;
                    let event = self.expect_event("LeadershipLost", "Warning").await;
                    assert_message_names(&event, "7");
                    self.lock_loop_ends().await;
                    None
                }
                Scenario::MirroredLease => {
                    self.expect_label("false").await;
                    self.expect_quiet().await;
                    self.publish(leader(7));
                    self.expect_label("true").await;
                    self.expect_event("LeaderElected", "Normal").await;
                    self.expect_lease_get(None).await;
                    let created = self.expect_lease_write(Method::POST, "1").await;
                    assert_eq!(created["metadata"]["name"], "redlock-orders-cron");
                    assert_eq!(created["spec"]["holderIdentity"], IDENTITY);
                    assert_eq!(
                        created["spec"]["leaseDurationSeconds"], 15,
                        "3 write intervals: the renew interval (1 s), but at least 5 s"
                    );
                    assert_eq!(created["spec"]["leaseTransitions"], 0);
                    assert!(created["spec"]["renewTime"].is_string(), "{created}");
                    assert!(created["spec"]["acquireTime"].is_string(), "{created}");
                    // Not every renew interval (1 s): 5 s later, an update on the known
                    // resourceVersion.
                    let written = tokio::time::Instant::now();
                    self.expect_quiet().await;
                    let renewed = self
                        .expect_lease_write_within(Method::PUT, "2", Duration::from_secs(6))
                        .await;
                    assert_eq!(written.elapsed(), LEASE_WRITE_INTERVAL);
                    assert_eq!(renewed["metadata"]["resourceVersion"], "1");
                    assert_eq!(renewed["spec"]["holderIdentity"], IDENTITY);
                    assert_eq!(renewed["spec"]["leaseTransitions"], 0);
                    assert!(renewed["spec"]["renewTime"].is_string(), "{renewed}");
                    self.publish(follower());
                    self.expect_label("false").await;
                    self.expect_event("LeadershipLost", "Warning").await;
                    let vacated = self.expect_lease_write(Method::PUT, "3").await;
                    assert_eq!(vacated["metadata"]["resourceVersion"], "2");
                    assert_eq!(vacated["spec"].get("holderIdentity"), None, "{vacated}");
                    self.lock_loop_ends().await;
                    None
                }
                Scenario::LeaseTakeover => {
                    self.expect_label("true").await;
                    self.expect_event("LeaderElected", "Normal").await;
                    self.expect_lease_get(Some(lease_held_by(OTHER, 2, "40")))
                        .await;
                    let updated = self.expect_lease_write(Method::PUT, "41").await;
                    assert_eq!(updated["metadata"]["resourceVersion"], "40");
                    assert_eq!(updated["spec"]["holderIdentity"], IDENTITY);
                    assert_eq!(updated["spec"]["leaseTransitions"], 3);
                    assert_eq!(updated["spec"]["leaseDurationSeconds"], 15);
                    self.lock_loop_ends().await;
                    None
                }
                Scenario::LabelPatchFailsOnce => {
                    self.expect_label_to_fail("false", StatusCode::INTERNAL_SERVER_ERROR)
                        .await;
                    let (request, respond) = self.next("the retried label patch").await;
                    assert_eq!(errors_for(&self.errors, "patch_label"), 1);
                    self.answer_label(request, respond, "false").await;
                    self.lock_loop_ends().await;
                    None
                }
                Scenario::OutageWithFlips => {
                    self.expect_label_to_fail("true", StatusCode::SERVICE_UNAVAILABLE)
                        .await;
                    self.expect_event("LeaderElected", "Normal").await;
                    // While the label patch backs off, the observer sees three more states
                    // (each Event is the sync point): lost, won again (token 6), lost again.
                    self.publish(follower());
                    self.expect_event("LeadershipLost", "Warning").await;
                    self.publish(leader(6));
                    self.expect_event("LeaderElected", "Normal").await;
                    self.publish(follower_of(OTHER));
                    let event = self.expect_event("LeadershipLost", "Warning").await;
                    assert_message_names(&event, "6");
                    // The retry carries the latest state, not the failed "true" nor a replay.
                    self.expect_label("false").await;
                    assert_eq!(errors_for(&self.errors, "patch_label"), 1);
                    self.lock_loop_ends().await;
                    None
                }
                Scenario::SenderDroppedAfterRelease => {
                    self.expect_label("true").await;
                    self.expect_event("LeaderElected", "Normal").await;
                    self.publish(follower());
                    self.tx = None;
                    self.expect_label("false").await;
                    let event = self.expect_event("LockReleased", "Normal").await;
                    assert_message_names(&event, "9");
                    self.lock_loop_ends().await;
                    None
                }
                Scenario::CancelledWhileLeading => {
                    self.expect_label("true").await;
                    self.expect_event("LeaderElected", "Normal").await;
                    self.expect_lease_get(None).await;
                    self.expect_lease_write(Method::POST, "1").await;
                    // Shutdown begins; the lock is still held until the lock loop releases it.
                    self.cancel.cancel();
                    self.expect_quiet().await;
                    self.publish(follower());
                    self.expect_label("false").await;
                    let event = self.expect_event("LockReleased", "Normal").await;
                    assert_message_names(&event, "3");
                    let vacated = self.expect_lease_write(Method::PUT, "2").await;
                    assert_eq!(vacated["spec"].get("holderIdentity"), None, "{vacated}");
                    self.expect_quiet().await;
                    self.tx.take()
                }
                Scenario::LeaseCreateConflict => {
                    self.expect_label("true").await;
                    self.expect_event("LeaderElected", "Normal").await;
                    self.expect_lease_get(None).await;
                    self.expect_lease_write_to_fail(Method::POST, "AlreadyExists")
                        .await;
                    self.expect_lease_get(Some(lease_held_by(OTHER, 4, "50")))
                        .await;
                    assert_eq!(errors_for(&self.errors, "update_lease"), 1);
                    let updated = self.expect_lease_write(Method::PUT, "51").await;
                    assert_eq!(updated["metadata"]["resourceVersion"], "50");
                    assert_eq!(updated["spec"]["holderIdentity"], IDENTITY);
                    assert_eq!(updated["spec"]["leaseTransitions"], 5);
                    self.assert_still_leading(7);
                    self.lock_loop_ends().await;
                    None
                }
                Scenario::LeaseReplaceConflict => {
                    self.expect_label("true").await;
                    self.expect_event("LeaderElected", "Normal").await;
                    self.expect_lease_get(None).await;
                    self.expect_lease_write(Method::POST, "1").await;
                    self.expect_lease_write_to_fail(Method::PUT, "Conflict")
                        .await;
                    self.expect_lease_get(Some(lease_held_by(OTHER, 1, "9")))
                        .await;
                    let rewritten = self.expect_lease_write(Method::PUT, "10").await;
                    assert_eq!(rewritten["metadata"]["resourceVersion"], "9");
                    assert_eq!(rewritten["spec"]["holderIdentity"], IDENTITY);
                    assert_eq!(rewritten["spec"]["leaseTransitions"], 2);
                    assert_eq!(errors_for(&self.errors, "update_lease"), 1);
                    self.assert_still_leading(7);
                    self.lock_loop_ends().await;
                    None
                }
                Scenario::VacateFindsAnotherHolder => {
                    self.expect_label("true").await;
                    self.expect_event("LeaderElected", "Normal").await;
                    self.expect_lease_get(None).await;
                    self.expect_lease_write(Method::POST, "1").await;
                    self.publish(follower_of(OTHER));
                    self.expect_label("false").await;
                    self.expect_event("LeadershipLost", "Warning").await;
                    self.expect_lease_write_to_fail(Method::PUT, "Conflict")
                        .await;
                    self.expect_lease_get(Some(lease_held_by(OTHER, 1, "12")))
                        .await;
                    // The new holder's Lease is not touched, now or later.
                    self.expect_quiet().await;
                    assert_eq!(errors_for(&self.errors, "update_lease"), 1);
                    self.lock_loop_ends().await;
                    None
                }
                Scenario::LabelPatchForbidden => {
                    let first = tokio::time::Instant::now();
                    self.expect_label_to_fail("true", StatusCode::FORBIDDEN)
                        .await;
                    self.expect_event("LeaderElected", "Normal").await;
                    self.expect_label_to_fail("true", StatusCode::FORBIDDEN)
                        .await;
                    let second = tokio::time::Instant::now();
                    let (request, respond) = self
                        .next_within("the third label patch", Duration::from_secs(61))
                        .await;
                    self.answer_label(request, respond, "true").await;
                    let third = tokio::time::Instant::now();
                    // Equal jitter: at least half of 1 s after the first failure; then no
                    // third attempt within a minute of the first.
                    assert!(
                        second - first >= Duration::from_millis(500)
                            && second - first <= Duration::from_secs(1),
                        "{:?}",
                        second - first
                    );
                    assert!(
                        third - first >= Duration::from_secs(60),
                        "{:?}",
                        third - first
                    );
                    assert_eq!(errors_for(&self.errors, "patch_label"), 2);
                    self.assert_still_leading(7);
                    self.lock_loop_ends().await;
                    None
                }
                Scenario::LeaseForbidden => {
                    self.expect_label("true").await;
                    self.expect_event("LeaderElected", "Normal").await;
                    let (request, respond) = self.next("the Lease read").await;
                    assert_eq!(request.method(), Method::GET);
                    assert_eq!(request.uri().path(), lease_path());
                    respond.send_response(json_response(
                        StatusCode::FORBIDDEN,
                        status_body(StatusCode::FORBIDDEN, "leases", "redlock-orders-cron"),
                    ));
                    self.expect_lease_get(None).await;
                    assert_eq!(errors_for(&self.errors, "update_lease"), 1);
                    assert_eq!(errors_for(&self.errors, "patch_label"), 0);
                    self.expect_lease_write(Method::POST, "1").await;
                    self.assert_still_leading(7);
                    self.lock_loop_ends().await;
                    None
                }
                Scenario::ApiTimeout => {
                    let (request, unanswered) = self.next("the label patch").await;
                    Self::label_patch(request, "true").await;
                    let sent = tokio::time::Instant::now();
                    // Never answered (but kept: a dropped responder would be an error, not silence).
                    // After the call's 10 s timeout the observer goes on with the Event.
                    let (request, respond) =
                        tokio::time::timeout(Duration::from_secs(15), self.handle.next_request())
                            .await
                            .expect("the Event after the label patch timed out")
                            .expect("the client is alive");
                    assert!(
                        sent.elapsed() >= Duration::from_secs(10),
                        "{:?}",
                        sent.elapsed()
                    );
                    drop(unanswered);
                    assert_eq!(request.method(), Method::POST);
                    let event = json_body(request).await;
                    assert_eq!(event["reason"], "LeaderElected");
                    respond
                        .send_response(json_response(StatusCode::CREATED, stored(&event, "900")));
                    assert_eq!(errors_for(&self.errors, "patch_label"), 1);
                    // The label is retried after its backoff.
                    self.expect_label("true").await;
                    self.assert_still_leading(7);
                    self.lock_loop_ends().await;
                    None
                }
                Scenario::TermRunsOut => {
                    self.expect_label("true").await;
                    self.expect_event("LeaderElected", "Normal").await;
                    // No publish: the term's step_down_at passes on its own.
                    self.expect_label("false").await;
                    self.expect_event("LeadershipLost", "Warning").await;
                    self.lock_loop_ends().await;
                    None
                }
            }
        })
    }

    /// Publishes a leadership state, as the lock loop does.
    fn publish(&self, leadership: Leadership) {
        self.tx
            .as_ref()
            .expect("the sender is still alive")
            .send_replace(leadership);
    }

    /// The leadership the lock loop published is still the term `token`: the observer only
    /// reads the channel, whatever the API server answered.
    fn assert_still_leading(&self, token: u64) {
        let tx = self.tx.as_ref().expect("the sender is still alive");
        let state = tx.borrow();
        let term = state.leading_at(Deadline::now()).expect("still leading");
        assert_eq!(term.fencing_token, token);
    }

    /// Drops the sender (the lock loop ended) and asserts that no further call follows.
    async fn lock_loop_ends(&mut self) {
        self.expect_quiet().await;
        self.tx = None;
        self.expect_quiet().await;
    }

    /// The next request, or a failure naming the call that never came.
    async fn next(&mut self, what: &str) -> (Request<Body>, Responder) {
        self.next_within(what, CALL_TIMEOUT).await
    }

    /// The next request within `limit`, which must carry the sidecar's User-Agent.
    async fn next_within(&mut self, what: &str, limit: Duration) -> (Request<Body>, Responder) {
        let (request, respond) = tokio::time::timeout(limit, self.handle.next_request())
            .await
            .unwrap_or_else(|_| panic!("{what} was not called within {limit:?}"))
            .unwrap_or_else(|| panic!("the client went away before {what}"));
        assert_user_agent(&request);
        (request, respond)
    }

    /// Asserts that no request arrives within [`QUIET`].
    async fn expect_quiet(&mut self) {
        if let Ok(Some((request, _))) =
            tokio::time::timeout(QUIET, self.handle.next_request()).await
        {
            panic!("unexpected call: {} {}", request.method(), request.uri());
        }
    }

    /// Asserts that `request` is the merge patch setting the leader label to `value`.
    async fn label_patch(request: Request<Body>, value: &str) {
        assert_eq!(request.method(), Method::PATCH);
        assert_eq!(
            request.uri().path(),
            format!("/api/v1/namespaces/{NAMESPACE}/pods/{POD}")
        );
        assert_eq!(request.uri().query(), Some(FIELD_MANAGER_QUERY));
        assert_eq!(
            request.headers()[header::CONTENT_TYPE],
            "application/merge-patch+json"
        );
        let body = json_body(request).await;
        assert_eq!(body, json!({ "metadata": { "labels": { LABEL: value } } }));
    }

    async fn answer_label(&mut self, request: Request<Body>, respond: Responder, value: &str) {
        Self::label_patch(request, value).await;
        respond.send_response(json_response(StatusCode::OK, pod_labelled(value)));
    }

    async fn expect_label(&mut self, value: &str) {
        let (request, respond) = self.next(&format!("the label patch to {value:?}")).await;
        self.answer_label(request, respond, value).await;
    }

    async fn expect_label_to_fail(&mut self, value: &str, status: StatusCode) {
        let (request, respond) = self.next(&format!("the label patch to {value:?}")).await;
        Self::label_patch(request, value).await;
        respond.send_response(json_response(status, status_body(status, "pods", POD)));
    }

    /// Asserts an Event on the pod with this reason and type; answers 201; returns its body.
    async fn expect_event(&mut self, reason: &str, type_: &str) -> Value {
        let (request, respond) = self.next(&format!("the {reason} event")).await;
        assert_eq!(request.method(), Method::POST);
        assert_eq!(
            request.uri().path(),
            format!("/api/v1/namespaces/{NAMESPACE}/events")
        );
        assert_eq!(request.uri().query(), Some(FIELD_MANAGER_QUERY));
        let event = json_body(request).await;
        assert_eq!(event["reason"], reason, "{event}");
        assert_eq!(event["type"], type_, "{event}");
        assert_eq!(event["involvedObject"]["kind"], "Pod");
        assert_eq!(event["involvedObject"]["apiVersion"], "v1");
        assert_eq!(event["involvedObject"]["name"], POD);
        assert_eq!(event["involvedObject"]["namespace"], NAMESPACE);
        assert_eq!(event["metadata"]["namespace"], NAMESPACE);
        let name = event["metadata"]["name"].as_str().unwrap_or_default();
        assert!(name.starts_with(&format!("{POD}.")), "{event}");
        assert_eq!(event["reportingComponent"], "redlock-sidecar");
        assert_eq!(event["reportingInstance"], POD);
        assert_eq!(event["source"]["component"], "redlock-sidecar");
        assert_eq!(event["count"], 1);
        assert!(event["lastTimestamp"].is_string(), "{event}");
        respond.send_response(json_response(StatusCode::CREATED, stored(&event, "900")));
        event
    }

    /// Asserts a GET of the mirrored Lease; answers with it, or 404.
    async fn expect_lease_get(&mut self, found: Option<Value>) {
        let (request, respond) = self.next("the Lease read").await;
        assert_eq!(request.method(), Method::GET);
        assert_eq!(request.uri().path(), lease_path());
        let response = match found {
            Some(lease) => json_response(StatusCode::OK, lease),
            None => json_response(
                StatusCode::NOT_FOUND,
                status_body(StatusCode::NOT_FOUND, "leases", "redlock-orders-cron"),
            ),
        };
        respond.send_response(response);
    }

    /// Asserts a create (POST) or update (PUT) of the Lease; answers it stored with
    /// `resource_version`; returns the request's body.
    async fn expect_lease_write(&mut self, method: Method, resource_version: &str) -> Value {
        self.expect_lease_write_within(method, resource_version, CALL_TIMEOUT)
            .await
    }

    /// [`Self::expect_lease_write`], the write coming within `limit`.
    async fn expect_lease_write_within(
        &mut self,
        method: Method,
        resource_version: &str,
        limit: Duration,
    ) -> Value {
        let (request, respond) = self
            .next_within(&format!("the Lease {method}"), limit)
            .await;
        assert_eq!(request.method(), method);
        let path = match method {
            Method::POST => format!("/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases"),
            _ => lease_path(),
        };
        assert_eq!(request.uri().path(), path);
        assert_eq!(request.uri().query(), Some(FIELD_MANAGER_QUERY));
        let lease = json_body(request).await;
        assert_eq!(lease["apiVersion"], "coordination.k8s.io/v1");
        assert_eq!(lease["kind"], "Lease");
        let status = match method {
            Method::POST => StatusCode::CREATED,
            _ => StatusCode::OK,
        };
        respond.send_response(json_response(status, stored(&lease, resource_version)));
        lease
    }
}

impl ApiServerVerifier {
    /// Asserts a create (POST) or update (PUT) of the Lease and answers 409 with `reason`
    /// (`AlreadyExists` for a create, `Conflict` for a stale resourceVersion).
    async fn expect_lease_write_to_fail(&mut self, method: Method, reason: &str) {
        // A renewal comes a write interval after the last write.
        let (request, respond) = self
            .next_within(
                &format!("the Lease {method}"),
                LEASE_WRITE_INTERVAL + CALL_TIMEOUT,
            )
            .await;
        assert_eq!(request.method(), method);
        let body = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("leases \"redlock-orders-cron\": {reason}"),
            "reason": reason,
            "details": { "name": "redlock-orders-cron", "group": "coordination.k8s.io", "kind": "leases" },
            "code": 409,
        });
        respond.send_response(json_response(StatusCode::CONFLICT, body));
    }
}

fn lease_path() -> String {
    format!("/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/redlock-orders-cron")
}

fn assert_message_names(event: &Value, token: &str) {
    let message = event["message"].as_str().unwrap_or_default();
    for part in [LOCK, IDENTITY, token] {
        assert!(message.contains(part), "{message:?} should name {part:?}");
    }
}

async fn json_body(request: Request<Body>) -> Value {
    let bytes = request
        .into_body()
        .collect_bytes()
        .await
        .expect("request body");
    serde_json::from_slice(&bytes).expect("request body is JSON")
}

fn json_response(status: StatusCode, body: Value) -> Response<ApiBody> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(ApiBody::Whole(Some(
            serde_json::to_vec(&body).expect("JSON").into(),
        )))
        .expect("response")
}

/// A response body of the mocked API server: whole, or streamed chunk by chunk, as a watch.
enum ApiBody {
    Whole(Option<Bytes>),
    Stream(tokio::sync::mpsc::UnboundedReceiver<Bytes>),
}

impl hyper::body::Body for ApiBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            ApiBody::Whole(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            ApiBody::Stream(rx) => rx
                .poll_recv(cx)
                .map(|chunk| chunk.map(|b| Ok(Frame::data(b)))),
        }
    }
}

/// The server's end of an open watch: each event a JSON line; dropping it ends the watch.
struct WatchStream(tokio::sync::mpsc::UnboundedSender<Bytes>);

impl WatchStream {
    fn send(&self, kind: &str, object: Value) {
        let mut line =
            serde_json::to_vec(&json!({ "type": kind, "object": object })).expect("JSON");
        line.push(b'\n');
        self.send_raw(line);
    }

    /// Bytes as they are, so a test can split a line across chunks.
    fn send_raw(&self, bytes: Vec<u8>) {
        // The client may have gone: then nobody reads, which is what the test looks at.
        let _ = self.0.send(Bytes::from(bytes));
    }
}

/// A 200 whose body streams what the returned [`WatchStream`] sends.
fn watch_response() -> (Response<ApiBody>, WatchStream) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let response = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json;stream=watch")
        .body(ApiBody::Stream(rx))
        .expect("response");
    (response, WatchStream(tx))
}

/// What the API server returns for an object it stored.
fn stored(object: &Value, resource_version: &str) -> Value {
    let mut object = object.clone();
    let metadata = &mut object["metadata"];
    metadata["resourceVersion"] = json!(resource_version);
    metadata["uid"] = json!("0c6f1b7e-8d2a-4e55-b1f3-7a9e2c4d6b80");
    metadata["creationTimestamp"] = json!("2026-11-21T10:00:00Z");
    object
}

fn pod_labelled(value: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": POD,
            "namespace": NAMESPACE,
            "uid": POD_UID,
            "resourceVersion": "4711",
            "creationTimestamp": "2026-11-21T09:00:00Z",
            "labels": { "app": "orders", LABEL: value },
        },
        "spec": { "containers": [ { "name": "app", "image": "orders:1.4" },
                                   { "name": "redlock", "image": "redlock-sidecar:0.1" } ] },
        "status": { "phase": "Running" },
    })
}

fn lease_held_by(holder: &str, transitions: i32, resource_version: &str) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": "redlock-orders-cron",
            "namespace": NAMESPACE,
            "resourceVersion": resource_version,
            "uid": "9d1c2b3a-0000-4000-8000-000000000001",
        },
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": 3,
            "acquireTime": "2026-11-21T09:30:00.000000Z",
            "renewTime": "2026-11-21T09:59:59.000000Z",
            "leaseTransitions": transitions,
        },
    })
}

fn status_body(status: StatusCode, resource: &str, name: &str) -> Value {
    let (reason, message) = match status {
        StatusCode::NOT_FOUND => ("NotFound", format!("{resource} {name:?} not found")),
        StatusCode::FORBIDDEN => ("Forbidden", format!("{resource} is forbidden")),
        StatusCode::SERVICE_UNAVAILABLE => (
            "ServiceUnavailable",
            "the server is currently unable to handle the request".to_string(),
        ),
        _ => (
            "InternalError",
            "Internal error occurred: etcdserver: request timed out".to_string(),
        ),
    };
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": { "name": name, "kind": resource },
        "code": status.as_u16(),
    })
}

// ---------------------------------------------------------------------------------------------
// Running a scenario

/// A `Kube` over a mocked API server, and the server's handle. Its retries, renewals and
/// timeouts run on Tokio's clock, which the paused-time tests advance.
fn mocked(settings: KubeSettings) -> (Kube, ApiHandle, IntCounterVec) {
    mocked_on(Clock::Tokio, settings)
}

/// [`mocked`], its deadlines on `clock`.
fn mocked_on(clock: Clock, settings: KubeSettings) -> (Kube, ApiHandle, IntCounterVec) {
    let (service, handle) = mock::pair::<Request<Body>, Response<ApiBody>>();
    let client = kube::Client::new(service, NAMESPACE);
    let errors = errors_counter();
    let kube =
        Kube::with_client(client, settings, POD.to_string(), errors.clone()).with_clock(clock);
    (kube, handle, errors)
}

/// Runs `observe` from `initial` against the verifier playing `scenario`; asserts that
/// `observe` returns; returns the error counter.
async fn run(scenario: Scenario, initial: Leadership, mirror_lease: bool) -> IntCounterVec {
    run_on(Clock::Tokio, scenario, initial, mirror_lease).await
}

/// [`run`], the observer's deadlines on `clock`.
async fn run_on(
    clock: Clock,
    scenario: Scenario,
    initial: Leadership,
    mirror_lease: bool,
) -> IntCounterVec {
    let (kube, handle, errors) = mocked_on(clock, settings(mirror_lease));
    let (tx, rx) = watch::channel(initial);
    let cancel = CancellationToken::new();
    let observer = tokio::spawn(kube.observe(rx, cancel.clone(), FLUSH_TIMEOUT));
    let verifier = ApiServerVerifier {
        handle,
        tx: Some(tx),
        cancel,
        errors: errors.clone(),
    }
    .run(scenario);

    // A scenario that keeps the sender alive checks that `observe` returns without its drop.
    let kept_tx = match verifier.await {
        Ok(tx) => tx,
        Err(err) => std::panic::resume_unwind(err.into_panic()),
    };
    tokio::time::timeout(FLUSH_TIMEOUT, observer)
        .await
        .expect("observe returned")
        .expect("observe did not panic");
    drop(kept_tx);
    errors
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test(start_paused = true)]
async fn a_follower_sets_its_label_false_and_never_writes_the_lease() {
    let errors = run(Scenario::FollowerOnly, follower_of(OTHER), true).await;
    assert_eq!(errors_for(&errors, "patch_label"), 0);
}

#[tokio::test(start_paused = true)]
async fn gaining_leadership_labels_the_pod_true_then_records_leader_elected() {
    run(Scenario::Gain, follower(), false).await;
}

#[tokio::test(start_paused = true)]
async fn losing_leadership_labels_the_pod_false_then_warns_leadership_lost() {
    run(Scenario::GainThenLoss, leader(7), false).await;
}

#[tokio::test(start_paused = true)]
async fn a_mirrored_lease_names_the_leader_is_renewed_each_interval_and_is_vacated_on_loss() {
    run(Scenario::MirroredLease, follower(), true).await;
}

#[tokio::test(start_paused = true)]
async fn taking_over_a_lease_another_pod_held_counts_one_more_transition() {
    run(Scenario::LeaseTakeover, leader(7), true).await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_label_patch_is_counted_and_retried_until_it_succeeds() {
    let errors = run(Scenario::LabelPatchFailsOnce, follower(), false).await;
    assert_eq!(errors_for(&errors, "patch_label"), 1);
    assert_eq!(errors_for(&errors, "create_event"), 0);
}

#[tokio::test(start_paused = true)]
async fn after_an_outage_only_the_latest_leadership_is_applied() {
    run(Scenario::OutageWithFlips, leader(5), false).await;
}

#[tokio::test(start_paused = true)]
async fn observe_returns_after_the_sender_is_dropped_having_applied_the_final_state() {
    run(Scenario::SenderDroppedAfterRelease, leader(9), false).await;
}

#[tokio::test(start_paused = true)]
async fn cancel_while_leading_waits_for_the_release_and_records_lock_released() {
    run(Scenario::CancelledWhileLeading, leader(3), true).await;
}

/// Real time on the boot clock, as in production: the observer wakes at `step_down_at` on a
/// `CLOCK_BOOTTIME` timer (which keeps counting while the host is suspended, so the label
/// does not lag a suspend), and `leading_at` reads the same clock.
#[tokio::test]
async fn a_term_that_runs_out_without_a_publish_clears_the_label() {
    run_on(
        Clock::Boot,
        Scenario::TermRunsOut,
        leader_for(4, Duration::from_millis(300)),
        false,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_lease_created_elsewhere_first_is_re_read_and_taken_over() {
    run(Scenario::LeaseCreateConflict, leader(7), true).await;
}

#[tokio::test(start_paused = true)]
async fn a_stale_lease_renewal_is_re_read_and_rewritten_on_the_fresh_version() {
    run(Scenario::LeaseReplaceConflict, leader(7), true).await;
}

#[tokio::test(start_paused = true)]
async fn a_former_leader_leaves_a_lease_that_names_another_holder_alone() {
    run(Scenario::VacateFindsAnotherHolder, leader(7), true).await;
}

#[tokio::test(start_paused = true)]
async fn a_forbidden_label_patch_is_retried_with_growing_delays() {
    run(Scenario::LabelPatchForbidden, leader(7), false).await;
}

#[tokio::test(start_paused = true)]
async fn a_forbidden_lease_is_counted_and_retried_without_holding_up_label_or_event() {
    run(Scenario::LeaseForbidden, leader(7), true).await;
}

#[tokio::test(start_paused = true)]
async fn an_api_call_that_never_answers_times_out_and_is_retried() {
    run(Scenario::ApiTimeout, leader(7), false).await;
}

#[tokio::test]
async fn without_a_namespace_setting_the_service_accounts_namespace_is_used() {
    let (service, mut handle) = mock::pair::<Request<Body>, Response<ApiBody>>();
    // In a cluster the client's default namespace is read from the service account's files.
    let client = kube::Client::new(service, "from-service-account");
    let settings = KubeSettings {
        namespace: None,
        ..settings(false)
    };
    let kube = Kube::with_client(client, settings, POD.to_string(), errors_counter());
    let (_tx, rx) = watch::channel(follower());
    let cancel = CancellationToken::new();
    let observer = tokio::spawn(kube.observe(rx, cancel.clone(), FLUSH_TIMEOUT));
    let (request, respond) = tokio::time::timeout(CALL_TIMEOUT, handle.next_request())
        .await
        .expect("the label patch")
        .expect("the client is alive");
    assert_eq!(
        request.uri().path(),
        format!("/api/v1/namespaces/from-service-account/pods/{POD}")
    );
    respond.send_response(json_response(StatusCode::OK, pod_labelled("false")));
    cancel.cancel();
    tokio::time::timeout(FLUSH_TIMEOUT, observer)
        .await
        .expect("observe returned")
        .expect("observe did not panic");
}

/// An API server that refuses every call: 403 on the pod, 500 on Events, 409 on Lease writes.
async fn refuse_everything(mut handle: ApiHandle) {
    while let Some((request, respond)) = handle.next_request().await {
        let (method, path) = (request.method().clone(), request.uri().path().to_string());
        let (status, reason) = match (method, path.contains("/leases")) {
            (Method::GET, true) => (StatusCode::NOT_FOUND, "NotFound"),
            (_, true) => (StatusCode::CONFLICT, "AlreadyExists"),
            (Method::PATCH, false) => (StatusCode::FORBIDDEN, "Forbidden"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "InternalError"),
        };
        let body = json!({ "kind": "Status", "apiVersion": "v1", "status": "Failure",
                           "reason": reason, "code": status.as_u16(), "message": reason });
        respond.send_response(json_response(status, body));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_api_failures_never_touch_a_real_lock() {
    let node = support::RedisNode::start();
    let spec = NodeSpec::parse(0, &node.url(), &Credentials::default()).expect("node URL");
    let mut cfg = RedlockConfig::new(LOCK, IDENTITY, vec![spec]);
    cfg.ttl = Duration::from_secs(2);
    let renewal = Renewal {
        interval: Duration::from_millis(600),
        safety_margin: Duration::from_millis(500),
    };
    let errors = errors_counter();
    let (redlock, metrics) =
        lease::instrumented_engine(&cfg, Some(errors.clone())).expect("engine");
    let (tx, mut rx) = lease::channel(&redlock);
    let cancel = CancellationToken::new();
    let candidacy = tokio::sync::watch::channel(Candidacy::unchecked()).1;
    let lock_loop = tokio::spawn(lease::run(
        redlock,
        renewal,
        tx,
        metrics,
        candidacy,
        cancel.clone(),
    ));

    let (service, handle) = mock::pair::<Request<Body>, Response<ApiBody>>();
    tokio::spawn(refuse_everything(handle));
    let kube = Kube::with_client(
        kube::Client::new(service, NAMESPACE),
        KubeSettings {
            renew_interval: renewal.interval,
            ..settings(true)
        },
        POD.to_string(),
        errors.clone(),
    );
    let flush = Duration::from_secs(1);
    let observer = tokio::spawn(kube.observe(rx.clone(), cancel.clone(), flush));

    // Fresh nodes count only after ttl + drift (restart-safe votes), hence the long wait.
    let token = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            if let Some(term) = rx.borrow_and_update().leading_at(Deadline::now()) {
                break term.fencing_token;
            }
            rx.changed().await.expect("the lock loop runs");
        }
    })
    .await
    .expect("the lock is acquired");

    // Three ttls of renewals while every API call fails: the term never ends or changes.
    let until = tokio::time::Instant::now() + 3 * cfg.ttl;
    let mut renewals = 0;
    while let Ok(changed) = tokio::time::timeout_at(until, rx.changed()).await {
        changed.expect("the lock loop runs");
        let state = rx.borrow_and_update().clone();
        let term = state.leading_at(Deadline::now()).expect("still leading");
        assert_eq!(term.fencing_token, token, "the same term");
        renewals += 1;
    }
    assert!(
        renewals >= 5,
        "renewed {renewals} times in {:?}",
        3 * cfg.ttl
    );
    let key = format!("redlock:{{{LOCK}}}");
    let value = support::command_at(node.addr(), &["GET", &key]).expect("GET");
    assert!(value.starts_with(&format!("{IDENTITY}:")), "{value}");
    for op in ["patch_label", "create_event", "update_lease"] {
        assert!(errors_for(&errors, op) >= 1, "{op} was refused and counted");
    }

    cancel.cancel();
    lock_loop.await.expect("the lock loop ends");
    let value = support::command_at(node.addr(), &["EXISTS", &key]).expect("EXISTS");
    assert_eq!(value, "0", "released on shutdown despite the API");
    tokio::time::timeout(flush + Duration::from_secs(1), observer)
        .await
        .expect("observe gave up within its flush timeout")
        .expect("observe did not panic");
}

#[tokio::test(start_paused = true)]
async fn a_guard_event_is_recorded_on_the_pod_and_a_rejected_one_is_counted() {
    let (kube, handle, errors) = mocked(settings(false));
    let mut api = ApiServerVerifier {
        handle,
        tx: None,
        cancel: CancellationToken::new(),
        errors: errors.clone(),
    };
    let server = tokio::spawn(async move {
        let event = api.expect_event("RunSkipped", "Warning").await;
        assert_eq!(event["message"], "not the leader; command not run");
        assert_eq!(
            event["involvedObject"].get("uid"),
            None,
            "uid not known yet"
        );
        let (_, respond) = api.next("the RunStarted event").await;
        respond.send_response(json_response(
            StatusCode::FORBIDDEN,
            status_body(StatusCode::FORBIDDEN, "events", ""),
        ));
    });

    kube.event("RunSkipped", "not the leader; command not run", true)
        .await
        .expect("event recorded");
    let err = kube
        .event("RunStarted", "command started", false)
        .await
        .expect_err("the API server refused it");
    assert_eq!(err.kind(), "api");
    assert_eq!(errors_for(&errors, "create_event"), 1);
    server.await.expect("verifier passed");
}

#[tokio::test(start_paused = true)]
async fn with_pod_uid_set_the_first_guard_event_already_names_the_pod_by_uid() {
    // guard never patches the label, so without POD_UID its Events would never carry the uid
    // (and `kubectl describe pod` would not list them).
    let (kube, handle, errors) = mocked(KubeSettings {
        pod_uid: Some(POD_UID.to_string()),
        ..settings(false)
    });
    let mut api = ApiServerVerifier {
        handle,
        tx: None,
        cancel: CancellationToken::new(),
        errors,
    };
    let server = tokio::spawn(async move {
        let event = api.expect_event("RunSkipped", "Normal").await;
        assert_eq!(event["involvedObject"]["uid"], POD_UID, "{event}");
        api.expect_quiet().await;
    });
    kube.event("RunSkipped", "lock busy; command not run", false)
        .await
        .expect("event recorded");
    server.await.expect("verifier passed");
}

#[test]
fn kube_mode_parses_and_displays_auto_on_and_off() {
    for (text, mode) in [
        ("auto", KubeMode::Auto),
        ("on", KubeMode::On),
        ("off", KubeMode::Off),
    ] {
        assert_eq!(text.parse::<KubeMode>().expect("valid"), mode);
        assert_eq!(mode.to_string(), text);
    }
    let err = "yes".parse::<KubeMode>().expect_err("invalid");
    assert_eq!(err.kind(), "invalid_mode");
}

#[tokio::test]
async fn connect_is_off_without_error_when_disabled_or_when_auto_lacks_a_pod_name() {
    let off = KubeSettings {
        mode: KubeMode::Off,
        ..settings(false)
    };
    assert!(Kube::connect(off, errors_counter())
        .await
        .expect("off is not an error")
        .is_none());
    let auto_without_pod = KubeSettings {
        mode: KubeMode::Auto,
        pod_name: None,
        ..settings(false)
    };
    assert!(Kube::connect(auto_without_pod, errors_counter())
        .await
        .expect("auto without a pod name is not an error")
        .is_none());
}

#[tokio::test]
async fn connect_fails_when_mode_is_on_without_a_pod_name() {
    let on_without_pod = KubeSettings {
        pod_name: None,
        ..settings(false)
    };
    let err = Kube::connect(on_without_pod, errors_counter())
        .await
        .err()
        .expect("mode on requires a pod name");
    assert_eq!(err.kind(), "missing_pod_name");
}

#[test]
fn lease_names_are_dns_labels_and_distinct_per_lock() {
    assert_eq!(lease_name("orders-cron"), "redlock-orders-cron");
    let names: Vec<String> = [
        "Orders_Cron",
        "orders_cron",
        "orders.cron",
        "billing/nightly",
        "",
        &"x".repeat(300),
    ]
    .iter()
    .map(|lock| lease_name(lock))
    .collect();
    for name in &names {
        assert!(name.len() <= 63, "{name}");
        assert!(name.starts_with("redlock-"), "{name}");
        assert!(
            name.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
            "{name}"
        );
        assert!(!name.ends_with('-'), "{name}");
    }
    let mut distinct = names.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), names.len(), "{names:?}");
}

#[test]
fn the_error_counter_starts_every_op_at_zero() {
    let errors = errors_counter();
    let registry = prometheus::Registry::new();
    registry
        .register(Box::new(errors.clone()))
        .expect("registers");
    let families = registry.gather();
    let family = families
        .iter()
        .find(|f| f.name() == "redlock_kubernetes_errors_total")
        .expect("family present");
    let mut ops: Vec<&str> = family
        .get_metric()
        .iter()
        .map(|m| m.get_label()[0].value())
        .collect();
    ops.sort();
    assert_eq!(
        ops,
        ["create_event", "patch_label", "update_lease", "watch_pod"]
    );
}

// ---------------------------------------------------------------------------------------------
// Following the app container's readiness (`--follow-container`): one list, then one watch

/// The pod as the API server returns it at `resource_version`, with the app container's
/// status as given (`None`: not started yet, no status).
fn pod_with_app(ready: Option<bool>, resource_version: &str) -> Value {
    let statuses: Vec<Value> = ready
        .map(|ready| {
            json!({"name": "app", "ready": ready, "started": true, "restartCount": 0,
                   "image": "shop/app:1", "imageID": ""})
        })
        .into_iter()
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": POD, "namespace": NAMESPACE, "uid": POD_UID,
                      "resourceVersion": resource_version },
        "spec": { "containers": [
            { "name": "app", "image": "shop/app:1" },
            { "name": "redlock", "image": "redlock-sidecar:1" }
        ] },
        "status": { "containerStatuses": statuses }
    })
}

/// A PodList at `resource_version`.
fn pod_list(resource_version: &str, items: Vec<Value>) -> Value {
    json!({ "apiVersion": "v1", "kind": "PodList",
            "metadata": { "resourceVersion": resource_version }, "items": items })
}

/// The request's query parameters, decoded.
fn query(request: &Request<Body>) -> BTreeMap<String, String> {
    query_of(request.uri())
}

fn query_of(uri: &http::Uri) -> BTreeMap<String, String> {
    uri.query()
        .unwrap_or_default()
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(key), percent_decode(value))
        })
        .collect()
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).expect("ASCII");
                out.push(u8::from_str_radix(hex, 16).expect("a percent escape"));
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).expect("UTF-8")
}

fn assert_user_agent(request: &Request<Body>) {
    assert_eq!(
        request
            .headers()
            .get(header::USER_AGENT)
            .and_then(|v| v.to_str().ok()),
        Some(USER_AGENT_VALUE),
        "{} {}",
        request.method(),
        request.uri()
    );
    assert!(USER_AGENT_VALUE.starts_with("redlock-sidecar/"));
}

/// The next request within `limit`; it carries the sidecar's User-Agent.
async fn next_request(
    handle: &mut ApiHandle,
    what: &str,
    limit: Duration,
) -> (Request<Body>, Responder) {
    let (request, respond) = tokio::time::timeout(limit, handle.next_request())
        .await
        .unwrap_or_else(|_| panic!("{what} was not requested within {limit:?}"))
        .unwrap_or_else(|| panic!("the client went away before {what}"));
    assert_user_agent(&request);
    (request, respond)
}

/// Asserts that the next request is a list of this pod, by field selector; its query.
async fn expect_pod_list(
    handle: &mut ApiHandle,
    limit: Duration,
) -> (BTreeMap<String, String>, Responder) {
    let (request, respond) = next_request(handle, "the pod's list", limit).await;
    assert_eq!(request.method(), Method::GET);
    assert_eq!(
        request.uri().path(),
        format!("/api/v1/namespaces/{NAMESPACE}/pods")
    );
    let query = query(&request);
    assert_eq!(
        query.get("fieldSelector").map(String::as_str),
        Some(format!("metadata.name={POD}").as_str()),
        "{query:?}"
    );
    assert!(!query.contains_key("watch"), "a list: {query:?}");
    (query, respond)
}

/// Asserts that the next request is a watch of this pod with bookmarks and a timeout of 5 to
/// 10 minutes; its query.
async fn expect_pod_watch(
    handle: &mut ApiHandle,
    limit: Duration,
) -> (BTreeMap<String, String>, Responder) {
    let (request, respond) = next_request(handle, "the pod's watch", limit).await;
    assert_eq!(request.method(), Method::GET);
    assert_eq!(
        request.uri().path(),
        format!("/api/v1/namespaces/{NAMESPACE}/pods")
    );
    let query = query(&request);
    assert_eq!(query.get("watch").map(String::as_str), Some("true"));
    assert_eq!(
        query.get("fieldSelector").map(String::as_str),
        Some(format!("metadata.name={POD}").as_str())
    );
    assert_eq!(
        query.get("allowWatchBookmarks").map(String::as_str),
        Some("true")
    );
    let timeout: u64 = query["timeoutSeconds"].parse().expect("seconds");
    assert!((300..600).contains(&timeout), "{timeout}");
    (query, respond)
}

fn app_ready(rx: &watch::Receiver<Candidacy>) -> bool {
    rx.borrow().app_ready(Deadline::now())
}

/// Waits (up to a minute, paused time) until the candidacy's app readiness is `want`.
async fn until_app_ready(rx: &mut watch::Receiver<Candidacy>, want: bool) {
    tokio::time::timeout(Duration::from_secs(60), async {
        while app_ready(rx) != want {
            rx.changed().await.expect("the watch runs");
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the app's readiness never read {want}"));
}

fn with_retry_after(mut response: Response<ApiBody>, seconds: u64) -> Response<ApiBody> {
    response.headers_mut().insert(
        header::RETRY_AFTER,
        header::HeaderValue::from_str(&seconds.to_string()).expect("header"),
    );
    response
}

#[tokio::test(start_paused = true)]
async fn the_app_containers_readiness_comes_from_one_list_then_one_watch_resumed_from_its_version()
{
    let (kube, mut handle, errors) = mocked(settings(false));
    let (tx, mut rx) = watch::channel(Candidacy::checked(Duration::from_secs(5)));
    let follow = tokio::spawn(kube.follow_container("app".to_string(), Duration::from_secs(1), tx));

    // One list, from the API server's watch cache (resourceVersion=0): not started yet.
    let t0 = tokio::time::Instant::now();
    let (query, respond) = expect_pod_list(&mut handle, CALL_TIMEOUT).await;
    assert_eq!(query.get("resourceVersion").map(String::as_str), Some("0"));
    respond.send_response(json_response(
        StatusCode::OK,
        pod_list("100", vec![pod_with_app(None, "100")]),
    ));
    rx.changed().await.expect("answered");
    assert!(!app_ready(&rx), "a container without a status is not ready");

    // One watch from the list's version.
    let (query, respond) = expect_pod_watch(&mut handle, CALL_TIMEOUT).await;
    assert_eq!(query["resourceVersion"], "100");
    let (response, stream) = watch_response();
    respond.send_response(response);
    // Ready; the event's line arrives in two pieces.
    let mut line = serde_json::to_vec(
        &json!({ "type": "MODIFIED", "object": pod_with_app(Some(true), "101") }),
    )
    .expect("JSON");
    line.push(b'\n');
    let rest = line.split_off(25);
    stream.send_raw(line);
    stream.send_raw(rest);
    until_app_ready(&mut rx, true).await;
    stream.send(
        "BOOKMARK",
        json!({ "kind": "Pod", "apiVersion": "v1", "metadata": { "resourceVersion": "150" } }),
    );
    stream.send("MODIFIED", pod_with_app(Some(false), "160"));
    until_app_ready(&mut rx, false).await;

    // While the watch is open, nothing else is asked.
    assert!(
        tokio::time::timeout(Duration::from_secs(60), handle.next_request())
            .await
            .is_err(),
        "no request while the watch is open"
    );
    // The server ends the watch (its timeout): the next one resumes from the last event.
    drop(stream);
    let (query, respond) = expect_pod_watch(&mut handle, CALL_TIMEOUT).await;
    assert_eq!(query["resourceVersion"], "160");
    // That version has left the server's history: 410, then a list that is a consistent read.
    respond.send_response(json_response(
        StatusCode::GONE,
        status_body(StatusCode::GONE, "pods", POD),
    ));
    let (query, respond) = expect_pod_list(&mut handle, CALL_TIMEOUT).await;
    assert!(!query.contains_key("resourceVersion"), "{query:?}");
    respond.send_response(json_response(
        StatusCode::OK,
        pod_list("200", vec![pod_with_app(Some(true), "200")]),
    ));
    until_app_ready(&mut rx, true).await;
    // Four requests in a minute would be too many: the next watch waits for the window.
    let relisted = tokio::time::Instant::now();
    let (query, respond) = expect_pod_watch(&mut handle, Duration::from_secs(61)).await;
    assert_eq!(query["resourceVersion"], "200");
    assert!(
        relisted.elapsed() >= Duration::from_secs(59),
        "{:?}",
        relisted.elapsed()
    );
    let requests = 5;
    assert!(
        t0.elapsed() >= Duration::from_secs(60 * (requests - 1) / 2),
        "at most 2 requests a minute: {:?}",
        t0.elapsed()
    );
    let (response, stream) = watch_response();
    respond.send_response(response);
    // An ERROR 410 inside the stream also lists again.
    stream.send("ERROR", status_body(StatusCode::GONE, "pods", POD));
    let (query, respond) = expect_pod_list(&mut handle, Duration::from_secs(61)).await;
    assert!(!query.contains_key("resourceVersion"), "{query:?}");
    respond.send_response(json_response(
        StatusCode::OK,
        pod_list("300", vec![pod_with_app(Some(true), "300")]),
    ));
    assert_eq!(
        errors_for(&errors, "watch_pod"),
        0,
        "410 Gone is the protocol's 'list again', not a failure"
    );
    follow.abort();
}

#[tokio::test(start_paused = true)]
async fn an_unreadable_pod_status_is_counted_told_to_the_candidacy_and_retried_after_retry_after() {
    let (kube, mut handle, errors) = mocked(settings(false));
    let (tx, mut rx) = watch::channel(Candidacy::checked(Duration::from_secs(5)));
    let follow = tokio::spawn(kube.follow_container("app".to_string(), Duration::from_secs(1), tx));

    // RBAC not bound yet.
    let (_, respond) = expect_pod_list(&mut handle, CALL_TIMEOUT).await;
    let first = tokio::time::Instant::now();
    respond.send_response(json_response(
        StatusCode::FORBIDDEN,
        status_body(StatusCode::FORBIDDEN, "pods", ""),
    ));
    rx.changed().await.expect("the candidacy is told");
    assert!(!app_ready(&rx));
    assert!(
        rx.borrow().changes_at(Deadline::now()).is_some(),
        "the candidacy counts how long the state stays unreadable"
    );
    assert_eq!(errors_for(&errors, "watch_pod"), 1);

    // Retried after the first backoff (0.5 to 1 s): overloaded, come back in 150 s (longer
    // than any backoff of this read, 2 minutes at most).
    let (_, respond) = expect_pod_list(&mut handle, CALL_TIMEOUT).await;
    let second = tokio::time::Instant::now();
    assert!(
        (Duration::from_millis(500)..=Duration::from_secs(1)).contains(&(second - first)),
        "{:?}",
        second - first
    );
    respond.send_response(with_retry_after(
        json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            status_body(StatusCode::SERVICE_UNAVAILABLE, "pods", ""),
        ),
        150,
    ));
    let (_, respond) = expect_pod_list(&mut handle, Duration::from_secs(151)).await;
    assert_eq!(
        second.elapsed(),
        Duration::from_secs(150),
        "Retry-After honoured, to the second"
    );
    assert_eq!(errors_for(&errors, "watch_pod"), 2);
    respond.send_response(json_response(
        StatusCode::OK,
        pod_list("7", vec![pod_with_app(Some(true), "7")]),
    ));
    until_app_ready(&mut rx, true).await;
    assert_eq!(
        rx.borrow().changes_at(Deadline::now()),
        None,
        "a readable answer ends the unreadable spell"
    );
    let (_, respond) = expect_pod_watch(&mut handle, CALL_TIMEOUT).await;
    // A watch that the server accepts is readable too: the last readiness is answered again.
    let (response, _stream) = watch_response();
    respond.send_response(response);
    rx.changed().await.expect("answered again");
    assert!(app_ready(&rx));
    follow.abort();
}

#[tokio::test(start_paused = true)]
async fn a_watch_silent_past_its_own_timeout_counts_as_hung_and_is_opened_again() {
    let (kube, mut handle, errors) = mocked(settings(false));
    let (tx, mut rx) = watch::channel(Candidacy::checked(Duration::from_secs(5)));
    let follow = tokio::spawn(kube.follow_container("app".to_string(), Duration::from_secs(1), tx));
    let (_, respond) = expect_pod_list(&mut handle, CALL_TIMEOUT).await;
    respond.send_response(json_response(
        StatusCode::OK,
        pod_list("5", vec![pod_with_app(Some(true), "5")]),
    ));
    until_app_ready(&mut rx, true).await;
    let (query, respond) = expect_pod_watch(&mut handle, CALL_TIMEOUT).await;
    let timeout = Duration::from_secs(query["timeoutSeconds"].parse().expect("seconds"));
    // Accepted, then nothing: no event, no end (a peer that stopped answering).
    let (response, stream) = watch_response();
    respond.send_response(response);
    let opened = tokio::time::Instant::now();
    let (query, respond) = expect_pod_watch(&mut handle, timeout + Duration::from_secs(32)).await;
    let silent = opened.elapsed();
    assert!(
        silent >= timeout + Duration::from_secs(30) && silent < timeout + Duration::from_secs(32),
        "given up {silent:?} after opening, its timeout {timeout:?}"
    );
    assert_eq!(query["resourceVersion"], "5", "resumed where it was");
    assert_eq!(
        errors_for(&errors, "watch_pod"),
        1,
        "a hung watch is a failure"
    );
    assert!(
        rx.borrow().changes_at(Deadline::now()).is_some(),
        "the candidacy was told the state is unreadable"
    );
    drop((stream, respond));
    follow.abort();
}

#[test]
fn following_every_app_container_needs_all_of_them_ready_and_ignores_init_containers() {
    let pod = |app: bool, worker: bool| -> k8s_openapi::api::core::v1::Pod {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": POD, "namespace": NAMESPACE },
            "spec": {
                "initContainers": [{ "name": "redlock-sidecar", "image": "redlock-sidecar:1" }],
                "containers": [
                    { "name": "app", "image": "shop/app:1" },
                    { "name": "worker", "image": "shop/worker:1" }
                ]
            },
            "status": {
                "initContainerStatuses": [{ "name": "redlock-sidecar", "ready": false,
                    "restartCount": 0, "image": "redlock-sidecar:1", "imageID": "" }],
                "containerStatuses": [
                    { "name": "app", "ready": app, "started": true, "restartCount": 0,
                      "image": "shop/app:1", "imageID": "" },
                    { "name": "worker", "ready": worker, "started": true, "restartCount": 0,
                      "image": "shop/worker:1", "imageID": "" }
                ]
            }
        }))
        .expect("a pod")
    };
    assert_eq!(container_ready(&pod(true, false), "*"), Some(false));
    assert_eq!(
        container_ready(&pod(true, true), "*"),
        Some(true),
        "the sidecar's own status is not asked"
    );
    assert_eq!(container_ready(&pod(true, false), "app"), Some(true));
    assert_eq!(container_ready(&pod(true, true), "redlock-sidecar"), None);
}

// ---------------------------------------------------------------------------------------------
// What one sidecar costs the API server: requests per pod per minute, by phase

/// What the fake API server of the rate test does with the requests it gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Answers; a watch stays open for its `timeoutSeconds` (or until the phase ends).
    Healthy,
    /// 503 without `Retry-After`.
    Unavailable,
    /// 429 with `Retry-After: 90`.
    Throttled,
    /// Takes requests and never answers them.
    Hung,
}

/// Length of each phase (simulated: time is paused).
const PHASE: Duration = Duration::from_secs(600);
const THROTTLED_RETRY_AFTER: Duration = Duration::from_secs(90);
const PHASES: [(&str, Mode); 5] = [
    ("steady", Mode::Healthy),
    ("503, no Retry-After", Mode::Unavailable),
    ("429, Retry-After 90 s", Mode::Throttled),
    ("hang", Mode::Hung),
    ("steady again", Mode::Healthy),
];
/// The pod's resourceVersion in the last phase; older ones have left the server's history.
const LATE_VERSION: u64 = 900;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    PodStatus,
    Label,
    Event,
    Lease,
}

#[derive(Clone, Copy, Debug)]
struct Seen {
    at: Duration,
    kind: Kind,
    /// Whether the answer was a failure (or none came).
    failed: bool,
}

/// The fake API server's memory.
struct FakeApi {
    start: tokio::time::Instant,
    seen: Vec<Seen>,
    lease: Option<Value>,
    lease_version: u64,
    /// Requests never answered (kept: a dropped responder would be an error, not a hang).
    held: Vec<Responder>,
}

impl FakeApi {
    fn phase_at(at: Duration) -> usize {
        usize::try_from(at.as_secs() / PHASE.as_secs())
            .unwrap_or(usize::MAX)
            .min(PHASES.len() - 1)
    }

    /// Plays the phases for their whole length; returns what it saw.
    async fn serve(mut handle: ApiHandle) -> FakeApi {
        let mut api = FakeApi {
            start: tokio::time::Instant::now(),
            seen: Vec::new(),
            lease: None,
            lease_version: 0,
            held: Vec::new(),
        };
        // Healthy for a while after the last phase, so that no call in flight at its end
        // fails (only what comes before the end is recorded).
        let end = api.start + PHASE * PHASES.len() as u32;
        let after = end + Duration::from_secs(30);
        while let Ok(Some((request, respond))) =
            tokio::time::timeout_at(after, handle.next_request()).await
        {
            assert_user_agent(&request);
            let at = api.start.elapsed();
            let record = tokio::time::Instant::now() < end;
            let phase = Self::phase_at(at);
            let path = request.uri().path().to_string();
            let kind = if path.contains("/leases") {
                Kind::Lease
            } else if path.ends_with("/events") {
                Kind::Event
            } else if request.method() == Method::PATCH {
                Kind::Label
            } else {
                Kind::PodStatus
            };
            let failed = match PHASES[phase].1 {
                Mode::Unavailable => {
                    respond.send_response(json_response(
                        StatusCode::SERVICE_UNAVAILABLE,
                        status_body(StatusCode::SERVICE_UNAVAILABLE, "pods", ""),
                    ));
                    true
                }
                Mode::Throttled => {
                    let body = json!({ "kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": "TooManyRequests", "message": "too many requests, please try again later",
                        "code": 429 });
                    respond.send_response(with_retry_after(
                        json_response(StatusCode::TOO_MANY_REQUESTS, body),
                        THROTTLED_RETRY_AFTER.as_secs(),
                    ));
                    true
                }
                Mode::Hung => {
                    api.held.push(respond);
                    true
                }
                Mode::Healthy => {
                    // A watch ends at its timeout, or when the API server's trouble begins.
                    let phase_end = match PHASES.get(phase + 1) {
                        Some(_) => api.start + PHASE * (phase as u32 + 1),
                        None => after + PHASE,
                    };
                    api.answer(request, respond, kind, phase, phase_end).await;
                    false
                }
            };
            if record {
                api.seen.push(Seen { at, kind, failed });
            }
        }
        api
    }

    async fn answer(
        &mut self,
        request: Request<Body>,
        respond: Responder,
        kind: Kind,
        phase: usize,
        phase_end: tokio::time::Instant,
    ) {
        let version = if phase == 0 { 100 } else { LATE_VERSION };
        let method = request.method().clone();
        match kind {
            Kind::PodStatus => {
                let query = query(&request);
                if query.get("watch").map(String::as_str) != Some("true") {
                    let rv = version.to_string();
                    respond.send_response(json_response(
                        StatusCode::OK,
                        pod_list(&rv, vec![pod_with_app(Some(true), &rv)]),
                    ));
                    return;
                }
                let from: u64 = query["resourceVersion"].parse().expect("a version");
                if from < version {
                    respond.send_response(json_response(
                        StatusCode::GONE,
                        status_body(StatusCode::GONE, "pods", POD),
                    ));
                    return;
                }
                let timeout: u64 = query["timeoutSeconds"].parse().expect("seconds");
                let (response, stream) = watch_response();
                respond.send_response(response);
                let ends =
                    (tokio::time::Instant::now() + Duration::from_secs(timeout)).min(phase_end);
                tokio::spawn(async move {
                    tokio::time::sleep_until(ends).await;
                    drop(stream);
                });
            }
            Kind::Label => {
                respond.send_response(json_response(StatusCode::OK, pod_labelled("true")));
            }
            Kind::Event => {
                let event = json_body(request).await;
                respond.send_response(json_response(StatusCode::CREATED, stored(&event, "900")));
            }
            Kind::Lease => match (method, &self.lease) {
                (Method::GET, Some(lease)) => {
                    respond.send_response(json_response(StatusCode::OK, lease.clone()));
                }
                (Method::GET, None) => respond.send_response(json_response(
                    StatusCode::NOT_FOUND,
                    status_body(StatusCode::NOT_FOUND, "leases", "redlock-orders-cron"),
                )),
                (method, _) => {
                    let lease = json_body(request).await;
                    self.lease_version += 1;
                    let lease = stored(&lease, &self.lease_version.to_string());
                    self.lease = Some(lease.clone());
                    let status = if method == Method::POST {
                        StatusCode::CREATED
                    } else {
                        StatusCode::OK
                    };
                    respond.send_response(json_response(status, lease));
                }
            },
        }
    }
}

/// Requests of `kinds` per minute over `[from, to)`, and the most in any 60 s from one of
/// them.
fn rate(seen: &[Seen], kinds: &[Kind], from: Duration, to: Duration) -> (f64, usize) {
    let times: Vec<Duration> = seen
        .iter()
        .filter(|s| kinds.contains(&s.kind) && s.at >= from && s.at < to)
        .map(|s| s.at)
        .collect();
    let per_minute = times.len() as f64 / (to - from).as_secs_f64() * 60.0;
    let max = times
        .iter()
        .map(|&t| {
            times
                .iter()
                .filter(|&&u| u >= t && u < t + Duration::from_secs(60))
                .count()
        })
        .max()
        .unwrap_or(0);
    (per_minute, max)
}

#[tokio::test(start_paused = true)]
async fn api_requests_per_pod_per_minute_at_steady_state_under_503_under_retry_after_and_in_a_hang()
{
    let (kube, handle, errors) = mocked(settings(true));
    let server = tokio::spawn(FakeApi::serve(handle));
    let start = tokio::time::Instant::now();
    // What the candidacy was told, over time: whether the app counts as ready.
    let (candidacy_tx, mut candidacy) = watch::channel(Candidacy::checked(Duration::from_secs(5)));
    let told = tokio::spawn(async move {
        let mut told = Vec::new();
        while candidacy.changed().await.is_ok() {
            let state = candidacy.borrow_and_update();
            let now = Deadline::now();
            // Settled: nothing pending, i.e. not counting an unreadable spell.
            told.push((
                start.elapsed(),
                state.app_ready(now),
                state.changes_at(now).is_none(),
            ));
        }
        told
    });
    let follow = tokio::spawn(kube.clone().follow_container(
        "app".to_string(),
        Duration::from_secs(1),
        candidacy_tx,
    ));
    let (leadership_tx, leadership_rx) = watch::channel(leader(7));
    let observer =
        tokio::spawn(kube.observe(leadership_rx, CancellationToken::new(), FLUSH_TIMEOUT));

    let api = match server.await {
        Ok(api) => api,
        Err(err) => std::panic::resume_unwind(err.into_panic()),
    };
    follow.abort();
    observer.abort();
    drop(leadership_tx);
    let _ = follow.await;
    let told = told.await.expect("the recorder ends with the watch");
    let seen = &api.seen;

    // The table.
    let all = [Kind::PodStatus, Kind::Label, Kind::Event, Kind::Lease];
    println!(
        "API requests per pod per minute (one sidecar: leader, Lease mirror on, renew interval 1 s, --follow-container), {} simulated minutes per phase; avg (most in any 60 s):",
        PHASE.as_secs() / 60
    );
    println!(
        "{:<24} {:>18} {:>18} {:>18}",
        "phase", "pod status", "Lease writes", "all requests"
    );
    let mut table = Vec::new();
    for (index, (name, _)) in PHASES.iter().enumerate() {
        let (from, to) = (PHASE * index as u32, PHASE * (index as u32 + 1));
        let pod = rate(seen, &[Kind::PodStatus], from, to);
        let lease = rate(seen, &[Kind::Lease], from, to);
        let total = rate(seen, &all, from, to);
        println!(
            "{name:<24} {:>11.2} ({:>3}) {:>11.2} ({:>3}) {:>11.2} ({:>3})",
            pod.0, pod.1, lease.0, lease.1, total.0, total.1
        );
        table.push((pod, lease, total));
    }

    // Pod status: never more than 2 requests in any minute, whatever the phase.
    let whole = rate(seen, &[Kind::PodStatus], Duration::ZERO, PHASE * 5);
    assert!(
        whole.1 <= 2,
        "pod status: {} requests in one minute",
        whole.1
    );
    // Steady: one list and a watch, then a watch every 5 to 10 minutes.
    let (steady_pod, steady_lease, steady_total) = table[0];
    let after_start = rate(seen, &[Kind::PodStatus], Duration::from_secs(60), PHASE);
    println!(
        "steady, after the first list and watch: pod status {:.2} a minute",
        after_start.0
    );
    assert!(after_start.0 <= 0.25, "{after_start:?}");
    assert!(
        steady_pod.0 <= 0.5,
        "steady pod status {:.2}/min",
        steady_pod.0
    );
    // The Lease mirror: every 5 s at most (renew interval 1 s), 12 a minute.
    assert!(
        steady_lease.0 <= 12.5 && steady_lease.1 <= 13,
        "{steady_lease:?}"
    );
    // Failing phases: no more than the steady rate, of anything.
    for (index, (pod, lease, total)) in table.iter().enumerate().skip(1).take(3) {
        let name = PHASES[index].0;
        assert!(pod.1 <= 2, "{name}: pod status {pod:?}");
        assert!(
            pod.0 <= 1.0,
            "{name}: pod status {pod:?}, the steady budget is 1 a minute"
        );
        assert!(lease.1 <= 2, "{name}: Lease {lease:?}");
        assert!(
            total.0 <= steady_total.0,
            "{name}: {total:?} vs steady {steady_total:?}"
        );
        let attempts = seen
            .iter()
            .filter(|s| s.kind == Kind::PodStatus && FakeApi::phase_at(s.at) == index)
            .count();
        assert!(
            attempts >= 5,
            "{name}: the pod status is still tried ({attempts})"
        );
    }
    // Retry-After: after a 429, that operation waits at least 90 s.
    for kind in [Kind::PodStatus, Kind::Lease] {
        let times: Vec<&Seen> = seen.iter().filter(|s| s.kind == kind).collect();
        for pair in times.windows(2) {
            if FakeApi::phase_at(pair[0].at) == 2 {
                assert!(
                    pair[1].at - pair[0].at >= THROTTLED_RETRY_AFTER,
                    "{kind:?} came back {:?} after a 429 with Retry-After 90",
                    pair[1].at - pair[0].at
                );
            }
        }
    }
    // Every failed call is counted, under its operation.
    let failed = |kind: Kind| seen.iter().filter(|s| s.kind == kind && s.failed).count() as u64;
    assert_eq!(errors_for(&errors, "watch_pod"), failed(Kind::PodStatus));
    assert_eq!(errors_for(&errors, "update_lease"), failed(Kind::Lease));
    assert_eq!(errors_for(&errors, "patch_label"), 0);
    assert_eq!(errors_for(&errors, "create_event"), 0);
    assert_eq!(
        seen.iter().filter(|s| s.kind == Kind::Label).count(),
        1,
        "the label is set once"
    );
    // The candidacy heard of the outage (unreadable) and of the recovery (ready again).
    for (phase, (name, _)) in PHASES.iter().enumerate().skip(1).take(3) {
        assert!(
            told.iter()
                .any(|&(at, _, settled)| FakeApi::phase_at(at) == phase && !settled),
            "{name}: the candidacy was told the state is unreadable"
        );
    }
    let recovered = told
        .iter()
        .find(|&&(at, ready, settled)| FakeApi::phase_at(at) == 4 && ready && settled)
        .map(|&(at, _, _)| at - PHASE * 4);
    assert!(
        recovered.is_some_and(|after| after <= Duration::from_secs(120)),
        "read again {recovered:?} into the last phase"
    );
    drop(api.held);
}

// ---------------------------------------------------------------------------------------------
// Over real connections: the client this sidecar builds

/// Method, path, query, User-Agent, Authorization.
type WireRequest = (Method, String, String, Option<String>, Option<String>);

/// What the plain-HTTP fake API server saw.
#[derive(Default)]
struct Wire {
    connections: usize,
    requests: Vec<WireRequest>,
    /// Open watch streams (kept open).
    watches: Vec<WatchStream>,
}

/// Log events by level and `op` field, for the test that runs on one thread.
#[derive(Clone, Default)]
struct LogCount(Arc<Mutex<Vec<LogLine>>>);

/// A log event's level and `op` field.
type LogLine = (tracing::Level, Option<String>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for LogCount {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        struct Op(Option<String>);
        impl tracing::field::Visit for Op {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                if field.name() == "op" {
                    self.0 = Some(value.to_string());
                }
            }
            fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
        }
        let mut op = Op(None);
        event.record(&mut op);
        self.0
            .lock()
            .expect("not poisoned")
            .push((*event.metadata().level(), op.0));
    }
}

async fn read_request_body(mut body: hyper::body::Incoming) {
    use hyper::body::Body as _;
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        if frame.is_err() {
            return;
        }
    }
}

async fn wire_answer(
    wire: Arc<Mutex<Wire>>,
    request: Request<hyper::body::Incoming>,
) -> Response<ApiBody> {
    let header = |name| {
        request
            .headers()
            .get(name)
            .and_then(|v: &header::HeaderValue| v.to_str().ok())
            .map(str::to_string)
    };
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let query = query_of(request.uri());
    wire.lock().expect("not poisoned").requests.push((
        method.clone(),
        path.clone(),
        request.uri().query().unwrap_or_default().to_string(),
        header(header::USER_AGENT),
        header(header::AUTHORIZATION),
    ));
    read_request_body(request.into_body()).await;
    match (method, query.contains_key("watch")) {
        (Method::GET, false) => json_response(
            StatusCode::OK,
            pod_list("10", vec![pod_with_app(Some(false), "10")]),
        ),
        (Method::GET, true) => {
            let (response, stream) = watch_response();
            // The app turns ready; the line arrives in two chunks.
            let mut line = serde_json::to_vec(
                &json!({ "type": "MODIFIED", "object": pod_with_app(Some(true), "11") }),
            )
            .expect("JSON");
            line.push(b'\n');
            let rest = line.split_off(40);
            stream.send_raw(line);
            stream.send_raw(rest);
            wire.lock().expect("not poisoned").watches.push(stream);
            response
        }
        // Writes: the API server is overloaded.
        _ => json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            status_body(StatusCode::SERVICE_UNAVAILABLE, "pods", POD),
        ),
    }
}

#[tokio::test]
async fn over_real_connections_each_503_is_one_request_counted_and_logged_once_on_a_kept_connection(
) {
    use tracing_subscriber::layer::SubscriberExt as _;
    let logs = LogCount::default();
    let _logging =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(logs.clone()));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let wire = Arc::new(Mutex::new(Wire::default()));
    let server_wire = Arc::clone(&wire);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            server_wire.lock().expect("not poisoned").connections += 1;
            let wire = Arc::clone(&server_wire);
            let service = hyper::service::service_fn(move |request| {
                let wire = Arc::clone(&wire);
                async move { Ok::<_, Infallible>(wire_answer(wire, request).await) }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });

    // The service account's token, as the kubelet projects it.
    let dir = support::TempDir::new("k8s-token");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "test-token").expect("token written");
    let mut config = kube::Config::new(format!("http://{addr}").parse().expect("a URL"));
    config.default_namespace = NAMESPACE.to_string();
    config.auth_info.token_file = Some(token_file.display().to_string());
    let client = redlock_sidecar::k8s::client(config).expect("a client");
    let errors = errors_counter();
    let kube = Kube::with_client(client, settings(false), POD.to_string(), errors.clone());

    let (candidacy_tx, mut candidacy) = watch::channel(Candidacy::checked(Duration::from_secs(5)));
    let follow = tokio::spawn(kube.clone().follow_container(
        "app".to_string(),
        Duration::from_secs(1),
        candidacy_tx,
    ));
    let (leadership_tx, leadership_rx) = watch::channel(leader(7));
    let observer =
        tokio::spawn(kube.observe(leadership_rx, CancellationToken::new(), FLUSH_TIMEOUT));

    // The watch streams the app's readiness over a real connection.
    tokio::time::timeout(
        Duration::from_secs(5),
        until_app_ready(&mut candidacy, true),
    )
    .await
    .expect("ready from the watch");
    // Long enough for the first retry (0.5 to 1 s) of each write, too short for a third try.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    observer.abort();
    follow.abort();
    drop(leadership_tx);

    let wire = wire.lock().expect("not poisoned");
    let count = |method: Method, part: &str| {
        wire.requests
            .iter()
            .filter(|(m, path, query, _, _)| {
                *m == method && (path.contains(part) || query.contains(part))
            })
            .count()
    };
    println!(
        "over real connections: {} requests on {} connections",
        wire.requests.len(),
        wire.connections
    );
    assert_eq!(count(Method::PATCH, "/pods/"), 2, "{:?}", wire.requests);
    assert_eq!(count(Method::POST, "/events"), 2, "{:?}", wire.requests);
    assert_eq!(count(Method::GET, "watch=true"), 1, "{:?}", wire.requests);
    assert_eq!(
        wire.requests.len(),
        6,
        "one list, one watch, two of each write: {:?}",
        wire.requests
    );
    assert_eq!(errors_for(&errors, "patch_label"), 2);
    assert_eq!(errors_for(&errors, "create_event"), 2);
    assert_eq!(errors_for(&errors, "watch_pod"), 0);
    for (method, path, _, agent, auth) in &wire.requests {
        assert_eq!(agent.as_deref(), Some(USER_AGENT_VALUE), "{method} {path}");
        assert_eq!(
            auth.as_deref(),
            Some("Bearer test-token"),
            "{method} {path}"
        );
    }
    // The watch keeps one connection; the writes share another (a 503's body is read, so
    // its connection goes back to the pool); a third at most while the list and the first
    // write overlap.
    assert!(wire.connections <= 3, "{} connections", wire.connections);
    drop(wire);

    let logs = logs.0.lock().expect("not poisoned");
    let errors_logged = logs
        .iter()
        .filter(|(level, _)| *level == tracing::Level::ERROR)
        .count();
    assert_eq!(errors_logged, 0, "no ERROR lines: {logs:?}");
    for op in ["patch_label", "create_event"] {
        let warnings = logs
            .iter()
            .filter(|(level, o)| *level == tracing::Level::WARN && o.as_deref() == Some(op))
            .count();
        assert_eq!(warnings, 1, "{op}: one warning for two failures: {logs:?}");
    }
}

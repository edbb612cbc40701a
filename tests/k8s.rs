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

mod support;

use std::time::{Duration, SystemTime};

use http::{header, Method, Request, Response, StatusCode};
use kube::client::Body;
use prometheus::IntCounterVec;
use redlock_sidecar::candidacy::Candidacy;
use redlock_sidecar::clock::{Clock, Deadline};
use redlock_sidecar::config::Renewal;
use redlock_sidecar::k8s::{errors_counter, lease_name, Kube, KubeMode, KubeSettings};
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
/// How long the verifier waits for an expected call.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the verifier listens to assert that no call arrives.
const QUIET: Duration = Duration::from_millis(500);
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

type ApiHandle = Handle<Request<Body>, Response<Body>>;
type Responder = SendResponse<Response<Body>>;

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
    /// The label patch answers 403 twice (RBAC missing), with growing delays, then succeeds;
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
                        created["spec"]["leaseDurationSeconds"], 3,
                        "3 renew intervals"
                    );
                    assert_eq!(created["spec"]["leaseTransitions"], 0);
                    assert!(created["spec"]["renewTime"].is_string(), "{created}");
                    assert!(created["spec"]["acquireTime"].is_string(), "{created}");
                    // One renew interval later, an update on the known resourceVersion.
                    let renewed = self.expect_lease_write(Method::PUT, "2").await;
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
                    assert_eq!(updated["spec"]["leaseDurationSeconds"], 3);
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
                    self.expect_label("true").await;
                    let third = tokio::time::Instant::now();
                    // Equal jitter: at least half of 200 ms, then of 400 ms.
                    assert!(
                        second - first >= Duration::from_millis(100),
                        "{:?}",
                        second - first
                    );
                    assert!(
                        third - second >= Duration::from_millis(200),
                        "{:?}",
                        third - second
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
        tokio::time::timeout(CALL_TIMEOUT, self.handle.next_request())
            .await
            .unwrap_or_else(|_| panic!("{what} was not called within {CALL_TIMEOUT:?}"))
            .unwrap_or_else(|| panic!("the client went away before {what}"))
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
        let (request, respond) = self.next(&format!("the Lease {method}")).await;
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
        let (request, respond) = self.next(&format!("the Lease {method}")).await;
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

fn json_response(status: StatusCode, body: Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::to_vec(&body).expect("JSON")))
        .expect("response")
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
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
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
    let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
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

    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
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
        ["create_event", "get_pod", "patch_label", "update_lease"]
    );
}

// ---------------------------------------------------------------------------------------------
// Following the app container's readiness (`--follow-container`)

/// The pod as the API server returns it, with the app container's status as given (`None`:
/// not started yet, no status).
fn pod_with_app(ready: Option<bool>) -> Value {
    let statuses: Vec<Value> = ready
        .map(|ready| {
            json!({"name": "app", "ready": ready, "started": true, "restartCount": 0,
                   "image": "shop/app:1", "imageID": ""})
        })
        .into_iter()
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": POD, "namespace": NAMESPACE, "uid": POD_UID },
        "spec": { "containers": [
            { "name": "app", "image": "shop/app:1" },
            { "name": "redlock", "image": "redlock-sidecar:1" }
        ] },
        "status": { "containerStatuses": statuses }
    })
}

/// Answers the next request, which must be the GET of this pod.
async fn answer_pod_get(handle: &mut ApiHandle, response: Response<Body>) {
    let (request, respond) = tokio::time::timeout(CALL_TIMEOUT, handle.next_request())
        .await
        .expect("the pod is read")
        .expect("the client is alive");
    assert_eq!(request.method(), Method::GET);
    assert_eq!(
        request.uri().path(),
        format!("/api/v1/namespaces/{NAMESPACE}/pods/{POD}")
    );
    respond.send_response(response);
}

#[tokio::test]
async fn the_app_containers_readiness_is_read_from_the_pod_and_an_api_error_changes_nothing() {
    let (kube, mut handle, errors) = mocked(settings(false));
    let (tx, mut rx) = watch::channel(Candidacy::checked(Duration::from_secs(5)));
    let follow =
        tokio::spawn(kube.follow_container("app".to_string(), Duration::from_millis(20), tx));
    let may_contend = |rx: &watch::Receiver<Candidacy>| rx.borrow().may_contend(Deadline::now());
    // Not started yet (no status): not ready, so no contending.
    answer_pod_get(
        &mut handle,
        json_response(StatusCode::OK, pod_with_app(None)),
    )
    .await;
    rx.changed().await.unwrap();
    assert!(!may_contend(&rx));
    // Ready: contend.
    answer_pod_get(
        &mut handle,
        json_response(StatusCode::OK, pod_with_app(Some(true))),
    )
    .await;
    rx.changed().await.unwrap();
    assert!(may_contend(&rx));
    // The API fails: the last known readiness stands, and the failure is counted.
    let failure = status_body(StatusCode::FORBIDDEN, "pods", POD);
    answer_pod_get(&mut handle, json_response(StatusCode::FORBIDDEN, failure)).await;
    support::wait_until_async(CALL_TIMEOUT, "the failure is counted", || async {
        errors.with_label_values(&["get_pod"]).get() == 1
    })
    .await;
    assert!(may_contend(&rx), "an API error changes nothing");
    assert!(!rx.has_changed().unwrap());
    answer_pod_get(
        &mut handle,
        json_response(StatusCode::OK, pod_with_app(Some(false))),
    )
    .await;
    rx.changed().await.unwrap();
    // The readinessProbe failed: not ready.
    assert!(!may_contend(&rx));
    follow.abort();
}

#[tokio::test]
async fn following_every_app_container_needs_all_of_them_ready_and_ignores_init_containers() {
    let (kube, mut handle, _) = mocked(settings(false));
    let pod = |app: bool, worker: bool| {
        json!({
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
        })
    };
    assert_eq!(
        ask_ready(&kube, &mut handle, pod(true, false)).await,
        Some(false)
    );
    assert_eq!(
        ask_ready(&kube, &mut handle, pod(true, true)).await,
        Some(true),
        "the sidecar's own status is not asked"
    );
}

/// `container_ready("*")` answered with `pod`.
async fn ask_ready(kube: &Kube, handle: &mut ApiHandle, pod: Value) -> Option<bool> {
    let kube = kube.clone();
    let asked = tokio::spawn(async move { kube.container_ready("*").await });
    answer_pod_get(handle, json_response(StatusCode::OK, pod)).await;
    asked.await.unwrap().unwrap()
}

//! Dapr's lock API through the real binary on real redis-server nodes, over HTTP (the control
//! listener) and over gRPC (`--dapr-grpc-listen`): the cases of Dapr's lock store conformance
//! suite on both, what Dapr's SDKs call before they lock, what travels beside Dapr's answers
//! (fencing token, validity, the reason of a refusal), "held" told apart from "no quorum", every
//! other gRPC method UNIMPLEMENTED, malformed messages INVALID_ARGUMENT, bad flags; plus a
//! property test that no gRPC input panics the service (in-process, real engine on a closed port).
//!
//! Dapr's own SDKs run against the binary in `scripts/dapr-sdks.sh`.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use prost::Message;
use redlock_sidecar::locks::dapr_grpc::proto::dapr_client::DaprClient;
use redlock_sidecar::locks::dapr_grpc::{proto, RpcErrorInfo, RpcStatus};
use support::{Proc, RedisCluster};
use tonic::transport::Channel;
use tonic::Code;

/// Longest wait for anything these tests expect to happen.
const DEADLINE: Duration = Duration::from_secs(30);
/// The longest expiry these tests ask for: the nodes' votes count for it at once.
const LONGEST_TTL: Duration = Duration::from_secs(60);
const STORE: &str = "redlock";

fn loopback() -> SocketAddr {
    format!("127.0.0.1:{}", support::free_port())
        .parse()
        .unwrap()
}

fn ready_cluster() -> RedisCluster {
    let cluster = RedisCluster::start(3);
    cluster.backdate_epochs(LONGEST_TTL);
    cluster
}

struct Sidecar {
    _proc: Proc,
    control: SocketAddr,
    grpc: SocketAddr,
}

impl Sidecar {
    async fn start(name: &str, cluster: &RedisCluster) -> Sidecar {
        let (admin, control, grpc) = (loopback(), loopback(), loopback());
        let (listen, control_listen, grpc_listen, redis) = (
            admin.to_string(),
            control.to_string(),
            grpc.to_string(),
            cluster.urls_joined(),
        );
        let args = [
            "run",
            "--lock",
            "leader",
            "--redis",
            &redis,
            "--node-set",
            support::TEST_NODE_SET,
            "--ttl",
            "2s",
            "--node-timeout",
            "100ms",
            "--retry-delay",
            "50ms",
            "--listen",
            &listen,
            "--control-listen",
            &control_listen,
            "--dapr-grpc-listen",
            &grpc_listen,
            "--identity",
            name,
            "--kubernetes",
            "off",
        ];
        let sidecar = Sidecar {
            _proc: Proc::spawn(&args, &[("REDLOCK_LOG", "info")]),
            control,
            grpc,
        };
        // What Dapr's Python SDK waits for before it makes a client.
        support::wait_until_async(DEADLINE, "Dapr's health check answers 204", || async {
            support::http::get(control, "/v1.0/healthz/outbound")
                .await
                .is_ok_and(|r| r.status == 204)
        })
        .await;
        sidecar
    }

    async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    async fn client(&self) -> DaprClient<Channel> {
        DaprClient::new(self.channel().await)
    }

    async fn post(&self, path: &str, body: &str) -> support::Response {
        support::http::request_with_body(
            "POST",
            self.control,
            path,
            Some(("application/json", body)),
        )
        .await
        .unwrap()
    }
}

/// One way to Dapr's lock API: its HTTP routes or its gRPC methods.
enum Via {
    Http(SocketAddr),
    Grpc(DaprClient<Channel>),
}

impl Via {
    /// `Ok(success)`, or the error: Dapr's `errorCode` over HTTP, the status code over gRPC.
    async fn try_lock(&mut self, resource: &str, owner: &str, expiry: i32) -> Result<bool, String> {
        match self {
            Via::Http(addr) => {
                let body = serde_json::json!({
                    "resourceId": resource, "lockOwner": owner, "expiryInSeconds": expiry
                })
                .to_string();
                let path = format!("/v1.0-alpha1/lock/{STORE}");
                let answer = support::http::request_with_body(
                    "POST",
                    *addr,
                    &path,
                    Some(("application/json", &body)),
                )
                .await?;
                let json = answer.json()?;
                match answer.status {
                    200 => Ok(json["success"] == true),
                    _ => Err(json["errorCode"].as_str().unwrap_or("?").to_owned()),
                }
            }
            Via::Grpc(client) => client
                .try_lock_alpha1(proto::TryLockRequest {
                    store_name: STORE.into(),
                    resource_id: resource.into(),
                    lock_owner: owner.into(),
                    expiry_in_seconds: expiry,
                })
                .await
                .map(|r| r.into_inner().success)
                .map_err(|status| format!("{:?}", status.code())),
        }
    }

    /// `Ok(status)` (Dapr's numbers), or the error as for [`Via::try_lock`].
    async fn unlock(&mut self, resource: &str, owner: &str) -> Result<i64, String> {
        match self {
            Via::Http(addr) => {
                let body =
                    serde_json::json!({ "resourceId": resource, "lockOwner": owner }).to_string();
                let path = format!("/v1.0-alpha1/unlock/{STORE}");
                let answer = support::http::request_with_body(
                    "POST",
                    *addr,
                    &path,
                    Some(("application/json", &body)),
                )
                .await?;
                let json = answer.json()?;
                match answer.status {
                    200 => json["status"].as_i64().ok_or_else(|| answer.body.clone()),
                    _ => Err(json["errorCode"].as_str().unwrap_or("?").to_owned()),
                }
            }
            Via::Grpc(client) => client
                .unlock_alpha1(proto::UnlockRequest {
                    store_name: STORE.into(),
                    resource_id: resource.into(),
                    lock_owner: owner.into(),
                })
                .await
                .map(|r| i64::from(r.into_inner().status))
                .map_err(|status| format!("{:?}", status.code())),
        }
    }
}

/// The cases of Dapr's lock store conformance suite (components-contrib,
/// `tests/conformance/lock/lock.go`), as there: the same keys, owners, expiries and order.
async fn conformance(mut via: Via) {
    let key = format!("{:016x}", rand_u64());
    let owner = "conftest";
    let (lock1, lock2) = (format!("{key}-1"), format!("{key}-2"));

    // TryLock: acquire lock1 (15 s), lock2 (3 s), then lock1 again fails.
    assert_eq!(
        via.try_lock(&lock1, owner, 15).await,
        Ok(true),
        "acquire lock1"
    );
    assert_eq!(
        via.try_lock(&lock2, owner, 3).await,
        Ok(true),
        "acquire lock2"
    );
    let lock2_expires = Instant::now() + Duration::from_secs(3);
    assert_eq!(
        via.try_lock(&lock1, owner, 15).await,
        Ok(false),
        "fails to acquire existing lock"
    );

    // Unlock: a resource that does not exist (1), the wrong owner (2), the owner (0).
    assert_eq!(
        via.unlock("nonexistent", owner).await,
        Ok(1),
        "fails to unlock with nonexistent resource ID"
    );
    assert_eq!(
        via.unlock(&lock1, "nonowner").await,
        Ok(2),
        "fails to unlock with wrong owner"
    );
    assert_eq!(
        via.unlock(&lock1, owner).await,
        Ok(0),
        "unlocks successfully"
    );

    // The lock expires: once lock2's expiry passed, it is re-acquired within 5 s (polled
    // every 100 ms, as there).
    tokio::time::sleep_until(lock2_expires.into()).await;
    let began = Instant::now();
    loop {
        if via.try_lock(&lock2, owner, 3).await == Ok(true) {
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "Lock 2 was not released in time after its scheduled expiration"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    hasher.finish()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daprs_lock_store_conformance_cases_pass_over_http() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let a = Sidecar::start("a", &cluster).await;
    conformance(Via::Http(a.control)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daprs_lock_store_conformance_cases_pass_over_grpc() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let a = Sidecar::start("a", &cluster).await;
    conformance(Via::Grpc(a.client().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_protocols_share_one_lock_store_across_sidecars() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let a = Sidecar::start("a", &cluster).await;
    let b = Sidecar::start("b", &cluster).await;
    let mut over_http = Via::Http(a.control);
    let mut over_grpc = Via::Grpc(b.client().await);
    assert_eq!(over_http.try_lock("order-7", "vader", 30).await, Ok(true));
    assert_eq!(over_grpc.try_lock("order-7", "luke", 30).await, Ok(false));
    assert_eq!(over_grpc.unlock("order-7", "luke").await, Ok(2));
    // The owner is known to the sidecar that took the lock: through the other, "another's".
    assert_eq!(over_grpc.unlock("order-7", "vader").await, Ok(2));
    assert_eq!(over_http.unlock("order-7", "vader").await, Ok(0));
    assert_eq!(over_grpc.try_lock("order-7", "luke", 30).await, Ok(true));
    let mut a_grpc = Via::Grpc(a.client().await);
    assert_eq!(a_grpc.try_lock("order-7", "vader", 30).await, Ok(false));
    assert_eq!(over_grpc.unlock("order-7", "luke").await, Ok(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_daprs_sdks_call_before_they_lock_answers_honestly() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let a = Sidecar::start("pod-a", &cluster).await;
    for path in ["/v1.0/healthz", "/v1.0/healthz/outbound"] {
        let answer = support::http::get(a.control, path).await.unwrap();
        assert_eq!(answer.status, 204, "{path}: {answer:?}");
    }
    // What Dapr's JavaScript SDK polls over HTTP.
    let metadata = support::http::get(a.control, "/v1.0/metadata")
        .await
        .unwrap();
    assert_eq!(metadata.status, 200, "{metadata:?}");
    let json = metadata.json().unwrap();
    assert_eq!(json["id"], "pod-a");
    assert_eq!(
        json["runtimeVersion"],
        format!("redlock-sidecar/{}", env!("CARGO_PKG_VERSION"))
    );
    assert_eq!(
        json["components"],
        serde_json::json!([{"name": "redlock", "type": "lock.redlock-sidecar", "version": "v1"}])
    );
    assert_eq!(json["actorRuntime"]["runtimeStatus"], "DISABLED");
    assert_eq!(
        json["extended"]["redlock-sidecar.grpc-listen"],
        a.grpc.to_string()
    );
    // What it calls over gRPC: the same description.
    let over_grpc = a
        .client()
        .await
        .get_metadata(proto::GetMetadataRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(over_grpc.id, "pod-a");
    assert_eq!(over_grpc.runtime_version, json["runtimeVersion"]);
    assert_eq!(over_grpc.registered_components.len(), 1);
    let component = &over_grpc.registered_components[0];
    assert_eq!(
        (&*component.name, &*component.r#type, &*component.version),
        ("redlock", "lock.redlock-sidecar", "v1")
    );
    assert_eq!(
        over_grpc.actor_runtime.map(|a| a.runtime_status),
        Some(proto::actor_runtime::ActorRuntimeStatus::Disabled as i32)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fencing_token_and_validity_travel_beside_daprs_answer() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let a = Sidecar::start("a", &cluster).await;
    let lock = "/v1.0-alpha1/lock/redlock";
    let unlock = "/v1.0-alpha1/unlock/redlock";
    let vader = r#"{"resourceId": "order-9", "lockOwner": "vader", "expiryInSeconds": 20}"#;
    let taken = a.post(lock, vader).await;
    assert_eq!(taken.json().unwrap(), serde_json::json!({"success": true}));
    let token: u64 = taken
        .header("x-redlock-fencing-token")
        .expect("a token")
        .parse()
        .unwrap();
    let validity: u64 = taken
        .header("x-redlock-validity-ms")
        .expect("a validity")
        .parse()
        .unwrap();
    assert!(validity > 15_000 && validity <= 20_000, "{validity}");
    assert_eq!(taken.header("x-redlock-reason"), None);
    // Held: Dapr's answer unchanged, the reason and the holding sidecar beside it.
    let luke = r#"{"resourceId": "order-9", "lockOwner": "luke", "expiryInSeconds": 20}"#;
    let held = a.post(lock, luke).await;
    assert_eq!(held.json().unwrap(), serde_json::json!({"success": false}));
    assert_eq!(held.header("x-redlock-reason"), Some("held"));
    assert_eq!(held.header("x-redlock-fencing-token"), None);
    let vader_unlock = r#"{"resourceId": "order-9", "lockOwner": "vader"}"#;
    assert_eq!(
        a.post(unlock, vader_unlock).await.json().unwrap(),
        serde_json::json!({"status": 0})
    );

    // Over gRPC: the response metadata, and the next holder's token is larger.
    let mut client = a.client().await;
    let response = client
        .try_lock_alpha1(proto::TryLockRequest {
            store_name: STORE.into(),
            resource_id: "order-9".into(),
            lock_owner: "luke".into(),
            expiry_in_seconds: 20,
        })
        .await
        .unwrap();
    let header = |name: &str| {
        response
            .metadata()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    assert!(response.get_ref().success);
    let next: u64 = header("x-redlock-fencing-token").unwrap().parse().unwrap();
    assert!(next > token, "{next} > {token}");
    let validity: u64 = header("x-redlock-validity-ms").unwrap().parse().unwrap();
    assert!(validity > 15_000 && validity <= 20_000, "{validity}");
    let held = client
        .try_lock_alpha1(proto::TryLockRequest {
            store_name: STORE.into(),
            resource_id: "order-9".into(),
            lock_owner: "vader".into(),
            expiry_in_seconds: 20,
        })
        .await
        .unwrap();
    assert!(!held.get_ref().success);
    assert_eq!(
        held.metadata()
            .get("x-redlock-reason")
            .and_then(|v| v.to_str().ok()),
        Some("held")
    );
}

/// The `ErrorInfo` of a gRPC status, after checking that the details repeat its code and
/// message (Dapr's Python SDK refuses details that do not).
fn error_info(status: &tonic::Status) -> RpcErrorInfo {
    let details = RpcStatus::decode(status.details()).expect("google.rpc.Status details");
    assert_eq!(details.code, status.code() as i32);
    assert_eq!(details.message, status.message());
    assert_eq!(
        details.details[0].type_url,
        "type.googleapis.com/google.rpc.ErrorInfo"
    );
    RpcErrorInfo::decode(&*details.details[0].value).expect("an ErrorInfo")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_quorum_the_answer_says_so_in_daprs_shape() {
    let mut cluster = tokio::task::block_in_place(ready_cluster);
    let a = Sidecar::start("a", &cluster).await;
    let mut client = a.client().await;
    tokio::task::block_in_place(|| {
        cluster.node_mut(0).stop();
        cluster.node_mut(1).stop();
    });
    // HTTP: Dapr's 500 ERR_TRY_LOCK_FAILED, the reason in Dapr's details and a header.
    let body = r#"{"resourceId": "refund-1", "lockOwner": "o", "expiryInSeconds": 5}"#;
    let answer = a.post("/v1.0-alpha1/lock/redlock", body).await;
    assert_eq!(answer.status, 500, "{answer:?}");
    let json = answer.json().unwrap();
    assert_eq!(json["errorCode"], "ERR_TRY_LOCK_FAILED");
    assert_eq!(
        json["details"][0]["@type"],
        "type.googleapis.com/google.rpc.ErrorInfo"
    );
    assert_eq!(json["details"][0]["reason"], "REDLOCK_NO_QUORUM");
    assert_eq!(json["details"][0]["domain"], "redlock-sidecar");
    assert_eq!(json["details"][0]["metadata"]["kind"], "no_quorum");
    assert_eq!(answer.header("x-redlock-reason"), Some("no_quorum"));
    let unlocked = a
        .post(
            "/v1.0-alpha1/unlock/redlock",
            r#"{"resourceId": "refund-1", "lockOwner": "o"}"#,
        )
        .await;
    assert_eq!(unlocked.json().unwrap(), serde_json::json!({"status": 3}));
    assert_eq!(unlocked.header("x-redlock-reason"), Some("unavailable"));

    // gRPC: INTERNAL as daprd answers, with the ErrorInfo in grpc-status-details-bin.
    let status = client
        .try_lock_alpha1(proto::TryLockRequest {
            store_name: STORE.into(),
            resource_id: "refund-2".into(),
            lock_owner: "o".into(),
            expiry_in_seconds: 5,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    assert!(status.message().contains("quorum"), "{status:?}");
    let info = error_info(&status);
    assert_eq!(info.reason, "REDLOCK_NO_QUORUM");
    assert_eq!(info.domain, "redlock-sidecar");
    assert_eq!(
        status
            .metadata()
            .get("x-redlock-reason")
            .and_then(|v| v.to_str().ok()),
        Some("no_quorum")
    );
    let unlocked = client
        .unlock_alpha1(proto::UnlockRequest {
            store_name: STORE.into(),
            resource_id: "refund-2".into(),
            lock_owner: "o".into(),
        })
        .await
        .unwrap();
    assert_eq!(
        unlocked.get_ref().status,
        proto::unlock_response::Status::InternalError as i32
    );
    // The health checks still answer: a lock call says what is wrong at once.
    let health = support::http::get(a.control, "/v1.0/healthz/outbound")
        .await
        .unwrap();
    assert_eq!(health.status, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_requests_dapr_refuses_get_daprs_codes_and_messages() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let a = Sidecar::start("a", &cluster).await;
    let mut client = a.client().await;
    let try_lock = |store: &str, resource: &str, owner: &str, expiry: i32| proto::TryLockRequest {
        store_name: store.into(),
        resource_id: resource.into(),
        lock_owner: owner.into(),
        expiry_in_seconds: expiry,
    };
    let long_owner = "o".repeat(129);
    for (request, message) in [
        (
            try_lock("redlock", "r", "o", 0),
            "ExpiryInSeconds is not positive in lock store redlock",
        ),
        (
            try_lock("redlock", "", "o", 5),
            "ResourceId is empty in lock store redlock",
        ),
        (
            try_lock("redlock", "r", "", 5),
            "LockOwner is empty in lock store redlock",
        ),
        (
            try_lock("redisStore", "r", "o", 5),
            "lock store redisStore not found",
        ),
        (try_lock("redlock", "r", "o", 3601), "at most 3600"),
        (
            try_lock("redlock", "r", &long_owner, 5),
            "lockOwner: 1 to 128",
        ),
        (try_lock("redlock", "a b", "o", 5), "name: 1 to 128"),
    ] {
        let status = client.try_lock_alpha1(request).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(message), "{status:?}");
    }
    let status = client
        .unlock_alpha1(proto::UnlockRequest {
            store_name: "redisStore".into(),
            resource_id: "r".into(),
            lock_owner: "o".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(status.message(), "lock store redisStore not found");
    // A message past the bound on message size: refused before it is read.
    let status = client
        .try_lock_alpha1(try_lock("redlock", "r", &"o".repeat(5000), 5))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
}

/// A codec that sends and receives the bytes as they are (to call any method with any body).
#[derive(Default)]
struct RawCodec;
struct RawEncoder;
struct RawDecoder;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

impl tonic::codec::Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use prost::bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use prost::bytes::Buf;
        let mut out = vec![0; src.remaining()];
        src.copy_to_slice(&mut out);
        Ok(Some(out))
    }
}

/// Calls `path` with `body` as the message.
async fn call_raw(channel: Channel, path: &str, body: Vec<u8>) -> Result<Vec<u8>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    grpc.unary(
        tonic::Request::new(body),
        http::uri::PathAndQuery::try_from(path).unwrap(),
        RawCodec,
    )
    .await
    .map(tonic::Response::into_inner)
}

/// Sends `frames` as the whole request body of `path`: the answer's gRPC status code.
async fn call_framed(channel: Channel, path: &str, frames: Vec<u8>) -> (Code, String) {
    use tower::ServiceExt;
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://127.0.0.1{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(axum::body::Body::from(frames)))
        .unwrap();
    let response = channel.oneshot(request).await.unwrap();
    let status =
        tonic::Status::from_header_map(response.headers()).expect("a trailers-only answer");
    (status.code(), status.message().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_other_method_is_unimplemented_and_names_what_is_served() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let a = Sidecar::start("a", &cluster).await;
    for path in [
        "/dapr.proto.runtime.v1.Dapr/GetState",
        "/dapr.proto.runtime.v1.Dapr/PublishEvent",
        "/dapr.proto.runtime.v1.Dapr/Shutdown",
        "/dapr.proto.runtime.v1.Dapr/TryLockAlpha2",
        "/grpc.health.v1.Health/Check",
        "/nothing",
    ] {
        let status = call_raw(a.channel().await, path, Vec::new())
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unimplemented, "{path}: {status:?}");
        for named in [path, "TryLockAlpha1", "UnlockAlpha1", "GetMetadata"] {
            assert!(status.message().contains(named), "{path}: {status:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_message_is_an_invalid_argument_and_the_sidecar_goes_on() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let a = Sidecar::start("a", &cluster).await;
    let try_lock = "/dapr.proto.runtime.v1.Dapr/TryLockAlpha1";
    for (what, body) in [
        ("a length past the end", vec![0x0a, 0x05, b'a']),
        ("a string that is not UTF-8", vec![0x12, 0x01, 0xff]),
        ("a wire type that does not exist", vec![0x0f]),
        ("an int32 field given as a string", vec![0x20, 0xff]),
    ] {
        let status = call_raw(a.channel().await, try_lock, body)
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
    }
    // A frame cut short, no message at all, a flag that is neither 0 nor 1.
    let (code, message) =
        call_framed(a.channel().await, try_lock, vec![0, 0, 0, 0, 10, 1, 2]).await;
    assert_eq!(code, Code::InvalidArgument, "{message}");
    let (code, message) = call_framed(a.channel().await, try_lock, Vec::new()).await;
    assert_eq!(code, Code::InvalidArgument, "{message}");
    let (code, message) = call_framed(a.channel().await, try_lock, vec![7, 0, 0, 0, 0]).await;
    assert_eq!(code, Code::InvalidArgument, "{message}");
    // Nothing was taken, and the next request is served.
    let mut client = a.client().await;
    let taken = client
        .try_lock_alpha1(proto::TryLockRequest {
            store_name: STORE.into(),
            resource_id: "after-garbage".into(),
            lock_owner: "o".into(),
            expiry_in_seconds: 5,
        })
        .await
        .unwrap();
    assert!(taken.get_ref().success);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_names_another_host_is_refused() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let a = Sidecar::start("a", &cluster).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", a.grpc))
        .unwrap()
        .origin("http://evil.example:50001".parse().unwrap())
        .connect()
        .await
        .unwrap();
    let status = DaprClient::new(channel)
        .try_lock_alpha1(proto::TryLockRequest {
            store_name: STORE.into(),
            resource_id: "order-1".into(),
            lock_owner: "o".into(),
            expiry_in_seconds: 5,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let held = Via::Http(a.control).unlock("order-1", "o").await;
    assert_eq!(held, Ok(1), "nothing was taken");
}

#[test]
fn bad_dapr_grpc_settings_exit_2_naming_the_flag() {
    let control = &format!("127.0.0.1:{}", support::free_port());
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    let base = [
        "run",
        "--redis",
        "redis://127.0.0.1:1",
        "--lock",
        "jobs",
        "--kubernetes",
        "off",
        "--listen",
        "127.0.0.1:0",
        "--control-listen",
        control,
    ];
    for extra in [
        &["--dapr-grpc-listen", "0.0.0.0:50001"][..],
        &["--dapr-grpc-listen", "[::ffff:10.1.2.3]:50001"],
        &["--dapr-grpc-listen", control],
        &["--dapr-grpc-listen", "127.0.0.1:50001", "--locks", "off"],
        &["--dapr-grpc-listen", "soon"],
        &["--dapr-grpc-listen", &taken],
    ] {
        let args = [&base[..], extra].concat();
        support::process::assert_invalid_config(&args, "--dapr-grpc-listen");
    }
}

mod in_process {
    //! No gRPC input panics the service: any message for any served method, and any bytes.

    use super::*;
    use proptest::prelude::*;
    use redlock_sidecar::locks::dapr::Runtime;
    use redlock_sidecar::locks::dapr_grpc::{self, DaprGrpc};
    use redlock_sidecar::locks::{self, Locks, RedlockEngine};
    use tower::ServiceExt;

    fn router() -> axum::Router {
        let nodes = vec!["redis://127.0.0.1:1".to_owned()];
        let cfg = support::engine_config(&nodes, "leader", "prop", Duration::from_secs(2));
        let metrics = redlock_sidecar::metrics::Metrics::new("leader", &nodes, None);
        let service = Locks::new(
            RedlockEngine::standalone(cfg, "app").expect("an engine"),
            4,
            metrics.app_locks().clone(),
        );
        let (_tx, leadership) = tokio::sync::watch::channel(
            redlock_sidecar::leadership::Leadership::new("leader", "prop"),
        );
        let runtime = Runtime::new(
            "prop",
            STORE,
            None,
            leadership,
            tokio_util::sync::CancellationToken::new(),
        );
        let api = locks::Api {
            locks: service,
            dapr_store: STORE.to_owned(),
        };
        dapr_grpc::router(DaprGrpc::new(api, runtime))
    }

    /// A gRPC frame holding `message`.
    fn frame(message: &[u8]) -> Vec<u8> {
        let mut framed = vec![0];
        framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
        framed.extend_from_slice(message);
        framed
    }

    fn message() -> impl Strategy<Value = Vec<u8>> {
        let text = || prop_oneof![Just(String::new()), Just(STORE.to_owned()), "\\PC{0,150}"];
        prop_oneof![
            (text(), text(), text(), any::<i32>()).prop_map(|(s, r, o, e)| {
                proto::TryLockRequest {
                    store_name: s,
                    resource_id: r,
                    lock_owner: o,
                    expiry_in_seconds: e,
                }
                .encode_to_vec()
            }),
            (text(), text(), text()).prop_map(|(s, r, o)| proto::UnlockRequest {
                store_name: s,
                resource_id: r,
                lock_owner: o,
            }
            .encode_to_vec()),
            prop::collection::vec(any::<u8>(), 0..64),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        #[test]
        fn no_grpc_input_panics_the_service(
            method in prop::sample::select(vec!["TryLockAlpha1", "UnlockAlpha1", "GetMetadata", "GetState"]),
            message in message(),
            framed in any::<bool>(),
        ) {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async {
                let body = if framed { frame(&message) } else { message.clone() };
                let request = http::Request::builder()
                    .method("POST")
                    .uri(format!("http://127.0.0.1/dapr.proto.runtime.v1.Dapr/{method}"))
                    .header("content-type", "application/grpc")
                    .header("te", "trailers")
                    .body(axum::body::Body::from(body))
                    .unwrap();
                // An answer, or still waiting on the closed port when the bound ends: never a panic.
                let Ok(response) = tokio::time::timeout(Duration::from_millis(500), router().oneshot(request)).await else {
                    return;
                };
                let response = response.unwrap();
                assert_eq!(response.status(), 200);
                if let Some(status) = tonic::Status::from_header_map(response.headers()) {
                    assert!(
                        matches!(
                            status.code(),
                            Code::InvalidArgument | Code::Internal | Code::Unimplemented | Code::OutOfRange | Code::ResourceExhausted
                        ),
                        "{method}: {status:?}"
                    );
                    // INTERNAL only for the store's failures (nothing answers on the closed
                    // port) and a compressed flag without an encoding, never for a message.
                    if status.code() == Code::Internal {
                        assert!(
                            status.message().starts_with("failed to try acquiring lock")
                                || status.message().contains("compressed-flag"),
                            "{method}: {status:?}"
                        );
                    }
                }
            });
        }
    }
}

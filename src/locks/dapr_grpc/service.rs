//! The methods served (`TryLockAlpha1`, `UnlockAlpha1`, `GetMetadata`) over the rules of
//! [`super::super::dapr`], and their statuses with Dapr's rich error details.

use std::collections::HashMap;
use std::sync::Arc;

use prost::Message;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tonic::{Code, Status};

use super::proto;
use super::proto::dapr_server::Dapr;
use crate::clock::Deadline;
use crate::locks::api::Api;
use crate::locks::dapr::{self, DaprError, Runtime, TryLocked};
use crate::locks::engine::LockEngine;

/// `google.rpc.Status`, as `grpc-status-details-bin` carries it.
#[derive(Clone, PartialEq, Message)]
pub struct RpcStatus {
    /// The gRPC status code (the same as the call's).
    #[prost(int32, tag = "1")]
    pub code: i32,
    /// The message (the same as the call's).
    #[prost(string, tag = "2")]
    pub message: String,
    /// The details.
    #[prost(message, repeated, tag = "3")]
    pub details: Vec<Any>,
}

/// `google.protobuf.Any`.
#[derive(Clone, PartialEq, Message)]
pub struct Any {
    /// `type.googleapis.com/<full message name>`.
    #[prost(string, tag = "1")]
    pub type_url: String,
    /// The message, encoded.
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

/// `google.rpc.ErrorInfo`.
#[derive(Clone, PartialEq, Message)]
pub struct RpcErrorInfo {
    /// `REDLOCK_…`.
    #[prost(string, tag = "1")]
    pub reason: String,
    /// [`dapr::ERROR_DOMAIN`].
    #[prost(string, tag = "2")]
    pub domain: String,
    /// Details such as the engine's error `kind`.
    #[prost(map = "string, string", tag = "3")]
    pub metadata: HashMap<String, String>,
}

/// `extras` as gRPC metadata (values that are no ASCII metadata are left out).
fn metadata(extras: Vec<(&'static str, String)>) -> MetadataMap {
    let mut map = MetadataMap::new();
    for (name, value) in extras {
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(name.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            map.insert(key, value);
        }
    }
    map
}

/// The gRPC status for `err`: daprd's code, the message, the reason in the metadata and, for a
/// store's failure, an `ErrorInfo` in the details.
pub fn status(err: &DaprError, extras: Vec<(&'static str, String)>) -> Status {
    let code = match err {
        DaprError::Malformed(_) | DaprError::StoreNotFound(_) => Code::InvalidArgument,
        DaprError::TooMany { .. } => Code::ResourceExhausted,
        DaprError::Unavailable(_) => Code::Internal,
    };
    let message = err.message();
    let Some(info) = err.info() else {
        return Status::with_metadata(code, message, metadata(extras));
    };
    let info = RpcErrorInfo {
        reason: info.reason.to_owned(),
        domain: dapr::ERROR_DOMAIN.to_owned(),
        metadata: info
            .metadata
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
    };
    let details = RpcStatus {
        code: code as i32,
        message: message.clone(),
        details: vec![Any {
            type_url: dapr::ERROR_INFO_TYPE.to_owned(),
            value: info.encode_to_vec(),
        }],
    };
    Status::with_details_and_metadata(
        code,
        message,
        details.encode_to_vec().into(),
        metadata(extras),
    )
}

/// `answer` with `extras` in its metadata.
fn answer<T>(message: T, extras: Vec<(&'static str, String)>) -> tonic::Response<T> {
    let mut response = tonic::Response::new(message);
    *response.metadata_mut() = metadata(extras);
    response
}

/// The methods of `dapr.proto.runtime.v1.Dapr` this sidecar serves.
pub struct DaprGrpc<E: LockEngine> {
    api: Arc<Api<E>>,
    runtime: Runtime,
}

impl<E: LockEngine> DaprGrpc<E> {
    /// Locks through `api`, described as `runtime`.
    pub fn new(api: Api<E>, runtime: Runtime) -> DaprGrpc<E> {
        DaprGrpc {
            api: Arc::new(api),
            runtime,
        }
    }

    /// The `GetMetadata` answer.
    pub fn metadata(&self) -> proto::GetMetadataResponse {
        proto::GetMetadataResponse {
            id: self.runtime.identity.clone(),
            registered_components: vec![proto::RegisteredComponents {
                name: self.runtime.store.clone(),
                r#type: dapr::STORE_TYPE.to_owned(),
                version: dapr::STORE_VERSION.to_owned(),
                capabilities: Vec::new(),
            }],
            extended_metadata: self
                .runtime
                .extended()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
            runtime_version: dapr::RUNTIME_VERSION.to_owned(),
            actor_runtime: Some(proto::ActorRuntime {
                runtime_status: proto::actor_runtime::ActorRuntimeStatus::Disabled as i32,
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

#[tonic::async_trait]
impl<E: LockEngine> Dapr for DaprGrpc<E> {
    async fn try_lock_alpha1(
        &self,
        request: tonic::Request<proto::TryLockRequest>,
    ) -> Result<tonic::Response<proto::TryLockResponse>, Status> {
        let request = request.into_inner();
        let found = dapr::try_lock(
            &self.api,
            &request.store_name,
            &request.resource_id,
            &request.lock_owner,
            i64::from(request.expiry_in_seconds),
        )
        .await;
        let extras = dapr::try_lock_extras(&found, Deadline::now());
        match found {
            Ok(found) => Ok(answer(
                proto::TryLockResponse {
                    success: matches!(found, TryLocked::Taken { .. }),
                },
                extras,
            )),
            Err(err) => Err(status(&err, extras)),
        }
    }

    async fn unlock_alpha1(
        &self,
        request: tonic::Request<proto::UnlockRequest>,
    ) -> Result<tonic::Response<proto::UnlockResponse>, Status> {
        let request = request.into_inner();
        let found = dapr::unlock_owned(
            &self.api,
            &request.store_name,
            &request.resource_id,
            &request.lock_owner,
        )
        .await;
        let extras = dapr::unlock_extras(&found);
        match found {
            // The same numbers in Dapr's enum and in its HTTP answer.
            Ok(unlocked) => Ok(answer(
                proto::UnlockResponse {
                    status: unlocked as i32,
                },
                extras,
            )),
            Err(err) => Err(status(&err, extras)),
        }
    }

    async fn get_metadata(
        &self,
        _request: tonic::Request<proto::GetMetadataRequest>,
    ) -> Result<tonic::Response<proto::GetMetadataResponse>, Status> {
        Ok(tonic::Response::new(self.metadata()))
    }
}

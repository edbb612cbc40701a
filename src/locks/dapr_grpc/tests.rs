use proptest::prelude::*;
use prost::Message;
use tonic::{Code, Status};

use super::*;
use crate::locks::dapr::{self, DaprError};

/// Decodes `bytes` as `U` as [`Codec`]'s decoder does.
fn decode<U: Message + Default>(bytes: &[u8]) -> Result<Option<U>, Status> {
    decode_message(bytes).map(Some)
}

#[test]
fn a_request_that_does_not_decode_is_an_invalid_argument() {
    let good = proto::TryLockRequest {
        store_name: "redlock".into(),
        resource_id: "order-1".into(),
        lock_owner: "vader".into(),
        expiry_in_seconds: 30,
    };
    assert_eq!(
        decode::<proto::TryLockRequest>(&good.encode_to_vec()).unwrap(),
        Some(good)
    );
    // A field's length past the end; a string that is not UTF-8; a bad wire type.
    for bad in [&[0x0a, 0x05, b'a'][..], &[0x12, 0x01, 0xff], &[0x0f]] {
        let err = decode::<proto::TryLockRequest>(bad).unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{bad:?}: {err:?}");
    }
}

#[test]
fn a_store_failure_carries_an_error_info_with_the_calls_code_and_message() {
    let err = DaprError::Unavailable(dapr::Unavailable::NoQuorum { kind: "no_quorum" });
    let status = status(&err, vec![(dapr::REASON, "no_quorum".into())]);
    assert_eq!(status.code(), Code::Internal);
    assert_eq!(
        status
            .metadata()
            .get(dapr::REASON)
            .and_then(|v| v.to_str().ok()),
        Some("no_quorum")
    );
    let details = RpcStatus::decode(status.details()).unwrap();
    assert_eq!(details.code, Code::Internal as i32);
    assert_eq!(details.message, status.message());
    assert_eq!(details.details[0].type_url, dapr::ERROR_INFO_TYPE);
    let info = RpcErrorInfo::decode(&*details.details[0].value).unwrap();
    assert_eq!(info.reason, "REDLOCK_NO_QUORUM");
    assert_eq!(info.domain, dapr::ERROR_DOMAIN);
    assert_eq!(
        info.metadata.get("kind").map(String::as_str),
        Some("no_quorum")
    );

    let refused = status_of_malformed();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.details().is_empty());
}

fn status_of_malformed() -> Status {
    status(
        &DaprError::Malformed("LockOwner is empty in lock store redlock".into()),
        Vec::new(),
    )
}

#[test]
fn an_unserved_method_is_told_what_is_served() {
    let status = unimplemented("/dapr.proto.runtime.v1.Dapr/GetState");
    assert_eq!(status.code(), Code::Unimplemented);
    for name in [
        "GetState",
        "TryLockAlpha1",
        "UnlockAlpha1",
        "GetMetadata",
        SERVICE,
    ] {
        assert!(status.message().contains(name), "{}", status.message());
    }
    let long = unimplemented(&"x".repeat(10_000));
    assert!(long.message().len() < 500);
}

proptest! {
    /// Any bytes decode as a request or are an INVALID_ARGUMENT; never a panic.
    #[test]
    fn any_bytes_decode_or_are_an_invalid_argument(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        for result in [
            decode::<proto::TryLockRequest>(&bytes).map(|_| ()),
            decode::<proto::UnlockRequest>(&bytes).map(|_| ()),
            decode::<proto::GetMetadataRequest>(&bytes).map(|_| ()),
        ] {
            if let Err(err) = result {
                prop_assert_eq!(err.code(), Code::InvalidArgument);
            }
        }
    }
}

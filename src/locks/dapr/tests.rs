use std::time::Duration;

use proptest::prelude::*;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::http::seconds;
use super::*;
use crate::clock::Deadline;
use crate::locks::bounds;
use crate::locks::service::Unlock;

#[test]
fn expiry_is_read_as_dapr_reads_it() {
    for (value, seconds_read) in [
        (json!(30), 30),
        (json!("30"), 30),
        (json!(30.0), 30),
        (json!("3e1"), 30),
        (json!(601), 601),
        (json!("3600"), 3600),
        (json!(3601), 3601),
        (json!(0), 0),
        (json!(-5), -5),
        (json!(null), 0),
    ] {
        assert_eq!(seconds(&value), Ok(seconds_read), "{value}");
    }
    for value in [
        json!(1.5),
        json!("soon"),
        json!(""),
        json!(true),
        json!([30]),
        json!(1u64 << 40),
        json!(-(1i64 << 40)),
        json!(1e300),
    ] {
        assert!(seconds(&value).is_err(), "{value}");
    }
}

#[test]
fn a_try_lock_is_checked_in_daprs_order_with_daprs_messages_then_up_to_an_hour() {
    let check =
        |store, resource, owner, expiry| check_try_lock("redlock", store, resource, owner, expiry);
    assert_eq!(check("redlock", "r", "o", 30), Ok(Duration::from_secs(30)));
    assert_eq!(check("redlock", "r", "o", 3600), Ok(bounds::MAX_TTL));
    // Dapr checks the expiry first, then the resource, the owner and the store.
    assert_eq!(
        check("other", "", "", 0),
        Err(DaprError::Malformed(
            "ExpiryInSeconds is not positive in lock store other".into()
        ))
    );
    assert_eq!(
        check("other", "", "", 5),
        Err(DaprError::Malformed(
            "ResourceId is empty in lock store other".into()
        ))
    );
    assert_eq!(
        check("other", "r", "", 5),
        Err(DaprError::Malformed(
            "LockOwner is empty in lock store other".into()
        ))
    );
    assert_eq!(
        check("other", "r", "o", 5),
        Err(DaprError::StoreNotFound("other".into()))
    );
    let long = check("redlock", "r", "o", 3601).unwrap_err();
    assert!(long.message().contains("at most 3600"), "{long:?}");
    for (resource, owner) in [("a b", "o"), ("r", &*"o".repeat(129)), ("r", "o\n")] {
        assert!(
            matches!(
                check("redlock", resource, owner, 5),
                Err(DaprError::Malformed(_))
            ),
            "{resource:?} {owner:?}"
        );
    }
}

#[test]
fn the_answers_say_what_dapr_has_no_field_for() {
    let now = Deadline::from_boottime(Duration::from_secs(100));
    let taken = Ok(TryLocked::Taken {
        fencing_token: 42,
        valid_until: now + Duration::from_millis(2500),
    });
    assert_eq!(
        try_lock_extras(&taken, now),
        vec![
            (FENCING_TOKEN, "42".to_owned()),
            (VALIDITY_MS, "2500".to_owned())
        ]
    );
    let held = Ok(TryLocked::Held {
        holder: Some("pod-b".into()),
    });
    assert_eq!(
        try_lock_extras(&held, now),
        vec![(REASON, "held".to_owned()), (HOLDER, "pod-b".to_owned())]
    );
    let not_ascii = Ok(TryLocked::Held {
        holder: Some("pöd".into()),
    });
    assert_eq!(
        try_lock_extras(&not_ascii, now),
        vec![(REASON, "held".to_owned())]
    );
    let no_quorum = Err(DaprError::Unavailable(Unavailable::NoQuorum {
        kind: "no_quorum",
    }));
    assert_eq!(
        try_lock_extras(&no_quorum, now),
        vec![(REASON, "no_quorum".to_owned())]
    );
    assert_eq!(
        unlock_extras(&Ok(Unlock::InternalError)),
        vec![(REASON, "unavailable".to_owned())]
    );
    assert!(unlock_extras(&Ok(Unlock::BelongsToOthers)).is_empty());
    assert!(try_lock_extras(&Err(DaprError::Malformed("x".into())), now).is_empty());
}

#[test]
fn a_store_failure_keeps_daprs_code_and_says_which_failure_it_is() {
    let err = DaprError::Unavailable(Unavailable::NoQuorum {
        kind: "node_set_conflict",
    });
    assert_eq!(err.error_code(), "ERR_TRY_LOCK_FAILED");
    assert_eq!(
        err.info(),
        Some(ErrorInfo {
            reason: "REDLOCK_NO_QUORUM",
            metadata: vec![("kind", "node_set_conflict".to_owned())]
        })
    );
    let down = DaprError::Unavailable(Unavailable::ShuttingDown);
    assert_eq!(down.error_code(), "ERR_TRY_LOCK_FAILED");
    assert_eq!(down.info().map(|i| i.reason), Some("REDLOCK_SHUTTING_DOWN"));
    assert_eq!(DaprError::Malformed("x".into()).info(), None);
}

#[test]
fn the_health_checks_answer_from_the_first_quorum_until_the_shutdown() {
    let (tx, rx) = tokio::sync::watch::channel(crate::leadership::Leadership::new("l", "me"));
    let closing = CancellationToken::new();
    let runtime = Runtime::new("me", "redlock", None, rx, closing.clone());
    assert!(runtime.serving().is_err(), "no round reached a quorum yet");
    tx.send_modify(|state| state.quorum_reachable = true);
    assert_eq!(runtime.serving(), Ok(()));
    // A quorum lost later: the lock calls say so, the health checks do not.
    tx.send_modify(|state| state.quorum_reachable = false);
    assert_eq!(runtime.serving(), Ok(()));
    closing.cancel();
    assert_eq!(runtime.serving(), Err("the sidecar is shutting down"));
}

#[test]
fn the_metadata_names_this_sidecar_and_its_store() {
    let (_tx, rx) = tokio::sync::watch::channel(crate::leadership::Leadership::new("l", "me"));
    let grpc = Some("127.0.0.1:50001".parse().unwrap());
    let runtime = Runtime::new("pod-a", "locks", grpc, rx, CancellationToken::new());
    let json = runtime.metadata_json();
    assert_eq!(json["id"], "pod-a");
    assert_eq!(json["runtimeVersion"], RUNTIME_VERSION);
    assert!(RUNTIME_VERSION.starts_with("redlock-sidecar/"));
    assert_eq!(json["components"][0]["name"], "locks");
    assert_eq!(json["components"][0]["type"], "lock.redlock-sidecar");
    assert_eq!(
        json["extended"]["redlock-sidecar.grpc-listen"],
        "127.0.0.1:50001"
    );
}

proptest! {
    /// Whatever a request holds, the checks answer (no panic), and a ttl comes out only
    /// for a request that Dapr's rules and this sidecar's bounds both take.
    #[test]
    fn the_checks_take_exactly_what_dapr_and_the_bounds_take(
        store in prop_oneof![Just("redlock".to_owned()), "\\PC{0,8}"],
        resource in prop_oneof![Just(String::new()), "\\PC{0,140}", "[a-z:-]{1,20}"],
        owner in prop_oneof![Just(String::new()), "\\PC{0,140}", "[a-z0-9-]{1,20}"],
        expiry in prop_oneof![any::<i64>(), -5i64..4000],
    ) {
        let checked = check_try_lock("redlock", &store, &resource, &owner, expiry);
        let takes = expiry > 0
            && store == "redlock"
            && bounds::name(&resource).is_ok()
            && bounds::owner(&owner).is_ok()
            && expiry <= 3600;
        prop_assert_eq!(checked.is_ok(), takes, "{:?}", checked);
        if let Ok(ttl) = checked {
            prop_assert_eq!(ttl, Duration::from_secs(expiry.unsigned_abs()));
        }
    }

    /// Every JSON value is read as seconds or refused, never a panic; a number within an
    /// int32 is read as itself.
    #[test]
    fn any_expiry_value_is_read_or_refused(n in any::<i64>(), f in any::<f64>(), text in "\\PC{0,12}") {
        let read = seconds(&json!(n));
        prop_assert_eq!(read.is_ok(), i32::try_from(n).is_ok());
        let _ = seconds(&json!(f));
        let _ = seconds(&json!(text));
    }
}

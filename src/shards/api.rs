//! `GET /v1/shards` on the control listener: the group and this member's shards.

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};

use super::ShardsRx;
use crate::clock::Deadline;

/// The route, answering from `rx` for the member `identity`.
pub fn router(rx: ShardsRx, identity: String) -> Router {
    Router::new()
        .route("/v1/shards", get(shards))
        .with_state((rx, identity))
}

/// The group's members, and each shard this member holds with its fencing token and the time
/// left before it stops acting on it (`validity_ms`, 0 once past).
async fn shards(State((rx, identity)): State<(ShardsRx, String)>) -> Json<Value> {
    Json(body(&rx.borrow(), &identity, Deadline::now()))
}

/// The answer's body at `now`.
pub fn body(snapshot: &super::Snapshot, identity: &str, now: Deadline) -> Value {
    let members: Vec<Value> = snapshot
        .members
        .iter()
        .map(|(identity, ready)| json!({"identity": identity, "ready": ready}))
        .collect();
    let owned: Vec<Value> = snapshot
        .owned
        .iter()
        .map(|(shard, owned)| {
            let left = owned.step_down_at.saturating_duration_since(now);
            json!({
                "shard": shard,
                "fencing_token": owned.token,
                "validity_ms": u64::try_from(left.as_millis()).unwrap_or(u64::MAX),
            })
        })
        .collect();
    json!({
        "identity": identity,
        "shards": snapshot.count,
        "members": members,
        "owned": owned,
        "refused": snapshot.refused,
    })
}

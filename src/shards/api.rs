//! The app's view of its shards, on the control listener: `GET /v1/shards` (the group and this
//! member's shards), `GET /v1/shards/watch` (server-sent events as they change) and
//! `POST /v1/shards/{shard}/ack` (the app stopped acting on a shard being revoked).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::WatchStream;

use super::{Owned, ShardsRx, Snapshot};
use crate::clock::Deadline;

/// The most `/v1/shards/watch` streams at once.
pub const MAX_WATCHERS: usize = 64;

/// How much earlier than the release a revoked shard's deadline is told to the app: it hears
/// of it a little late and counts from then, so the keys go only this long after the deadline
/// it was told (found by the shards model). Not kept when the deadline is now (no app
/// acknowledges): such an app stops at `revoked`, and fencing covers a late write.
pub const REVOKE_GRACE: Duration = Duration::from_millis(100);

/// What the app tells the member: whether it acknowledges revocations (a watch stream opened
/// with `?ack=true`: only then does the member wait for it) and which revoked shards it let
/// go.
pub struct AppSide {
    watchers: Arc<Semaphore>,
    /// Open watch streams that acknowledge.
    acking: AtomicUsize,
    acked: Mutex<BTreeSet<u32>>,
    notify: Notify,
}

/// An open watch stream that acknowledges, counted while it lives.
struct Acking(Arc<AppSide>);

impl Acking {
    fn new(app: &Arc<AppSide>) -> Acking {
        app.acking.fetch_add(1, Ordering::Relaxed);
        Acking(Arc::clone(app))
    }
}

impl Drop for Acking {
    fn drop(&mut self) {
        self.0.acking.fetch_sub(1, Ordering::Relaxed);
        // The member may be waiting for this stream's acknowledgements: they will not come.
        self.0.notify.notify_one();
    }
}

impl AppSide {
    pub fn new() -> Arc<AppSide> {
        Arc::new(AppSide {
            watchers: Arc::new(Semaphore::new(MAX_WATCHERS)),
            acking: AtomicUsize::new(0),
            acked: Mutex::new(BTreeSet::new()),
            notify: Notify::new(),
        })
    }

    /// Whether a `/v1/shards/watch?ack=true` stream is open: the app acknowledges revocations.
    pub fn acknowledges(&self) -> bool {
        self.acking.load(Ordering::Relaxed) > 0
    }

    /// The shards acknowledged since the last call.
    pub fn take_acks(&self) -> BTreeSet<u32> {
        std::mem::take(&mut *self.acked.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Completes when a shard is acknowledged or an acknowledging stream ends (at once if one
    /// did since the last wait).
    pub async fn acked(&self) {
        self.notify.notified().await;
    }

    fn ack(&self, shard: u32) {
        self.acked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(shard);
        self.notify.notify_one();
    }
}

#[derive(Clone)]
struct ApiState {
    rx: ShardsRx,
    identity: String,
    app: Arc<AppSide>,
}

/// The routes, answering from `rx` for the member `identity`, and telling `app`'s side.
pub fn router(rx: ShardsRx, identity: String, app: Arc<AppSide>) -> Router {
    Router::new()
        .route("/v1/shards", get(shards))
        .route("/v1/shards/watch", get(watch))
        .route("/v1/shards/{shard}/ack", post(ack))
        .with_state(ApiState { rx, identity, app })
}

/// The app stopped acting on a shard being revoked: the member releases it now. 404: not
/// held; 409: held, not being revoked.
async fn ack(State(state): State<ApiState>, path: Result<Path<u32>, PathRejection>) -> Response {
    let shard = match path {
        Ok(Path(shard)) => shard,
        Err(rejection) => {
            let error = format!("bad shard: {}", rejection.body_text());
            return (StatusCode::BAD_REQUEST, Json(json!({ "error": error }))).into_response();
        }
    };
    let revoking = state
        .rx
        .borrow()
        .owned
        .get(&shard)
        .map(|owned| owned.revoke_by.is_some());
    let (status, error) = match revoking {
        Some(true) => {
            state.app.ack(shard);
            return Json(json!({ "shard": shard, "acknowledged": true })).into_response();
        }
        Some(false) => (StatusCode::CONFLICT, "the shard is held, not being revoked"),
        None => (StatusCode::NOT_FOUND, "this member does not hold the shard"),
    };
    (status, Json(json!({ "shard": shard, "error": error }))).into_response()
}

async fn shards(State(state): State<ApiState>) -> Json<Value> {
    Json(body(&state.rx.borrow(), &state.identity, Deadline::now()))
}

/// A stream of events: `shards` first (the whole body, as `GET /v1/shards`), then `added`
/// (`{shard, fencing_token, validity_ms}`) when this member takes a shard, `revoking`
/// (`{shard, fencing_token, deadline_ms}`) when it is to give one up (the app stops acting on
/// it within `deadline_ms`), and `revoked` (`{shard}`) when it stops acting on one, before its
/// keys are released; the stream ends at shutdown, after every shard was revoked. With
/// `?ack=true` the app promises to acknowledge each `revoking` (`POST
/// /v1/shards/{shard}/ack`): while such a stream is open the member waits for that, up to
/// the deadline, before it releases the shard; otherwise the deadline is now.
async fn watch(State(state): State<ApiState>, RawQuery(query): RawQuery) -> Response {
    let acks = match acks_asked(query.as_deref()) {
        Ok(acks) => acks,
        Err(error) => {
            return (StatusCode::BAD_REQUEST, Json(json!({ "error": error }))).into_response()
        }
    };
    let Ok(slot) = state.app.watchers.clone().try_acquire_owned() else {
        let error = format!("too many /v1/shards/watch streams (at most {MAX_WATCHERS})");
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "error": error })),
        )
            .into_response();
    };
    let acking = acks.then(|| Acking::new(&state.app));
    // One reading for both, so the first diff starts where the body ends.
    let (first, mut last) = {
        let snapshot = state.rx.borrow();
        let first = body(&snapshot, &state.identity, Deadline::now());
        (first, snapshot.owned.clone())
    };
    let changes = WatchStream::from_changes(state.rx.clone()).flat_map(move |snapshot| {
        let events = changes(&last, &snapshot.owned, Deadline::now());
        last = snapshot.owned;
        futures_util::stream::iter(events)
    });
    let events = futures_util::stream::once(async move { ("shards", first) })
        .chain(changes)
        .map(move |(name, data)| {
            // The stream owns its slot and its promise: dropping the stream ends both.
            let _slot: &OwnedSemaphorePermit = &slot;
            let _acking: &Option<Acking> = &acking;
            Ok::<_, std::convert::Infallible>(Event::default().event(name).data(data.to_string()))
        });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// Whether a watch's query asks to acknowledge revocations: `ack=true` or `ack=1` (`false`,
/// `0` or no `ack`: not); anything else is an error.
fn acks_asked(query: Option<&str>) -> Result<bool, String> {
    let mut acks = false;
    for pair in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        acks = match pair.split_once('=').unwrap_or((pair, "true")) {
            ("ack", "true" | "1") => true,
            ("ack", "false" | "0") => false,
            _ => {
                return Err(format!(
                    "bad query {pair:?}: /v1/shards/watch takes only ack=true or ack=false"
                ))
            }
        };
    }
    Ok(acks)
}

/// The events from `before` to `after` at `now`: revocations first. Every `revoked` follows a
/// `revoking` of the same tenure: a shard marked and released between two readings of the
/// snapshot, or dropped at its step-down, gets one with a deadline of now.
pub fn changes(
    before: &BTreeMap<u32, Owned>,
    after: &BTreeMap<u32, Owned>,
    now: Deadline,
) -> Vec<(&'static str, Value)> {
    let mut events = Vec::new();
    for (shard, owned) in before {
        if after.get(shard).is_none_or(|now| now.token != owned.token) {
            if owned.revoke_by.is_none() {
                let at_once = Owned {
                    revoke_by: Some(now),
                    ..*owned
                };
                events.push(("revoking", revoking_json(*shard, &at_once, now)));
            }
            events.push(("revoked", json!({ "shard": shard })));
        }
    }
    for (shard, owned) in after {
        let was = before.get(shard).filter(|was| was.token == owned.token);
        if was.is_none() {
            events.push(("added", owned_json(*shard, owned, now)));
        }
        // Revoking: marked now, on the same tenure (a new tenure was announced just above).
        if owned.revoke_by.is_some() && was.is_none_or(|was| was.revoke_by.is_none()) {
            events.push(("revoking", revoking_json(*shard, owned, now)));
        }
    }
    events
}

fn ms(left: Duration) -> u64 {
    u64::try_from(left.as_millis()).unwrap_or(u64::MAX)
}

fn owned_json(shard: u32, owned: &Owned, now: Deadline) -> Value {
    let left = owned.step_down_at.saturating_duration_since(now);
    let mut body = json!({
        "shard": shard,
        "fencing_token": owned.token,
        "validity_ms": ms(left),
    });
    if let Some(by) = owned.revoke_by {
        body["revoking_deadline_ms"] = json!(ms(told_deadline(by, now)));
    }
    body
}

fn revoking_json(shard: u32, owned: &Owned, now: Deadline) -> Value {
    let by = owned.revoke_by.unwrap_or(owned.step_down_at);
    json!({
        "shard": shard,
        "fencing_token": owned.token,
        "deadline_ms": ms(told_deadline(by, now)),
    })
}

/// The time left, as the app is told it at `now`, of a revocation whose keys go at `by`:
/// [`REVOKE_GRACE`] less.
fn told_deadline(by: Deadline, now: Deadline) -> Duration {
    by.saturating_duration_since(now)
        .saturating_sub(REVOKE_GRACE)
}

/// The body of `GET /v1/shards` at `now`: the members, and each shard this member holds with
/// its fencing token and the time left before it stops acting on it (`validity_ms`). A shard
/// past its step-down instant is not listed, whether or not the member's loop has run since (a
/// process paused past it answers from the clock, not from its stale state).
pub fn body(snapshot: &Snapshot, identity: &str, now: Deadline) -> Value {
    let members: Vec<Value> = snapshot
        .members
        .iter()
        .map(|(identity, ready)| json!({"identity": identity, "ready": ready}))
        .collect();
    let owned: Vec<Value> = snapshot
        .owned
        .iter()
        .filter(|(_, owned)| owned.step_down_at > now)
        .map(|(shard, owned)| owned_json(*shard, owned, now))
        .collect();
    json!({
        "identity": identity,
        "shards": snapshot.count,
        "members": members,
        "owned": owned,
        "refused": snapshot.refused,
    })
}

#[cfg(test)]
mod tests {

    use super::*;

    fn owned(token: u64) -> Owned {
        Owned {
            token,
            step_down_at: Deadline::now() + Duration::from_secs(5),
            revoke_by: None,
        }
    }

    #[test]
    fn a_shard_past_its_step_down_is_not_listed_even_if_the_loop_has_not_dropped_it() {
        let now = Deadline::now();
        let snapshot = Snapshot {
            count: 2,
            owned: BTreeMap::from([
                (0, owned(7)),
                (
                    1,
                    Owned {
                        token: 8,
                        step_down_at: now,
                        revoke_by: None,
                    },
                ),
            ]),
            ..Snapshot::default()
        };
        let listed = body(&snapshot, "me", now);
        let shards: Vec<u64> = listed["owned"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["shard"].as_u64().unwrap())
            .collect();
        assert_eq!(shards, [0]);
    }

    #[test]
    fn a_shard_taken_again_is_revoked_then_added_and_a_renewal_is_no_event() {
        let before = BTreeMap::from([(1, owned(10)), (2, owned(20)), (3, owned(30))]);
        let mut after = before.clone();
        after.remove(&1);
        after.insert(3, owned(31));
        after.insert(4, owned(40));
        if let Some(two) = after.get_mut(&2) {
            two.step_down_at += Duration::from_secs(1);
        }
        let events: Vec<(&str, u64)> = changes(&before, &after, Deadline::now())
            .into_iter()
            .map(|(name, data)| (name, data["shard"].as_u64().unwrap()))
            .collect();
        assert_eq!(
            events,
            [
                ("revoking", 1),
                ("revoked", 1),
                ("revoking", 3),
                ("revoked", 3),
                ("added", 3),
                ("added", 4)
            ]
        );
    }

    #[test]
    fn a_watch_acknowledges_only_when_it_asks_and_other_queries_are_refused() {
        assert_eq!(acks_asked(None), Ok(false));
        assert_eq!(acks_asked(Some("")), Ok(false));
        assert_eq!(acks_asked(Some("ack=true")), Ok(true));
        assert_eq!(acks_asked(Some("ack")), Ok(true));
        assert_eq!(acks_asked(Some("ack=1&ack=0")), Ok(false));
        assert!(acks_asked(Some("ack=yes")).is_err());
        assert!(acks_asked(Some("wait=1s")).is_err());
        let app = AppSide::new();
        let stream = Acking::new(&app);
        assert!(app.acknowledges());
        drop(stream);
        assert!(!app.acknowledges());
    }

    #[test]
    fn a_shard_marked_for_revocation_is_revoking_once_with_its_deadline() {
        let now = Deadline::now();
        let before = BTreeMap::from([(1, owned(10)), (2, owned(20))]);
        let mut after = before.clone();
        if let Some(one) = after.get_mut(&1) {
            one.revoke_by = Some(now + Duration::from_millis(1500));
        }
        let events = changes(&before, &after, now);
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].0, "revoking");
        assert_eq!(events[0].1["shard"], 1);
        assert_eq!(events[0].1["fencing_token"], 10);
        assert_eq!(
            events[0].1["deadline_ms"], 1400,
            "the grace before the release"
        );
        assert!(changes(&after, &after, now).is_empty(), "announced once");
        // Released: `revoked` alone, its `revoking` already sent.
        let mut released = after.clone();
        released.remove(&1);
        let events = changes(&after, &released, now);
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].0, "revoked");
        let listed = body(
            &Snapshot {
                owned: after,
                ..Snapshot::default()
            },
            "me",
            now,
        );
        assert_eq!(listed["owned"][0]["revoking_deadline_ms"], 1400);
        assert!(listed["owned"][1].get("revoking_deadline_ms").is_none());
    }
}

//! `POST /v1/leader/resign`: its query (hold, successor), naming the successor on the nodes,
//! and the step-down it waits for.

use std::time::Duration;

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::json_error;
use crate::candidacy::{presence, CandidacyTx};
use crate::clock::{self, Deadline};
use crate::leadership::LeadershipRx;

/// What the control routes read and change.
#[derive(Clone)]
pub struct ControlState {
    /// The leadership channel (read).
    pub leadership: LeadershipRx,
    /// Whether this sidecar stands for leadership (written by a resign).
    pub candidacy: CandidacyTx,
    /// A resign's hold when the request names none: one ttl.
    pub default_hold: Duration,
}

/// The longest a resign waits for the lock loop to step down before it answers.
pub const RESIGN_ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// The shortest resign hold. A hold must outlast the lock loop's noticing it (else the loop
/// finds the hold over and leads on), and a sidecar that contends again at once wins the lock
/// back before a standby, woken by the release, has finished its round: `hold=0` would answer
/// "resigned" and change nothing, so it is refused.
pub const MIN_RESIGN_HOLD: Duration = Duration::from_secs(1);

pub(super) async fn resign(
    State(state): State<ControlState>,
    RawQuery(query): RawQuery,
) -> Response {
    let Resign { hold, to } = match resign_query(query.as_deref(), state.default_hold) {
        Ok(asked) => asked,
        Err(why) => return json_error(StatusCode::BAD_REQUEST, &why),
    };
    let Some(token) = state
        .leadership
        .borrow()
        .leading_at(Deadline::now())
        .map(|t| t.fencing_token)
    else {
        return json_error(StatusCode::CONFLICT, "not leading");
    };
    if let Some(to) = &to {
        if !state.candidacy.borrow().waits_as(to) {
            return json_error(
                StatusCode::NOT_FOUND,
                "no waiting candidate of this lock has that identity (see the other sidecars' /leader and redlock_candidacy)",
            );
        }
        if let Err(why) = name_successor(&state.candidacy, to).await {
            return json_error(StatusCode::SERVICE_UNAVAILABLE, why);
        }
    }
    state
        .candidacy
        .send_modify(|c| c.resign(hold, Deadline::now()));
    // Stepped down: not leading, or leading in a later tenure (after the hold) than the one
    // resigned from.
    let mut leadership = state.leadership.clone();
    let stepped_down = leadership.wait_for(|l| {
        l.leading_at(Deadline::now())
            .is_none_or(|t| t.fencing_token != token)
    });
    let stepped_down = matches!(
        clock::within(RESIGN_ANSWER_WITHIN, stepped_down).await,
        Ok(Ok(_))
    );
    if !stepped_down {
        return json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "still leading: the lock loop did not step down in time; the hold stands, see /leader",
        );
    }
    let hold_ms = u64::try_from(hold.as_millis()).unwrap_or(u64::MAX);
    (
        StatusCode::OK,
        Json(serde_json::json!({ "resigned": true, "hold_ms": hold_ms, "to": to })),
    )
        .into_response()
}

/// Announces `to` as the successor on the nodes (through the presence task), then gives the
/// other candidates a presence period to read it, so that they defer to it when the lock is
/// released; or why it could not be announced.
async fn name_successor(candidacy: &CandidacyTx, to: &str) -> Result<(), &'static str> {
    let mut changes = candidacy.subscribe();
    candidacy.send_modify(|c| c.hand_over_to(to));
    let announced = changes.wait_for(|c| c.successor_announced());
    match clock::within(RESIGN_ANSWER_WITHIN, announced).await {
        Ok(Ok(_)) => {}
        _ => return Err("the successor could not be announced on the nodes; still leading"),
    }
    clock::pause(presence::PERIOD + SUCCESSOR_READ_SLACK).await;
    Ok(())
}

/// A resign's query.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Resign {
    /// How long this sidecar does not contend.
    pub(super) hold: Duration,
    /// The waiting candidate to hand over to.
    pub(super) to: Option<String>,
}

/// A resign's query (`hold=DURATION`, `to=IDENTITY`, each at most once, nothing else), or why
/// it is refused.
pub(super) fn resign_query(query: Option<&str>, default: Duration) -> Result<Resign, String> {
    let mut asked = Resign {
        hold: default,
        to: None,
    };
    let (mut seen_hold, mut seen_to) = (false, false);
    for pair in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        match pair.split_once('=') {
            Some(("hold", text)) => {
                crate::locks::bounds::once("hold", &mut seen_hold)?;
                asked.hold = humantime::parse_duration(text)
                    .ok()
                    .filter(|d| (MIN_RESIGN_HOLD..=crate::config::MAX_APP_WAIT).contains(d))
                    .ok_or_else(|| {
                        "hold: a duration from 1s to 1h such as 30s or 2m (hold=0 is refused: \
                         contending again at once would win the lock back)"
                            .to_owned()
                    })?;
            }
            Some(("to", text)) => {
                crate::locks::bounds::once("to", &mut seen_to)?;
                let identity = percent_decode(text)
                    .filter(|id| {
                        !id.is_empty()
                            && id.len() <= MAX_IDENTITY_LEN
                            && !id.chars().any(char::is_control)
                    })
                    .ok_or_else(|| {
                        format!("to: a sidecar's identity, 1 to {MAX_IDENTITY_LEN} characters without control characters")
                    })?;
                asked.to = Some(identity);
            }
            _ => return Err("the query parameters are hold=DURATION and to=IDENTITY".to_owned()),
        }
    }
    Ok(asked)
}

/// Longest identity `to` may name (a pod name is at most 253 characters).
const MAX_IDENTITY_LEN: usize = 253;
/// What a candidate's reading of a newly named successor may take past a presence period.
const SUCCESSOR_READ_SLACK: Duration = Duration::from_millis(300);

/// `text` with `%XX` escapes (and `+` as a space) decoded, if it is valid UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = text.get(i + 1..i + 3)?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            byte => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

//! Whether this sidecar stands for leadership: its app's readiness, the other candidates,
//! and hand-overs.
//!
//! A lock held for a broken app stops the work it exists for: the healthy standbys wait, and
//! a Service that routes by the leader label sends traffic to the broken pod. But readiness
//! must decide *who* leads, never *whether* anyone does: an app that is ready only while it
//! leads, or a fleet whose apps all fail together (a shared database down), must still have a
//! leader. So the lock loop (`lease::run`) asks [`Candidacy`] before it contends and while it
//! leads. [`Candidacy`] is a pure decision over what the app's checks answered, what the other
//! candidates of the lock announced on the nodes (see [`presence`]) and the time; the checks
//! ([`probe`], the pod status), the presence task and the control listener's resign route feed
//! it through one `watch` channel.
//!
//! ## Behaviour
//! - **No check configured:** the app counts as ready.
//! - **Who is preferred.** Every candidate announces on the nodes whether its app is ready and
//!   when it started. A candidate is preferred over another if its app is ready and the other's
//!   is not; between equals, the younger one (started later: during a rolling update, a new
//!   pod rather than an old one that is terminated next), then the larger identity. A resign
//!   to a named successor makes that one preferred for a while ([`SUCCESSOR_LIFE`]).
//! - **Contending:** every candidate contends, whatever its app says (only a resign holds it
//!   back). One that a live waiting candidate is preferred over *defers*: each of its rounds
//!   starts a handicap later ([`handicap`]), so when the lock comes free the preferred one
//!   takes it first, and the others still take it a handicap later if it does not. So an app
//!   that is never ready, or ready only while leading, still gets a leader within a ttl (a
//!   crashed holder's key) plus the handicap; a SIGTERM hands over at once to the preferred
//!   standby.
//! - **Leading** survives failed answers of the app. Once they have failed for
//!   `--app-unready-after` (counted from the first failure of the current run), the leader
//!   steps down and releases at once, as on SIGTERM, **if a candidate whose app is ready is
//!   waiting**: that one takes over within milliseconds. With no ready candidate, the leader
//!   keeps the lock (leadership does not move among unready apps), and steps down as soon as
//!   one announces itself.
//! - **Unknown app state:** an answer that could not be had (the API server unreachable, RBAC
//!   not bound) leaves the last answer standing; once nothing could be read for twice
//!   `--app-unready-after`, the app counts as ready, as if no check were configured, with a
//!   warning (see `lease::run`) and the candidacy gauge saying so.
//! - **Resign** (`POST /v1/leader/resign?hold=D` on the control listener): a leader steps down
//!   and releases at once, and this sidecar does not contend again until `D` has passed.

pub mod presence;
pub mod probe;

use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::clock::{Clock, Deadline};

/// How long a resign's named successor stays preferred.
pub const SUCCESSOR_LIFE: Duration = Duration::from_secs(5);

/// One candidate of the lock, as announced on the nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Its identity.
    pub identity: String,
    /// Whether its app was ready (or counted as ready) when it last announced itself.
    pub ready: bool,
    /// When it started, in ms of the Unix epoch (its own clock).
    pub born_ms: u64,
}

impl Peer {
    /// The order of preference: ready first, then younger, then the larger identity.
    fn rank(&self) -> (bool, u64, &str) {
        (self.ready, self.born_ms, &self.identity)
    }
}

/// What the presence task last read from the nodes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Field {
    /// The other live candidates that wait (the holder is not one).
    pub peers: Vec<Peer>,
    /// A resign's named successor, if one is live.
    pub successor: Option<String>,
}

/// How much later than a preferred candidate's a deferring candidate's rounds start: long
/// enough for the preferred one's round (`node_timeout`, and waking up), short enough that a
/// preferred candidate that does not take the lock costs little.
pub fn handicap(node_timeout: Duration) -> Duration {
    node_timeout
        .saturating_mul(4)
        .max(Duration::from_millis(200))
}

/// This sidecar's standing, for the gauge, the logs and the answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// It contends (or leads).
    Contending,
    /// A preferred candidate is waiting: it lets that one take the lock first.
    Deferring,
    /// Its app is not ready (it still contends when no ready candidate is waiting).
    AppNotReady,
    /// The app's state could not be read for long: it counts as ready.
    AppStateUnknown,
    /// A resign holds it back.
    Resigned,
}

impl Standing {
    /// Every standing, for the gauge.
    pub const ALL: [Standing; 5] = [
        Standing::Contending,
        Standing::Deferring,
        Standing::AppNotReady,
        Standing::AppStateUnknown,
        Standing::Resigned,
    ];

    /// The gauge's label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Standing::Contending => "contending",
            Standing::Deferring => "deferring",
            Standing::AppNotReady => "app_not_ready",
            Standing::AppStateUnknown => "app_state_unknown",
            Standing::Resigned => "resigned",
        }
    }
}

/// What the app's checks said, what the other candidates announced, and what was asked of
/// this sidecar; changed only by events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidacy {
    /// How long a leader's app may fail before it yields to a ready candidate.
    unready_after: Duration,
    /// Whether a check of the app is configured.
    checked: bool,
    /// The app's last answer; `None` until its first.
    ready: Option<bool>,
    /// The first failure of the current run of failures.
    failing_since: Option<Deadline>,
    /// Since when the app's state could not be read (reset by any answer).
    unreadable_since: Option<Deadline>,
    /// No contending before this (a resign's hold).
    hold_until: Option<Deadline>,
    /// Who we are, and when we started (ms of the Unix epoch): our rank among the peers.
    me: Peer,
    /// The other candidates, as last read.
    field: Field,
    /// A resign's named successor, until the presence task has announced it.
    handing_to: Option<String>,
    /// The named successor has been announced on the nodes.
    successor_announced: bool,
}

impl Candidacy {
    /// Without any check of the app: always ready.
    pub fn unchecked() -> Candidacy {
        Candidacy {
            unready_after: Duration::MAX,
            checked: false,
            ready: Some(true),
            failing_since: None,
            unreadable_since: None,
            hold_until: None,
            me: Peer {
                identity: String::new(),
                ready: true,
                born_ms: 0,
            },
            field: Field::default(),
            handing_to: None,
            successor_announced: false,
        }
    }

    /// With a check of the app: not ready until its first ready answer.
    pub fn checked(unready_after: Duration) -> Candidacy {
        Candidacy {
            unready_after,
            checked: true,
            ready: None,
            ..Candidacy::unchecked()
        }
    }

    /// This sidecar's identity and start (ms of the Unix epoch), as the peers rank it.
    pub fn named(mut self, identity: &str, born_ms: u64) -> Candidacy {
        self.me.identity = identity.to_owned();
        self.me.born_ms = born_ms;
        self
    }

    /// The app answered at `now`.
    pub fn answered(&mut self, ready: bool, now: Deadline) {
        self.ready = Some(ready);
        self.unreadable_since = None;
        if ready {
            self.failing_since = None;
        } else {
            self.failing_since.get_or_insert(now);
        }
    }

    /// The app's state could not be read at `now`: the last answer stands, for a while.
    pub fn unreadable(&mut self, now: Deadline) {
        self.unreadable_since.get_or_insert(now);
    }

    /// Stand aside from `now` for `hold`.
    pub fn resign(&mut self, hold: Duration, now: Deadline) {
        self.hold_until = Some(now + hold);
    }

    /// What the presence task read from the nodes at `now`.
    pub fn saw(&mut self, field: Field) {
        self.field = field;
    }

    /// Whether `identity` is a live candidate waiting for the lock, as last read.
    pub fn waits_as(&self, identity: &str) -> bool {
        self.field
            .peers
            .iter()
            .any(|peer| peer.identity == identity)
    }

    /// A resign hands over to `identity`: the presence task announces it as the successor.
    pub fn hand_over_to(&mut self, identity: &str) {
        self.handing_to = Some(identity.to_owned());
        self.successor_announced = false;
    }

    /// The successor to announce, if one is named and not announced yet.
    pub fn handing_over(&self) -> Option<&str> {
        self.handing_to
            .as_deref()
            .filter(|_| !self.successor_announced)
    }

    /// The named successor was announced on the nodes (see [`presence::name_successor`]).
    pub fn announced_successor(&mut self) {
        self.successor_announced = true;
        self.handing_to = None;
    }

    /// Whether the successor named last has been announced.
    pub fn successor_announced(&self) -> bool {
        self.successor_announced
    }

    /// Whether a resign's hold keeps this sidecar from contending at `now` (it then announces
    /// nothing: it does not wait for the lock).
    pub fn resigned(&self, now: Deadline) -> bool {
        self.held(now)
    }

    /// Who we are, and whether our app counts as ready at `now`: what we announce.
    pub fn announced(&self, now: Deadline) -> Peer {
        Peer {
            ready: self.app_ready(now),
            ..self.me.clone()
        }
    }

    /// How long the app's state may stay unreadable before it counts as ready.
    fn unknown_after(&self) -> Duration {
        self.unready_after.saturating_mul(2)
    }

    /// Whether the app's state has been unreadable for too long at `now`.
    fn state_unknown(&self, now: Deadline) -> bool {
        self.unreadable_since
            .is_some_and(|since| now >= since + self.unknown_after())
    }

    /// Whether the app counts as ready at `now`.
    pub fn app_ready(&self, now: Deadline) -> bool {
        self.ready == Some(true) || self.state_unknown(now)
    }

    /// The live candidate preferred over us, if any (a named successor first).
    pub fn preferred_peer(&self, now: Deadline) -> Option<&str> {
        if let Some(successor) = &self.field.successor {
            if *successor != self.me.identity {
                return Some(successor);
            }
            return None;
        }
        let me = self.announced(now);
        self.field
            .peers
            .iter()
            .filter(|peer| peer.identity != me.identity && peer.rank() > me.rank())
            .max_by(|a, b| a.rank().cmp(&b.rank()))
            .map(|peer| peer.identity.as_str())
    }

    /// Whether a candidate whose app is ready waits besides us.
    fn ready_peer_waits(&self) -> bool {
        self.field.successor.is_some()
            || self
                .field
                .peers
                .iter()
                .any(|peer| peer.ready && peer.identity != self.me.identity)
    }

    /// Whether this sidecar may start contending at `now`.
    pub fn may_contend(&self, now: Deadline) -> bool {
        !self.held(now)
    }

    /// Whether this sidecar's rounds start a [`handicap`] late at `now`: a preferred
    /// candidate waits.
    pub fn defers(&self, now: Deadline) -> bool {
        self.preferred_peer(now).is_some()
    }

    /// Whether a leader may go on leading at `now`.
    pub fn may_lead(&self, now: Deadline) -> bool {
        let yields = self.failing_too_long(now) && self.ready_peer_waits();
        !self.held(now) && !yields
    }

    fn failing_too_long(&self, now: Deadline) -> bool {
        !self.state_unknown(now)
            && self
                .failing_since
                .is_some_and(|since| now >= since + self.unready_after)
    }

    /// The next instant after `now` at which a verdict may change without a new event.
    pub fn changes_at(&self, now: Deadline) -> Option<Deadline> {
        let unready = self.failing_since.map(|since| since + self.unready_after);
        let unknown = self
            .unreadable_since
            .map(|since| since + self.unknown_after());
        [unready, unknown, self.hold_until]
            .into_iter()
            .flatten()
            .filter(|&at| at > now)
            .min()
    }

    /// This sidecar's standing at `now`.
    pub fn standing(&self, now: Deadline) -> Standing {
        if self.held(now) {
            Standing::Resigned
        } else if self.defers(now) {
            Standing::Deferring
        } else if self.checked && self.state_unknown(now) {
            Standing::AppStateUnknown
        } else if !self.app_ready(now) {
            Standing::AppNotReady
        } else {
            Standing::Contending
        }
    }

    /// Why this sidecar does not contend or lead at `now`, for logs and answers.
    pub fn why_not(&self, now: Deadline) -> &'static str {
        if self.held(now) {
            "resigned"
        } else if self.failing_too_long(now) {
            "app not ready, and a ready candidate is waiting"
        } else {
            "app not ready"
        }
    }

    fn held(&self, now: Deadline) -> bool {
        self.hold_until.is_some_and(|until| now < until)
    }
}

/// The sending half: the app's checks and the resign route.
pub type CandidacyTx = watch::Sender<Candidacy>;
/// The receiving half: the lock loop.
pub type CandidacyRx = watch::Receiver<Candidacy>;

/// Waits until `verdict(candidacy, now)` holds, re-asking after every change and at every
/// instant a verdict may change; false if `cancel` fired first.
pub async fn until(
    rx: &mut CandidacyRx,
    cancel: &CancellationToken,
    verdict: impl Fn(&Candidacy, Deadline) -> bool,
) -> bool {
    loop {
        if cancel.is_cancelled() {
            return false;
        }
        let now = Deadline::now();
        let (holds, wake) = {
            let candidacy = rx.borrow_and_update();
            (verdict(&candidacy, now), candidacy.changes_at(now))
        };
        if holds {
            return true;
        }
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return false,
            changed = rx.changed() => {
                if changed.is_err() {
                    // Nobody can change it any more: only cancellation ends the wait.
                    cancel.cancelled().await;
                    return false;
                }
            }
            _ = Clock::Boot.sleep_until_some(wake) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AFTER: Duration = Duration::from_secs(5);

    fn at(t0: Deadline, s: f64) -> Deadline {
        t0 + Duration::from_secs_f64(s)
    }

    #[test]
    fn without_a_check_it_contends_and_leads_until_it_resigns() {
        let t0 = Deadline::from_boottime(Duration::from_secs(1_000));
        let mut c = Candidacy::unchecked();
        assert!(c.may_contend(t0) && c.may_lead(t0));
        assert_eq!(c.standing(t0), Standing::Contending);
        c.resign(Duration::from_secs(10), t0);
        assert!(!c.may_contend(at(t0, 9.9)) && !c.may_lead(at(t0, 9.9)));
        assert_eq!(c.why_not(t0), "resigned");
        assert_eq!(c.standing(t0), Standing::Resigned);
        assert_eq!(c.changes_at(t0), Some(at(t0, 10.0)));
        assert!(c.may_contend(at(t0, 10.0)));
        assert_eq!(c.changes_at(at(t0, 10.0)), None);
    }

    fn peer(identity: &str, ready: bool, born_ms: u64) -> Peer {
        Peer {
            identity: identity.into(),
            ready,
            born_ms,
        }
    }

    fn field(peers: Vec<Peer>) -> Field {
        Field {
            peers,
            successor: None,
        }
    }

    #[test]
    fn an_app_never_ready_still_contends_and_defers_only_to_a_preferred_candidate() {
        let t0 = Deadline::from_boottime(Duration::from_secs(1_000));
        let mut c = Candidacy::checked(AFTER).named("a", 10);
        assert!(c.may_contend(t0), "no answer yet, nobody else: contends");
        assert_eq!(c.standing(t0), Standing::AppNotReady);
        c.answered(false, t0);
        assert!(c.may_contend(t0) && !c.defers(t0));
        c.saw(field(vec![peer("b", false, 20), peer("c", false, 5)]));
        // b is younger, so preferred among the unready; c would defer to us.
        assert_eq!(c.preferred_peer(t0), Some("b"));
        assert!(c.may_contend(t0) && c.defers(t0));
        assert_eq!(c.standing(t0), Standing::Deferring);
        c.saw(field(vec![peer("c", false, 5)]));
        assert!(!c.defers(t0));
        assert_eq!(
            handicap(Duration::from_millis(50)),
            Duration::from_millis(200)
        );
        assert_eq!(handicap(Duration::from_millis(250)), Duration::from_secs(1));
    }

    #[test]
    fn a_ready_candidate_is_preferred_and_a_younger_one_among_equals() {
        let t0 = Deadline::from_boottime(Duration::from_secs(1_000));
        let mut old = Candidacy::checked(AFTER).named("old", 10);
        old.answered(true, t0);
        old.saw(field(vec![peer("new", true, 20)]));
        assert_eq!(
            old.preferred_peer(t0),
            Some("new"),
            "a rollout: the new pod"
        );
        old.saw(field(vec![peer("new", false, 20)]));
        assert_eq!(old.preferred_peer(t0), None, "ready first");
        let mut new = Candidacy::checked(AFTER).named("new", 20);
        new.answered(true, t0);
        new.saw(field(vec![peer("old", true, 10), peer("new", true, 20)]));
        assert_eq!(new.preferred_peer(t0), None, "itself is not a peer");
        new.saw(Field {
            successor: Some("old".into()),
            ..field(vec![peer("old", true, 10)])
        });
        assert_eq!(
            new.preferred_peer(t0),
            Some("old"),
            "a named successor first"
        );
    }

    #[test]
    fn a_leader_yields_after_unready_after_only_to_a_waiting_ready_candidate() {
        let t0 = Deadline::from_boottime(Duration::from_secs(1_000));
        let mut c = Candidacy::checked(AFTER).named("a", 10);
        c.answered(true, t0);
        c.answered(false, at(t0, 1.0));
        assert!(c.may_lead(at(t0, 5.9)));
        assert_eq!(c.changes_at(at(t0, 2.0)), Some(at(t0, 6.0)));
        assert!(c.may_lead(at(t0, 6.0)), "nobody ready waits: no churn");
        c.saw(field(vec![peer("b", false, 20)]));
        assert!(
            c.may_lead(at(t0, 7.0)),
            "an unready candidate does not take over"
        );
        c.saw(field(vec![peer("b", true, 5)]));
        assert!(!c.may_lead(at(t0, 7.0)), "a ready one does");
        assert_eq!(
            c.why_not(at(t0, 7.0)),
            "app not ready, and a ready candidate is waiting"
        );
        // Ready again: the count of failures starts over.
        c.answered(true, at(t0, 8.0));
        assert!(c.may_lead(at(t0, 8.0)));
        c.answered(false, at(t0, 9.0));
        assert!(c.may_lead(at(t0, 13.9)) && !c.may_lead(at(t0, 14.0)));
    }

    #[test]
    fn an_app_state_that_cannot_be_read_counts_as_ready_after_twice_unready_after() {
        let t0 = Deadline::from_boottime(Duration::from_secs(1_000));
        let mut c = Candidacy::checked(AFTER).named("a", 10);
        c.unreadable(t0);
        c.unreadable(at(t0, 5.0));
        assert!(!c.app_ready(at(t0, 9.9)));
        assert_eq!(c.changes_at(at(t0, 5.0)), Some(at(t0, 10.0)));
        assert!(c.app_ready(at(t0, 10.0)));
        assert_eq!(c.standing(at(t0, 10.0)), Standing::AppStateUnknown);
        assert!(c.announced(at(t0, 10.0)).ready);
        c.answered(false, at(t0, 11.0));
        assert!(!c.app_ready(at(t0, 11.0)), "an answer counts again");
    }

    #[tokio::test]
    async fn until_wakes_on_a_change_and_at_the_instant_a_verdict_flips() {
        let t0 = Deadline::now();
        let mut c = Candidacy::unchecked();
        c.resign(Duration::from_millis(50), t0);
        let (tx, mut rx) = watch::channel(c);
        let cancel = CancellationToken::new();
        assert!(until(&mut rx, &cancel, Candidacy::may_contend).await);
        assert!(Deadline::now() >= t0 + Duration::from_millis(50));
        tx.send_modify(|c| c.resign(Duration::from_secs(3600), Deadline::now()));
        let waiting = until(&mut rx, &cancel, Candidacy::may_contend);
        tokio::pin!(waiting);
        let early = crate::clock::within(Duration::from_millis(20), waiting.as_mut()).await;
        assert!(early.is_err(), "still held");
        cancel.cancel();
        assert!(!waiting.await);
    }
}

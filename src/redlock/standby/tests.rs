//! The standby's decisions over time, with no Redis and no clock.

use super::*;
use crate::redlock::fencing::MAX_TOKEN;

const TTL: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_secs(1);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A start well after boot, so that times before it exist too.
fn start() -> Deadline {
    Deadline::from_boottime(Duration::from_secs(1_000))
}

fn subscribed(n: usize) -> Standby {
    let mut s = Standby::new(n, n / 2 + 1, TTL, POLL);
    for i in 0..n {
        s.subscription(i, true);
    }
    s
}

#[test]
fn a_busy_round_sleeps_until_a_quorum_of_keys_may_have_expired() {
    let t0 = start();
    let mut s = subscribed(3);
    s.round_busy(t0, &[true, true, true], Some(ms(8000)), None, 0);
    assert_eq!(
        s.next(t0),
        (Action::Wait, Some(t0 + ms(8000) + CLOCK_DRIFT_FLOOR))
    );
    // Reads at the deadline show renewed keys: sleep again, no round.
    let t1 = t0 + ms(8002);
    s.read(t1, 0, Ok(Some(ms(7000))));
    s.read(t1, 1, Ok(Some(ms(9000))));
    s.read(t1, 2, Ok(Some(ms(6000))));
    // Quorum 2 of 3 held: free only once two have expired: the 2nd earliest.
    assert_eq!(
        s.next(t1),
        (Action::Wait, Some(t1 + ms(7000) + CLOCK_DRIFT_FLOOR))
    );
}

#[test]
fn a_crashed_holder_is_replaced_once_its_keys_are_read_gone() {
    let t0 = start();
    let mut s = subscribed(3);
    s.round_busy(t0, &[true, true, false], Some(ms(500)), None, 0);
    // The node that was free is read first.
    assert_eq!(s.next(t0), (Action::Read { fallback: false }, None));
    s.read(t0, 2, Ok(None));
    let (action, at) = s.next(t0);
    assert_eq!(action, Action::Wait);
    let at = at.unwrap();
    s.read(at, 0, Ok(None));
    s.read(at, 1, Ok(Some(ms(1))));
    assert_eq!(s.next(at), (Action::Round, None));
}

#[test]
fn a_failed_read_is_read_again_later_and_starts_no_round() {
    let t0 = start();
    let mut s = subscribed(3);
    s.round_busy(t0, &[true, true, true], Some(ms(5000)), None, 0);
    // Every read fails (a slow node, a busy client): no round, read again after a poll.
    for i in 0..3 {
        s.read(t0, i, Err(()));
    }
    s.settle(t0, 0.0, false);
    assert_eq!(
        s.next(t0),
        (Action::Wait, Some(t0 + POLL + CLOCK_DRIFT_FLOOR))
    );
    // Two nodes answer free: a round, whatever the third says.
    let t1 = t0 + POLL + CLOCK_DRIFT_FLOOR;
    s.read(t1, 0, Ok(None));
    s.read(t1, 1, Ok(None));
    s.read(t1, 2, Err(()));
    s.settle(t1, 0.0, false);
    assert_eq!(s.next(t1), (Action::Round, None));
}

#[test]
fn a_failed_read_delays_the_round_by_at_most_a_poll() {
    let t0 = start();
    let mut s = subscribed(3);
    s.round_busy(t0, &[true, true, true], Some(ms(500)), None, 0);
    let at = t0 + ms(500) + CLOCK_DRIFT_FLOOR;
    // The holder crashed: one node reads free, one still shows a key, one fails.
    s.read(at, 0, Ok(None));
    s.read(at, 1, Ok(Some(ms(5000))));
    s.read(at, 2, Err(()));
    s.settle(at, 0.0, false);
    assert_eq!(
        s.next(at),
        (Action::Wait, Some(at + POLL + CLOCK_DRIFT_FLOOR))
    );
}

#[test]
fn a_release_schedules_a_spread_round_and_an_acquisition_stands_it_down() {
    let t0 = start();
    let mut s = subscribed(3);
    s.set_waiters(t0, 1000);
    s.round_busy(t0, &[true, true, true], Some(TTL), Some("a"), 7);
    assert!(s.released(t0, 0, "a", 0.5));
    // The 999 others × 250 µs (under the 250 ms cap); half of it.
    let half = SPREAD_SLOT * 999 / 2;
    assert_eq!(s.next(t0), (Action::Wait, Some(t0 + half)));
    // Another node's copy of the same release does not move it.
    assert!(s.released(t0, 1, "a", 0.0));
    assert_eq!(s.next(t0), (Action::Wait, Some(t0 + half)));
    assert_eq!(s.next(t0 + half), (Action::Round, None));
    // The winner's announcement arrives first: no round, held for its validity.
    let announced = Announced {
        identity: "b".into(),
        fencing_token: 8,
    };
    assert!(s.acquired(t0 + ms(1), announced.clone(), ms(9000)));
    assert_eq!(
        s.next(t0 + ms(1)),
        (Action::Wait, Some(t0 + ms(9001) + CLOCK_DRIFT_FLOOR))
    );
    // The same announcement from another node is not news.
    assert!(!s.acquired(t0 + ms(2), announced, ms(9000)));
    // A late copy of the old holder's release changes nothing.
    assert!(!s.released(t0 + ms(2), 2, "a", 0.0));
    assert_eq!(s.next(t0 + ms(2)).0, Action::Wait);
}

#[test]
fn a_release_is_spread_over_those_it_wakes_not_over_every_waiter() {
    let t0 = start();
    let mut s = subscribed(1);
    s.set_waiters(t0, 1000);
    s.set_release_watchers(0);
    assert!(s.released(t0, 0, "a", 1.0));
    // Release watchers not counted (yet): every waiter may have heard it (the 999 others).
    assert_eq!(s.next(t0), (Action::Wait, Some(t0 + SPREAD_SLOT * 999)));
    let mut s = subscribed(1);
    s.set_waiters(t0, 1000);
    s.set_release_watchers(READERS);
    assert!(s.released(t0, 0, "a", 1.0));
    assert_eq!(
        s.next(t0),
        (Action::Wait, Some(t0 + SPREAD_SLOT * (READERS as u32 - 1)))
    );
}

#[test]
fn about_readers_contenders_subscribe_to_releases() {
    assert!(
        watches_releases(false, 0, 0.99),
        "a failed count subscribes"
    );
    assert!(watches_releases(false, READERS - 1, 0.99));
    assert!(!watches_releases(false, READERS, 0.0));
    assert!(!watches_releases(false, 10_000, 0.0), "never joins a crowd");
    assert!(watches_releases(true, READERS, 0.99), "exactly enough stay");
    assert!(!watches_releases(true, READERS + 1, 0.99));
    // Too many (they started at once): each stays with chance READERS / watchers.
    let watchers = 8 * READERS;
    let stay = (0..1000)
        .filter(|i| watches_releases(true, watchers, f64::from(*i) / 1000.0))
        .count();
    assert_eq!(stay, 125);
}

#[test]
fn watchers_count_again_within_a_ttl_and_then_every_few() {
    assert_eq!(release_recheck_in(TTL, true, 0.0), TTL / 2);
    assert_eq!(release_recheck_in(TTL, true, 1.0), TTL * 3 / 2);
    assert_eq!(release_recheck_in(TTL, false, 0.5), TTL * 3);
    assert_eq!(release_recheck_in(TTL, false, 7.0), TTL * 9 / 2);
}

#[test]
fn a_lone_waiter_starts_at_once_and_the_spread_is_capped() {
    let t0 = start();
    let mut s = subscribed(1);
    s.set_waiters(t0, 1);
    assert!(s.released(t0, 0, "a", 1.0));
    assert_eq!(s.next(t0), (Action::Round, None));
    let mut s = subscribed(1);
    s.set_waiters(t0, 2);
    assert!(s.released(t0, 0, "a", 1.0));
    assert_eq!(s.next(t0), (Action::Wait, Some(t0 + SPREAD_SLOT)));
    let mut s = subscribed(1);
    s.set_waiters(t0, 1_000_000);
    assert!(s.released(t0, 0, "a", 1.0));
    assert_eq!(s.next(t0), (Action::Wait, Some(t0 + SPREAD_MAX)));
}

#[test]
fn keyspace_events_move_the_deadline_without_reads() {
    let t0 = start();
    let mut s = subscribed(1);
    s.round_busy(t0, &[true], Some(ms(3000)), None, 0);
    let renewal = t0 + ms(2000);
    s.key_event(renewal, 0, KeyEvent::Written);
    assert_eq!(
        s.next(renewal),
        (Action::Wait, Some(renewal + TTL + CLOCK_DRIFT_FLOOR))
    );
    s.key_event(renewal + ms(5), 0, KeyEvent::Gone);
    assert_eq!(s.next(renewal + ms(5)), (Action::Round, None));
}

#[test]
fn keyspace_events_alone_put_the_read_off_by_at_most_three_ttls() {
    let t0 = start();
    let mut s = subscribed(1);
    s.round_busy(t0, &[true], Some(ms(3000)), None, 0);
    // A write event every second (renewals, or forged ones).
    let mut at = t0;
    while s.next(at).0 == Action::Wait {
        s.key_event(at, 0, KeyEvent::Written);
        at += ms(1000);
    }
    assert_eq!(at, t0 + TTL * 3 + ms(1000));
    s.read(at, 0, Ok(Some(ms(9000))));
    s.key_event(at, 0, KeyEvent::Written);
    assert_eq!(
        s.next(at),
        (Action::Wait, Some(at + TTL + CLOCK_DRIFT_FLOOR))
    );
}

#[test]
fn without_any_subscription_the_nodes_are_polled() {
    let t0 = start();
    let mut s = Standby::new(1, 1, TTL, POLL);
    assert_eq!(s.next(t0), (Action::Read { fallback: true }, None));
    s.read(t0, 0, Ok(Some(ms(9000))));
    assert_eq!(s.next(t0), (Action::Wait, Some(t0 + POLL)));
    s.subscription(0, true);
    // A subscription that comes up may have missed a release: read once more.
    assert_eq!(s.next(t0), (Action::Read { fallback: false }, None));
    s.read(t0, 0, Ok(Some(ms(9000))));
    assert_eq!(
        s.next(t0),
        (Action::Wait, Some(t0 + ms(9000) + CLOCK_DRIFT_FLOOR))
    );
    s.subscription(0, false);
    assert_eq!(s.next(t0 + POLL), (Action::Read { fallback: true }, None));
    // The read on resubscription is one made for want of push.
    s.read(t0 + POLL, 0, Ok(Some(ms(9000))));
    s.subscription(0, true);
    assert_eq!(s.next(t0 + POLL), (Action::Read { fallback: true }, None));
}

#[test]
fn a_round_called_for_by_reads_is_spread_over_the_waiters() {
    let t0 = start();
    let mut s = subscribed(1);
    s.set_waiters(t0, 100);
    s.round_busy(t0, &[true], Some(ms(1000)), Some("a"), 1);
    s.settle(t0, 0.5, false);
    assert_eq!(s.next(t0).0, Action::Wait);
    let at = t0 + ms(1000) + CLOCK_DRIFT_FLOOR;
    s.read(at, 0, Ok(None));
    s.settle(at, 0.5, false);
    // The 99 other waiters × 250 µs, half of it.
    assert_eq!(
        s.next(at),
        (Action::Wait, Some(at + Duration::from_micros(12_375)))
    );
    assert_eq!(s.next(at + ms(13)), (Action::Round, None));
}

/// Reads every node at `at`, each showing a key that lives `pttl` longer.
fn read_all(s: &mut Standby, at: Deadline, pttl: Duration) {
    for i in 0..3 {
        s.read(at, i, Ok(Some(pttl)));
    }
}

#[test]
fn with_many_waiters_a_standby_reads_by_turns_and_follows_its_drawn_read() {
    let t0 = start();
    let mut s = subscribed(3);
    s.set_waiters(t0, 10_000);
    s.round_busy(t0, &[true, true, true], Some(ms(8000)), None, 0);
    // Its first deadline is read (a standby starts on its turn), and then followed.
    let d1 = t0 + ms(8000) + CLOCK_DRIFT_FLOOR;
    assert_eq!(s.next(d1), (Action::Read { fallback: false }, None));
    read_all(&mut s, d1, ms(8000));
    s.turn_taken(0.99);
    let d2 = d1 + ms(8000) + CLOCK_DRIFT_FLOOR;
    assert_eq!(s.next(d1), (Action::Wait, Some(d2)));
    assert_eq!(s.next(d2), (Action::Read { fallback: false }, None));
    read_all(&mut s, d2, ms(8000));
    // Not drawn (0.99 × 10,000 waiters ≥ READERS): the next deadline is skipped, and the
    // keys are taken for renewed at the pace of the last read.
    s.turn_taken(0.99);
    let d3 = d2 + ms(8000) + CLOCK_DRIFT_FLOOR;
    assert_eq!(s.next(d3), (Action::Skip, None));
    s.skip(d3, 0.99);
    let d4 = d3 + (d3 - d2);
    assert_eq!(s.next(d3), (Action::Wait, Some(d4)));
    assert_eq!(s.next(d4), (Action::Skip, None));
    // Drawn (0.001 × 10,000 < READERS): read.
    s.skip(d4, 0.001);
    let (action, at) = s.next(d4);
    assert_eq!(action, Action::Wait);
    assert_eq!(
        s.next(at.unwrap()),
        (Action::Read { fallback: false }, None)
    );
}

#[test]
fn with_few_waiters_every_deadline_is_read() {
    let t0 = start();
    let mut s = subscribed(3);
    s.set_waiters(t0, READERS);
    s.round_busy(t0, &[true, true, true], Some(ms(8000)), None, 0);
    let mut at = t0 + ms(8000) + CLOCK_DRIFT_FLOOR;
    for _ in 0..5 {
        assert_eq!(s.next(at), (Action::Read { fallback: false }, None));
        read_all(&mut s, at, ms(8000));
        s.turn_taken(1.0);
        at += ms(8000) + CLOCK_DRIFT_FLOOR;
    }
}

#[test]
fn a_standby_off_its_turn_still_reads_for_want_of_push_and_takes_a_release() {
    let t0 = start();
    let mut s = subscribed(3);
    s.set_waiters(t0, 10_000);
    s.round_busy(t0, &[true, true, true], Some(ms(8000)), None, 0);
    s.turn_taken(0.99);
    s.turn_taken(0.99);
    let d1 = t0 + ms(8000) + CLOCK_DRIFT_FLOOR;
    assert_eq!(s.next(d1), (Action::Skip, None));
    // A release reaches it by push: a round, turn or not.
    assert!(s.released(d1, 0, "a", 0.0));
    assert_eq!(s.next(d1), (Action::Round, None));
    // Without any live subscription, nothing is skipped.
    let mut s = subscribed(3);
    s.set_waiters(t0, 10_000);
    s.round_busy(t0, &[true, true, true], Some(ms(8000)), None, 0);
    s.turn_taken(0.99);
    s.turn_taken(0.99);
    for i in 0..3 {
        s.subscription(i, false);
    }
    assert_eq!(s.next(d1), (Action::Read { fallback: true }, None));
}

#[test]
fn the_waiters_are_counted_again_every_three_ttls_and_every_ttl_when_taking_turns() {
    let t0 = start();
    let mut s = subscribed(3);
    // No answer: tried again later.
    s.set_waiters(t0, 0);
    assert!(!s.recount_due(t0 + TTL));
    assert!(s.recount_due(t0 + TTL * 3));
    s.set_waiters(t0, 3);
    assert!(!s.recount_due(t0 + TTL * 3 - ms(1)));
    assert!(s.recount_due(t0 + TTL * 3));
    // However many were counted: a crowd that left silences reads for about a ttl.
    s.set_waiters(t0, 100 * READERS);
    assert!(!s.recount_due(t0 + TTL / 2 - ms(1)));
    assert!(s.recount_due(t0 + TTL / 2));
    s.set_waiters(t0 + TTL, 2);
    assert!(!s.recount_due(t0 + TTL * 3));
}

#[test]
fn taking_turns_a_round_called_for_by_reads_is_spread_over_the_readers_only() {
    let t0 = start();
    let mut s = subscribed(1);
    s.set_waiters(t0, 10_000);
    s.read(t0, 0, Ok(None));
    s.settle(t0, 1.0, false);
    assert_eq!(s.next(t0), (Action::Wait, Some(t0 + SPREAD_SLOT * 99)));
    // A keyspace event reaches every waiter: the whole spread.
    let mut s = subscribed(1);
    s.set_waiters(t0, 10_000);
    s.key_event(t0, 0, KeyEvent::Gone);
    s.settle(t0, 1.0, true);
    assert_eq!(s.next(t0), (Action::Wait, Some(t0 + SPREAD_MAX)));
}

#[test]
fn an_acquisition_announced_after_its_holders_release_does_not_stand_the_round_down() {
    let t0 = start();
    let mut s = subscribed(3);
    s.round_busy(t0, &[true, true, true], Some(TTL), None, 0);
    // "b" won, announced its acquisition and released at once; the release arrives
    // first (the announcement is sent apart and was late).
    assert!(s.released(t0, 0, "b", 0.0));
    let announced = Announced {
        identity: "b".into(),
        fencing_token: 9,
    };
    assert!(!s.acquired(t0 + ms(1), announced, ms(9000)));
    assert_eq!(s.next(t0 + ms(1)), (Action::Round, None));
    // Another holder's announcement still stands it down.
    let announced = Announced {
        identity: "c".into(),
        fencing_token: 10,
    };
    assert!(s.acquired(t0 + ms(2), announced, ms(9000)));
    assert_eq!(s.next(t0 + ms(2)).0, Action::Wait);
}

#[test]
fn keyspace_event_names() {
    assert_eq!(key_event("expired"), Some(KeyEvent::Gone));
    assert_eq!(key_event("expire"), Some(KeyEvent::Written));
    assert_eq!(key_event("incrby"), None);
}

mod announcements;

//! What announcements (of an acquisition, a holder, a validity) change in a standby's
//! decisions, and what false ones cannot.

use super::*;

/// An announcement of `identity` with `fencing_token`.
fn told(identity: &str, fencing_token: u64) -> Announced {
    Announced {
        identity: identity.into(),
        fencing_token,
    }
}

#[test]
fn an_announcement_that_is_not_news_changes_nothing() {
    let t0 = start();
    let mut s = subscribed(1);
    s.round_busy(t0, &[true], Some(ms(2000)), Some("a"), 100);
    let before = s.clone();
    // At or below the counter the round saw on the nodes: old news, whatever it claims.
    assert!(!s.acquired(t0, told("ghost", 0), Duration::MAX));
    assert!(!s.acquired(t0, told("ghost", 100), Duration::MAX));
    assert_eq!(s.next(t0), before.next(t0));
    // A round that reads and releases call for is not stood down by it.
    s.read(t0 + ms(2002), 0, Ok(None));
    s.settle(t0 + ms(2002), 0.0, false);
    assert!(!s.acquired(t0 + ms(2002), told("ghost", 1), TTL));
    assert_eq!(s.next(t0 + ms(2002)), (Action::Round, None));
}

#[test]
fn an_announced_validity_never_puts_a_read_past_the_keys_expiry_nor_past_a_ttl() {
    let t0 = start();
    let mut s = subscribed(3);
    s.round_busy(t0, &[true, true, true], Some(ms(500)), Some("a"), 100);
    // An hour claimed: the keys read expire in 500 ms, and they are read then.
    assert!(s.acquired(t0, told("ghost", MAX_TOKEN), Duration::from_secs(3600)));
    assert_eq!(
        s.next(t0),
        (Action::Wait, Some(t0 + ms(500) + CLOCK_DRIFT_FLOOR))
    );
    // After a release (nodes free): at most the longest ttl from the announcement.
    let mut s = subscribed(3);
    s.round_busy(t0, &[true, true, true], Some(ms(500)), Some("a"), 100);
    for i in 0..3 {
        assert!(s.released(t0, i, "a", 0.0));
    }
    assert!(s.acquired(t0, told("b", 101), Duration::from_secs(3600)));
    assert_eq!(
        s.next(t0),
        (Action::Wait, Some(t0 + TTL + CLOCK_DRIFT_FLOOR))
    );
}

#[test]
fn a_false_holder_is_forgotten_once_the_nodes_show_another_and_its_token_with_it() {
    let t0 = start();
    let mut s = subscribed(1);
    s.round_busy(t0, &[true], Some(ms(1000)), Some("a"), 100);
    assert!(s.acquired(t0, told("ghost", MAX_TOKEN), Duration::from_secs(3600)));
    let read = t0 + ms(1002);
    s.read(read, 0, Ok(Some(ms(2000))));
    s.shown(Some("a"));
    // Contradicted before anything confirmed it: no announcement is taken until a round.
    assert!(!s.acquired(read, told("b", 101), TTL));
    // The holder crashed: its key is read gone, and the round is not stood down.
    let gone = read + ms(2002);
    s.read(gone, 0, Ok(None));
    s.shown(None);
    s.settle(gone, 0.0, false);
    assert!(!s.acquired(gone, told("ghost", MAX_TOKEN), TTL));
    assert_eq!(s.next(gone), (Action::Round, None));
    // The round shows the real holder and counter: real tokens are news again.
    s.round_busy(gone, &[true], Some(ms(2000)), Some("b"), 101);
    assert!(s.acquired(gone, told("c", 102), TTL));
}

#[test]
fn a_forged_token_under_the_holders_name_does_not_make_the_next_holder_stale() {
    let t0 = start();
    let mut s = subscribed(1);
    s.round_busy(t0, &[true], Some(ms(1000)), Some("a"), 100);
    assert!(s.acquired(t0, told("a", MAX_TOKEN), TTL));
    // The nodes show "a": confirmed, but the token was never shown by a round.
    s.read(t0 + ms(1002), 0, Ok(Some(ms(2000))));
    s.shown(Some("a"));
    // "a" releases; the next holder's real token is news.
    assert!(s.released(t0 + ms(1500), 0, "a", 0.0));
    assert!(s.acquired(t0 + ms(1501), told("b", 101), TTL));
    // Or "a" crashed and "b" took over unannounced: the nodes show "b".
    let mut s = subscribed(1);
    s.round_busy(t0, &[true], Some(ms(1000)), Some("a"), 100);
    assert!(s.acquired(t0, told("a", MAX_TOKEN), TTL));
    s.read(t0 + ms(1002), 0, Ok(Some(ms(2000))));
    s.shown(Some("a"));
    s.read(t0 + ms(3004), 0, Ok(Some(ms(2000))));
    s.shown(Some("b"));
    assert!(s.acquired(t0 + ms(3005), told("c", 102), TTL));
}

#[test]
fn a_stream_of_false_announcements_puts_a_round_off_by_at_most_one_ttl() {
    for with_releases in [false, true] {
        let t0 = start();
        let mut s = subscribed(3);
        s.round_busy(t0, &[true, true, true], Some(ms(1000)), Some("a"), 100);
        // The holder crashed at t0; its keys are gone from `gone` on. Every 10 ms of it:
        // a false acquisition (a higher token each time), and, with releases, its release.
        let gone = t0 + ms(1000);
        let mut token = MAX_TOKEN - 10_000;
        let mut now = t0;
        let round = loop {
            assert!(now < gone + TTL * 3, "no round (releases: {with_releases})");
            token += 1;
            let name = format!("ghost-{token}");
            s.acquired(now, told(&name, token), Duration::from_secs(3600));
            s.settle(now, 1.0, true);
            if with_releases {
                s.released(now, (token % 3) as usize, &name, 1.0);
                s.settle(now, 1.0, true);
            }
            match s.next(now).0 {
                Action::Round => break now,
                Action::Read { .. } => {
                    let pttl = (now < gone).then(|| gone - now);
                    for i in 0..3 {
                        s.read(now, i, Ok(pttl));
                    }
                    s.shown(pttl.map(|_| "a"));
                    s.settle(now, 1.0, false);
                }
                Action::Skip | Action::Wait => {}
            }
            now += ms(10);
        };
        assert!(
            round <= gone + TTL + ms(50),
            "a round {:?} after the keys expired (releases: {with_releases})",
            round - gone
        );
    }
}

proptest::proptest! {
    /// Whatever anyone publishes (acquisitions and releases of any identity, token and
    /// validity, every 10 ms, and a fresh acquisition whenever a round is due), a standby
    /// runs a round within a ttl of its crashed holder's keys' expiry.
    #[test]
    fn no_announcements_put_a_round_off_past_a_ttl_after_the_keys_expire(
        messages in proptest::collection::vec(
            (proptest::bool::ANY, 0usize..6, 0u64..20_000, 0usize..3),
            0..1500,
        )
    ) {
        let names = ["a", "ghost", "b"];
        let t0 = start();
        let gone = t0 + ms(1000);
        let mut s = subscribed(3);
        s.round_busy(t0, &[true, true, true], Some(gone - t0), Some("a"), 100);
        let mut now = t0;
        for step in 0u64.. {
            proptest::prop_assert!(now <= gone + TTL * 3, "no round");
            if let Some((release, token, validity, name)) = messages.get(step as usize) {
                let name = names[*name];
                if *release {
                    s.released(now, (step % 3) as usize, name, 0.5);
                } else {
                    let token = [0, 99, 100, 101 + step, 1 << 40, MAX_TOKEN - 200_000 - step]
                        [*token];
                    s.acquired(now, told(name, token), ms(*validity));
                }
                s.settle(now, 0.5, true);
            }
            match s.next(now).0 {
                Action::Round if now >= gone => break,
                // Before the crash, a round finds "a" holding.
                Action::Round => {
                    s.round_busy(now, &[true, true, true], Some(gone - now), Some("a"), 100)
                }
                Action::Read { .. } => {
                    let pttl = (now < gone).then(|| gone - now);
                    for i in 0..3 {
                        s.read(now, i, Ok(pttl));
                    }
                    s.shown(pttl.map(|_| "a"));
                    s.settle(now, 0.5, false);
                }
                Action::Skip | Action::Wait => {}
            }
            if s.round_at.is_some() {
                // Above every token of the messages.
                let token = MAX_TOKEN - 100_000 + step;
                s.acquired(now, told("ghost", token), Duration::from_secs(3600));
            }
            now += ms(10);
        }
        let late = now.saturating_duration_since(gone);
        proptest::prop_assert!(
            late <= TTL + ms(50),
            "a round {:?} after the keys expired", late
        );
    }
}

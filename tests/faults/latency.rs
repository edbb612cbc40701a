//! Latency and jitter on the way to the nodes.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn latency_and_jitter_never_let_two_holders_in() {
    let cluster = ready_cluster(3, LIB_TTL);
    let mut proxies = Vec::new();
    for _ in 0..4 {
        proxies.push(proxies_for(&cluster).await);
    }
    let urls: Vec<Vec<String>> = proxies.iter().map(|p| urls_of(p)).collect();
    let fleet = LibFleet::start(
        "latency-lib",
        "lib",
        &urls,
        &[LibPlan::holding(), LibPlan::quick()],
        19,
    );
    // (nodes, fixed, jitter, how long) per phase; latency applies each way, the node timeout is
    // 50 ms: mild, then around the timeout, then a slow majority, then nothing in time at all.
    let ms = Duration::from_millis;
    let phases = [
        (vec![0, 1, 2], ms(1), ms(10), ms(2500)),
        (vec![0, 1, 2], ms(5), ms(30), ms(2500)),
        (vec![0, 1], ms(20), ms(20), ms(2000)),
        (vec![0, 1, 2], ms(150), ms(0), ms(2000)),
    ];
    let mut begun = Vec::new();
    for (phase, (nodes, fixed, jitter, lasting)) in phases.iter().enumerate() {
        for contender in &proxies {
            heal(contender);
            for &i in nodes {
                contender[i].set_latency(*fixed, *jitter);
            }
        }
        let from = Instant::now();
        if phase < 3 {
            // The next holder holds 2–4 × ttl, renewing under this latency.
            fleet.ctx.request_long();
        }
        // The fault's own duration.
        tokio::time::sleep(*lasting).await;
        begun.push((
            from,
            fleet.store().count_since(from, |r| r.kind == Kind::Begin),
        ));
    }
    for contender in &proxies {
        heal(contender);
    }
    let healed = Instant::now();
    next_session(
        fleet.store(),
        healed,
        None,
        LIB_TTL + TAKEOVER_SLACK,
        "the lock moves again once answers are timely",
    )
    .await;
    let ctx = fleet.stop().await;
    assert!(
        begun[0].1 > 0,
        "handoffs go on under mild latency: {begun:?}"
    );
    // Nothing answers within the node timeout in the last phase: no acquisition may succeed
    // (rounds already under way when it began are given the node timeout).
    let (last_from, _) = begun[3];
    let late_acquisitions = ctx.store.count_since(last_from + ms(200), |r| {
        r.kind == Kind::Begin && r.at < healed
    });
    assert_eq!(
        late_acquisitions, 0,
        "acquired without timely answers from a quorum"
    );
    let (_, row) = check(
        "latency + jitter, 4 phases up to 300 ms round trips",
        "4 library, own proxies",
        phases.len(),
        &ctx.store.records(),
        Mode::Strict,
        &[],
    );
    checker::report(vec![row]);
}

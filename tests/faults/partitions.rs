//! Holders cut off from a majority of the nodes.

use super::*;

/// Cuts one contender's proxies to `nodes` off: a blackhole (bytes held until healed, as TCP
/// would retransmit them) or refusal (open connections dropped, new ones reset).
pub(crate) fn cut_off(proxies: &[FaultProxy], nodes: &[usize], blackhole: bool) {
    for &i in nodes {
        if blackhole {
            proxies[i].blackhole(true);
        } else {
            proxies[i].refuse(true);
            proxies[i].drop_connections();
        }
    }
}

pub(crate) fn heal(proxies: &[FaultProxy]) {
    for proxy in proxies {
        proxy.heal();
    }
}

impl GuardFleet {
    /// The exit code of the finished run `identity`.
    pub(crate) fn exit_of(&self, identity: &str) -> Option<i32> {
        let slot = self.slots[Self::slot_of(identity)]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        slot.exits
            .iter()
            .find(|exit| exit.identity == identity)
            .map(|exit| exit.code)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn a_holder_cut_off_from_a_majority_stops_before_anyone_else_starts() {
    let cluster = ready_cluster(3, PROC_TTL);
    let rounds = 4;

    let mut guard_proxies = Vec::new();
    let mut lib_proxies = Vec::new();
    for _ in 0..3 {
        guard_proxies.push(proxies_for(&cluster).await);
        lib_proxies.push(proxies_for(&cluster).await);
    }
    let store = FencedStore::new();
    let server = StoreServer::start(store.clone()).await;
    // Sections of 2–4 × ttl: only renewals keep them legitimate, so a cut-off holder must stop
    // CMD, and the others must not.
    let guard_urls: Vec<Vec<String>> = guard_proxies.iter().map(|p| urls_of(p)).collect();
    let guards = GuardFleet::start(
        "part-guard",
        "guard",
        &guard_urls,
        server.port(),
        &LONG_SECTIONS,
        &[76],
    );
    let lib_urls: Vec<Vec<String>> = lib_proxies.iter().map(|p| urls_of(p)).collect();
    let fleet = LibFleet::start(
        "part-lib",
        "lib",
        &lib_urls,
        &[LibPlan::holding(), LibPlan::quick()],
        17,
    );

    let guard_part = async {
        for round in 0..rounds {
            let (_, who, _) =
                open_session(&store, PROC_TTL + TAKEOVER_SLACK, "a guard holds the lock").await;
            let slot = GuardFleet::slot_of(&who);
            guards.with_run(&who, GuardSlot::strike);
            cut_off(&guard_proxies[slot], &[0, 1], round % 2 == 0);
            let cut = Instant::now();
            next_session(
                &store,
                cut,
                Some(&who),
                PROC_TTL + TAKEOVER_SLACK,
                "a guard with a quorum takes over from the cut-off holder",
            )
            .await;
            support::wait_until_async(
                Duration::from_secs(5),
                "the cut-off guard stops CMD and exits 76",
                || async { guards.exit_of(&who).is_some() },
            )
            .await;
            assert_eq!(guards.exit_of(&who), Some(76), "{who} self-fenced");
            heal(&guard_proxies[slot]);
        }
    };
    let lib_part = async {
        for round in 0..rounds {
            // Every other round cuts off a holder of 2–4 × ttl that renewals carried so far.
            let (i, who, _) = if round % 2 == 1 {
                let (_, who, token) = long_section(&fleet, "a long library critical section").await;
                (fleet.index[&who], who, token)
            } else {
                support::wait_for_async(
                    LIB_TTL + TAKEOVER_SLACK,
                    "a library contender holds the lock",
                    || fleet.holder(),
                )
                .await
            };
            cut_off(&lib_proxies[i], &[1, 2], round % 2 == 1);
            let cut = Instant::now();
            next_session(
                fleet.store(),
                cut,
                Some(&who),
                LIB_TTL + TAKEOVER_SLACK,
                "a contender with a quorum takes over from the cut-off holder",
            )
            .await;
            // Some more handoffs among the others, then the network heals.
            tokio::time::sleep(Duration::from_millis(500)).await;
            heal(&lib_proxies[i]);
        }
    };
    tokio::join!(guard_part, lib_part);
    let healed = Instant::now();
    next_session(
        fleet.store(),
        healed,
        None,
        LIB_TTL + TAKEOVER_SLACK,
        "the library lock moves after the partitions heal",
    )
    .await;
    let exits = guards.stop().await;
    let ctx = fleet.stop().await;
    assert!(
        exits.iter().filter(|exit| exit.code == 76).count() >= rounds,
        "{exits:?}"
    );
    let (_, guard_row) = check(
        "holder cut off from 2 of 3 nodes (guard)",
        "3 guard, own proxies",
        rounds,
        &store.records(),
        Mode::Strict,
        &[],
    );
    let (_, lib_row) = check(
        "holder cut off from 2 of 3 nodes (library)",
        "4 library, own proxies",
        rounds,
        &ctx.store.records(),
        Mode::Strict,
        &[],
    );
    checker::report(vec![guard_row, lib_row]);
}

//! The soak: many handoffs under random faults.

use super::*;

/// `REDLOCK_SOAK=N`: N handoffs under random faults (default: a short run of 200, so the test
/// never skips). `REDLOCK_SOAK_SEED=S` replays the fault sequence of a run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn soak() {
    let env_num = |name: &str| {
        std::env::var(name).ok().map(|v| {
            v.parse::<u64>()
                .unwrap_or_else(|_| panic!("{name}={v} is not a number"))
        })
    };
    let long = env_num("REDLOCK_SOAK");
    let target = long.unwrap_or(200) as usize;
    let seed = env_num("REDLOCK_SOAK_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    // A fault every this many handoffs.
    let fault_every = if long.is_some() { 50 } else { 20 };
    println!("soak: {target} handoffs, a fault every {fault_every}, seed {seed} (replay with REDLOCK_SOAK_SEED={seed})");

    let (cluster, standbys) = ready_cluster_with_standbys(LIB_TTL).await;
    let addrs = cluster.lock().unwrap().addrs();
    let mut proxies = Vec::new();
    for _ in 0..4 {
        let mut own = Vec::new();
        for &addr in &addrs {
            own.push(FaultProxy::start(addr).await);
        }
        proxies.push(own);
    }
    let urls: Vec<Vec<String>> = proxies.iter().map(|p| urls_of(p)).collect();
    let fleet = LibFleet::start(
        "soak",
        "lib",
        &urls,
        &[LibPlan::quick(), LibPlan::quick(), LibPlan::holding()],
        seed,
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let mut injected: std::collections::BTreeMap<Fault, usize> = Default::default();
    let started = Instant::now();
    let mut next_fault = fault_every;
    let mut next_progress = 1000;
    loop {
        let handoffs = fleet.store().begins().saturating_sub(1);
        if handoffs >= target {
            break;
        }
        if long.is_some() && handoffs >= next_progress {
            eprintln!(
                "soak: {handoffs} handoffs, {} faults, {:.0?}",
                injected.values().sum::<usize>(),
                started.elapsed()
            );
            next_progress += 1000;
        }
        if handoffs < next_fault {
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        }
        // Every third fault strikes a critical section of 2–4 × ttl that renewals carry (each
        // one holds up the handoffs the soak counts for a few seconds).
        if injected.values().sum::<usize>() % 3 == 1 {
            long_section(&fleet, &format!("a long critical section (seed {seed})")).await;
        }
        let fault = FAULTS[rng.random_range(0..FAULTS.len())];
        inject(fault, &mut rng, &cluster, &proxies, &fleet, &standbys).await;
        *injected.entry(fault).or_default() += 1;
        // Liveness: once the fault is healed (and restarted nodes have been up for ttl + drift),
        // the lock moves again.
        next_session(
            fleet.store(),
            Instant::now(),
            None,
            LIB_TTL * 4 + TAKEOVER_SLACK,
            &format!("the lock moves again after {fault:?} (seed {seed})"),
        )
        .await;
        next_fault = fleet.store().begins().saturating_sub(1) + fault_every;
    }
    let ctx = fleet.stop().await;
    let faults: usize = injected.values().sum();
    let (a, row) = check(
        &format!("soak, seed {seed}"),
        "4 library, own proxies",
        faults,
        &ctx.store.records(),
        Mode::Strict,
        &ctx.crashes(),
    );
    // A pause's late write passes only while no newer token was accepted: the store's rule,
    // re-checked by the checker (rule 2) together with the token order (rule 1).
    let pauses = ctx.pauses();
    println!(
        "soak: {} handoffs in {:.1?}; faults {injected:?}; votes not counted (data age, eviction policy): {}; \
         holder pauses: {} (stale writes refused: {}); holder crashes: {}",
        a.handoffs(),
        started.elapsed(),
        ctx.votes.not_counted.load(Ordering::Relaxed),
        pauses.len(),
        pauses.iter().filter(|(_, _, accepted)| !accepted).count(),
        ctx.crashes().len()
    );
    println!("{}", checker::table(std::slice::from_ref(&row)));
    // Faults are due every `fault_every` handoffs after the last one healed; handoffs made
    // while a fault lasts count too, so there are fewer than target / fault_every.
    assert!(faults >= 3, "faults were injected: {injected:?}");
    checker::report(vec![row]);
}

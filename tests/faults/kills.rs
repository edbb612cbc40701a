//! Holders killed outright.

use super::*;

/// Kills (SIGKILL) the guard whose CMD holds the lock, and checks its successor came no sooner
/// than the killed holder's key expired on a quorum. Returns the crash instant, or `None` if the
/// session ended on its own before the kill landed.
pub(crate) async fn kill_guard_holder(
    guards: &GuardFleet,
    store: &FencedStore,
    cluster: &RedisCluster,
    lock: &str,
) -> Option<Instant> {
    let (begun, who, token) = open_session(
        store,
        LONGEST_SECTION + PROC_TTL + TAKEOVER_SLACK,
        "a guard holds the lock",
    )
    .await;
    // Into its critical section, then dead.
    tokio::time::sleep_until((begun + Duration::from_millis(100)).into()).await;
    let crash = Instant::now();
    let killed = guards.with_run(&who, |slot| {
        slot.strike();
        slot.current.as_mut().is_some_and(|run| run.proc.sigkill())
    });
    let read_at = Instant::now();
    let bound = block_in_place(|| earliest_takeover(cluster, lock));
    let ended_before = store.count_since(begun, |r| {
        r.who == who && r.token == token && r.kind == Kind::End && r.at < crash
    }) > 0;
    if killed != Some(true) || ended_before {
        return None;
    }
    let (next, next_who, _) = next_session(
        store,
        crash,
        Some(&who),
        PROC_TTL + TAKEOVER_SLACK,
        "another guard takes the lock after a crash",
    )
    .await;
    assert!(
        next + Duration::from_millis(5) >= read_at + bound,
        "{next_who} began {:?} after {who} was killed, but its key still had {bound:?} on a quorum",
        next - crash
    );
    Some(crash)
}

/// Kills (SIGKILL) the `run` sidecar that leads, and checks its successor came no sooner than its
/// key expired on a quorum. A new sidecar replaces it (the pod restarts).
pub(crate) async fn kill_run_leader(run: &mut RunFleet, cluster: &RedisCluster) -> Instant {
    let (i, who, _) =
        support::wait_for_async(PROC_TTL + TAKEOVER_SLACK, "a run sidecar leads", || {
            run.leader()
        })
        .await;
    let crash = Instant::now();
    let code = run.remove(i, libc::SIGKILL).await;
    assert_eq!(code, 128 + libc::SIGKILL);
    let read_at = Instant::now();
    let bound = block_in_place(|| earliest_takeover(cluster, &run.lock));
    run.add();
    let (next, next_who, _) = next_session(
        &run.store,
        crash,
        Some(&who),
        PROC_TTL + TAKEOVER_SLACK,
        "another run sidecar leads after a crash",
    )
    .await;
    assert!(
        next + Duration::from_millis(5) >= read_at + bound,
        "{next_who} led {:?} after {who} was killed, but its key still had {bound:?} on a quorum",
        next - crash
    );
    crash
}

/// Stops the `run` leader gracefully (its app first, then SIGTERM: native sidecars stop after the
/// app) and starts a replacement.
pub(crate) async fn retire_run_leader(run: &mut RunFleet) {
    let (i, who, _) =
        support::wait_for_async(PROC_TTL + TAKEOVER_SLACK, "a run sidecar leads", || {
            run.leader()
        })
        .await;
    let stopped = Instant::now();
    let code = run.remove(i, libc::SIGTERM).await;
    assert_eq!(code, 0, "{who} exits 0 on SIGTERM");
    run.add();
    next_session(
        &run.store,
        stopped,
        Some(&who),
        PROC_TTL,
        "a standby leads after a graceful release, before the key could expire",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn a_killed_holder_is_replaced_only_after_its_key_expires_without_overlap() {
    let cluster = ready_cluster(3, PROC_TTL);
    let urls = cluster.urls();

    let guard_store = FencedStore::new();
    let server = StoreServer::start(guard_store.clone()).await;
    // Half the sections are short, half last 2–4 × ttl.
    let sections = [
        SHORT_SECTION,
        LONG_SECTIONS[0],
        SHORT_SECTION,
        LONG_SECTIONS[1],
    ]
    .into_iter()
    .chain([SHORT_SECTION, LONG_SECTIONS[2]])
    .collect::<Vec<_>>();
    let guards = GuardFleet::start(
        "kill-guard",
        "guard",
        &vec![urls.clone(); 3],
        server.port(),
        &sections,
        // Killed, or done just before the kill landed.
        &[0, 128 + libc::SIGKILL],
    );
    let mut run = RunFleet::start("kill-run", "run", &urls, 3);

    let rounds = 3;
    let (mut guard_crashes, mut run_crashes, mut run_faults) = (Vec::new(), Vec::new(), 0);
    for _ in 0..rounds {
        let (guard_crash, run_crash) = tokio::join!(
            async {
                // A session can end on its own just as it is killed: try again then.
                for _ in 0..5 {
                    if let Some(crash) =
                        kill_guard_holder(&guards, &guard_store, &cluster, "kill-guard").await
                    {
                        return crash;
                    }
                }
                panic!("could not kill a guard inside its critical section");
            },
            async {
                let crash = kill_run_leader(&mut run, &cluster).await;
                retire_run_leader(&mut run).await;
                crash
            }
        );
        guard_crashes.push(guard_crash);
        run_crashes.push(run_crash);
        run_faults += 2;
    }
    // Long sections run to their end under renewals, and graceful handoffs go on.
    support::wait_until_async(
        LONGEST_SECTION * 3 + TAKEOVER_SLACK,
        "a section of 2–4 × ttl that no fault struck finishes",
        || async {
            guards
                .exits()
                .iter()
                .any(|exit| exit.long && !exit.struck && exit.code == 0)
        },
    )
    .await;
    next_session(
        &guard_store,
        Instant::now(),
        None,
        LONGEST_SECTION + TAKEOVER_SLACK,
        "guards go on",
    )
    .await;

    let guard_exits = guards.stop().await;
    let run_store = run.store.clone();
    let run_exits = run.stop().await;
    let killed = guard_exits
        .iter()
        .filter(|exit| exit.code == 128 + libc::SIGKILL)
        .count();
    assert_eq!(
        killed, rounds,
        "every killed guard shows SIGKILL: {guard_exits:?}"
    );
    // Every run no fault was aimed at exited 0 (checked by `stop`), long ones too.
    assert_eq!(
        run_exits.iter().filter(|(_, c)| *c == 0).count(),
        rounds + 3,
        "every retired sidecar exited 0: {run_exits:?}"
    );

    let (guard_a, guard_row) = check(
        "SIGKILL holder (guard)",
        "3 guard",
        rounds,
        &guard_store.records(),
        Mode::Strict,
        &guard_crashes,
    );
    let (run_a, run_row) = check(
        "SIGKILL / SIGTERM leader (run)",
        "3 run + app",
        run_faults,
        &run_store.records(),
        Mode::Strict,
        &run_crashes,
    );
    for a in [&guard_a, &run_a] {
        assert_eq!(
            a.crash_takeovers.len(),
            rounds,
            "a successor after every crash"
        );
        let slowest = checker::quantile(&a.crash_takeovers, 1.0).expect("takeovers");
        assert!(
            slowest <= PROC_TTL + TAKEOVER_SLACK,
            "liveness: {slowest:?}"
        );
        let release = checker::quantile(&a.release_takeovers, 1.0).expect("graceful handoffs");
        assert!(
            release < PROC_TTL,
            "a release hands over before any expiry: {release:?}"
        );
    }
    checker::report(vec![guard_row, run_row]);
}

//! Holders paused past their ttl: fencing catches their late writes.

use super::*;

/// Sends `sig` to process group `pgid` (guard's CMD leads its own group).
pub(crate) fn signal_group(pgid: u32, sig: libc::c_int) {
    let pgid = libc::pid_t::try_from(pgid).expect("pid fits");
    // SAFETY: kill(2) has no memory-safety preconditions; the group is CMD's, a descendant of
    // this test that is still running (it is stopped, not reaped).
    let rc = unsafe { libc::kill(-pgid, sig) };
    assert_eq!(rc, 0, "kill(-{pgid}, {sig})");
}

/// The value of `redlock_lock_lost_total{reason="…"}` in a metrics text.
pub(crate) fn lost_count(metrics: &str, reason: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("redlock_lock_lost_total") && l.contains(reason))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn a_holder_paused_past_its_ttl_is_caught_by_fencing() {
    let cluster = ready_cluster(3, PROC_TTL);
    let urls = cluster.urls();
    let pause = PROC_TTL + Duration::from_secs(1);
    let rounds = 2;

    // guard and CMD frozen together (a stopped VM, a stop-the-world pause of the whole pod).
    let guard_part = async {
        let store = FencedStore::new();
        let server = StoreServer::start(store.clone()).await;
        // CMD writes until it is stopped: only renewals keep it legitimate.
        let guards = GuardFleet::start(
            "pause-guard",
            "guard",
            &vec![urls.clone(); 2],
            server.port(),
            &[100_000],
            &[76, 92],
        );
        let mut paused_exits = Vec::new();
        for _ in 0..rounds {
            let (begun, who, token) =
                open_session(&store, PROC_TTL + TAKEOVER_SLACK, "a guard holds the lock").await;
            let cmd_pid = store
                .records()
                .iter()
                .find(|r| r.who == who && r.kind == Kind::Begin)
                .and_then(|r| r.pid)
                .expect("CMD sent its pid");
            let stopped = guards
                .with_run(&who, |slot| {
                    slot.frozen = true;
                    slot.strike();
                    let run = slot.current.as_mut().expect("current run");
                    run.proc.sigstop()
                })
                .expect("the holder's guard is running");
            assert!(stopped);
            // The whole pod stops: guard's helpers too (guard → watchdog → supervisor → CMD),
            // which would otherwise kill CMD at the step-down point (as they must when only
            // guard is stuck).
            let supervisor = support::proc_parent(cmd_pid).expect("CMD's supervisor");
            let watchdog = support::proc_parent(supervisor).expect("guard's watchdog");
            assert!(support::send_signal(watchdog, libc::SIGSTOP));
            assert!(support::send_signal(supervisor, libc::SIGSTOP));
            signal_group(cmd_pid, libc::SIGSTOP);
            // Paused holders keep their lock until it expires; then someone else gets it.
            let (next, next_who, _) = next_session(
                &store,
                begun,
                Some(&who),
                PROC_TTL + TAKEOVER_SLACK,
                "another guard takes over from a paused one",
            )
            .await;
            tokio::time::sleep_until((begun + pause).max(next).into()).await;
            // CMD wakes first and makes the write it was about to make.
            let woke = Instant::now();
            signal_group(cmd_pid, libc::SIGCONT);
            support::wait_until_async(
                Duration::from_secs(5),
                "the paused CMD writes after waking",
                || async {
                    store.count_since(woke, |r| {
                        r.who == who && r.token == token && r.kind != Kind::Gone
                    }) > 0
                },
            )
            .await;
            assert_eq!(
                store.count_since(woke, |r| r.who == who && r.kind != Kind::Gone && r.accepted),
                0,
                "{who}'s writes after its pause were refused ({next_who} holds a newer token)"
            );
            // Then its supervisor and guard wake, find the lock lost, and make sure CMD is gone.
            support::send_signal(supervisor, libc::SIGCONT);
            support::send_signal(watchdog, libc::SIGCONT);
            guards.with_run(&who, |slot| {
                let run = slot.current.as_mut().expect("current run");
                run.proc.sigcont();
                slot.frozen = false;
            });
            support::wait_until_async(
                Duration::from_secs(10),
                "the paused guard exits",
                || async { guards.with_run(&who, |_| ()).is_none() },
            )
            .await;
            paused_exits.push(who);
        }
        // The guard that took over last (no fault aimed at it) holds on for two validity
        // windows and more: renewals carry its critical section.
        let (begun, who, token) =
            open_session(&store, PROC_TTL + TAKEOVER_SLACK, "a guard holds the lock").await;
        support::wait_until_async(
            PROC_TTL * 3,
            "the last holder is still in its critical section after 2 × ttl",
            || async {
                assert!(
                    store.is_open(&who, token),
                    "{who}'s critical section ended after {:?}: {:?}",
                    begun.elapsed(),
                    guards.exits()
                );
                begun.elapsed() >= PROC_TTL * 2
            },
        )
        .await;
        let exits = guards.stop().await;
        for who in &paused_exits {
            let code = exits
                .iter()
                .find(|exit| exit.identity == *who)
                .expect("exit")
                .code;
            assert!(
                code == 76 || code == 92,
                "{who}: lock lost (76) or CMD's own exit on the refused write (92), got {code}"
            );
        }
        let (a, row) = check(
            "SIGSTOP holder past ttl (guard + CMD)",
            "2 guard",
            rounds,
            &store.records(),
            Mode::Fenced,
            &[],
        );
        assert!(a.stale_refused >= rounds, "every pause was caught: {a:?}");
        assert!(
            a.overlaps.iter().filter(|o| o.fenced).count() >= rounds,
            "the paused CMDs did run on (fenced, not prevented)"
        );
        row
    };

    // run sidecar frozen; its app stops trusting it when polls time out.
    let run_part = async {
        let mut run = RunFleet::start("pause-run", "run", &urls, 2);
        for _ in 0..rounds {
            let (i, who, _) =
                support::wait_for_async(PROC_TTL + TAKEOVER_SLACK, "a run sidecar leads", || {
                    run.leader()
                })
                .await;
            let addr = run.members[i].addr;
            assert!(run.members[i].proc.sigstop());
            let paused = Instant::now();
            next_session(
                &run.store,
                paused,
                Some(&who),
                PROC_TTL + TAKEOVER_SLACK,
                "another sidecar leads while the leader is frozen",
            )
            .await;
            tokio::time::sleep_until((paused + pause).into()).await;
            assert!(run.members[i].proc.sigcont());
            let first = support::http::get(addr, "/leader")
                .await
                .expect("the resumed sidecar answers");
            assert_eq!(
                first.status, 503,
                "a sidecar resumed after its term must not claim leadership: {}",
                first.body
            );
            support::wait_until_async(
                Duration::from_secs(5),
                "the resumed sidecar counts a lock lost to a pause",
                || async {
                    support::http::get(addr, "/metrics")
                        .await
                        .is_ok_and(|m| lost_count(&m.body, "reason=\"paused\"") >= 1)
                },
            )
            .await;
        }
        let store = run.store.clone();
        run.stop().await;
        let (_, row) = check(
            "SIGSTOP leader past ttl (run)",
            "2 run + app",
            rounds,
            &store.records(),
            Mode::Strict,
            &[],
        );
        row
    };

    // In-process holders that stop between their validity check and their write.
    let lib_part = async {
        let fleet = LibFleet::start(
            "pause-lib",
            "lib",
            &vec![urls.clone(); 3],
            &[LibPlan::quick()],
            7,
        );
        for round in 0..3 {
            *fleet.ctx.pause_request.lock().unwrap() = Some(LIB_TTL + Duration::from_millis(500));
            support::wait_until_async(
                LIB_TTL + TAKEOVER_SLACK,
                "a paused library holder wakes and writes",
                || async { fleet.ctx.pauses().len() > round },
            )
            .await;
        }
        let ctx = fleet.stop().await;
        for (who, token, accepted) in ctx.pauses() {
            assert!(
                !accepted,
                "{who}'s write with token {token} after its pause was refused"
            );
        }
        let (a, row) = check(
            "pause past validity (library)",
            "3 library",
            3,
            &ctx.store.records(),
            Mode::Strict,
            &[],
        );
        assert!(a.late_writes >= 3 && a.stale_refused >= 3, "{a:?}");
        row
    };

    let (guard_row, run_row, lib_row) = tokio::join!(guard_part, run_part, lib_part);
    checker::report(vec![guard_row, run_row, lib_row]);
}

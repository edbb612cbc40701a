//! The checker and the fenced store themselves.

use super::*;

pub(crate) fn record(
    base: Instant,
    ms: u64,
    who: &str,
    token: u64,
    kind: Kind,
    accepted: bool,
    deadline_ms: Option<u64>,
) -> Record {
    Record {
        at: base + Duration::from_millis(ms),
        who: who.to_owned(),
        token,
        kind,
        accepted,
        deadline: deadline_ms.map(|d| base + Duration::from_millis(d)),
        pid: None,
    }
}

#[test]
pub(crate) fn the_checker_flags_overlaps_token_regressions_and_refused_writes() {
    let base = Instant::now();
    // a holds 0..10 and b begins at 5 with a greater token; the log claims a's write at 8 was
    // accepted (a broken store): an unfenced overlap, a failed store self-check, and a's refused
    // end within its validity.
    let overlapping = [
        record(base, 0, "a", 10, Kind::Begin, true, None),
        record(base, 5, "b", 11, Kind::Begin, true, None),
        record(base, 8, "a", 10, Kind::Write, true, None),
        record(base, 10, "a", 10, Kind::End, false, None),
        record(base, 12, "b", 11, Kind::End, true, None),
    ];
    let strict = analyse(&overlapping, Mode::Strict, &[]);
    assert_eq!(strict.overlaps.len(), 1, "{strict:?}");
    assert!(!strict.overlaps[0].fenced, "a wrote inside the overlap");
    assert!(
        strict.violations.iter().any(|v| v.contains("overlapped")),
        "{:?}",
        strict.violations
    );
    assert!(
        strict
            .violations
            .iter()
            .any(|v| v.contains("store accepted")),
        "{:?}",
        strict.violations
    );
    assert!(
        strict
            .violations
            .iter()
            .any(|v| v.contains("within its validity")),
        "{:?}",
        strict.violations
    );

    // The same overlap, fenced: every write of a after b's begin was refused.
    let fenced = [
        record(base, 0, "a", 10, Kind::Begin, true, None),
        record(base, 5, "b", 11, Kind::Begin, true, None),
        record(base, 8, "a", 10, Kind::Write, false, None),
        record(base, 9, "a", 10, Kind::Gone, true, None),
        record(base, 12, "b", 11, Kind::End, true, None),
    ];
    let paused = analyse(&fenced, Mode::Fenced, &[]);
    assert!(paused.violations.is_empty(), "{:?}", paused.violations);
    assert_eq!(paused.overlaps.len(), 1);
    assert!(paused.overlaps[0].fenced);
    assert_eq!(paused.stale_refused, 1);
    assert!(
        !analyse(&fenced, Mode::Strict, &[]).violations.is_empty(),
        "without pauses any overlap is a violation"
    );

    // A later session with a smaller token.
    let backwards = [
        record(base, 0, "a", 10, Kind::Begin, true, None),
        record(base, 1, "a", 10, Kind::End, true, None),
        record(base, 2, "b", 10, Kind::Begin, true, None),
        record(base, 3, "b", 10, Kind::End, true, None),
    ];
    let analysis = analyse(&backwards, Mode::Strict, &[]);
    assert!(
        analysis
            .violations
            .iter()
            .any(|v| v.contains("token did not increase")),
        "{:?}",
        analysis.violations
    );
}

#[test]
pub(crate) fn the_checker_excludes_late_writes_and_measures_handoffs() {
    let base = Instant::now();
    let records = [
        // a: released at 10; b takes over at 14 (4 ms after release).
        record(base, 0, "a", 1, Kind::Begin, true, Some(100)),
        record(base, 10, "a", 1, Kind::End, true, Some(100)),
        record(base, 14, "b", 2, Kind::Begin, true, Some(200)),
        // b crashes at 20 (no end); c begins at 1020.
        record(base, 19, "b", 2, Kind::Write, true, Some(200)),
        record(base, 1020, "c", 3, Kind::Begin, true, Some(2000)),
        // b wakes from a pause past its validity (200) and writes: late, refused, no overlap.
        record(base, 1500, "b", 2, Kind::Write, false, Some(200)),
        record(base, 1600, "c", 3, Kind::End, true, Some(2000)),
    ];
    let a = analyse(&records, Mode::Strict, &[base + Duration::from_millis(20)]);
    assert!(a.violations.is_empty(), "{:?}", a.violations);
    assert_eq!(a.late_writes, 1);
    assert_eq!(a.stale_refused, 1);
    assert_eq!(a.handoffs(), 2);
    assert_eq!(a.release_takeovers, vec![Duration::from_millis(4)]);
    assert_eq!(a.crash_takeovers, vec![Duration::from_millis(1000)]);
    assert_eq!(a.leaderless_total, Duration::from_millis(4 + 1001));
    assert_eq!(a.leaderless_max, Duration::from_millis(1001));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn the_store_refuses_lower_tokens_and_sees_a_killed_writer_go() {
    let store = FencedStore::new();
    assert!(store.write("a", 5, Kind::Begin, None));
    assert!(
        !store.write("b", 4, Kind::Begin, None),
        "a lower token is refused"
    );
    assert!(
        store.write("a", 5, Kind::Write, None),
        "the same token is accepted"
    );

    // guard's CMD one-liner, run by bash against the served store, then killed mid-way.
    let server = StoreServer::start(store.clone()).await;
    let mut cmd = Proc::spawn_program(
        std::path::Path::new("bash"),
        &["-c", &guard_cmd(server.port(), 1000, "0.01")],
        &[("REDLOCK_FENCING_TOKEN", "7"), ("REDLOCK_HOLDER", "cmd")],
    );
    support::wait_until_async(Duration::from_secs(5), "CMD writes", || async {
        store.count_since(Instant::now() - Duration::from_secs(60), |r| {
            r.who == "cmd" && r.kind == Kind::Write
        }) >= 3
    })
    .await;
    let killed_at = Instant::now();
    cmd.sigkill();
    support::wait_until_async(Duration::from_secs(5), "the store sees CMD go", || async {
        !store.is_open("cmd", 7)
    })
    .await;
    let records = store.records();
    let begin = records.iter().find(|r| r.who == "cmd").expect("a record");
    assert_eq!(begin.kind, Kind::Begin);
    assert_eq!(begin.pid, Some(cmd.pid()), "CMD reports its pid");
    let gone = records.last().expect("records");
    assert_eq!((gone.kind, gone.who.as_str()), (Kind::Gone, "cmd"));
    assert!(gone.at >= killed_at);

    // A refused write makes CMD stop with 92.
    assert!(store.write("z", 8, Kind::Begin, None));
    let mut refused = Proc::spawn_program(
        std::path::Path::new("bash"),
        &["-c", &guard_cmd(server.port(), 3, "0.01")],
        &[("REDLOCK_FENCING_TOKEN", "7"), ("REDLOCK_HOLDER", "late")],
    );
    let status = refused
        .wait_exit_async(Duration::from_secs(5))
        .await
        .expect("CMD exits");
    assert_eq!(
        exit_code(status),
        91,
        "begin refused: {}",
        refused.output_text()
    );
}

//! `redlock-sidecar guard` as real processes on real redis-server nodes.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use support::{Proc, RedisCluster, TempDir};

/// The ttl the binary is run with in these tests.
const TTL_SECS: Duration = Duration::from_secs(2);

fn ready_cluster(n: usize) -> RedisCluster {
    let cluster = RedisCluster::start(n);
    cluster.wait_votes_count(TTL_SECS);
    cluster
}

fn guard(cluster: &RedisCluster, identity: &str, options: &[&str], cmd: &[&str]) -> Proc {
    let redis = cluster.urls_joined();
    let mut args = vec![
        "guard",
        "--lock",
        "nightly",
        "--redis",
        &redis,
        "--ttl",
        "2s",
        "--safety-margin",
        "300ms",
        "--kill-grace",
        "300ms",
        "--retry-delay",
        "20ms",
        "--identity",
        identity,
        // Generous for a loaded 2-core test machine; the node timeout bounds each call.
        "--node-timeout",
        "250ms",
    ];
    args.extend_from_slice(options);
    args.push("--");
    args.extend_from_slice(cmd);
    Proc::spawn(&args, &[])
}

fn sh(script: &str) -> Vec<&str> {
    vec!["sh", "-c", script]
}

fn exit_code(proc: &mut Proc, within: Duration) -> i32 {
    let status = proc
        .wait_exit(within)
        .unwrap_or_else(|| panic!("guard did not exit: {}", proc.output_text()));
    status
        .code()
        .unwrap_or_else(|| panic!("guard killed: {status:?}"))
}

fn pid_alive(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

fn read_pid(file: &Path) -> i32 {
    support::wait_until(Duration::from_secs(10), "CMD wrote its pid", || {
        std::fs::read_to_string(file).is_ok_and(|s| s.trim().parse::<i32>().is_ok())
    });
    std::fs::read_to_string(file)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn racing_guards_never_overlap_and_tokens_strictly_increase() {
    let cluster = ready_cluster(3);
    let dir = TempDir::new("race");
    let log = dir.path().join("sections");
    let script = format!(
        "echo \"start $REDLOCK_FENCING_TOKEN $REDLOCK_HOLDER\" >> {0}; sleep 0.05; echo \"end $REDLOCK_FENCING_TOKEN $REDLOCK_HOLDER\" >> {0}",
        log.display()
    );
    let rounds = 5;
    let mut guards: Vec<Proc> = Vec::new();
    for round in 0..rounds {
        for contender in ["a", "b", "c"] {
            guards.push(guard(
                &cluster,
                contender,
                &["--wait", "30s", "--on-busy", "fail"],
                &sh(&script),
            ));
        }
        if round % 2 == 1 {
            for mut g in guards.drain(..) {
                assert_eq!(
                    exit_code(&mut g, Duration::from_secs(60)),
                    0,
                    "{}",
                    g.output_text()
                );
            }
        }
    }
    for mut g in guards {
        assert_eq!(
            exit_code(&mut g, Duration::from_secs(60)),
            0,
            "{}",
            g.output_text()
        );
    }
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
    assert_eq!(
        lines.len(),
        2 * 3 * rounds,
        "every CMD ran exactly once:\n{text}"
    );
    let mut last_token = 0u64;
    for pair in lines.chunks(2) {
        assert_eq!(pair[0][0], "start", "sections never interleave:\n{text}");
        assert_eq!(pair[1][0], "end", "sections never interleave:\n{text}");
        assert_eq!(
            pair[0][1..],
            pair[1][1..],
            "a section ends with the token it started with"
        );
        let token: u64 = pair[0][1].parse().unwrap();
        assert!(token > last_token, "tokens strictly increase:\n{text}");
        last_token = token;
    }
}

#[test]
fn a_busy_lock_is_skipped_with_exit_0_or_fails_with_75_without_running_cmd() {
    let cluster = ready_cluster(3);
    let dir = TempDir::new("busy");
    let started = dir.path().join("started");
    let mut holder = guard(
        &cluster,
        "holder",
        &[],
        &sh(&format!("touch {}; sleep 30", started.display())),
    );
    support::wait_until(Duration::from_secs(10), "holder runs", || started.exists());

    let ran = dir.path().join("ran");
    let touch_script = format!("touch {}", ran.display());
    let touch = sh(&touch_script);
    let mut skip = guard(&cluster, "skipper", &["--on-busy", "skip"], &touch);
    assert_eq!(exit_code(&mut skip, Duration::from_secs(10)), 0);
    assert!(
        skip.stderr_text().contains("lock busy"),
        "says why: {}",
        skip.stderr_text()
    );
    let mut fail = guard(
        &cluster,
        "failer",
        &["--on-busy", "fail", "--wait", "300ms"],
        &touch,
    );
    assert_eq!(exit_code(&mut fail, Duration::from_secs(10)), 75);
    assert!(!ran.exists(), "CMD never ran while the lock was busy");
    holder.sigterm();
    exit_code(&mut holder, Duration::from_secs(10));
}

#[test]
fn losing_the_quorum_kills_cmd_before_the_lock_can_expire_and_exits_76() {
    let mut cluster = ready_cluster(3);
    let dir = TempDir::new("lost");
    let pid_file = dir.path().join("pid");
    let mut g = guard(
        &cluster,
        "holder",
        &[],
        &sh(&format!("echo $$ > {}; exec sleep 30", pid_file.display())),
    );
    let cmd_pid = read_pid(&pid_file);
    // How long the key lives on the node that stays up: an upper bound on the lock's validity.
    // (The round was decided at quorum: the key may still be landing on node 2.)
    let mut pttl = 0;
    let mut read_at = Instant::now();
    support::wait_until(Duration::from_secs(2), "the key is set on node 2", || {
        read_at = Instant::now();
        let answer = cluster.node(2).command(&["PTTL", "redlock:{nightly}"]);
        pttl = answer.parse().unwrap_or(0);
        pttl > 0
    });
    let key_expiry = read_at + Duration::from_millis(pttl);
    cluster.node_mut(0).stop();
    cluster.node_mut(1).stop();
    support::wait_until(Duration::from_secs(5), "CMD is stopped", || {
        !pid_alive(cmd_pid)
    });
    let stopped_at = Instant::now();
    assert!(
        stopped_at < key_expiry,
        "CMD stopped {:?} before the key could expire",
        key_expiry - stopped_at
    );
    assert_eq!(
        exit_code(&mut g, Duration::from_secs(10)),
        76,
        "{}",
        g.output_text()
    );
}

#[test]
fn signals_are_forwarded_and_cmds_exit_code_is_passed_through() {
    let cluster = ready_cluster(3);
    let dir = TempDir::new("signals");
    let marks = dir.path().join("marks");
    let script = format!(
        "trap 'echo got-term >> {0}; exit 7' TERM; echo ready >> {0}; while true; do sleep 0.05; done",
        marks.display()
    );
    let mut g = guard(&cluster, "holder", &[], &sh(&script));
    support::wait_until(Duration::from_secs(10), "CMD ready", || {
        std::fs::read_to_string(&marks).is_ok_and(|s| s.contains("ready"))
    });
    g.sigterm();
    assert_eq!(
        exit_code(&mut g, Duration::from_secs(10)),
        7,
        "{}",
        g.output_text()
    );
    assert!(
        std::fs::read_to_string(&marks)
            .unwrap()
            .contains("got-term"),
        "CMD saw SIGTERM"
    );

    let mut g = guard(&cluster, "exit3", &["--wait", "5s"], &sh("exit 3"));
    assert_eq!(exit_code(&mut g, Duration::from_secs(10)), 3);
    let mut g = guard(&cluster, "killed", &["--wait", "5s"], &sh("kill -KILL $$"));
    assert_eq!(exit_code(&mut g, Duration::from_secs(10)), 128 + 9);
    let mut g = guard(
        &cluster,
        "missing",
        &["--wait", "5s"],
        &["/no/such/command"],
    );
    assert_eq!(exit_code(&mut g, Duration::from_secs(10)), 127);
}

#[test]
fn min_hold_keeps_the_lock_after_cmd_ends() {
    let cluster = ready_cluster(3);
    let dir = TempDir::new("minhold");
    let done = dir.path().join("done");
    let started = Instant::now();
    let mut short = guard(
        &cluster,
        "short",
        &["--min-hold", "1500ms"],
        &sh(&format!("touch {}", done.display())),
    );
    support::wait_until(Duration::from_secs(10), "CMD ran", || done.exists());
    let mut late = guard(&cluster, "late", &["--on-busy", "fail"], &["true"]);
    assert_eq!(
        exit_code(&mut late, Duration::from_secs(10)),
        75,
        "still held after CMD ended"
    );
    assert_eq!(exit_code(&mut short, Duration::from_secs(10)), 0);
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "held for --min-hold"
    );
    let mut after = guard(
        &cluster,
        "after",
        &["--on-busy", "fail", "--wait", "3s"],
        &["true"],
    );
    assert_eq!(
        exit_code(&mut after, Duration::from_secs(10)),
        0,
        "released after --min-hold"
    );
}

#[test]
fn cmd_does_not_outlive_a_killed_guard() {
    let cluster = ready_cluster(3);
    let dir = TempDir::new("orphan");
    let pid_file = dir.path().join("pid");
    let mut g = guard(
        &cluster,
        "holder",
        &[],
        &sh(&format!("echo $$ > {}; exec sleep 30", pid_file.display())),
    );
    let cmd_pid = read_pid(&pid_file);
    g.sigkill();
    support::wait_until(Duration::from_secs(5), "CMD dies with its guard", || {
        !pid_alive(cmd_pid)
    });
}

#[test]
fn no_quorum_exits_69_and_max_hold_stops_cmd_with_124() {
    let mut cluster = ready_cluster(3);
    let mut g = guard(
        &cluster,
        "holder",
        &["--max-hold", "500ms", "--wait", "5s"],
        &["sleep", "30"],
    );
    assert_eq!(
        exit_code(&mut g, Duration::from_secs(10)),
        124,
        "{}",
        g.output_text()
    );
    for i in 0..3 {
        cluster.node_mut(i).stop();
    }
    let mut g = guard(&cluster, "holder", &[], &["true"]);
    assert_eq!(
        exit_code(&mut g, Duration::from_secs(10)),
        69,
        "{}",
        g.output_text()
    );
}

#[test]
fn invalid_guard_options_exit_2_with_one_line_naming_the_option() {
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "guard",
                "--lock",
                "x",
                "--redis",
                "redis://127.0.0.1:1",
                "--kill-grace",
                "0",
                "--",
                "true",
            ],
            "--kill-grace",
        ),
        (
            &[
                "guard",
                "--lock",
                "x",
                "--redis",
                "redis://127.0.0.1:1",
                "--on-busy",
                "maybe",
                "--",
                "true",
            ],
            "--on-busy",
        ),
        (
            &[
                "guard",
                "--lock",
                "x",
                "--redis",
                "redis://127.0.0.1:1",
                "--min-hold",
                "5s",
                "--max-hold",
                "1s",
                "--",
                "true",
            ],
            "--min-hold",
        ),
        (
            &["guard", "--lock", "x", "--redis", "redis://127.0.0.1:1"],
            "CMD",
        ),
        (
            &[
                "guard",
                "--lock",
                "x",
                "--redis",
                "redis://127.0.0.1:1",
                "--wait",
                "forever",
                "--",
                "true",
            ],
            "--wait",
        ),
    ];
    for (args, option) in cases {
        support::process::assert_invalid_config(args, option);
    }
}

//! `redlock-sidecar guard` as real processes on real redis-server nodes.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use support::{Proc, RedisCluster, TempDir};

/// The ttl the binary is run with in these tests.
const TTL_SECS: Duration = Duration::from_secs(2);

fn guard(cluster: &RedisCluster, identity: &str, options: &[&str], cmd: &[&str]) -> Proc {
    guard_with_ttl(cluster, "2s", identity, options, cmd)
}

/// [`guard`] with another ttl (and no `--kill-grace`: the caller's, or the derived default).
fn guard_with_ttl(
    cluster: &RedisCluster,
    ttl: &str,
    identity: &str,
    options: &[&str],
    cmd: &[&str],
) -> Proc {
    let argv = guard_argv(cluster, ttl, identity, options, cmd);
    Proc::spawn(&argv.iter().map(String::as_str).collect::<Vec<_>>(), &[])
}

/// The arguments of [`guard_with_ttl`].
fn guard_argv(
    cluster: &RedisCluster,
    ttl: &str,
    identity: &str,
    options: &[&str],
    cmd: &[&str],
) -> Vec<String> {
    let redis = cluster.urls_joined();
    let mut args = vec![
        "guard",
        "--lock",
        "nightly",
        "--redis",
        &redis,
        "--ttl",
        ttl,
        "--retry-delay",
        "20ms",
        "--identity",
        identity,
    ];
    if ttl == "2s" {
        // Generous for a loaded 2-core test machine; the node timeout bounds each call.
        let defaults = [
            ("--safety-margin", "300ms"),
            ("--kill-grace", "300ms"),
            ("--node-timeout", "250ms"),
        ];
        for (flag, value) in defaults {
            if !options.contains(&flag) {
                args.extend_from_slice(&[flag, value]);
            }
        }
    }
    args.extend_from_slice(options);
    args.push("--");
    args.extend_from_slice(cmd);
    args.into_iter().map(str::to_owned).collect()
}

/// A guard "holder" whose CMD runs until stopped; returns once CMD runs.
fn start_holder(cluster: &RedisCluster, dir: &TempDir) -> Proc {
    let started = dir.path().join("holder-started");
    let holder = guard(
        cluster,
        "holder",
        &[],
        &sh(&format!("touch {}; exec sleep 30", started.display())),
    );
    support::wait_until(Duration::from_secs(10), "holder runs", || started.exists());
    holder
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
    let cluster = RedisCluster::ready(3, TTL_SECS);
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
    let cluster = RedisCluster::ready(3, TTL_SECS);
    let dir = TempDir::new("busy");
    let mut holder = start_holder(&cluster, &dir);

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
    let mut cluster = RedisCluster::ready(3, TTL_SECS);
    let dir = TempDir::new("lost");
    let pid_file = dir.path().join("pid");
    let termed = dir.path().join("termed");
    // CMD notes SIGTERM and runs on: only the SIGKILL at the step-down point ends it.
    let script = format!(
        "trap 'touch {}' TERM; echo $$ > {}; while true; do sleep 0.05; done",
        termed.display(),
        pid_file.display()
    );
    // A 1 s margin (of the 2 s ttl): the test sees CMD's end late by the time its own
    // polling takes, which on a loaded machine can exceed the default 300 ms.
    let mut g = guard(&cluster, "holder", &["--safety-margin", "1s"], &sh(&script));
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
    assert!(
        termed.exists(),
        "CMD got SIGTERM --kill-grace before the SIGKILL"
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
    let cluster = RedisCluster::ready(3, TTL_SECS);
    let dir = TempDir::new("signals");
    let marks = dir.path().join("marks");
    let script = format!(
        "trap 'echo got-term >> {0}; exit 7' TERM; echo ready >> {0}; while true; do sleep 0.05; done",
        marks.display()
    );
    // A signal asks the whole job to end: no --min-hold after CMD exits from it.
    let mut g = guard(&cluster, "holder", &["--min-hold", "60s"], &sh(&script));
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
    assert_no_key(&cluster, "released before exit");

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
    let cluster = RedisCluster::ready(3, TTL_SECS);
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
fn cmd_and_its_children_do_not_outlive_a_killed_guard() {
    let cluster = RedisCluster::ready(3, TTL_SECS);
    let dir = TempDir::new("orphan");
    let pid_file = dir.path().join("pid");
    let child_file = dir.path().join("child");
    let mut g = guard(
        &cluster,
        "holder",
        &[],
        &sh(&format!(
            "echo $$ > {}; sleep 300 & echo $! > {}; wait",
            pid_file.display(),
            child_file.display()
        )),
    );
    let cmd_pid = read_pid(&pid_file);
    let child_pid = read_pid(&child_file);
    g.sigkill();
    support::wait_until(
        Duration::from_secs(5),
        "CMD and its child die with guard",
        || !pid_alive(cmd_pid) && !pid_alive(child_pid),
    );
}

#[test]
fn no_quorum_exits_69_and_max_hold_stops_cmd_with_124() {
    let mut cluster = RedisCluster::ready(3, TTL_SECS);
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
    // Events required, but not in a pod: refused before anything connects.
    support::process::assert_invalid_config_with_env(
        &[
            "guard",
            "--lock",
            "x",
            "--redis",
            "redis://127.0.0.1:1",
            "--kubernetes",
            "on",
            "--",
            "true",
        ],
        &[("POD_NAME", "")],
        "--kubernetes",
    );
}

/// The lock's key on the nodes.
const KEY: &str = "redlock:{nightly}";

/// The lock value on each running node (`None` where the key is absent).
fn values(cluster: &RedisCluster) -> Vec<Option<String>> {
    values_of(cluster, "nightly")
}

/// [`values`] for lock `lock`.
fn values_of(cluster: &RedisCluster, lock: &str) -> Vec<Option<String>> {
    let key = format!("redlock:{{{lock}}}");
    cluster
        .iter()
        .filter(|node| node.is_running())
        .map(|node| {
            let value = node.command(&["GET", &key]);
            (value != "(nil)").then_some(value)
        })
        .collect()
}

fn assert_no_key(cluster: &RedisCluster, why: &str) {
    let values = values(cluster);
    assert!(values.iter().all(Option::is_none), "{why}: {values:?}");
}

/// When the key on node `i` expires at the latest (read right after it is set).
fn key_expiry(cluster: &RedisCluster, i: usize) -> Instant {
    let mut pttl = 0;
    let mut read_at = Instant::now();
    support::wait_until(Duration::from_secs(5), "the key is set", || {
        read_at = Instant::now();
        pttl = cluster.node(i).command(&["PTTL", KEY]).parse().unwrap_or(0);
        pttl > 0
    });
    read_at + Duration::from_millis(pttl)
}

/// The process group of `pid`.
fn pgrp(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .nth(2)?
        .parse()
        .ok()
}

/// The parent of `pid`.
fn ppid(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// User + system CPU time of `pid` in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("guard runs");
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 1..]
        .split_whitespace()
        .collect();
    // After the state (field 3 overall): utime and stime are fields 14 and 15.
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

fn http_get(addr: std::net::SocketAddr, path: &str) -> Option<support::Response> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(support::http::get(addr, path))
        .ok()
}

/// A free loopback address for `--listen`, and the same as text.
fn admin_addr() -> (std::net::SocketAddr, String) {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], support::free_port()));
    (addr, addr.to_string())
}

/// A file in `dir`, and its path as text for a flag.
fn file_arg(dir: &TempDir, name: &str) -> (std::path::PathBuf, String) {
    let path = dir.path().join(name);
    let text = path.display().to_string();
    (path, text)
}

#[test]
fn a_lock_lost_during_min_hold_keeps_cmds_exit_code_and_is_counted() {
    let mut cluster = RedisCluster::ready(3, TTL_SECS);
    let dir = TempDir::new("lost-min-hold");
    let done = dir.path().join("done");
    let (addr, listen) = admin_addr();
    let (outcome, outcome_path) = file_arg(&dir, "outcome");
    let mut g = guard(
        &cluster,
        "holder",
        &[
            "--kill-grace",
            "100ms",
            "--min-hold",
            "30s",
            "--node-timeout",
            "400ms",
            "--safety-margin",
            "500ms",
            "--listen",
            &listen,
            "--outcome-file",
            &outcome_path,
        ],
        &sh(&format!("touch {}", done.display())),
    );
    support::wait_until(Duration::from_secs(10), "CMD ran", || done.exists());
    g.wait_for_output("CMD exited", Duration::from_secs(5));
    cluster.node_mut(0).stop();
    cluster.node_mut(1).stop();
    // The remaining node does not answer, so the release after the loss waits a node
    // timeout: long enough to read the counter while guard still runs.
    cluster.node_mut(2).pause();
    let mut counted = false;
    while !counted && g.is_running() {
        counted = http_get(addr, "/metrics").is_some_and(|r| {
            r.body
                .lines()
                .any(|l| l.starts_with("redlock_lock_lost_total{") && !l.ends_with(" 0"))
        });
        std::thread::sleep(support::POLL_EVERY);
    }
    assert_eq!(
        exit_code(&mut g, Duration::from_secs(10)),
        0,
        "CMD's code, no panic: {}",
        g.output_text()
    );
    let log = g.stderr_text();
    assert!(counted, "redlock_lock_lost_total counted the loss: {log}");
    assert!(log.contains("lock lost"), "logged: {log}");
    assert!(
        log.contains("during --min-hold"),
        "the LockLost event path: {log}"
    );
    assert!(
        log.contains("released the lock"),
        "release attempted: {log}"
    );
    let line = std::fs::read_to_string(&outcome).unwrap();
    assert!(
        line.starts_with("outcome=ran exit_code=0 lock=nightly fencing_token="),
        "{line}"
    );
}

#[test]
fn waiting_for_a_cmd_that_ignores_sigterm_costs_no_cpu() {
    let cluster = RedisCluster::start(3);
    cluster.backdate_epochs(Duration::from_secs(30));
    let dir = TempDir::new("grace-cpu");
    let pid_file = dir.path().join("pid");
    let mut g = guard_with_ttl(
        &cluster,
        "30s",
        "holder",
        &["--max-hold", "1s", "--kill-grace", "10s"],
        &sh(&format!(
            "trap '' TERM; echo $$ > {}; exec sleep 30",
            pid_file.display()
        )),
    );
    let cmd_pid = read_pid(&pid_file);
    g.wait_for_output("--max-hold reached", Duration::from_secs(10));
    // A measurement window inside the 10 s grace period, not a synchronisation.
    let window = Duration::from_secs(1);
    let before = cpu_ticks(g.pid());
    std::thread::sleep(window);
    let used = cpu_ticks(g.pid()) - before;
    assert!(
        pid_alive(cmd_pid),
        "CMD still runs in its grace period: the window measured guard waiting"
    );
    // SAFETY: sysconf has no preconditions.
    let per_sec = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let share = used as f64 / per_sec / window.as_secs_f64();
    assert!(
        share < 0.1,
        "guard used {:.0} % of a core while CMD ignored SIGTERM",
        share * 100.0
    );
}

#[test]
fn sigkill_of_guards_process_group_kills_cmds_whole_tree_before_the_lock_can_expire() {
    // ttl 10 s: renewals keep the lock on a loaded machine until the kill, and the test's own
    // polling is small beside the validity it is measured against.
    let cluster = RedisCluster::start(3);
    cluster.backdate_epochs(Duration::from_secs(10));
    let dir = TempDir::new("tree");
    let file = |name: &str| dir.path().join(name);
    let script = format!(
        "echo $$ > {}; sleep 300 & echo $! > {}; setsid sleep 300 & echo $! > {}; wait",
        file("sh").display(),
        file("child").display(),
        file("escaped").display()
    );
    // guard in a session (and process group) of its own, so that its whole group can be
    // SIGKILLed as a terminal or a process manager would.
    let bin = support::bin().display().to_string();
    let mut argv = vec![bin];
    argv.extend(guard_argv(
        &cluster,
        "10s",
        "holder",
        &["--node-timeout", "250ms"],
        &sh(&script),
    ));
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let g = Proc::spawn_program(Path::new("setsid"), &argv, &[]);
    let tree: Vec<i32> = ["sh", "child", "escaped"]
        .iter()
        .map(|name| read_pid(&file(name)))
        .collect();
    support::wait_until(Duration::from_secs(5), "setsid took effect", || {
        pgrp(tree[2]) == Some(tree[2])
    });
    assert_ne!(pgrp(tree[0]), pgrp(tree[2]), "one process left CMD's group");
    let expiry = key_expiry(&cluster, 0);
    assert_eq!(
        pgrp(g.pid() as i32),
        Some(g.pid() as i32),
        "guard leads its group"
    );
    // SAFETY: kill(2) on the process group of our own, unreaped child.
    assert_eq!(unsafe { libc::kill(-(g.pid() as i32), libc::SIGKILL) }, 0);
    support::wait_until(Duration::from_secs(5), "CMD's tree is gone", || {
        tree.iter().all(|&pid| !pid_alive(pid))
    });
    let gone_at = Instant::now();
    assert!(
        gone_at < expiry,
        "CMD's tree was gone {:?} before the lock's validity ended",
        expiry - gone_at
    );
}

#[test]
fn orphans_below_guard_are_reaped() {
    let cluster = RedisCluster::ready(3, TTL_SECS);
    let dir = TempDir::new("reap");
    let file = |name: &str| dir.path().join(name);
    // The inner shell exits at once, leaving its `sleep` an orphan.
    let script = format!(
        "echo $PPID > {}; sh -c 'echo $$ > {}; sleep 1 & echo $! > {}'; exec sleep 30",
        file("supervisor").display(),
        file("inner").display(),
        file("orphan").display()
    );
    let mut g = guard(&cluster, "holder", &[], &sh(&script));
    let supervisor = read_pid(&file("supervisor"));
    let inner = read_pid(&file("inner"));
    let orphan = read_pid(&file("orphan"));
    // Once the inner shell has exited, the orphan has a new parent.
    support::wait_until(Duration::from_secs(5), "the orphan is re-parented", || {
        ppid(orphan) != Some(inner)
    });
    assert_eq!(
        ppid(orphan),
        Some(supervisor),
        "the orphan stays below guard's supervisor, not PID 1"
    );
    support::wait_until(Duration::from_secs(5), "the orphan is reaped", || {
        !Path::new(&format!("/proc/{orphan}")).exists()
    });

    // guard itself reaps what its supervisor leaves when the supervisor is killed.
    let child = file("child");
    let script = format!(
        "echo $PPID > {}; sleep 300 & echo $! > {}; wait",
        file("supervisor2").display(),
        child.display()
    );
    g.sigterm();
    assert_eq!(exit_code(&mut g, Duration::from_secs(10)), 128 + 15);
    let mut g = guard(&cluster, "holder", &["--wait", "5s"], &sh(&script));
    let supervisor = read_pid(&file("supervisor2"));
    let child = read_pid(&child);
    support::send_signal(supervisor as u32, libc::SIGKILL);
    support::wait_until(
        Duration::from_secs(5),
        "CMD's child is killed and reaped",
        || !Path::new(&format!("/proc/{child}")).exists(),
    );
    assert_eq!(exit_code(&mut g, Duration::from_secs(10)), 128 + 9);
    assert_no_key(&cluster, "released after the supervisor died");
}

#[test]
fn not_leader_is_published_before_the_release() {
    let cluster = RedisCluster::start(3);
    cluster.backdate_epochs(Duration::from_secs(30));
    let dir = TempDir::new("not-leader-first");
    let (ready, go) = (dir.path().join("ready"), dir.path().join("go"));
    let (addr, listen) = admin_addr();
    // After --max-hold, CMD ignores SIGTERM until the test lets it go; the 10 s kill grace
    // keeps the lock held (no longer renewed, not yet released) for all that time.
    let script = format!(
        "trap '' TERM; echo $$ > {0}.tmp; mv {0}.tmp {0}; while [ ! -e {1} ]; do sleep 0.05; done",
        ready.display(),
        go.display()
    );
    let mut g = guard_with_ttl(
        &cluster,
        "30s",
        "holder",
        &[
            "--max-hold",
            "3s",
            "--kill-grace",
            "10s",
            "--node-timeout",
            "250ms",
            "--listen",
            &listen,
        ],
        &sh(&script),
    );
    support::wait_until(Duration::from_secs(10), "CMD ignores SIGTERM", || {
        ready.exists()
    });
    support::wait_until(Duration::from_secs(10), "/leader says leader", || {
        http_get(addr, "/leader").is_some_and(|r| r.status == 200)
    });
    support::wait_until(Duration::from_secs(10), "/leader says not leader", || {
        http_get(addr, "/leader").is_some_and(|r| r.status == 503)
    });
    let held = values(&cluster).iter().filter(|v| v.is_some()).count();
    assert_eq!(
        held, 3,
        "not-leader is published while the lock is still held"
    );
    let cmd_pid: i32 = std::fs::read_to_string(&ready)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(pid_alive(cmd_pid), "CMD runs on in its 10 s grace period");
    let metrics = http_get(addr, "/metrics").expect("metrics").body;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("redlock_is_leader{") && l.ends_with(" 0")),
        "{metrics}"
    );
    std::fs::write(&go, "").unwrap();
    assert_eq!(exit_code(&mut g, Duration::from_secs(10)), 124);
    assert_no_key(&cluster, "released at exit");
}

#[test]
fn sigterm_while_waiting_for_the_lock_exits_at_once_and_runs_nothing() {
    let cluster = RedisCluster::ready(3, TTL_SECS);
    let dir = TempDir::new("term-wait");
    let mut holder = start_holder(&cluster, &dir);
    let (addr, listen) = admin_addr();
    let ran = dir.path().join("ran");
    let (outcome, outcome_path) = file_arg(&dir, "outcome");
    let mut waiter = guard(
        &cluster,
        "waiter",
        &[
            "--wait",
            "60s",
            "--listen",
            &listen,
            "--outcome-file",
            &outcome_path,
        ],
        &sh(&format!("touch {}", ran.display())),
    );
    support::wait_until(
        Duration::from_secs(10),
        "the waiter found the lock busy",
        || {
            http_get(addr, "/metrics").is_some_and(|r| {
                r.body.lines().any(|l| {
                    l.starts_with("redlock_acquire_attempts_total{")
                        && l.contains("result=\"busy\"")
                        && !l.ends_with(" 0")
                })
            })
        },
    );
    waiter.sigterm();
    assert_eq!(exit_code(&mut waiter, Duration::from_secs(2)), 128 + 15);
    assert!(!ran.exists(), "CMD did not run");
    assert_eq!(
        std::fs::read_to_string(&outcome).unwrap(),
        "outcome=not-started exit_code=143 lock=nightly\n"
    );
    assert!(
        values(&cluster)
            .iter()
            .all(|v| v.as_deref().is_some_and(|v| v.starts_with("holder:"))),
        "nothing of the waiter's on the nodes"
    );
    holder.sigterm();
    exit_code(&mut holder, Duration::from_secs(10));
    assert_no_key(&cluster, "the holder released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_the_lock_is_being_taken_releases_it_and_runs_nothing() {
    let cluster = RedisCluster::start(3);
    // A node timeout that covers setting up the slow connections in the first round.
    let ttl = "13s";
    cluster.wait_votes_count(Duration::from_secs(13));
    let mut proxies = Vec::new();
    for node in cluster.iter() {
        let proxy = support::FaultProxy::start(node.addr()).await;
        proxies.push(proxy);
    }
    // Every byte takes 150 ms each way: the key stands on the nodes for 150 ms while
    // guard still waits for the answers of the round that takes it.
    for proxy in &proxies {
        proxy.set_latency(Duration::from_millis(150), Duration::ZERO);
    }
    let urls: Vec<String> = proxies.iter().map(|p| p.url()).collect();
    let redis = urls.join(",");
    let dir = TempDir::new("term-acquire");
    let ran = dir.path().join("ran");
    let touch = format!("touch {}", ran.display());
    let mut g = Proc::spawn(
        &[
            "guard",
            "--lock",
            "nightly",
            "--redis",
            &redis,
            "--ttl",
            ttl,
            "--identity",
            "holder",
            "--node-timeout",
            "3s",
            "--connect-timeout",
            "10s",
            "--",
            "sh",
            "-c",
            &touch,
        ],
        &[],
    );
    let end = Instant::now() + Duration::from_secs(20);
    while !cluster
        .iter()
        .any(|node| node.command(&["EXISTS", KEY]) == "1")
    {
        assert!(g.is_running(), "{}", g.output_text());
        assert!(Instant::now() < end, "no key written: {}", g.output_text());
        tokio::time::sleep(support::POLL_EVERY).await;
    }
    g.sigterm();
    let status = g
        .wait_exit_async(Duration::from_secs(10))
        .await
        .expect("exits");
    assert_eq!(status.code(), Some(128 + 15), "{}", g.output_text());
    assert!(!ran.exists(), "CMD did not run");
    assert!(
        g.stderr_text().contains("released the lock"),
        "the round in flight took the lock: {}",
        g.output_text()
    );
    let left: Vec<String> = cluster
        .iter()
        .map(|node| node.command(&["EXISTS", KEY]))
        .collect();
    assert_eq!(
        left,
        ["0", "0", "0"],
        "released on every node: {}",
        g.output_text()
    );
}

#[test]
fn any_valid_ttl_alone_works_for_guard_and_run() {
    // The smallest ttl the default node timeout allows, and a few more.
    let ttls = ["217ms", "2s", "3s"];
    let cluster = RedisCluster::start(3);
    cluster.wait_votes_count(Duration::from_secs(3));
    let redis = cluster.urls_joined();
    for ttl in ttls {
        let lock = format!("ttl-{ttl}");
        let mut g = Proc::spawn(
            &[
                "guard", "--lock", &lock, "--redis", &redis, "--ttl", ttl, "--", "true",
            ],
            &[],
        );
        assert_eq!(
            exit_code(&mut g, Duration::from_secs(10)),
            0,
            "guard --ttl {ttl}: {}",
            g.output_text()
        );
        let (addr, listen) = admin_addr();
        let mut run = Proc::spawn(
            &[
                "run",
                "--lock",
                &lock,
                "--redis",
                &redis,
                "--ttl",
                ttl,
                "--listen",
                &listen,
                "--kubernetes",
                "off",
            ],
            &[],
        );
        support::wait_until(Duration::from_secs(10), "run leads", || {
            assert!(run.is_running(), "run --ttl {ttl}: {}", run.output_text());
            http_get(addr, "/leader").is_some_and(|r| r.status == 200)
        });
        run.sigterm();
        assert_eq!(exit_code(&mut run, Duration::from_secs(10)), 0);
    }
    support::process::assert_invalid_config(
        &[
            "guard",
            "--lock",
            "x",
            "--redis",
            "redis://127.0.0.1:1",
            "--ttl",
            "216ms",
            "--",
            "true",
        ],
        "--ttl",
    );
    support::process::assert_invalid_config(
        &[
            "guard",
            "--lock",
            "x",
            "--redis",
            "redis://127.0.0.1:1",
            "--ttl",
            "2s",
            "--kill-grace",
            "2s",
            "--",
            "true",
        ],
        "--kill-grace",
    );
}

#[test]
fn thirty_guards_started_at_the_same_instant_run_cmd_exactly_once() {
    // The first round of every guard is held on every node (CLIENT PAUSE) until all 30
    // have sent it, then released on all nodes at once: each node serves them in its own
    // order, the classic split-vote herd.
    let ttl = "13s";
    let cluster = RedisCluster::start(3);
    cluster.wait_votes_count(Duration::from_secs(13));
    let dir = TempDir::new("herd");
    let runs = dir.path().join("runs");
    let script = format!("echo $REDLOCK_HOLDER >> {}", runs.display());
    for node in cluster.iter() {
        node.command(&["CLIENT", "PAUSE", "30000", "WRITE"]);
    }
    let names: Vec<String> = (0..30).map(|i| format!("herd-{i}")).collect();
    let mut guards: Vec<Proc> = names
        .iter()
        .map(|name| {
            guard_with_ttl(
                &cluster,
                ttl,
                name,
                &[
                    "--on-busy",
                    "skip",
                    "--node-timeout",
                    "3s",
                    "--min-hold",
                    "12s",
                ],
                &sh(&script),
            )
        })
        .collect();
    support::wait_until(
        Duration::from_secs(20),
        "30 rounds wait on every node",
        || {
            cluster.iter().all(|node| {
                node.command(&["INFO", "clients"])
                    .lines()
                    .any(|l| l.trim() == "blocked_clients:30")
            })
        },
    );
    for node in cluster.iter() {
        node.command(&["CLIENT", "UNPAUSE"]);
    }
    // Every guard but the winner decides while the winner holds the lock (--min-hold).
    support::wait_until(Duration::from_secs(20), "29 guards skipped", || {
        guards
            .iter_mut()
            .map(|g| g.is_running())
            .filter(|r| !r)
            .count()
            == 29
    });
    let mut winner = None;
    for mut g in guards {
        if g.is_running() {
            winner = Some(g);
            continue;
        }
        assert_eq!(exit_code(&mut g, Duration::ZERO), 0, "{}", g.output_text());
        assert!(g.stderr_text().contains("lock busy"), "{}", g.output_text());
    }
    let winner = &mut winner.expect("one guard runs CMD");
    // SIGTERM during --min-hold, not while CMD still runs (it would end the run with 143).
    winner.wait_for_output("CMD exited", Duration::from_secs(10));
    winner.sigterm();
    assert_eq!(exit_code(winner, Duration::from_secs(10)), 0);
    let text = std::fs::read_to_string(&runs).unwrap_or_default();
    assert_eq!(text.lines().count(), 1, "CMD ran exactly once: {text}");
}

#[test]
fn a_round_split_among_contenders_is_retried_but_a_holder_with_a_quorum_means_busy() {
    let cluster = RedisCluster::ready(3, TTL_SECS);
    let dir = TempDir::new("split");
    let ran = dir.path().join("ran");
    let touch = format!("touch {}", ran.display());
    // Two other contenders hold one node each: nobody has a quorum.
    cluster.node(0).command(&["SET", KEY, "a:1", "PX", "400"]);
    cluster.node(1).command(&["SET", KEY, "b:2", "PX", "400"]);
    let mut g = guard(&cluster, "late", &["--on-busy", "skip"], &sh(&touch));
    assert_eq!(
        exit_code(&mut g, Duration::from_secs(10)),
        0,
        "{}",
        g.output_text()
    );
    assert!(
        ran.exists(),
        "a split is retried, then won: {}",
        g.output_text()
    );

    std::fs::remove_file(&ran).unwrap();
    cluster.node(0).command(&["SET", KEY, "a:1", "PX", "400"]);
    cluster.node(1).command(&["SET", KEY, "a:1", "PX", "400"]);
    let mut g = guard(&cluster, "late", &["--on-busy", "skip"], &sh(&touch));
    assert_eq!(exit_code(&mut g, Duration::from_secs(10)), 0);
    assert!(g.stderr_text().contains("lock busy"), "{}", g.output_text());
    assert!(!ran.exists(), "a holder on a quorum is busy: skipped");
}

#[test]
fn the_outcome_file_says_what_happened() {
    let cluster = RedisCluster::ready(3, TTL_SECS);
    let dir = TempDir::new("outcome");
    let (outcome, path) = file_arg(&dir, "outcome");
    let mut g = guard(
        &cluster,
        "runner",
        &["--outcome-file", &path],
        &sh("exit 3"),
    );
    assert_eq!(exit_code(&mut g, Duration::from_secs(10)), 3);
    let line = std::fs::read_to_string(&outcome).unwrap();
    let token = line
        .trim_end()
        .strip_prefix("outcome=ran exit_code=3 lock=nightly fencing_token=")
        .unwrap_or_else(|| panic!("{line}"));
    assert!(token.parse::<u64>().is_ok_and(|t| t > 0), "{line}");

    let mut holder = start_holder(&cluster, &dir);
    let mut g = Proc::spawn(
        &[
            "guard",
            "--lock",
            "nightly",
            "--redis",
            &cluster.urls_joined(),
            "--ttl",
            "2s",
            "--identity",
            "skipper",
            "--",
            "true",
        ],
        &[("REDLOCK_OUTCOME_FILE", &path)],
    );
    assert_eq!(exit_code(&mut g, Duration::from_secs(10)), 0);
    assert_eq!(
        std::fs::read_to_string(&outcome).unwrap(),
        "outcome=skipped exit_code=0 lock=nightly\n"
    );
    // A file that cannot be written changes nothing but a log line.
    let mut g = guard(
        &cluster,
        "skipper",
        &["--outcome-file", "/nonexistent-dir/outcome"],
        &["true"],
    );
    assert_eq!(exit_code(&mut g, Duration::from_secs(10)), 0);
    assert!(g.stderr_text().contains("could not write the outcome file"));
    holder.sigterm();
    exit_code(&mut holder, Duration::from_secs(10));
}

#[test]
fn a_renewal_that_finds_the_lock_taken_over_kills_cmd_without_grace() {
    let cluster = RedisCluster::ready(3, TTL_SECS);
    let dir = TempDir::new("superseded");
    let pid_file = dir.path().join("pid");
    let mut g = guard(
        &cluster,
        "holder",
        &["--kill-grace", "1s"],
        &sh(&format!(
            "echo $$ > {}; trap '' TERM; exec sleep 30",
            pid_file.display()
        )),
    );
    let cmd_pid = read_pid(&pid_file);
    key_expiry(&cluster, 1);
    for i in 0..2 {
        cluster
            .node(i)
            .command(&["SET", KEY, "thief:1", "PX", "10000"]);
    }
    support::wait_until(Duration::from_secs(5), "CMD is killed", || {
        !pid_alive(cmd_pid)
    });
    assert_eq!(exit_code(&mut g, Duration::from_secs(10)), 76);
    let log = g.stderr_text();
    assert!(log.contains("SIGKILL to CMD at once"), "{log}");
    assert!(
        !log.contains("CMD still running; sending SIGKILL"),
        "no grace period was waited out: {log}"
    );
}

// ------------------------------------------------------------------------------------------------
// Jobs longer than one validity window
// ------------------------------------------------------------------------------------------------

/// The sum of the samples of metric family `name` (every label set) in a scrape of `addr`;
/// `None` if the scrape failed or has no such series.
fn metric_sum(addr: std::net::SocketAddr, name: &str) -> Option<f64> {
    let body = http_get(addr, "/metrics")?.body;
    let samples: Vec<f64> = body
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!samples.is_empty()).then(|| samples.iter().sum())
}

/// A guard on lock `lock` with `--listen` and `--outcome-file` in `dir`; `ttl` `None` keeps
/// the default ttl (10 s) and every timing default, as a user would run it.
fn long_guard(
    cluster: &RedisCluster,
    dir: &TempDir,
    lock: &str,
    ttl: Option<&str>,
    options: &[&str],
    script: &str,
) -> (Proc, std::net::SocketAddr, std::path::PathBuf) {
    let (addr, listen) = admin_addr();
    let (outcome, outcome_path) = file_arg(dir, &format!("{lock}.outcome"));
    let redis = cluster.urls_joined();
    let mut args = vec![
        "guard",
        "--lock",
        lock,
        "--redis",
        &redis,
        "--identity",
        lock,
        "--wait",
        "12s",
        "--listen",
        &listen,
        "--outcome-file",
        &outcome_path,
    ];
    if let Some(ttl) = ttl {
        args.extend_from_slice(&["--ttl", ttl]);
    }
    args.extend_from_slice(options);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    (Proc::spawn(&args, &[]), addr, outcome)
}

/// Asserts that guard `g` (still running) has not counted or logged a lost lock, leads, and
/// has renewed at least `renewals` times.
fn assert_still_holding(g: &mut Proc, addr: std::net::SocketAddr, renewals: f64) {
    assert!(g.is_running(), "guard runs: {}", g.output_text());
    let lost = metric_sum(addr, "redlock_lock_lost_total").expect("lock_lost_total is exported");
    assert_eq!(lost, 0.0, "no loss counted: {}", g.output_text());
    let leader = metric_sum(addr, "redlock_is_leader").expect("is_leader is exported");
    assert_eq!(leader, 1.0, "still the leader: {}", g.output_text());
    let body = http_get(addr, "/metrics").expect("metrics").body;
    let ok: f64 = body
        .lines()
        .filter(|l| l.starts_with("redlock_renewals_total{") && l.contains("result=\"ok\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(ok >= renewals, "renewed {ok} times, expected ≥ {renewals}");
}

/// Asserts guard's log and outcome line of a job that ran to its end with `code`.
fn assert_ran(g: &Proc, outcome: &Path, code: i32) {
    let log = g.stderr_text();
    for said in [
        "lock lost",
        "stopping CMD",
        "renewals could not keep the lock",
    ] {
        assert!(!log.contains(said), "no {said:?} in the log: {log}");
    }
    let line = std::fs::read_to_string(outcome).unwrap_or_default();
    assert!(
        line.starts_with(&format!("outcome=ran exit_code={code} lock=")),
        "{line}"
    );
}

/// Runs, side by side on one cluster: a job of `job_secs` (at least three validity windows)
/// that must come back with its own exit code, and a job stopped by a `--max-hold` of
/// `max_hold_secs` (longer than a validity window) that must not be stopped before it.
fn long_jobs(
    cluster: &RedisCluster,
    ttl: Option<&str>,
    options: &[&str],
    job_secs: u64,
    max_hold_secs: u64,
) {
    let dir = TempDir::new("long-job");
    let file = |name: &str| dir.path().join(name);
    let (started, slept, go) = (file("started"), file("slept"), file("go"));
    let script = format!(
        "touch {}; sleep {job_secs}; touch {}; while [ ! -e {} ]; do sleep 0.05; done; exit 3",
        started.display(),
        slept.display(),
        go.display()
    );
    let mut job = long_guard(cluster, &dir, "long", ttl, options, &script);
    let hold_started = file("hold-started");
    let max_hold = format!("{max_hold_secs}s");
    let mut hold_options = options.to_vec();
    hold_options.extend_from_slice(&["--max-hold", &max_hold]);
    let spawned = Instant::now();
    let mut capped = long_guard(
        cluster,
        &dir,
        "capped",
        ttl,
        &hold_options,
        &format!("touch {}; exec sleep 300", hold_started.display()),
    );
    support::wait_until(Duration::from_secs(15), "both CMDs started", || {
        assert!(job.0.is_running(), "{}", job.0.output_text());
        assert!(capped.0.is_running(), "{}", capped.0.output_text());
        started.exists() && hold_started.exists()
    });

    // --max-hold ends its job, not a renewal schedule that went stale.
    let capped_code = exit_code(&mut capped.0, Duration::from_secs(max_hold_secs + 15));
    let capped_after = spawned.elapsed();
    assert_eq!(capped_code, 124, "{}", capped.0.output_text());
    assert!(
        capped_after >= Duration::from_secs(max_hold_secs),
        "--max-hold {max_hold} was honoured, not cut short: exited {capped_after:?} after start"
    );
    let log = capped.0.stderr_text();
    assert!(log.contains("--max-hold reached"), "{log}");
    assert!(!log.contains("lock lost"), "{log}");
    let line = std::fs::read_to_string(&capped.2).unwrap_or_default();
    assert!(
        line.starts_with("outcome=max-hold exit_code=124 lock=capped"),
        "{line}"
    );

    // The long job runs to its end under the lock, renewed all along.
    support::wait_until(
        Duration::from_secs(job_secs + 15),
        "the long CMD ran its full length",
        || {
            assert!(
                job.0.is_running(),
                "guard stopped early: {}",
                job.0.output_text()
            );
            slept.exists()
        },
    );
    assert_still_holding(&mut job.0, job.1, 3.0);
    assert!(
        values_of(cluster, "long")
            .iter()
            .all(|v| v.as_deref().is_some_and(|v| v.starts_with("long:"))),
        "the lock is still the long job's on every node"
    );
    std::fs::write(&go, "").unwrap();
    assert_eq!(
        exit_code(&mut job.0, Duration::from_secs(10)),
        3,
        "CMD's own code: {}",
        job.0.output_text()
    );
    assert_ran(&job.0, &job.2, 3);
}

#[test]
fn jobs_of_three_validity_windows_at_the_default_ttl_keep_the_lock_and_cmds_exit_code() {
    // The default ttl of 10 s: a 31 s job, and a --max-hold of 25 s.
    let cluster = RedisCluster::start(3);
    cluster.backdate_epochs(Duration::from_secs(10));
    long_jobs(&cluster, None, &[], 31, 25);
}

#[test]
fn jobs_of_three_validity_windows_at_ttl_2s_keep_the_lock_and_cmds_exit_code() {
    // A 7 s job, and a --max-hold of 5 s, at ttl 2 s.
    let cluster = RedisCluster::ready(3, TTL_SECS);
    long_jobs(
        &cluster,
        Some("2s"),
        &[
            "--safety-margin",
            "300ms",
            "--kill-grace",
            "300ms",
            "--node-timeout",
            "250ms",
        ],
        7,
        5,
    );
}

#[test]
fn cmd_gets_the_lock_variables_but_none_of_guards_own_settings_or_credentials() {
    // Three nodes that admit only the ACL user alice: guard reaches node 0 with the
    // credentials inline in its URL, the others with REDLOCK_REDIS_USERNAME/PASSWORD.
    let (user, password) = ("alice", "alice-pw-4417");
    let acl = format!("user default off\nuser {user} on >{password} ~* &* +@all\n");
    let mut cluster = RedisCluster {
        nodes: (0..3)
            .map(|_| support::RedisNode::start_with_config(&acl))
            .collect(),
    };
    for i in 0..3 {
        cluster.node_mut(i).set_auth(Some(user), password);
    }
    cluster.backdate_epochs(TTL_SECS);
    let mut urls = cluster.urls();
    urls[0] = urls[0].replace("redis://", &format!("redis://{user}:{password}@"));
    let redis = urls.join(",");
    let dir = TempDir::new("cmd-env");
    let (env_file, _) = file_arg(&dir, "env");
    let mut g = Proc::spawn(
        &[
            "guard",
            "--lock",
            "nightly",
            "--ttl",
            "2s",
            "--identity",
            "env-test",
            "--",
            "sh",
            "-c",
            &format!("env > {}", env_file.display()),
        ],
        &[
            ("REDLOCK_REDIS", &redis),
            ("REDLOCK_REDIS_USERNAME", user),
            ("REDLOCK_REDIS_PASSWORD", password),
            ("REDLOCK_WAIT", "5s"),
            ("JOB_SETTING", "kept"),
        ],
    );
    assert_eq!(
        exit_code(&mut g, Duration::from_secs(10)),
        0,
        "guard reached the nodes with those credentials: {}",
        g.output_text()
    );
    let env = std::fs::read_to_string(&env_file).expect("CMD wrote its environment");
    let vars: Vec<(&str, &str)> = env.lines().filter_map(|l| l.split_once('=')).collect();
    let get = |name: &str| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
    assert_eq!(get("REDLOCK_LOCK"), Some("nightly"), "{env}");
    assert_eq!(get("REDLOCK_HOLDER"), Some("env-test"), "{env}");
    assert!(
        get("REDLOCK_FENCING_TOKEN").is_some_and(|t| t.parse::<u64>().is_ok_and(|t| t > 0)),
        "{env}"
    );
    assert_eq!(
        get("JOB_SETTING"),
        Some("kept"),
        "the rest is inherited: {env}"
    );
    let redlock: Vec<&str> = vars
        .iter()
        .map(|(k, _)| *k)
        .filter(|k| k.starts_with("REDLOCK_"))
        .collect();
    assert_eq!(
        redlock.len(),
        3,
        "only the three lock variables, none of guard's settings: {redlock:?}"
    );
    assert!(!env.contains(password), "no credential reaches CMD: {env}");
}

/// How the stalled-guard tests stop guard's own thread while it holds the lock.
#[derive(Clone, Copy, Debug)]
enum Stall {
    /// guard's stderr is a pipe nobody reads, filled; then a renewal fails (two nodes paused
    /// for 1 s), which guard logs.
    StderrFull,
    /// The password file is replaced by a FIFO (as a hung mount behaves) and every client
    /// connection is dropped: guard must read the file again to reconnect.
    PasswordFileBlocks,
    /// guard is SIGSTOPped past the lock's validity.
    Sigstop,
}

/// G1 holds the lock and its CMD appends a line every 20 ms for about 4 s; `stall` stops G1's
/// thread; G2 waits for the lock and appends its own lines while it holds it. Whatever G1 is
/// doing, none of its CMD's lines may fall between G2's: CMD dies before the lock can expire.
fn a_stalled_guard_never_overlaps_the_next_holder(stall: Stall) {
    const PASSWORD: &str = "s3cret";
    let mut cluster = match stall {
        Stall::PasswordFileBlocks => {
            let mut cluster = RedisCluster::start_with(3, &["--requirepass", PASSWORD]);
            for i in 0..3 {
                cluster.node_mut(i).set_auth(None, PASSWORD);
            }
            cluster.wait_votes_count(TTL_SECS);
            cluster
        }
        _ => RedisCluster::ready(3, TTL_SECS),
    };
    let dir = TempDir::new("stalled");
    let sections = dir.path().join("sections");
    let (g1_password, g1_password_arg) = file_arg(&dir, "g1-password");
    let (g2_password, g2_password_arg) = file_arg(&dir, "g2-password");
    std::fs::write(&g1_password, PASSWORD).unwrap();
    std::fs::write(&g2_password, PASSWORD).unwrap();
    let with_password = |file: &str| match stall {
        Stall::PasswordFileBlocks => vec!["--redis-password-file".to_owned(), file.to_owned()],
        _ => vec![],
    };
    let g1_script = format!(
        "i=0; while [ $i -lt 200 ]; do echo g1 >> {0}; sleep 0.02; i=$((i+1)); done",
        sections.display()
    );
    let g1_options = with_password(&g1_password_arg);
    let g1_options: Vec<&str> = g1_options.iter().map(String::as_str).collect();
    let argv = guard_argv(&cluster, "2s", "g1", &g1_options, &sh(&g1_script));
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    // A pipe for G1's stderr: the test keeps the read end and never reads it.
    let (stderr_read, stderr_write) = std::io::pipe().expect("pipe");
    let mut g1 = match stall {
        Stall::StderrFull => Proc::spawn_with_stderr(
            &support::bin(),
            &argv,
            &[("REDLOCK_LOG", "debug")],
            Some(stderr_write.try_clone().unwrap().into()),
        ),
        _ => Proc::spawn(&argv, &[]),
    };
    let started = Instant::now();
    while !std::fs::read_to_string(&sections).is_ok_and(|s| s.contains("g1")) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "G1's CMD did not start: {}",
            g1.output_text()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    match stall {
        Stall::StderrFull => {
            fill_pipe(stderr_write, &stderr_read);
            cluster.node_mut(0).pause();
            cluster.node_mut(1).pause();
            // The fault's length (half the ttl), not a wait for a condition.
            std::thread::sleep(Duration::from_secs(1));
            cluster.node_mut(0).resume();
            cluster.node_mut(1).resume();
        }
        Stall::PasswordFileBlocks => {
            let fifo = dir.path().join("fifo");
            let path = std::ffi::CString::new(fifo.display().to_string()).unwrap();
            // SAFETY: mkfifo reads the NUL-terminated path.
            assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
            std::fs::rename(&fifo, &g1_password).unwrap();
            for node in cluster.iter() {
                for kind in ["normal", "pubsub"] {
                    let _ = node.try_command(&["CLIENT", "KILL", "TYPE", kind]);
                }
            }
        }
        Stall::Sigstop => assert!(g1.sigstop()),
    }
    let g2_script = format!(
        "echo g2-start >> {0}; sleep 1; echo g2-end >> {0}",
        sections.display()
    );
    let mut g2_options = vec!["--wait", "30s"];
    let g2_password_options = with_password(&g2_password_arg);
    g2_options.extend(g2_password_options.iter().map(String::as_str));
    let mut g2 = guard(&cluster, "g2", &g2_options, &sh(&g2_script));
    assert_eq!(
        exit_code(&mut g2, Duration::from_secs(30)),
        0,
        "{}",
        g2.output_text()
    );
    let lines = std::fs::read_to_string(&sections).unwrap();
    let g2_section: Vec<&str> = lines
        .lines()
        .skip_while(|l| *l != "g2-start")
        .take_while(|l| *l != "g2-end")
        .collect();
    assert!(!g2_section.is_empty(), "G2 ran CMD: {lines}");
    let overlapping = g2_section.iter().filter(|l| **l == "g1").count();
    assert_eq!(
        overlapping, 0,
        "{stall:?}: G1's CMD wrote while G2 held the lock"
    );
    if matches!(stall, Stall::Sigstop) {
        assert!(g1.sigcont());
    }
    g1.sigkill();
}

/// Fills the pipe whose ends are `write` and `read` (blocking writes from a thread of their
/// own, which stays blocked), and waits until it is full.
fn fill_pipe(write: std::io::PipeWriter, read: &std::io::PipeReader) {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    std::thread::spawn(move || {
        let mut write = write;
        let chunk = [b'x'; 512];
        while write.write_all(&chunk).is_ok() {}
    });
    // SAFETY: fcntl and ioctl on a pipe descriptor the test owns, writing one local int.
    let capacity = unsafe { libc::fcntl(read.as_raw_fd(), libc::F_GETPIPE_SZ) };
    support::wait_until(Duration::from_secs(10), "G1's stderr pipe is full", || {
        let mut queued: libc::c_int = 0;
        unsafe { libc::ioctl(read.as_raw_fd(), libc::FIONREAD, &mut queued) };
        queued + 512 > capacity
    });
}

#[test]
fn a_guard_blocked_on_a_full_stderr_pipe_stops_cmd_before_the_next_holder_runs() {
    a_stalled_guard_never_overlaps_the_next_holder(Stall::StderrFull);
}

#[test]
fn a_guard_whose_password_file_blocks_stops_cmd_before_the_next_holder_runs() {
    a_stalled_guard_never_overlaps_the_next_holder(Stall::PasswordFileBlocks);
}

#[test]
fn a_sigstopped_guard_has_cmd_killed_before_the_next_holder_runs() {
    a_stalled_guard_never_overlaps_the_next_holder(Stall::Sigstop);
}

#[test]
fn a_password_file_that_blocks_at_start_up_exits_2_naming_the_flag() {
    let dir = TempDir::new("fifo");
    let fifo = dir.path().join("password");
    let path = std::ffi::CString::new(fifo.display().to_string()).unwrap();
    // SAFETY: mkfifo reads the NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let fifo = fifo.display().to_string();
    for command in ["run", "guard"] {
        let mut args = vec![
            command,
            "--lock",
            "nightly",
            "--redis",
            "redis://127.0.0.1:1",
            "--redis-password-file",
            &fifo,
        ];
        if command == "guard" {
            args.extend(["--", "true"]);
        }
        let line = support::process::assert_invalid_config(&args, "--redis-password-file");
        assert!(line.contains("did not finish within"), "{line}");
    }
}

// ------------------------------------------------------------------------------------------------
// Schedule slots (--slot) and slow rounds
// ------------------------------------------------------------------------------------------------

/// The record of slot `id` on each node (`None` where there is none).
fn slot_records(cluster: &RedisCluster, id: &str) -> Vec<Option<String>> {
    let key = format!("redlock:{{nightly}}:slot:{id}");
    cluster
        .iter()
        .map(|node| {
            let value = node.command(&["GET", &key]);
            (value != "(nil)").then_some(value)
        })
        .collect()
}

/// The `outcome=` word and the `fencing_token=` of an outcome file.
fn outcome_of(file: &Path) -> (String, Option<String>) {
    let line = std::fs::read_to_string(file).unwrap_or_default();
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|part| part.strip_prefix(name))
            .map(str::to_owned)
    };
    (
        field("outcome=").unwrap_or_else(|| panic!("no outcome: {line:?}")),
        field("fencing_token="),
    )
}

/// A guard of slot `slot` whose CMD appends its holder to `runs`, with its outcome file.
fn slot_guard(
    cluster: &RedisCluster,
    dir: &TempDir,
    name: &str,
    slot: &str,
    options: &[&str],
    runs: &Path,
) -> (Proc, std::path::PathBuf) {
    let (outcome, path) = file_arg(dir, &format!("outcome-{name}"));
    let mut args = vec!["--slot", slot, "--outcome-file", &path];
    args.extend_from_slice(options);
    let script = format!("echo {name} >> {}", runs.display());
    (guard(cluster, name, &args, &sh(&script)), outcome)
}

fn lines(file: &Path) -> Vec<String> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn two_guards_racing_for_one_slot_run_it_once_and_a_later_guard_of_the_slot_skips_it() {
    let cluster = RedisCluster::ready(3, TTL_SECS);
    let dir = TempDir::new("slot-race");
    let runs = dir.path().join("runs");
    // Both wait: the one that loses the lock takes it once the winner lets go, and must then
    // find the slot recorded.
    let wait = ["--wait", "10s"];
    let (mut a, outcome_a) = slot_guard(&cluster, &dir, "a", "29412345", &wait, &runs);
    let (mut b, outcome_b) = slot_guard(&cluster, &dir, "b", "29412345", &wait, &runs);
    for g in [&mut a, &mut b] {
        assert_eq!(
            exit_code(g, Duration::from_secs(20)),
            0,
            "{}",
            g.output_text()
        );
    }
    assert_eq!(lines(&runs).len(), 1, "CMD ran once: {:?}", lines(&runs));
    let mut outcomes = [outcome_of(&outcome_a), outcome_of(&outcome_b)];
    outcomes.sort();
    let [(skipped, _), (ran, token)] = &outcomes;
    assert_eq!(ran, "ran", "{outcomes:?}");
    assert_eq!(skipped, "already-ran", "{outcomes:?}");
    // Recorded on a quorum, with the fencing token of the run.
    let records = slot_records(&cluster, "29412345");
    assert!(token.is_some());
    assert!(
        records.iter().filter(|r| *r == token).count() >= 2
            && records.iter().all(|r| r.is_none() || r == token),
        "{records:?} vs {token:?}"
    );
    // A node outside the quorum may not have it (guard exits once a quorum has it).
    let holding = records.iter().position(|r| r == token).expect("recorded");
    let pttl: u64 = cluster
        .node(holding)
        .command(&["PTTL", "redlock:{nightly}:slot:29412345"])
        .parse()
        .unwrap();
    assert!(
        pttl > 23 * 3600 * 1000 && pttl <= 24 * 3600 * 1000,
        "{pttl}"
    );

    // A later guard of the slot: no lock contention now, still skipped.
    let (mut c, outcome_c) = slot_guard(&cluster, &dir, "c", "29412345", &[], &runs);
    assert_eq!(exit_code(&mut c, Duration::from_secs(10)), 0);
    assert_eq!(
        outcome_of(&outcome_c).0,
        "already-ran",
        "{}",
        c.output_text()
    );
    assert!(
        c.stderr_text().contains("slot already ran"),
        "{}",
        c.output_text()
    );
    assert_eq!(lines(&runs).len(), 1);
    assert_no_key(&cluster, "the lock is released at once");
    // Another slot of the same lock runs.
    let (mut d, outcome_d) = slot_guard(&cluster, &dir, "d", "29412346", &[], &runs);
    assert_eq!(exit_code(&mut d, Duration::from_secs(10)), 0);
    assert_eq!(outcome_of(&outcome_d).0, "ran", "{}", d.output_text());
    let ran = lines(&runs);
    assert_eq!(ran.len(), 2, "{ran:?}");
    assert_eq!(ran[1], "d");
}

#[test]
fn a_failed_or_lost_run_of_a_slot_is_not_recorded_and_a_retry_runs_it() {
    let mut cluster = RedisCluster::ready(3, TTL_SECS);
    let dir = TempDir::new("slot-failed");
    let runs = dir.path().join("runs");
    let (outcome, path) = file_arg(&dir, "outcome");
    let slot = ["--slot", "s", "--outcome-file", &path];
    let mut g = guard(&cluster, "failing", &slot, &sh("exit 3"));
    assert_eq!(exit_code(&mut g, Duration::from_secs(10)), 3);
    assert_eq!(slot_records(&cluster, "s"), [None, None, None]);

    // Lost: renewals fail (two nodes freeze), CMD gets SIGTERM and exits 0 on it; guard exits
    // 76 and must not record the slot, though CMD's own code is 0 and one node still has the
    // lock key.
    let pid_file = dir.path().join("pid");
    let script = format!(
        "trap 'exit 0' TERM; echo $$ > {}; while true; do sleep 0.05; done",
        pid_file.display()
    );
    let mut g = guard(
        &cluster,
        "losing",
        &[&slot[..], &["--safety-margin", "1s"]].concat(),
        &sh(&script),
    );
    read_pid(&pid_file);
    key_expiry(&cluster, 2);
    cluster.node_mut(0).pause();
    cluster.node_mut(1).pause();
    let code = exit_code(&mut g, Duration::from_secs(10));
    cluster.node_mut(0).resume();
    cluster.node_mut(1).resume();
    assert_eq!(code, 76, "{}", g.output_text());
    assert!(
        g.stderr_text().contains("CMD exited exit_code=0"),
        "CMD itself exited 0: {}",
        g.output_text()
    );
    assert_eq!(outcome_of(&outcome).0, "lost");
    assert_eq!(slot_records(&cluster, "s"), [None, None, None]);

    // A retry runs the slot (once the lost run's keys are gone) and records it.
    let mut g = guard(
        &cluster,
        "retry",
        &[&slot[..], &["--wait", "10s"]].concat(),
        &sh(&format!("echo retry >> {}", runs.display())),
    );
    assert_eq!(
        exit_code(&mut g, Duration::from_secs(20)),
        0,
        "{}",
        g.output_text()
    );
    assert_eq!(outcome_of(&outcome).0, "ran");
    assert_eq!(lines(&runs), ["retry"]);
    assert!(
        slot_records(&cluster, "s")
            .iter()
            .filter(|r| r.is_some())
            .count()
            >= 2
    );
}

#[test]
fn a_slot_record_expires_after_slot_retention_and_the_slot_runs_again() {
    let cluster = RedisCluster::ready(3, TTL_SECS);
    let dir = TempDir::new("slot-retention");
    let runs = dir.path().join("runs");
    // The shortest retention: one ttl (the record must outlive the tenure it was written in).
    let retention = ["--slot-retention", "2s"];
    let (mut g, outcome) = slot_guard(&cluster, &dir, "first", "s", &retention, &runs);
    assert_eq!(exit_code(&mut g, Duration::from_secs(10)), 0);
    assert_eq!(outcome_of(&outcome).0, "ran");
    // A node outside the quorum may not have it (guard exits once a quorum has it).
    let holding = slot_records(&cluster, "s")
        .iter()
        .position(Option::is_some)
        .expect("recorded");
    let pttl: i64 = cluster
        .node(holding)
        .command(&["PTTL", "redlock:{nightly}:slot:s"])
        .parse()
        .unwrap();
    assert!(pttl > 0 && pttl <= 2000, "{pttl}");
    support::wait_until(Duration::from_secs(10), "the record expires", || {
        slot_records(&cluster, "s").iter().all(Option::is_none)
    });
    let (mut g, outcome) = slot_guard(&cluster, &dir, "second", "s", &retention, &runs);
    assert_eq!(exit_code(&mut g, Duration::from_secs(10)), 0);
    assert_eq!(outcome_of(&outcome).0, "ran", "{}", g.output_text());
    assert_eq!(lines(&runs), ["first", "second"]);
}

#[test]
fn invalid_slot_options_exit_2_with_one_line_naming_the_option() {
    let long = "x".repeat(129);
    let base = ["guard", "--lock", "x", "--redis", "redis://127.0.0.1:1"];
    let cases: &[(&[&str], &str)] = &[
        (&["--slot", "a b"], "--slot"),
        (&["--slot", "a\nb"], "--slot"),
        (&["--slot", &long], "--slot"),
        (&["--slot", ""], "--slot"),
        (
            &["--slot", "s", "--slot-retention", "0"],
            "--slot-retention",
        ),
        (
            &["--slot", "s", "--slot-retention", "31d"],
            "--slot-retention",
        ),
        (
            &["--slot", "s", "--slot-retention", "soon"],
            "--slot-retention",
        ),
    ];
    for (extra, option) in cases {
        let args = [&base[..], extra, &["--", "true"]].concat();
        support::process::assert_invalid_config(&args, option);
    }
    // From the environment too (REDLOCK_SLOT, for the Kubernetes downward API).
    support::process::assert_invalid_config_with_env(
        &[&base[..], &["--", "true"]].concat(),
        &[("REDLOCK_SLOT", "two words")],
        "--slot",
    );
}

#[test]
fn thirty_guards_of_one_slot_whose_first_rounds_time_out_run_it_once_and_never_exit_69() {
    // A loaded host, made certain: every node holds every guard's rounds (CLIENT PAUSE) past
    // the default 50 ms node timeout until all 30 have sent one (the first ones have long
    // timed out by then; a guard that took that for an outage has ended, with 69), then lets
    // them go. All nodes are up all along: no guard may give up with 69.
    let cluster = RedisCluster::start(3);
    cluster.backdate_epochs(Duration::from_secs(10));
    let dir = TempDir::new("slow-herd");
    let runs = dir.path().join("runs");
    for node in cluster.iter() {
        node.command(&["CLIENT", "PAUSE", "30000", "WRITE"]);
    }
    let mut guards: Vec<(Proc, std::path::PathBuf)> = (0..30)
        .map(|i| {
            let name = format!("herd-{i}");
            let (outcome, path) = file_arg(&dir, &format!("outcome-{name}"));
            let script = format!("echo {name} >> {}", runs.display());
            let g = guard_with_ttl(
                &cluster,
                "10s",
                &name,
                &["--slot", "herd", "--outcome-file", &path],
                &sh(&script),
            );
            (g, outcome)
        })
        .collect();
    support::wait_until(
        Duration::from_secs(20),
        "30 guards' rounds wait on every node, or a guard ended",
        || {
            let blocked = cluster.iter().all(|node| {
                node.command(&["INFO", "clients"])
                    .lines()
                    .any(|l| l.trim() == "blocked_clients:30")
            });
            blocked || guards.iter_mut().any(|(g, _)| !g.is_running())
        },
    );
    for node in cluster.iter() {
        node.command(&["CLIENT", "UNPAUSE"]);
    }
    let mut words = Vec::new();
    for (g, outcome) in &mut guards {
        let code = exit_code(g, Duration::from_secs(30));
        assert_eq!(
            code,
            0,
            "never 69 while every node is up: {}",
            g.output_text()
        );
        words.push(outcome_of(outcome).0);
    }
    assert_eq!(lines(&runs).len(), 1, "CMD ran once: {:?}", lines(&runs));
    assert_eq!(words.iter().filter(|w| *w == "ran").count(), 1, "{words:?}");
    assert!(
        words
            .iter()
            .all(|w| ["ran", "skipped", "already-ran"].contains(&w.as_str())),
        "{words:?}"
    );
}

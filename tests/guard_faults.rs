//! `redlock-sidecar guard` under faults of guard and of the processes it keeps between
//! itself and CMD, through the real binary on real redis-server nodes.
//!
//! Each fault case stops or kills guard and one of its helper processes (found the way an
//! operator or a fault harness would find them: guard's own child, or CMD's parent), while
//! CMD's tree has a writer that left CMD's session (`setsid`, double fork) and a plain
//! background writer. A second guard waits for the lock and writes its own section: no write
//! of the first tree may fall into it, and the first tree must be dead before the first
//! lock's validity ends.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use support::{Proc, RedisCluster, TempDir};

/// The ttl every guard here runs with.
const TTL: Duration = Duration::from_secs(2);

/// guard's argv for lock `lock` with a ttl of 2 s and timings for a loaded 2-core machine.
fn guard_argv(
    cluster: &RedisCluster,
    lock: &str,
    identity: &str,
    options: &[&str],
    cmd: &[&str],
) -> Vec<String> {
    let redis = cluster.urls_joined();
    let mut args = vec![
        "guard",
        "--lock",
        lock,
        "--redis",
        &redis,
        "--ttl",
        "2s",
        "--retry-delay",
        "20ms",
        "--identity",
        identity,
        "--safety-margin",
        "300ms",
        "--kill-grace",
        "300ms",
        "--node-timeout",
        "250ms",
    ];
    args.extend_from_slice(options);
    args.push("--");
    args.extend_from_slice(cmd);
    args.into_iter().map(str::to_owned).collect()
}

fn guard(
    cluster: &RedisCluster,
    lock: &str,
    identity: &str,
    options: &[&str],
    cmd: &[&str],
) -> Proc {
    let argv = guard_argv(cluster, lock, identity, options, cmd);
    Proc::spawn(&argv.iter().map(String::as_str).collect::<Vec<_>>(), &[])
}

fn sh(script: &str) -> Vec<&str> {
    vec!["sh", "-c", script]
}

/// `(state, ppid, session)` of `pid`, from `/proc/PID/stat`.
fn stat(pid: i32) -> Option<(char, i32, i32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut fields = text[text.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    let _pgrp = fields.next()?;
    let session = fields.next()?.parse().ok()?;
    Some((state, ppid, session))
}

/// Alive: exists and is not a zombie.
fn alive(pid: i32) -> bool {
    stat(pid).is_some_and(|(state, _, _)| state != 'Z' && state != 'X')
}

fn stopped(pid: i32) -> bool {
    stat(pid).is_some_and(|(state, _, _)| state == 'T' || state == 't')
}

/// The live children of `pid`.
fn children_of(pid: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&p| stat(p).is_some_and(|(s, ppid, _)| ppid == pid && s != 'Z'))
        .collect()
}

fn read_pid(file: &Path) -> i32 {
    let mut pid = 0;
    support::wait_until(Duration::from_secs(10), "a pid file is written", || {
        pid = std::fs::read_to_string(file)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        pid > 0
    });
    pid
}

/// The earliest instant at which the key of `lock` expires on some node (read at once).
fn earliest_expiry(cluster: &RedisCluster, lock: &str) -> Instant {
    let key = format!("redlock:{{{lock}}}");
    cluster
        .iter()
        .filter_map(|node| {
            let read_at = Instant::now();
            let pttl: i64 = node.command(&["PTTL", &key]).parse().ok()?;
            (pttl > 0).then(|| read_at + Duration::from_millis(pttl as u64))
        })
        .min()
        .expect("the key is set on some node")
}

fn signal(pid: i32, sig: i32) {
    support::send_signal(pid as u32, sig);
    if sig == libc::SIGSTOP {
        support::wait_stopped_state(pid as u32, true);
    }
}

/// Kills what a case leaves behind, also when it fails: the processes it names, where they
/// are still the ones it started (their command line names the case's directory, or they are
/// the binary's helpers).
struct Leftovers {
    pids: Vec<i32>,
    dir: String,
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        for &pid in &self.pids {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            if alive(pid) && (cmdline.contains(&self.dir) || cmdline.contains("supervise")) {
                support::send_signal(pid as u32, libc::SIGKILL);
            }
        }
    }
}

/// What happens to a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    Nothing,
    Stop,
    Kill,
}

/// Which helper process the second fault hits, found as a fault harness would find it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Helper {
    /// guard's own child process.
    GuardsChild,
    /// CMD's parent process.
    CmdsParent,
}

/// A writer script: writes its pid to $1, then appends $2 to $3 every 20 ms, forever.
const WRITER: &str = "echo $$ > \"$1\"; while :; do echo \"$2\" >> \"$3\"; sleep 0.02; done";

/// G1 runs a tree with a setsid double-forked writer and a plain background writer; the
/// faults hit G1 and one of its helpers; G2 waits for the lock and writes its section.
fn the_tree_dies_by_the_locks_expiry(guard_fault: Fault, helper: Helper, helper_fault: Fault) {
    let case = format!("guard {guard_fault:?}, {helper:?} {helper_fault:?}");
    let mut cluster = RedisCluster::ready(3, TTL);
    let dir = TempDir::new("tree-faults");
    let file = |name: &str| dir.path().join(name);
    std::fs::write(file("writer.sh"), WRITER).unwrap();
    let sections = file("sections");
    let script = format!(
        "echo $$ > {sh}; echo $PPID > {parent}; \
         setsid sh -c 'sh {writer} {escaped} g1-setsid {sections} & exit 0'; \
         sh {writer} {bg} g1-bg {sections} & \
         wait",
        sh = file("sh").display(),
        parent = file("parent").display(),
        writer = file("writer.sh").display(),
        escaped = file("escaped").display(),
        bg = file("bg").display(),
        sections = sections.display(),
    );
    let mut g1 = guard(&cluster, "nightly", "g1", &[], &sh(&script));
    let cmd = read_pid(&file("sh"));
    let cmds_parent = read_pid(&file("parent"));
    let escaped = read_pid(&file("escaped"));
    let bg = read_pid(&file("bg"));
    // The double fork is complete once the escaped writer was re-parented.
    support::wait_until(
        Duration::from_secs(5),
        "the setsid writer is orphaned",
        || stat(escaped).is_some_and(|(_, ppid, _)| ppid == cmds_parent),
    );
    assert_ne!(
        stat(escaped).map(|s| s.2),
        stat(cmd).map(|s| s.2),
        "the escaped writer left CMD's session"
    );
    support::wait_until(Duration::from_secs(5), "both writers write", || {
        let text = std::fs::read_to_string(&sections).unwrap_or_default();
        text.contains("g1-setsid") && text.contains("g1-bg")
    });
    let guard_pid = g1.pid() as i32;
    let guards_children = children_of(guard_pid);
    assert_eq!(guards_children.len(), 1, "{case}: {guards_children:?}");
    let target = match helper {
        Helper::GuardsChild => guards_children[0],
        Helper::CmdsParent => cmds_parent,
    };
    let helpers: Vec<i32> = {
        let mut h = vec![guards_children[0], cmds_parent];
        h.dedup();
        h
    };
    let tree = [cmd, bg, escaped];
    let _leftovers = Leftovers {
        pids: tree.iter().chain(&helpers).copied().collect(),
        dir: dir.path().display().to_string(),
    };

    match guard_fault {
        Fault::Nothing => {}
        Fault::Stop => assert!(g1.sigstop()),
        Fault::Kill => assert!(g1.sigkill()),
    }
    match helper_fault {
        Fault::Nothing => {}
        Fault::Stop => signal(target, libc::SIGSTOP),
        Fault::Kill => signal(target, libc::SIGKILL),
    }
    // Once guard can no longer renew (and a renewal it had sent is answered), the lock's
    // validity is fixed: the earliest expiry on any node.
    let faulted_at = Instant::now();
    std::thread::sleep(Duration::from_millis(50));
    let expiry = (guard_fault != Fault::Nothing).then(|| earliest_expiry(&cluster, "nightly"));
    let g2_script = format!(
        "echo g2-start >> {0}; sleep 1; echo g2-end >> {0}",
        sections.display()
    );
    let mut g2 = guard(
        &cluster,
        "nightly",
        "g2",
        &["--wait", "30s"],
        &sh(&g2_script),
    );
    if guard_fault == Fault::Nothing && helper_fault == Fault::Stop {
        // guard renews on and CMD may run on: cut guard off from a quorum past the validity,
        // so that it must stop CMD with one of its helpers stopped.
        cluster.node_mut(0).pause();
        cluster.node_mut(1).pause();
        std::thread::sleep(TTL + Duration::from_millis(500));
        cluster.node_mut(0).resume();
        cluster.node_mut(1).resume();
    }
    support::wait_until(TTL * 3, &format!("{case}: G1's tree is dead"), || {
        tree.iter().all(|&pid| !alive(pid))
    });
    let dead_at = Instant::now();
    if let Some(expiry) = expiry {
        eprintln!(
            "{case}: G1's tree dead {:?} after the fault, {:?} before the lock's expiry",
            dead_at - faulted_at,
            expiry.saturating_duration_since(dead_at)
        );
        assert!(
            dead_at <= expiry,
            "{case}: G1's tree outlived the lock's validity by {:?}",
            dead_at - expiry
        );
    }
    let status = g2
        .wait_exit(Duration::from_secs(30))
        .unwrap_or_else(|| panic!("{case}: G2 did not exit: {}", g2.output_text()));
    assert_eq!(status.code(), Some(0), "{case}: {}", g2.output_text());
    // Anything of G1's still alive would keep writing: give it time to show.
    std::thread::sleep(Duration::from_millis(300));
    let text = std::fs::read_to_string(&sections).unwrap();
    let after: Vec<&str> = text.lines().skip_while(|l| *l != "g2-start").collect();
    assert!(after.contains(&"g2-end"), "{case}: G2 ran CMD: {text}");
    let late = after.iter().filter(|l| l.starts_with("g1")).count();
    assert_eq!(
        late, 0,
        "{case}: G1's tree wrote {late} lines after G2's CMD started"
    );

    // Stopped processes, once continued, end on their own.
    for &pid in &helpers {
        if stopped(pid) {
            signal(pid, libc::SIGCONT);
        }
    }
    if guard_fault == Fault::Stop {
        assert!(g1.sigcont());
    }
    if guard_fault != Fault::Kill {
        let status = g1
            .wait_exit(Duration::from_secs(15))
            .unwrap_or_else(|| panic!("{case}: G1 did not exit: {}", g1.output_text()));
        assert_ne!(status.code(), Some(0), "{case}: CMD did not finish");
        if helper_fault != Fault::Kill {
            // The lock was lost (guard stopped past it, or cut off): CMD was stopped for it.
            assert_eq!(status.code(), Some(76), "{case}: {}", g1.output_text());
        }
    }
    support::wait_until(
        Duration::from_secs(10),
        &format!("{case}: G1's helpers end"),
        || helpers.iter().all(|&pid| !alive(pid)),
    );
}

#[test]
fn sigstop_guard_and_sigkill_cmds_parent() {
    the_tree_dies_by_the_locks_expiry(Fault::Stop, Helper::CmdsParent, Fault::Kill);
}

#[test]
fn sigstop_guard_and_sigkill_guards_child() {
    the_tree_dies_by_the_locks_expiry(Fault::Stop, Helper::GuardsChild, Fault::Kill);
}

#[test]
fn sigstop_guard_and_sigstop_cmds_parent() {
    the_tree_dies_by_the_locks_expiry(Fault::Stop, Helper::CmdsParent, Fault::Stop);
}

#[test]
fn sigstop_guard_and_sigstop_guards_child() {
    the_tree_dies_by_the_locks_expiry(Fault::Stop, Helper::GuardsChild, Fault::Stop);
}

#[test]
fn sigkill_guard_and_sigstop_cmds_parent() {
    the_tree_dies_by_the_locks_expiry(Fault::Kill, Helper::CmdsParent, Fault::Stop);
}

#[test]
fn sigkill_guard_and_sigstop_guards_child() {
    the_tree_dies_by_the_locks_expiry(Fault::Kill, Helper::GuardsChild, Fault::Stop);
}

#[test]
fn sigkill_guard_and_sigkill_cmds_parent() {
    the_tree_dies_by_the_locks_expiry(Fault::Kill, Helper::CmdsParent, Fault::Kill);
}

#[test]
fn sigkill_guard_and_sigkill_guards_child() {
    the_tree_dies_by_the_locks_expiry(Fault::Kill, Helper::GuardsChild, Fault::Kill);
}

#[test]
fn sigstop_guard_alone() {
    the_tree_dies_by_the_locks_expiry(Fault::Stop, Helper::CmdsParent, Fault::Nothing);
}

#[test]
fn sigkill_guard_alone() {
    the_tree_dies_by_the_locks_expiry(Fault::Kill, Helper::CmdsParent, Fault::Nothing);
}

#[test]
fn sigstop_cmds_parent_alone() {
    the_tree_dies_by_the_locks_expiry(Fault::Nothing, Helper::CmdsParent, Fault::Stop);
}

#[test]
fn sigstop_guards_child_alone() {
    the_tree_dies_by_the_locks_expiry(Fault::Nothing, Helper::GuardsChild, Fault::Stop);
}

#[test]
fn sigkill_cmds_parent_alone() {
    the_tree_dies_by_the_locks_expiry(Fault::Nothing, Helper::CmdsParent, Fault::Kill);
}

#[test]
fn sigkill_guards_child_alone() {
    the_tree_dies_by_the_locks_expiry(Fault::Nothing, Helper::GuardsChild, Fault::Kill);
}

// ------------------------------------------------------------------------------------------------
// Exit 76 whenever CMD was stopped for the lock, and a slot whose record was not written
// ------------------------------------------------------------------------------------------------

/// The `outcome=` word of an outcome file.
fn outcome_of(file: &Path) -> String {
    let line = std::fs::read_to_string(file).unwrap_or_default();
    line.split_whitespace()
        .find_map(|part| part.strip_prefix("outcome="))
        .unwrap_or_else(|| panic!("no outcome: {line:?}"))
        .to_owned()
}

/// The record of slot `id` of `lock` on each node (`None` where there is none).
fn slot_records(cluster: &RedisCluster, lock: &str, id: &str) -> Vec<Option<String>> {
    let key = format!("redlock:{{{lock}}}:slot:{id}");
    cluster
        .iter()
        .map(|node| {
            let value = node.command(&["GET", &key]);
            (value != "(nil)").then_some(value)
        })
        .collect()
}

#[test]
fn a_guard_stopped_past_its_lock_exits_76_lost_every_time() {
    let cluster = RedisCluster::ready(3, TTL);
    let dir = TempDir::new("stopped-lost");
    // CMD dies of SIGTERM, exits 0 on it (it must not count as done), or ignores it.
    let cmds = [
        "exec sleep 300",
        "trap 'exit 0' TERM; while :; do sleep 0.05; done",
        "trap '' TERM; while :; do sleep 0.05; done",
    ];
    for run in 0..6 {
        let started = dir.path().join(format!("started-{run}"));
        let outcome = dir.path().join(format!("outcome-{run}"));
        let (lock, slot) = (format!("stopped-{run}"), format!("slot-{run}"));
        let script = format!("touch {}; {}", started.display(), cmds[run % 3]);
        let outcome_arg = outcome.display().to_string();
        let options = ["--outcome-file", &outcome_arg, "--slot", &slot];
        let mut g = guard(&cluster, &lock, "g", &options, &sh(&script));
        support::wait_until(Duration::from_secs(10), "CMD runs", || started.exists());
        assert!(g.sigstop());
        // Past the lock's validity: the helpers stop CMD meanwhile.
        std::thread::sleep(TTL + Duration::from_secs(1));
        assert!(g.sigcont());
        let status = g
            .wait_exit(Duration::from_secs(10))
            .unwrap_or_else(|| panic!("run {run}: guard did not exit: {}", g.output_text()));
        assert_eq!(
            (status.code(), outcome_of(&outcome).as_str()),
            (Some(76), "lost"),
            "run {run} ({}): {}",
            cmds[run % 3],
            g.output_text()
        );
        assert!(
            slot_records(&cluster, &lock, &slot)
                .iter()
                .all(Option::is_none),
            "run {run}: a stopped run records nothing"
        );
    }
}

/// How the nodes fail to take a slot's record.
#[derive(Clone, Copy, Debug)]
enum RecordFault {
    /// Two of three nodes paused (SIGSTOP) as CMD exits: cut off.
    CutOff,
    /// Two of three nodes refuse writes (`maxmemory` below their use) as CMD exits.
    Unwritable,
}

fn a_slot_whose_record_reaches_too_few_nodes_is_unrecorded(fault: RecordFault) {
    let mut cluster = RedisCluster::ready(3, TTL);
    let dir = TempDir::new("unrecorded");
    let (ready, go) = (dir.path().join("ready"), dir.path().join("go"));
    let outcome = dir.path().join("outcome");
    let outcome_arg = outcome.display().to_string();
    let script = format!(
        "touch {}; while [ ! -e {} ]; do sleep 0.01; done; exit 0",
        ready.display(),
        go.display()
    );
    let options = ["--outcome-file", &outcome_arg, "--slot", "29412345"];
    let mut g = guard(&cluster, "slots", "g", &options, &sh(&script));
    support::wait_until(Duration::from_secs(10), "CMD runs", || ready.exists());
    match fault {
        RecordFault::CutOff => {
            cluster.node_mut(0).pause();
            cluster.node_mut(1).pause();
        }
        RecordFault::Unwritable => {
            for i in 0..2 {
                cluster
                    .node(i)
                    .command(&["CONFIG", "SET", "maxmemory", "1"]);
            }
        }
    }
    std::fs::write(&go, "").unwrap();
    let status = g
        .wait_exit(Duration::from_secs(15))
        .unwrap_or_else(|| panic!("{fault:?}: guard did not exit: {}", g.output_text()));
    match fault {
        RecordFault::CutOff => {
            cluster.node_mut(0).resume();
            cluster.node_mut(1).resume();
        }
        RecordFault::Unwritable => {
            for i in 0..2 {
                cluster
                    .node(i)
                    .command(&["CONFIG", "SET", "maxmemory", "0"]);
            }
        }
    }
    assert_eq!(
        (status.code(), outcome_of(&outcome).as_str()),
        (Some(69), "unrecorded"),
        "{fault:?}: {}",
        g.output_text()
    );
    assert!(
        g.stderr_text().contains("may run it again"),
        "{fault:?}: the log says so: {}",
        g.output_text()
    );
    let records = slot_records(&cluster, "slots", "29412345");
    assert!(
        records.iter().flatten().count() < 2,
        "{fault:?}: fewer than a quorum hold it: {records:?}"
    );
}

#[test]
fn a_slot_whose_nodes_are_cut_off_as_cmd_exits_is_unrecorded_and_exits_69() {
    a_slot_whose_record_reaches_too_few_nodes_is_unrecorded(RecordFault::CutOff);
}

#[test]
fn a_slot_whose_nodes_refuse_writes_as_cmd_exits_is_unrecorded_and_exits_69() {
    a_slot_whose_record_reaches_too_few_nodes_is_unrecorded(RecordFault::Unwritable);
}

// ------------------------------------------------------------------------------------------------
// A stopped helper with guard running
// ------------------------------------------------------------------------------------------------

/// CMD ends on its own (exit 3, a background child left behind) while one helper is stopped:
/// guard still passes CMD's code on, kills what CMD left, and releases the lock at once.
fn a_stopped_helper_neither_keeps_the_lock_nor_hides_cmds_code(helper: Helper) {
    let cluster = RedisCluster::ready(3, TTL);
    let dir = TempDir::new("stopped-helper");
    let file = |name: &str| dir.path().join(name);
    let script = format!(
        "echo $PPID > {parent}; touch {ready}; while [ ! -e {go} ]; do sleep 0.01; done; \
         sleep 300 & echo $! > {left}; exit 3",
        parent = file("parent").display(),
        ready = file("ready").display(),
        go = file("go").display(),
        left = file("left").display(),
    );
    let mut g = guard(&cluster, "nightly", "g", &[], &sh(&script));
    support::wait_until(Duration::from_secs(10), "CMD runs", || {
        file("ready").exists()
    });
    let cmds_parent = read_pid(&file("parent"));
    let guards_child = children_of(g.pid() as i32)[0];
    let target = match helper {
        Helper::GuardsChild => guards_child,
        Helper::CmdsParent => cmds_parent,
    };
    let _leftovers = Leftovers {
        pids: vec![guards_child, cmds_parent],
        dir: dir.path().display().to_string(),
    };
    signal(target, libc::SIGSTOP);
    std::fs::write(file("go"), "").unwrap();
    let left = read_pid(&file("left"));
    let status = g
        .wait_exit(Duration::from_secs(5))
        .unwrap_or_else(|| panic!("{helper:?}: guard did not exit: {}", g.output_text()));
    assert_eq!(status.code(), Some(3), "{helper:?}: {}", g.output_text());
    assert!(!alive(left), "{helper:?}: what CMD left behind is killed");
    assert!(
        !alive(guards_child) && !alive(cmds_parent),
        "{helper:?}: the helpers are gone"
    );
    let key = cluster.node(0).command(&["EXISTS", "redlock:{nightly}"]);
    assert_eq!(key, "0", "{helper:?}: the lock is released");
}

#[test]
fn a_stopped_supervisor_neither_keeps_the_lock_nor_hides_cmds_code() {
    a_stopped_helper_neither_keeps_the_lock_nor_hides_cmds_code(Helper::CmdsParent);
}

#[test]
fn a_stopped_watchdog_neither_keeps_the_lock_nor_hides_cmds_code() {
    a_stopped_helper_neither_keeps_the_lock_nor_hides_cmds_code(Helper::GuardsChild);
}

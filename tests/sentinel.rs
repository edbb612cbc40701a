//! A Sentinel-monitored group as one node (`redis+sentinel://`), through the real binary: two
//! `run` sidecars contend on one group (N = 1) of a master, a replica and three real Sentinels,
//! and the group fails over under a held lock: `SENTINEL FAILOVER`, and a killed master whose
//! replica missed the lock key.
//!
//! Every test polls each sidecar's `/leader` all along ([`Watch`]) and checks, from the answers
//! and the logs, that no claim begins before the previous one has ended and that fencing tokens
//! grow. After a failover the new master's epoch marker is young (its run id and replication
//! id are new), so its grants count only ttl + drift after the first contender met it: that is
//! what keeps a second holder out when the new master missed the key, and it is checked here
//! against the marker itself.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::time::{Duration, SystemTime};

use redlock_sidecar::redlock::{votes, EPOCH_KEY};
use support::failover::{leader_after, Contender, SLACK, TTL};
use support::sentinel::SentinelGroup;
use support::tenures::{ms_between, Watch};
use support::{Proc, RedisNode, TempDir};
use tokio::task::block_in_place;

const LOCK: &str = "sentinel";
const KEY: &str = "redlock:{sentinel}";
/// A leads on the group's first master, B follows and sees A hold the lock.
async fn a_leads_and_b_follows(group: &SentinelGroup) -> (Watch, Contender, Contender) {
    // The master has been up for long: its grants count at once.
    group.master.backdate_epoch(Duration::from_secs(60));
    let url = group.url();
    let mut watch = Watch::new();
    let a = Contender::start(LOCK, "a", &url);
    watch.add(&a);
    watch
        .next_tenure(SystemTime::UNIX_EPOCH, Some("a"), "a leads", &[&a])
        .await;
    let b = Contender::start(LOCK, "b", &url);
    watch.add(&b);
    support::wait_until_async(
        Duration::from_secs(10),
        "b sees a hold the lock",
        || async { b.holder().await.as_deref() == Some("a") },
    )
    .await;
    (watch, a, b)
}

/// The age of `node`'s epoch marker, if it holds the node's own lineage (read-only).
fn marker_age(node: &RedisNode) -> Option<Duration> {
    let marker = node.try_command(&["GET", EPOCH_KEY]).ok()?;
    let pttl: i64 = node.try_command(&["PTTL", EPOCH_KEY]).ok()?.parse().ok()?;
    votes::data_age(&marker, pttl, &node.lineage()?)
}

/// `check` on `redis`, with extra flags: exit code and stdout.
fn check(redis: &str, extra: &[&str]) -> (i32, String) {
    let mut args = vec!["check", "--redis", redis, "--ttl", "2s"];
    args.extend(extra);
    let mut proc = Proc::spawn(&args, &[]);
    let status = proc
        .wait_exit(Duration::from_secs(20))
        .expect("check exits");
    (status.code().unwrap_or(-1), proc.output_text())
}

fn secs(from: SystemTime, to: SystemTime) -> f64 {
    ms_between(from, to) / 1e3
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_under_a_held_lock_keeps_one_leader_and_follows_the_new_master() {
    let group = block_in_place(SentinelGroup::start);
    let (mut watch, a, b) = a_leads_and_b_follows(&group).await;
    let (_, out) = block_in_place(|| check(&group.url(), &[]));
    assert!(
        out.contains(&format!(
            "Sentinel group mymaster: master 127.0.0.1:{} with 1 replica",
            group.master.port()
        )),
        "{out}"
    );

    let started = SystemTime::now();
    block_in_place(|| {
        group.failover();
        group.wait_master_is(group.replica.port());
    });
    let switched = SystemTime::now();
    let back = leader_after(&watch, switched, &[&a, &b]).await;
    // Followed: the leader's renewals now land on the promoted replica.
    support::wait_until_async(
        Duration::from_secs(10),
        "the new master holds a sidecar's key",
        || async {
            let value = group.replica.try_command(&["GET", KEY]).unwrap_or_default();
            value.starts_with("a:") || value.starts_with("b:")
        },
    )
    .await;
    let failover = secs(started, switched);
    let bound = failover + votes::required_data_age(TTL).as_secs_f64() + SLACK.as_secs_f64();
    println!(
        "SENTINEL FAILOVER: sentinels switched after {failover:.2} s; a leader answered {:.2} s \
         after that",
        secs(switched, back)
    );
    assert!(
        secs(started, back) <= bound,
        "leadership back within failover time + ttl + drift + {SLACK:?}"
    );
    let (_, out) = block_in_place(|| check(&group.url(), &[]));
    assert!(
        out.contains(&format!("master 127.0.0.1:{}", group.replica.port())),
        "check follows the group:\n{out}"
    );

    a.stop(&mut watch).await;
    b.stop(&mut watch).await;
    let running: [&Contender; 0] = [];
    watch.finish(&running).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_whose_replica_missed_the_key_gives_no_second_leader_before_ttl_plus_drift()
{
    let mut group = block_in_place(SentinelGroup::start);
    let (mut watch, a, b) = a_leads_and_b_follows(&group).await;
    // The replica loses A's key (as if the write never reached it) and the master dies: the
    // promoted replica has a free key for anyone who asks.
    assert_eq!(
        group
            .replica
            .command(&["CONFIG", "SET", "replica-read-only", "no"]),
        "OK"
    );
    assert_eq!(group.replica.command(&["DEL", KEY]), "1");
    assert!(group.master.command(&["GET", KEY]).starts_with("a:"));
    let killed = SystemTime::now();
    group.master.stop();
    block_in_place(|| group.wait_master_is(group.replica.port()));
    let switched = SystemTime::now();
    let next = watch
        .next_tenure(killed, None, "a leader on the new master", &[&a, &b])
        .await;
    // Its grants counted only once its marker, stamped after the promotion, was ttl + drift old.
    let age = block_in_place(|| marker_age(&group.replica)).expect("the new master's marker");
    let stamped = SystemTime::now() - age;
    let required = votes::required_data_age(TTL);
    println!(
        "killed master: sentinels switched after {:.2} s; marker stamped {:.2} s after the kill; \
         next leader's round began {:.2} s after the stamp (ttl + drift = {:.2} s)",
        secs(killed, switched),
        secs(killed, stamped),
        secs(stamped, next.since),
        required.as_secs_f64()
    );
    assert!(
        stamped > killed,
        "the marker was stamped after the failover"
    );
    // `stamped` is read back to the millisecond, from the node's clock.
    assert!(
        next.claimed_after + Duration::from_millis(5) >= stamped + required,
        "no grant of the new master counted before ttl + drift: round began {:.3} s after the stamp",
        secs(stamped, next.since)
    );
    assert!(
        secs(killed, next.claimed_after)
            <= secs(killed, switched) + required.as_secs_f64() + SLACK.as_secs_f64(),
        "leadership back within failover time + ttl + drift + {SLACK:?}"
    );

    a.stop(&mut watch).await;
    b.stop(&mut watch).await;
    let running: [&Contender; 0] = [];
    watch.finish(&running).await;
}

#[test]
fn sentinels_and_the_master_each_get_their_own_password_and_neither_is_shown() {
    let group = SentinelGroup::start_with_passwords(Some("data-pw"), Some("sentinel-pw"));
    let hosts: Vec<String> = group
        .sentinels
        .iter()
        .map(|s| format!("127.0.0.1:{}", s.port()))
        .collect();
    let url = format!("redis+sentinel://:data-pw@{}/mymaster", hosts.join(","));
    let dir = TempDir::new("sentinel-password");
    let file = dir.path().join("password");
    std::fs::write(&file, "sentinel-pw\n").unwrap();
    let file = file.to_str().unwrap();

    let (code, out) = check(&url, &["--sentinel-password-file", file]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!(
            "master 127.0.0.1:{} with 1 replica",
            group.master.port()
        )),
        "{out}"
    );
    assert!(
        out.contains("verdict: unsafe because mymaster@") && out.contains("min-replicas-to-write"),
        "{out}"
    );
    group
        .master
        .command(&["CONFIG", "SET", "min-replicas-to-write", "1"]);
    let (_, out) = check(&url, &["--sentinel-password-file", file]);
    assert!(
        out.contains(
            "verdict: safe; survives no node loss; one failover makes the lock unavailable"
        ),
        "{out}"
    );

    // Without the Sentinels' password, no Sentinel answers; and the master's alone is not theirs.
    let (code, out) = check(&url, &[]);
    assert_eq!(code, 69, "{out}");
    assert!(
        out.contains("no Sentinel of mymaster answered") && out.contains("auth"),
        "{out}"
    );
    let (code, wrong) = check(&url, &["--sentinel-password", "data-pw"]);
    assert_eq!(code, 69, "{wrong}");
    for text in [&out, &wrong] {
        assert!(
            !text.contains("data-pw") && !text.contains("sentinel-pw"),
            "no password shows:\n{text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_sentinel_password_file_is_used_by_the_next_connections() {
    let group = SentinelGroup::start_with_passwords(None, Some("old-pw"));
    group.master.backdate_epoch(Duration::from_secs(60));
    let dir = TempDir::new("sentinel-rotation");
    let file = dir.path().join("password");
    std::fs::write(&file, "old-pw\n").unwrap();
    let file_arg = file.display().to_string();
    let a = Contender::start_with(
        LOCK,
        "a",
        &group.url(),
        &["--sentinel-password-file", &file_arg],
    );
    support::wait_until_async(Duration::from_secs(15), "a leads", || async {
        a.holder().await.as_deref() == Some("a")
    })
    .await;
    // The Sentinels now accept only the new password, and the file holds it (renamed over
    // the old one, as a Secret volume updates).
    for sentinel in &group.sentinels {
        let answer = sentinel.try_command(&["ACL", "SETUSER", "default", "resetpass", ">new-pw"]);
        assert_eq!(answer.as_deref(), Ok("OK"));
    }
    let next = dir.path().join("password.new");
    std::fs::write(&next, "new-pw\n").unwrap();
    std::fs::rename(&next, &file).unwrap();
    // Every connection to the master is dropped: the next one is made through the Sentinels.
    let sidecar_clients = || {
        let list = group.master.command(&["CLIENT", "LIST"]);
        // The sidecar's (RESP3, with its pushes), not the replica's, the Sentinels' or this test's.
        list.lines().filter(|l| l.contains("resp=3")).count()
    };
    assert!(
        sidecar_clients() > 0,
        "the sidecar is connected to the master"
    );
    for kind in ["normal", "pubsub"] {
        let _ = group.master.try_command(&["CLIENT", "KILL", "TYPE", kind]);
    }
    support::wait_until(
        Duration::from_secs(5),
        "the sidecar's connections are gone",
        || sidecar_clients() == 0,
    );
    support::wait_until(
        Duration::from_secs(10),
        "the sidecar reconnected to the master through the Sentinels",
        || sidecar_clients() > 0,
    );
    support::wait_until_async(Duration::from_secs(10), "a leads again", || async {
        a.holder().await.as_deref() == Some("a")
    })
    .await;
    assert!(
        !a.proc.output_text().contains("new-pw") && !a.proc.output_text().contains("old-pw"),
        "no password shows"
    );
}

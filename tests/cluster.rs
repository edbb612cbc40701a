//! A Redis Cluster endpoint as one voter, against a real local cluster built with the cluster
//! commands (3 masters, with or without a replica each).
//!
//! - The engine's scripts touch only the lock's slot (the lock's keys and that slot's epoch
//!   marker): no `CROSSSLOT`, routed to the slot's master from any node of the cluster, and a
//!   lock name never used before wins its first round once the shard has been met.
//! - `ASK` during a slot migration is followed.
//! - Two `run` sidecars under a held lock: `CLUSTER FAILOVER`, then a killed master; never two
//!   leaders, the promoted master's grants counted only ttl + drift after its slot marker was
//!   stamped, leadership back within failover time + ttl + drift.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use redlock_sidecar::clock::Deadline;
use redlock_sidecar::redlock::cluster::{epoch_key, key_slot};
use redlock_sidecar::redlock::{votes, LockError, NoObserver, Redlock};
use support::cluster_mode::ClusterMode;
use support::failover::{leader_after, Contender, SLACK, TTL};
use support::tenures::{ms_between, Watch};
use support::{engine_config, Proc, RedisNode};
use tokio::task::block_in_place;
use tokio_util::sync::CancellationToken;

/// The slot of lock `name`'s keys.
fn slot_of(name: &str) -> u16 {
    key_slot(&format!("redlock:{{{name}}}"))
}

/// A lock name whose slot master `index` of a 3-master [`ClusterMode`] serves, after `skip`
/// such names.
fn name_on_master(index: usize, skip: usize) -> String {
    let per = 16384 / 3;
    (0..)
        .map(|n| format!("job-{n}"))
        .filter(|name| usize::from(slot_of(name)) / per == index.min(2))
        .nth(skip)
        .expect("names cover every range")
}

/// How long `node` has provably kept the data of `slot` (its slot marker's age), read-only.
fn slot_data_age(node: &RedisNode, slot: u16) -> Option<Duration> {
    let key = epoch_key(slot);
    let marker = node.try_command(&["GET", &key]).ok()?;
    let pttl: i64 = node.try_command(&["PTTL", &key]).ok()?.parse().ok()?;
    votes::data_age(&marker, pttl, &node.lineage()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_is_one_voter_whose_scripts_stay_in_the_lock_slot_and_new_names_need_no_wait() {
    let cluster = block_in_place(|| ClusterMode::start(3, 0));
    let ttl = Duration::from_secs(1);
    // The URL names master 0; the first lock lives on master 1: the engine is routed there.
    let url = cluster.masters[0].url();
    // `check` sees a cluster shard, a voter like any other, and writes nothing: no marker yet.
    let mut check = Proc::spawn(&["check", "--redis", &url, "--ttl", "1s"], &[]);
    let status = block_in_place(|| check.wait_exit(Duration::from_secs(20))).expect("exits");
    let out = check.output_text();
    assert_eq!(status.code(), Some(0), "{out}");
    let owner = cluster
        .master_of(slot_of("check"))
        .expect("an owner")
        .port();
    assert!(
        out.contains(&format!(
            "cluster shard: master 127.0.0.1:{owner} of the lock's slot {} with 0 replicas",
            slot_of("check")
        )),
        "{out}"
    );
    assert!(!out.contains("vote does not count"), "{out}");
    for master in &cluster.masters {
        assert_eq!(master.command(&["DBSIZE"]), "0", "check wrote nothing");
    }

    let first_name = name_on_master(1, 0);
    let first = Redlock::new(
        engine_config(std::slice::from_ref(&url), &first_name, "a", ttl),
        Arc::new(NoObserver),
    )
    .unwrap();
    let met = SystemTime::now();
    let deadline = Deadline::now() + Duration::from_secs(20);
    let lease = first
        .acquire(Some(deadline), &CancellationToken::new(), |_, _| {})
        .await
        .expect("the lock, once the shard's markers are ttl + drift old");
    let key = format!("redlock:{{{first_name}}}");
    assert!(
        cluster.masters[1].command(&["GET", &key]).starts_with("a:"),
        "the lock's key is on the master of its slot"
    );
    assert!(
        slot_data_age(&cluster.masters[1], slot_of(&first_name)).is_some(),
        "the slot's own epoch marker carries master 1's lineage"
    );
    let node_wide = redlock_sidecar::redlock::EPOCH_KEY;
    let holder = cluster.master_of(key_slot(node_wide)).expect("a master");
    assert_eq!(
        holder.command(&["EXISTS", node_wide]),
        "0",
        "no node-wide marker in another slot"
    );
    println!(
        "first lock of a fresh cluster after {:.2} s (ttl + drift = {:.2} s)",
        ms_between(met, SystemTime::now()) / 1e3,
        votes::required_data_age(ttl).as_secs_f64()
    );
    first.release(&lease).await;

    // Names never used before, on every master: the first round counts, because every
    // master's slot markers were stamped when the cluster was first met.
    let required = votes::required_data_age(ttl);
    for (index, skip) in [(0, 0), (1, 1), (2, 0)] {
        let name = name_on_master(index, skip);
        let master = &cluster.masters[index];
        support::wait_until_async(
            Duration::from_secs(10),
            "the slot marker is old enough",
            || async { slot_data_age(master, slot_of(&name)).is_some_and(|age| age >= required) },
        )
        .await;
        let lock = Redlock::new(
            engine_config(std::slice::from_ref(&url), &name, "b", ttl),
            Arc::new(NoObserver),
        )
        .unwrap();
        support::wait_until_async(Duration::from_secs(5), "connected", || async {
            lock.nodes()[0].facts().is_some()
        })
        .await;
        let lease = lock
            .try_acquire()
            .await
            .unwrap_or_else(|e| panic!("{name} (slot {}) on its first round: {e}", slot_of(&name)));
        assert_eq!(lock.release(&lease).await, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_in_migration_is_followed_with_asking_then_moved() {
    let cluster = block_in_place(|| ClusterMode::start(3, 0));
    let ttl = Duration::from_secs(1);
    let name = name_on_master(0, 0);
    let slot = slot_of(&name);
    let (source, target) = (&cluster.masters[0], &cluster.masters[1]);
    let lock = Redlock::new(
        engine_config(&[cluster.masters[2].url()], &name, "a", ttl),
        Arc::new(NoObserver),
    )
    .unwrap();
    let marker = epoch_key(slot);
    support::wait_until_async(
        Duration::from_secs(10),
        "the slot's marker stamped",
        || async { source.try_command(&["EXISTS", &marker]).as_deref() == Ok("1") },
    )
    .await;
    // The slot is being migrated from master 0 to master 1, and its marker has moved already.
    let (source_id, target_id) = (
        source.command(&["CLUSTER", "MYID"]),
        target.command(&["CLUSTER", "MYID"]),
    );
    let slot_text = slot.to_string();
    assert_eq!(
        target.command(&["CLUSTER", "SETSLOT", &slot_text, "IMPORTING", &source_id]),
        "OK"
    );
    assert_eq!(
        source.command(&["CLUSTER", "SETSLOT", &slot_text, "MIGRATING", &target_id]),
        "OK"
    );
    let port = target.port().to_string();
    assert_eq!(
        source.command(&[
            "MIGRATE",
            "127.0.0.1",
            &port,
            "",
            "0",
            "5000",
            "KEYS",
            &marker
        ]),
        "OK"
    );

    // Mid-migration the source answers ASK; the target, asked with ASKING, refuses a
    // multi-key script whose keys are not all there yet (TRYAGAIN): followed, not run.
    let err = lock
        .try_acquire()
        .await
        .expect_err("no multi-key call mid-migration");
    assert!(
        err.to_string().contains("TryAgain"),
        "the ASK redirection was followed to the importing master: {err}"
    );
    let key = format!("redlock:{{{name}}}");
    assert!(source.command(&["GET", &key]).starts_with("(error) ASK"));

    // The migration completes: the source answers MOVED, followed within the same call.
    for node in &cluster.masters {
        assert_eq!(
            node.command(&["CLUSTER", "SETSLOT", &slot_text, "NODE", &target_id]),
            "OK"
        );
    }
    let err = lock
        .try_acquire()
        .await
        .expect_err("a young marker on the new owner");
    assert!(
        matches!(err, LockError::NotYetTrusted { .. }),
        "the script ran on the new owner, where the moved marker names the source: {err}"
    );
    assert_eq!(
        target.command(&["GET", &marker]),
        target.lineage().unwrap(),
        "re-stamped with the new owner's lineage"
    );
    assert!(source
        .command(&["GET", &marker])
        .starts_with("(error) MOVED"));
}

// ------------------------------------------------------------------------------------------------
// Failovers under a held lock, through the binary
// ------------------------------------------------------------------------------------------------

const LOCK: &str = "cluster";
fn secs(from: SystemTime, to: SystemTime) -> f64 {
    ms_between(from, to) / 1e3
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_failover_and_a_killed_master_under_a_held_lock_give_one_leader_at_a_time() {
    let mut cluster = block_in_place(|| ClusterMode::start(3, 1));
    let slot = slot_of(LOCK);
    let owner = usize::from(slot) / (16384 / 3);
    // The sidecars name another master: routing is theirs to do.
    let url = cluster.masters[(owner + 1) % 3].url();
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

    // A manual failover: the replica takes over, the old master follows it.
    let started = SystemTime::now();
    let replica_port = cluster.replicas[owner][0].port();
    assert_eq!(
        cluster.replicas[owner][0].command(&["CLUSTER", "FAILOVER"]),
        "OK"
    );
    block_in_place(|| cluster.wait_master(replica_port));
    let switched = SystemTime::now();
    let back = leader_after(&watch, switched, &[&a, &b]).await;
    println!(
        "CLUSTER FAILOVER: done after {:.2} s; a leader answered {:.2} s after that",
        secs(started, switched),
        secs(switched, back)
    );
    assert!(
        secs(started, back)
            <= secs(started, switched)
                + votes::required_data_age(TTL).as_secs_f64()
                + SLACK.as_secs_f64()
    );

    // The new master dies: the old one, its replica now, is promoted with a new lineage.
    let killed = SystemTime::now();
    cluster.replicas[owner][0].stop();
    let old_master = cluster.masters[owner].port();
    block_in_place(|| cluster.wait_master(old_master));
    let promoted = SystemTime::now();
    let next = watch
        .next_tenure(promoted, None, "a leader on the promoted master", &[&a, &b])
        .await;
    let age = block_in_place(|| slot_data_age(&cluster.masters[owner], slot))
        .expect("the promoted master's slot marker");
    let stamped = SystemTime::now() - age;
    let required = votes::required_data_age(TTL);
    println!(
        "killed master: promoted after {:.2} s; marker stamped {:.2} s after the kill; the next \
         leader's round began {:.2} s after the stamp (ttl + drift = {:.2} s)",
        secs(killed, promoted),
        secs(killed, stamped),
        secs(stamped, next.since),
        required.as_secs_f64()
    );
    assert!(stamped > killed, "the marker was stamped after the kill");
    assert!(
        next.claimed_after + Duration::from_millis(5) >= stamped + required,
        "no grant of the promoted master counted before ttl + drift"
    );
    assert!(
        secs(killed, next.claimed_after)
            <= secs(killed, promoted) + required.as_secs_f64() + SLACK.as_secs_f64(),
        "leadership back within failover time + ttl + drift + {SLACK:?}"
    );

    a.stop(&mut watch).await;
    b.stop(&mut watch).await;
    let running: [&Contender; 0] = [];
    watch.finish(&running).await;
}

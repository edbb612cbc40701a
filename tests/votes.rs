//! Which votes count, against real redis-server processes: every way a node can lose data
//! keeps its grants from counting for ttl + drift, evicting nodes never count unless
//! allowed, and a holder steps down as soon as a quorum shows the lock is gone.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use redlock_sidecar::clock::Deadline;
use redlock_sidecar::redlock::{votes, Lease, LockError, NoObserver, Redlock, RedlockConfig, Vote};
use support::{RedisCluster, RedisNode};

const TTL: Duration = Duration::from_secs(1);

fn config(urls: &[String], identity: &str, ttl: Duration) -> RedlockConfig {
    support::engine_config(urls, "test", identity, ttl)
}

fn redlock(urls: &[String], identity: &str) -> Redlock {
    Redlock::new(config(urls, identity, TTL), Arc::new(NoObserver)).expect("valid config")
}

/// Beta's rounds while alpha's lock may still be valid: none may succeed, and each must
/// show the node(s) that lost data as granting but not counted (once they answer at all).
async fn refused_while_alpha_is_valid(beta: &Redlock, alpha: &Lease, lost: &[usize]) {
    let mut saw_not_counted = false;
    let mut last = String::new();
    while Deadline::now() < alpha.valid_until {
        match beta.try_acquire().await {
            Ok(lease) => panic!(
                "beta acquired (token {}) while alpha's lock was still valid",
                lease.fencing_token
            ),
            Err(err) => {
                let votes = err.votes().cloned().unwrap_or_default();
                last = err.to_string();
                assert!(
                    !votes.0.iter().any(|(_, v)| *v == Vote::Granted),
                    "a node that lost data counted: {votes}"
                );
                saw_not_counted |= votes
                    .0
                    .iter()
                    .filter(|(_, v)| matches!(v, Vote::NotCounted(_)))
                    .count()
                    >= lost.len().min(2);
            }
        }
    }
    assert!(
        saw_not_counted,
        "the nodes that lost data granted without being counted; last round: {last}"
    );
}

/// Waits until alpha's key stands on every node: a round is decided at quorum, so the last
/// node's `SET` may land after a data loss meant to strike it (and then rightly count).
fn wait_for_keys_everywhere(cluster: &RedisCluster) {
    tokio::task::block_in_place(|| {
        support::wait_until(Duration::from_secs(5), "alpha's key on every node", || {
            cluster.iter().all(|node| {
                node.command(&["GET", "redlock:{test}"])
                    .starts_with("alpha:")
            })
        })
    });
}

/// After a data loss on `lost`, alpha's renewal sees the lock gone on a quorum, beta
/// cannot take it while alpha's lease is valid, and takes it once the nodes have kept their
/// (new) data for ttl + drift, with a greater fencing token.
async fn data_loss_story(cluster: &mut RedisCluster, lose: impl Fn(&mut RedisNode)) {
    let urls = cluster.urls();
    let alpha = redlock(&urls, "alpha");
    let beta = redlock(&urls, "beta");
    let lease = alpha.try_acquire().await.expect("alpha acquires");
    wait_for_keys_everywhere(cluster);
    for index in [0, 1] {
        lose(cluster.node_mut(index));
    }
    // The renewal may first meet broken connections (a restart), then the truth.
    let mut verdict = alpha.extend(&lease).await;
    while matches!(verdict, Err(LockError::Lost { .. })) && Deadline::now() < lease.valid_until {
        verdict = alpha.extend(&lease).await;
    }
    assert!(
        matches!(
            verdict,
            Err(LockError::Superseded { .. } | LockError::Expired { .. })
        ),
        "alpha must learn it lost the lock, got {verdict:?}"
    );
    refused_while_alpha_is_valid(&beta, &lease, &[0, 1]).await;
    let deadline = Deadline::now() + votes::required_data_age(TTL) + Duration::from_secs(10);
    let taken = beta
        .acquire(Some(deadline), &Default::default(), |_, _| {})
        .await
        .expect("beta acquires once the nodes kept their data for ttl + drift");
    assert!(taken.fencing_token > lease.fencing_token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushall_on_a_majority_never_gives_a_second_holder() {
    let mut cluster = RedisCluster::ready(3, TTL);
    data_loss_story(&mut cluster, |node| {
        node.command(&["FLUSHALL"]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushdb_on_a_majority_never_gives_a_second_holder() {
    let mut cluster = RedisCluster::ready(3, TTL);
    data_loss_story(&mut cluster, |node| {
        node.command(&["FLUSHDB"]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_from_an_older_snapshot_never_gives_a_second_holder() {
    let mut cluster = RedisCluster::ready(3, TTL);
    // Snapshots taken before the lock: the marker is in them, the lock key is not.
    for node in cluster.iter() {
        node.command(&["SAVE"]);
    }
    data_loss_story(&mut cluster, |node| node.restart()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_node_never_counts_unless_allowed() {
    let lru = RedisNode::start_with(&["--maxmemory-policy", "allkeys-lru"]);
    let safe = RedisCluster::start(2);
    let urls = vec![lru.url(), safe.node(0).url(), safe.node(1).url()];
    lru.wait_votes_count(TTL);
    safe.wait_votes_count(TTL);
    // Take the two safe nodes away: only the evicting node could vote.
    let mut cfg = config(&urls, "alpha", TTL);
    cfg.nodes.truncate(1);
    let strict = Redlock::new(cfg.clone(), Arc::new(NoObserver)).expect("config");
    let err = strict
        .try_acquire()
        .await
        .expect_err("an evicting node's grant must not count");
    let votes = err.votes().expect("votes").to_string();
    assert!(votes.contains("allkeys-lru"), "{votes}");
    cfg.allow_evicting_nodes = true;
    let allowed = Redlock::new(cfg, Arc::new(NoObserver)).expect("config");
    let lease = allowed
        .try_acquire()
        .await
        .expect("with --allow-evicting-nodes it counts");
    allowed.release(&lease).await;
    // With all three nodes, the two safe ones still make a quorum.
    let all = redlock(&urls, "beta");
    all.try_acquire()
        .await
        .expect("two safe nodes are a quorum");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_ttl_contender_waits_out_the_longest_ttl_in_use() {
    let long = Duration::from_secs(4);
    let cluster = RedisCluster::start(3);
    cluster.wait_votes_count(long);
    let urls = cluster.urls();
    let alpha = Redlock::new(config(&urls, "alpha", long), Arc::new(NoObserver)).expect("cfg");
    let beta = redlock(&urls, "beta");
    let lease = alpha.try_acquire().await.expect("alpha (ttl 4s) acquires");
    wait_for_keys_everywhere(&cluster);
    // Two nodes lose everything, the max-ttl register included; the third remembers it.
    cluster.node(0).command(&["FLUSHALL"]);
    cluster.node(1).command(&["FLUSHALL"]);
    refused_while_alpha_is_valid(&beta, &lease, &[0, 1]).await;
    assert!(
        beta.required_data_age() >= votes::required_data_age(long),
        "beta learned the 4s ttl from the node that kept it: {:?}",
        beta.required_data_age()
    );
}

/// The remaining times (`PTTL`) of `keys` on `node`, read at one instant (time stands still
/// inside a script): keys that expire in the same millisecond read alike.
fn pttls_at_once(node: &RedisNode, keys: &[&str]) -> Vec<i64> {
    let count = keys.len().to_string();
    let mut args = vec![
        "EVAL",
        "local left = {} for i, key in ipairs(KEYS) do left[i] = redis.call('PTTL', key) end \
         return table.concat(left, ' ')",
        &count,
    ];
    args.extend_from_slice(keys);
    node.command(&args)
        .split_whitespace()
        .map(|n| n.parse().expect("a PTTL"))
        .collect()
}

/// Renewals rewrite the max-ttl register and the node-set record rarely (once their refresh
/// marker is gone), yet both always outlive the key a renewal extends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_keep_the_register_and_record_beyond_the_key_and_rewrite_them_rarely() {
    let cluster = RedisCluster::ready(1, TTL);
    let lock = redlock(&cluster.urls(), "alpha");
    let mut lease = lock.try_acquire().await.expect("acquired");
    let node = cluster.node(0);
    // The key's, the register's and the record's remaining times.
    let keys = [
        "redlock:{test}",
        "redlock:{test}:ttl",
        "redlock:{test}:nodes",
    ];
    let pttls = || pttls_at_once(node, &keys);
    node.command(&["CONFIG", "RESETSTAT"]);
    // Renewals a third of the ttl apart (the engine's cadence) over two refresh periods.
    let life = redlock_sidecar::redlock::RECORD_LIFE;
    let renewals = 3 * (life - 1) * 2 + 2;
    let mut pace = tokio::time::interval(TTL / 3);
    for _ in 0..renewals {
        pace.tick().await;
        lease = lock.extend(&lease).await.expect("renewed");
        let left = pttls();
        for (outliving, outlives) in keys.iter().zip(&left).skip(1) {
            assert!(
                *outlives >= left[0],
                "{outliving} has {outlives} ms left, the key {} ms",
                left[0]
            );
        }
    }
    let stats = node.command(&["INFO", "commandstats"]);
    let sets: u32 = stats
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_set:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().expect("a count"));
    // Three writes (register, record, marker) per refresh, a refresh every 3 × (life − 1)
    // renewals from the first on: three refreshes. A refresh whenever the register had less
    // than a ttl left (two writes every third renewal) would make about twelve.
    assert!(
        (3..=9).contains(&sets),
        "{sets} SETs over {renewals} renewals"
    );
    lock.release(&lease).await;
}

/// The register says the longest ttl of any key that may still stand: a grant, and the
/// renewals after it, under a register of a longer ttl that is about to expire keep that
/// register (its value, never lowered) until after their own key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_longer_ttls_register_about_to_expire_is_kept_past_a_shorter_key() {
    let longer = TTL * 2;
    // Old enough to count under the longer ttl the register shows.
    let cluster = RedisCluster::ready(1, longer);
    let node = cluster.node(0);
    let register = "redlock:{test}:ttl";
    let longer_ms = longer.as_millis().to_string();
    let lock = redlock(&cluster.urls(), "alpha");
    // Connected first, so that the grant follows the register's write within milliseconds.
    lock.inspect().await;
    // A contender with the longer ttl held the lock long ago: its register has half our ttl
    // left (the value check below fails if it was gone before the grant).
    let left = (TTL / 2).as_millis().to_string();
    node.command(&["SET", register, &longer_ms, "PX", &left]);
    let mut lease = lock.try_acquire().await.expect("acquired");
    // The key's and the register's remaining times, and the register.
    let read = || -> (i64, i64, String) {
        let left = pttls_at_once(node, &["redlock:{test}", register]);
        (left[0], left[1], node.command(&["GET", register]))
    };
    let check = |(key, left, value): (i64, i64, String), after: &str| {
        assert!(
            left >= key,
            "after {after}: the register has {left} ms left, the key {key} ms"
        );
        assert_eq!(value, longer_ms, "after {after}: the register's value");
    };
    check(read(), "the grant");
    let mut pace = tokio::time::interval(TTL / 3);
    pace.tick().await;
    for renewal in 1..=4 {
        pace.tick().await;
        lease = lock.extend(&lease).await.expect("renewed");
        check(read(), &format!("renewal {renewal}"));
    }
    lock.release(&lease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_switched_to_eviction_at_runtime_stops_the_node_counting() {
    let cluster = RedisCluster::ready(1, TTL);
    let lock = redlock(&cluster.urls(), "alpha");
    let lease = lock.try_acquire().await.expect("a noeviction node counts");
    lock.release(&lease).await;
    cluster
        .node(0)
        .command(&["CONFIG", "SET", "maxmemory-policy", "volatile-lru"]);
    // The connection stays up; its facts are read again within FACTS_MAX_AGE.
    let deadline = Instant::now() + redlock_sidecar::redlock::FACTS_MAX_AGE * 3;
    loop {
        match lock.try_acquire().await {
            Ok(lease) => lock.release(&lease).await,
            Err(err) => {
                let votes = err.votes().expect("votes").to_string();
                assert!(votes.contains("volatile-lru"), "{votes}");
                break;
            }
        };
        assert!(
            Instant::now() < deadline,
            "the new policy was never noticed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A cron job's first run after its Redis restarted: the node answers at once, but its vote
/// counts only ttl + drift after it was first met. guard (even with `--wait 0`) waits for
/// that, says so, and runs CMD; exit 69 stays for a quorum that does not answer.
#[test]
fn guard_waits_for_a_node_whose_vote_counts_soon_instead_of_failing() {
    let node = RedisNode::start();
    let outcome = support::TempDir::new("outcome");
    let outcome_file = outcome.path().join("outcome");
    let mut guard = support::Proc::spawn(
        &[
            "guard",
            "--lock",
            "fresh",
            "--redis",
            &node.url(),
            "--ttl",
            "2s",
            "--wait",
            "0",
            "--kubernetes",
            "off",
            "--outcome-file",
            outcome_file.to_str().expect("utf-8 path"),
            "--",
            "sh",
            "-c",
            "exit 3",
        ],
        &[],
    );
    let status = guard
        .wait_exit(Duration::from_secs(20))
        .unwrap_or_else(|| panic!("guard exits\n{}", guard.output_text()));
    let log = guard.output_text();
    assert_eq!(
        status.code(),
        Some(3),
        "CMD ran and its code came back:\n{log}"
    );
    assert!(
        log.contains("waiting for nodes whose votes count"),
        "guard says why it waits:\n{log}"
    );
    let line = std::fs::read_to_string(&outcome_file).expect("outcome line");
    assert!(line.starts_with("outcome=ran exit_code=3 "), "{line}");
}

/// L (ttl 12 s) holds all three nodes; nodes 1 and 2 lose everything and have kept their new
/// data for 2 s when X (ttl 2 s, no `--max-ttl`, no register seen yet) tries. X reaches node 0,
/// the only node still holding L's 12 s register, 200 ms later than the others: counted as they
/// came, the grants of nodes 1 and 2 would be a quorum before node 0 answers. They are judged
/// once node 0 has answered, against its 12 s register.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_young_nodes_grant_waits_for_a_slower_nodes_longer_ttl_register() {
    let long_ttl = Duration::from_secs(12);
    let short_ttl = Duration::from_secs(2);
    let cluster = RedisCluster::start(3);
    cluster.backdate_epochs(long_ttl);
    let long = Redlock::new(
        config(&cluster.urls(), "long", long_ttl),
        Arc::new(NoObserver),
    )
    .expect("valid config");
    let lease = long.try_acquire().await.expect("l takes the lock");
    for i in [1, 2] {
        assert_eq!(cluster.node(i).command(&["FLUSHALL"]), "OK");
        cluster.node(i).wait_votes_count(short_ttl);
    }
    let slow = support::FaultProxy::start(cluster.node(0).addr()).await;
    let urls = [slow.url(), cluster.node(1).url(), cluster.node(2).url()];
    let mut cfg = config(&urls, "short", short_ttl);
    cfg.node_timeout = Duration::from_millis(400);
    let short = Redlock::new(cfg, Arc::new(NoObserver)).expect("valid config");
    // Connections up first (a read teaches no register), then node 0 answers late.
    for (node, view) in short.inspect().await {
        assert!(view.is_ok(), "{node} answers: {view:?}");
    }
    slow.set_latency(Duration::from_millis(100), Duration::ZERO);
    let err = short
        .try_acquire()
        .await
        .expect_err("no second holder while l's lock is valid");
    assert!(
        Deadline::now() < lease.valid_until,
        "l's lock was still valid"
    );
    assert!(
        matches!(err, LockError::NotYetTrusted { ready_in, .. } if ready_in > short_ttl),
        "nodes 1 and 2 count only once they have kept their data for l's ttl: {err}"
    );
}

// ---------------------------------------------------------------------------------------
// Same servers, same set (votes.rs, rule 7)
// ---------------------------------------------------------------------------------------

/// A contender on `urls` whose node set is the fingerprint of the servers (no `--node-set`).
fn fingerprinted(urls: &[String], identity: &str) -> Redlock {
    let mut cfg = config(urls, identity, TTL);
    cfg.node_set = None;
    Redlock::new(cfg, Arc::new(NoObserver)).expect("valid config")
}

/// `redis://localhost:P` for each node: the same servers under other names.
fn by_host_name(cluster: &RedisCluster) -> Vec<String> {
    cluster
        .addrs()
        .iter()
        .map(|addr| format!("redis://localhost:{}", addr.port()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contenders_that_name_the_same_servers_differently_share_one_node_set() {
    let cluster = RedisCluster::ready(3, TTL);
    let alpha = fingerprinted(&cluster.urls(), "alpha");
    let beta = fingerprinted(&by_host_name(&cluster), "beta");
    // Both know every server: then the fingerprints agree.
    alpha.inspect().await;
    beta.inspect().await;
    assert_eq!(alpha.node_set(), beta.node_set());
    let lease = alpha.try_acquire().await.expect("alpha acquires");
    match beta.try_acquire().await {
        Err(LockError::Busy { holder, .. }) => assert_eq!(holder.as_deref(), Some("alpha")),
        other => panic!("beta sees alpha hold the lock, not a node-set conflict: {other:?}"),
    }
    alpha.extend(&lease).await.expect("alpha renews");
    assert!(alpha.release(&lease).await >= 2);
    let taken = beta
        .try_acquire()
        .await
        .expect("beta acquires after the release");
    assert!(taken.fencing_token > lease.fencing_token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contenders_on_different_servers_still_refuse_to_lead_beside_each_other() {
    let cluster = RedisCluster::ready(4, TTL);
    let urls = cluster.urls();
    let alpha = fingerprinted(&urls[..3], "alpha");
    let beta = fingerprinted(&[urls[0].clone(), urls[1].clone(), urls[3].clone()], "beta");
    let _lease = alpha.try_acquire().await.expect("alpha acquires");
    let refused = beta.try_acquire().await;
    assert!(
        matches!(refused, Err(LockError::NodeSetConflict { .. })),
        "beta lists another server: {refused:?}"
    );
}

/// Records of two node sets left on the nodes (a round of each, each seeing the other's) are
/// no lock: each lost round removes its own record, so one of the two leads soon, although
/// both retry all along (a record they refreshed would stand for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_node_set_records_do_not_keep_the_lock_from_being_taken() {
    let cluster = RedisCluster::ready(4, TTL);
    let urls = cluster.urls();
    let alpha = fingerprinted(&urls[..3], "alpha");
    let beta = fingerprinted(&[urls[0].clone(), urls[1].clone(), urls[3].clone()], "beta");
    alpha.inspect().await;
    beta.inspect().await;
    // Each set's record on one shared node, for far longer than the test.
    for (node, set) in [(0, &alpha), (1, &beta)] {
        let fingerprint = set.node_set().fingerprint;
        let key = "redlock:{test}:nodes";
        let set = cluster
            .node(node)
            .command(&["SET", key, &fingerprint, "PX", "600000"]);
        assert_eq!(set, "OK");
    }
    let deadline = Deadline::now() + TTL * 2 + Duration::from_secs(2);
    let cancel = tokio_util::sync::CancellationToken::new();
    let race = |contender: &Redlock| {
        let (contender, cancel) = (contender.clone(), cancel.clone());
        async move {
            let won = contender.acquire(Some(deadline), &cancel, |_, _| {}).await;
            if won.is_ok() {
                cancel.cancel();
            }
            won
        }
    };
    let (a, b) = tokio::join!(race(&alpha), race(&beta));
    let (lease, loser) = match (a, b) {
        (Ok(lease), Err(_)) => (lease, &beta),
        (Err(_), Ok(lease)) => (lease, &alpha),
        other => panic!("exactly one leads within two ttls: {other:?}"),
    };
    let refused = loser.try_acquire().await;
    assert!(
        Deadline::now() < lease.valid_until,
        "the check ran while the lease was valid"
    );
    assert!(
        matches!(refused, Err(LockError::NodeSetConflict { .. })),
        "the other sees the leader's node set: {refused:?}"
    );
}

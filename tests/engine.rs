//! The Redlock engine against real redis-server processes.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redlock_sidecar::clock::{self, Deadline};
use redlock_sidecar::redlock::{
    ConfigError, Credentials, Lease, LockError, NoObserver, NodeErrorKind, NodeSpec, Observer, Op,
    Redlock, RedlockConfig, Vote,
};
use support::{RedisCluster, RedisNode};
use tokio_util::sync::CancellationToken;

const TTL: Duration = Duration::from_secs(1);

fn config(urls: &[String], identity: &str) -> RedlockConfig {
    support::engine_config(urls, "test", identity, TTL)
}

fn redlock(urls: &[String], identity: &str) -> Redlock {
    Redlock::new(config(urls, identity), Arc::new(NoObserver)).expect("valid config")
}

fn key_on(node: &RedisNode) -> String {
    node.command(&["GET", "redlock:{test}"])
}

async fn mutual_exclusion(n: usize) {
    let cluster = RedisCluster::ready(n, TTL);
    let urls = cluster.urls();
    let counter = Arc::new(AtomicU64::new(0));
    let rounds = 4;
    let mut tasks = Vec::new();
    for id in 0..32 {
        let lock = redlock(&urls, &format!("task-{id}"));
        let counter = counter.clone();
        tasks.push(tokio::spawn(async move {
            let never = CancellationToken::new();
            for _ in 0..rounds {
                let deadline = Deadline::now() + Duration::from_secs(60);
                let lease = lock
                    .acquire(Some(deadline), &never, |_, _| {})
                    .await
                    .expect("acquired");
                // Read, yield, write: any overlap loses an increment.
                let seen = counter.load(Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1)).await;
                counter.store(seen + 1, Ordering::SeqCst);
                lock.release(&lease).await;
            }
        }));
    }
    for task in tasks {
        task.await.expect("task finished");
    }
    assert_eq!(
        counter.load(Ordering::SeqCst),
        32 * rounds,
        "no increment lost with {n} nodes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_contenders_never_overlap_on_one_node() {
    mutual_exclusion(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_contenders_never_overlap_on_three_nodes() {
    mutual_exclusion(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_contenders_never_overlap_on_five_nodes() {
    mutual_exclusion(5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lock_is_busy_for_others_and_names_its_holder() {
    let cluster = RedisCluster::ready(3, TTL);
    let a = redlock(&cluster.urls(), "alpha");
    let b = redlock(&cluster.urls(), "beta");
    let lease = a.try_acquire().await.expect("alpha acquires");
    match b.try_acquire().await {
        Err(LockError::Busy {
            holder,
            holder_fence,
            ..
        }) => {
            assert_eq!(holder.as_deref(), Some("alpha"));
            assert_eq!(
                holder_fence, lease.fencing_token,
                "the holder's token is readable"
            );
        }
        other => panic!("expected busy, got {other:?}"),
    }
    let keys: Vec<String> = cluster.iter().map(key_on).collect();
    assert!(
        keys.iter().all(|k| !k.starts_with("beta:")),
        "beta left no key behind: {keys:?}"
    );
    let alphas = keys.iter().filter(|k| k.starts_with("alpha:")).count();
    assert!(alphas >= 2, "alpha's key stands on a quorum: {keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_holders_lock_is_never_released_or_extended() {
    let cluster = RedisCluster::ready(3, TTL);
    let a = redlock(&cluster.urls(), "alpha");
    let lease = a.try_acquire().await.expect("alpha acquires");
    // Someone else's key takes the place of ours on every node (as after an expiry).
    for node in cluster.iter() {
        node.command(&["SET", "redlock:{test}", "intruder:00", "PX", "60000"]);
    }
    match a.extend(&lease).await {
        Err(LockError::Superseded { .. }) => {}
        other => panic!("extend of a replaced lock must fail as superseded, got {other:?}"),
    }
    assert_eq!(a.release(&lease).await, 0, "nothing of ours to delete");
    for node in cluster.iter() {
        assert_eq!(key_on(node), "intruder:00");
        let pttl: i64 = node.command(&["PTTL", "redlock:{test}"]).parse().unwrap();
        assert!(pttl > 50_000, "the intruder's ttl was not touched: {pttl}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_after_expiry_fails_and_extend_in_time_renews_validity() {
    let cluster = RedisCluster::ready(3, TTL);
    let a = redlock(&cluster.urls(), "alpha");
    let lease = a.try_acquire().await.expect("acquires");
    let renewed = a.extend(&lease).await.expect("extends while valid");
    assert!(
        renewed.valid_until > lease.valid_until,
        "validity moved forward"
    );
    assert_eq!(renewed.fencing_token, lease.fencing_token);
    clock::sleep_until_deadline(renewed.valid_until).await;
    match a.extend(&renewed).await {
        Err(LockError::Expired { .. }) => {}
        other => panic!("extend after expiry must fail, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minority_down_still_works_a_majority_down_fails_fast_naming_the_nodes() {
    let mut cluster = RedisCluster::ready(5, TTL);
    let a = redlock(&cluster.urls(), "alpha");
    cluster.node_mut(0).stop();
    cluster.node_mut(1).stop();
    let lease = a.try_acquire().await.expect("3 of 5 is a quorum");
    a.release(&lease).await;
    cluster.node_mut(2).stop();
    let started = Instant::now();
    match a.try_acquire().await {
        Err(LockError::QuorumUnreachable { needed, votes, .. }) => {
            assert_eq!(needed, 3);
            let failed: Vec<&str> = votes.failed().collect();
            assert!(failed.len() >= 2, "names the failed nodes: {votes}");
            for label in failed {
                let port: u16 = label.rsplit(':').next().unwrap().parse().unwrap();
                assert!(
                    cluster.ports()[..3].contains(&port),
                    "{label} is one of the stopped nodes"
                );
            }
        }
        other => panic!("expected quorum unreachable, got {other:?}"),
    }
    // Bounded by the node timeout (100 ms), not by any reconnect loop.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "failed fast: {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn votes_of_restarted_nodes_are_not_counted_so_a_forgotten_lock_is_not_retaken() {
    let mut cluster = RedisCluster::ready(3, TTL);
    let a = redlock(&cluster.urls(), "alpha");
    let b = redlock(&cluster.urls(), "beta");
    let _held = a.try_acquire().await.expect("alpha acquires");
    // Two nodes restart without persistence and forget alpha's key.
    cluster.node_mut(0).restart();
    cluster.node_mut(1).restart();
    // Beta's first round may only find its old connections broken; it retries until the
    // restarted nodes answer, well within the time they stay uncounted (ttl + drift + 1 s).
    let deadline = Instant::now() + Duration::from_millis(1500);
    loop {
        let err = b
            .try_acquire()
            .await
            .expect_err("beta must not get the lock alpha still holds");
        let votes = err.votes().expect("votes");
        assert!(
            !votes.0.iter().any(|(_, v)| *v == Vote::Granted),
            "no counted grant: {votes}"
        );
        if votes
            .0
            .iter()
            .any(|(_, v)| matches!(v, Vote::NotCounted(_)))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a restarted node answered: {votes}"
        );
    }
    assert!(
        key_on(cluster.node(2)).starts_with("alpha:"),
        "alpha's key survives on the third node"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_strictly_increase_over_a_thousand_handoffs_with_restarts() {
    let mut cluster = RedisCluster::ready(3, TTL);
    let urls = cluster.urls();
    let contenders = [redlock(&urls, "alpha"), redlock(&urls, "beta")];
    let never = CancellationToken::new();
    let mut last = 0u64;
    for handoff in 0..1000 {
        if handoff % 250 == 125 {
            // A minority node loses everything, fencing counter included.
            cluster.node_mut(2).restart();
        }
        let lock = &contenders[handoff % 2];
        let deadline = Deadline::now() + Duration::from_secs(30);
        let lease = lock
            .acquire(Some(deadline), &never, |_, _| {})
            .await
            .expect("acquires");
        assert!(
            lease.fencing_token > last,
            "handoff {handoff}: {} after {last}",
            lease.fencing_token
        );
        last = lease.fencing_token;
        lock.release(&lease).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_node_does_not_slow_acquire_beyond_the_node_timeout() {
    let mut cluster = RedisCluster::start(3);
    let mut cfg = config(&cluster.urls(), "alpha");
    // A long node timeout: waiting for the paused node would take 1.5 s.
    cfg.node_timeout = Duration::from_millis(1500);
    cfg.ttl = Duration::from_secs(7);
    // Nodes that have kept their data for longer than any ttl may be: their grants count
    // without waiting for the other nodes' max-ttl registers.
    cluster.backdate_epochs(redlock_sidecar::redlock::timing::MAX_TTL);
    // A warm-up tenure that expires rather than being released: its node-set record stays
    // on the nodes (a release takes it, and the next round then hears every node, the
    // paused one included, before it leads: see `votes`, rule 7).
    // Its key lives 500 ms, its record four times that.
    let mut short = cfg.clone();
    short.ttl = Duration::from_millis(500);
    short.node_timeout = Duration::from_millis(100);
    let warm = Redlock::new(short, Arc::new(NoObserver)).unwrap();
    warm.try_acquire().await.expect("warm-up");
    let a = Redlock::new(cfg, Arc::new(NoObserver)).unwrap();
    a.inspect().await;
    support::wait_until_async(
        Duration::from_secs(5),
        "the warm-up key expires",
        || async { cluster.iter().all(|node| key_on(node) == "(nil)") },
    )
    .await;
    cluster.node_mut(0).pause();
    let started = Instant::now();
    let lease = a.try_acquire().await.expect("quorum of the two live nodes");
    let took = started.elapsed();
    cluster.node_mut(0).resume();
    a.release(&lease).await;
    assert!(
        took < Duration::from_millis(750),
        "decided at quorum, not at the paused node's timeout: {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_long_before_its_retry_delay() {
    // The holder's key lives 6 s and the waiter retries after 10 s: only the release
    // announcement can wake it sooner.
    let ttl = Duration::from_secs(6);
    let cluster = RedisCluster::start(3);
    cluster.wait_votes_count(ttl);
    let mut holder_cfg = config(&cluster.urls(), "holder");
    holder_cfg.ttl = ttl;
    let holder = Redlock::new(holder_cfg, Arc::new(NoObserver)).unwrap();
    let mut cfg = config(&cluster.urls(), "waiter");
    cfg.ttl = ttl;
    cfg.retry_delay = Duration::from_secs(10);
    cfg.retry_max = Duration::from_secs(10);
    let waiter = Redlock::new(cfg, Arc::new(NoObserver)).unwrap();
    let lease = holder.try_acquire().await.expect("holder acquires");
    let (tried_tx, tried_rx) = tokio::sync::oneshot::channel();
    let mut tried_tx = Some(tried_tx);
    let wait = tokio::spawn(async move {
        let never = CancellationToken::new();
        let lease = waiter
            .acquire(None, &never, |result, _| {
                if result.is_err() {
                    if let Some(tx) = tried_tx.take() {
                        let _ = tx.send(());
                    }
                }
            })
            .await;
        (lease, Instant::now())
    });
    tried_rx.await.expect("the waiter found the lock busy");
    let released_at = Instant::now();
    holder.release(&lease).await;
    let (lease, acquired_at) = wait.await.unwrap();
    lease.expect("waiter acquires");
    let handoff = acquired_at - released_at;
    assert!(
        handoff < Duration::from_secs(3),
        "woken by the release, not by its timer or the key's expiry: {handoff:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_answering_garbage_is_a_typed_protocol_error() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while let Ok(n) = socket.read(&mut buf).await {
                    if n == 0
                        || socket
                            .write_all(b"HTTP/1.1 400 nonsense\r\n\r\n\x00\xff")
                            .await
                            .is_err()
                    {
                        break;
                    }
                }
            });
        }
    });
    let lock = redlock(&[format!("redis://{addr}")], "alpha");
    let started = Instant::now();
    match lock.try_acquire().await {
        Err(LockError::QuorumUnreachable { votes, .. }) => match &votes.0[0].1 {
            Vote::Failed(err) => assert_eq!(err.kind, NodeErrorKind::Protocol, "{err}"),
            other => panic!("expected a failed vote, got {other}"),
        },
        other => panic!("expected quorum unreachable, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(3), "no hang");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_an_auth_error_that_never_shows_the_password() {
    let node = RedisNode::start_with(&["--requirepass", "right-secret"]);
    let url = format!("redis://:wrong-secret@127.0.0.1:{}", node.port());
    let lock = redlock(&[url], "alpha");
    let err = lock.try_acquire().await.expect_err("auth fails");
    let LockError::QuorumUnreachable { votes, .. } = &err else {
        panic!("{err:?}")
    };
    let Vote::Failed(node_err) = &votes.0[0].1 else {
        panic!("{votes}")
    };
    assert_eq!(node_err.kind, NodeErrorKind::Auth, "{node_err}");
    let shown = format!("{err} {err:?}");
    assert!(
        !shown.contains("wrong-secret") && !shown.contains("right-secret"),
        "{shown}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_from_credentials_reaches_nodes_without_one_in_the_url() {
    let node = RedisNode::start_with(&["--requirepass", "s3cret"]);
    node.wait_votes_count(TTL);
    let creds = Credentials {
        password: Some("s3cret".into()),
        ..Credentials::default()
    };
    let spec = NodeSpec::parse(0, &node.url(), &creds).unwrap();
    assert!(!format!("{spec:?} {spec}").contains("s3cret"));
    let mut cfg = config(&[node.url()], "alpha");
    cfg.nodes = vec![spec];
    let lock = Redlock::new(cfg, Arc::new(NoObserver)).unwrap();
    let lease = lock.try_acquire().await.expect("authenticated");
    assert_eq!(lock.release(&lease).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_host_is_a_typed_connection_error_without_hanging() {
    let lock = redlock(&["redis://no-such-host.invalid:6379".to_owned()], "alpha");
    let started = Instant::now();
    let err = lock.try_acquire().await.expect_err("unreachable");
    assert_eq!(err.kind(), "no_quorum", "{err}");
    assert!(started.elapsed() < Duration::from_secs(3), "no hang");
}

#[test]
fn malformed_urls_and_bad_node_lists_are_config_errors() {
    let creds = Credentials::default();
    let err = NodeSpec::parse(0, "redis//nocolon", &creds).unwrap_err();
    assert_eq!(err.flag, "--redis");
    let err = NodeSpec::parse(2, "redis://:pw@[::1", &creds).unwrap_err();
    assert!(
        err.reason.contains("node #3") && !err.to_string().contains("pw"),
        "{err}"
    );
    let cfg = config(&[], "alpha");
    assert_eq!(
        cfg.validate(),
        Err(ConfigError::new("--redis", "at least one node is required"))
    );
    let cfg = config(
        &["redis://127.0.0.1:1".into(), "redis://127.0.0.1:1".into()],
        "alpha",
    );
    assert_eq!(cfg.validate().unwrap_err().flag, "--redis");
    let mut cfg = config(&["redis://127.0.0.1:1".into()], "alpha");
    cfg.ttl = Duration::from_millis(100);
    assert_eq!(cfg.validate().unwrap_err().flag, "--ttl");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_ahead_of_the_clock_still_yields_a_greater_token() {
    let cluster = RedisCluster::ready(3, TTL);
    let a = redlock(&cluster.urls(), "alpha");
    // As if an earlier holder's clock ran far ahead: its token is above our candidate.
    let ahead = 1u64 << 50;
    for node in cluster.iter() {
        node.command(&["SET", "redlock:{test}:fence", &ahead.to_string()]);
    }
    let lease = a
        .try_acquire()
        .await
        .expect("acquires through the write-back round");
    assert_eq!(lease.fencing_token, ahead + 1);
    a.release(&lease).await;
    let next = a.try_acquire().await.expect("acquires again");
    assert!(next.fencing_token > lease.fencing_token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_right_after_acquire_leaves_no_key_behind() {
    // A round is decided at quorum, so the slowest node's SET may still be queued when
    // the holder releases: the release must not overtake it and leave a key for a ttl.
    let cluster = RedisCluster::ready(3, TTL);
    let urls = cluster.urls();
    for round in 0..200 {
        // Fresh connections each time: the SET and the release race for the same connect.
        let lock = redlock(&urls, "alpha");
        let lease = lock.try_acquire().await.expect("acquires");
        lock.release(&lease).await;
        for (index, node) in cluster.iter().enumerate() {
            assert_eq!(
                key_on(node),
                "(nil)",
                "round {round}: key left on node {index}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_waiters_take_turns_reading_and_a_crashed_holder_is_still_replaced() {
    const WAITERS: usize = 400;
    // Longer than the other tests' ttl: a loaded machine may miss a renewal or two.
    const TTL: Duration = Duration::from_secs(3);
    /// What the waiters report about their turns (the sidecar's metrics hear the same).
    #[derive(Default)]
    struct Turns {
        skipped: AtomicU64,
        most_waiters: AtomicU64,
    }
    impl Observer for Turns {
        fn standby_read_skipped(&self) {
            self.skipped.fetch_add(1, Ordering::Relaxed);
        }
        fn waiters_counted(&self, waiters: u64) {
            self.most_waiters.fetch_max(waiters, Ordering::Relaxed);
        }
    }
    let turns = Arc::new(Turns::default());
    let redlock = |urls: &[String], identity: &str| {
        Redlock::new(
            support::engine_config(urls, "test", identity, TTL),
            turns.clone(),
        )
        .expect("valid config")
    };
    let cluster = RedisCluster::start(3);
    cluster.wait_votes_count(TTL);
    let urls = cluster.urls();
    let holder = redlock(&urls, "holder");
    let lease = holder.try_acquire().await.expect("holder acquires");
    let renewing = CancellationToken::new();
    let renewer = {
        let (holder, renewing) = (holder.clone(), renewing.clone());
        tokio::spawn(async move {
            let mut lease = lease;
            while !renewing.is_cancelled() {
                tokio::time::sleep(TTL / 3).await;
                lease = holder.extend(&lease).await.unwrap_or(lease);
            }
        })
    };
    let rounds = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let waiters = start_waiters(
        (0..WAITERS).map(|i| redlock(&urls, &format!("waiter-{i}"))),
        &rounds,
        &stop,
    );
    support::wait_until(Duration::from_secs(30), "every waiter ran a round", || {
        rounds.load(Ordering::Relaxed) >= WAITERS as u64
    });
    // The waiters that counted few count again within three ttls, and then read by turns.
    tokio::time::sleep(TTL * 4).await;
    let window = TTL * 5;
    let reads_before = cluster.node(0).calls("get");
    let rounds_before = rounds.load(Ordering::Relaxed);
    let skipped_before = turns.skipped.load(Ordering::Relaxed);
    tokio::time::sleep(window).await;
    let reads = cluster.node(0).calls("get") - reads_before;
    let skipped = turns.skipped.load(Ordering::Relaxed) - skipped_before;
    assert!(skipped > 0, "no waiter reported a read left to others");
    let most = turns.most_waiters.load(Ordering::Relaxed);
    assert!(
        most > 50 && most <= WAITERS as u64 + 1,
        "the waiters counted at most {most} of the {} subscribers",
        WAITERS + 1
    );
    // Reading at every deadline (the key's expiry, renewed every ttl/3: one read per waiter
    // every 2/3 to 1 ttl) would be 2,000 to 3,000 reads; by turns, about a quarter of that
    // (the waiters that started early counted fewer and read at every deadline until they
    // count again).
    let all_read = (WAITERS as u64) * 5;
    assert!(
        reads < all_read / 2,
        "{reads} reads of node 0 by {WAITERS} waiters in {window:?}: they do not take turns"
    );
    assert_eq!(
        rounds.load(Ordering::Relaxed),
        rounds_before,
        "idle waiters ran acquire rounds"
    );
    // The holder stops renewing (crashed): a waiter takes over once its key has expired.
    renewing.cancel();
    renewer.await.expect("renewer");
    support::wait_until(
        TTL * 4,
        "a waiter takes over from the crashed holder",
        || waiters.iter().any(|w| w.is_finished()),
    );
    // The winner does not renew: stop the others before its key expires.
    stop.cancel();
    let mut won = 0;
    for waiter in waiters {
        if let (_, Ok(_)) = waiter.await.expect("waiter") {
            won += 1;
        }
    }
    assert_eq!(won, 1, "exactly one waiter took over");
}

/// Each of `waiters` waits for the lock (`acquire`) until it wins or `stop`; `rounds` counts
/// the rounds they all run. Each task ends with its engine and what `acquire` returned.
fn start_waiters(
    waiters: impl Iterator<Item = Redlock>,
    rounds: &Arc<AtomicU64>,
    stop: &CancellationToken,
) -> Vec<tokio::task::JoinHandle<(Redlock, Result<Lease, LockError>)>> {
    waiters
        .map(|waiter| {
            let (rounds, stop) = (rounds.clone(), stop.clone());
            tokio::spawn(async move {
                let lease = waiter
                    .acquire(None, &stop, |_, _| {
                        rounds.fetch_add(1, Ordering::Relaxed);
                    })
                    .await;
                (waiter, lease)
            })
        })
        .collect()
}

/// Subscribers of `channel` on `node` (`PUBSUB NUMSUB`).
fn subscribers(node: &RedisNode, channel: &str) -> u64 {
    let reply = node.command(&["PUBSUB", "NUMSUB", channel]);
    let count = reply.lines().nth(1).unwrap_or_default();
    count
        .parse()
        .unwrap_or_else(|_| panic!("NUMSUB {channel}: {reply:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_the_waiters_that_watch_and_many_watchers_thin_out_to_about_fifty() {
    const WAITERS: usize = 200;
    // No waiter reads the nodes before the holder's key would expire (about 30 s from the
    // start), nor counts the release channel's subscribers (and so subscribes again, and reads)
    // before 15 s, even on a loaded machine: until then, only the release announcement can
    // show that the lock is free.
    const TTL: Duration = Duration::from_secs(30);
    let cluster = RedisCluster::start(3);
    cluster.backdate_epochs(TTL);
    let urls = cluster.urls();
    /// Reads of the nodes by the waiters; once `released`, those made before any waiter's
    /// acquire call after the release had an answer (a read that showed the lock free would
    /// come before the round it calls for).
    #[derive(Default)]
    struct Reads {
        all: AtomicU64,
        released: AtomicBool,
        round_since: AtomicBool,
        before_a_round: AtomicU64,
    }
    impl Observer for Reads {
        fn node_call(&self, _: usize, op: Op, _: Duration, _: Result<(), NodeErrorKind>) {
            if op == Op::Acquire && self.released.load(Ordering::SeqCst) {
                self.round_since.store(true, Ordering::SeqCst);
            }
        }
        fn standby_read(&self, _fallback: bool) {
            self.all.fetch_add(1, Ordering::SeqCst);
            if self.released.load(Ordering::SeqCst) && !self.round_since.load(Ordering::SeqCst) {
                self.before_a_round.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    let redlock = |identity: &str, observer: Arc<dyn Observer>| {
        Redlock::new(
            support::engine_config(&urls, "test", identity, TTL),
            observer,
        )
        .expect("valid config")
    };
    let holder = redlock("holder", Arc::new(NoObserver));
    let lease = holder.try_acquire().await.expect("holder acquires");
    let rounds = Arc::new(AtomicU64::new(0));
    let reads = Arc::new(Reads::default());
    let stop = CancellationToken::new();
    // All at once, as after a mass restart: every one of them watches releases at first.
    let mut waiters = start_waiters(
        (0..WAITERS).map(|i| redlock(&format!("waiter-{i}"), reads.clone())),
        &rounds,
        &stop,
    );
    let released = "redlock:{test}:released";
    let acquired = "redlock:{test}:acquired";
    // Each waiter reads the nodes once its subscriptions are up; then none reads until the
    // holder's key would expire.
    let mut last = (0, Instant::now());
    support::wait_until_async(
        TTL / 5,
        "every waiter subscribed, ran a round and read the nodes, and no read for 1 s",
        || {
            let count = reads.all.load(Ordering::SeqCst);
            if count != last.0 {
                last = (count, Instant::now());
            }
            let ready = rounds.load(Ordering::Relaxed) >= WAITERS as u64
                && count >= WAITERS as u64
                && last.1.elapsed() >= Duration::from_secs(1)
                && cluster
                    .iter()
                    .all(|node| subscribers(node, acquired) >= WAITERS as u64);
            async move { ready }
        },
    )
    .await;
    reads.released.store(true, Ordering::SeqCst);
    holder.release(&lease).await;
    support::wait_until_async(
        TTL / 5,
        "a waiter takes over, woken by the release",
        || async { waiters.iter().any(|w| w.is_finished()) },
    )
    .await;
    assert_eq!(
        reads.before_a_round.load(Ordering::SeqCst),
        0,
        "a read, not the release announcement, showed the lock free"
    );
    let finished = waiters
        .iter()
        .position(|w| w.is_finished())
        .expect("one finished");
    let (winner, lease) = waiters.swap_remove(finished).await.expect("winner");
    let mut lease = lease.expect("the waiter that finished holds the lock");
    // The winner renews; the others keep waiting, and those that watch releases count the
    // channel's subscribers again: about fifty stay on each node.
    let mut renew_at = Instant::now() + TTL / 3;
    let deadline = Instant::now() + TTL * 3;
    loop {
        if Instant::now() >= renew_at {
            lease = winner.extend(&lease).await.expect("the winner renews");
            renew_at = Instant::now() + TTL / 3;
        }
        let counts: Vec<(u64, u64)> = cluster
            .iter()
            .map(|node| (subscribers(node, acquired), subscribers(node, released)))
            .collect();
        if counts.iter().all(|(waiting, watching)| {
            *waiting >= WAITERS as u64 - 1 && *watching < WAITERS as u64 / 2
        }) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still too many watch releases (waiters, watchers per node): {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        waiters.iter().all(|w| !w.is_finished()),
        "a second waiter took the lock"
    );
    stop.cancel();
    for waiter in waiters {
        let (_, lease) = waiter.await.expect("waiter");
        assert!(lease.is_err(), "a second waiter took the lock");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_made_while_the_connections_are_redialled_still_deletes_the_keys() {
    // A ttl far longer than the release's own bound (2 × node timeout): a key left behind
    // would still be there when we look.
    const TTL: Duration = Duration::from_secs(10);
    let cluster = RedisCluster::start(3);
    cluster.wait_votes_count(TTL);
    let mut proxies = Vec::new();
    for node in &cluster.nodes {
        proxies.push(support::proxy::FaultProxy::start(node.addr()).await);
    }
    let urls: Vec<String> = proxies.iter().map(|p| p.url()).collect();
    let holder = Redlock::new(
        support::engine_config(&urls, "test", "holder", TTL),
        Arc::new(NoObserver),
    )
    .expect("valid config");
    // `acquire` keeps a subscription per node: it notices a dropped connection and redials.
    let never = CancellationToken::new();
    let lease = holder
        .acquire(Some(Deadline::now() + TTL), &never, |_, _| {})
        .await
        .expect("holder acquires");
    // Every connection is dropped, and the new ones take longer to open than a node timeout
    // (100 ms): the release finds every node still connecting and gives up on its answers.
    for proxy in &proxies {
        proxy.set_latency(Duration::from_millis(80), Duration::ZERO);
        proxy.drop_connections();
    }
    support::wait_until(Duration::from_secs(5), "the nodes are redialled", || {
        proxies.iter().all(|p| p.connections_accepted() >= 2)
    });
    holder.release(&lease).await;
    // The deletes were still sent once the connections opened: no key waits for its ttl.
    support::wait_until(TTL / 2, "the released key is gone from every node", || {
        cluster.nodes.iter().all(|n| key_on(n) == "(nil)")
    });
}

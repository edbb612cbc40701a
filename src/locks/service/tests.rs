//! The service over an in-process engine whose waiters are never woken by the nodes
//! (as if no release announcement came), to see what the service itself does.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use crate::clock::{self, Deadline};
use crate::locks::engine::{AcquireFailed, EngineLease, ExtendFailed, NameLock};
use crate::metrics::Metrics;

#[derive(Default)]
struct Nodes {
    /// The names held on the nodes.
    held: Mutex<std::collections::HashSet<String>>,
    /// Acquisition rounds that found the name held.
    busy_rounds: AtomicUsize,
    tokens: AtomicUsize,
    /// Names opened and dropped (engine locks made and freed).
    opened: AtomicUsize,
    dropped: AtomicUsize,
    /// While set, a release deletes the key (a quorum answered) and then waits for
    /// `releases_finish` (the slowest node's answer).
    slow_releases: std::sync::atomic::AtomicBool,
    releases_finish: Notify,
}

struct Engine(Arc<Nodes>);
struct Name(Arc<Nodes>, String);
struct Held(u64, Deadline);

impl Drop for Name {
    fn drop(&mut self) {
        self.0.dropped.fetch_add(1, Ordering::SeqCst);
    }
}

impl EngineLease for Held {
    fn fencing_token(&self) -> u64 {
        self.0
    }
    fn valid_until(&self) -> Deadline {
        self.1
    }
}

impl NameLock for Name {
    type Lease = Held;

    async fn acquire(
        &self,
        deadline: Deadline,
        cancel: CancellationToken,
        _: impl FnMut(Option<String>) + Send + 'static,
    ) -> Result<Held, AcquireFailed> {
        if self.0.held.lock().unwrap().insert(self.1.clone()) {
            let token = self.0.tokens.fetch_add(1, Ordering::SeqCst) as u64 + 1;
            return Ok(Held(token, Deadline::now() + Duration::from_secs(30)));
        }
        self.0.busy_rounds.fetch_add(1, Ordering::SeqCst);
        // No announcement ever comes: only the deadline or a cancel ends the wait.
        tokio::select! {
            _ = clock::sleep_until_deadline(deadline) => Err(AcquireFailed::Held { holder: None }),
            _ = cancel.cancelled() => Err(AcquireFailed::Cancelled),
        }
    }
    async fn extend(&self, lease: &Held) -> Result<Held, ExtendFailed> {
        Ok(Held(lease.0, Deadline::now() + Duration::from_secs(30)))
    }
    async fn release(&self, _: &Held, gone: impl FnOnce() + Send) {
        self.0.held.lock().unwrap().remove(&self.1);
        gone();
        if self.0.slow_releases.load(Ordering::SeqCst) {
            self.0.releases_finish.notified().await;
        }
    }
    async fn holder(&self) -> Result<Option<String>, ()> {
        Ok(None)
    }
}

impl LockEngine for Engine {
    type Name = Name;
    fn open(&self, name: &str, _: Duration) -> Result<Name, String> {
        self.0.opened.fetch_add(1, Ordering::SeqCst);
        Ok(Name(Arc::clone(&self.0), name.to_owned()))
    }
}

fn service(nodes: &Arc<Nodes>) -> Arc<Locks<Engine>> {
    let metrics = Metrics::new("t", &[], None).app_locks().clone();
    Locks::new(Engine(Arc::clone(nodes)), 16, metrics)
}

fn service_keeping(nodes: &Arc<Nodes>, keep: Duration, max: usize) -> Arc<Locks<Engine>> {
    let metrics = Metrics::new("t", &[], None).app_locks().clone();
    Locks::keeping_idle(Engine(Arc::clone(nodes)), 16, metrics, keep, max)
}

/// One acquisition and its release; the token.
async fn cycle(locks: &Arc<Locks<Engine>>, name: &str) -> u64 {
    let ttl = Duration::from_secs(10);
    let granted = locks
        .acquire(name, ttl, Duration::ZERO, None)
        .await
        .unwrap();
    locks.release(name, granted.lease).await.unwrap();
    granted.fencing_token
}

#[tokio::test]
async fn a_hot_name_reuses_its_engine_lock_cycle_after_cycle() {
    let nodes = Arc::new(Nodes::default());
    let locks = service(&nodes);
    let mut last = 0;
    for _ in 0..20 {
        let token = cycle(&locks, "hot").await;
        assert!(token > last, "every acquisition is a new one");
        last = token;
    }
    assert_eq!(nodes.opened.load(Ordering::SeqCst), 1, "opened once");
    assert_eq!(nodes.dropped.load(Ordering::SeqCst), 0, "kept while idle");
    assert_eq!(locks.table().slots.len(), 1);
}

#[tokio::test]
async fn a_name_nobody_uses_drops_its_engine_lock_after_the_idle_time() {
    let nodes = Arc::new(Nodes::default());
    let locks = service_keeping(&nodes, Duration::from_millis(50), 8);
    cycle(&locks, "once").await;
    until(|| nodes.dropped.load(Ordering::SeqCst) == 1).await;
    assert!(locks.table().slots.is_empty());
    assert_eq!(
        locks.table().timer_at,
        None,
        "nothing is due once the last idle name is gone"
    );
    // The name opens again when it is wanted again, and is dropped again.
    cycle(&locks, "once").await;
    assert_eq!(nodes.opened.load(Ordering::SeqCst), 2);
    until(|| nodes.dropped.load(Ordering::SeqCst) == 2).await;
}

#[tokio::test]
async fn distinct_names_leave_at_most_the_bound_of_idle_engine_locks() {
    let nodes = Arc::new(Nodes::default());
    let locks = service_keeping(&nodes, Duration::from_secs(3600), 4);
    for i in 0..50 {
        cycle(&locks, &format!("order-{i}")).await;
    }
    assert_eq!(nodes.opened.load(Ordering::SeqCst), 50);
    // The acquisition's part of a name is given back just after its answer.
    until(|| nodes.dropped.load(Ordering::SeqCst) == 46).await;
    assert_eq!(locks.table().slots.len(), 4);
    assert_eq!(locks.table().idle.len(), 4);
    // The most recent names are the ones kept: reused without opening.
    cycle(&locks, "order-49").await;
    assert_eq!(nodes.opened.load(Ordering::SeqCst), 50);
}

#[tokio::test]
async fn a_name_in_use_is_never_dropped_however_long_it_is_held() {
    let nodes = Arc::new(Nodes::default());
    let locks = service_keeping(&nodes, Duration::from_millis(10), 8);
    let ttl = Duration::from_secs(10);
    let held = locks
        .acquire("held", ttl, Duration::ZERO, None)
        .await
        .unwrap();
    // Other names come and go while it is held, and are dropped after their idle time
    // (so more than that time passes while it is held).
    for i in 0..5 {
        cycle(&locks, &format!("other-{i}")).await;
    }
    until(|| nodes.dropped.load(Ordering::SeqCst) == 5).await;
    assert!(locks.table().slots.contains_key(&("held".to_owned(), ttl)));
    locks.release("held", held.lease).await.unwrap();
    until(|| nodes.dropped.load(Ordering::SeqCst) == 6).await;
}

#[tokio::test]
async fn shutdown_drops_the_idle_names() {
    let nodes = Arc::new(Nodes::default());
    let locks = service(&nodes);
    cycle(&locks, "a").await;
    cycle(&locks, "b").await;
    until(|| locks.table().idle.len() == 2).await;
    locks.shutdown().await;
    assert_eq!(nodes.dropped.load(Ordering::SeqCst), 2);
    assert!(locks.table().slots.is_empty());
}

#[tokio::test]
async fn a_release_here_hands_the_name_to_the_next_request_here_without_an_announcement() {
    let nodes = Arc::new(Nodes::default());
    let locks = service(&nodes);
    let ttl = Duration::from_secs(10);
    let first = locks
        .acquire("hot", ttl, Duration::ZERO, None)
        .await
        .unwrap();
    let waiter = tokio::spawn({
        let locks = Arc::clone(&locks);
        async move {
            locks
                .acquire("hot", ttl, Duration::from_secs(20), None)
                .await
        }
    });
    // The waiter has its turn (it holds a claim) before the release.
    until(|| locks.counted() == 2).await;
    locks.release("hot", first.lease).await.unwrap();
    let second = clock::within(Duration::from_secs(5), waiter)
        .await
        .expect("handed over without waiting for the deadline")
        .unwrap()
        .unwrap();
    assert!(second.fencing_token > first.fencing_token);
    assert_eq!(
        nodes.busy_rounds.load(Ordering::SeqCst),
        0,
        "no round ran while the name was held here"
    );
}

#[tokio::test]
async fn past_its_wait_a_request_behind_a_lease_here_still_asks_the_nodes_once() {
    let nodes = Arc::new(Nodes::default());
    let locks = service(&nodes);
    let ttl = Duration::from_secs(10);
    locks
        .acquire("hot", ttl, Duration::ZERO, None)
        .await
        .unwrap();
    let refused = locks
        .acquire("hot", ttl, Duration::from_millis(20), None)
        .await;
    assert_eq!(refused.unwrap_err(), Refused::Held { holder: None });
    assert_eq!(nodes.busy_rounds.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_being_released_is_no_longer_kept_alive_and_delete_waits_for_the_nodes() {
    let nodes = Arc::new(Nodes::default());
    nodes.slow_releases.store(true, Ordering::SeqCst);
    let locks = service(&nodes);
    let is_held = |name: &str| nodes.held.lock().unwrap().contains(name);

    // Abandoned: once the release has deleted the key, a keepalive hears that it ended,
    // not a validity (another contender may hold the lock by now).
    let ttl = Duration::from_millis(200);
    let granted = locks
        .acquire("abandoned", ttl, Duration::ZERO, None)
        .await
        .unwrap();
    until(|| !is_held("abandoned")).await;
    assert!(matches!(
        locks.keepalive("abandoned", granted.lease),
        Err(Found::Ended(End::Abandoned))
    ));
    nodes.releases_finish.notify_waiters();

    // DELETE answers once the nodes answered the release, not before.
    let granted = locks
        .acquire("deleted", Duration::from_secs(10), Duration::ZERO, None)
        .await
        .unwrap();
    let releasing = tokio::spawn({
        let locks = Arc::clone(&locks);
        async move { locks.release("deleted", granted.lease).await }
    });
    until(|| !is_held("deleted")).await;
    assert!(!releasing.is_finished());
    assert!(matches!(
        locks.keepalive("deleted", granted.lease),
        Err(Found::Ended(End::Released))
    ));
    until(|| {
        nodes.releases_finish.notify_waiters();
        releasing.is_finished()
    })
    .await;
    assert_eq!(releasing.await.unwrap(), Ok(()));
}

fn service_of(nodes: &Arc<Nodes>, max: usize) -> Arc<Locks<Engine>> {
    let metrics = Metrics::new("t", &[], None).app_locks().clone();
    Locks::new(Engine(Arc::clone(nodes)), max, metrics)
}

#[tokio::test]
async fn a_held_lease_costs_no_task_while_it_waits() {
    let nodes = Arc::new(Nodes::default());
    let locks = service_of(&nodes, 2_000);
    let tasks = || {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    };
    let ttl = Duration::from_secs(30);
    locks
        .acquire("first", ttl, Duration::ZERO, None)
        .await
        .unwrap();
    let before = tasks();
    for i in 0..1_000 {
        locks
            .acquire(&format!("order-{i}"), ttl, Duration::ZERO, None)
            .await
            .unwrap();
    }
    assert_eq!(locks.held(), 1_001);
    assert_eq!(tasks(), before, "one timer task for all, none per lease");
    assert_eq!(locks.table().wakes.len(), 1_001, "one wake-up each");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_leases_count_against_the_bound_until_forgotten() {
    let nodes = Arc::new(Nodes::default());
    let locks = service_of(&nodes, 2);
    let short = Duration::from_millis(200);
    let a = locks
        .acquire("a", short, Duration::ZERO, None)
        .await
        .unwrap();
    locks
        .acquire("b", short, Duration::ZERO, None)
        .await
        .unwrap();
    // Nobody keeps them alive: abandoned after their ttl, and remembered.
    until(|| locks.held() == 0 && nodes.held.lock().unwrap().is_empty()).await;
    assert_eq!(locks.counted(), 2);
    let refused = locks.acquire("c", short, Duration::ZERO, None).await;
    assert_eq!(refused.unwrap_err(), Refused::TooMany { max: 2 });
    // The app hears how its lease ended; then it is forgotten, and there is room again.
    assert_eq!(
        locks.release("a", a.lease).await,
        Err(Found::Ended(End::Abandoned))
    );
    assert_eq!(locks.counted(), 1);
    locks
        .acquire("c", short, Duration::ZERO, None)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dapr_lock_that_expires_is_not_remembered() {
    let nodes = Arc::new(Nodes::default());
    let locks = service_of(&nodes, 1);
    let short = Duration::from_millis(200);
    let owner = || Some("app-1".to_owned());
    locks
        .acquire("a", short, Duration::ZERO, owner())
        .await
        .unwrap();
    until(|| locks.counted() == 0).await;
    locks
        .acquire("b", short, Duration::ZERO, owner())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_and_watches_have_bounds_of_their_own() {
    let nodes = Arc::new(Nodes::default());
    let locks = service_of(&nodes, 1_000);
    let ttl = Duration::from_secs(30);
    let held = locks
        .acquire("hot", ttl, Duration::ZERO, None)
        .await
        .unwrap();
    let mut waiters = Vec::new();
    for _ in 0..MAX_WAITING {
        let locks = Arc::clone(&locks);
        waiters.push(tokio::spawn(async move {
            locks
                .acquire("hot", ttl, Duration::from_secs(60), None)
                .await
        }));
    }
    until(|| locks.table().waiting == MAX_WAITING).await;
    let refused = locks
        .acquire("cold", ttl, Duration::from_secs(1), None)
        .await;
    assert_eq!(
        refused.unwrap_err(),
        Refused::TooManyWaiting { max: MAX_WAITING }
    );
    // A request without a wait, and a release, still go through.
    let other = locks
        .acquire("cold", ttl, Duration::ZERO, None)
        .await
        .unwrap();
    locks.release("cold", other.lease).await.unwrap();

    let mut watching: Vec<_> = (0..MAX_WATCHES)
        .map(|_| locks.watch("hot", held.lease).unwrap())
        .collect();
    assert!(matches!(
        locks.watch("hot", held.lease),
        Err(Found::TooManyWatches { .. })
    ));
    watching.pop();
    assert!(locks.watch("hot", held.lease).is_ok());
    for waiter in waiters {
        waiter.abort();
    }
    until(|| locks.table().waiting == 0).await;
}

/// Waits (with a deadline) until `done`.
async fn until(done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "condition not reached in 5 s"
        );
        tokio::task::yield_now().await;
        clock::pause(Duration::from_millis(1)).await;
    }
}

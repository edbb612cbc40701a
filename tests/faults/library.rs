//! In-process (library) contenders: a fleet of engines taking turns in critical sections.

use super::*;

/// How a library contender behaves in its critical section.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LibPlan {
    /// Hold each acquisition for a random time in this range (extending every ttl/3).
    pub(crate) hold: (Duration, Duration),
    /// Write to the store this often while holding.
    pub(crate) write_every: Duration,
    /// Stop writing this long before the lease's validity ends.
    pub(crate) margin: Duration,
}

impl LibPlan {
    /// Many quick handoffs.
    pub(crate) fn quick() -> LibPlan {
        LibPlan {
            hold: (Duration::ZERO, Duration::from_millis(3)),
            write_every: Duration::from_millis(1),
            margin: Duration::from_millis(100),
        }
    }

    /// Holds long enough to be extended, so faults hit held locks.
    pub(crate) fn holding() -> LibPlan {
        LibPlan {
            hold: (Duration::from_millis(10), Duration::from_millis(500)),
            write_every: Duration::from_millis(5),
            margin: Duration::from_millis(100),
        }
    }
}

/// What library contenders share with the scenario driving them.
pub(crate) struct LibCtx {
    pub(crate) store: Arc<FencedStore>,
    /// Pending "crash the next holder" requests, and when holders crashed.
    pub(crate) crash_requests: AtomicUsize,
    pub(crate) crashes: Mutex<Vec<Instant>>,
    /// A pending "pause the next holder this long" request, and what each pause wrote after:
    /// (who, token, whether its stale write was accepted).
    pub(crate) pause_request: Mutex<Option<Duration>>,
    pub(crate) pauses: Mutex<Vec<(String, u64, bool)>>,
    /// Pending "the next holder holds for 2–4 × ttl" requests, and the sessions that did
    /// (who, token).
    pub(crate) long_requests: AtomicUsize,
    pub(crate) long_sessions: Mutex<Vec<(String, u64)>>,
    /// Votes the restart rule did not count, over every contender.
    pub(crate) votes: Arc<VoteCounter>,
}

impl LibCtx {
    pub(crate) fn new(store: Arc<FencedStore>) -> Arc<LibCtx> {
        Arc::new(LibCtx {
            store,
            crash_requests: AtomicUsize::new(0),
            crashes: Mutex::new(Vec::new()),
            pause_request: Mutex::new(None),
            pauses: Mutex::new(Vec::new()),
            long_requests: AtomicUsize::new(0),
            long_sessions: Mutex::new(Vec::new()),
            votes: Arc::new(VoteCounter::default()),
        })
    }

    pub(crate) fn take_pause(&self) -> Option<Duration> {
        self.pause_request
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Asks the next holder to hold for 2–4 × ttl.
    pub(crate) fn request_long(&self) {
        self.long_requests.fetch_add(1, Ordering::SeqCst);
    }

    pub(crate) fn take_long(&self) -> bool {
        self.long_requests
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    pub(crate) fn is_long(&self, who: &str, token: u64) -> bool {
        self.long_sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|(w, t)| w == who && *t == token)
    }

    pub(crate) fn take_crash(&self) -> bool {
        self.crash_requests
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    pub(crate) fn crashes(&self) -> Vec<Instant> {
        self.crashes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(crate) fn pauses(&self) -> Vec<(String, u64, bool)> {
        self.pauses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Contends for the lock until `stop`: acquire, write `begin`, hold (writing and extending),
/// write `end`, release. A long request makes the hold 2–4 × ttl instead of the plan's. A crash
/// request drops the lease unreleased and starts a new client (a
/// restarted process); a pause request sleeps past the validity without renewing, then makes the
/// write it was about to make (a GC pause between the validity check and the write).
pub(crate) async fn library_contender(
    identity: String,
    cfg: RedlockConfig,
    plan: LibPlan,
    ctx: Arc<LibCtx>,
    stop: CancellationToken,
    seed: u64,
) -> usize {
    let mut rng = StdRng::seed_from_u64(seed);
    let client = || Redlock::new(cfg.clone(), ctx.votes.clone()).expect("valid config");
    let mut redlock = client();
    let ttl = cfg.ttl;
    let mut sessions = 0;
    let in_time = |lease: &Lease| Deadline::now() + plan.margin < lease.valid_until;
    // The store's records are `Instant`s: the deadline on their scale.
    let write = |lease: &Lease, kind: Kind| {
        ctx.store.write(
            &identity,
            lease.fencing_token,
            kind,
            Some(lease.valid_until.to_instant()),
        )
    };
    // `acquire` looks at `stop` only while it waits: an uncontended round still succeeds.
    while !stop.is_cancelled() {
        // Only cancellation ends an unbounded wait.
        let Ok(mut lease) = redlock.acquire(None, &stop, |_, _| {}).await else {
            break;
        };
        if !in_time(&lease) {
            redlock.release(&lease).await;
            continue;
        }
        sessions += 1;
        // Decided before `begin`, so that a long session is known as one from its start.
        let long = ctx.take_long();
        if long {
            ctx.long_sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((identity.clone(), lease.fencing_token));
        }
        write(&lease, Kind::Begin);
        if let Some(pause) = ctx.take_pause() {
            tokio::time::sleep(pause).await;
            let accepted = write(&lease, Kind::Write);
            ctx.pauses.lock().unwrap_or_else(|e| e.into_inner()).push((
                identity.clone(),
                lease.fencing_token,
                accepted,
            ));
            redlock.release(&lease).await;
            continue;
        }
        let hold = if long {
            rng.random_range(ttl * 2..=ttl * 4)
        } else {
            rng.random_range(plan.hold.0..=plan.hold.1)
        };
        let until = Deadline::now() + hold;
        let mut renew_at = lease.acquired_at + ttl / 3;
        let mut held = true;
        loop {
            let now = Deadline::now();
            if now >= until {
                break;
            }
            if now >= renew_at {
                match redlock.extend(&lease).await {
                    Ok(renewed) => {
                        lease = renewed;
                        renew_at = Deadline::now() + ttl / 3;
                    }
                    Err(_) => {
                        held = false;
                        break;
                    }
                }
            }
            tokio::time::sleep(plan.write_every.min(until.saturating_duration_since(now))).await;
            if !in_time(&lease) {
                held = false;
                break;
            }
            write(&lease, Kind::Write);
        }
        if ctx.take_crash() {
            // The process dies holding the lock: no `end`, no release; a new one starts.
            ctx.crashes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Instant::now());
            redlock = client();
            continue;
        }
        if held && in_time(&lease) {
            write(&lease, Kind::End);
        } else {
            // Gave up: the lock was lost or ran out.
            ctx.store.gone(
                &identity,
                lease.fencing_token,
                Some(lease.valid_until.to_instant()),
            );
        }
        redlock.release(&lease).await;
    }
    sessions
}

/// A group of library contenders on one lock.
pub(crate) struct LibFleet {
    pub(crate) ctx: Arc<LibCtx>,
    pub(crate) stop: CancellationToken,
    pub(crate) tasks: Vec<JoinHandle<usize>>,
    /// Identity → index, to find the holder's proxies.
    pub(crate) index: HashMap<String, usize>,
}

impl LibFleet {
    /// Starts one contender per entry of `urls` (each its own node URLs, e.g. its own proxies);
    /// contender i follows `plans[i % plans.len()]`.
    pub(crate) fn start(
        lock: &str,
        prefix: &str,
        urls: &[Vec<String>],
        plans: &[LibPlan],
        seed: u64,
    ) -> LibFleet {
        let ctx = LibCtx::new(FencedStore::new());
        let stop = CancellationToken::new();
        let mut tasks = Vec::new();
        let mut index = HashMap::new();
        for (i, urls) in urls.iter().enumerate() {
            let identity = format!("{prefix}{i}");
            index.insert(identity.clone(), i);
            tasks.push(tokio::spawn(library_contender(
                identity.clone(),
                lib_config(lock, &identity, urls),
                plans[i % plans.len()],
                ctx.clone(),
                stop.clone(),
                seed.wrapping_add(i as u64),
            )));
        }
        LibFleet {
            ctx,
            stop,
            tasks,
            index,
        }
    }

    pub(crate) fn store(&self) -> &FencedStore {
        &self.ctx.store
    }

    /// The contender index of the current holder, if a session is open.
    pub(crate) fn holder(&self) -> Option<(usize, String, u64)> {
        let (_, who, token) = self.store().last_begin()?;
        self.store()
            .is_open(&who, token)
            .then(|| (self.index[&who], who, token))
    }

    /// The holder, if its session is a long one: (begun, who, token).
    pub(crate) fn long_holder(&self) -> Option<(Instant, String, u64)> {
        let (at, who, token) = self.store().last_begin()?;
        (self.store().is_open(&who, token) && self.ctx.is_long(&who, token))
            .then_some((at, who, token))
    }

    pub(crate) async fn stop(self) -> Arc<LibCtx> {
        self.stop.cancel();
        for task in self.tasks {
            task.await.expect("library contender did not panic");
        }
        self.ctx
    }
}

/// Asks for a critical section of 2–4 × ttl and waits until one has been held for a ttl
/// (renewals carried it past its first validity window), so that the fault that follows
/// strikes it; returns (begun, who, token). Asks again if the one it asked for ended early.
pub(crate) async fn long_section(fleet: &LibFleet, what: &str) -> (Instant, String, u64) {
    fleet.ctx.request_long();
    support::wait_for_async(LIB_TTL * 8 + TAKEOVER_SLACK, what, || {
        let open = fleet.long_holder();
        if open.is_none() && fleet.ctx.long_requests.load(Ordering::SeqCst) == 0 {
            fleet.ctx.request_long();
        }
        open.filter(|(begun, _, _)| begun.elapsed() >= LIB_TTL)
    })
    .await
}

//! Mutual exclusion under faults, proven against real `redis-server` processes and the real binary.
//!
//! Every critical section writes to a fenced store ([`support::fenced`]) at its start, while it
//! runs and at its end; the store accepts a write only if its fencing token is at least the highest
//! it has accepted. The checker ([`support::checker`]) turns the records into sessions and asserts,
//! per scenario: tokens strictly increase in the order sessions begin; where no holder is paused,
//! no two sessions overlap and no write within its writer's validity is refused; where holders are
//! paused past their ttl, every overlap is fenced (the stale holder's writes were refused); and
//! the lock is taken again once a quorum is healthy.
//!
//! Critical sections come short and long: guard contenders hold for 0.4 s or for 2–4 × ttl
//! (only renewals keep those legitimate), and every guard run no fault was aimed at must exit
//! 0, its CMD's own code. Library contenders hold a section of 2–4 × ttl on request: every
//! other fault of the restart, data-loss and cut-off scenarios and every third of the soak
//! strikes such a section once it has been held for a ttl; the rolling restart asks for one
//! per round, the latency scenario one per phase (but the last).
//!
//! Each scenario prints a row of a summary table (`cargo test --test faults -- --nocapture`).
//! `REDLOCK_SOAK=N` makes the `soak` test run N handoffs under random faults
//! (`REDLOCK_SOAK_SEED=S` replays one run); see `scripts/soak.sh` and `docs/reliability.md`.

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redlock_sidecar::redlock::{quorum, Lease, Redlock, RedlockConfig};
use support::checker::{self, analyse, Analysis, Mode, Row};
use support::fenced::{FencedStore, Kind, Record, StoreServer};
use support::{FaultProxy, Proc, RedisCluster, RedisNode};
use tokio::task::{block_in_place, JoinHandle};
use tokio_util::sync::CancellationToken;

/// The ttl of in-process (library) contenders: short, so that faults cost little time.
const LIB_TTL: Duration = Duration::from_secs(1);
/// The ttl of the real binary's contenders (guard, run): room for their timers on a busy machine.
const PROC_TTL: Duration = Duration::from_secs(2);
/// Timing flags of every guard and run process (validated by the binary: see `guard --help`).
const PROC_TIMING: [&str; 10] = [
    "--ttl",
    "2s",
    "--safety-margin",
    "500ms",
    "--node-timeout",
    "50ms",
    "--connect-timeout",
    "250ms",
    "--retry-delay",
    "20ms",
];
/// Poll period of the supervisors and of the `run` sidecars' apps.
const POLL: Duration = Duration::from_millis(10);
/// A crashed holder's key lives out its ttl; the next holder must follow within this much more.
const TAKEOVER_SLACK: Duration = Duration::from_secs(3);
/// Writes of guard's long critical sections, 50 ms apart: 4, 5.5 and 7 s of sleeps (2 to
/// 3.5 × `PROC_TTL`, a little more with bash's own time). Only renewals keep them legitimate.
const LONG_SECTIONS: [u32; 3] = [80, 110, 140];
/// Writes of a short guard critical section (0.4 s).
const SHORT_SECTION: u32 = 8;
/// An upper bound on the longest guard critical section.
const LONGEST_SECTION: Duration = Duration::from_secs(9);

// ------------------------------------------------------------------------------------------------
// Cluster and configuration helpers
// ------------------------------------------------------------------------------------------------

fn ready_cluster(n: usize, ttl: Duration) -> RedisCluster {
    block_in_place(|| {
        let cluster = RedisCluster::start(n);
        cluster.wait_votes_count(ttl);
        cluster
    })
}

fn lib_config(lock: &str, identity: &str, urls: &[String]) -> RedlockConfig {
    let mut cfg = support::engine_config(urls, lock, identity, LIB_TTL);
    cfg.node_timeout = Duration::from_millis(50);
    cfg.connect_timeout = Duration::from_millis(250);
    cfg.retry_max = Duration::from_millis(100);
    cfg
}

/// One proxy per node, for one contender.
async fn proxies_for(cluster: &RedisCluster) -> Vec<FaultProxy> {
    let mut proxies = Vec::new();
    for addr in cluster.addrs() {
        proxies.push(FaultProxy::start(addr).await);
    }
    proxies
}

fn urls_of(proxies: &[FaultProxy]) -> Vec<String> {
    proxies.iter().map(FaultProxy::url).collect()
}

/// The earliest moment, measured from now, at which anyone can take `lock` over: the key must
/// be gone from a quorum of nodes, so it is the quorum-th smallest remaining ttl (0 where the key
/// is missing or the node is down).
fn earliest_takeover(cluster: &RedisCluster, lock: &str) -> Duration {
    let key = format!("redlock:{{{lock}}}");
    let mut left: Vec<Duration> = cluster
        .iter()
        .map(|node| {
            node.try_command(&["PTTL", &key])
                .ok()
                .and_then(|v| v.parse::<i64>().ok())
                .and_then(|ms| u64::try_from(ms).ok())
                .map_or(Duration::ZERO, Duration::from_millis)
        })
        .collect();
    left.sort();
    left[quorum(cluster.len()) - 1]
}

fn exit_code(status: std::process::ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// Waits (bounded) for a session that began at or after `after`, by someone other than `not`.
/// Panics naming `what` when none comes: the lock was not taken again.
async fn next_session(
    store: &FencedStore,
    after: Instant,
    not: Option<&str>,
    deadline: Duration,
    what: &str,
) -> (Instant, String, u64) {
    let found = |store: &FencedStore| {
        store
            .last_begin()
            .filter(|(at, who, _)| *at >= after && not.is_none_or(|n| n != who))
    };
    support::wait_for_async(deadline, what, || found(store)).await
}

/// Waits (bounded) until a session is open (begun, neither ended nor gone) and returns it.
async fn open_session(
    store: &FencedStore,
    deadline: Duration,
    what: &str,
) -> (Instant, String, u64) {
    let found = |store: &FencedStore| {
        store
            .last_begin()
            .filter(|(_, who, token)| store.is_open(who, *token))
    };
    support::wait_for_async(deadline, what, || found(store)).await
}

// ------------------------------------------------------------------------------------------------
// In-process (library) contenders
// ------------------------------------------------------------------------------------------------

/// How a library contender behaves in its critical section.
#[derive(Clone, Copy, Debug)]
struct LibPlan {
    /// Hold each acquisition for a random time in this range (extending every ttl/3).
    hold: (Duration, Duration),
    /// Write to the store this often while holding.
    write_every: Duration,
    /// Stop writing this long before the lease's validity ends.
    margin: Duration,
}

impl LibPlan {
    /// Many quick handoffs.
    fn quick() -> LibPlan {
        LibPlan {
            hold: (Duration::ZERO, Duration::from_millis(3)),
            write_every: Duration::from_millis(1),
            margin: Duration::from_millis(100),
        }
    }

    /// Holds long enough to be extended, so faults hit held locks.
    fn holding() -> LibPlan {
        LibPlan {
            hold: (Duration::from_millis(10), Duration::from_millis(500)),
            write_every: Duration::from_millis(5),
            margin: Duration::from_millis(100),
        }
    }
}

/// What library contenders share with the scenario driving them.
struct LibCtx {
    store: Arc<FencedStore>,
    /// Pending "crash the next holder" requests, and when holders crashed.
    crash_requests: AtomicUsize,
    crashes: Mutex<Vec<Instant>>,
    /// A pending "pause the next holder this long" request, and what each pause wrote after:
    /// (who, token, whether its stale write was accepted).
    pause_request: Mutex<Option<Duration>>,
    pauses: Mutex<Vec<(String, u64, bool)>>,
    /// Pending "the next holder holds for 2–4 × ttl" requests, and the sessions that did
    /// (who, token).
    long_requests: AtomicUsize,
    long_sessions: Mutex<Vec<(String, u64)>>,
    /// Votes the restart rule did not count, over every contender.
    votes: Arc<VoteCounter>,
}

impl LibCtx {
    fn new(store: Arc<FencedStore>) -> Arc<LibCtx> {
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

    fn take_pause(&self) -> Option<Duration> {
        self.pause_request
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Asks the next holder to hold for 2–4 × ttl.
    fn request_long(&self) {
        self.long_requests.fetch_add(1, Ordering::SeqCst);
    }

    fn take_long(&self) -> bool {
        self.long_requests
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    fn is_long(&self, who: &str, token: u64) -> bool {
        self.long_sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|(w, t)| w == who && *t == token)
    }

    fn take_crash(&self) -> bool {
        self.crash_requests
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    fn crashes(&self) -> Vec<Instant> {
        self.crashes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn pauses(&self) -> Vec<(String, u64, bool)> {
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
async fn library_contender(
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
    let in_time = |lease: &Lease| Instant::now() + plan.margin < lease.valid_until;
    let write = |lease: &Lease, kind: Kind| {
        ctx.store.write(
            &identity,
            lease.fencing_token,
            kind,
            Some(lease.valid_until),
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
        let until = Instant::now() + hold;
        let mut renew_at = lease.acquired_at + ttl / 3;
        let mut held = true;
        loop {
            let now = Instant::now();
            if now >= until {
                break;
            }
            if now >= renew_at {
                match redlock.extend(&lease).await {
                    Ok(renewed) => {
                        lease = renewed;
                        renew_at = Instant::now() + ttl / 3;
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
            ctx.store
                .gone(&identity, lease.fencing_token, Some(lease.valid_until));
        }
        redlock.release(&lease).await;
    }
    sessions
}

/// A group of library contenders on one lock.
struct LibFleet {
    ctx: Arc<LibCtx>,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<usize>>,
    /// Identity → index, to find the holder's proxies.
    index: HashMap<String, usize>,
}

impl LibFleet {
    /// Starts one contender per entry of `urls` (each its own node URLs, e.g. its own proxies);
    /// contender i follows `plans[i % plans.len()]`.
    fn start(
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

    fn store(&self) -> &FencedStore {
        &self.ctx.store
    }

    /// The contender index of the current holder, if a session is open.
    fn holder(&self) -> Option<(usize, String, u64)> {
        let (_, who, token) = self.store().last_begin()?;
        self.store()
            .is_open(&who, token)
            .then(|| (self.index[&who], who, token))
    }

    /// The holder, if its session is a long one: (begun, who, token).
    fn long_holder(&self) -> Option<(Instant, String, u64)> {
        let (at, who, token) = self.store().last_begin()?;
        (self.store().is_open(&who, token) && self.ctx.is_long(&who, token))
            .then_some((at, who, token))
    }

    async fn stop(self) -> Arc<LibCtx> {
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
async fn long_section(fleet: &LibFleet, what: &str) -> (Instant, String, u64) {
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

// ------------------------------------------------------------------------------------------------
// guard contenders (the real binary)
// ------------------------------------------------------------------------------------------------

/// CMD for guard: a bash one-liner that writes `begin`, then `writes` times `write` with `every`
/// between them, then `end`, to the store over loopback TCP; it exits 91/92/93 as soon as the
/// store refuses a write. `sleep` gets no copy of the socket, so the store sees the connection
/// close the moment bash dies.
fn guard_cmd(store_port: u16, writes: u32, every: &str) -> String {
    format!(
        r#"exec 3<>/dev/tcp/127.0.0.1/{store_port} || exit 90
say() {{ echo "$1 $REDLOCK_FENCING_TOKEN $REDLOCK_HOLDER $$" >&3 && read -r reply <&3 && [ "$reply" = ok ]; }}
say begin || exit 91
i=0
while [ $i -lt {writes} ]; do sleep {every} 3>&-; say write || exit 92; i=$((i+1)); done
say end || exit 93"#
    )
}

struct GuardRun {
    identity: String,
    proc: Proc,
    /// Its critical section is one of [`LONG_SECTIONS`].
    long: bool,
    /// A fault was aimed at it: its exit code is judged by the fleet's `fault_codes`.
    struck: bool,
}

/// How a guard run ended.
#[derive(Clone, Debug)]
struct GuardExit {
    identity: String,
    /// Exit code, or 128+signal.
    code: i32,
    long: bool,
    struck: bool,
}

#[derive(Default)]
struct GuardSlot {
    current: Option<GuardRun>,
    runs: u32,
    /// Every finished run.
    exits: Vec<GuardExit>,
    /// Output of runs that exited with an unexpected code.
    unexpected: Vec<String>,
    /// While set, the supervisor does not start a new run in this slot.
    frozen: bool,
}

impl GuardSlot {
    /// Marks the current run as struck by a fault; false if there is none.
    fn strike(&mut self) -> bool {
        self.current.as_mut().map(|run| run.struck = true).is_some()
    }
}

/// Guard contenders: one supervisor per slot keeps a `redlock-sidecar guard` running in it,
/// starting a new one (with a new identity) whenever the last one exits.
///
/// Each run's CMD writes `sections[k]` times (see [`guard_cmd`]), the slots taking the sections
/// in turn from different starting points. A run no fault was aimed at must exit 0: CMD's own
/// code after a section whose every write was accepted, however long it held the lock. A
/// struck run may exit with one of the scenario's `fault_codes`.
struct GuardFleet {
    slots: Vec<Arc<Mutex<GuardSlot>>>,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl GuardFleet {
    /// `urls[i]` are slot i's node URLs; CMDs write to the store on `store_port`.
    fn start(
        lock: &str,
        prefix: &str,
        urls: &[Vec<String>],
        store_port: u16,
        sections: &[u32],
        fault_codes: &'static [i32],
    ) -> GuardFleet {
        let stop = CancellationToken::new();
        let mut slots = Vec::new();
        let mut tasks = Vec::new();
        for (i, urls) in urls.iter().enumerate() {
            let slot = Arc::new(Mutex::new(GuardSlot::default()));
            let mut args: Vec<String> = ["guard", "--lock", lock, "--redis", &urls.join(",")]
                .iter()
                .chain(PROC_TIMING.iter())
                .chain(
                    [
                        "--kill-grace",
                        "300ms",
                        // Long sections of the others come first: never give up waiting.
                        "--wait",
                        "10m",
                        "--on-busy",
                        "fail",
                    ]
                    .iter(),
                )
                .map(|s| s.to_string())
                .collect();
            args.push("--identity".into());
            let mut cmds: Vec<(String, bool)> = sections
                .iter()
                .map(|&writes| {
                    let long = LONG_SECTIONS.contains(&writes);
                    (guard_cmd(store_port, writes, "0.05"), long)
                })
                .collect();
            let start = i % cmds.len();
            cmds.rotate_left(start);
            tasks.push(tokio::spawn(supervise_guard(
                slot.clone(),
                format!("{prefix}{i}."),
                args,
                cmds,
                fault_codes,
                stop.clone(),
            )));
            slots.push(slot);
        }
        GuardFleet { slots, stop, tasks }
    }

    /// The slot of a guard identity (`{prefix}{slot}.{run}`).
    fn slot_of(identity: &str) -> usize {
        let (head, _) = identity.rsplit_once('.').expect("guard identity");
        let digits = head.trim_start_matches(|c: char| !c.is_ascii_digit());
        digits.parse().expect("slot number")
    }

    /// Runs `f` on the guard process of `identity` if it is still the current run of its slot.
    fn with_run<T>(&self, identity: &str, f: impl FnOnce(&mut GuardSlot) -> T) -> Option<T> {
        let mut slot = self.slots[Self::slot_of(identity)]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let current = slot
            .current
            .as_ref()
            .is_some_and(|r| r.identity == identity);
        current.then(|| f(&mut slot))
    }

    /// Every finished run so far.
    fn exits(&self) -> Vec<GuardExit> {
        self.slots
            .iter()
            .flat_map(|slot| slot.lock().unwrap_or_else(|e| e.into_inner()).exits.clone())
            .collect()
    }

    /// Stops every supervisor (their guards are killed) and returns every finished run;
    /// panics with the output of runs that exited with an unexpected code.
    async fn stop(self) -> Vec<GuardExit> {
        self.stop.cancel();
        for task in self.tasks {
            task.await.expect("supervisor did not panic");
        }
        let mut exits = Vec::new();
        for slot in &self.slots {
            let slot = slot.lock().unwrap_or_else(|e| e.into_inner());
            assert!(
                slot.unexpected.is_empty(),
                "guard exited with an unexpected code:\n{}",
                slot.unexpected.join("\n")
            );
            exits.extend(slot.exits.iter().cloned());
        }
        exits
    }
}

async fn supervise_guard(
    slot: Arc<Mutex<GuardSlot>>,
    prefix: String,
    args: Vec<String>,
    cmds: Vec<(String, bool)>,
    fault_codes: &'static [i32],
    stop: CancellationToken,
) {
    loop {
        {
            let mut s = slot.lock().unwrap_or_else(|e| e.into_inner());
            let finished = s
                .current
                .as_mut()
                .and_then(|run| run.proc.try_status().map(|st| (run, exit_code(st))))
                .map(|(run, code)| {
                    let expected = if run.struck {
                        fault_codes.contains(&code)
                    } else {
                        code == 0
                    };
                    let unexpected = (!expected).then(|| {
                        format!(
                            "{} exited {code} ({}):\n{}",
                            run.identity,
                            if run.struck {
                                "struck by a fault"
                            } else {
                                "no fault aimed at it: CMD's own 0 expected"
                            },
                            run.proc.output_text()
                        )
                    });
                    let exit = GuardExit {
                        identity: run.identity.clone(),
                        code,
                        long: run.long,
                        struck: run.struck,
                    };
                    (exit, unexpected)
                });
            if let Some((exit, unexpected)) = finished {
                s.exits.push(exit);
                s.unexpected.extend(unexpected);
                s.current = None;
            }
            if stop.is_cancelled() {
                s.current = None; // dropping a Proc kills and reaps it
                return;
            }
            if s.current.is_none() && !s.frozen {
                let (cmd, long) = &cmds[s.runs as usize % cmds.len()];
                s.runs += 1;
                let identity = format!("{prefix}{}", s.runs);
                let argv: Vec<&str> = args
                    .iter()
                    .map(String::as_str)
                    .chain([identity.as_str(), "--", "bash", "-c", cmd])
                    .collect();
                let proc = Proc::spawn(&argv, &[("REDLOCK_LOG", "info")]);
                s.current = Some(GuardRun {
                    identity,
                    proc,
                    long: *long,
                    struck: false,
                });
            }
        }
        tokio::time::sleep(POLL).await;
    }
}

// ------------------------------------------------------------------------------------------------
// run contenders (the real binary) and their apps
// ------------------------------------------------------------------------------------------------

/// The app next to a `run` sidecar. It polls `/leader`; on a 200 it starts (or goes on with)
/// leader-only work under the answer's fencing token, writing to the store; it stops at once on
/// a 503, on an error, when a poll takes over 100 ms, or when the validity it was told runs out.
/// Told to stop (the pod shuts down), it ends its work with `end`: native sidecars are stopped
/// after the app, so the lock is released only then.
async fn app(identity: String, addr: SocketAddr, store: Arc<FencedStore>, stop: CancellationToken) {
    const WRITE_EVERY: Duration = Duration::from_millis(100);
    // (token, deadline, last write) of the work in progress.
    let mut work: Option<(u64, Instant, Instant)> = None;
    let end = |work: &mut Option<(u64, Instant, Instant)>| {
        if let Some((token, deadline, _)) = work.take() {
            if Instant::now() < deadline {
                store.write(&identity, token, Kind::End, Some(deadline));
            }
        }
    };
    while !stop.is_cancelled() {
        let sent = Instant::now();
        let answer = tokio::time::timeout(
            Duration::from_millis(100),
            support::http::get(addr, "/leader"),
        )
        .await;
        let leading = match answer {
            Ok(Ok(resp)) if resp.status == 200 => resp.json().ok().and_then(|body| {
                Some((
                    body["fencing_token"].as_u64()?,
                    body["validity_ms"].as_u64()?,
                ))
            }),
            _ => None,
        };
        let now = Instant::now();
        match (leading, work) {
            (Some((token, validity_ms)), current) => {
                let deadline = sent + Duration::from_millis(validity_ms);
                match current {
                    Some((t, _, last)) if t == token => {
                        let last = if now >= last + WRITE_EVERY {
                            store.write(&identity, token, Kind::Write, Some(deadline));
                            now
                        } else {
                            last
                        };
                        work = Some((token, deadline, last));
                    }
                    _ => {
                        end(&mut work);
                        store.write(&identity, token, Kind::Begin, Some(deadline));
                        work = Some((token, deadline, now));
                    }
                }
            }
            // Stop at once; no `end`: that marks a holder letting go on purpose.
            (None, Some((token, deadline, _))) => {
                store.gone(&identity, token, Some(deadline));
                work = None;
            }
            (None, None) => {}
        }
        if let Some((token, deadline, _)) = work.filter(|(_, deadline, _)| now >= *deadline) {
            // The validity it was told ran out with no fresh answer: stop, no more writes.
            store.gone(&identity, token, Some(deadline));
            work = None;
        }
        tokio::time::sleep(POLL).await;
    }
    end(&mut work);
}

struct RunMember {
    identity: String,
    addr: SocketAddr,
    proc: Proc,
    app_stop: CancellationToken,
    app: JoinHandle<()>,
}

/// `redlock-sidecar run` contenders on one lock, each with its app.
struct RunFleet {
    lock: String,
    urls: String,
    prefix: String,
    store: Arc<FencedStore>,
    members: Vec<RunMember>,
    started: u32,
    /// (identity, exit code) of members that were removed.
    exits: Vec<(String, i32)>,
}

impl RunFleet {
    fn start(lock: &str, prefix: &str, urls: &[String], n: usize) -> RunFleet {
        let mut fleet = RunFleet {
            lock: lock.to_owned(),
            urls: urls.join(","),
            prefix: prefix.to_owned(),
            store: FencedStore::new(),
            members: Vec::new(),
            started: 0,
            exits: Vec::new(),
        };
        for _ in 0..n {
            fleet.add();
        }
        fleet
    }

    /// Starts one more sidecar (a new pod) and its app.
    fn add(&mut self) {
        self.started += 1;
        let identity = format!("{}{}", self.prefix, self.started);
        let port = support::free_port();
        let listen = format!("127.0.0.1:{port}");
        let args: Vec<&str> = ["run", "--lock", &self.lock, "--redis", &self.urls]
            .into_iter()
            .chain(PROC_TIMING)
            .chain(["--listen", &listen, "--identity", &identity])
            .chain(["--kubernetes", "off"])
            .collect();
        let proc = Proc::spawn(&args, &[("REDLOCK_LOG", "info")]);
        let app_stop = CancellationToken::new();
        let addr: SocketAddr = listen.parse().expect("loopback address");
        let app = tokio::spawn(app(
            identity.clone(),
            addr,
            self.store.clone(),
            app_stop.clone(),
        ));
        self.members.push(RunMember {
            identity,
            addr,
            proc,
            app_stop,
            app,
        });
    }

    fn position(&self, identity: &str) -> Option<usize> {
        self.members.iter().position(|m| m.identity == identity)
    }

    /// The member whose app works as leader now.
    fn leader(&self) -> Option<(usize, String, u64)> {
        let (_, who, token) = self.store.last_begin()?;
        let i = self.position(&who)?;
        self.store.is_open(&who, token).then_some((i, who, token))
    }

    /// Removes member `i`. SIGTERM: its app ends its work first, then the sidecar gets SIGTERM.
    /// Anything else: the whole pod crashes (the app is aborted, the sidecar gets `sig`).
    async fn remove(&mut self, i: usize, sig: libc::c_int) -> i32 {
        let mut member = self.members.remove(i);
        if sig == libc::SIGTERM {
            member.app_stop.cancel();
            member.app.await.expect("app did not panic");
            member.proc.signal(sig);
        } else {
            // The pod crashes: the app dies mid-work (no `end`), and so does the sidecar.
            member.app.abort();
            let _ = member.app.await;
            member.proc.signal(sig);
        }
        let status = member
            .proc
            .wait_exit_async(Duration::from_secs(10))
            .await
            .unwrap_or_else(|| {
                panic!(
                    "{} did not exit\n{}",
                    member.identity,
                    member.proc.output_text()
                )
            });
        // Shown only if the test fails: what the sidecar saw, for the checker's verdict.
        println!(
            "--- {} (exit {status}) ---\n{}",
            member.identity,
            member.proc.output_text()
        );
        let code = exit_code(status);
        self.exits.push((member.identity, code));
        code
    }

    async fn stop(mut self) -> Vec<(String, i32)> {
        while !self.members.is_empty() {
            let code = self.remove(0, libc::SIGTERM).await;
            assert_eq!(code, 0, "a run sidecar exits 0 on SIGTERM");
        }
        self.exits
    }
}

// ------------------------------------------------------------------------------------------------
// Reporting
// ------------------------------------------------------------------------------------------------

/// Analyses `store` and panics on any violation, after printing the scenario's row either way.
fn check(
    scenario: &str,
    contenders: &str,
    faults: usize,
    records: &[Record],
    mode: Mode,
    crashes: &[Instant],
) -> (Analysis, Row) {
    let analysis = analyse(records, mode, crashes);
    let row = Row::new(scenario, contenders, faults, &analysis);
    if !analysis.violations.is_empty() {
        checker::report(vec![row.clone()]);
    }
    analysis.assert_no_violations(scenario);
    (analysis, row)
}

/// Counts the votes the restart rule refused to count.
#[derive(Default)]
struct VoteCounter {
    not_counted: AtomicUsize,
}

impl redlock_sidecar::redlock::Observer for VoteCounter {
    fn node_counted(&self, _index: usize, counted: bool) {
        if !counted {
            self.not_counted.fetch_add(1, Ordering::Relaxed);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// The checker and the store themselves
// ------------------------------------------------------------------------------------------------

fn record(
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
fn the_checker_flags_overlaps_token_regressions_and_refused_writes() {
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
fn the_checker_excludes_late_writes_and_measures_handoffs() {
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
async fn the_store_refuses_lower_tokens_and_sees_a_killed_writer_go() {
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

// ------------------------------------------------------------------------------------------------
// Scenarios
// ------------------------------------------------------------------------------------------------

/// Kills (SIGKILL) the guard whose CMD holds the lock, and checks its successor came no sooner
/// than the killed holder's key expired on a quorum. Returns the crash instant, or `None` if the
/// session ended on its own before the kill landed.
async fn kill_guard_holder(
    guards: &GuardFleet,
    store: &FencedStore,
    cluster: &RedisCluster,
    lock: &str,
) -> Option<Instant> {
    let (begun, who, token) = open_session(
        store,
        LONGEST_SECTION + PROC_TTL + TAKEOVER_SLACK,
        "a guard holds the lock",
    )
    .await;
    // Into its critical section, then dead.
    tokio::time::sleep_until((begun + Duration::from_millis(100)).into()).await;
    let crash = Instant::now();
    let killed = guards.with_run(&who, |slot| {
        slot.strike();
        slot.current.as_mut().is_some_and(|run| run.proc.sigkill())
    });
    let read_at = Instant::now();
    let bound = block_in_place(|| earliest_takeover(cluster, lock));
    let ended_before = store.count_since(begun, |r| {
        r.who == who && r.token == token && r.kind == Kind::End && r.at < crash
    }) > 0;
    if killed != Some(true) || ended_before {
        return None;
    }
    let (next, next_who, _) = next_session(
        store,
        crash,
        Some(&who),
        PROC_TTL + TAKEOVER_SLACK,
        "another guard takes the lock after a crash",
    )
    .await;
    assert!(
        next + Duration::from_millis(5) >= read_at + bound,
        "{next_who} began {:?} after {who} was killed, but its key still had {bound:?} on a quorum",
        next - crash
    );
    Some(crash)
}

/// Kills (SIGKILL) the `run` sidecar that leads, and checks its successor came no sooner than its
/// key expired on a quorum. A new sidecar replaces it (the pod restarts).
async fn kill_run_leader(run: &mut RunFleet, cluster: &RedisCluster) -> Instant {
    let (i, who, _) =
        support::wait_for_async(PROC_TTL + TAKEOVER_SLACK, "a run sidecar leads", || {
            run.leader()
        })
        .await;
    let crash = Instant::now();
    let code = run.remove(i, libc::SIGKILL).await;
    assert_eq!(code, 128 + libc::SIGKILL);
    let read_at = Instant::now();
    let bound = block_in_place(|| earliest_takeover(cluster, &run.lock));
    run.add();
    let (next, next_who, _) = next_session(
        &run.store,
        crash,
        Some(&who),
        PROC_TTL + TAKEOVER_SLACK,
        "another run sidecar leads after a crash",
    )
    .await;
    assert!(
        next + Duration::from_millis(5) >= read_at + bound,
        "{next_who} led {:?} after {who} was killed, but its key still had {bound:?} on a quorum",
        next - crash
    );
    crash
}

/// Stops the `run` leader gracefully (its app first, then SIGTERM: native sidecars stop after the
/// app) and starts a replacement.
async fn retire_run_leader(run: &mut RunFleet) {
    let (i, who, _) =
        support::wait_for_async(PROC_TTL + TAKEOVER_SLACK, "a run sidecar leads", || {
            run.leader()
        })
        .await;
    let stopped = Instant::now();
    let code = run.remove(i, libc::SIGTERM).await;
    assert_eq!(code, 0, "{who} exits 0 on SIGTERM");
    run.add();
    next_session(
        &run.store,
        stopped,
        Some(&who),
        PROC_TTL,
        "a standby leads after a graceful release, before the key could expire",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_is_replaced_only_after_its_key_expires_without_overlap() {
    let cluster = ready_cluster(3, PROC_TTL);
    let urls = cluster.urls();

    let guard_store = FencedStore::new();
    let server = StoreServer::start(guard_store.clone()).await;
    // Half the sections are short, half last 2–4 × ttl.
    let sections = [
        SHORT_SECTION,
        LONG_SECTIONS[0],
        SHORT_SECTION,
        LONG_SECTIONS[1],
    ]
    .into_iter()
    .chain([SHORT_SECTION, LONG_SECTIONS[2]])
    .collect::<Vec<_>>();
    let guards = GuardFleet::start(
        "kill-guard",
        "guard",
        &vec![urls.clone(); 3],
        server.port(),
        &sections,
        // Killed, or done just before the kill landed.
        &[0, 128 + libc::SIGKILL],
    );
    let mut run = RunFleet::start("kill-run", "run", &urls, 3);

    let rounds = 3;
    let (mut guard_crashes, mut run_crashes, mut run_faults) = (Vec::new(), Vec::new(), 0);
    for _ in 0..rounds {
        let (guard_crash, run_crash) = tokio::join!(
            async {
                // A session can end on its own just as it is killed: try again then.
                for _ in 0..5 {
                    if let Some(crash) =
                        kill_guard_holder(&guards, &guard_store, &cluster, "kill-guard").await
                    {
                        return crash;
                    }
                }
                panic!("could not kill a guard inside its critical section");
            },
            async {
                let crash = kill_run_leader(&mut run, &cluster).await;
                retire_run_leader(&mut run).await;
                crash
            }
        );
        guard_crashes.push(guard_crash);
        run_crashes.push(run_crash);
        run_faults += 2;
    }
    // Long sections run to their end under renewals, and graceful handoffs go on.
    support::wait_until_async(
        LONGEST_SECTION * 3 + TAKEOVER_SLACK,
        "a section of 2–4 × ttl that no fault struck finishes",
        || async {
            guards
                .exits()
                .iter()
                .any(|exit| exit.long && !exit.struck && exit.code == 0)
        },
    )
    .await;
    next_session(
        &guard_store,
        Instant::now(),
        None,
        LONGEST_SECTION + TAKEOVER_SLACK,
        "guards go on",
    )
    .await;

    let guard_exits = guards.stop().await;
    let run_store = run.store.clone();
    let run_exits = run.stop().await;
    let killed = guard_exits
        .iter()
        .filter(|exit| exit.code == 128 + libc::SIGKILL)
        .count();
    assert_eq!(
        killed, rounds,
        "every killed guard shows SIGKILL: {guard_exits:?}"
    );
    // Every run no fault was aimed at exited 0 (checked by `stop`), long ones too.
    assert_eq!(
        run_exits.iter().filter(|(_, c)| *c == 0).count(),
        rounds + 3,
        "every retired sidecar exited 0: {run_exits:?}"
    );

    let (guard_a, guard_row) = check(
        "SIGKILL holder (guard)",
        "3 guard",
        rounds,
        &guard_store.records(),
        Mode::Strict,
        &guard_crashes,
    );
    let (run_a, run_row) = check(
        "SIGKILL / SIGTERM leader (run)",
        "3 run + app",
        run_faults,
        &run_store.records(),
        Mode::Strict,
        &run_crashes,
    );
    for a in [&guard_a, &run_a] {
        assert_eq!(
            a.crash_takeovers.len(),
            rounds,
            "a successor after every crash"
        );
        let slowest = checker::quantile(&a.crash_takeovers, 1.0).expect("takeovers");
        assert!(
            slowest <= PROC_TTL + TAKEOVER_SLACK,
            "liveness: {slowest:?}"
        );
        let release = checker::quantile(&a.release_takeovers, 1.0).expect("graceful handoffs");
        assert!(
            release < PROC_TTL,
            "a release hands over before any expiry: {release:?}"
        );
    }
    checker::report(vec![guard_row, run_row]);
}

/// Sends `sig` to process group `pgid` (guard's CMD leads its own group).
fn signal_group(pgid: u32, sig: libc::c_int) {
    let pgid = libc::pid_t::try_from(pgid).expect("pid fits");
    // SAFETY: kill(2) has no memory-safety preconditions; the group is CMD's, a descendant of
    // this test that is still running (it is stopped, not reaped).
    let rc = unsafe { libc::kill(-pgid, sig) };
    assert_eq!(rc, 0, "kill(-{pgid}, {sig})");
}

/// The value of `redlock_lock_lost_total{reason="…"}` in a metrics text.
fn lost_count(metrics: &str, reason: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("redlock_lock_lost_total") && l.contains(reason))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_paused_past_its_ttl_is_caught_by_fencing() {
    let cluster = ready_cluster(3, PROC_TTL);
    let urls = cluster.urls();
    let pause = PROC_TTL + Duration::from_secs(1);
    let rounds = 2;

    // guard and CMD frozen together (a stopped VM, a stop-the-world pause of the whole pod).
    let guard_part = async {
        let store = FencedStore::new();
        let server = StoreServer::start(store.clone()).await;
        // CMD writes until it is stopped: only renewals keep it legitimate.
        let guards = GuardFleet::start(
            "pause-guard",
            "guard",
            &vec![urls.clone(); 2],
            server.port(),
            &[100_000],
            &[76, 92],
        );
        let mut paused_exits = Vec::new();
        for _ in 0..rounds {
            let (begun, who, token) =
                open_session(&store, PROC_TTL + TAKEOVER_SLACK, "a guard holds the lock").await;
            let cmd_pid = store
                .records()
                .iter()
                .find(|r| r.who == who && r.kind == Kind::Begin)
                .and_then(|r| r.pid)
                .expect("CMD sent its pid");
            let stopped = guards
                .with_run(&who, |slot| {
                    slot.frozen = true;
                    slot.strike();
                    let run = slot.current.as_mut().expect("current run");
                    run.proc.sigstop()
                })
                .expect("the holder's guard is running");
            assert!(stopped);
            // The whole pod stops: guard's supervisor too, which would otherwise kill CMD at
            // the step-down point (as it must when only guard is stuck).
            let supervisor = support::proc_parent(cmd_pid).expect("CMD's supervisor");
            assert!(support::send_signal(supervisor, libc::SIGSTOP));
            signal_group(cmd_pid, libc::SIGSTOP);
            // Paused holders keep their lock until it expires; then someone else gets it.
            let (next, next_who, _) = next_session(
                &store,
                begun,
                Some(&who),
                PROC_TTL + TAKEOVER_SLACK,
                "another guard takes over from a paused one",
            )
            .await;
            tokio::time::sleep_until((begun + pause).max(next).into()).await;
            // CMD wakes first and makes the write it was about to make.
            let woke = Instant::now();
            signal_group(cmd_pid, libc::SIGCONT);
            support::wait_until_async(
                Duration::from_secs(5),
                "the paused CMD writes after waking",
                || async {
                    store.count_since(woke, |r| {
                        r.who == who && r.token == token && r.kind != Kind::Gone
                    }) > 0
                },
            )
            .await;
            assert_eq!(
                store.count_since(woke, |r| r.who == who && r.kind != Kind::Gone && r.accepted),
                0,
                "{who}'s writes after its pause were refused ({next_who} holds a newer token)"
            );
            // Then its supervisor and guard wake, find the lock lost, and make sure CMD is gone.
            support::send_signal(supervisor, libc::SIGCONT);
            guards.with_run(&who, |slot| {
                let run = slot.current.as_mut().expect("current run");
                run.proc.sigcont();
                slot.frozen = false;
            });
            support::wait_until_async(
                Duration::from_secs(10),
                "the paused guard exits",
                || async { guards.with_run(&who, |_| ()).is_none() },
            )
            .await;
            paused_exits.push(who);
        }
        // The guard that took over last (no fault aimed at it) holds on for two validity
        // windows and more: renewals carry its critical section.
        let (begun, who, token) =
            open_session(&store, PROC_TTL + TAKEOVER_SLACK, "a guard holds the lock").await;
        support::wait_until_async(
            PROC_TTL * 3,
            "the last holder is still in its critical section after 2 × ttl",
            || async {
                assert!(
                    store.is_open(&who, token),
                    "{who}'s critical section ended after {:?}: {:?}",
                    begun.elapsed(),
                    guards.exits()
                );
                begun.elapsed() >= PROC_TTL * 2
            },
        )
        .await;
        let exits = guards.stop().await;
        for who in &paused_exits {
            let code = exits
                .iter()
                .find(|exit| exit.identity == *who)
                .expect("exit")
                .code;
            assert!(
                code == 76 || code == 92,
                "{who}: lock lost (76) or CMD's own exit on the refused write (92), got {code}"
            );
        }
        let (a, row) = check(
            "SIGSTOP holder past ttl (guard + CMD)",
            "2 guard",
            rounds,
            &store.records(),
            Mode::Fenced,
            &[],
        );
        assert!(a.stale_refused >= rounds, "every pause was caught: {a:?}");
        assert!(
            a.overlaps.iter().filter(|o| o.fenced).count() >= rounds,
            "the paused CMDs did run on (fenced, not prevented)"
        );
        row
    };

    // run sidecar frozen; its app stops trusting it when polls time out.
    let run_part = async {
        let mut run = RunFleet::start("pause-run", "run", &urls, 2);
        for _ in 0..rounds {
            let (i, who, _) =
                support::wait_for_async(PROC_TTL + TAKEOVER_SLACK, "a run sidecar leads", || {
                    run.leader()
                })
                .await;
            let addr = run.members[i].addr;
            assert!(run.members[i].proc.sigstop());
            let paused = Instant::now();
            next_session(
                &run.store,
                paused,
                Some(&who),
                PROC_TTL + TAKEOVER_SLACK,
                "another sidecar leads while the leader is frozen",
            )
            .await;
            tokio::time::sleep_until((paused + pause).into()).await;
            assert!(run.members[i].proc.sigcont());
            let first = support::http::get(addr, "/leader")
                .await
                .expect("the resumed sidecar answers");
            assert_eq!(
                first.status, 503,
                "a sidecar resumed after its term must not claim leadership: {}",
                first.body
            );
            support::wait_until_async(
                Duration::from_secs(5),
                "the resumed sidecar counts a lock lost to a pause",
                || async {
                    support::http::get(addr, "/metrics")
                        .await
                        .is_ok_and(|m| lost_count(&m.body, "reason=\"paused\"") >= 1)
                },
            )
            .await;
        }
        let store = run.store.clone();
        run.stop().await;
        let (_, row) = check(
            "SIGSTOP leader past ttl (run)",
            "2 run + app",
            rounds,
            &store.records(),
            Mode::Strict,
            &[],
        );
        row
    };

    // In-process holders that stop between their validity check and their write.
    let lib_part = async {
        let fleet = LibFleet::start(
            "pause-lib",
            "lib",
            &vec![urls.clone(); 3],
            &[LibPlan::quick()],
            7,
        );
        for round in 0..3 {
            *fleet.ctx.pause_request.lock().unwrap() = Some(LIB_TTL + Duration::from_millis(500));
            support::wait_until_async(
                LIB_TTL + TAKEOVER_SLACK,
                "a paused library holder wakes and writes",
                || async { fleet.ctx.pauses().len() > round },
            )
            .await;
        }
        let ctx = fleet.stop().await;
        for (who, token, accepted) in ctx.pauses() {
            assert!(
                !accepted,
                "{who}'s write with token {token} after its pause was refused"
            );
        }
        let (a, row) = check(
            "pause past validity (library)",
            "3 library",
            3,
            &ctx.store.records(),
            Mode::Strict,
            &[],
        );
        assert!(a.late_writes >= 3 && a.stale_refused >= 3, "{a:?}");
        row
    };

    let (guard_row, run_row, lib_row) = tokio::join!(guard_part, run_part, lib_part);
    checker::report(vec![guard_row, run_row, lib_row]);
}

/// Restarts `nodes` of `cluster` (SIGKILL, then start empty on the same port) from a blocking
/// section; `down` is how long they stay down.
fn restart_nodes(cluster: &Mutex<RedisCluster>, nodes: &[usize], down: Duration) {
    block_in_place(|| {
        let mut cluster = cluster.lock().unwrap_or_else(|e| e.into_inner());
        for &i in nodes {
            cluster.node_mut(i).stop();
        }
        // The fault's own duration: the nodes are down this long.
        std::thread::sleep(down);
        for &i in nodes {
            cluster.node_mut(i).start_again();
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_nodes_restarted_empty_under_held_locks_never_allow_two_holders() {
    let cluster = Mutex::new(ready_cluster(3, LIB_TTL));
    let urls = cluster.lock().unwrap().urls();
    let fleet = LibFleet::start(
        "restart-lib",
        "lib",
        &vec![urls.clone(); 4],
        &[LibPlan::holding(), LibPlan::quick()],
        11,
    );
    let mut rng = StdRng::seed_from_u64(11);
    let (mut faults, mut restarts) = (0, 0);
    let mut held_when_hit = 0;
    let end = Instant::now() + Duration::from_secs(12);
    let mut last_fault = Instant::now();
    while Instant::now() < end {
        // Strike while someone holds the lock (a restart loses the holder's key on that node);
        // every other time, a critical section of 2–4 × ttl that renewals carry.
        let (_, who, token) = if faults % 2 == 1 {
            long_section(&fleet, "a long critical section under restarts").await
        } else {
            open_session(
                fleet.store(),
                LIB_TTL * 3 + TAKEOVER_SLACK,
                "the lock is taken again once a quorum counts",
            )
            .await
        };
        let k = rng.random_range(1..=2);
        let mut nodes: Vec<usize> = (0..3).collect();
        while nodes.len() > k {
            nodes.remove(rng.random_range(0..nodes.len()));
        }
        restart_nodes(
            &cluster,
            &nodes,
            Duration::from_millis(rng.random_range(0..100)),
        );
        held_when_hit += usize::from(fleet.store().is_open(&who, token));
        faults += 1;
        restarts += k;
        last_fault = Instant::now();
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..1500))).await;
    }
    // Liveness: once the restarted nodes have been up for ttl + drift, the lock moves again.
    next_session(
        fleet.store(),
        last_fault,
        None,
        LIB_TTL * 3 + TAKEOVER_SLACK,
        "the lock is taken again after the last restart",
    )
    .await;
    let ctx = fleet.stop().await;
    let not_counted = ctx.votes.not_counted.load(Ordering::Relaxed);
    assert!(
        not_counted > 0,
        "the restart rule had votes to refuse (restarted nodes granted)"
    );
    assert!(held_when_hit > 0, "restarts hit held locks");
    let (_, row) = check(
        &format!("Redis restarts, 1–2 of 3 at once ({restarts} restarts)"),
        "4 library",
        faults,
        &ctx.store.records(),
        Mode::Strict,
        &[],
    );
    checker::report(vec![row]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_every_node_keeps_one_holder_at_a_time() {
    let cluster = Mutex::new(ready_cluster(3, PROC_TTL));
    let urls = cluster.lock().unwrap().urls();
    let fleet = LibFleet::start(
        "roll-lib",
        "lib",
        &vec![urls.clone(); 4],
        &[LibPlan::holding(), LibPlan::quick()],
        13,
    );
    let run = RunFleet::start("roll-run", "run", &urls, 2);
    open_session(
        &run.store,
        PROC_TTL + TAKEOVER_SLACK,
        "a run sidecar leads before the rolling restart",
    )
    .await;
    // Two rounds over the nodes, one at a time, as a StatefulSet rollout does: each node is down
    // briefly, comes back empty, and the next one goes once it answers again (plus a pause).
    let mut restarts = 0;
    for _ in 0..2 {
        for node in 0..3 {
            if node == 0 {
                // The next library holder holds 2–4 × ttl, through this round's restarts.
                fleet.ctx.request_long();
            }
            restart_nodes(&cluster, &[node], Duration::from_millis(200));
            restarts += 1;
            tokio::time::sleep(Duration::from_millis(1200)).await;
        }
    }
    let rolled = Instant::now();
    // Liveness for the run lock: its leader may lose the lock during the rollout (see
    // `a_leader_keeps_its_lock_through_a_rolling_restart` below), but someone leads after it.
    support::wait_until_async(
        PROC_TTL * 2 + TAKEOVER_SLACK,
        "a run sidecar leads after the rolling restart",
        || async {
            run.leader().is_some_and(|(_, who, token)| {
                run.store.count_since(rolled, |r| {
                    r.who == who && r.token == token && r.kind != Kind::Gone
                }) > 0
            })
        },
    )
    .await;
    // Liveness for the library lock, whose handoffs need counted votes.
    next_session(
        fleet.store(),
        rolled,
        None,
        LIB_TTL * 3 + TAKEOVER_SLACK,
        "the library lock moves again after the rolling restart",
    )
    .await;
    let ctx = fleet.stop().await;
    let run_store = run.store.clone();
    run.stop().await;
    let (_, lib_row) = check(
        "rolling restart, 2 rounds (library)",
        "4 library",
        restarts,
        &ctx.store.records(),
        Mode::Strict,
        &[],
    );
    let (_, run_row) = check(
        "rolling restart, 2 rounds (run)",
        "2 run + app",
        restarts,
        &run_store.records(),
        Mode::Strict,
        &[],
    );
    checker::report(vec![lib_row, run_row]);
}

/// Cuts one contender's proxies to `nodes` off: a blackhole (bytes held until healed, as TCP
/// would retransmit them) or refusal (open connections dropped, new ones reset).
fn cut_off(proxies: &[FaultProxy], nodes: &[usize], blackhole: bool) {
    for &i in nodes {
        if blackhole {
            proxies[i].blackhole(true);
        } else {
            proxies[i].refuse(true);
            proxies[i].drop_connections();
        }
    }
}

fn heal(proxies: &[FaultProxy]) {
    for proxy in proxies {
        proxy.heal();
    }
}

impl GuardFleet {
    /// The exit code of the finished run `identity`.
    fn exit_of(&self, identity: &str) -> Option<i32> {
        let slot = self.slots[Self::slot_of(identity)]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        slot.exits
            .iter()
            .find(|exit| exit.identity == identity)
            .map(|exit| exit.code)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cut_off_from_a_majority_stops_before_anyone_else_starts() {
    let cluster = ready_cluster(3, PROC_TTL);
    let rounds = 4;

    let mut guard_proxies = Vec::new();
    let mut lib_proxies = Vec::new();
    for _ in 0..3 {
        guard_proxies.push(proxies_for(&cluster).await);
        lib_proxies.push(proxies_for(&cluster).await);
    }
    let store = FencedStore::new();
    let server = StoreServer::start(store.clone()).await;
    // Sections of 2–4 × ttl: only renewals keep them legitimate, so a cut-off holder must stop
    // CMD, and the others must not.
    let guard_urls: Vec<Vec<String>> = guard_proxies.iter().map(|p| urls_of(p)).collect();
    let guards = GuardFleet::start(
        "part-guard",
        "guard",
        &guard_urls,
        server.port(),
        &LONG_SECTIONS,
        &[76],
    );
    let lib_urls: Vec<Vec<String>> = lib_proxies.iter().map(|p| urls_of(p)).collect();
    let fleet = LibFleet::start(
        "part-lib",
        "lib",
        &lib_urls,
        &[LibPlan::holding(), LibPlan::quick()],
        17,
    );

    let guard_part = async {
        for round in 0..rounds {
            let (_, who, _) =
                open_session(&store, PROC_TTL + TAKEOVER_SLACK, "a guard holds the lock").await;
            let slot = GuardFleet::slot_of(&who);
            guards.with_run(&who, GuardSlot::strike);
            cut_off(&guard_proxies[slot], &[0, 1], round % 2 == 0);
            let cut = Instant::now();
            next_session(
                &store,
                cut,
                Some(&who),
                PROC_TTL + TAKEOVER_SLACK,
                "a guard with a quorum takes over from the cut-off holder",
            )
            .await;
            support::wait_until_async(
                Duration::from_secs(5),
                "the cut-off guard stops CMD and exits 76",
                || async { guards.exit_of(&who).is_some() },
            )
            .await;
            assert_eq!(guards.exit_of(&who), Some(76), "{who} self-fenced");
            heal(&guard_proxies[slot]);
        }
    };
    let lib_part = async {
        for round in 0..rounds {
            // Every other round cuts off a holder of 2–4 × ttl that renewals carried so far.
            let (i, who, _) = if round % 2 == 1 {
                let (_, who, token) = long_section(&fleet, "a long library critical section").await;
                (fleet.index[&who], who, token)
            } else {
                support::wait_for_async(
                    LIB_TTL + TAKEOVER_SLACK,
                    "a library contender holds the lock",
                    || fleet.holder(),
                )
                .await
            };
            cut_off(&lib_proxies[i], &[1, 2], round % 2 == 1);
            let cut = Instant::now();
            next_session(
                fleet.store(),
                cut,
                Some(&who),
                LIB_TTL + TAKEOVER_SLACK,
                "a contender with a quorum takes over from the cut-off holder",
            )
            .await;
            // Some more handoffs among the others, then the network heals.
            tokio::time::sleep(Duration::from_millis(500)).await;
            heal(&lib_proxies[i]);
        }
    };
    tokio::join!(guard_part, lib_part);
    let healed = Instant::now();
    next_session(
        fleet.store(),
        healed,
        None,
        LIB_TTL + TAKEOVER_SLACK,
        "the library lock moves after the partitions heal",
    )
    .await;
    let exits = guards.stop().await;
    let ctx = fleet.stop().await;
    assert!(
        exits.iter().filter(|exit| exit.code == 76).count() >= rounds,
        "{exits:?}"
    );
    let (_, guard_row) = check(
        "holder cut off from 2 of 3 nodes (guard)",
        "3 guard, own proxies",
        rounds,
        &store.records(),
        Mode::Strict,
        &[],
    );
    let (_, lib_row) = check(
        "holder cut off from 2 of 3 nodes (library)",
        "4 library, own proxies",
        rounds,
        &ctx.store.records(),
        Mode::Strict,
        &[],
    );
    checker::report(vec![guard_row, lib_row]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_and_jitter_never_let_two_holders_in() {
    let cluster = ready_cluster(3, LIB_TTL);
    let mut proxies = Vec::new();
    for _ in 0..4 {
        proxies.push(proxies_for(&cluster).await);
    }
    let urls: Vec<Vec<String>> = proxies.iter().map(|p| urls_of(p)).collect();
    let fleet = LibFleet::start(
        "latency-lib",
        "lib",
        &urls,
        &[LibPlan::holding(), LibPlan::quick()],
        19,
    );
    // (nodes, fixed, jitter, how long) per phase; latency applies each way, the node timeout is
    // 50 ms: mild, then around the timeout, then a slow majority, then nothing in time at all.
    let ms = Duration::from_millis;
    let phases = [
        (vec![0, 1, 2], ms(1), ms(10), ms(2500)),
        (vec![0, 1, 2], ms(5), ms(30), ms(2500)),
        (vec![0, 1], ms(20), ms(20), ms(2000)),
        (vec![0, 1, 2], ms(150), ms(0), ms(2000)),
    ];
    let mut begun = Vec::new();
    for (phase, (nodes, fixed, jitter, lasting)) in phases.iter().enumerate() {
        for contender in &proxies {
            heal(contender);
            for &i in nodes {
                contender[i].set_latency(*fixed, *jitter);
            }
        }
        let from = Instant::now();
        if phase < 3 {
            // The next holder holds 2–4 × ttl, renewing under this latency.
            fleet.ctx.request_long();
        }
        // The fault's own duration.
        tokio::time::sleep(*lasting).await;
        begun.push((
            from,
            fleet.store().count_since(from, |r| r.kind == Kind::Begin),
        ));
    }
    for contender in &proxies {
        heal(contender);
    }
    let healed = Instant::now();
    next_session(
        fleet.store(),
        healed,
        None,
        LIB_TTL + TAKEOVER_SLACK,
        "the lock moves again once answers are timely",
    )
    .await;
    let ctx = fleet.stop().await;
    assert!(
        begun[0].1 > 0,
        "handoffs go on under mild latency: {begun:?}"
    );
    // Nothing answers within the node timeout in the last phase: no acquisition may succeed
    // (rounds already under way when it began are given the node timeout).
    let (last_from, _) = begun[3];
    let late_acquisitions = ctx.store.count_since(last_from + ms(200), |r| {
        r.kind == Kind::Begin && r.at < healed
    });
    assert_eq!(
        late_acquisitions, 0,
        "acquired without timely answers from a quorum"
    );
    let (_, row) = check(
        "latency + jitter, 4 phases up to 300 ms round trips",
        "4 library, own proxies",
        phases.len(),
        &ctx.store.records(),
        Mode::Strict,
        &[],
    );
    checker::report(vec![row]);
}

/// The faults the soak test picks from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    /// One node killed and started again empty.
    RestartOne,
    /// Two of three nodes at once: a majority loses the lock and the fencing counter.
    RestartTwo,
    /// Every node at once: all data gone.
    RestartAll,
    /// A node frozen (SIGSTOP) and thawed.
    PauseNode,
    /// The holder cut off from two nodes: bytes held until healed.
    CutHolderBlackhole,
    /// The holder cut off from two nodes: connections reset.
    CutHolderRefuse,
    /// Some contender cut off from one node.
    CutMinority,
    /// Latency and jitter on every contender's every node.
    Latency,
    /// Every connection to one node dropped.
    DropConnections,
    /// The holder dies without releasing.
    CrashHolder,
    /// The holder pauses past its validity, then writes.
    PauseHolder,
    /// `FLUSHALL` on one, two or three nodes: data lost without a restart.
    FlushAll,
    /// `FLUSHDB` on one, two or three nodes.
    FlushDb,
    /// One, two or three nodes restored from a snapshot taken a moment before (the lock has
    /// moved on since): old data, a new run id.
    RestoreSnapshot,
    /// One node's address moved to a replica whose link broke a moment before: it missed the
    /// latest writes.
    Failover,
}

const FAULTS: [Fault; 15] = [
    Fault::RestartOne,
    Fault::RestartTwo,
    Fault::RestartAll,
    Fault::PauseNode,
    Fault::CutHolderBlackhole,
    Fault::CutHolderRefuse,
    Fault::CutMinority,
    Fault::Latency,
    Fault::DropConnections,
    Fault::CrashHolder,
    Fault::PauseHolder,
    Fault::FlushAll,
    Fault::FlushDb,
    Fault::RestoreSnapshot,
    Fault::Failover,
];

/// Picks `k` distinct nodes of three.
fn some_nodes(rng: &mut StdRng, k: usize) -> Vec<usize> {
    let mut nodes: Vec<usize> = (0..3).collect();
    while nodes.len() > k {
        nodes.remove(rng.random_range(0..nodes.len()));
    }
    nodes
}

/// Injects `fault`, waits out its duration and heals it.
async fn inject(
    fault: Fault,
    rng: &mut StdRng,
    cluster: &Mutex<RedisCluster>,
    proxies: &[Vec<FaultProxy>],
    fleet: &LibFleet,
    standbys: &Standbys,
) {
    let ms = |rng: &mut StdRng, lo: u64, hi: u64| Duration::from_millis(rng.random_range(lo..hi));
    match fault {
        Fault::RestartOne | Fault::RestartTwo | Fault::RestartAll => {
            let k = match fault {
                Fault::RestartOne => 1,
                Fault::RestartTwo => 2,
                _ => 3,
            };
            let nodes = some_nodes(rng, k);
            let down = ms(rng, 0, 200);
            restart_nodes(cluster, &nodes, down);
        }
        Fault::PauseNode => {
            let node = rng.random_range(0..3);
            let lasting = ms(rng, 200, 1500);
            block_in_place(|| cluster.lock().unwrap().node_mut(node).pause());
            tokio::time::sleep(lasting).await;
            block_in_place(|| cluster.lock().unwrap().node_mut(node).resume());
        }
        Fault::CutHolderBlackhole | Fault::CutHolderRefuse | Fault::CutMinority => {
            let (who, nodes) = if fault == Fault::CutMinority {
                (rng.random_range(0..proxies.len()), some_nodes(rng, 1))
            } else {
                let holder = fleet.holder().map_or(0, |(i, _, _)| i);
                (holder, some_nodes(rng, 2))
            };
            let lasting = ms(rng, 300, 1500);
            cut_off(&proxies[who], &nodes, fault != Fault::CutHolderRefuse);
            tokio::time::sleep(lasting).await;
            heal(&proxies[who]);
        }
        Fault::Latency => {
            let (fixed, jitter) = (ms(rng, 0, 10), ms(rng, 1, 40));
            let lasting = ms(rng, 500, 2000);
            for contender in proxies {
                for proxy in contender {
                    proxy.set_latency(fixed, jitter);
                }
            }
            tokio::time::sleep(lasting).await;
            for contender in proxies {
                heal(contender);
            }
        }
        Fault::DropConnections => {
            let node = rng.random_range(0..3);
            for contender in proxies {
                contender[node].drop_connections();
            }
        }
        Fault::CrashHolder => {
            let before = fleet.ctx.crashes().len();
            fleet.ctx.crash_requests.fetch_add(1, Ordering::SeqCst);
            support::wait_until_async(LIB_TTL * 3 + TAKEOVER_SLACK, "a holder crashes", || async {
                fleet.ctx.crashes().len() > before
            })
            .await;
        }
        Fault::FlushAll | Fault::FlushDb => {
            let command = if fault == Fault::FlushAll {
                "FLUSHALL"
            } else {
                "FLUSHDB"
            };
            let k = rng.random_range(1..=3);
            let nodes = some_nodes(rng, k);
            let cut = cut_holder_beside(rng, fleet, proxies, &nodes);
            block_in_place(|| {
                let cluster = cluster.lock().unwrap_or_else(|e| e.into_inner());
                for &i in &nodes {
                    assert_eq!(cluster.node(i).command(&[command]), "OK");
                }
            });
            heal_later(cut, ms(rng, 300, 1500)).await;
        }
        Fault::RestoreSnapshot => {
            let k = rng.random_range(1..=3);
            let nodes = some_nodes(rng, k);
            block_in_place(|| {
                let cluster = cluster.lock().unwrap_or_else(|e| e.into_inner());
                for &i in &nodes {
                    cluster.node(i).save_snapshot();
                }
            });
            // The lock moves on after the snapshot.
            tokio::time::sleep(ms(rng, 200, 1500)).await;
            let cut = cut_holder_beside(rng, fleet, proxies, &nodes);
            block_in_place(|| {
                let mut cluster = cluster.lock().unwrap_or_else(|e| e.into_inner());
                for &i in &nodes {
                    cluster.node_mut(i).restart_from_snapshot();
                }
            });
            heal_later(cut, ms(rng, 300, 1500)).await;
        }
        Fault::Failover => {
            let node = rng.random_range(0..3);
            let missed = ms(rng, 0, 500);
            let cut = cut_holder_beside(rng, fleet, proxies, &[node]);
            standbys.failover(cluster, proxies, node, missed).await;
            heal_later(cut, ms(rng, 300, 1500)).await;
        }
        Fault::PauseHolder => {
            let before = fleet.ctx.pauses().len();
            *fleet
                .ctx
                .pause_request
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(LIB_TTL + ms(rng, 0, 500));
            support::wait_until_async(
                LIB_TTL * 4 + TAKEOVER_SLACK,
                "a holder pauses and wakes",
                || async { fleet.ctx.pauses().len() > before },
            )
            .await;
        }
    }
}

/// Half the time, cuts the current holder off from one node outside `struck` (its connections
/// refused), so that its key stands on a bare majority that includes the struck nodes: losing
/// one node's data then decides who may hold the lock. Returns the proxies to heal.
fn cut_holder_beside<'a>(
    rng: &mut StdRng,
    fleet: &LibFleet,
    proxies: &'a [Vec<FaultProxy>],
    struck: &[usize],
) -> Option<&'a [FaultProxy]> {
    let spared: Vec<usize> = (0..3).filter(|i| !struck.contains(i)).collect();
    let (holder, _, _) = fleet.holder()?;
    if spared.is_empty() || !rng.random_bool(0.5) {
        return None;
    }
    let node = spared[rng.random_range(0..spared.len())];
    cut_off(&proxies[holder], &[node], false);
    Some(&proxies[holder])
}

/// Heals `cut` (from [`cut_holder_beside`]) after `after`.
async fn heal_later(cut: Option<&[FaultProxy]>, after: Duration) {
    if let Some(proxies) = cut {
        tokio::time::sleep(after).await;
        heal(proxies);
    }
}

/// One replica per node, kept in sync through a proxy (so that its link can be cut), ready to
/// take over the node's address. They start with the cluster, so that the first failover of a
/// node promotes a server that has been up for a long time (an uptime rule cannot catch it), and
/// carries a copy of the node's epoch marker.
struct Standbys {
    /// Per node: the replica and the proxy it replicates through (`None` while failing over).
    replicas: Mutex<Vec<Option<(RedisNode, FaultProxy)>>>,
}

impl Standbys {
    async fn start(cluster: &Mutex<RedisCluster>) -> Standbys {
        let addrs = cluster.lock().unwrap_or_else(|e| e.into_inner()).addrs();
        let mut replicas = Vec::new();
        for addr in addrs {
            replicas.push(Some(Standbys::replica_of(addr).await));
        }
        Standbys {
            replicas: Mutex::new(replicas),
        }
    }

    async fn replica_of(master: SocketAddr) -> (RedisNode, FaultProxy) {
        let link = FaultProxy::start(master).await;
        let replica = block_in_place(|| {
            let replica = RedisNode::start_replica();
            replica.replicate(link.addr());
            replica
        });
        (replica, link)
    }

    /// Fails node `node` over to its replica: the replica's link breaks, `missed` later
    /// (writes go on meanwhile) the old server dies, the replica is promoted and every
    /// contender's proxy for the node moves to it. The replica then is node `node`, and a new
    /// replica of it stands by.
    async fn failover(
        &self,
        cluster: &Mutex<RedisCluster>,
        proxies: &[Vec<FaultProxy>],
        node: usize,
        missed: Duration,
    ) {
        let (replica, link) = self.replicas.lock().unwrap_or_else(|e| e.into_inner())[node]
            .take()
            .expect("a standby for every node");
        link.refuse(true);
        link.drop_connections();
        tokio::time::sleep(missed).await;
        let promoted = replica.addr();
        block_in_place(|| {
            let mut cluster = cluster.lock().unwrap_or_else(|e| e.into_inner());
            cluster.node_mut(node).stop();
            assert_eq!(replica.command(&["REPLICAOF", "NO", "ONE"]), "OK");
            cluster.nodes[node] = replica;
        });
        for contender in proxies {
            contender[node].set_upstream(promoted);
        }
        let fresh = Standbys::replica_of(promoted).await;
        self.replicas.lock().unwrap_or_else(|e| e.into_inner())[node] = Some(fresh);
    }
}

/// A cluster of three whose votes count, and a standby replica for each node.
async fn ready_cluster_with_standbys(ttl: Duration) -> (Mutex<RedisCluster>, Standbys) {
    let cluster = Mutex::new(block_in_place(|| RedisCluster::start(3)));
    let standbys = Standbys::start(&cluster).await;
    block_in_place(|| cluster.lock().unwrap().wait_votes_count(ttl));
    (cluster, standbys)
}

/// Strikes held locks with faults drawn from `faults` for `lasting` (library contenders on their
/// own proxies, one fresh cluster), checks that the lock moves again after the last one, that
/// some votes were not counted, and the records. Returns the scenario's row.
async fn strike_held_locks(
    scenario: &str,
    lock: &str,
    faults: &[Fault],
    lasting: Duration,
    seed: u64,
) -> Row {
    let (cluster, standbys) = ready_cluster_with_standbys(LIB_TTL).await;
    let addrs = cluster.lock().unwrap().addrs();
    let mut proxies = Vec::new();
    for _ in 0..4 {
        let mut own = Vec::new();
        for &addr in &addrs {
            own.push(FaultProxy::start(addr).await);
        }
        proxies.push(own);
    }
    let urls: Vec<Vec<String>> = proxies.iter().map(|p| urls_of(p)).collect();
    let fleet = LibFleet::start(
        lock,
        "lib",
        &urls,
        &[LibPlan::holding(), LibPlan::quick()],
        seed,
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let mut injected: std::collections::BTreeMap<Fault, usize> = Default::default();
    let mut held_when_hit = 0;
    let end = Instant::now() + lasting;
    let mut last_fault = Instant::now();
    while Instant::now() < end {
        let struck = injected.values().sum::<usize>();
        // Every other fault strikes a critical section of 2–4 × ttl that renewals carry.
        if struck % 2 == 1 {
            long_section(
                &fleet,
                &format!("{scenario}: a long critical section (seed {seed})"),
            )
            .await;
        } else {
            open_session(
                fleet.store(),
                LIB_TTL * 4 + TAKEOVER_SLACK,
                &format!("{scenario}: the lock is taken again (seed {seed})"),
            )
            .await;
        }
        // In turn, so that each kind is drawn; where and how long is random.
        let fault = faults[struck % faults.len()];
        inject(fault, &mut rng, &cluster, &proxies, &fleet, &standbys).await;
        // The data is lost as `inject` ends (a restore restarts the nodes last).
        held_when_hit += usize::from(fleet.holder().is_some());
        *injected.entry(fault).or_default() += 1;
        last_fault = Instant::now();
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..1500))).await;
    }
    next_session(
        fleet.store(),
        last_fault,
        None,
        LIB_TTL * 4 + TAKEOVER_SLACK,
        &format!("{scenario}: the lock is taken again after the last fault (seed {seed})"),
    )
    .await;
    let ctx = fleet.stop().await;
    let faults: usize = injected.values().sum();
    let (_, row) = check(
        &format!("{scenario} {injected:?}"),
        "4 library, own proxies",
        faults,
        &ctx.store.records(),
        Mode::Strict,
        &[],
    );
    assert!(
        ctx.votes.not_counted.load(Ordering::Relaxed) > 0,
        "{scenario}: nodes that lost data granted votes that were not counted ({injected:?})"
    );
    assert!(held_when_hit > 0, "{scenario}: faults hit held locks");
    row
}

/// How long each data-loss scenario strikes.
const STRIKING: Duration = Duration::from_secs(12);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushes_under_held_locks_never_allow_two_holders() {
    let row = strike_held_locks(
        "FLUSHALL / FLUSHDB, 1–3 of 3 nodes",
        "flush-lib",
        &[Fault::FlushAll, Fault::FlushDb],
        STRIKING,
        17,
    )
    .await;
    checker::report(vec![row]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restores_from_older_snapshots_under_held_locks_never_allow_two_holders() {
    let row = strike_held_locks(
        "restore from an older snapshot, 1–3 of 3 nodes",
        "snapshot-lib",
        &[Fault::RestoreSnapshot],
        STRIKING,
        19,
    )
    .await;
    checker::report(vec![row]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failovers_to_replicas_that_missed_writes_never_allow_two_holders() {
    let row = strike_held_locks(
        "failover to a replica that missed writes",
        "failover-lib",
        &[Fault::Failover],
        STRIKING,
        23,
    )
    .await;
    checker::report(vec![row]);
}

/// `REDLOCK_SOAK=N`: N handoffs under random faults (default: a short run of 200, so the test
/// never skips). `REDLOCK_SOAK_SEED=S` replays the fault sequence of a run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak() {
    let env_num = |name: &str| {
        std::env::var(name).ok().map(|v| {
            v.parse::<u64>()
                .unwrap_or_else(|_| panic!("{name}={v} is not a number"))
        })
    };
    let long = env_num("REDLOCK_SOAK");
    let target = long.unwrap_or(200) as usize;
    let seed = env_num("REDLOCK_SOAK_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    // A fault every this many handoffs.
    let fault_every = if long.is_some() { 50 } else { 20 };
    println!("soak: {target} handoffs, a fault every {fault_every}, seed {seed} (replay with REDLOCK_SOAK_SEED={seed})");

    let (cluster, standbys) = ready_cluster_with_standbys(LIB_TTL).await;
    let addrs = cluster.lock().unwrap().addrs();
    let mut proxies = Vec::new();
    for _ in 0..4 {
        let mut own = Vec::new();
        for &addr in &addrs {
            own.push(FaultProxy::start(addr).await);
        }
        proxies.push(own);
    }
    let urls: Vec<Vec<String>> = proxies.iter().map(|p| urls_of(p)).collect();
    let fleet = LibFleet::start(
        "soak",
        "lib",
        &urls,
        &[LibPlan::quick(), LibPlan::quick(), LibPlan::holding()],
        seed,
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let mut injected: std::collections::BTreeMap<Fault, usize> = Default::default();
    let started = Instant::now();
    let mut next_fault = fault_every;
    let mut next_progress = 1000;
    loop {
        let handoffs = fleet.store().begins().saturating_sub(1);
        if handoffs >= target {
            break;
        }
        if long.is_some() && handoffs >= next_progress {
            eprintln!(
                "soak: {handoffs} handoffs, {} faults, {:.0?}",
                injected.values().sum::<usize>(),
                started.elapsed()
            );
            next_progress += 1000;
        }
        if handoffs < next_fault {
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        }
        // Every third fault strikes a critical section of 2–4 × ttl that renewals carry (each
        // one holds up the handoffs the soak counts for a few seconds).
        if injected.values().sum::<usize>() % 3 == 1 {
            long_section(&fleet, &format!("a long critical section (seed {seed})")).await;
        }
        let fault = FAULTS[rng.random_range(0..FAULTS.len())];
        inject(fault, &mut rng, &cluster, &proxies, &fleet, &standbys).await;
        *injected.entry(fault).or_default() += 1;
        // Liveness: once the fault is healed (and restarted nodes have been up for ttl + drift),
        // the lock moves again.
        next_session(
            fleet.store(),
            Instant::now(),
            None,
            LIB_TTL * 4 + TAKEOVER_SLACK,
            &format!("the lock moves again after {fault:?} (seed {seed})"),
        )
        .await;
        next_fault = fleet.store().begins().saturating_sub(1) + fault_every;
    }
    let ctx = fleet.stop().await;
    let faults: usize = injected.values().sum();
    let (a, row) = check(
        &format!("soak, seed {seed}"),
        "4 library, own proxies",
        faults,
        &ctx.store.records(),
        Mode::Strict,
        &ctx.crashes(),
    );
    // A pause's late write passes only while no newer token was accepted: the store's rule,
    // re-checked by the checker (rule 2) together with the token order (rule 1).
    let pauses = ctx.pauses();
    println!(
        "soak: {} handoffs in {:.1?}; faults {injected:?}; votes not counted (data age, eviction policy): {}; \
         holder pauses: {} (stale writes refused: {}); holder crashes: {}",
        a.handoffs(),
        started.elapsed(),
        ctx.votes.not_counted.load(Ordering::Relaxed),
        pauses.len(),
        pauses.iter().filter(|(_, _, accepted)| !accepted).count(),
        ctx.crashes().len()
    );
    println!("{}", checker::table(std::slice::from_ref(&row)));
    // Faults are due every `fault_every` handoffs after the last one healed; handoffs made
    // while a fault lasts count too, so there are fewer than target / fault_every.
    assert!(faults >= 3, "faults were injected: {injected:?}");
    checker::report(vec![row]);
}

/// Restarted-node conditions without a restart: node 2 forgets the key, its script cache and its
/// client connections.
fn forget_like_a_restart(node: &RedisNode, key: &str) {
    node.command(&["DEL", key]);
    node.command(&["SCRIPT", "FLUSH"]);
    node.command(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]);
}

/// Makes `holder`'s key on nodes 0 and 1 (a quorum of three) outlive the test. The round was
/// decided at quorum, so the key may still be landing on one of them: waits for it first.
fn keep_for_the_test(cluster: &RedisCluster, key: &str, holder: &str) {
    for node in [cluster.node(0), cluster.node(1)] {
        support::wait_until(Duration::from_secs(2), "the holder's key lands", || {
            node.command(&["GET", key])
                .starts_with(&format!("{holder}:"))
        });
        assert_eq!(node.command(&["PEXPIRE", key, "120000"]), "1");
    }
}

/// A regression test for a defect these scenarios found: a lost round's cleanup overtook the
/// round's own SET on a node that had just restarted and left a key behind for a whole ttl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_round_leaves_no_key_behind_on_a_node_that_just_restarted() {
    let cluster = ready_cluster(3, LIB_TTL);
    let urls = cluster.urls();
    let key = "redlock:{stale}";
    let client = |identity: &str| {
        Redlock::new(
            lib_config("stale", identity, &urls),
            Arc::new(VoteCounter::default()),
        )
        .expect("valid config")
    };
    let (holder, standby) = (client("holder"), client("standby"));
    holder.try_acquire().await.expect("holder acquires");
    // The holder keeps nodes 0 and 1 for the whole test.
    block_in_place(|| keep_for_the_test(&cluster, key, "holder"));
    let addr = cluster.node(2).addr();
    let mut leaked = Vec::new();
    for trial in 0..200 {
        block_in_place(|| forget_like_a_restart(cluster.node(2), key));
        // Nodes 0 and 1 answer "held" first: the round is lost before node 2 answers, and the
        // cleanup is sent to node 2 while its SET is still on the way (EVALSHA, NOSCRIPT,
        // SCRIPT LOAD, EVALSHA). The cleanup must still come after the SET.
        standby.try_acquire().await.expect_err("the lock is held");
        let cleaned = tokio::spawn(async move {
            support::wait_until_async(
                Duration::from_millis(300),
                "the lost round's key is cleaned up",
                || async {
                    !support::command_at_async(addr, &["GET", key], Duration::from_secs(1))
                        .await
                        .unwrap_or_default()
                        .starts_with("standby:")
                },
            )
            .await
        });
        if cleaned.await.is_err() {
            leaked.push(trial);
        }
    }
    assert!(
        leaked.is_empty(),
        "lost rounds left their key on node 2 (for a whole ttl) in trials {leaked:?}"
    );
}

// ------------------------------------------------------------------------------------------------
// Regression tests for liveness bugs the scenarios above found (not safety).
// ------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_puts_the_key_back_on_a_node_that_lost_it_even_when_that_node_is_slower() {
    let cluster = ready_cluster(3, LIB_TTL);
    // Node 2 answers 10 ms later than the others (well within the node timeout), as a node does
    // whose connection and scripts must be set up again after a restart.
    let slow = FaultProxy::start(cluster.node(2).addr()).await;
    slow.set_latency(Duration::from_millis(5), Duration::ZERO);
    let urls = vec![cluster.node(0).url(), cluster.node(1).url(), slow.url()];
    // The proxy delays each chunk in turn, so back-to-back extends queue up behind each other
    // on the slow link: a node timeout that covers the queue.
    let mut cfg = lib_config("repair", "holder", &urls);
    cfg.node_timeout = Duration::from_millis(200);
    let redlock = Redlock::new(cfg, Arc::new(VoteCounter::default())).expect("valid config");
    let mut lease = redlock.try_acquire().await.expect("acquires");
    let key = "redlock:{repair}";
    block_in_place(|| cluster.node(2).command(&["DEL", key]));
    for _ in 0..3 {
        lease = redlock.extend(&lease).await.expect("nodes 0 and 1 grant");
    }
    let node2 = cluster.node(2).addr();
    support::wait_until_async(
        Duration::from_millis(500),
        "node 2 has the holder's key again after three extends",
        || async {
            support::command_at_async(node2, &["GET", key], Duration::from_secs(1))
                .await
                .is_ok_and(|v| v == lease.value())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_for_a_held_lock_do_not_wake_each_other() {
    let cluster = ready_cluster(3, LIB_TTL);
    let urls = cluster.urls();
    let key = "redlock:{storm}";
    let holder = Redlock::new(
        lib_config("storm", "holder", &urls),
        Arc::new(VoteCounter::default()),
    )
    .expect("valid config");
    holder.try_acquire().await.expect("holder acquires");
    // The holder has nodes 0 and 1 (a quorum) for the whole test; node 2 lost its key. Every
    // waiter's round is granted on node 2 and lost; its cleanup deletes that grant.
    block_in_place(|| {
        keep_for_the_test(&cluster, key, "holder");
        cluster.node(2).command(&["DEL", key]);
    });
    let rounds = Arc::new(AtomicUsize::new(0));
    let waiting = Duration::from_secs(3);
    let mut waiters = Vec::new();
    for i in 0..3 {
        let mut cfg = lib_config("storm", &format!("waiter{i}"), &urls);
        cfg.retry_delay = Duration::from_millis(200);
        cfg.retry_max = Duration::from_secs(1);
        let redlock = Redlock::new(cfg, Arc::new(VoteCounter::default())).expect("valid config");
        let rounds = rounds.clone();
        waiters.push(tokio::spawn(async move {
            let never = CancellationToken::new();
            redlock
                .acquire(Some(Instant::now() + waiting), &never, |_, _| {
                    rounds.fetch_add(1, Ordering::Relaxed);
                })
                .await
                .expect_err("the lock stays held");
        }));
    }
    for waiter in waiters {
        waiter.await.expect("waiter finished");
    }
    // Polling a held lock about once per retry_max: a handful of rounds each.
    let rounds = rounds.load(Ordering::Relaxed);
    assert!(
        rounds <= 3 * 6,
        "3 waiters made {rounds} rounds in {waiting:?}: lost rounds' cleanups woke them"
    );
}

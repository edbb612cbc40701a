//! Request locks (`/v1/locks`) under the suite's faults: two `run` sidecars, each behind its own
//! proxy per node, three clients per sidecar on one name. A client acquires with a wait, keeps
//! its lease alive, writes under its fencing token only while within the `validity_ms` it was
//! last given (counted from when it sent the request that told it, so never later than the
//! sidecar meant) and until it is told `lost` (410), then deletes the lease.
//!
//! Faults, each aimed at the holder: its sidecar SIGSTOPped past the ttl, SIGKILLed (and
//! started again), Redis nodes restarted empty, its sidecar cut off from a majority (blackhole
//! and reset; the sharp case first cuts one node for over a ttl, so that the holder's key stands
//! on exactly two nodes, then one of those two), and `FLUSHALL` (on one node, and on one of the
//! two nodes a holder cut off from the third still has its key on).

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU8;

use super::*;

/// The request lock's name (its engine lock is `app:NAME`).
const REQ_NAME: &str = "orders";
/// The ttl clients ask for: short, so that faults cost little time.
const REQ_TTL: Duration = Duration::from_secs(1);
/// The `wait` clients ask for.
const REQ_WAIT: Duration = Duration::from_secs(3);
/// How often a holder writes.
const REQ_WRITE_EVERY: Duration = Duration::from_millis(25);
/// A holder keeps its lease alive every ttl/5 to ttl/3: sometimes it hears `lost` before its
/// validity ends (the notice comes ttl/5 before), sometimes only at its next call after it.
const KEEPALIVE_EVERY_MS: (u64, u64) = (200, 333);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_millis(500);
const DELETE_TIMEOUT: Duration = Duration::from_secs(2);
const CLIENTS_PER_SIDECAR: usize = 3;
/// The name is held again within this bound after each fault, counted from when a quorum is
/// healthy again: the holder's key lives out its ttl (or the validity the holder's client was
/// given ends), restarted or flushed nodes count again ttl + drift after they lost their data,
/// and a wait's round follows.
const REQ_LIVENESS: Duration = Duration::from_secs(2 * REQ_TTL.as_secs() + 3);

/// A client's section as the scenario steers it ([`ReqClient::control`]).
const NORMAL: u8 = 0;
/// The scenario asks the holder to hold on until a fault ends its lease.
const HOLD: u8 = 1;
/// The holder saw [`HOLD`] while in its section: it holds on.
const HOLDING: u8 = 2;
/// The scenario lets a holder that survived its fault go: it ends its section now.
const FINISH: u8 = 3;

/// What one client saw, for the summary and the failure messages.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    /// 200 answers to an acquisition.
    granted: usize,
    /// Grants whose answer left too little validity counted from the request's start (it
    /// waited): a keepalive told the validity first.
    refreshed: usize,
    /// Grants never used (lost or out of validity before the first write).
    unused: usize,
    /// Sections begun (a `begin` written).
    sections: usize,
    /// 409: still held after the wait.
    busy: usize,
    /// 503 by `kind` (or the error when none).
    unavailable: BTreeMap<String, usize>,
    /// Requests that got no answer in time (a stopped or killed sidecar).
    no_answer: usize,
    keepalives: usize,
    /// (token, when 410 `lost` came, how long before the client's deadline; negative after).
    lost: Vec<(u64, Instant, i64)>,
    /// Sections that stopped because the validity ran out without a fresh answer.
    expired: usize,
    /// Sections that stopped on 404 (the sidecar restarted and forgot the lease).
    unknown: usize,
    /// Sections stopped by a refused write (a newer token was accepted).
    refused: usize,
    /// DELETE answers: "200", "404", "410 lost", … .
    deletes: BTreeMap<String, usize>,
    /// Answers no rule of the API allows here.
    unexpected: Vec<String>,
}

/// One client of one sidecar's control listener.
pub(crate) struct ReqClient {
    pub(crate) who: String,
    pub(crate) sidecar: usize,
    pub(crate) control: AtomicU8,
    pub(crate) tally: Mutex<Tally>,
}

impl ReqClient {
    fn tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn validity_of(response: &support::Response) -> Option<(String, u64, Duration)> {
    let body = response.json().ok()?;
    Some((
        body["lease"].as_str()?.to_owned(),
        body["fencing_token"].as_u64()?,
        ms(body["validity_ms"].as_u64()?),
    ))
}

/// A keepalive sent now: (when it was sent, the answer).
async fn keepalive(addr: SocketAddr, path: String) -> (Instant, Result<support::Response, String>) {
    let sent = Instant::now();
    let answer = support::http::request_within("POST", addr, &path, KEEPALIVE_TIMEOUT).await;
    (sent, answer)
}

/// How a section ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// Wrote `end`: it lets go on purpose.
    Done,
    /// Told `lost` (410).
    Lost,
    /// Its validity ran out with no fresh answer.
    Expired,
    /// The sidecar no longer knows the lease (404: it restarted).
    Unknown,
    /// A write was refused.
    Refused,
}

/// Takes the name again and again until `stop`: acquire (with a wait), `begin`, write every
/// [`REQ_WRITE_EVERY`] and keep alive every ttl/5 to ttl/3 while within the validity last
/// given, `end` and DELETE. Sections last 20–200 ms, one in eight 2–4 × ttl (keepalives carry
/// it), or as long as the scenario holds them ([`HOLD`]).
pub(crate) async fn req_client(
    me: Arc<ReqClient>,
    addr: SocketAddr,
    store: Arc<FencedStore>,
    stop: CancellationToken,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let acquire = format!(
        "/v1/locks/{REQ_NAME}?ttl={}ms&wait={}ms",
        REQ_TTL.as_millis(),
        REQ_WAIT.as_millis()
    );
    let acquire_timeout = REQ_WAIT + REQ_TTL + Duration::from_secs(2);
    let unexpected = |what: &str, answer: &support::Response| {
        me.tally()
            .unexpected
            .push(format!("{what}: {} {}", answer.status, answer.body));
    };
    while !stop.is_cancelled() {
        let sent = Instant::now();
        let answer = tokio::select! {
            // Going away cancels the wait (and a lock won for it is released).
            _ = stop.cancelled() => break,
            answer = support::http::request_within("POST", addr, &acquire, acquire_timeout) => answer,
        };
        let (lease, token, validity) = match answer {
            Ok(r) if r.status == 200 => match validity_of(&r) {
                Some(granted) => granted,
                None => {
                    unexpected("acquire", &r);
                    continue;
                }
            },
            Ok(r) if r.status == 409 => {
                me.tally().busy += 1;
                continue;
            }
            Ok(r) if r.status == 503 => {
                let kind = r
                    .json()
                    .ok()
                    .and_then(|b| {
                        b["kind"]
                            .as_str()
                            .or(b["error"].as_str())
                            .map(str::to_owned)
                    })
                    .unwrap_or_default();
                *me.tally().unavailable.entry(kind).or_default() += 1;
                tokio::time::sleep(ms(20)).await;
                continue;
            }
            Ok(r) => {
                unexpected("acquire", &r);
                tokio::time::sleep(ms(50)).await;
                continue;
            }
            Err(_) => {
                me.tally().no_answer += 1;
                tokio::time::sleep(ms(50)).await;
                continue;
            }
        };
        me.tally().granted += 1;
        let lease_path = format!("/v1/locks/{REQ_NAME}/{lease}");
        let keepalive_path = format!("{lease_path}/keepalive");
        // The validity was counted when the sidecar answered, after the request was sent.
        let mut deadline = sent + validity;
        let mut told_lost = false;
        if deadline < Instant::now() + REQ_TTL / 2 {
            // It waited (the validity is counted from before the wait): ask how long is left,
            // counted from now, rather than run out before the first keepalive.
            me.tally().refreshed += 1;
            let (sent, answer) = keepalive(addr, keepalive_path.clone()).await;
            match answer {
                Ok(r) if r.status == 200 => {
                    if let Some((_, _, validity)) = validity_of(&r) {
                        deadline = sent + validity;
                    }
                }
                Ok(r) if r.status == 410 => told_lost = true,
                Ok(r) if r.status == 404 => {}
                Ok(r) => unexpected("keepalive", &r),
                Err(_) => me.tally().no_answer += 1,
            }
        }
        let now = Instant::now();
        let usable = !told_lost && now + REQ_WRITE_EVERY < deadline;
        let outcome = if !usable {
            me.tally().unused += 1;
            None
        } else if !store.write(&me.who, token, Kind::Begin, Some(deadline)) {
            Some(Outcome::Refused)
        } else {
            me.tally().sections += 1;
            let section = if rng.random_range(0..8) == 0 {
                REQ_TTL.mul_f64(rng.random_range(2.0..4.0))
            } else {
                ms(rng.random_range(20..200))
            };
            let section_end = now + section;
            let mut next_keepalive =
                now + ms(rng.random_range(KEEPALIVE_EVERY_MS.0..=KEEPALIVE_EVERY_MS.1));
            let mut pending: Option<JoinHandle<(Instant, Result<support::Response, String>)>> =
                None;
            let outcome = loop {
                tokio::time::sleep(REQ_WRITE_EVERY).await;
                if pending.as_ref().is_some_and(JoinHandle::is_finished) {
                    let (sent, answer) = pending
                        .take()
                        .expect("a pending keepalive")
                        .await
                        .expect("keepalive task");
                    match answer {
                        Ok(r) if r.status == 200 => {
                            me.tally().keepalives += 1;
                            if let Some((_, _, validity)) = validity_of(&r) {
                                deadline = deadline.max(sent + validity);
                            }
                        }
                        Ok(r) if r.status == 410 => {
                            let now = Instant::now();
                            let ahead = if now < deadline {
                                (deadline - now).as_millis() as i64
                            } else {
                                -((now - deadline).as_millis() as i64)
                            };
                            me.tally().lost.push((token, now, ahead));
                            if r.json().is_ok_and(|b| b["ended"] != "lost") {
                                unexpected("keepalive of a held lease", &r);
                            }
                            break Outcome::Lost;
                        }
                        Ok(r) if r.status == 404 => break Outcome::Unknown,
                        Ok(r) => unexpected("keepalive", &r),
                        Err(_) => me.tally().no_answer += 1,
                    }
                }
                let now = Instant::now();
                if now >= deadline {
                    break Outcome::Expired;
                }
                let state = match me.control.compare_exchange(
                    HOLD,
                    HOLDING,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                ) {
                    Ok(_) => HOLDING,
                    Err(state) => state,
                };
                if stop.is_cancelled() || state == FINISH || (state == NORMAL && now >= section_end)
                {
                    break if store.write(&me.who, token, Kind::End, Some(deadline)) {
                        Outcome::Done
                    } else {
                        Outcome::Refused
                    };
                }
                if !store.write(&me.who, token, Kind::Write, Some(deadline)) {
                    break Outcome::Refused;
                }
                if pending.is_none() && now >= next_keepalive {
                    pending = Some(tokio::spawn(keepalive(addr, keepalive_path.clone())));
                    next_keepalive =
                        now + ms(rng.random_range(KEEPALIVE_EVERY_MS.0..=KEEPALIVE_EVERY_MS.1));
                }
            };
            if let Some(pending) = pending {
                pending.abort();
            }
            Some(outcome)
        };
        match outcome {
            Some(Outcome::Done) | None => {}
            Some(outcome) => {
                // Stopped without `end`: the session is over from here (or from its deadline).
                store.gone(&me.who, token, Some(deadline));
                let mut tally = me.tally();
                match outcome {
                    Outcome::Expired => tally.expired += 1,
                    Outcome::Unknown => tally.unknown += 1,
                    Outcome::Refused => tally.refused += 1,
                    Outcome::Lost | Outcome::Done => {}
                }
            }
        }
        me.control.store(NORMAL, Ordering::SeqCst);
        let deleted =
            support::http::request_within("DELETE", addr, &lease_path, DELETE_TIMEOUT).await;
        let key = match deleted {
            Ok(r) if r.status == 410 => format!(
                "410 {}",
                r.json()
                    .ok()
                    .and_then(|b| b["ended"].as_str().map(str::to_owned))
                    .unwrap_or_default()
            ),
            Ok(r) => r.status.to_string(),
            Err(_) => "no answer".to_owned(),
        };
        *me.tally().deletes.entry(key).or_default() += 1;
        tokio::time::sleep(ms(rng.random_range(0..20))).await;
    }
}

/// A `run` sidecar behind proxies of its own, started again on the same ports after a kill.
pub(crate) struct ReqSidecar {
    pub(crate) identity: String,
    args: Vec<String>,
    pub(crate) admin: SocketAddr,
    pub(crate) control: SocketAddr,
    pub(crate) proc: Proc,
    pub(crate) proxies: Vec<FaultProxy>,
    /// What earlier processes of this sidecar logged, for a failure's message.
    earlier: String,
}

impl ReqSidecar {
    /// Starts `run` behind a proxy of its own to each node at `nodes`.
    pub(crate) async fn start(identity: &str, nodes: &[SocketAddr]) -> ReqSidecar {
        let mut proxies = Vec::new();
        for &node in nodes {
            proxies.push(FaultProxy::start(node).await);
        }
        let (admin, control) = (support::sidecar::loopback(), support::sidecar::loopback());
        let args: Vec<String> = [
            "run",
            "--lock",
            "req-leader",
            "--redis",
            &urls_of(&proxies).join(","),
            // Every sidecar names the nodes through proxies of its own: one node set.
            "--node-set",
            support::TEST_NODE_SET,
        ]
        .into_iter()
        .chain(PROC_TIMING)
        .chain(["--listen", &admin.to_string()])
        .chain(["--control-listen", &control.to_string()])
        .chain(["--identity", identity, "--kubernetes", "off"])
        .map(str::to_owned)
        .collect();
        let proc = Self::spawn(&args);
        let sidecar = ReqSidecar {
            identity: identity.to_owned(),
            args,
            admin,
            control,
            proc,
            proxies,
            earlier: String::new(),
        };
        sidecar.wait_serving().await;
        sidecar
    }

    fn spawn(args: &[String]) -> Proc {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Proc::spawn(&args, &[("REDLOCK_LOG", "info")])
    }

    /// Waits until the control listener answers (404 for a route it does not have).
    pub(crate) async fn wait_serving(&self) {
        let what = format!("{}'s control listener serves", self.identity);
        support::wait_until_async(Duration::from_secs(10), &what, || async {
            support::http::get(self.control, "/none")
                .await
                .is_ok_and(|r| r.status == 404)
        })
        .await;
    }

    /// SIGKILL (the pod crashes), then the same command on the same ports (the container
    /// restarts) after `down`.
    pub(crate) async fn kill_and_restart(&mut self, down: Duration) {
        assert!(self.proc.sigkill());
        let status = self
            .proc
            .wait_exit_async(Duration::from_secs(10))
            .await
            .expect("a killed sidecar exits");
        assert_eq!(exit_code(status), 128 + libc::SIGKILL);
        self.earlier.push_str(&self.proc.output_text());
        tokio::time::sleep(down).await;
        self.proc = Self::spawn(&self.args);
        self.wait_serving().await;
    }

    pub(crate) fn logs(&self) -> String {
        format!(
            "--- {} ---\n{}{}",
            self.identity,
            self.earlier,
            self.proc.output_text()
        )
    }
}

/// The clients, the store they write to, and what the scenario asks of them.
pub(crate) struct ReqFleet {
    pub(crate) store: Arc<FencedStore>,
    pub(crate) clients: Vec<Arc<ReqClient>>,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl ReqFleet {
    pub(crate) fn start(sidecars: &[ReqSidecar], per_sidecar: usize, seed: u64) -> ReqFleet {
        let store = FencedStore::new();
        let stop = CancellationToken::new();
        let (mut clients, mut tasks) = (Vec::new(), Vec::new());
        for (s, sidecar) in sidecars.iter().enumerate() {
            for c in 0..per_sidecar {
                let client = Arc::new(ReqClient {
                    who: format!("{}-client{c}", sidecar.identity),
                    sidecar: s,
                    control: AtomicU8::new(NORMAL),
                    tally: Mutex::new(Tally::default()),
                });
                tasks.push(tokio::spawn(req_client(
                    client.clone(),
                    sidecar.control,
                    store.clone(),
                    stop.clone(),
                    seed.wrapping_add(clients.len() as u64),
                )));
                clients.push(client);
            }
        }
        ReqFleet {
            store,
            clients,
            stop,
            tasks,
        }
    }

    fn client(&self, who: &str) -> &Arc<ReqClient> {
        self.clients
            .iter()
            .find(|c| c.who == who)
            .expect("a client of the fleet")
    }

    /// Waits for a holder and makes it hold on until a fault ends its lease; with `long`, until
    /// it has held for a ttl and more (keepalives carried it past its first validity). Tries
    /// another holder when this one's section ends first.
    pub(crate) async fn strike(&self, long: bool) -> Struck {
        let end = Instant::now() + REQ_LIVENESS * 3;
        loop {
            assert!(Instant::now() < end, "no holder could be held for a fault");
            let (begun, who, token) =
                open_session(&self.store, REQ_LIVENESS, "a client holds the name").await;
            let client = self.client(&who);
            let asked = client
                .control
                .compare_exchange(NORMAL, HOLD, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok();
            if asked {
                let seen = Instant::now() + ms(300);
                while client.control.load(Ordering::SeqCst) == HOLD && Instant::now() < seen {
                    tokio::time::sleep(ms(2)).await;
                }
            }
            let holding = client.control.load(Ordering::SeqCst) == HOLDING;
            let mut held = holding && self.store.is_open(&who, token);
            if held && long {
                while held && begun.elapsed() < REQ_TTL + ms(100) {
                    tokio::time::sleep(ms(5)).await;
                    held = self.store.is_open(&who, token);
                }
            }
            if held {
                return Struck {
                    who,
                    token,
                    sidecar: client.sidecar,
                };
            }
            let _ =
                client
                    .control
                    .compare_exchange(HOLD, NORMAL, Ordering::SeqCst, Ordering::SeqCst);
            tokio::time::sleep(ms(5)).await;
        }
    }

    /// Lets a holder that its fault did not end go (it ends its section now).
    pub(crate) fn finish(&self, struck: &Struck) {
        let _ = self.client(&struck.who).control.compare_exchange(
            HOLDING,
            FINISH,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }

    pub(crate) async fn stop(self) -> Vec<Arc<ReqClient>> {
        self.stop.cancel();
        for task in self.tasks {
            task.await.expect("a request-lock client did not panic");
        }
        self.clients
    }
}

/// The holder a fault is aimed at.
pub(crate) struct Struck {
    pub(crate) who: String,
    pub(crate) token: u64,
    pub(crate) sidecar: usize,
}

/// One fault's figures.
struct FaultLine {
    fault: String,
    /// From the fault (or the quorum's return) to the next section.
    takeover: Duration,
    /// Faults that took the name from its holder: (holder, its token, when the next section
    /// began, the validity the holder's client was last given).
    promise: Option<(String, u64, Instant, Instant)>,
}

/// Runs `future`, catching a panic so that the caller can show the sidecars' logs first.
struct CatchUnwind<F>(std::pin::Pin<Box<F>>);

impl<F: std::future::Future> std::future::Future for CatchUnwind<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let future = self.0.as_mut();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| future.poll(cx))) {
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(value)) => std::task::Poll::Ready(Ok(value)),
            Err(panic) => std::task::Poll::Ready(Err(panic)),
        }
    }
}

/// The first `begin` decided at or after `since` by someone other than `not`: (when, who).
fn first_begin_after(
    store: &FencedStore,
    since: Instant,
    not: Option<&str>,
) -> Option<(Instant, String)> {
    store
        .records()
        .into_iter()
        .find(|r| r.kind == Kind::Begin && r.at >= since && not != Some(r.who.as_str()))
        .map(|r| (r.at, r.who))
}

/// The latest deadline `who` wrote under with `token`: the validity its client was last given.
fn last_deadline(store: &FencedStore, who: &str, token: u64) -> Option<Instant> {
    store
        .records()
        .iter()
        .filter(|r| r.who == who && r.token == token)
        .filter_map(|r| r.deadline)
        .max()
}

fn signed_ms(from: Instant, to: Instant) -> i64 {
    if to >= from {
        (to - from).as_millis() as i64
    } else {
        -((from - to).as_millis() as i64)
    }
}

/// Reads the name's key on every node (`None`: no key, or no answer).
fn key_values(cluster: &Mutex<RedisCluster>) -> Vec<Option<String>> {
    let key = format!("redlock:{{app:{REQ_NAME}}}");
    block_in_place(|| {
        let cluster = cluster.lock().unwrap_or_else(|e| e.into_inner());
        cluster
            .iter()
            .map(|node| {
                node.try_command(&["GET", &key])
                    .ok()
                    .filter(|v| !v.is_empty() && v != "(nil)")
            })
            .collect()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn request_locks_keep_their_promise_under_faults() {
    let started = Instant::now();
    let cluster = Mutex::new(ready_cluster(3, PROC_TTL));
    let nodes = cluster.lock().unwrap().addrs();
    let mut sidecars = Vec::new();
    for identity in ["req-a", "req-b"] {
        sidecars.push(ReqSidecar::start(identity, &nodes).await);
    }
    let fleet = ReqFleet::start(&sidecars, CLIENTS_PER_SIDECAR, 41);
    let store = fleet.store.clone();
    let mut rng = StdRng::seed_from_u64(41);
    let mut lines: Vec<FaultLine> = Vec::new();
    // Faults that took the name from its holder: the "crashes" of the summary row.
    let mut crashes = Vec::new();
    let (mut sharp, mut kill_bounds) = (0, Vec::new());

    let scenario = async {
        for round in 0..12 {
            // Every other fault strikes a holder that keepalives carried past its first validity.
            let struck = fleet.strike(round % 2 == 1).await;
            // (fault, since when the name must be held again, whether the fault took it from
            // its holder)
            let (fault, since, took) = match round {
                // The holder's sidecar stopped past the ttl, then resumed.
                0 | 6 => {
                    let s = &mut sidecars[struck.sidecar];
                    assert!(s.proc.sigstop());
                    let stopped = Instant::now();
                    next_session(
                        &store,
                        stopped,
                        Some(&struck.who),
                        REQ_TTL + TAKEOVER_SLACK,
                        "a client of the other sidecar takes the name from a stopped one",
                    )
                    .await;
                    tokio::time::sleep_until((stopped + REQ_TTL + Duration::from_secs(1)).into())
                        .await;
                    assert!(s.proc.sigcont());
                    ("SIGSTOP holder's sidecar past the ttl", stopped, true)
                }
                // The holder's sidecar killed, and started again.
                2 | 8 => {
                    let killed = Instant::now();
                    let s = &mut sidecars[struck.sidecar];
                    assert!(s.proc.sigkill());
                    let read_at = Instant::now();
                    let bound = block_in_place(|| {
                        earliest_takeover(&cluster.lock().unwrap(), &format!("app:{REQ_NAME}"))
                    });
                    kill_bounds.push((killed, read_at + bound));
                    s.kill_and_restart(ms(300)).await;
                    ("SIGKILL holder's sidecar, restarted", killed, true)
                }
                // Redis nodes restarted empty while the name is held: one, then two of three.
                3 | 7 => {
                    let k = if round == 3 { 1 } else { 2 };
                    restart_nodes(&cluster, &some_nodes(&mut rng, k), ms(100));
                    let back = Instant::now();
                    fleet.finish(&struck);
                    let fault = if k == 1 {
                        "restart 1 of 3 nodes (empty)"
                    } else {
                        "restart 2 of 3 nodes (empty)"
                    };
                    (fault, back, false)
                }
                // The holder's sidecar cut off from a majority. In the sharp case its key stands
                // on exactly two nodes and it still reaches one of them: a release there frees
                // a majority.
                1 | 5 | 9 | 11 => {
                    let blackhole = round == 1 || round == 9;
                    let sharp_case = round == 1 || round == 5;
                    let proxies = &sidecars[struck.sidecar].proxies;
                    let mut nodes = some_nodes(&mut rng, 3);
                    let first = nodes.remove(rng.random_range(0..3));
                    let second = nodes.remove(rng.random_range(0..2));
                    if sharp_case {
                        cut_off(proxies, &[first], blackhole);
                        // Its key on `first` expires; renewals keep it on the other two.
                        tokio::time::sleep(REQ_TTL + ms(300)).await;
                        let values = key_values(&cluster);
                        let on_two = values[first] != values[second]
                            && values[second].is_some()
                            && values[second] == values[nodes[0]];
                        if on_two && store.is_open(&struck.who, struck.token) {
                            sharp += 1;
                        } else {
                            println!("partition round {round} is not the sharp case: {values:?}");
                        }
                    }
                    cut_off(proxies, &[first, second], blackhole);
                    let cut = Instant::now();
                    next_session(
                        &store,
                        cut,
                        Some(&struck.who),
                        REQ_TTL + TAKEOVER_SLACK,
                        "a client with a quorum takes over from the cut-off holder",
                    )
                    .await;
                    tokio::time::sleep(ms(300)).await;
                    heal(proxies);
                    let fault = match (sharp_case, blackhole) {
                        (true, true) => "holder's sidecar cut off, its key on 2 of 3 (blackhole)",
                        (true, false) => "holder's sidecar cut off, its key on 2 of 3 (reset)",
                        (false, true) => "holder's sidecar cut off from 2 of 3 (blackhole)",
                        (false, false) => "holder's sidecar cut off from 2 of 3 (reset)",
                    };
                    (fault, cut, true)
                }
                // FLUSHALL while the name is held: on one node; then on one of the two nodes a
                // holder cut off from the third still has its key on (a majority lost it).
                4 | 10 => {
                    let mut nodes = some_nodes(&mut rng, 3);
                    let flushed = nodes.remove(rng.random_range(0..3));
                    let proxies = &sidecars[struck.sidecar].proxies;
                    let bare = round == 10;
                    if bare {
                        cut_off(proxies, &[nodes[0]], false);
                        tokio::time::sleep(REQ_TTL + ms(300)).await;
                    }
                    block_in_place(|| {
                        let cluster = cluster.lock().unwrap_or_else(|e| e.into_inner());
                        assert_eq!(cluster.node(flushed).command(&["FLUSHALL"]), "OK");
                    });
                    let flushed_at = Instant::now();
                    if bare {
                        next_session(
                            &store,
                            flushed_at,
                            Some(&struck.who),
                            REQ_LIVENESS,
                            "a client takes over once the flushed node counts",
                        )
                        .await;
                        heal(proxies);
                        (
                            "FLUSHALL, the holder's key on a bare majority",
                            flushed_at,
                            true,
                        )
                    } else {
                        fleet.finish(&struck);
                        ("FLUSHALL on 1 of 3 nodes", flushed_at, false)
                    }
                }
                _ => unreachable!("twelve rounds"),
            };
            // Liveness: the name is held again within the bound once a quorum is healthy.
            let not = took.then_some(struck.who.as_str());
            next_session(
                &store,
                since,
                not,
                REQ_LIVENESS,
                &format!("the name is held again after: {fault}"),
            )
            .await;
            // The first section after the fault (the wait above may have seen a later one).
            let (next, next_who) =
                first_begin_after(&store, since, not).expect("a section began after the fault");
            let promise = took.then(|| {
                crashes.push(since);
                let promised = last_deadline(&store, &struck.who, struck.token)
                    .expect("the holder wrote under a deadline");
                (struck.who.clone(), struck.token, next, promised)
            });
            println!(
                "request-lock fault {round}: {fault}: {} held; {next_who} began {:?} later{}",
                struck.who,
                next - since,
                promise
                    .as_ref()
                    .map_or(String::new(), |(_, _, next, promised)| format!(
                        ", {} ms after the validity the holder's client was given",
                        signed_ms(*promised, *next)
                    ))
            );
            lines.push(FaultLine {
                fault: fault.to_owned(),
                takeover: next - since,
                promise,
            });
            // Some handoffs between faults.
            tokio::time::sleep(ms(500)).await;
        }
        // Both sidecars still serve, and the name goes on changing hands.
        let calm = Instant::now();
        next_session(
            &store,
            calm,
            None,
            REQ_LIVENESS,
            "handoffs go on after the faults",
        )
        .await;
        for sidecar in &sidecars {
            let health = support::http::get(sidecar.admin, "/healthz").await;
            assert!(
                health.as_ref().is_ok_and(|r| r.status == 200),
                "{} is healthy after the faults: {health:?}",
                sidecar.identity
            );
        }
    };
    // A failure in the scenario shows what the sidecars logged.
    let outcome = CatchUnwind(Box::pin(tokio::time::timeout(
        Duration::from_secs(150),
        scenario,
    )))
    .await;
    let logs = |sidecars: &[ReqSidecar]| {
        sidecars
            .iter()
            .map(ReqSidecar::logs)
            .collect::<Vec<_>>()
            .join("\n")
    };
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(_)) => panic!("the scenario did not finish in 150 s\n{}", logs(&sidecars)),
        Err(panic) => {
            println!("{}", logs(&sidecars));
            std::panic::resume_unwind(panic);
        }
    }
    let clients = fleet.stop().await;
    let records = store.records();
    let mut analysis = analyse(&records, Mode::Fenced, &crashes);
    // A client's validity is a promise: no write made within it may be refused.
    for r in records
        .iter()
        .filter(|r| r.kind != Kind::Gone && !r.accepted && !r.is_late())
    {
        analysis.violations.push(format!(
            "{} was refused with token {} {} ms before the validity its client was given ended",
            r.who,
            r.token,
            r.deadline.map_or(0, |d| signed_ms(r.at, d))
        ));
    }
    // Nobody was granted the name before the validity its holder's client was given had
    // ended, unless that client had been told `lost` first.
    let told_lost = |who: &str, token: u64, before: Instant| {
        clients.iter().filter(|c| c.who == who).any(|c| {
            c.tally()
                .lost
                .iter()
                .any(|(t, at, _)| *t == token && *at < before)
        })
    };
    for line in &lines {
        if let Some((who, token, next, promised)) = &line.promise {
            if next < promised && !told_lost(who, *token, *next) {
                analysis.violations.push(format!(
                    "{}: the next section began {} ms before the validity {who}'s client was \
                     given (token {token}) ended, and it had not been told lost",
                    line.fault,
                    signed_ms(*next, *promised)
                ));
            }
        }
    }
    // A kill's successor began no sooner than the killed holder's key had expired on a quorum.
    for (killed, bound) in &kill_bounds {
        if let Some(next) = analysis.first_begin_after(*killed) {
            if next.begin + ms(5) < *bound {
                analysis.violations.push(format!(
                    "{} began {:?} before the killed holder's key had expired on a quorum",
                    next.who,
                    *bound - next.begin
                ));
            }
        }
    }
    let mut totals = Tally::default();
    let mut per_client = String::new();
    for client in &clients {
        let tally = client.tally();
        per_client.push_str(&format!("{}: {tally:?}\n", client.who));
        totals.granted += tally.granted;
        totals.refreshed += tally.refreshed;
        totals.unused += tally.unused;
        totals.sections += tally.sections;
        totals.busy += tally.busy;
        totals.no_answer += tally.no_answer;
        totals.keepalives += tally.keepalives;
        totals.expired += tally.expired;
        totals.unknown += tally.unknown;
        totals.refused += tally.refused;
        totals.lost.extend(tally.lost.iter().cloned());
        for (k, v) in &tally.unavailable {
            *totals.unavailable.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &tally.deletes {
            *totals.deletes.entry(k.clone()).or_default() += v;
        }
        totals.unexpected.extend(tally.unexpected.iter().cloned());
    }
    let lost_in_time = totals
        .lost
        .iter()
        .filter(|(_, _, ahead)| *ahead > 0)
        .count();
    let takeovers: Vec<Duration> = lines.iter().map(|l| l.takeover).collect();
    let margins: Vec<i64> = lines
        .iter()
        .filter_map(|l| l.promise.as_ref())
        .map(|(_, _, next, promised)| signed_ms(*promised, *next))
        .collect();
    println!(
        "request locks: {} grants ({} refreshed by a keepalive, {} unused), {} sections, \
         {} busy, 503 {:?}, {} unanswered, {} keepalives, {} told lost ({} before the validity \
         ended), {} expired, {} unknown after a restart, {} stopped by a refused write, \
         DELETE {:?}; {sharp} of 2 sharp partitions had the key on exactly two nodes; held \
         again after each fault {:?} ms (max {:?}); after the holder's validity: {margins:?} ms; \
         {:.1} s",
        totals.granted,
        totals.refreshed,
        totals.unused,
        totals.sections,
        totals.busy,
        totals.unavailable,
        totals.no_answer,
        totals.keepalives,
        totals.lost.len(),
        lost_in_time,
        totals.expired,
        totals.unknown,
        totals.refused,
        totals.deletes,
        takeovers.iter().map(|d| d.as_millis()).collect::<Vec<_>>(),
        takeovers.iter().max(),
        started.elapsed().as_secs_f64()
    );
    let row = Row::new(
        "request locks: SIGSTOP / SIGKILL of the holder's sidecar, node restarts, partitions, FLUSHALL",
        "2 run, 3 clients each, own proxies",
        lines.len(),
        &analysis,
    );
    if !analysis.violations.is_empty() || !totals.unexpected.is_empty() {
        checker::report(vec![row.clone()]);
        println!("{per_client}\n{}", logs(&sidecars));
    }
    analysis.assert_no_violations("request locks under faults");
    assert!(
        totals.unexpected.is_empty(),
        "answers the API does not give here: {:?}",
        totals.unexpected
    );
    assert!(
        sharp >= 1,
        "the sharp partition case (the holder's key on exactly two nodes) was exercised"
    );
    for sidecar in &mut sidecars {
        assert!(sidecar.proc.sigterm());
        let status = sidecar
            .proc
            .wait_exit_async(Duration::from_secs(10))
            .await
            .expect("a sidecar exits on SIGTERM");
        assert_eq!(exit_code(status), 0, "{}", sidecar.logs());
    }
    checker::report(vec![row]);
}

//! Leadership follows the app, and readiness decides who leads, never whether anyone does:
//! `run --app-ready` sidecars next to small local apps whose readiness the test turns on and
//! off (or that are ready only while their own sidecar leads), a simulated rolling update,
//! and the control listener's resign route, through the real binary on real redis-server
//! nodes.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{http, leads, one_leader, RedisCluster, Sidecar};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TTL: Duration = Duration::from_secs(2);
/// `--app-unready-after` in these tests.
const UNREADY_AFTER: Duration = Duration::from_millis(600);
/// `--app-ready-interval` in these tests.
const PROBE_EVERY: Duration = Duration::from_millis(100);
/// What a loaded 2-core machine (other tests run beside these) may add to a hand-over: a
/// round, a reconnect, the poll of `/leader`.
const SLACK: Duration = Duration::from_secs(4);
/// The hold of the resign test.
const HOLD: Duration = Duration::from_secs(3);
/// How often a candidate announces itself to the others (`candidacy::presence::PERIOD`).
const PRESENCE: Duration = Duration::from_secs(1);

/// An app with a readiness endpoint that answers 200 or 503 as the test says, or (once told
/// whose) as its own sidecar's `/leader` answers.
struct App {
    addr: SocketAddr,
    ready: Arc<AtomicBool>,
    sidecar: Arc<std::sync::OnceLock<SocketAddr>>,
}

impl App {
    async fn start(ready: bool) -> App {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ready = Arc::new(AtomicBool::new(ready));
        let sidecar: Arc<std::sync::OnceLock<SocketAddr>> = Arc::default();
        let answer = ready.clone();
        let leading = sidecar.clone();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let answer = answer.clone();
                let leading = leading.clone();
                tokio::spawn(async move {
                    let ready = match leading.get() {
                        Some(sidecar) => http::get(*sidecar, "/leader")
                            .await
                            .is_ok_and(|r| r.status == 200),
                        None => answer.load(Ordering::SeqCst),
                    };
                    let mut buf = [0u8; 1024];
                    let _ = conn.read(&mut buf).await;
                    let status = if ready {
                        "200 OK"
                    } else {
                        "503 Service Unavailable"
                    };
                    let reply = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n");
                    let _ = conn.write_all(reply.as_bytes()).await;
                });
            }
        });
        App {
            addr,
            ready,
            sidecar,
        }
    }

    /// An app that is ready only while its sidecar (see [`App::follow`]) leads.
    async fn start_following_leader() -> App {
        App::start(false).await
    }

    /// From now on, ready exactly while the sidecar at `addr` answers 200 on `/leader`.
    fn follow(&self, addr: SocketAddr) {
        let _ = self.sidecar.set(addr);
    }

    fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    fn url(&self) -> String {
        format!("http://{}/ready", self.addr)
    }
}

/// A sidecar for lock `work` on `cluster`; with `app`, it follows that app's readiness.
fn sidecar(name: &str, cluster: &RedisCluster, app: Option<&App>) -> Sidecar {
    let (interval, after) = (
        format!("{}ms", PROBE_EVERY.as_millis()),
        format!("{}ms", UNREADY_AFTER.as_millis()),
    );
    let app_url = app.map(App::url);
    let mut extra = vec!["--kubernetes", "off"];
    if let Some(url) = &app_url {
        extra.extend([
            "--app-ready",
            url,
            "--app-ready-interval",
            &interval,
            "--app-unready-after",
            &after,
        ]);
    }
    Sidecar::start_logging(name, "work", &cluster.urls_joined(), "2s", &extra, "info")
}

fn ready_cluster() -> RedisCluster {
    RedisCluster::ready(3, TTL)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_app_fails_hands_over_and_returns_as_a_standby() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let apps = [App::start(true).await, App::start(true).await];
    let sidecars = [
        sidecar("a", &cluster, Some(&apps[0])),
        sidecar("b", &cluster, Some(&apps[1])),
    ];
    let both = [&sidecars[0], &sidecars[1]];
    let first = one_leader(&both, Duration::from_secs(15)).await;
    let other = 1 - first;
    let token = sidecars[first].token().await.unwrap();

    // The leader's app fails: the other takes over once the failures have lasted
    // --app-unready-after (plus a probe), not at the first failed probe and not a ttl later.
    let broke = Instant::now();
    apps[first].set_ready(false);
    leads(&both, other, UNREADY_AFTER + PROBE_EVERY + SLACK).await;
    let took = broke.elapsed();
    assert!(
        took >= UNREADY_AFTER,
        "a leader keeps leading through {UNREADY_AFTER:?} of failures; handed over after {took:?}"
    );
    let new_token = sidecars[other].token().await.unwrap();
    assert!(new_token > token, "tokens grow: {token} then {new_token}");
    let log = sidecars[first].proc.output_text();
    assert!(
        log.contains("stepping down and releasing the lock at once")
            && log.contains("app not ready"),
        "{log}"
    );

    // Back to ready: the former leader contends again as a standby (it sees the holder) and
    // takes nothing from the healthy leader.
    apps[first].set_ready(true);
    support::wait_until_async(
        Duration::from_secs(10),
        "the former leader follows the new one",
        || async {
            sidecars[first].holder().await.as_deref() == Some(sidecars[other].name.as_str())
        },
    )
    .await;
    assert!(sidecars[other].is_leader().await);
    assert_eq!(sidecars[other].token().await, Some(new_token));

    // Both apps fail, the standby's first (and the leader learns it: a presence period or
    // two): no ready candidate waits, so the leader keeps the lock (leadership does not move
    // among unready apps) well past --app-unready-after. Once the other app is ready again,
    // the leader yields to it.
    apps[first].set_ready(false);
    support::wait_until_async(SLACK, "the standby's app counts as not ready", || async {
        sidecars[first].metric("redlock_app_ready", "lock=").await == 0.0
    })
    .await;
    tokio::time::sleep(PRESENCE * 2).await;
    apps[other].set_ready(false);
    let both_failed = Instant::now();
    while both_failed.elapsed() < UNREADY_AFTER + PRESENCE * 3 {
        assert!(
            sidecars[other].is_leader().await,
            "the leader kept the lock with no ready candidate waiting"
        );
        tokio::time::sleep(support::POLL_EVERY).await;
    }
    apps[first].set_ready(true);
    leads(&both, first, PROBE_EVERY + PRESENCE * 2 + SLACK).await;
}

/// An app that is not ready still gets a leader when no ready candidate stands: readiness
/// decides who leads, never whether.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_that_is_not_ready_still_leads_when_no_ready_candidate_stands() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let app = App::start(false).await;
    let sidecar = sidecar("starting", &cluster, Some(&app));
    leads(&[&sidecar], 0, SLACK * 2).await;
    support::wait_until_async(SLACK, "the gauge says why", || async {
        sidecar
            .metric("redlock_candidacy", "state=\"app_not_ready\"")
            .await
            == 1.0
    })
    .await;
    assert_eq!(sidecar.metric("redlock_app_ready", "lock=").await, 0.0);
    app.set_ready(true);
    support::wait_until_async(SLACK, "the gauge follows the app", || async {
        sidecar
            .metric("redlock_candidacy", "state=\"contending\"")
            .await
            == 1.0
    })
    .await;
    assert!(sidecar.is_leader().await, "still the leader");
}

/// Three sidecars whose apps are ready only while their own sidecar leads (an app whose
/// readinessProbe asks `/leader`): one of them leads within a ttl, and exactly one keeps
/// leading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apps_ready_only_while_leading_elect_one_leader_and_keep_it() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let mut apps = Vec::new();
    let mut sidecars = Vec::new();
    for name in ["a", "b", "c"] {
        let app = App::start_following_leader().await;
        let sidecar = sidecar(name, &cluster, Some(&app));
        app.follow(sidecar.addr);
        apps.push(app);
        sidecars.push(sidecar);
    }
    let all: Vec<&Sidecar> = sidecars.iter().collect();
    let started = Instant::now();
    let first = one_leader(&all, TTL + SLACK).await;
    println!(
        "apps ready only while leading: a leader after {:?}",
        started.elapsed()
    );
    let token = sidecars[first].token().await;
    let kept = Instant::now();
    while kept.elapsed() < UNREADY_AFTER + PRESENCE * 3 {
        assert_eq!(one_leader(&all, SLACK).await, first, "leadership stays put");
        tokio::time::sleep(support::POLL_EVERY).await;
    }
    assert_eq!(sidecars[first].token().await, token, "one tenure");
}

/// A rolling update with maxSurge 1 (a new pod starts and is ready, then an old one is
/// terminated, repeated): the lock moves from an old pod to a new one exactly once, never from
/// an old pod to another old one, from what the sidecars know (`--kubernetes off`). Two
/// trials, the leader terminated at a different step of each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_moves_leadership_once() {
    for trial in 0..2 {
        let cluster = tokio::task::block_in_place(ready_cluster);
        let mut watch = support::tenures::Watch::new();
        let mut old = Vec::new();
        for i in 0..3 {
            let pod = sidecar(&format!("old-{i}"), &cluster, None);
            watch.add(&pod);
            old.push(pod);
        }
        let first = {
            let all: Vec<&Sidecar> = old.iter().collect();
            one_leader(&all, Duration::from_secs(15)).await
        };
        // The leader is terminated at step `trial`, the other old pods in order.
        let mut order: Vec<usize> = (0..3).filter(|i| *i != first).collect();
        order.insert(trial, first);
        let mut old: Vec<Option<Sidecar>> = old.into_iter().map(Some).collect();
        let mut new = Vec::new();
        for (step, gone) in order.into_iter().enumerate() {
            let pod = sidecar(&format!("new-{step}"), &cluster, None);
            watch.add(&pod);
            // Ready: it stands as a candidate, and the others have read its announcement.
            support::wait_until_async(SLACK, "the new pod contends", || async {
                pod.metric("redlock_candidacy", "state=\"contending\"")
                    .await
                    == 1.0
            })
            .await;
            let others: Vec<&Sidecar> = old.iter().flatten().chain(new.iter()).collect();
            support::wait_until_async(SLACK, "the others defer to the new pod", || async {
                for other in &others {
                    if !other.is_leader().await
                        && other
                            .metric("redlock_candidacy", "state=\"deferring\"")
                            .await
                            != 1.0
                    {
                        return false;
                    }
                }
                true
            })
            .await;
            new.push(pod);
            let mut pod = old[gone].take().expect("each old pod once");
            pod.proc.sigterm();
            assert!(pod
                .proc
                .wait_exit_async(Duration::from_secs(10))
                .await
                .is_some());
            watch.keep_log(pod.name.clone(), pod.proc.stderr_text());
        }
        let running: Vec<&Sidecar> = new.iter().collect();
        // Leadership at once is judged by the watch's tenures (the sidecars' own claims), not
        // by polling them one after the other.
        support::wait_until_async(SLACK, "a new pod leads", || async {
            for pod in &running {
                if pod.is_leader().await {
                    return true;
                }
            }
            false
        })
        .await;
        let tenures = watch.finish(&running).await;
        let who: Vec<&str> = tenures.iter().map(|t| t.who.as_str()).collect();
        println!("rolling update, trial {trial}: leaders in turn {who:?}");
        assert_eq!(who.len(), 2, "one move per rollout: {who:?}");
        assert!(
            who[0].starts_with("old-") && who[1].starts_with("new-"),
            "{who:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resign_on_the_control_listener_hands_over_at_once_and_the_public_port_changes_nothing() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let sidecars = [sidecar("a", &cluster, None), sidecar("b", &cluster, None)];
    let both = [&sidecars[0], &sidecars[1]];
    let first = one_leader(&both, Duration::from_secs(15)).await;
    let other = 1 - first;
    let (leader, standby) = (&sidecars[first], &sidecars[other]);

    // The public port has no state-changing route.
    let public = http::request("POST", leader.addr, "/v1/leader/resign")
        .await
        .unwrap();
    assert!(matches!(public.status, 404 | 405), "{}", public.status);
    assert!(leader.is_leader().await);

    // Bad input: a JSON error, and nothing changes.
    for path in [
        "/v1/leader/resign?hold=soon",
        "/v1/leader/resign?hold=2h",
        "/v1/leader/resign?force=1",
    ] {
        let answer = http::request("POST", leader.control, path).await.unwrap();
        assert_eq!(answer.status, 400, "{path}");
        assert!(answer.json().unwrap()["error"].is_string(), "{path}");
    }
    let answer = http::get(leader.control, "/v1/leader/resign")
        .await
        .unwrap();
    assert_eq!(answer.status, 405);
    assert!(answer.json().unwrap()["error"].is_string());
    assert!(leader.is_leader().await);

    // A standby cannot resign.
    let answer = http::request("POST", standby.control, "/v1/leader/resign")
        .await
        .unwrap();
    assert_eq!(answer.status, 409);
    assert_eq!(answer.json().unwrap()["error"], "not leading");

    // The leader resigns: it answers once it no longer leads, and the standby takes over
    // within a round trip or so (a release wakes it), not a ttl later.
    let asked = Instant::now();
    let answer = http::request("POST", leader.control, "/v1/leader/resign?hold=3s")
        .await
        .unwrap();
    assert_eq!(answer.status, 200);
    let body = answer.json().unwrap();
    assert_eq!(body["resigned"], true);
    assert_eq!(body["hold_ms"], HOLD.as_millis() as u64);
    assert!(!leader.is_leader().await);
    leads(&both, other, TTL).await;
    let took = asked.elapsed();
    assert!(took < TTL / 2, "handed over in {took:?}");

    // During its hold the former leader does not contend: when the new leader goes away
    // (SIGTERM releases the lock), the resigned one takes the lock only once its hold is over.
    let mut sidecars = sidecars;
    sidecars[other].proc.sigterm();
    assert!(sidecars[other]
        .proc
        .wait_exit(Duration::from_secs(10))
        .is_some());
    let resigned = &sidecars[first];
    leads(&[resigned], 0, HOLD + SLACK).await;
    let led_after = asked.elapsed();
    assert!(
        led_after >= HOLD,
        "led again {led_after:?} after resigning with a {HOLD:?} hold"
    );
    assert!(resigned.proc.output_text().contains("resigned"));
}

#[test]
fn bad_candidacy_settings_exit_2_naming_the_flag() {
    let base = ["run", "--lock", "x", "--redis", "redis://127.0.0.1:1"];
    let cases: &[(&[&str], &str)] = &[
        (&["--control-listen", "0.0.0.0:9708"], "--control-listen"),
        (&["--control-listen", "[::]:9708"], "--control-listen"),
        (&["--app-ready", "https://localhost/ready"], "--app-ready"),
        (&["--app-ready", "localhost:8080"], "--app-ready"),
        (
            &[
                "--app-ready",
                "http://localhost:8080/",
                "--app-ready-interval",
                "1ms",
            ],
            "--app-ready-interval",
        ),
        (
            &[
                "--app-ready",
                "http://localhost:8080/",
                "--app-ready-interval",
                "2s",
                "--app-unready-after",
                "1s",
            ],
            "--app-unready-after",
        ),
        (&["--app-unready-after", "2h"], "--app-unready-after"),
    ];
    for (extra, flag) in cases {
        let args: Vec<&str> = base.iter().chain(extra.iter()).copied().collect();
        support::process::assert_invalid_config(&args, flag);
    }
}

/// `POST /v1/leader/resign?to=IDENTITY` hands over to the named waiting standby (twice, to
/// each standby in turn, so not by chance); an identity that is not a waiting candidate gets
/// 404, a standby 409, a bad `to` 400, and none of them changes anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resign_to_a_named_standby_hands_over_to_it() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let sidecars = [
        sidecar("a", &cluster, None),
        sidecar("b", &cluster, None),
        sidecar("c", &cluster, None),
    ];
    let all: Vec<&Sidecar> = sidecars.iter().collect();
    let mut leader = one_leader(&all, Duration::from_secs(15)).await;
    // Every standby has announced itself and the leader has read it.
    tokio::time::sleep(PRESENCE * 2).await;
    for (path, status) in [
        ("/v1/leader/resign?to=nobody", 404),
        ("/v1/leader/resign?to=", 400),
        ("/v1/leader/resign?to=a%0Ab", 400),
    ] {
        let answer = http::request("POST", sidecars[leader].control, path)
            .await
            .unwrap();
        assert_eq!(answer.status, status, "{path}: {}", answer.body);
        assert!(answer.json().unwrap()["error"].is_string(), "{path}");
    }
    let standby = (leader + 1) % 3;
    let answer = http::request(
        "POST",
        sidecars[standby].control,
        &format!("/v1/leader/resign?to={}", sidecars[leader].name),
    )
    .await
    .unwrap();
    assert_eq!(answer.status, 409, "a standby cannot resign");
    assert!(sidecars[leader].is_leader().await, "nothing changed");

    for step in 0..2 {
        // The standby that would not win by age: the older of the two, then the other.
        let successor = (leader + 1 + step) % 3;
        let path = format!("/v1/leader/resign?to={}&hold=1s", sidecars[successor].name);
        let answer = http::request("POST", sidecars[leader].control, &path)
            .await
            .unwrap();
        assert_eq!(answer.status, 200, "{path}: {}", answer.body);
        assert_eq!(
            answer.json().unwrap()["to"],
            sidecars[successor].name.as_str()
        );
        leads(&all, successor, SLACK).await;
        leader = successor;
        tokio::time::sleep(PRESENCE * 2).await;
    }
}

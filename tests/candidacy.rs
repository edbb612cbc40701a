//! Leadership follows the app: `run --app-ready` sidecars next to small local apps whose
//! readiness the test turns on and off, and the control listener's resign route, through the
//! real binary on real redis-server nodes.

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

/// An app with a readiness endpoint that answers 200 or 503 as the test says.
struct App {
    addr: SocketAddr,
    ready: Arc<AtomicBool>,
}

impl App {
    async fn start(ready: bool) -> App {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ready = Arc::new(AtomicBool::new(ready));
        let answer = ready.clone();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let ready = answer.load(Ordering::SeqCst);
                tokio::spawn(async move {
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
        App { addr, ready }
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

    // A standby whose app is not ready does not take over: the leader's app fails, the
    // standby's too; nobody leads until the standby's app is ready again.
    apps[other].set_ready(false);
    apps[first].set_ready(false);
    support::wait_until_async(
        UNREADY_AFTER + PROBE_EVERY + SLACK,
        "the leader steps down",
        || async { !sidecars[other].is_leader().await },
    )
    .await;
    assert!(!sidecars[first].is_leader().await);
    apps[first].set_ready(true);
    leads(&both, first, PROBE_EVERY + SLACK).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_that_never_became_ready_never_leads() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let app = App::start(false).await;
    let sidecar = sidecar("starting", &cluster, Some(&app));
    support::wait_until_async(Duration::from_secs(10), "the sidecar serves", || async {
        sidecar.leader().await.is_some()
    })
    .await;
    let waits = Instant::now();
    while !sidecar.proc.output_text().contains("app not ready yet") {
        assert!(
            waits.elapsed() < Duration::from_secs(10),
            "it logs why it waits: {}",
            sidecar.proc.output_text()
        );
        tokio::time::sleep(support::POLL_EVERY).await;
    }
    assert!(!sidecar.is_leader().await);
    assert!(
        cluster
            .iter()
            .all(|node| node.command(&["EXISTS", "redlock:{work}"]) == "0"),
        "no key was taken"
    );
    app.set_ready(true);
    leads(&[&sidecar], 0, PROBE_EVERY + SLACK).await;
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

//! `redlock-sidecar run` as real processes on real redis-server nodes.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use support::{http, one_leader, Proc, RedisCluster, Sidecar};

/// The ttl the binary is run with in these tests, as a flag value and as a duration.
const TTL: &str = "2s";
const TTL_SECS: Duration = Duration::from_secs(2);

/// A sidecar for lock `jobs` on `cluster`, with the shared test flags and `extra`.
fn sidecar(name: &str, cluster: &RedisCluster, extra: &[&str]) -> Sidecar {
    Sidecar::start(name, "jobs", &cluster.urls_joined(), TTL, extra)
}

fn ready_cluster(n: usize) -> RedisCluster {
    // Blocking is fine here: nothing else runs on the test's runtime yet.
    RedisCluster::ready(n, TTL_SECS)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sidecars_elect_one_leader_and_hand_over_on_sigterm_sigkill_and_sigstop() {
    let cluster = ready_cluster(3);
    let mut sidecars: Vec<Sidecar> = ["a", "b", "c"]
        .iter()
        .map(|n| sidecar(n, &cluster, &[]))
        .collect();

    // Exactly one leads, and every sidecar names it as holder.
    let first = one_leader(
        &sidecars.iter().collect::<Vec<_>>(),
        Duration::from_secs(20),
    )
    .await;
    let leader_name = sidecars[first].name.clone();
    support::wait_until_async(
        Duration::from_secs(5),
        "all agree on the holder",
        || async {
            let mut agree = true;
            for s in &sidecars {
                agree &= s
                    .leader()
                    .await
                    .is_some_and(|b| b["holder"] == leader_name.as_str());
            }
            agree
        },
    )
    .await;
    let first_token = sidecars[first].leader().await.unwrap()["fencing_token"]
        .as_u64()
        .unwrap();

    // SIGTERM: a standby takes over through the release announcement, well before the ttl.
    let sent = Instant::now();
    sidecars[first].proc.sigterm();
    let standbys: Vec<&Sidecar> = sidecars
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != first)
        .map(|(_, s)| s)
        .collect();
    let second = one_leader(&standbys, Duration::from_secs(5)).await;
    let handoff = sent.elapsed();
    let second_name = standbys[second].name.clone();
    println!("handoff after SIGTERM: {handoff:?}");
    assert!(
        handoff < Duration::from_secs(2),
        "took over before the old ttl: {handoff:?}"
    );
    let status = sidecars[first]
        .proc
        .wait_exit(Duration::from_secs(5))
        .expect("exits after SIGTERM");
    assert_eq!(
        status.code(),
        Some(0),
        "{}",
        sidecars[first].proc.output_text()
    );
    assert!(sidecars[first]
        .proc
        .stderr_text()
        .contains("released the lock"));
    let second = sidecars.iter().position(|s| s.name == second_name).unwrap();
    let second_token = sidecars[second].leader().await.unwrap()["fencing_token"]
        .as_u64()
        .unwrap();
    assert!(
        second_token > first_token,
        "tokens grow: {second_token} after {first_token}"
    );

    // SIGKILL: the last standby leads within ttl + retry delay (plus polling slack).
    let killed = Instant::now();
    sidecars[second].proc.sigkill();
    let third = sidecars
        .iter()
        .position(|s| s.name != sidecars[first].name && s.name != sidecars[second].name)
        .unwrap();
    support::wait_until_async(Duration::from_secs(6), "takeover after SIGKILL", || {
        sidecars[third].is_leader()
    })
    .await;
    println!("takeover after SIGKILL: {:?}", killed.elapsed());
    assert!(
        killed.elapsed() < Duration::from_millis(2000 + 1000 + 1500),
        "within ttl + retry delay"
    );

    // SIGSTOP the leader past its ttl: a fresh sidecar takes over; after SIGCONT the old
    // one never claims leadership while the new one holds, and its token is lower.
    let paused_token = sidecars[third].leader().await.unwrap()["fencing_token"]
        .as_u64()
        .unwrap();
    let fresh = sidecar("d", &cluster, &[]);
    sidecars[third].proc.sigstop();
    support::wait_until_async(Duration::from_secs(8), "fresh sidecar takes over", || {
        fresh.is_leader()
    })
    .await;
    sidecars[third].proc.sigcont();
    let watch_until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < watch_until {
        let (old, new) = tokio::join!(sidecars[third].leader(), fresh.leader());
        let (Some(old), Some(new)) = (old, new) else {
            continue;
        };
        if new["is_leader"] == true {
            assert_eq!(
                old["is_leader"], false,
                "the resumed holder never claims leadership: {old}"
            );
            assert!(
                new["fencing_token"].as_u64().unwrap() > paused_token,
                "the new token is higher"
            );
        }
    }
    drop(fresh);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_quorum_flips_leader_to_503_before_validity_ends_then_recovers() {
    let mut cluster = ready_cluster(3);
    // A 1 s margin (of the 2 s ttl): the test sees the step-down late by the time its own
    // polling takes, which on a loaded machine can exceed the default 300 ms.
    let a = sidecar("a", &cluster, &["--safety-margin", "1s"]);
    support::wait_until_async(Duration::from_secs(20), "a leads", || a.is_leader()).await;
    // Record when the lock's validity ends, as the leader reports it.
    let seen = Instant::now();
    let validity_ms = a.leader().await.unwrap()["validity_ms"].as_u64().unwrap();
    let expiry = seen + Duration::from_millis(validity_ms);
    cluster.node_mut(0).stop();
    cluster.node_mut(1).stop();
    support::wait_until_async(Duration::from_secs(5), "leader steps down", || async {
        !a.is_leader().await
    })
    .await;
    let stepped_down = Instant::now();
    assert!(
        stepped_down < expiry,
        "stepped down {:?} before the recorded expiry",
        expiry - stepped_down
    );
    support::wait_until_async(
        Duration::from_secs(5),
        "not ready without quorum",
        || async {
            http::get(a.addr, "/readyz")
                .await
                .is_ok_and(|r| r.status == 503)
        },
    )
    .await;
    cluster.node_mut(0).start_again();
    cluster.node_mut(1).start_again();
    let b = sidecar("b", &cluster, &[]);
    // Restarted nodes vote again only after ttl + drift: then exactly one leads.
    one_leader(&[&a, &b], Duration::from_secs(20)).await;
    support::wait_until_async(Duration::from_secs(5), "ready again", || async {
        http::get(a.addr, "/readyz")
            .await
            .is_ok_and(|r| r.status == 200)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_reports_a_restarted_node_as_not_counted_until_it_is_old_enough() {
    let mut cluster = ready_cluster(3);
    let a = sidecar("a", &cluster, &[]);
    support::wait_until_async(Duration::from_secs(20), "a leads", || a.is_leader()).await;
    let node = cluster.node(2).addr().to_string();
    let counted = || async {
        let text = http::get(a.addr, "/metrics").await.unwrap().body;
        sample(
            &parse_metrics(&text),
            "redlock_node_vote_counted",
            Some(("node", &node)),
        )
    };
    assert_eq!(counted().await, 1.0);
    // A leader only renews; its renewals must notice the restart.
    cluster.node_mut(2).restart();
    support::wait_until_async(Duration::from_secs(10), "restart noticed", || async {
        counted().await == 0.0
    })
    .await;
    support::wait_until_async(Duration::from_secs(15), "counted again", || async {
        counted().await == 1.0
    })
    .await;
    assert!(
        a.is_leader().await,
        "one node's restart does not cost the lead"
    );
}

/// The metric families documented in docs/reference.md's metrics table (rows starting with
/// `` | `redlock_ ``), plus the process collector's families that table sums up as `process_*`.
fn documented_metrics() -> Vec<String> {
    let doc = include_str!("../docs/reference.md");
    let mut names: Vec<String> = doc
        .lines()
        .filter_map(|line| line.strip_prefix("| `redlock_"))
        .map(|rest| {
            let name = rest.split(['`', '{']).next().unwrap();
            format!("redlock_{name}")
        })
        .collect();
    assert!(
        names.len() > 20,
        "docs/reference.md's metrics table was not found ({names:?})"
    );
    names.extend(["process_resident_memory_bytes", "process_cpu_seconds_total"].map(String::from));
    names
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn parse_metrics(text: &str) -> prometheus_parse::Scrape {
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
        .expect("valid exposition format")
}

fn sample(scrape: &prometheus_parse::Scrape, name: &str, label: Option<(&str, &str)>) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name && label.is_none_or(|(k, v)| s.labels.get(k) == Some(v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => 0.0,
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_valid_exposition_with_every_documented_name_and_move_on_handoff() {
    let cluster = ready_cluster(3);
    let mut a = sidecar("a", &cluster, &[]);
    support::wait_until_async(Duration::from_secs(20), "a leads", || a.is_leader()).await;
    let b = sidecar("b", &cluster, &["--workload", "jobs-runner"]);
    b.wait_serving().await;
    let text = http::get(b.addr, "/metrics").await.unwrap();
    assert_eq!(text.status, 200);
    let before = parse_metrics(&text.body);
    let names: std::collections::HashSet<&str> = before
        .samples
        .iter()
        .map(|s| {
            s.metric
                .trim_end_matches("_bucket")
                .trim_end_matches("_sum")
                .trim_end_matches("_count")
        })
        .collect();
    for name in documented_metrics() {
        assert!(names.contains(name.as_str()), "{name} is exported");
    }
    for (k, _) in before.samples.iter().flat_map(|s| s.labels.iter()) {
        assert!(
            [
                "lock",
                "node",
                "op",
                "kind",
                "result",
                "reason",
                "direction",
                "version",
                "workload",
                "state",
                "fingerprint",
                "le"
            ]
            .contains(&k.as_str()),
            "bounded label {k}"
        );
    }
    assert_eq!(
        sample(&before, "redlock_leader_since_timestamp_seconds", None),
        0.0,
        "a follower has no tenure"
    );
    // The alerts judge the validity margin against each sidecar's own timing.
    assert_eq!(
        sample(&before, "redlock_ttl_seconds", None),
        TTL_SECS.as_secs_f64()
    );
    assert_eq!(
        sample(&before, "redlock_renew_interval_seconds", None),
        (TTL_SECS / 3).as_secs_f64()
    );
    assert_eq!(sample(&before, "redlock_safety_margin_seconds", None), 0.3);
    // One info series, naming the workload (alerts join it to tell locks of one workload apart).
    let info: Vec<_> = before
        .samples
        .iter()
        .filter(|s| s.metric == "redlock_info")
        .collect();
    assert_eq!(info.len(), 1, "one redlock_info series");
    assert_eq!(info[0].labels.get("workload"), Some("jobs-runner"));
    assert_eq!(info[0].labels.get("lock"), Some("jobs"));
    assert_eq!(sample(&before, "redlock_info", None), 1.0);
    let handover = unix_now();
    a.proc.sigterm();
    support::wait_until_async(Duration::from_secs(5), "b leads", || b.is_leader()).await;
    let after = parse_metrics(&http::get(b.addr, "/metrics").await.unwrap().body);
    let since = sample(&after, "redlock_leader_since_timestamp_seconds", None);
    assert!(
        (handover..=unix_now()).contains(&since),
        "b's tenure began after the handover at {handover}: {since}"
    );
    assert_eq!(sample(&after, "redlock_is_leader", None), 1.0);
    assert_eq!(
        sample(
            &after,
            "redlock_leader_transitions_total",
            Some(("direction", "gained"))
        ),
        1.0
    );
    assert!(
        sample(
            &after,
            "redlock_acquire_attempts_total",
            Some(("result", "acquired"))
        ) >= 1.0
    );
    assert!(
        sample(&after, "redlock_contention_total", None)
            >= sample(&before, "redlock_contention_total", None)
    );
    assert!(sample(&after, "redlock_fencing_token", None) > 0.0);
    assert!(sample(&after, "redlock_validity_remaining_seconds", None) > 0.0);
    assert_eq!(sample(&after, "redlock_node_up", None), 3.0, "all nodes up");
    // The vote gauge follows the answers that carry a data-age proof: the grants of b's round
    // (the last of which may come after b leads) and its renewals.
    support::wait_until_async(
        Duration::from_secs(5),
        "b counts every node's vote",
        || async {
            let now = parse_metrics(&http::get(b.addr, "/metrics").await.unwrap().body);
            sample(&now, "redlock_node_vote_counted", None) == 3.0
        },
    )
    .await;
}

/// The next server-sent event's JSON payload.
async fn next_event<R: tokio::io::AsyncBufRead + Unpin>(
    lines: &mut tokio::io::Lines<R>,
) -> serde_json::Value {
    let data = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let line = lines.next_line().await.unwrap().expect("stream open");
            if let Some(data) = line.strip_prefix("data:") {
                return data.trim().to_owned();
            }
        }
    })
    .await
    .expect("an event within 10 s");
    serde_json::from_str(&data).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_reports_leadership_changes_and_unknown_routes_are_refused() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

    let cluster = ready_cluster(3);
    let mut a = sidecar("a", &cluster, &[]);
    support::wait_until_async(Duration::from_secs(20), "a leads", || a.is_leader()).await;
    let b = sidecar("b", &cluster, &[]);
    support::wait_until_async(Duration::from_secs(10), "b sees a as holder", || async {
        b.leader().await.is_some_and(|body| body["holder"] == "a")
    })
    .await;

    // b's stream: the current state first (a follower that sees a), then b's takeover.
    let stream = tokio::net::TcpStream::connect(b.addr).await.unwrap();
    let (read, mut write) = stream.into_split();
    write
        .write_all(b"GET /leader/watch HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    let mut lines = BufReader::new(read).lines();
    let first = next_event(&mut lines).await;
    assert_eq!(first["is_leader"], false, "{first}");
    assert_eq!(first["holder"], "a", "{first}");
    a.proc.sigterm();
    // Before b leads, b may refresh its view (a read of the nodes still showing a, then the
    // release announcement: nobody holds the lock for a moment); never another holder.
    let mut second = next_event(&mut lines).await;
    while second["is_leader"] == false {
        assert!(
            second["holder"] == "a" || second["holder"].is_null(),
            "{second}"
        );
        second = next_event(&mut lines).await;
    }
    assert_eq!(second["is_leader"], true, "{second}");
    assert_eq!(second["holder"], "b", "{second}");
    let a = &b;

    assert_eq!(http::get(a.addr, "/nope").await.unwrap().status, 404);
    assert_eq!(
        http::request("POST", a.addr, "/leader")
            .await
            .unwrap()
            .status,
        405
    );
    let head = http::request("HEAD", a.addr, "/leader").await.unwrap();
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty());
}

#[test]
fn invalid_configurations_exit_2_with_one_line_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "run",
                "--lock",
                "x",
                "--redis",
                "redis://127.0.0.1:1",
                "--renew-interval",
                "9s",
            ],
            "--renew-interval",
        ),
        (
            &[
                "run",
                "--lock",
                "x",
                "--redis",
                "redis://127.0.0.1:1",
                "--safety-margin",
                "10ms",
            ],
            "--safety-margin",
        ),
        (
            &[
                "run",
                "--lock",
                "x",
                "--redis",
                "redis://127.0.0.1:1",
                "--ttl",
                "100ms",
            ],
            "--ttl",
        ),
        (
            &[
                "run",
                "--lock",
                "x",
                "--redis",
                "redis://127.0.0.1:1,redis://127.0.0.1:1",
            ],
            "--redis",
        ),
        (
            &[
                "run",
                "--lock",
                "x",
                "--redis",
                "redis://127.0.0.1:1",
                "--ttl",
                "soon",
            ],
            "--ttl",
        ),
        (&["run", "--redis", "redis://127.0.0.1:1"], "--lock"),
        (
            &["run", "--lock", "x", "--redis", "redis://:hunter2@[::1"],
            "--redis",
        ),
        (
            &[
                "run",
                "--lock",
                "x",
                "--redis",
                "redis://127.0.0.1:1",
                "--shutdown-timeout",
                "1ms",
            ],
            "--shutdown-timeout",
        ),
        (
            &[
                "run",
                "--lock",
                "x",
                "--redis",
                "redis://127.0.0.1:1",
                "--ready-when",
                "always",
            ],
            "--ready-when",
        ),
    ];
    for (args, flag) in cases {
        let stderr = support::process::assert_invalid_config(args, flag);
        assert!(!stderr.contains("hunter2"), "no password: {stderr}");
    }
}

/// Every `data:` payload of a `/leader/watch` stream, read until the server ends it.
async fn watch_until_end(addr: SocketAddr) -> Vec<serde_json::Value> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (read, mut write) = stream.into_split();
    write
        .write_all(b"GET /leader/watch HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    let mut lines = BufReader::new(read).lines();
    let mut events = Vec::new();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Some(data) = line.strip_prefix("data:") {
            events.push(serde_json::from_str(data.trim()).unwrap());
        }
    }
    events
}

/// A SIGTERM that lands while an acquire round is in flight, and that round then wins: the
/// lock is released and never published (no 200, no leader event, no "acquired" log).
/// Deterministic: the node holds every write while `CLIENT PAUSE WRITE` is on, so the round's
/// script waits at the node until the signal has been handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_that_wins_after_sigterm_is_released_without_ever_leading() {
    let cluster = RedisCluster::start(1);
    let ttl = Duration::from_secs(60);
    cluster.backdate_epochs(ttl);
    let node = cluster.node(0);
    assert_eq!(node.command(&["CLIENT", "PAUSE", "60000", "WRITE"]), "OK");

    let addr: SocketAddr = format!("127.0.0.1:{}", support::free_port())
        .parse()
        .unwrap();
    let (redis, listen) = (node.url(), addr.to_string());
    // The node timeout covers the time the script is held at the node.
    let mut sidecar = Proc::spawn(
        &[
            "run",
            "--lock",
            "jobs",
            "--redis",
            &redis,
            "--ttl",
            "60s",
            "--node-timeout",
            "10s",
            "--shutdown-timeout",
            "30s",
            "--listen",
            &listen,
            "--identity",
            "a",
            "--kubernetes",
            "off",
        ],
        &[("REDLOCK_LOG", "debug")],
    );
    support::wait_until_async(Duration::from_secs(10), "admin endpoint serves", || async {
        http::get(addr, "/healthz")
            .await
            .is_ok_and(|r| r.status == 200)
    })
    .await;
    let events = tokio::spawn(watch_until_end(addr));
    support::wait_until_async(
        Duration::from_secs(10),
        "the round's script waits at the paused node",
        // The connection may have subscribed first (`flags=Pb`): it is the same connection.
        // The candidacy's presence (a MULTI with writes) may have gone first on it: then the
        // round's script waits in the query buffer behind the blocked transaction.
        || async {
            node.command(&["CLIENT", "LIST"]).lines().any(|client| {
                let field = |name: &str| {
                    client
                        .split(' ')
                        .find_map(|f| f.strip_prefix(name))
                        .unwrap_or("")
                        .to_owned()
                };
                let (flags, queued) = (field("flags="), field("qbuf=") != "0");
                let in_multi = flags.contains('x');
                flags.contains('b') && (field("cmd=") == "evalsha" || (in_multi && queued))
            })
        },
    )
    .await;
    assert_eq!(http::get(addr, "/leader").await.unwrap().status, 503);

    sidecar.sigterm();
    sidecar
        .wait_for_output_async("shutting down", Duration::from_secs(10))
        .await;
    assert_eq!(node.command(&["CLIENT", "UNPAUSE"]), "OK");
    let status = sidecar
        .wait_exit_async(Duration::from_secs(30))
        .await
        .expect("the sidecar exits");
    let log = sidecar.output_text();
    assert!(status.success(), "{log}");

    // The round won (a fencing token was minted) and the key was given back.
    assert_ne!(
        node.command(&["GET", "redlock:{jobs}:fence"]),
        "(nil)",
        "{log}"
    );
    assert_eq!(node.command(&["EXISTS", "redlock:{jobs}"]), "0", "{log}");
    assert!(!log.contains("acquired the lock"), "never published: {log}");
    let events = events.await.unwrap();
    assert!(!events.is_empty(), "the stream reported the state");
    assert!(
        events.iter().all(|e| e["is_leader"] == false),
        "never leader: {events:?}"
    );
    let after_signal = &log[log.find("shutting down").unwrap()..];
    assert!(
        after_signal.contains("won the lock after shutdown began"),
        "{log}"
    );
    assert!(after_signal.contains("released the lock"), "{log}");
}

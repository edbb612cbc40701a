//! Request-lock leases are counted and cheap, through the real binary on real redis-server
//! nodes: a held lease costs no file descriptor and a few kilobytes; the chart's default
//! `maxLeases` fits its memory limit with room to spare; held, waiting and ended (remembered)
//! leases all count against `--locks-max-leases`, past which the answer is 429 at once while
//! the probes and the leadership lock carry on; a flood of leases nobody keeps alive, under
//! the open-files limit containerd gives by default, never runs the sidecar out of
//! descriptors.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use support::{http, Proc, RedisCluster};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest wait for anything these tests expect to happen.
const DEADLINE: Duration = Duration::from_secs(60);
/// What a probe or a refusal may take (the chart's probe `timeoutSeconds`).
const ANSWER_WITHIN: Duration = Duration::from_secs(2);

/// A `run` sidecar on `cluster`, leading the lock `leader`, and its two addresses.
struct Sidecar {
    proc: Proc,
    admin: SocketAddr,
    control: SocketAddr,
}

impl Sidecar {
    /// Started as `prefix... redlock-sidecar run ...` (e.g. under `prlimit`), with `extra`
    /// flags.
    async fn start(cluster: &RedisCluster, prefix: &[&str], extra: &[&str]) -> Sidecar {
        let (admin, control) = (support::sidecar::loopback(), support::sidecar::loopback());
        let (listen, control_listen, redis) = (
            admin.to_string(),
            control.to_string(),
            cluster.urls_joined(),
        );
        let bin = support::bin();
        let bin = bin.to_string_lossy().into_owned();
        let mut args: Vec<&str> = prefix.to_vec();
        let program = if prefix.is_empty() {
            Path::new(&bin)
        } else {
            args.push(&bin);
            Path::new("/usr/bin/prlimit")
        };
        args.extend([
            "run",
            "--lock",
            "leader",
            "--redis",
            &redis,
            "--ttl",
            "2s",
            "--listen",
            &listen,
            "--control-listen",
            &control_listen,
            "--identity",
            "bounds",
            "--kubernetes",
            "off",
        ]);
        args.extend_from_slice(extra);
        let sidecar = Sidecar {
            proc: Proc::spawn_program(program, &args, &[("REDLOCK_LOG", "info")]),
            admin,
            control,
        };
        support::wait_until_async(DEADLINE, "the sidecar leads", || async {
            http::get(sidecar.admin, "/leader")
                .await
                .is_ok_and(|r| r.status == 200)
        })
        .await;
        sidecar
    }

    /// `POST path` on the control listener (no body), within [`ANSWER_WITHIN`].
    async fn post(&self, path: &str) -> http::Response {
        http::request("POST", self.control, path)
            .await
            .unwrap_or_else(|e| panic!("POST {path}: {e}\n{}", self.proc.output_text()))
    }

    /// Resident memory, in bytes.
    fn rss(&self) -> u64 {
        self.status_bytes("VmRSS:")
    }

    /// Resident memory that is not the binary's own pages (heap, stacks), in bytes.
    fn anon(&self) -> u64 {
        self.status_bytes("RssAnon:")
    }

    fn status_bytes(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.proc.pid())).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("a {field} line"));
        kb * 1024
    }

    /// Open file descriptors.
    fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.proc.pid()))
            .unwrap()
            .count()
    }

    /// The leadership as `/leader` tells it: (is leader, fencing token).
    async fn leadership(&self) -> (bool, Option<u64>) {
        let leader = http::get(self.admin, "/leader").await.unwrap();
        let body = leader.json().unwrap();
        (
            body["is_leader"].as_bool().unwrap_or(false),
            body["fencing_token"].as_u64(),
        )
    }
}

/// Nodes whose votes count at once for any ttl these tests ask for.
fn ready_cluster() -> RedisCluster {
    let cluster = RedisCluster::start(3);
    cluster.backdate_epochs(Duration::from_secs(3_600));
    cluster
}

/// Takes the distinct names `first..first + n` with `query`, eight at a time; the answers'
/// statuses.
async fn take(sidecar: &Sidecar, first: usize, n: usize, query: &str) -> Vec<u16> {
    let control = sidecar.control;
    let mut statuses = Vec::new();
    let names: Vec<usize> = (first..first + n).collect();
    for batch in names.chunks(8) {
        let asked: Vec<_> = batch
            .iter()
            .map(|i| {
                let path = format!("/v1/locks/held-{i}?{query}");
                tokio::spawn(async move { http::request("POST", control, &path).await })
            })
            .collect();
        for answer in asked {
            statuses.push(answer.await.unwrap().map_or(0, |r| r.status));
        }
    }
    statuses
}

/// Settles a moment after a burst (transient buffers given back), then reads (fds, RSS).
async fn measure(sidecar: &Sidecar) -> (usize, u64) {
    tokio::time::sleep(Duration::from_secs(2)).await;
    (sidecar.fds(), sidecar.rss())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lease_costs_no_file_descriptor_and_a_few_kilobytes() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let sidecar = Sidecar::start(&cluster, &[], &[]).await;
    // The first request opens the request locks' connections to the nodes.
    assert_eq!(take(&sidecar, 0, 1, "ttl=10m").await, [200]);
    let mut figures = vec![(1, measure(&sidecar).await)];
    for (from, to) in [(1, 100), (100, 500), (500, 1_000)] {
        let statuses = take(&sidecar, from, to - from, "ttl=10m").await;
        assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
        figures.push((to, measure(&sidecar).await));
    }
    let (_, (fds_at_1, rss_at_1)) = figures[0];
    let (_, (fds_at_1000, rss_at_1000)) = figures[3];
    let per_lease = rss_at_1000.saturating_sub(rss_at_1) / 999;
    eprintln!(
        "held leases (fds, RSS bytes): {figures:?}; {per_lease} bytes per lease from 1 to 1,000"
    );
    assert!(
        fds_at_1000 <= fds_at_1 + 8,
        "descriptors grow with the leases: {figures:?}"
    );
    // About 8 KB in a release build; a debug build's allocations are a little larger.
    assert!(
        per_lease <= 16 * 1024,
        "{per_lease} bytes per held lease: {figures:?}"
    );
    assert!(sidecar.leadership().await.0);
}

/// The value at `path` (keys from the top) of the chart's values file: a plain scalar, found
/// by indentation.
fn chart_value(path: &[&str]) -> String {
    let values_path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/redlock-sidecar/values.yaml");
    let text = std::fs::read_to_string(values_path).unwrap();
    let mut depth = 0;
    let mut indent = 0;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let this_indent = line.len() - trimmed.len();
        if depth > 0 && this_indent < indent {
            panic!(
                "{path:?}: {} not found under {:?}",
                path[depth],
                &path[..depth]
            );
        }
        if this_indent != indent {
            continue;
        }
        let Some((key, value)) = trimmed.split_once(':') else {
            continue;
        };
        if key != path[depth] {
            continue;
        }
        if depth + 1 == path.len() {
            return value.split('#').next().unwrap().trim().to_owned();
        }
        depth += 1;
        indent = this_indent + 2;
    }
    panic!("{path:?} not in values.yaml");
}

/// Bytes of a Kubernetes quantity such as `64Mi`.
fn quantity(text: &str) -> u64 {
    let (number, factor) = [("Ki", 1u64 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30)]
        .into_iter()
        .find_map(|(suffix, factor)| text.strip_suffix(suffix).map(|n| (n, factor)))
        .unwrap_or((text, 1));
    number.parse::<u64>().unwrap() * factor
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_max_leases_fit_its_memory_limit_with_room_to_spare() {
    let max: usize = chart_value(&["sidecar", "locks", "maxLeases"])
        .parse()
        .unwrap();
    let limit = quantity(&chart_value(&["sidecar", "resources", "limits", "memory"]));
    let cluster = tokio::task::block_in_place(ready_cluster);
    let max_flag = max.to_string();
    let sidecar = Sidecar::start(&cluster, &[], &["--locks-max-leases", &max_flag]).await;
    let statuses = take(&sidecar, 0, max, "ttl=10m").await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!(take(&sidecar, max, 1, "ttl=10m").await, [429]);
    let (fds, rss) = measure(&sidecar).await;
    let anon = sidecar.anon();
    eprintln!(
        "the chart's maxLeases ({max}) held: RSS {} KiB ({} KiB not the binary's) of a {} KiB \
         limit, {fds} descriptors",
        rss / 1024,
        anon / 1024,
        limit / 1024
    );
    // Room to spare for the connections slow clients may hold (about 16 KB each, up to 2 x
    // 512), a burst of renewals and the leadership lock. A debug build's binary alone maps
    // some 20 MB more than a release build's (RssFile), hence two bounds.
    assert!(
        anon <= limit / 2,
        "{anon} bytes of heap with {max} leases held: more than half the chart's limit ({limit})"
    );
    assert!(
        rss <= limit * 3 / 4,
        "RSS {rss} with {max} leases held: more than 3/4 of the chart's limit ({limit})"
    );
}

/// Sends `POST path` and leaves the request waiting (its answer is never read).
async fn leave_waiting(addr: SocketAddr, path: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let request = format!("POST {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_waiting_and_remembered_leases_all_count_and_past_the_bound_429_comes_at_once() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    let sidecar = Sidecar::start(&cluster, &[], &["--locks-max-leases", "20"]).await;
    let (_, token) = sidecar.leadership().await;
    // 10 held, 5 waiting for one of them, 5 nobody keeps alive (ended after their ttl of 1s,
    // then remembered so that their apps learn why).
    assert!(take(&sidecar, 0, 10, "ttl=1m")
        .await
        .iter()
        .all(|s| *s == 200));
    let mut waiting = Vec::new();
    for _ in 0..5 {
        waiting.push(leave_waiting(sidecar.control, "/v1/locks/held-0?wait=50s&ttl=1m").await);
    }
    let abandoned: Vec<String> = {
        let mut leases = Vec::new();
        for i in 0..5 {
            let answer = sidecar.post(&format!("/v1/locks/gone-{i}?ttl=1s")).await;
            assert_eq!(answer.status, 200, "{answer:?}");
            leases.push(answer.json().unwrap()["lease"].as_str().unwrap().to_owned());
        }
        leases
    };
    support::wait_until_async(DEADLINE, "the five are abandoned", || async {
        let text = http::get(sidecar.admin, "/metrics").await.unwrap().body;
        text.lines().any(|l| {
            l.starts_with("redlock_app_leases_ended_total{")
                && l.contains("abandoned")
                && l.ends_with(" 5")
        })
    })
    .await;

    let asked = Instant::now();
    let refused = sidecar.post("/v1/locks/one-more").await;
    let took = asked.elapsed();
    assert_eq!(refused.status, 429, "{refused:?}");
    assert!(took < ANSWER_WITHIN, "{took:?}");
    assert!(refused.body.contains("at most 20"), "{refused:?}");
    let dapr = http::request_with_body(
        "POST",
        sidecar.control,
        "/v1.0-alpha1/lock/redlock",
        Some((
            "application/json",
            r#"{"resourceId":"dapr-1","lockOwner":"o","expiryInSeconds":5}"#,
        )),
    )
    .await
    .unwrap();
    assert_eq!(dapr.status, 429, "{dapr:?}");
    eprintln!("past --locks-max-leases 20: 429 in {took:?}");

    // The probes and the leadership lock carry on: same tenure, answers in time.
    for path in ["/healthz", "/leader"] {
        let asked = Instant::now();
        let answer = http::get(sidecar.admin, path).await.unwrap();
        assert_eq!(answer.status, 200, "{path}: {answer:?}");
        assert!(asked.elapsed() < ANSWER_WITHIN, "{path}");
    }
    assert_eq!(sidecar.leadership().await, (true, token));

    // An app that learns how its lease ended frees its place.
    let ended = http::request(
        "DELETE",
        sidecar.control,
        &format!("/v1/locks/gone-0/{}", abandoned[0]),
    )
    .await
    .unwrap();
    assert_eq!(ended.status, 410, "{ended:?}");
    assert_eq!(sidecar.post("/v1/locks/one-more").await.status, 200);
    assert_eq!(sidecar.post("/v1/locks/two-more").await.status, 429);
    // So does a waiting request that goes away.
    drop(waiting.pop());
    support::wait_until_async(DEADLINE, "a waiting place is given back", || async {
        sidecar.post("/v1/locks/two-more").await.status == 200
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_leases_nobody_keeps_alive_never_runs_out_of_descriptors() {
    let cluster = tokio::task::block_in_place(ready_cluster);
    // containerd's default soft limit, as the hard one too: raising it gains nothing.
    let sidecar = Sidecar::start(&cluster, &["--nofile=1024:1024"], &[]).await;
    let (_, token) = sidecar.leadership().await;
    let stop = Instant::now() + Duration::from_secs(6);
    // Eight clients taking distinct names with a ttl of 1s, as fast as they are answered.
    let clients: Vec<_> = (0..8)
        .map(|c| {
            let control = sidecar.control;
            tokio::spawn(async move {
                let (mut granted, mut refused, mut i) = (0usize, 0usize, 0usize);
                while Instant::now() < stop {
                    i += 1;
                    let path = format!("/v1/locks/flood-{c}-{i}?ttl=1s");
                    match http::request("POST", control, &path)
                        .await
                        .map(|r| r.status)
                    {
                        Ok(200) => granted += 1,
                        Ok(429) => refused += 1,
                        other => panic!("{path}: {other:?}"),
                    }
                }
                (granted, refused)
            })
        })
        .collect();
    let mut probes = Vec::new();
    let mut most_fds = 0;
    while Instant::now() < stop {
        let asked = Instant::now();
        let answer = http::get(sidecar.admin, "/healthz").await;
        probes.push((answer.map(|r| r.status), asked.elapsed()));
        most_fds = most_fds.max(sidecar.fds());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (mut granted, mut refused) = (0, 0);
    for client in clients {
        let (g, r) = client.await.unwrap();
        granted += g;
        refused += r;
    }
    let rss = sidecar.rss();
    eprintln!(
        "flood: {granted} granted, {refused} refused (429), at most {most_fds} descriptors, \
         RSS {} KiB, probes {probes:?}",
        rss / 1024
    );
    assert!(
        probes
            .iter()
            .all(|(a, took)| matches!(a, Ok(200)) && *took < ANSWER_WITHIN),
        "{probes:?}"
    );
    // Ended leases are remembered for a minute and count: no more than the bound in this
    // flood of a few seconds.
    assert!(granted <= 1_000, "{granted} granted");
    assert!(most_fds < 200, "{most_fds} descriptors");
    assert!(
        !sidecar.proc.output_text().contains("Too many open files"),
        "{}",
        sidecar.proc.output_text()
    );
    assert_eq!(sidecar.leadership().await, (true, token));
    // The leases ended (after their ttl), and nothing was held on: the holdings are released.
    support::wait_until_async(DEADLINE, "every flooded lease ended", || async {
        let text = http::get(sidecar.admin, "/metrics").await.unwrap().body;
        text.lines()
            .any(|l| l.starts_with("redlock_app_leases{") && l.ends_with(" 0"))
    })
    .await;
    let mut stream = TcpStream::connect(sidecar.control).await.unwrap();
    stream
        .write_all(b"GET /nope HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    assert!(answer.starts_with(b"HTTP/1.1 404"));
}

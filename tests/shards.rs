//! `run --shards N` through the real binary and real redis-servers: members split the shards
//! evenly with no shard in two hands; a member that leaves on SIGTERM hands its shards over
//! at once (well within a ttl, so not by expiry), with higher fencing tokens, once its app
//! acknowledged each revocation; a joiner takes only its share; an app that does not
//! acknowledge keeps its shards until the revoke deadline, not longer; a member whose app is
//! not ready holds nothing; a member started with another count than the group's takes no part
//! and says why until the group's members are gone; bad counts are refused, and so is a Redis
//! Cluster, saying why; no HTTP input panics the routes.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use support::sidecar::Sidecar;
use support::{http, RedisCluster};

const TTL: Duration = Duration::from_secs(2);
const DEADLINE: Duration = Duration::from_secs(30);

/// Shard → fencing token, as `sidecar` answers `GET /v1/shards`.
async fn owned(sidecar: &Sidecar) -> Option<BTreeMap<u64, u64>> {
    let body = http::get(sidecar.control, "/v1/shards")
        .await
        .ok()?
        .json()
        .ok()?;
    let owned = body["owned"].as_array()?;
    Some(
        owned
            .iter()
            .filter_map(|s| Some((s["shard"].as_u64()?, s["fencing_token"].as_u64()?)))
            .collect(),
    )
}

/// Waits until `sidecars` hold `counts` shards each (in order), between them every one of
/// `shards` and none twice; what each holds then.
async fn wait_split(
    sidecars: &[&Sidecar],
    shards: u64,
    counts: &[usize],
) -> Vec<BTreeMap<u64, u64>> {
    wait_split_as(
        sidecars,
        shards,
        |sizes| sizes == counts,
        &format!("{counts:?}"),
    )
    .await
}

/// [`wait_split`] for any counts `fits` accepts (`what` names them).
async fn wait_split_as(
    sidecars: &[&Sidecar],
    shards: u64,
    fits: impl Fn(&[usize]) -> bool,
    what: &str,
) -> Vec<BTreeMap<u64, u64>> {
    let start = Instant::now();
    loop {
        let mut all = Vec::new();
        for sidecar in sidecars {
            all.push(owned(sidecar).await.unwrap_or_default());
        }
        let sizes: Vec<usize> = all.iter().map(BTreeMap::len).collect();
        let mut union: Vec<u64> = all.iter().flat_map(|o| o.keys().copied()).collect();
        union.sort_unstable();
        union.dedup();
        if fits(&sizes) && union.len() as u64 == shards {
            return all;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "not split {what} within {DEADLINE:?}: {all:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An open `/v1/shards/watch` stream: its raw bytes so far.
struct Watch {
    stream: tokio::net::TcpStream,
    raw: Vec<u8>,
}

impl Watch {
    /// Opens `/v1/shards/watch` with `query` (e.g. `?ack=true`).
    async fn open(sidecar: &Sidecar, query: &str) -> Watch {
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(sidecar.control)
            .await
            .unwrap();
        let request = format!(
            "GET /v1/shards/watch{query} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        Watch {
            stream,
            raw: Vec::new(),
        }
    }

    /// The `(event, data)` pairs received so far.
    fn events(&self) -> Vec<(String, serde_json::Value)> {
        let Some(head) = self.raw.windows(4).position(|w| w == b"\r\n\r\n") else {
            return Vec::new();
        };
        let (body, _, _) = support::http::decode_chunks(&self.raw[head + 4..]).unwrap();
        let text = String::from_utf8_lossy(&body).into_owned();
        text.split("\n\n")
            .filter_map(|event| {
                let name = event.lines().find_map(|l| l.strip_prefix("event: "))?;
                let data = event.lines().find_map(|l| l.strip_prefix("data: "))?;
                Some((name.to_owned(), serde_json::from_str(data).ok()?))
            })
            .collect()
    }

    /// Reads until `n` events named `name` came; their data.
    async fn until_named(&mut self, name: &str, n: usize) -> Vec<serde_json::Value> {
        let named = |events: Vec<(String, serde_json::Value)>| -> Vec<serde_json::Value> {
            events
                .into_iter()
                .filter(|(event, _)| event == name)
                .map(|(_, data)| data)
                .collect()
        };
        let start = Instant::now();
        while named(self.events()).len() < n && start.elapsed() < DEADLINE {
            let before = self.raw.len();
            self.until(self.events().len() + 1).await;
            if self.raw.len() == before {
                break;
            }
        }
        named(self.events())
    }

    /// Reads until `n` events came (or the stream ends, or the deadline passes); the events.
    async fn until(&mut self, n: usize) -> Vec<(String, serde_json::Value)> {
        use tokio::io::AsyncReadExt;
        let start = Instant::now();
        while self.events().len() < n && start.elapsed() < DEADLINE {
            let mut buf = [0u8; 4096];
            match tokio::time::timeout(DEADLINE, self.stream.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
                Ok(Ok(read)) => self.raw.extend_from_slice(&buf[..read]),
            }
        }
        self.events()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_split_the_shards_evenly_a_leaver_hands_over_at_once_and_a_joiner_takes_only_its_share(
) {
    let cluster = RedisCluster::ready(3, TTL);
    let extra = ["--shards", "12", "--node-set", support::TEST_NODE_SET];
    let a = Sidecar::start("shard-a", "work", &cluster.urls_joined(), "2s", &extra);
    let b = Sidecar::start("shard-b", "work", &cluster.urls_joined(), "2s", &extra);
    let mut c = Sidecar::start("shard-c", "work", &cluster.urls_joined(), "2s", &extra);
    let before = wait_split(&[&a, &b, &c], 12, &[4, 4, 4]).await;
    assert_eq!(a.metric("redlock_shards_owned", "").await, 4.0);
    assert!(
        a.metric("redlock_shard_moves_total", "kind=\"taken\"")
            .await
            >= 4.0
    );

    let leaving = before[2].clone();
    // The leaver's app hears every shard revoked (after the first event, the whole body), and
    // acknowledges each; a second stream that does not acknowledge only listens.
    let mut watch = Watch::open(&c, "?ack=true").await;
    let mut listener = Watch::open(&c, "").await;
    assert_eq!(listener.until(1).await[0].0, "shards");
    let first = watch.until(1).await;
    assert_eq!(first[0].0, "shards", "{first:?}");
    assert_eq!(first[0].1["owned"].as_array().map(Vec::len), Some(4));
    let sent = Instant::now();
    assert!(c.proc.sigterm());
    // It revokes every shard and waits for its app (which watches), which lets each go.
    let revoking = watch.until_named("revoking", 4).await;
    for data in &revoking {
        let shard = data["shard"].as_u64().unwrap();
        assert_eq!(data["fencing_token"].as_u64(), leaving.get(&shard).copied());
        assert!(data["deadline_ms"].as_u64().unwrap() > 0, "{data}");
        let acked = http::request("POST", c.control, &format!("/v1/shards/{shard}/ack"))
            .await
            .unwrap();
        assert_eq!(acked.status, 200, "{}", acked.body);
    }
    let after = wait_split(&[&a, &b], 12, &[6, 6]).await;
    let handed_over = sent.elapsed();
    assert!(
        handed_over < TTL / 2,
        "the leaver's shards were taken in {handed_over:?}: by expiry, not hand-over"
    );
    assert_eq!(
        c.proc.wait_exit(DEADLINE).map(|s| s.code()),
        Some(Some(0)),
        "the leaver exits cleanly"
    );
    let mut revoked: Vec<u64> = watch
        .until_named("revoked", 4)
        .await
        .iter()
        .map(|data| data["shard"].as_u64().unwrap())
        .collect();
    revoked.sort_unstable();
    assert_eq!(revoked, leaving.keys().copied().collect::<Vec<_>>());
    assert_eq!(listener.until_named("revoked", 4).await.len(), 4);
    assert_eq!(
        listener.until_named("revoking", 4).await.len(),
        4,
        "every revoked follows a revoking"
    );
    for (shard, token) in &leaving {
        let now = after
            .iter()
            .find_map(|o| o.get(shard))
            .expect("every shard held");
        assert!(now > token, "shard {shard}: token {now} after {token}");
    }
    // The members that stayed kept what they had: only the leaver's shards moved.
    for (kept, had) in after.iter().zip(&before) {
        for (shard, token) in had {
            assert_eq!(kept.get(shard), Some(token), "shard {shard} stayed put");
        }
    }

    // A member joins: it takes its share (4) and only from the members above theirs, who
    // take nothing; no other shard moves.
    let d = Sidecar::start("shard-d", "work", &cluster.urls_joined(), "2s", &extra);
    let joined = wait_split(&[&a, &b, &d], 12, &[4, 4, 4]).await;
    for (now, had) in joined.iter().zip(&after) {
        for (shard, token) in now {
            assert_eq!(
                had.get(shard),
                Some(token),
                "shard {shard} was theirs already"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_that_does_not_acknowledge_keeps_its_shards_until_the_revoke_deadline_only() {
    let cluster = RedisCluster::ready(3, TTL);
    let extra = [
        "--shards",
        "4",
        "--node-set",
        support::TEST_NODE_SET,
        "--shard-revoke-timeout",
        "1500ms",
    ];
    let a = Sidecar::start("slow-app", "work", &cluster.urls_joined(), "2s", &extra);
    wait_split(&[&a], 4, &[4]).await;
    let mut watch = Watch::open(&a, "?ack=true").await;
    watch.until(1).await;
    // A joiner: the member revokes its excess (2 shards); the app, which said it acknowledges,
    // says nothing.
    let b = Sidecar::start("joiner", "work", &cluster.urls_joined(), "2s", &extra);
    let revoking = watch.until_named("revoking", 2).await;
    let marked = Instant::now();
    assert_eq!(revoking.len(), 2, "{revoking:?}");
    let deadline = Duration::from_millis(revoking[0]["deadline_ms"].as_u64().unwrap());
    assert!(deadline <= Duration::from_millis(1500), "{deadline:?}");
    // Until the deadline the shards stay the member's (listed, with it), the joiner's not.
    let shard = revoking[0]["shard"].as_u64().unwrap();
    let listed = http::get(a.control, "/v1/shards")
        .await
        .unwrap()
        .json()
        .unwrap();
    let entry = listed["owned"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["shard"].as_u64() == Some(shard))
        .cloned()
        .expect("still listed while being revoked");
    assert!(entry["revoking_deadline_ms"].as_u64().is_some(), "{entry}");
    if marked.elapsed() < deadline / 2 {
        let theirs = owned(&b).await.unwrap_or_default();
        assert!(!theirs.contains_key(&shard), "taken before the deadline");
    }
    // Then it is released, revoked, and the joiner takes it.
    let revoked = watch.until_named("revoked", 2).await;
    assert!(
        marked.elapsed() + Duration::from_millis(50) >= deadline,
        "revoked after {:?}, deadline {deadline:?}",
        marked.elapsed()
    );
    assert_eq!(revoked.len(), 2);
    wait_split(&[&a, &b], 4, &[2, 2]).await;
    // An ack for a shard that is not being revoked, or not held, is refused.
    let mine = owned(&a).await.unwrap();
    let held = mine.keys().next().unwrap();
    let not_revoking = http::request("POST", a.control, &format!("/v1/shards/{held}/ack"))
        .await
        .unwrap();
    assert_eq!(not_revoking.status, 409, "{}", not_revoking.body);
    let theirs = owned(&b).await.unwrap();
    let other = theirs.keys().next().unwrap();
    let not_held = http::request("POST", a.control, &format!("/v1/shards/{other}/ack"))
        .await
        .unwrap();
    assert_eq!(not_held.status, 404);
    assert!(not_held.json().unwrap()["error"].is_string());
    let garbage = http::request("POST", a.control, "/v1/shards/x/ack")
        .await
        .unwrap();
    assert_eq!(garbage.status, 400);
    assert!(garbage.json().unwrap()["error"].is_string());
    let bad_query = http::get(a.control, "/v1/shards/watch?ack=maybe")
        .await
        .unwrap();
    assert_eq!(bad_query.status, 400);

    // Streams that do not acknowledge hold nothing back: a third member's share is released
    // at once, well before the revoke deadline.
    drop(watch);
    let mut listeners = [Watch::open(&a, "").await, Watch::open(&b, "").await];
    for listener in &mut listeners {
        listener.until(1).await;
    }
    let joined = Instant::now();
    let c = Sidecar::start("third", "work", &cluster.urls_joined(), "2s", &extra);
    let within_one = |sizes: &[usize]| {
        let mut sorted = sizes.to_vec();
        sorted.sort_unstable();
        sorted == [1, 1, 2]
    };
    wait_split_as(&[&a, &b, &c], 4, within_one, "1, 1, 2 in any order").await;
    let took = joined.elapsed();
    assert!(
        took < Duration::from_millis(1500),
        "the third member waited {took:?}: a stream that does not acknowledge held it back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_stream_that_acknowledges_closes_the_revoked_shards_go_at_once() {
    let ttl = Duration::from_secs(10);
    let cluster = RedisCluster::ready(3, ttl);
    let extra = [
        "--shards",
        "4",
        "--node-set",
        support::TEST_NODE_SET,
        "--shutdown-timeout",
        "30s",
        "--shard-revoke-timeout",
        "8s",
        "--safety-margin",
        "1s",
    ];
    // A long ttl: the deadline (never past the step-down, at least 4 s away) is seconds off.
    let a = Sidecar::start("closing-app", "work", &cluster.urls_joined(), "10s", &extra);
    wait_split(&[&a], 4, &[4]).await;
    let mut watch = Watch::open(&a, "?ack=true").await;
    watch.until(1).await;
    let b = Sidecar::start("joiner-2", "work", &cluster.urls_joined(), "10s", &extra);
    let revoking = watch.until_named("revoking", 2).await;
    assert_eq!(revoking.len(), 2);
    let deadline = Duration::from_millis(revoking[0]["deadline_ms"].as_u64().unwrap());
    assert!(deadline > Duration::from_secs(3), "{revoking:?}");
    // The app goes away without a word: its acknowledgements will not come.
    let closed = Instant::now();
    drop(watch);
    wait_split(&[&a, &b], 4, &[2, 2]).await;
    let took = closed.elapsed();
    assert!(
        took < deadline / 2,
        "the revoked shards waited {took:?} (deadline {deadline:?}) for a stream that had closed"
    );
}

/// The stated bound of a crash: the dead member's leases and entry run out within a ttl (its
/// entry lives three renew intervals), and the others' next cycle follows within a renew
/// interval; the rest is the acquisition round and this machine's slack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_members_shards_are_owned_elsewhere_within_a_ttl_and_a_renew_interval() {
    let cluster = RedisCluster::ready(3, TTL);
    let extra = ["--shards", "4", "--node-set", support::TEST_NODE_SET];
    let a = Sidecar::start("survivor", "work", &cluster.urls_joined(), "2s", &extra);
    let mut b = Sidecar::start("crashes", "work", &cluster.urls_joined(), "2s", &extra);
    let before = wait_split(&[&a, &b], 4, &[2, 2]).await;
    let crashed = Instant::now();
    assert!(b.proc.sigkill());
    let after = wait_split(&[&a], 4, &[4]).await;
    let took = crashed.elapsed();
    let bound = TTL + TTL / 3 + Duration::from_millis(1500);
    println!("a crashed member's shards owned again after {took:?} (bound {bound:?})");
    assert!(took < bound, "owned again after {took:?}, bound {bound:?}");
    for (shard, token) in &before[1] {
        assert!(
            after[0][shard] > *token,
            "shard {shard}: fenced above the dead owner"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_app_is_not_ready_holds_no_shard_while_ready_ones_exist() {
    let cluster = RedisCluster::ready(3, TTL);
    let extra = ["--shards", "6", "--node-set", support::TEST_NODE_SET];
    let dead_app = format!("http://127.0.0.1:{}/ready", support::free_port());
    let mut unready_extra = extra.to_vec();
    unready_extra.extend(["--app-ready", &dead_app, "--app-ready-interval", "100ms"]);
    let unready = Sidecar::start(
        "unready",
        "work",
        &cluster.urls_joined(),
        "2s",
        &unready_extra,
    );
    let a = Sidecar::start("ready-a", "work", &cluster.urls_joined(), "2s", &extra);
    let b = Sidecar::start("ready-b", "work", &cluster.urls_joined(), "2s", &extra);
    wait_split(&[&a, &b, &unready], 6, &[3, 3, 0]).await;
    let body = http::get(unready.control, "/v1/shards")
        .await
        .unwrap()
        .json()
        .unwrap();
    let members = body["members"].as_array().unwrap();
    assert_eq!(members.len(), 3, "{body}");
    assert!(
        members
            .iter()
            .any(|m| m["identity"] == "unready" && m["ready"] == false),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_paused_past_its_leases_loses_its_shards_and_never_claims_them_after() {
    let cluster = RedisCluster::ready(3, TTL);
    let extra = ["--shards", "4", "--node-set", support::TEST_NODE_SET];
    let mut a = Sidecar::start("paused", "work", &cluster.urls_joined(), "2s", &extra);
    let b = Sidecar::start("awake", "work", &cluster.urls_joined(), "2s", &extra);
    let before = wait_split(&[&a, &b], 4, &[2, 2]).await;
    assert!(a.proc.sigstop());
    // Its entry and its leases expire: the other member takes every shard, fenced higher.
    let alone = wait_split(&[&b], 4, &[4]).await;
    for (shard, token) in &before[0] {
        assert!(
            alone[0][shard] > *token,
            "shard {shard}: fenced above the paused owner"
        );
    }
    assert!(a.proc.sigcont());
    // Woken, it answers from the clock before its loop runs: none of those shards is its.
    let claimed = owned(&a).await.expect("answers");
    assert!(
        claimed.keys().all(|shard| !alone[0].contains_key(shard)),
        "the woken member claims {claimed:?}, held by the other: {alone:?}"
    );
    wait_split(&[&a, &b], 4, &[2, 2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_of_another_count_takes_no_part_says_why_and_takes_over_once_alone() {
    let cluster = RedisCluster::ready(3, TTL);
    let urls = cluster.urls_joined();
    let four = ["--shards", "4", "--node-set", support::TEST_NODE_SET];
    let eight = ["--shards", "8", "--node-set", support::TEST_NODE_SET];
    let mut old = Sidecar::start("count-old", "work", &urls, "2s", &four);
    wait_split(&[&old], 4, &[4]).await;
    let new = Sidecar::start("count-new", "work", &urls, "2s", &eight);
    let start = Instant::now();
    let refused = loop {
        let body = http::get(new.control, "/v1/shards")
            .await
            .ok()
            .and_then(|r| r.json().ok());
        if let Some(why) = body.and_then(|b| b["refused"].as_str().map(str::to_owned)) {
            break why;
        }
        assert!(start.elapsed() < DEADLINE, "no refusal within {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(refused.contains("splits 4 shards"), "{refused}");
    assert!(refused.contains("--shards 8"), "{refused}");
    // The group's split stands: the old member keeps all four, the new one holds none.
    wait_split(&[&old, &new], 4, &[4, 0]).await;
    // Once the last member of the old count is gone, the new count is the group's.
    assert!(old.proc.sigterm());
    wait_split(&[&new], 8, &[8]).await;
}

#[test]
fn a_shard_count_of_zero_or_past_the_limit_is_refused() {
    for count in ["0", "16385", "-1", "many"] {
        let flag = format!("--shards={count}");
        let args = [
            "run",
            "--lock",
            "work",
            "--redis",
            "redis://127.0.0.1:1",
            &flag,
        ];
        support::process::assert_invalid_config(&args, "--shards");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_on_a_redis_cluster_refuses_shards_and_says_why_while_it_still_leads() {
    let cluster = tokio::task::block_in_place(|| support::cluster_mode::ClusterMode::start(3, 0));
    let url = cluster.masters[0].url();
    let a = Sidecar::start("on-cluster", "work", &url, "2s", &["--shards", "4"]);
    let start = Instant::now();
    let body = loop {
        let body = http::get(a.control, "/v1/shards")
            .await
            .ok()
            .and_then(|r| r.json().ok());
        if let Some(body) = body.filter(|b| b["refused"].is_string()) {
            break body;
        }
        assert!(start.elapsed() < DEADLINE, "no refusal within {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let refused = body["refused"].as_str().unwrap();
    assert!(refused.contains("cluster mode"), "{refused}");
    assert_eq!(body["owned"].as_array().map(Vec::len), Some(0));
    // The lock itself (one slot) still works: the member leads.
    support::sidecar::leads(&[&a], 0, DEADLINE).await;
}

mod no_input_panics {
    use super::*;
    use proptest::prelude::*;
    use redlock_sidecar::clock::Deadline;
    use redlock_sidecar::shards::{self, api, Owned};

    fn segment() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("0".to_owned()),
            Just("1".to_owned()),
            Just("4294967296".to_owned()),
            Just("-1".to_owned()),
            Just("%FF".to_owned()),
            Just("ack".to_owned()),
            "[a-z0-9%._-]{0,24}",
            "\\PC{0,12}".prop_map(|s| s.replace(['/', '?', '#', ' '], "")),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        #[test]
        fn no_http_input_panics_the_shard_routes(
            method in prop::sample::select(vec!["GET", "POST", "DELETE", "PUT"]),
            segments in prop::collection::vec(segment(), 0..4),
        ) {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async {
                let (tx, rx) = shards::channel(4);
                let soon = Deadline::now() + Duration::from_secs(5);
                tx.send_modify(|s| {
                    s.owned.insert(0, Owned { token: 7, step_down_at: soon, revoke_by: None });
                    s.owned.insert(1, Owned { token: 8, step_down_at: soon, revoke_by: Some(soon) });
                });
                let routes = api::router(rx, "me".to_owned(), api::AppSide::new());
                let (_leadership_tx, leadership) = tokio::sync::watch::channel(
                    redlock_sidecar::leadership::Leadership::new("work", "me"),
                );
                let (candidacy, _candidacy_rx) = tokio::sync::watch::channel(
                    redlock_sidecar::candidacy::Candidacy::unchecked(),
                );
                let router = redlock_sidecar::http::control_router(
                    redlock_sidecar::http::ControlState {
                        leadership,
                        candidacy,
                        default_hold: Duration::from_secs(2),
                    },
                    Some(routes),
                );
                let path = format!("/v1/shards/{}", segments.join("/"));
                let Ok(uri) = path.parse::<::http::Uri>() else { return };
                if uri.path().ends_with("/watch") && method == "GET" {
                    return; // A stream: it does not end.
                }
                let (status, text) = http::oneshot(&router, method, &uri.to_string(), "").await;
                assert!((200..600).contains(&status));
                if status >= 400 {
                    assert!(
                        serde_json::from_str::<serde_json::Value>(&text).is_ok_and(|v| v.is_object()),
                        "{method} {uri}: {status} {text}"
                    );
                }
                // Only a shard being revoked is acknowledged.
                if method == "POST" && uri.path() == "/v1/shards/1/ack" {
                    assert_eq!(status, 200, "{text}");
                }
                if method == "POST" && uri.path() == "/v1/shards/0/ack" {
                    assert_eq!(status, 409, "{text}");
                }
            });
        }
    }
}

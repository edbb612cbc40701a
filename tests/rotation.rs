//! Credentials rotate without a restart: a `run` sidecar on three TLS nodes that authenticate
//! clients and require a password. The password and the client certificate (from a new CA)
//! are rotated in their files, the nodes accept only the new ones, and every client connection
//! is dropped: the sidecar's next connections read the files again, and the lock keeps its
//! quorum.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use support::tls::{client_cert, make_ca, make_certs, tls_node_with};
use support::{http, Proc, RedisNode, TempDir};

/// Writes `contents` to `path` the way a Secret volume updates: a new file renamed over it.
fn replace(path: &Path, contents: &[u8]) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, contents).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

/// The value of the first sample of `family` whose labels contain `label`.
fn sample(metrics: &str, family: &str, label: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(family) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The credentials' fingerprint the sidecar reports (`redlock_credentials_info`), if any.
fn fingerprint(metrics: &str) -> Option<String> {
    let line = metrics
        .lines()
        .find(|l| l.starts_with("redlock_credentials_info{"))?;
    let at = line.find("fingerprint=\"")? + "fingerprint=\"".len();
    Some(line[at..].split('"').next()?.to_owned())
}

async fn metrics(addr: SocketAddr) -> String {
    http::get(addr, "/metrics")
        .await
        .map(|r| r.body)
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_client_certificate_and_password_are_used_by_the_next_connections() {
    let dir = TempDir::new("rotation");
    make_certs(&dir);
    make_ca(&dir, "ca2");
    client_cert(&dir, "ca2", "client2");
    let path = |f: &str| dir.path().join(f);
    let secret = TempDir::new("secret");
    let file = |f: &str| secret.path().join(f);
    replace(&file("password"), b"first-secret\n");
    replace(
        &file("tls.crt"),
        &std::fs::read(path("client.crt")).unwrap(),
    );
    replace(
        &file("tls.key"),
        &std::fs::read(path("client.key")).unwrap(),
    );
    let mut nodes: Vec<(RedisNode, String)> = (0..3)
        .map(|_| tls_node_with(&dir, "yes", &["--requirepass", "first-secret"]))
        .collect();
    for (node, _) in &nodes {
        node.backdate_epoch(redlock_sidecar::redlock::votes::required_data_age(
            Duration::from_secs(3),
        ));
    }
    let urls: Vec<&str> = nodes.iter().map(|(_, url)| url.as_str()).collect();
    let redis = urls.join(",");
    let addr: SocketAddr = format!("127.0.0.1:{}", support::free_port())
        .parse()
        .unwrap();
    let listen = addr.to_string();
    let ca = path("ca.crt").display().to_string();
    let (cert, key, password) = (
        file("tls.crt").display().to_string(),
        file("tls.key").display().to_string(),
        file("password").display().to_string(),
    );
    let mut sidecar = Proc::spawn(
        &[
            "run",
            "--lock",
            "rotation",
            "--redis",
            &redis,
            "--ttl",
            "3s",
            "--renew-interval",
            "500ms",
            "--safety-margin",
            "500ms",
            "--node-timeout",
            "250ms",
            "--redis-ca-file",
            &ca,
            "--redis-client-cert",
            &cert,
            "--redis-client-key",
            &key,
            "--redis-password-file",
            &password,
            "--listen",
            &listen,
            "--kubernetes",
            "off",
        ],
        &[],
    );
    let leader = || async {
        http::get(addr, "/leader")
            .await
            .is_ok_and(|r| r.status == 200)
    };
    support::wait_until_async(Duration::from_secs(20), "the sidecar leads", leader).await;
    let token = http::get(addr, "/leader").await.unwrap().json().unwrap()["fencing_token"].clone();
    // Which password the pod uses is visible, the password is not.
    support::wait_until_async(
        Duration::from_secs(10),
        "a credentials fingerprint",
        || async { fingerprint(&metrics(addr).await).is_some() },
    )
    .await;
    let first = fingerprint(&metrics(addr).await).unwrap_or_default();
    assert_eq!(first.len(), 16, "{first}");

    // Rotation: new files; the nodes accept only the new password and the new CA's clients.
    replace(&file("password"), b"second-secret\n");
    replace(
        &file("tls.crt"),
        &std::fs::read(path("client2.crt")).unwrap(),
    );
    replace(
        &file("tls.key"),
        &std::fs::read(path("client2.key")).unwrap(),
    );
    let ca2 = path("ca2.crt").display().to_string();
    for (node, _) in &mut nodes {
        assert_eq!(
            node.command(&["CONFIG", "SET", "requirepass", "second-secret"]),
            "OK"
        );
        node.set_auth(None, "second-secret");
        assert_eq!(
            node.command(&["CONFIG", "SET", "tls-ca-cert-file", &ca2]),
            "OK"
        );
    }
    // Every connection drops (a network blip, a proxy restart): the next ones need the new
    // credentials.
    let before = sample(
        &metrics(addr).await,
        "redlock_renewals_total",
        "result=\"ok\"",
    );
    for (node, _) in &nodes {
        node.command(&["CLIENT", "KILL", "TYPE", "normal"]);
    }
    support::wait_until_async(
        Duration::from_secs(20),
        "four renewals on new connections",
        || async {
            sample(
                &metrics(addr).await,
                "redlock_renewals_total",
                "result=\"ok\"",
            ) >= before + 4.0
        },
    )
    .await;
    support::wait_until_async(
        Duration::from_secs(15),
        "the fingerprint follows the rotated file",
        || async { fingerprint(&metrics(addr).await).is_some_and(|now| now != first) },
    )
    .await;
    let text = metrics(addr).await;
    assert!(
        !text.contains("first-secret") && !text.contains("second-secret"),
        "no secret in the metrics"
    );
    assert_eq!(
        sample(&text, "redlock_lock_lost_total", "reason="),
        0.0,
        "the lock kept its quorum through the rotation:\n{}",
        sidecar.output_text()
    );
    let now = http::get(addr, "/leader").await.unwrap();
    assert_eq!(now.status, 200, "still leading");
    assert_eq!(
        now.json().unwrap()["fencing_token"],
        token,
        "the same tenure"
    );
    for (node, _) in &nodes {
        let clients = node.command(&["CLIENT", "LIST"]);
        assert!(
            clients.lines().any(|l| !l.contains("cmd=client|list")),
            "the sidecar is connected again: {clients}"
        );
    }
    sidecar.sigterm();
    let status = sidecar.wait_exit_async(Duration::from_secs(10)).await;
    assert_eq!(status.and_then(|s| s.code()), Some(0));
    let log = sidecar.output_text();
    assert!(
        !log.contains("first-secret") && !log.contains("second-secret"),
        "{log}"
    );
}

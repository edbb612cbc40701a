//! The operator commands (`check`, `status`, `install`) and TLS, through the real binary.

mod support;

use std::process::Command;
use std::time::Duration;

use support::{free_port, Proc, RedisCluster, RedisNode, TempDir};

fn run(args: &[&str]) -> (i32, String, String) {
    let mut proc = Proc::spawn(args, &[]);
    let status = proc.wait_exit(Duration::from_secs(20)).expect("exits");
    (
        status.code().unwrap_or(-1),
        proc.stdout_text(),
        proc.stderr_text(),
    )
}

#[test]
fn check_prints_every_node_and_fails_without_a_quorum() {
    let mut cluster = RedisCluster::start(3);
    cluster
        .node(0)
        .command(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]);
    let redis = cluster.urls_joined();
    let (code, out, err) = run(&["check", "--redis", &redis]);
    assert_eq!(code, 0, "{out}{err}");
    for port in cluster.ports() {
        assert!(
            out.contains(&format!("127.0.0.1:{port}")),
            "lists node {port}:\n{out}"
        );
    }
    assert!(
        out.contains("7.0") || out.contains("7."),
        "shows the version:\n{out}"
    );
    assert!(
        out.contains("allkeys-lru can evict lock keys"),
        "warns about eviction:\n{out}"
    );
    assert!(out.contains("3 of 3 nodes reachable"), "{out}");
    cluster.node_mut(1).stop();
    cluster.node_mut(2).stop();
    let (code, out, _) = run(&["check", "--redis", &redis]);
    assert_eq!(code, 69, "{out}");
    assert!(out.contains("NO QUORUM"), "{out}");
}

#[test]
fn status_shows_holder_ttl_and_fencing_counter_without_the_password() {
    let node = RedisNode::start_with(&["--requirepass", "pa55word"]);
    node.command(&["SET", "redlock:{jobs}", "worker-7:abcdef", "PX", "60000"]);
    node.command(&["SET", "redlock:{jobs}:fence", "42"]);
    let url = format!("redis://:pa55word@127.0.0.1:{}", node.port());
    let (code, out, err) = run(&["status", "--lock", "jobs", "--redis", &url]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("worker-7"), "holder:\n{out}");
    assert!(out.contains("42"), "fencing counter:\n{out}");
    assert!(out.contains("held by worker-7"), "quorum view:\n{out}");
    assert!(
        !out.contains("pa55word") && !err.contains("pa55word"),
        "no password:\n{out}{err}"
    );
}

/// A CA and a server certificate for 127.0.0.1, made with the openssl command.
fn make_certs(dir: &TempDir) {
    let sh = |script: &str| {
        let status = Command::new("sh")
            .arg("-c")
            .arg(script)
            .current_dir(dir.path())
            .output()
            .expect("sh runs");
        assert!(
            status.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&status.stderr)
        );
    };
    sh("openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 1 -subj /CN=redlock-test-ca");
    sh("openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=127.0.0.1");
    sh("printf 'subjectAltName=IP:127.0.0.1\\n' > san.ext && openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.crt -days 1 -extfile san.ext");
}

#[test]
fn tls_nodes_are_reached_with_a_private_ca_and_refused_without_it() {
    let dir = TempDir::new("tls");
    make_certs(&dir);
    let tls_port = free_port().to_string();
    let path = |f: &str| dir.path().join(f).display().to_string();
    let node = RedisNode::start_with(&[
        "--tls-port",
        &tls_port,
        "--tls-cert-file",
        &path("server.crt"),
        "--tls-key-file",
        &path("server.key"),
        "--tls-ca-cert-file",
        &path("ca.crt"),
        "--tls-auth-clients",
        "no",
    ]);
    let url = format!("rediss://127.0.0.1:{tls_port}");
    let (code, out, err) = run(&["check", "--redis", &url, "--redis-ca-file", &path("ca.crt")]);
    assert_eq!(code, 0, "reached over TLS with the CA:\n{out}{err}");
    assert!(out.contains("1 of 1 nodes reachable"), "{out}");
    let (code, out, _) = run(&["check", "--redis", &url]);
    assert_eq!(code, 69, "an unknown issuer is refused:\n{out}");
    drop(node);
}

#[test]
fn install_copies_a_runnable_binary_and_refuses_a_missing_directory() {
    let dir = TempDir::new("install");
    let (code, out, err) = run(&["install", dir.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    let copy = dir.path().join("redlock-sidecar");
    assert!(out.contains(copy.to_str().unwrap()), "{out}");
    let version = Command::new(&copy)
        .arg("--version")
        .output()
        .expect("the copy runs");
    assert!(version.status.success());
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        format!("redlock-sidecar {}", env!("CARGO_PKG_VERSION"))
    );
    // Installing again replaces the copy in place.
    assert_eq!(run(&["install", dir.path().to_str().unwrap()]).0, 0);
    let entries = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(entries, 1, "no partial file left behind");

    let missing = dir.path().join("missing");
    support::process::assert_invalid_config(&["install", missing.to_str().unwrap()], "DIR");
}

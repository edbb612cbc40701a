//! The operator commands (`check`, `status`, `install`) and TLS, through the real binary.

mod support;

use std::process::Command;
use std::time::Duration;

use support::tls::{make_certs, tls_node};
use support::{Proc, RedisCluster, RedisNode, TempDir};

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

#[test]
fn the_password_can_come_from_a_file_and_is_never_shown() {
    let node = RedisNode::start_with(&["--requirepass", "pa55word"]);
    let dir = TempDir::new("password-file");
    let file = dir.path().join("password");
    std::fs::write(&file, "pa55word\n").unwrap();
    let url = format!("redis://127.0.0.1:{}", node.port());
    let file = file.to_str().unwrap();
    let (code, out, err) = run(&["check", "--redis", &url, "--redis-password-file", file]);
    assert_eq!(
        code, 0,
        "authenticated with the file's password:\n{out}{err}"
    );
    assert!(out.contains("1 of 1 nodes reachable"), "{out}");
    assert!(!out.contains("pa55word") && !err.contains("pa55word"));

    std::fs::write(file, "wrong\n").unwrap();
    let (code, out, _) = run(&["check", "--redis", &url, "--redis-password-file", file]);
    assert_eq!(code, 69, "a wrong password is refused:\n{out}");
    let missing = dir.path().join("missing");
    support::process::assert_invalid_config(
        &[
            "check",
            "--redis",
            &url,
            "--redis-password-file",
            missing.to_str().unwrap(),
        ],
        "--redis-password-file",
    );
}

#[test]
fn tls_nodes_are_reached_with_a_private_ca_and_refused_without_it() {
    let dir = TempDir::new("tls");
    make_certs(&dir);
    let (node, url) = tls_node(&dir, "no");
    let path = |f: &str| dir.path().join(f).display().to_string();
    let (code, out, err) = run(&["check", "--redis", &url, "--redis-ca-file", &path("ca.crt")]);
    assert_eq!(code, 0, "reached over TLS with the CA:\n{out}{err}");
    assert!(out.contains("1 of 1 nodes reachable"), "{out}");
    let (code, out, _) = run(&["check", "--redis", &url]);
    assert_eq!(code, 69, "an unknown issuer is refused:\n{out}");
    drop(node);
}

#[test]
fn nodes_that_authenticate_clients_are_reached_with_a_client_certificate_only() {
    let dir = TempDir::new("mtls");
    make_certs(&dir);
    let (node, url) = tls_node(&dir, "yes");
    let path = |f: &str| dir.path().join(f).display().to_string();
    let ca = ["--redis-ca-file".to_string(), path("ca.crt")];
    let with_ca = |extra: &[String]| {
        let mut args = vec!["check".to_string(), "--redis".to_string(), url.clone()];
        args.extend(ca.iter().cloned());
        args.extend(extra.iter().cloned());
        run(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let (code, out, err) = with_ca(&[]);
    assert_eq!(code, 69, "no client certificate, refused:\n{out}{err}");
    let client = [
        "--redis-client-cert".to_string(),
        path("client.crt"),
        "--redis-client-key".to_string(),
        path("client.key"),
    ];
    let (code, out, err) = with_ca(&client);
    assert_eq!(code, 0, "reached with the client certificate:\n{out}{err}");
    assert!(out.contains("1 of 1 nodes reachable"), "{out}");
    let key = std::fs::read_to_string(path("client.key")).unwrap();
    let secret_line = key.lines().nth(1).unwrap();
    assert!(!out.contains(secret_line) && !err.contains(secret_line));
    drop(node);

    // A certificate without its key, or a key that is not PEM, is a configuration error.
    support::process::assert_invalid_config(
        &[
            "check",
            "--redis",
            &url,
            "--redis-client-cert",
            &path("client.crt"),
        ],
        "--redis-client-key",
    );
    support::process::assert_invalid_config(
        &[
            "check",
            "--redis",
            &url,
            "--redis-client-cert",
            &path("client.crt"),
            "--redis-client-key",
            &path("san.ext"),
        ],
        "--redis-client-cert",
    );
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

//! The operator commands (`check`, `status`, `install`) and TLS, through the real binary.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

mod support;

use std::process::Command;
use std::time::Duration;

use redlock_sidecar::redlock::votes;
use support::tls::{make_certs, tls_node};
use support::{free_port, FaultProxy, Proc, RedisCluster, RedisNode, TempDir};

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
    assert!(
        out.contains("verdict: safe; survives no node loss; not yet"),
        "two fresh nodes can vote, the evicting one never:\n{out}"
    );
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

/// The lines `check` prints under `node`'s row: its kind, vote and warnings.
fn check_details<'a>(out: &'a str, label: &str) -> Vec<&'a str> {
    out.lines()
        .skip_while(|l| !l.starts_with(label))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .collect()
}

/// The verdict line of a `check` output.
fn verdict(out: &str) -> &str {
    out.lines()
        .find_map(|l| l.strip_prefix("verdict: "))
        .unwrap_or_else(|| panic!("a verdict line:\n{out}"))
}

#[test]
fn check_says_why_an_acl_user_that_may_not_run_scripts_gets_no_vote() {
    let mut node = RedisNode::start_with_config(
        "user default on nopass ~* &* +@all\n\
         user noscript on >pw ~* &* +@all -@scripting\n\
         user nochannel on >pw ~* resetchannels +@all\n\
         user nolockkeys on >pw ~app:* &* +@all\n",
    );
    // Long enough a data age that only the ACL can stop these votes.
    node.backdate_epoch(Duration::from_secs(3600));
    let port = node.port();
    let url = |user: &str| format!("redis://{user}:pw@127.0.0.1:{port}");
    let redis = [url("noscript"), url("nochannel"), url("nolockkeys")];
    // One server under three users, checked one at a time.
    for (user, redis) in ["noscript", "nochannel", "nolockkeys"].iter().zip(&redis) {
        let (code, out, err) = run(&["check", "--redis", redis, "--ttl", "2s"]);
        let details = check_details(&out, &format!("127.0.0.1:{port}")).join("\n");
        match *user {
            "noscript" => {
                assert_eq!(code, 69, "{out}{err}");
                assert!(
                    details.contains("vote does not count: the ACL user may not run")
                        && details.contains("evalsha"),
                    "names the refused command:\n{out}"
                );
                assert!(verdict(&out).starts_with("unavailable"), "{out}");
            }
            "nochannel" => {
                assert_eq!(code, 0, "{out}{err}");
                assert!(!details.contains("vote does not count"), "{out}");
                assert!(
                    details.contains("may not run publish redlock:{check}:released"),
                    "warns that releases wake nobody:\n{out}"
                );
            }
            _ => {
                assert!(
                    details.contains("vote does not count")
                        && details.contains("no permissions to access one of the keys"),
                    "a user without the lock's keys:\n{out}"
                );
            }
        }
        assert!(!out.contains(":pw@") && !err.contains(":pw@"), "{out}{err}");
    }

    // The same words at a sidecar's startup.
    let listen = format!("127.0.0.1:{}", free_port());
    let mut sidecar = Proc::spawn(
        &[
            "run",
            "--lock",
            "acl",
            "--redis",
            &redis[0],
            "--ttl",
            "2s",
            "--listen",
            &listen,
            "--kubernetes",
            "off",
        ],
        &[],
    );
    sidecar.wait_for_output("vote does not count", Duration::from_secs(10));
    let log = sidecar.stderr_text();
    assert!(log.contains("evalsha"), "{log}");
    node.stop();
}

/// `check` on real servers of every kind it tells apart, through the binary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_gives_each_kind_of_node_a_verdict_and_the_set_one() {
    use tokio::task::block_in_place;
    // A master whose CONFIG is renamed away, as managed services do: check never needs it.
    let independent = RedisNode::start_with(&["--rename-command", "CONFIG", ""]);
    assert!(independent
        .command(&["CONFIG", "GET", "save"])
        .starts_with("(error)"));
    let primary = RedisNode::start();
    let replica = RedisNode::start_replica();
    block_in_place(|| replica.replicate(primary.addr()));
    for node in [&independent, &primary] {
        node.backdate_epoch(Duration::from_secs(3600));
    }
    // The independent master is reached through a proxy: another port than it reports.
    let proxy = FaultProxy::start(independent.addr()).await;
    let redis = [proxy.url(), primary.url(), replica.url()].join(",");
    let check = || block_in_place(|| run(&["check", "--redis", &redis, "--ttl", "2s"]));

    let (code, out, err) = check();
    assert_eq!(code, 0, "{out}{err}");
    let proxied = check_details(&out, &proxy.addr().to_string()).join("\n");
    assert!(proxied.contains("independent master"), "{out}");
    assert!(
        proxied.contains(&format!("reports tcp_port {}", independent.port())),
        "the proxy in between is seen:\n{out}"
    );
    let primary_lines = check_details(&out, &format!("127.0.0.1:{}", primary.port())).join("\n");
    let abstain = format!(
        "~{:.1} s (ttl + drift)",
        votes::required_data_age(Duration::from_secs(2)).as_secs_f64()
    );
    assert!(
        primary_lines.contains(&format!(
            "primary with 1 replica: after a failover the new primary abstains for {abstain}"
        )),
        "{out}"
    );
    assert!(primary_lines.contains("min-replicas-to-write 0"), "{out}");
    let replica_lines = check_details(&out, &format!("127.0.0.1:{}", replica.port())).join("\n");
    assert!(
        replica_lines.contains(&format!("a replica of 127.0.0.1:{}", primary.port()))
            && replica_lines.contains("vote does not count"),
        "{out}"
    );
    assert!(
        verdict(&out).starts_with(&format!(
            "unsafe because 127.0.0.1:{}: under a network partition",
            primary.port()
        )),
        "{out}"
    );
    assert!(
        out.contains("none seen"),
        "persistence from INFO, without CONFIG:\n{out}"
    );

    // With min-replicas-to-write the primary is safe; two voters of three, one that can fail over.
    primary.command(&["CONFIG", "SET", "min-replicas-to-write", "1"]);
    let (_, out, _) = check();
    assert_eq!(
        verdict(&out),
        format!(
            "safe; survives no node loss; one failover makes the lock unavailable for {abstain}"
        ),
        "{out}"
    );
    drop(proxy);
}

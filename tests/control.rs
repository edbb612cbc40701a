//! The control listener takes requests from this pod's processes only, and its answers tell
//! the truth; `run` raises its open-files limit; the start-up checks of `--control-listen` and
//! `--slot-retention`. Through the real binary, on real redis-server nodes where a leader or a
//! lock is needed.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use support::http;

/// Longest wait for anything these tests expect to happen.
const DEADLINE: Duration = Duration::from_secs(30);

/// A `run` sidecar on a closed Redis port (no quorum: it serves, leads nothing).
fn sidecar_without_redis(
    program: &Path,
    args: &[&str],
    extra: &[&str],
) -> (support::Proc, SocketAddr) {
    let admin = support::sidecar::loopback();
    let listen = admin.to_string();
    let mut all: Vec<&str> = args.to_vec();
    all.extend([
        "run",
        "--lock",
        "limits",
        "--redis",
        "redis://127.0.0.1:1",
        "--listen",
        &listen,
        "--kubernetes",
        "off",
    ]);
    all.extend_from_slice(extra);
    (support::Proc::spawn_program(program, &all, &[]), admin)
}

async fn wait_serving(addr: SocketAddr, path: &str, status: u16) {
    support::wait_until_async(DEADLINE, "the listener serves", || async {
        http::get(addr, path)
            .await
            .is_ok_and(|r| r.status == status)
    })
    .await;
}

/// `Max open files` of `pid`: (soft, hard).
fn open_files_limit(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a Max open files line")
        .to_owned();
    let fields: Vec<&str> = line.split_whitespace().collect();
    (fields[3].to_owned(), fields[4].to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_raises_its_soft_open_files_limit_to_the_hard_limit_and_says_nothing() {
    // The limits containerd gives a container by default, or lower ones where the test's own
    // hard limit is lower.
    let mut own = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid rlimit for getrlimit to fill.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut own) }, 0);
    let hard = own.rlim_max.min(4096);
    let soft = (hard / 4).min(1024);
    let nofile = format!("--nofile={soft}:{hard}");
    let prlimit = Path::new("/usr/bin/prlimit");
    assert!(prlimit.exists(), "prlimit (util-linux) is needed");
    let bin = support::bin();
    let bin = bin.to_str().unwrap();
    let (proc, admin) = sidecar_without_redis(prlimit, &[&nofile, bin], &[]);
    wait_serving(admin, "/healthz", 200).await;
    assert_eq!(
        open_files_limit(proc.pid()),
        (hard.to_string(), hard.to_string()),
        "{}",
        proc.output_text()
    );
    assert!(
        !proc.output_text().contains("open files"),
        "nothing said on success: {}",
        proc.output_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv4_mapped_loopback_control_address_is_loopback() {
    let port = support::free_port();
    let mapped = format!("[::ffff:127.0.0.1]:{port}");
    let (proc, admin) = sidecar_without_redis(&support::bin(), &[], &["--control-listen", &mapped]);
    wait_serving(admin, "/healthz", 200).await;
    // Served on 127.0.0.1, where IPv4 clients and mapped IPv6 ones both arrive.
    let control = SocketAddr::from(([127, 0, 0, 1], port));
    wait_serving(control, "/nope", 404).await;
    let answer = http::request("POST", control, "/v1/leader/resign")
        .await
        .unwrap();
    assert_eq!(answer.status, 409, "{answer:?}: {}", proc.output_text());
}

#[test]
fn a_slot_retention_shorter_than_the_tenure_exits_2_naming_the_flag_and_the_bound() {
    let base = [
        "guard",
        "--lock",
        "x",
        "--redis",
        "redis://127.0.0.1:1",
        "--slot",
        "s",
    ];
    for (extra, bound) in [
        (&["--slot-retention", "1ms"][..], "10s"),
        (&["--slot-retention", "9s"][..], "10s"),
        (&["--ttl", "2s", "--slot-retention", "1s"][..], "2s"),
        (
            &["--min-hold", "1m", "--slot-retention", "1m"][..],
            "1m 10s",
        ),
    ] {
        let args = [&base[..], extra, &["--", "true"]].concat();
        let line = support::process::assert_invalid_config(&args, "--slot-retention");
        assert!(
            line.contains("at least") && line.contains(&format!("({bound})")),
            "{extra:?}: {line}"
        );
    }
}

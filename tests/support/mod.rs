//! Shared support for the integration tests: real `redis-server` children ([`RedisNode`],
//! [`RedisCluster`]), a fault-injecting TCP proxy ([`FaultProxy`]), a minimal HTTP/1.1 and
//! server-sent-events client ([`http`]) and helpers to run the real binary ([`Proc`]).
//!
//! Every test binary uses only part of this, hence the blanket `dead_code` allowance.
#![allow(dead_code)]

pub mod checker;
pub mod cluster_mode;
pub mod failover;
pub mod fenced;
pub mod http;
pub mod process;
pub mod proxy;
pub mod redis;
pub mod sentinel;
pub mod sidecar;
pub mod tenures;
pub mod tls;

use std::future::Future;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

// Re-exports for the test binaries; each uses only some of them.
#[allow(unused_imports)]
pub use self::http::Response;
#[allow(unused_imports)]
pub use self::process::{bin, Proc};
#[allow(unused_imports)]
pub use self::proxy::{FaultProxy, KeepingProxy};
#[allow(unused_imports)]
pub use self::redis::{
    command_at, command_at_async, command_at_timeout, RawConn, RedisCluster, RedisNode, Resp,
};
#[allow(unused_imports)]
pub use self::sidecar::{leads, one_leader, Sidecar};

/// The node-set name every contender the tests start uses (`--node-set`), so that tests of
/// other behaviour do not depend on the node set (after a restart, contenders that have not
/// reconnected yet name the server by its old run id for a round). The node-set tests remove
/// it (`tests/dataloss.rs`, `tests/votes.rs`).
pub const TEST_NODE_SET: &str = "test-nodes";

/// An engine config for library contenders on `urls`: the given lock, identity and ttl, a
/// node timeout of 100 ms and quick retries (10 ms growing to 50 ms).
pub fn engine_config(
    urls: &[String],
    lock: &str,
    identity: &str,
    ttl: Duration,
) -> redlock_sidecar::redlock::RedlockConfig {
    use redlock_sidecar::redlock::{Credentials, NodeSpec, RedlockConfig};
    let nodes = urls
        .iter()
        .enumerate()
        .map(|(i, url)| NodeSpec::parse(i, url, &Credentials::default()).expect("valid url"))
        .collect();
    let mut cfg = RedlockConfig::new(lock, identity, nodes);
    // Contenders reach the nodes through proxies of their own: one node set, many addresses.
    cfg.node_set = Some(TEST_NODE_SET.to_owned());
    cfg.ttl = ttl;
    cfg.node_timeout = Duration::from_millis(100);
    cfg.retry_delay = Duration::from_millis(10);
    cfg.retry_max = Duration::from_millis(50);
    cfg
}

/// How often [`wait_until`] and [`wait_until_async`] re-check their condition.
pub const POLL_EVERY: Duration = Duration::from_millis(5);

/// Polls `cond` every few milliseconds until it returns true; panics naming `what` if it is
/// still false after `deadline`.
pub fn wait_until(deadline: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + deadline;
    loop {
        if cond() {
            return;
        }
        if Instant::now() >= end {
            panic!("timed out after {deadline:?} waiting for: {what}");
        }
        std::thread::sleep(POLL_EVERY);
    }
}

/// Async twin of [`wait_until`]: awaits `cond()` every few milliseconds (without blocking the
/// runtime) until it yields true; panics naming `what` after `deadline`.
pub async fn wait_until_async<F, Fut>(deadline: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let end = tokio::time::Instant::now() + deadline;
    loop {
        if cond().await {
            return;
        }
        if tokio::time::Instant::now() >= end {
            panic!("timed out after {deadline:?} waiting for: {what}");
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// Polls `probe` until it yields a value, and returns that value: for conditions that can
/// stop holding between a check and a second read.
pub async fn wait_for_async<T>(
    deadline: Duration,
    what: &str,
    mut probe: impl FnMut() -> Option<T>,
) -> T {
    let end = tokio::time::Instant::now() + deadline;
    loop {
        if let Some(value) = probe() {
            return value;
        }
        if tokio::time::Instant::now() >= end {
            panic!("timed out after {deadline:?} waiting for: {what}");
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// A loopback TCP port that was free a moment ago (bind 127.0.0.1:0, read the port, release it).
/// Someone else may take it before you bind it: [`RedisNode::start`] retries on a new port.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap_or_else(|e| panic!("cannot bind a loopback port: {e}"));
    listener
        .local_addr()
        .unwrap_or_else(|e| panic!("cannot read the bound port: {e}"))
        .port()
}

/// A fresh directory under the system temp dir, removed (with its contents) on drop.
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub fn new(prefix: &str) -> TempDir {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let name = format!(
            "redlock-sidecar-{prefix}-{}-{}-{nanos}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let path = std::env::temp_dir().join(name);
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("cannot create temp dir {}: {e}", path.display()));
        TempDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The scheduler state letter of a process (`R`, `S`, `T` for stopped, `Z` for zombie, ...),
/// read from procfs; `None` if it cannot be read (no such process, or no procfs).
pub fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may contain spaces: the state follows the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.trim_start().chars().next()
}

/// The parent of a process, read from procfs.
pub fn proc_parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Sends `sig` to `pid` with `libc::kill`; true if the signal was delivered.
pub fn send_signal(pid: u32, sig: libc::c_int) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: kill(2) has no memory-safety preconditions; callers only pass pids of their own
    // children that have not been reaped yet, so the pid cannot have been reused.
    unsafe { libc::kill(pid, sig) == 0 }
}

/// After SIGSTOP / SIGCONT, waits (bounded) until procfs shows the process stopped / not stopped.
/// Without procfs this returns at once.
pub fn wait_stopped_state(pid: u32, stopped: bool) {
    if proc_state(pid).is_none() {
        return;
    }
    let what = format!(
        "process {pid} to be {}",
        if stopped { "stopped" } else { "running again" }
    );
    wait_until(Duration::from_secs(2), &what, || match proc_state(pid) {
        Some(s) => (s == 'T' || s == 't') == stopped,
        None => true,
    });
}

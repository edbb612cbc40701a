//! `run` sidecars for the failover tests (Sentinel groups, cluster mode): a ttl of 2 s with
//! quick renewals, so that a failover under a held lock shows within seconds.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use super::tenures::{Sidecar, Watch, ELECTION, POLL};
use super::{free_port, http, Proc};

/// The ttl the sidecars run with (`TIMING`).
pub const TTL: Duration = Duration::from_secs(2);
/// ttl 2 s: renew every 400 ms, stop claiming 500 ms before the validity ends.
pub const TIMING: [&str; 12] = [
    "--ttl",
    "2s",
    "--renew-interval",
    "400ms",
    "--safety-margin",
    "500ms",
    "--node-timeout",
    "250ms",
    "--connect-timeout",
    "500ms",
    "--retry-delay",
    "50ms",
];
/// Beyond failover time + ttl + drift, what a loaded 2-core machine may add before a leader
/// shows on `/leader` (rounds, retries, the poll).
pub const SLACK: Duration = Duration::from_secs(3);

/// One `run` sidecar on `lock`.
pub struct Contender {
    pub name: String,
    pub addr: SocketAddr,
    pub proc: Proc,
}

impl Sidecar for Contender {
    fn name(&self) -> &str {
        &self.name
    }
    fn addr(&self) -> SocketAddr {
        self.addr
    }
    fn proc(&self) -> &Proc {
        &self.proc
    }
}

impl Contender {
    pub fn start(lock: &str, name: &str, redis: &str) -> Contender {
        Contender::start_with(lock, name, redis, &[])
    }

    /// [`Contender::start`] with more flags.
    pub fn start_with(lock: &str, name: &str, redis: &str, extra: &[&str]) -> Contender {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port())
            .parse()
            .expect("loopback address");
        let listen = addr.to_string();
        let mut args = vec!["run", "--lock", lock, "--redis", redis];
        args.extend(TIMING);
        args.extend([
            "--listen",
            &listen,
            "--identity",
            name,
            "--kubernetes",
            "off",
        ]);
        args.extend(extra);
        Contender {
            name: name.to_owned(),
            addr,
            proc: Proc::spawn(&args, &[("REDLOCK_LOG", "info")]),
        }
    }

    /// The holder this sidecar sees, from its `/leader` body.
    pub async fn holder(&self) -> Option<String> {
        let body = http::get(self.addr, "/leader").await.ok()?.json().ok()?;
        body["holder"].as_str().map(str::to_owned)
    }

    /// SIGTERM, wait for exit 0, and hand the log to `watch`.
    pub async fn stop(mut self, watch: &mut Watch) {
        self.proc.sigterm();
        let status = self
            .proc
            .wait_exit_async(Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("{} did not exit\n{}", self.name, self.proc.output_text()));
        assert_eq!(status.code(), Some(0), "{}", self.proc.output_text());
        watch.keep_log(self.name.clone(), self.proc.stderr_text());
    }
}

/// Waits until a sidecar answers "leader" for a request sent after `after`; returns when that
/// request was sent.
pub async fn leader_after(watch: &Watch, after: SystemTime, running: &[&Contender]) -> SystemTime {
    let end = tokio::time::Instant::now() + ELECTION;
    loop {
        if let Some(t) = watch.tenures().iter().find(|t| t.leading_at > after) {
            return t.leading_at;
        }
        if tokio::time::Instant::now() >= end {
            let logs: Vec<String> = running
                .iter()
                .map(|c| format!("--- {} ---\n{}", c.name, c.proc.output_text()))
                .collect();
            panic!("no leader after the failover\n{}", logs.join("\n"));
        }
        tokio::time::sleep(POLL).await;
    }
}

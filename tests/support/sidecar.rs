//! `redlock-sidecar run` as a child process: the command line the tests share, and what its
//! endpoints say.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::{http, Proc};

/// Flags every test sidecar gets unless the test passes its own: quick retries, and a node
/// timeout generous enough for a loaded 2-core test machine (it bounds each call).
const DEFAULTS: [(&str, &str); 3] = [
    ("--safety-margin", "300ms"),
    ("--retry-delay", "50ms"),
    ("--node-timeout", "250ms"),
];

/// A running sidecar with its public (probes, metrics) and control (loopback) addresses.
pub struct Sidecar {
    pub proc: Proc,
    pub addr: SocketAddr,
    pub control: SocketAddr,
    pub name: String,
}

impl Sidecar {
    /// `run --lock LOCK --redis REDIS --ttl TTL --identity NAME`, logging at debug level, with
    /// [`DEFAULTS`] for what `extra` does not set.
    pub fn start(name: &str, lock: &str, redis: &str, ttl: &str, extra: &[&str]) -> Sidecar {
        Sidecar::start_logging(name, lock, redis, ttl, extra, "debug")
    }

    /// [`Sidecar::start`] with the log level `log` (`REDLOCK_LOG`).
    pub fn start_logging(
        name: &str,
        lock: &str,
        redis: &str,
        ttl: &str,
        extra: &[&str],
        log: &str,
    ) -> Sidecar {
        let (addr, control) = (loopback(), loopback());
        let (listen, control_listen) = (addr.to_string(), control.to_string());
        let mut args = vec![
            "run",
            "--lock",
            lock,
            "--redis",
            redis,
            "--ttl",
            ttl,
            "--listen",
            &listen,
            "--control-listen",
            &control_listen,
            "--identity",
            name,
        ];
        for (flag, value) in DEFAULTS {
            if !extra.contains(&flag) {
                args.extend([flag, value]);
            }
        }
        args.extend_from_slice(extra);
        Sidecar {
            proc: Proc::spawn(&args, &[("REDLOCK_LOG", log)]),
            addr,
            control,
            name: name.to_owned(),
        }
    }

    /// The `/leader` body; its status and `is_leader` must agree.
    pub async fn leader(&self) -> Option<serde_json::Value> {
        let response = http::get(self.addr, "/leader").await.ok()?;
        let body = response.json().ok()?;
        assert_eq!(
            body["is_leader"].as_bool(),
            Some(response.status == 200),
            "status and body of /leader agree"
        );
        Some(body)
    }

    pub async fn is_leader(&self) -> bool {
        http::get(self.addr, "/leader")
            .await
            .is_ok_and(|r| r.status == 200)
    }

    /// The holder this sidecar names, if any.
    pub async fn holder(&self) -> Option<String> {
        Some(self.leader().await?["holder"].as_str()?.to_owned())
    }

    /// The fencing token it publishes, if any.
    pub async fn token(&self) -> Option<u64> {
        self.leader().await?["fencing_token"].as_u64()
    }

    pub async fn wait_serving(&self) {
        super::wait_until_async(Duration::from_secs(10), "admin endpoint serves", || async {
            http::get(self.addr, "/healthz")
                .await
                .is_ok_and(|r| r.status == 200)
        })
        .await;
    }

    pub async fn wait_holder(&self, holder: &str, within: Duration) {
        let what = format!("{} sees {holder} as holder", self.name);
        super::wait_until_async(within, &what, || async {
            self.holder().await.as_deref() == Some(holder)
        })
        .await;
    }

    /// The sum of `family`'s samples whose labels include `label`.
    pub async fn metric(&self, family: &str, label: &str) -> f64 {
        let text = http::get(self.addr, "/metrics")
            .await
            .map(|r| r.body)
            .unwrap_or_default();
        text.lines()
            .filter(|l| l.strip_prefix(family).is_some_and(|r| r.starts_with('{')))
            .filter(|l| l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl super::tenures::Sidecar for Sidecar {
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

/// Waits until exactly one of `sidecars` leads, within `within`, and returns its index; never
/// two at a time. On a timeout, the panic shows every sidecar's log.
pub async fn one_leader(sidecars: &[&Sidecar], within: Duration) -> usize {
    let deadline = Instant::now() + within;
    loop {
        let mut leaders = Vec::new();
        for (i, s) in sidecars.iter().enumerate() {
            if s.is_leader().await {
                leaders.push(i);
            }
        }
        assert!(leaders.len() <= 1, "never two leaders: {leaders:?}");
        if let [leader] = leaders[..] {
            return leader;
        }
        if Instant::now() >= deadline {
            let logs: Vec<String> = sidecars
                .iter()
                .map(|s| format!("--- {} ---\n{}", s.name, s.proc.output_text()))
                .collect();
            panic!("no leader within {within:?}\n{}", logs.join("\n"));
        }
        tokio::time::sleep(super::POLL_EVERY).await;
    }
}

/// A free loopback address.
pub fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], super::free_port()))
}

/// Waits until `sidecars[which]` leads, within `within`; never two leaders meanwhile.
pub async fn leads(sidecars: &[&Sidecar], which: usize, within: Duration) {
    let deadline = Instant::now() + within;
    while one_leader(sidecars, within).await != which {
        assert!(
            Instant::now() < deadline,
            "{} did not lead within {within:?}",
            sidecars[which].name
        );
        tokio::time::sleep(super::POLL_EVERY).await;
    }
}

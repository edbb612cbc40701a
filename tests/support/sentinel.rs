//! A real Sentinel-monitored group: a master, its replica, and Sentinel processes watching
//! them, all children of the test on loopback ports. Sentinels are the server binary in
//! sentinel mode (`SERVER CONF --sentinel`), so `$REDLOCK_TEST_REDIS_SERVER` applies to them too.
//!
//! Each Sentinel has its own writable config file (it rewrites it), a down-after of 1 s and a
//! failover timeout of 4 s, so failovers on loopback take a few seconds.

use std::fs::File;
use std::io::ErrorKind;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::redis::{server_binary, RawConn, Resp, ALIVE_TIMEOUT};
use super::{free_port, wait_until, RedisNode, TempDir};

/// The name every test group is monitored under.
pub const GROUP: &str = "mymaster";
/// Bound on a group becoming ready, and on a failover completing.
pub const GROUP_DEADLINE: Duration = Duration::from_secs(20);

/// One Sentinel process.
pub struct Sentinel {
    child: Option<Child>,
    port: u16,
    dir: TempDir,
    password: Option<String>,
}

impl Sentinel {
    /// Starts a Sentinel monitoring `master` (quorum `quorum`), with `password` as its own
    /// `requirepass` and `master_password` to reach the master.
    fn start(
        master: SocketAddr,
        quorum: usize,
        password: Option<&str>,
        master_password: Option<&str>,
    ) -> Sentinel {
        let mut last = String::new();
        for _ in 0..10 {
            let dir = TempDir::new("sentinel");
            let port = free_port();
            let mut conf = format!(
                "port {port}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\ndir {}\n\
                 sentinel monitor {GROUP} {} {} {quorum}\n\
                 sentinel down-after-milliseconds {GROUP} 1000\n\
                 sentinel failover-timeout {GROUP} 4000\n",
                dir.path().display(),
                master.ip(),
                master.port()
            );
            if let Some(password) = password {
                conf += &format!("requirepass {password}\n");
            }
            if let Some(password) = master_password {
                conf += &format!("sentinel auth-pass {GROUP} {password}\n");
            }
            let path = dir.path().join("sentinel.conf");
            std::fs::write(&path, conf).expect("write sentinel.conf");
            let log = File::create(dir.path().join("sentinel.log")).expect("sentinel log");
            let child = match Command::new(server_binary())
                .arg(&path)
                .arg("--sentinel")
                .stdin(Stdio::null())
                .stdout(Stdio::from(log.try_clone().expect("log")))
                .stderr(Stdio::from(log))
                .spawn()
            {
                Ok(child) => child,
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    panic!("`{}` is not on PATH: install redis-server", server_binary())
                }
                Err(e) => panic!("cannot start a Sentinel: {e}"),
            };
            let mut sentinel = Sentinel {
                child: Some(child),
                port,
                dir,
                password: password.map(str::to_owned),
            };
            let end = Instant::now() + Duration::from_secs(5);
            loop {
                if sentinel.try_command(&["PING"]).is_ok_and(|r| r == "PONG") {
                    return sentinel;
                }
                let exited = sentinel
                    .child
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten());
                if exited.is_some() || Instant::now() >= end {
                    last = sentinel.log_text();
                    break;
                }
                std::thread::sleep(super::POLL_EVERY);
            }
        }
        panic!("no Sentinel started on 10 ports; last log:\n{last}");
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sentinel.log")).unwrap_or_default()
    }

    /// One command (authenticated if the Sentinel has a password), reply as text.
    pub fn try_command(&self, args: &[&str]) -> Result<String, String> {
        let mut conn = RawConn::connect_timeout(self.addr(), ALIVE_TIMEOUT * 5)?;
        if let Some(password) = &self.password {
            match conn.command_resp(&["AUTH", password])? {
                Resp::Simple(ok) if ok == "OK" => {}
                other => return Err(format!("AUTH: {other}")),
            }
        }
        conn.command(args)
    }

    /// The master's port this Sentinel names now.
    pub fn master_port(&self) -> Option<u16> {
        let reply = self
            .try_command(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", GROUP])
            .ok()?;
        reply.lines().nth(1)?.trim().parse().ok()
    }

    /// A field of `SENTINEL MASTER GROUP` (a flat list of names and values).
    fn master_field(&self, name: &str) -> Option<String> {
        let reply = self.try_command(&["SENTINEL", "MASTER", GROUP]).ok()?;
        let lines: Vec<&str> = reply.lines().collect();
        lines
            .chunks(2)
            .find(|pair| pair[0] == name)
            .and_then(|pair| pair.get(1).map(|v| v.to_string()))
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A master, one replica and three Sentinels (quorum 2).
pub struct SentinelGroup {
    /// The master the group started with.
    pub master: RedisNode,
    /// Its replica, the one a failover promotes.
    pub replica: RedisNode,
    pub sentinels: Vec<Sentinel>,
}

impl SentinelGroup {
    /// A group without passwords, ready: every Sentinel knows the replica and the others.
    pub fn start() -> SentinelGroup {
        SentinelGroup::start_with_passwords(None, None)
    }

    /// A group whose servers require `data` (master and replica alike) and whose Sentinels
    /// require `sentinel`.
    pub fn start_with_passwords(data: Option<&str>, sentinel: Option<&str>) -> SentinelGroup {
        let auth: Vec<&str> = match data {
            Some(password) => vec!["--requirepass", password, "--masterauth", password],
            None => vec![],
        };
        let master = RedisNode::start_with(&auth);
        let mut replica_args = vec!["--repl-diskless-load", "swapdb"];
        replica_args.extend(&auth);
        let replica = RedisNode::start_with(&replica_args);
        assert_eq!(
            master.command(&["CONFIG", "SET", "repl-diskless-sync-delay", "0"]),
            "OK"
        );
        let port = master.port().to_string();
        assert_eq!(replica.command(&["REPLICAOF", "127.0.0.1", &port]), "OK");
        wait_until(GROUP_DEADLINE, "the replica's first sync", || {
            replica
                .try_command(&["INFO", "replication"])
                .is_ok_and(|info| info.contains("master_link_status:up"))
        });
        let sentinels = (0..3)
            .map(|_| Sentinel::start(master.addr(), 2, sentinel, data))
            .collect();
        let group = SentinelGroup {
            master,
            replica,
            sentinels,
        };
        group.wait_ready();
        group
    }

    /// Waits until every Sentinel knows the replica and the two other Sentinels: before that
    /// a failover cannot be agreed on.
    fn wait_ready(&self) {
        wait_until(
            GROUP_DEADLINE,
            "every Sentinel knows the replica and the others",
            || {
                self.sentinels.iter().all(|s| {
                    s.master_field("num-slaves").as_deref() == Some("1")
                        && s.master_field("num-other-sentinels").as_deref() == Some("2")
                })
            },
        );
    }

    /// `redis+sentinel://127.0.0.1:S1,127.0.0.1:S2,127.0.0.1:S3/mymaster` (no credentials).
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect();
        format!("redis+sentinel://{}/{GROUP}", hosts.join(","))
    }

    /// Waits until every Sentinel still running names the server on `port` as the master.
    pub fn wait_master_is(&self, port: u16) {
        let what = format!("every Sentinel names 127.0.0.1:{port} as the master");
        wait_until(GROUP_DEADLINE, &what, || {
            self.sentinels.iter().all(|s| s.master_port() == Some(port))
        });
    }

    /// `SENTINEL FAILOVER` on the first Sentinel (the replica is promoted, the master demoted);
    /// returns once the command was accepted.
    pub fn failover(&self) {
        // A Sentinel refuses while it has not yet seen the replica answer INFO; retried.
        wait_until(GROUP_DEADLINE, "SENTINEL FAILOVER is accepted", || {
            self.sentinels[0]
                .try_command(&["SENTINEL", "FAILOVER", GROUP])
                .is_ok_and(|r| r == "OK")
        });
    }

    /// Every Sentinel's log, for a failure message.
    pub fn logs(&self) -> String {
        self.sentinels
            .iter()
            .map(|s| format!("--- sentinel {} ---\n{}", s.port(), s.log_text()))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

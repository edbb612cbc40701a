//! Real `redis-server` processes on free loopback ports, and a tiny raw RESP client.
//!
//! Servers are children of the test process and are always killed *and waited for* (a killed
//! process that nobody waits for stays a zombie). No persistence: a restarted node is empty.

use std::fmt;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::ops::{Index, IndexMut};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, send_signal, wait_stopped_state, TempDir};
use redlock_sidecar::redlock::votes;

/// How long a starting server may take to answer PING.
pub const START_DEADLINE: Duration = Duration::from_secs(5);
/// Default connect + reply timeout of the raw client.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// The reply deadline of [`RedisNode::is_running`].
pub const ALIVE_TIMEOUT: Duration = Duration::from_millis(200);

/// The environment variable naming the server binary the tests start, e.g. a `valkey-server`:
/// the whole suite then runs against that server (Sentinels too, as `SERVER CONF --sentinel`).
pub const SERVER_ENV: &str = "REDLOCK_TEST_REDIS_SERVER";

/// The server binary the tests start: `$REDLOCK_TEST_REDIS_SERVER`, else `redis-server`.
pub fn server_binary() -> String {
    std::env::var(SERVER_ENV)
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "redis-server".to_owned())
}

const INSTALL_HINT: &str = "`redis-server` is not on PATH (or $REDLOCK_TEST_REDIS_SERVER does not \
name a server binary). Install it (Debian/Ubuntu package \
`redis-server`, 7.0 or newer): `apt-get update && apt-get install -y redis-server`";

// ---------------------------------------------------------------------------------------------
// RESP
// ---------------------------------------------------------------------------------------------

/// One RESP2 reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resp {
    Simple(String),
    Error(String),
    Int(i64),
    /// `None` is the nil bulk string. Bytes are decoded lossily as UTF-8.
    Bulk(Option<String>),
    /// `None` is the nil array.
    Array(Option<Vec<Resp>>),
}

/// Rendered like `redis-cli` minus the type tags: `OK`, `(error) ERR ...`, `42`, the bulk
/// string itself, `(nil)`, array elements one per line, `(empty array)`.
impl fmt::Display for Resp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Resp::Simple(s) => f.write_str(s),
            Resp::Error(e) => write!(f, "(error) {e}"),
            Resp::Int(i) => write!(f, "{i}"),
            Resp::Bulk(Some(s)) => f.write_str(s),
            Resp::Bulk(None) | Resp::Array(None) => f.write_str("(nil)"),
            Resp::Array(Some(items)) if items.is_empty() => f.write_str("(empty array)"),
            Resp::Array(Some(items)) => {
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str("\n")?;
                    }
                    write!(f, "{item}")?;
                }
                Ok(())
            }
        }
    }
}

impl Resp {
    pub fn is_error(&self) -> bool {
        matches!(self, Resp::Error(_))
    }
}

/// Encodes one command as a RESP array of bulk strings.
pub fn encode_command(args: &[&str]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// Parses one reply from the front of `buf`: `Ok(None)` if it is incomplete, otherwise the
/// reply and how many bytes it used.
pub fn parse_resp(buf: &[u8]) -> Result<Option<(Resp, usize)>, String> {
    parse_at(buf, 0)
}

fn parse_at(buf: &[u8], pos: usize) -> Result<Option<(Resp, usize)>, String> {
    let Some(rel) = buf[pos..].windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    if rel == 0 {
        return Err("empty RESP line".into());
    }
    let line = String::from_utf8_lossy(&buf[pos + 1..pos + rel]).into_owned();
    let next = pos + rel + 2;
    let int = |s: &str| {
        s.parse::<i64>()
            .map_err(|e| format!("bad RESP number {s:?}: {e}"))
    };
    match buf[pos] {
        b'+' => Ok(Some((Resp::Simple(line), next))),
        b'-' => Ok(Some((Resp::Error(line), next))),
        b':' => Ok(Some((Resp::Int(int(&line)?), next))),
        b'$' => {
            let len = int(&line)?;
            if len < 0 {
                return Ok(Some((Resp::Bulk(None), next)));
            }
            let end = next + len as usize;
            if buf.len() < end + 2 {
                return Ok(None);
            }
            let s = String::from_utf8_lossy(&buf[next..end]).into_owned();
            Ok(Some((Resp::Bulk(Some(s)), end + 2)))
        }
        b'*' => {
            let n = int(&line)?;
            if n < 0 {
                return Ok(Some((Resp::Array(None), next)));
            }
            let mut items = Vec::with_capacity(n as usize);
            let mut at = next;
            for _ in 0..n {
                match parse_at(buf, at)? {
                    Some((item, after)) => {
                        items.push(item);
                        at = after;
                    }
                    None => return Ok(None),
                }
            }
            Ok(Some((Resp::Array(Some(items)), at)))
        }
        other => Err(format!("unexpected RESP type byte {:?}", other as char)),
    }
}

/// A blocking raw RESP connection (std `TcpStream`), one command at a time.
///
/// Blocking: inside a `current_thread` tokio runtime, do not point it at a [`super::FaultProxy`]
/// running on that same runtime (use `command_at_async`, or `flavor = "multi_thread"`).
pub struct RawConn {
    stream: TcpStream,
    buf: Vec<u8>,
    timeout: Duration,
}

impl RawConn {
    pub fn connect(addr: SocketAddr) -> Result<RawConn, String> {
        RawConn::connect_timeout(addr, DEFAULT_TIMEOUT)
    }

    /// `timeout` bounds the connect and, later, each command's whole round trip.
    pub fn connect_timeout(addr: SocketAddr, timeout: Duration) -> Result<RawConn, String> {
        let stream = TcpStream::connect_timeout(&addr, timeout)
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let _ = stream.set_nodelay(true);
        stream
            .set_write_timeout(Some(timeout))
            .map_err(|e| e.to_string())?;
        Ok(RawConn {
            stream,
            buf: Vec::new(),
            timeout,
        })
    }

    /// Sends one command and reads its reply within the connection's timeout.
    /// Transport failures (timeout, reset, EOF) are `Err`; Redis errors are `Ok(Resp::Error)`.
    /// After a timeout the late reply may still arrive: use a new connection.
    pub fn command_resp(&mut self, args: &[&str]) -> Result<Resp, String> {
        let end = Instant::now() + self.timeout;
        self.stream
            .write_all(&encode_command(args))
            .map_err(|e| format!("write {args:?}: {e}"))?;
        let mut chunk = [0u8; 16 * 1024];
        loop {
            if let Some((reply, used)) = parse_resp(&self.buf)? {
                self.buf.drain(..used);
                return Ok(reply);
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "timed out after {:?} waiting for {args:?}",
                    self.timeout
                ));
            }
            self.stream
                .set_read_timeout(Some(left))
                .map_err(|e| e.to_string())?;
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(format!("connection closed while waiting for {args:?}")),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(format!(
                        "timed out after {:?} waiting for {args:?}",
                        self.timeout
                    ))
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("read reply to {args:?}: {e}")),
            }
        }
    }

    /// Like [`RawConn::command_resp`], rendered as text (see [`Resp`]'s `Display`).
    pub fn command(&mut self, args: &[&str]) -> Result<String, String> {
        self.command_resp(args).map(|r| r.to_string())
    }
}

/// One command on a fresh connection to `addr`, reply rendered as text; 2 s timeout.
pub fn command_at(addr: SocketAddr, args: &[&str]) -> Result<String, String> {
    command_at_timeout(addr, args, DEFAULT_TIMEOUT)
}

/// One command on a fresh connection to `addr` with the given connect and reply timeout.
pub fn command_at_timeout(
    addr: SocketAddr,
    args: &[&str],
    timeout: Duration,
) -> Result<String, String> {
    RawConn::connect_timeout(addr, timeout)?.command(args)
}

/// Async (tokio) form of [`command_at_timeout`], safe to use next to a `FaultProxy` on a
/// `current_thread` runtime.
pub async fn command_at_async(
    addr: SocketAddr,
    args: &[&str],
    timeout: Duration,
) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let run = async {
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let _ = stream.set_nodelay(true);
        stream
            .write_all(&encode_command(args))
            .await
            .map_err(|e| format!("write {args:?}: {e}"))?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        loop {
            if let Some((reply, _)) = parse_resp(&buf)? {
                return Ok(reply.to_string());
            }
            match stream.read(&mut chunk).await {
                Ok(0) => return Err(format!("connection closed while waiting for {args:?}")),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) => return Err(format!("read reply to {args:?}: {e}")),
            }
        }
    };
    tokio::time::timeout(timeout, run)
        .await
        .unwrap_or_else(|_| Err(format!("timed out after {timeout:?} waiting for {args:?}")))
}

// ---------------------------------------------------------------------------------------------
// RedisNode
// ---------------------------------------------------------------------------------------------

enum StartError {
    /// The port was taken (by us racing someone, or by a server that is not ours).
    PortBusy,
    Failed(String),
}

/// One `redis-server` child on a loopback port, with its own temp working dir.
pub struct RedisNode {
    child: Option<Child>,
    port: u16,
    dir: TempDir,
    config: Option<PathBuf>,
    extra_args: Vec<String>,
    /// (user, password) used by [`RedisNode::command`] and friends; user `None` = `AUTH pass`.
    auth: Option<(Option<String>, String)>,
    paused: bool,
    launches: u32,
}

impl RedisNode {
    /// Starts a plain node (no auth) on a free loopback port.
    pub fn start() -> RedisNode {
        RedisNode::start_inner(None, &[])
    }

    /// Starts a node with extra command-line arguments appended (they override the defaults),
    /// e.g. `&["--requirepass", "secret"]`. A `--requirepass` given here is remembered and used
    /// by [`RedisNode::command`].
    pub fn start_with(extra_args: &[&str]) -> RedisNode {
        RedisNode::start_inner(None, extra_args)
    }

    /// Writes `conf_text` to `redis.conf` in the node's temp dir and passes it as the first
    /// argument (needed for ACL users: `user NAME on >pass ~lock:* +@all`). The command-line
    /// defaults (port, bind, no persistence, ...) still apply after it. A `requirepass` line is
    /// remembered for [`RedisNode::command`]; for ACL users call [`RedisNode::set_auth`].
    pub fn start_with_config(conf_text: &str) -> RedisNode {
        RedisNode::start_inner(Some(conf_text), &[])
    }

    fn start_inner(conf_text: Option<&str>, extra_args: &[&str]) -> RedisNode {
        let dir = TempDir::new("redis");
        let mut auth = None;
        let config = conf_text.map(|text| {
            let path = dir.path().join("redis.conf");
            std::fs::write(&path, text)
                .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
            for line in text.lines() {
                let mut words = line.split_whitespace();
                if words.next() == Some("requirepass") {
                    if let Some(pass) = words.next() {
                        auth = Some((None, pass.trim_matches('"').to_string()));
                    }
                }
            }
            path
        });
        if let Some(i) = extra_args.iter().position(|a| *a == "--requirepass") {
            if let Some(pass) = extra_args.get(i + 1) {
                auth = Some((None, (*pass).to_string()));
            }
        }
        let mut node = RedisNode {
            child: None,
            port: 0,
            dir,
            config,
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            auth,
            paused: false,
            launches: 0,
        };
        let mut last = String::new();
        for _ in 0..10 {
            node.port = free_port();
            match node.launch() {
                Ok(child) => {
                    node.child = Some(child);
                    return node;
                }
                Err(StartError::PortBusy) => last = format!("port {} was busy", node.port),
                Err(StartError::Failed(msg)) => panic!("redis-server failed to start: {msg}"),
            }
        }
        panic!("redis-server failed to start on 10 different free ports; last: {last}");
    }

    /// Spawns the server on `self.port` and waits until it answers PING.
    fn launch(&mut self) -> Result<Child, StartError> {
        self.launches += 1;
        let log_path = self.dir.path().join(format!("redis-{}.log", self.launches));
        let log = File::create(&log_path)
            .map_err(|e| StartError::Failed(format!("create {}: {e}", log_path.display())))?;
        let log2 = log
            .try_clone()
            .map_err(|e| StartError::Failed(e.to_string()))?;
        let mut cmd = Command::new(server_binary());
        if let Some(conf) = &self.config {
            cmd.arg(conf);
        }
        let port = self.port.to_string();
        cmd.args(["--port", &port, "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--daemonize", "no"])
            .args(["--protected-mode", "no", "--loglevel", "warning"])
            .args(["--enable-debug-command", "yes"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2));
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) if e.kind() == ErrorKind::NotFound => panic!("{INSTALL_HINT}"),
            Err(e) => return Err(StartError::Failed(format!("spawn redis-server: {e}"))),
        };
        let read_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
        let end = Instant::now() + START_DEADLINE;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                let log = read_log();
                if log.contains("Address already in use") {
                    return Err(StartError::PortBusy);
                }
                return Err(StartError::Failed(format!(
                    "redis-server exited with {status} on port {}; its output:\n{log}",
                    self.port
                )));
            }
            if let Some(ours) = self.answers_as(child.id()) {
                if ours {
                    return Ok(child);
                }
                // Someone else's server answers on this port; ours will fail to bind.
                let _ = child.kill();
                let _ = child.wait();
                return Err(StartError::PortBusy);
            }
            if Instant::now() >= end {
                let _ = child.kill();
                let _ = child.wait();
                return Err(StartError::Failed(format!(
                    "redis-server did not answer PING on port {} within {START_DEADLINE:?}; \
                     its output:\n{}",
                    self.port,
                    read_log()
                )));
            }
            std::thread::sleep(super::POLL_EVERY);
        }
    }

    /// `None`: nothing answers yet. `Some(true)`: a server answers and it is process `pid`
    /// (checked with `INFO server` when we can authenticate). `Some(false)`: another server.
    fn answers_as(&self, pid: u32) -> Option<bool> {
        let mut conn = RawConn::connect_timeout(self.addr(), ALIVE_TIMEOUT).ok()?;
        match conn.command_resp(&["PING"]).ok()? {
            Resp::Simple(s) if s == "PONG" => {}
            Resp::Error(e) if e.starts_with("NOAUTH") => {
                if !self.authenticate(&mut conn) {
                    // Cannot look inside; the child is alive (checked before), accept it.
                    return Some(true);
                }
            }
            _ => return None,
        }
        let info = conn.command(&["INFO", "server"]).ok()?;
        let reported = info
            .lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .and_then(|v| v.trim().parse::<u32>().ok());
        Some(reported.is_none_or(|p| p == pid))
    }

    fn authenticate(&self, conn: &mut RawConn) -> bool {
        let Some((user, pass)) = &self.auth else {
            return false;
        };
        let reply = match user {
            Some(u) => conn.command_resp(&["AUTH", u, pass]),
            None => conn.command_resp(&["AUTH", pass]),
        };
        matches!(reply, Ok(Resp::Simple(ref s)) if s == "OK")
    }

    /// Credentials that [`RedisNode::command`] (and `is_running`'s ownership checks) use:
    /// `user` `None` sends `AUTH pass`, `Some(u)` sends `AUTH u pass`.
    pub fn set_auth(&mut self, user: Option<&str>, pass: &str) {
        self.auth = Some((user.map(str::to_string), pass.to_string()));
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// `redis://127.0.0.1:PORT` (no credentials in it).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The OS pid of the running server, if any.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The server's captured stdout/stderr of its current (latest) run.
    pub fn log_text(&self) -> String {
        let path = self.dir.path().join(format!("redis-{}.log", self.launches));
        std::fs::read_to_string(path).unwrap_or_default()
    }

    /// SIGKILL and wait: the port is free and the data gone when this returns. Idempotent.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.paused = false;
    }

    /// [`RedisNode::stop`], then start again on the SAME port (empty: no persistence). Retries
    /// for a couple of seconds if the port is briefly busy.
    pub fn restart(&mut self) {
        self.stop();
        self.start_again();
    }

    /// Starts a stopped node again on its port (no-op if it is running).
    pub fn start_again(&mut self) {
        if self.child.is_some() {
            return;
        }
        let mut last = String::new();
        for _ in 0..40 {
            match self.launch() {
                Ok(child) => {
                    self.child = Some(child);
                    return;
                }
                Err(StartError::PortBusy) => {
                    last = format!("port {} busy", self.port);
                    // Back-off between bind attempts, not synchronisation.
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(StartError::Failed(msg)) => panic!("redis-server failed to restart: {msg}"),
            }
        }
        panic!(
            "redis-server could not get its port {} back: {last}",
            self.port
        );
    }

    /// `SAVE`: a snapshot of the node's data in its directory, for
    /// [`RedisNode::restart_from_snapshot`].
    /// Retried while a replica's sync keeps a fork busy (`SAVE` refuses to run beside one).
    pub fn save_snapshot(&self) {
        super::wait_until(START_DEADLINE, "SAVE succeeds", || {
            self.try_command(&["SAVE"]).is_ok_and(|reply| reply == "OK")
        });
    }

    /// SIGKILL, then start again on the same port from the last [`RedisNode::save_snapshot`]
    /// (a restore from a backup: whatever was written since is gone). The snapshot file is
    /// removed once loaded, so a later [`RedisNode::restart`] starts empty again.
    pub fn restart_from_snapshot(&mut self) {
        let dump = self.dir.path().join("dump.rdb");
        assert!(
            dump.exists(),
            "no snapshot of {} to restart from",
            self.addr()
        );
        self.restart();
        std::fs::remove_file(&dump)
            .unwrap_or_else(|e| panic!("cannot remove {}: {e}", dump.display()));
    }

    /// A node meant to become a replica (see [`RedisNode::replicate`]): it loads a master's
    /// data from the socket, so no snapshot file is left behind to be loaded by a restart.
    pub fn start_replica() -> RedisNode {
        RedisNode::start_with(&["--repl-diskless-load", "swapdb"])
    }

    /// `REPLICAOF` the server at `master` (e.g. a [`super::FaultProxy`] in front of it, to cut
    /// the link later), then waits (bounded) until the initial sync is done. The master's
    /// `repl-diskless-sync-delay` is set to 0 first (by default it waits 5 s for more replicas).
    /// As a runtime command it is forgotten by a restart, which comes back as an empty master.
    pub fn replicate(&self, master: SocketAddr) {
        let delay = command_at(master, &["CONFIG", "SET", "repl-diskless-sync-delay", "0"]);
        assert_eq!(delay.as_deref(), Ok("OK"), "master {master}");
        let port = master.port().to_string();
        let host = master.ip().to_string();
        assert_eq!(self.command(&["REPLICAOF", &host, &port]), "OK");
        super::wait_until(START_DEADLINE, "the replica's first sync", || {
            self.try_command(&["INFO", "replication"])
                .is_ok_and(|info| {
                    info.lines()
                        .any(|l| l.trim_end() == "master_link_status:up")
                })
        });
    }

    /// SIGSTOP: the process freezes; connects still succeed (kernel backlog) but nothing answers.
    pub fn pause(&mut self) {
        if let Some(pid) = self.pid() {
            if send_signal(pid, libc::SIGSTOP) {
                self.paused = true;
                wait_stopped_state(pid, true);
            }
        }
    }

    /// SIGCONT after [`RedisNode::pause`].
    pub fn resume(&mut self) {
        if let Some(pid) = self.pid() {
            if send_signal(pid, libc::SIGCONT) {
                self.paused = false;
                wait_stopped_state(pid, false);
            }
        }
    }

    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// True if the node answers PING (`PONG` or `NOAUTH`) within 200 ms.
    pub fn is_running(&self) -> bool {
        if self.child.is_none() {
            return false;
        }
        let Ok(mut conn) = RawConn::connect_timeout(self.addr(), ALIVE_TIMEOUT) else {
            return false;
        };
        match conn.command_resp(&["PING"]) {
            Ok(Resp::Simple(s)) => s == "PONG",
            Ok(Resp::Error(e)) => e.starts_with("NOAUTH"),
            _ => false,
        }
    }

    /// A raw connection, already authenticated if credentials are known.
    pub fn conn(&self) -> Result<RawConn, String> {
        let mut conn = RawConn::connect(self.addr())?;
        if self.auth.is_some() && !self.authenticate(&mut conn) {
            return Err(format!("AUTH failed on {}", self.addr()));
        }
        Ok(conn)
    }

    /// One command, reply as [`Resp`]; transport failures are `Err`.
    pub fn try_command_resp(&self, args: &[&str]) -> Result<Resp, String> {
        self.conn()?.command_resp(args)
    }

    /// One command, reply as text; transport failures are `Err`.
    pub fn try_command(&self, args: &[&str]) -> Result<String, String> {
        self.try_command_resp(args).map(|r| r.to_string())
    }

    /// One command, reply as text (`GET` → the value or `(nil)`, `PTTL` → `1234`, errors →
    /// `(error) ...`). Panics if the node cannot be reached.
    pub fn command(&self, args: &[&str]) -> String {
        self.try_command(args)
            .unwrap_or_else(|e| panic!("redis {} {args:?}: {e}", self.addr()))
    }

    /// How many times `command` (lower case) ran here: `calls=` of its `INFO commandstats` line.
    pub fn calls(&self, command: &str) -> u64 {
        let prefix = format!("cmdstat_{command}:calls=");
        self.command(&["INFO", "commandstats"])
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next()?.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for RedisNode {
    fn drop(&mut self) {
        if self.paused {
            self.resume();
        }
        self.stop();
    }
}

// ---------------------------------------------------------------------------------------------
// RedisCluster
// ---------------------------------------------------------------------------------------------

/// N independent Redis masters (not Redis Cluster mode: separate servers, as Redlock wants).
pub struct RedisCluster {
    pub nodes: Vec<RedisNode>,
}

impl RedisNode {
    /// `uptime_in_seconds` from `INFO server`, if the node answers.
    pub fn uptime_secs(&self) -> Option<u64> {
        self.try_command(&["INFO", "server"]).ok().and_then(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("uptime_in_seconds:"))
                .and_then(|v| v.trim().parse().ok())
        })
    }

    /// The server process' `run_id` from `INFO server`, if the node answers.
    pub fn run_id(&self) -> Option<String> {
        let info = self.try_command(&["INFO", "server"]).ok()?;
        let run_id = info.lines().find_map(|l| l.strip_prefix("run_id:"))?;
        Some(run_id.trim().to_owned())
    }

    /// The server's `master_replid` from `INFO replication`, if the node answers.
    pub fn replid(&self) -> Option<String> {
        let info = self.try_command(&["INFO", "replication"]).ok()?;
        let replid = info
            .lines()
            .find_map(|l| l.strip_prefix("master_replid:"))?;
        Some(replid.trim().to_owned())
    }

    /// The lineage the engine's scripts stamp into the epoch marker of database 0.
    pub fn lineage(&self) -> Option<String> {
        Some(votes::lineage(&self.run_id()?, &self.replid()?, 0))
    }

    /// How long this node has provably kept its data for the engine: the age of its epoch
    /// marker, stamping the marker first (as the first contender to meet the node would).
    pub fn data_age(&self) -> Option<Duration> {
        let lineage = &self.lineage()?;
        let key = redlock_sidecar::redlock::EPOCH_KEY;
        let marker = self.try_command(&["GET", key]).ok()?;
        let pttl: i64 = self.try_command(&["PTTL", key]).ok()?.parse().ok()?;
        if let Some(age) = votes::data_age(&marker, pttl, lineage) {
            return Some(age);
        }
        let lifetime = votes::EPOCH_LIFETIME_MS.to_string();
        self.try_command(&["SET", key, lineage, "PX", &lifetime])
            .ok()?;
        Some(Duration::ZERO)
    }

    /// Stamps the epoch marker as if this node had kept its data for `age` already: a node that
    /// has been up for a while, without a test waiting that long for it.
    pub fn backdate_epoch(&self, age: Duration) {
        let lineage = &self
            .lineage()
            .expect("the node answers INFO with a run_id and a master_replid");
        let px = (votes::EPOCH_LIFETIME_MS - age.as_millis() as u64).to_string();
        self.command(&[
            "SET",
            redlock_sidecar::redlock::EPOCH_KEY,
            lineage,
            "PX",
            &px,
        ]);
    }

    /// Waits until this node's grants count for a lock of `ttl`: its epoch marker is at least
    /// ttl + drift old. Fresh, restarted and flushed nodes do not vote before that.
    pub fn wait_votes_count(&self, ttl: Duration) {
        let needed = votes::required_data_age(ttl);
        super::wait_until(
            needed + Duration::from_secs(10),
            "node has kept its data for ttl + drift",
            || self.data_age().is_some_and(|age| age >= needed),
        );
    }
}

impl RedisCluster {
    /// [`RedisNode::wait_votes_count`] for every node.
    pub fn wait_votes_count(&self, ttl: Duration) {
        for node in self.iter() {
            node.wait_votes_count(ttl);
        }
    }

    /// [`RedisNode::backdate_epoch`] for every node: their grants count for any ttl up to
    /// `ttl` at once.
    pub fn backdate_epochs(&self, ttl: Duration) {
        for node in self.iter() {
            node.backdate_epoch(votes::required_data_age(ttl));
        }
    }

    pub fn start(n: usize) -> RedisCluster {
        RedisCluster::start_with(n, &[])
    }

    /// `n` nodes whose grants count for a lock of `ttl` (see [`RedisNode::wait_votes_count`]).
    pub fn ready(n: usize, ttl: Duration) -> RedisCluster {
        let cluster = RedisCluster::start(n);
        cluster.wait_votes_count(ttl);
        cluster
    }

    /// `n` nodes, each started with the same extra arguments.
    pub fn start_with(n: usize, extra_args: &[&str]) -> RedisCluster {
        RedisCluster {
            nodes: (0..n).map(|_| RedisNode::start_with(extra_args)).collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn node(&self, i: usize) -> &RedisNode {
        &self.nodes[i]
    }

    pub fn node_mut(&mut self, i: usize) -> &mut RedisNode {
        &mut self.nodes[i]
    }

    pub fn iter(&self) -> std::slice::Iter<'_, RedisNode> {
        self.nodes.iter()
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisNode::url).collect()
    }

    /// Comma-separated URLs, e.g. for a `--redis-urls` flag or env var.
    pub fn urls_joined(&self) -> String {
        self.urls().join(",")
    }

    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.nodes.iter().map(RedisNode::addr).collect()
    }

    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(RedisNode::port).collect()
    }

    /// Runs one command on every running node; replies in node order (`Err` for unreachable).
    pub fn command_all(&self, args: &[&str]) -> Vec<Result<String, String>> {
        self.nodes.iter().map(|n| n.try_command(args)).collect()
    }

    /// `FLUSHALL` on every node that is running.
    pub fn flush_all(&self) {
        for n in self.nodes.iter().filter(|n| n.pid().is_some()) {
            n.command(&["FLUSHALL"]);
        }
    }
}

impl Index<usize> for RedisCluster {
    type Output = RedisNode;
    fn index(&self, i: usize) -> &RedisNode {
        &self.nodes[i]
    }
}

impl IndexMut<usize> for RedisCluster {
    fn index_mut(&mut self, i: usize) -> &mut RedisNode {
        &mut self.nodes[i]
    }
}

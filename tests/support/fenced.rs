//! A fenced resource for the fault tests: a store that accepts a write only if its fencing token
//! is at least the highest token it has accepted, and records every write, accepted or refused,
//! with the moment (monotonic) it was decided.
//!
//! In-process contenders call [`FencedStore::write`]. Process contenders (guard's CMD) talk to a
//! [`StoreServer`] over loopback TCP, one line per write, so a `bash` one-liner can take part:
//!
//! ```text
//! -> begin|write|end TOKEN WHO [PID]
//! <- ok | refused
//! ```
//!
//! The server decides in the order lines arrive and stamps them then. When a connection closes
//! (the process ended or was killed) before its session wrote `end`, the server records
//! [`Kind::Gone`]: the moment the kernel closed the socket, an upper bound on the process' death.
//! All stamps come from one clock in one process, so their order is exact.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

/// What a record marks in a critical section.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The first write of a critical section.
    Begin,
    /// A write in the middle.
    Write,
    /// The last write: the holder is about to release.
    End,
    /// Not a write: the writer's connection closed without `end` (it died or was killed).
    Gone,
}

impl Kind {
    fn parse(word: &str) -> Option<Kind> {
        match word {
            "begin" => Some(Kind::Begin),
            "write" => Some(Kind::Write),
            "end" => Some(Kind::End),
            _ => None,
        }
    }
}

/// One decided write (or a [`Kind::Gone`] mark).
#[derive(Clone, Debug)]
pub struct Record {
    /// When the store decided (monotonic, one clock for every writer).
    pub at: Instant,
    /// Who wrote: the contender's identity.
    pub who: String,
    /// The fencing token the write carried.
    pub token: u64,
    pub kind: Kind,
    /// Whether the store accepted it (always true for `Gone`, which is no write).
    pub accepted: bool,
    /// The end of the writer's own lease validity, when the writer knows it (in-process
    /// contenders). A write decided after it was made by a writer that paused between its
    /// validity check and the write.
    pub deadline: Option<Instant>,
    /// The writer's process id, when it sent one (guard's CMD does).
    pub pid: Option<u32>,
}

impl Record {
    /// Decided after the writer's own validity ended (the writer was paused or starved).
    pub fn is_late(&self) -> bool {
        self.deadline.is_some_and(|d| self.at >= d)
    }
}

#[derive(Default)]
struct State {
    highest: u64,
    records: Vec<Record>,
    begins: usize,
    last_begin: Option<(Instant, String, u64)>,
}

/// The store. Share it with `Arc`.
#[derive(Default)]
pub struct FencedStore {
    state: Mutex<State>,
}

impl FencedStore {
    pub fn new() -> Arc<FencedStore> {
        Arc::new(FencedStore::default())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes with `token`: accepted (true) if `token` ≥ the highest token accepted so far.
    pub fn write(&self, who: &str, token: u64, kind: Kind, deadline: Option<Instant>) -> bool {
        self.write_with_pid(who, token, kind, deadline, None)
    }

    pub fn write_with_pid(
        &self,
        who: &str,
        token: u64,
        kind: Kind,
        deadline: Option<Instant>,
        pid: Option<u32>,
    ) -> bool {
        let mut state = self.state();
        // Stamped under the lock, so the order of stamps is the order of decisions.
        let at = Instant::now();
        let accepted = token >= state.highest;
        if accepted {
            state.highest = token;
        }
        if kind == Kind::Begin {
            state.begins += 1;
            state.last_begin = Some((at, who.to_owned(), token));
        }
        state.records.push(Record {
            at,
            who: who.to_owned(),
            token,
            kind,
            accepted,
            deadline,
            pid,
        });
        accepted
    }

    /// Marks that `who`'s session with `token` ended without `end`: its writer is gone, or gave
    /// up (e.g. after a failed renewal). `deadline` as in [`FencedStore::write`]: a mark made
    /// after it does not stretch the session.
    pub fn gone(&self, who: &str, token: u64, deadline: Option<Instant>) {
        let mut state = self.state();
        let at = Instant::now();
        state.records.push(Record {
            at,
            who: who.to_owned(),
            token,
            kind: Kind::Gone,
            accepted: true,
            deadline,
            pid: None,
        });
    }

    /// Every record so far, in decision order.
    pub fn records(&self) -> Vec<Record> {
        self.state().records.clone()
    }

    /// The highest token accepted so far.
    pub fn highest(&self) -> u64 {
        self.state().highest
    }

    /// How many `begin` writes were decided so far (accepted or not).
    pub fn begins(&self) -> usize {
        self.state().begins
    }

    /// The latest `begin`: when, who, token.
    pub fn last_begin(&self) -> Option<(Instant, String, u64)> {
        self.state().last_begin.clone()
    }

    /// Whether `who`'s session with `token` has neither ended nor gone yet.
    pub fn is_open(&self, who: &str, token: u64) -> bool {
        let state = self.state();
        let mut begun = false;
        for r in state.records.iter().rev() {
            if r.who == who && r.token == token {
                if matches!(r.kind, Kind::End | Kind::Gone) {
                    return false;
                }
                begun |= r.kind == Kind::Begin;
            }
        }
        begun
    }

    /// Records decided at or after `since` that match `filter`.
    pub fn count_since(&self, since: Instant, filter: impl Fn(&Record) -> bool) -> usize {
        self.state()
            .records
            .iter()
            .filter(|r| r.at >= since && filter(r))
            .count()
    }
}

/// The store served over loopback TCP (see the module doc). Dropping it stops the server and
/// closes every connection.
pub struct StoreServer {
    port: u16,
    task: JoinHandle<()>,
}

impl StoreServer {
    /// Binds `127.0.0.1:0` and serves `store` on the current tokio runtime.
    pub async fn start(store: Arc<FencedStore>) -> StoreServer {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .unwrap_or_else(|e| panic!("store cannot bind a loopback port: {e}"));
        let port = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("store cannot read its port: {e}"))
            .port();
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        if let Ok((socket, _)) = accepted {
                            connections.spawn(serve(socket, store.clone()));
                        }
                    }
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                }
            }
        });
        StoreServer { port, task }
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        // Aborting the accept task drops its JoinSet, which aborts every connection.
        self.task.abort();
    }
}

async fn serve(socket: tokio::net::TcpStream, store: Arc<FencedStore>) {
    let _ = socket.set_nodelay(true);
    let (read, mut write) = socket.into_split();
    let mut lines = BufReader::new(read).lines();
    // The session this connection writes for, until it writes `end`.
    let mut open: Option<(String, u64)> = None;
    while let Ok(Some(line)) = lines.next_line().await {
        let words: Vec<&str> = line.split_whitespace().collect();
        let parsed =
            match words.as_slice() {
                [kind, token, who, rest @ ..] => Kind::parse(kind)
                    .zip(token.parse::<u64>().ok())
                    .map(|(kind, token)| {
                        (kind, token, *who, rest.first().and_then(|p| p.parse().ok()))
                    }),
                _ => None,
            };
        let Some((kind, token, who, pid)) = parsed else {
            let _ = write.write_all(b"error\n").await;
            continue;
        };
        let accepted = store.write_with_pid(who, token, kind, None, pid);
        open = match kind {
            Kind::End => None,
            _ => Some((who.to_owned(), token)),
        };
        let reply: &[u8] = if accepted { b"ok\n" } else { b"refused\n" };
        if write.write_all(reply).await.is_err() {
            break;
        }
    }
    if let Some((who, token)) = open {
        store.gone(&who, token, None);
    }
}

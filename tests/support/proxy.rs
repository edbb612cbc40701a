//! `FaultProxy`: a small tokio TCP proxy in front of one upstream (a Redis node) whose faults
//! (latency, blackhole, refusal, dropped connections) the test flips while it runs.
//!
//! Blackhole semantics are those of a partition that TCP survives: bytes are *held*, not
//! discarded, so after `heal()` whatever was sent in the meantime is delivered in order (as TCP
//! retransmission would). Clients with a reply timeout see the timeout; the byte stream never
//! loses a request in the middle, so the RESP framing stays intact.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Faults {
    latency: Duration,
    jitter: Duration,
    blackhole: bool,
    refuse: bool,
    /// Bumped by `drop_connections`: connections opened under an older generation close.
    generation: u64,
}

struct Shared {
    /// Where new connections go; [`FaultProxy::set_upstream`] moves it (a failover).
    upstream: Mutex<SocketAddr>,
    accepted: AtomicU64,
    refused: AtomicU64,
    active: AtomicU64,
    bytes: AtomicU64,
    rng: Mutex<u64>,
}

impl Shared {
    /// Uniform in `0..jitter` (xorshift64*; quality is irrelevant here).
    fn jitter(&self, jitter: Duration) -> Duration {
        let nanos = jitter.as_nanos() as u64;
        if nanos == 0 {
            return Duration::ZERO;
        }
        let mut s = self.rng.lock().unwrap_or_else(|p| p.into_inner());
        *s ^= *s >> 12;
        *s ^= *s << 25;
        *s ^= *s >> 27;
        Duration::from_nanos(s.wrapping_mul(0x2545_F491_4F6C_DD1D) % nanos)
    }
}

/// Decrements the active-connection count when a connection task ends (or is dropped).
struct ActiveGuard(Arc<Shared>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A TCP proxy on `127.0.0.1:<ephemeral>` forwarding to one upstream.
///
/// It runs on the tokio runtime that called [`FaultProxy::start`]: blocking clients (std
/// sockets) used from a `current_thread` test would starve it; use `flavor = "multi_thread"`
/// or async clients.
pub struct FaultProxy {
    addr: SocketAddr,
    faults: watch::Sender<Faults>,
    shared: Arc<Shared>,
    accept_task: JoinHandle<()>,
}

impl FaultProxy {
    /// Binds `127.0.0.1:0` and starts accepting. Each accepted connection opens its own
    /// upstream connection.
    pub async fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .unwrap_or_else(|e| panic!("proxy cannot bind a loopback port: {e}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("proxy cannot read its port: {e}"));
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let seed = (nanos ^ (u64::from(addr.port()) << 32)) | 1;
        let shared = Arc::new(Shared {
            upstream: Mutex::new(upstream),
            accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            active: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            rng: Mutex::new(seed),
        });
        let (faults, faults_rx) = watch::channel(Faults::default());
        let accept_task = tokio::spawn(accept_loop(listener, shared.clone(), faults_rx));
        FaultProxy {
            addr,
            faults,
            shared,
            accept_task,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `redis://127.0.0.1:PORT` of the proxy.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.addr.port())
    }

    pub fn upstream(&self) -> SocketAddr {
        *self
            .shared
            .upstream
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Points the proxy at another upstream, as a failover moves a node's address to its
    /// replica: connections opened from now on reach `upstream`; open ones are closed, so no
    /// client keeps talking to the old server.
    pub fn set_upstream(&self, upstream: SocketAddr) {
        *self
            .shared
            .upstream
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = upstream;
        self.drop_connections();
    }

    /// Every chunk read from now on, in either direction, is forwarded `fixed + U(0..jitter)`
    /// after it was read; order per direction is preserved.
    pub fn set_latency(&self, fixed: Duration, jitter: Duration) {
        self.faults.send_modify(|f| {
            f.latency = fixed;
            f.jitter = jitter;
        });
    }

    /// While on: connections are accepted and kept, nothing is forwarded either way (bytes are
    /// held until it is turned off), new connections do not reach the upstream yet.
    pub fn blackhole(&self, on: bool) {
        self.faults.send_modify(|f| f.blackhole = on);
    }

    /// While on: new connections are accepted and reset at once (RST via SO_LINGER 0).
    pub fn refuse(&self, on: bool) {
        self.faults.send_modify(|f| f.refuse = on);
    }

    /// Closes every current connection (both sides) now; later connections work as usual.
    pub fn drop_connections(&self) {
        self.faults.send_modify(|f| f.generation += 1);
    }

    /// Clears latency, blackhole and refusal (open connections stay open).
    pub fn heal(&self) {
        self.faults.send_modify(|f| {
            *f = Faults {
                generation: f.generation,
                ..Faults::default()
            }
        });
    }

    /// TCP connections accepted so far, refused ones included.
    pub fn connections_accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections reset because `refuse` was on.
    pub fn connections_refused(&self) -> u64 {
        self.shared.refused.load(Ordering::SeqCst)
    }

    /// Connections currently being served.
    pub fn active_connections(&self) -> u64 {
        self.shared.active.load(Ordering::SeqCst)
    }

    /// Bytes written to either side so far.
    pub fn bytes_forwarded(&self) -> u64 {
        self.shared.bytes.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept_task.abort();
        // Dropping `self.faults` (the watch sender) right after this closes every connection
        // task: their drop-watch resolves with "closed".
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, faults: watch::Receiver<Faults>) {
    loop {
        let Ok((sock, _)) = listener.accept().await else {
            tokio::task::yield_now().await; // e.g. out of fds: do not spin the runtime
            continue;
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        if faults.borrow().refuse {
            shared.refused.fetch_add(1, Ordering::SeqCst);
            let _ = sock.set_zero_linger();
            drop(sock);
            continue;
        }
        shared.active.fetch_add(1, Ordering::SeqCst);
        let guard = ActiveGuard(shared.clone());
        tokio::spawn(serve(sock, shared.clone(), faults.clone(), guard));
    }
}

async fn serve(
    client: TcpStream,
    shared: Arc<Shared>,
    faults: watch::Receiver<Faults>,
    _guard: ActiveGuard,
) {
    let generation = faults.borrow().generation;
    let mut drop_rx = faults.clone();
    let dropped = async move {
        // Resolves on a newer generation, or with Err when the proxy is gone.
        let _ = drop_rx.wait_for(|f| f.generation != generation).await;
    };
    let work = async move {
        let mut gate = faults.clone();
        if gate.wait_for(|f| !f.blackhole).await.is_err() {
            return;
        }
        let target = *shared.upstream.lock().unwrap_or_else(|p| p.into_inner());
        let Ok(upstream) = TcpStream::connect(target).await else {
            return; // upstream down: the client sees its connection closed
        };
        let _ = client.set_nodelay(true);
        let _ = upstream.set_nodelay(true);
        let (client_r, client_w) = client.into_split();
        let (up_r, up_w) = upstream.into_split();
        tokio::join!(
            pump(client_r, up_w, &shared, faults.clone()),
            pump(up_r, client_w, &shared, faults.clone()),
        );
    };
    tokio::select! {
        // Checked first so that after `drop_connections()` no further byte is forwarded.
        biased;
        () = dropped => {}
        () = work => {}
    }
}

/// Copies `from` → `to` through a queue of (due time, chunk): the reader stamps each chunk with
/// the latency in force when it was read, the writer waits for the stamp and for no blackhole.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    faults: watch::Receiver<Faults>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader_faults = faults.clone();
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let f = *reader_faults.borrow();
                    let due = Instant::now() + f.latency + shared.jitter(f.jitter);
                    if tx.send((due, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
        // Dropping `tx` lets the writer finish the queue and then half-close.
    };
    let mut gate = faults;
    let writer = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if gate.wait_for(|f| !f.blackhole).await.is_err() {
                return;
            }
            if to.write_all(&chunk).await.is_err() {
                return;
            }
            shared.bytes.fetch_add(chunk.len() as u64, Ordering::SeqCst);
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}

/// A proxy that keeps its clients' connections when its upstream moves, as Redis-aware
/// proxies and managed endpoints do on a failover: [`KeepingProxy::switch`] makes every
/// client connection re-dial the new upstream, and the client never sees a disconnect.
/// Requests a client sends while no upstream is reachable wait in its socket until one is.
pub struct KeepingProxy {
    addr: SocketAddr,
    upstream: watch::Sender<SocketAddr>,
    accept_task: JoinHandle<()>,
}

impl KeepingProxy {
    /// Binds `127.0.0.1:0` and starts accepting.
    pub async fn start(upstream: SocketAddr) -> KeepingProxy {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .unwrap_or_else(|e| panic!("proxy cannot bind a loopback port: {e}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("proxy cannot read its port: {e}"));
        let (upstream, upstream_rx) = watch::channel(upstream);
        let accept_task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let _ = client.set_nodelay(true);
                tokio::spawn(keep(client, upstream_rx.clone()));
            }
        });
        KeepingProxy {
            addr,
            upstream,
            accept_task,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Moves every client connection, open or new, to `to`.
    pub fn switch(&self, to: SocketAddr) {
        self.upstream.send_replace(to);
    }
}

impl Drop for KeepingProxy {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

/// Pipes one client connection to the current upstream, re-dialling whenever it moves.
async fn keep(client: TcpStream, mut upstream: watch::Receiver<SocketAddr>) {
    let (mut client_rx, mut client_tx) = client.into_split();
    let mut from_client = vec![0u8; 16 * 1024];
    let mut from_upstream = vec![0u8; 16 * 1024];
    loop {
        let addr = *upstream.borrow_and_update();
        let mut moved = false;
        if let Ok(up) = TcpStream::connect(addr).await {
            let _ = up.set_nodelay(true);
            let (mut up_rx, mut up_tx) = up.into_split();
            loop {
                tokio::select! {
                    read = client_rx.read(&mut from_client) => match read {
                        Ok(0) | Err(_) => return,
                        Ok(n) => if up_tx.write_all(&from_client[..n]).await.is_err() { break },
                    },
                    read = up_rx.read(&mut from_upstream) => match read {
                        Ok(0) | Err(_) => break,
                        Ok(n) => if client_tx.write_all(&from_upstream[..n]).await.is_err() { return },
                    },
                    changed = upstream.changed() => {
                        if changed.is_err() { return }
                        moved = true;
                        break;
                    }
                }
            }
        }
        // The upstream is gone: wait until it moves.
        if !moved && upstream.changed().await.is_err() {
            return;
        }
    }
}

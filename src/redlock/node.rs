//! One Redis master: its address (credentials kept secret), its connection, its errors.
//!
//! ## Behaviour
//! - One multiplexed connection per node, made lazily (in the background, bounded by the
//!   connect timeout) and remade after I/O errors.
//! - On every new connection the node's [`NodeFacts`] (run id, eviction policy) are read
//!   once; a restart always drops the connection, so the run id is never stale. The server
//!   the last connection reached is kept after it drops ([`Node::server`]): the node-set
//!   fingerprint names the node by it (see `votes`, rule 7). The
//!   eviction policy can change under a live connection: it is read again in the
//!   background once it is older than [`FACTS_MAX_AGE`].
//! - Every call is bounded by the caller's timeout: a hung node costs at most that.
//! - Scripts go by `EVALSHA`, falling back to `EVAL` when the node does not know them
//!   (after a restart, say).
//! - Credentials kept in files are read again for every new connection (see `secrets`).
//! - Passwords never leave this module: `Debug` and `Display` show `host:port`, and
//!   error texts are scrubbed of the password before they are kept.
//! - A node may be a Sentinel group (`redis+sentinel://`): each connection is made to the
//!   master the Sentinels name, and is dropped when the group fails over (see `sentinel`).
//! - An answer `READONLY` or `MASTERDOWN` drops the connection: the server is no longer a
//!   master that can grant, and the next call dials (or resolves) again.
//! - **One connection carries pushes too.** The connection speaks RESP3 where the server does
//!   (Redis 6+), so a waiter's subscriptions ride on it ([`Node::pushes`]) and a sidecar
//!   holds one connection per node, not two: a node's idle cost grows with its clients. A
//!   server or proxy that refuses `HELLO 3` gets RESP2 and a dedicated pub/sub connection.

use std::fmt;
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, Client, ClientTlsConfig, ConnectionAddr, ConnectionInfo, FromRedisValue,
    IntoConnectionInfo, ProtocolVersion, PushInfo, RedisError, Script, TlsCertificates,
};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::{CancellationToken, DropGuard};

use super::cluster;
use super::error::ConfigError;
use super::secrets::SecretFiles;
use super::sentinel::{self, Group, SentinelUrl};

/// Credentials and TLS settings applied to every node URL that does not carry its own.
#[derive(Clone, Default)]
pub struct Credentials {
    /// ACL user name (Redis 6+).
    pub username: Option<String>,
    /// Password; never printed.
    pub password: Option<String>,
    /// PEM bundle of CA certificates for `rediss://` nodes with a private CA.
    pub ca_pem: Option<Vec<u8>>,
    /// Client certificate (PEM chain) and private key (PEM) for `rediss://` nodes that
    /// authenticate clients (`tls-auth-clients yes`); the key is never printed.
    pub client_cert: Option<ClientCert>,
    /// ACL user for the Sentinels of `redis+sentinel://` nodes.
    pub sentinel_username: Option<String>,
    /// Password for the Sentinels of `redis+sentinel://` nodes; never printed.
    pub sentinel_password: Option<String>,
    /// Files the password, CA and client certificate come from, read again for every new
    /// connection (see [`super::secrets`]); what they held at start-up is in the fields above.
    pub files: SecretFiles,
}

/// A TLS client certificate and its key, both PEM.
#[derive(Clone)]
pub struct ClientCert {
    /// The certificate chain.
    pub cert_pem: Vec<u8>,
    /// The private key; never printed.
    pub key_pem: Vec<u8>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("ca_pem", &self.ca_pem.as_ref().map(|pem| pem.len()))
            .field(
                "client_cert",
                &self.client_cert.as_ref().map(|_| "<redacted>"),
            )
            .field("sentinel_username", &self.sentinel_username)
            .field(
                "sentinel_password",
                &self.sentinel_password.as_ref().map(|_| "<redacted>"),
            )
            .field("files", &self.files)
            .finish()
    }
}

/// A parsed node address. `Debug`/`Display` show only `host:port` (a Sentinel group:
/// `MASTER@sentinel1:port,...`).
#[derive(Clone)]
pub struct NodeSpec {
    label: String,
    /// The node; for a Sentinel group, the master as first named (its credentials and db; the
    /// address is replaced by the one the Sentinels give).
    info: ConnectionInfo,
    tls: bool,
    ca_pem: Option<Vec<u8>>,
    client_cert: Option<ClientCert>,
    sentinel: Option<SentinelSpec>,
    /// Read again for every new connection; the URL's own password wins over the file's.
    files: SecretFiles,
    url_has_password: bool,
}

/// The Sentinels of a `redis+sentinel://` node, with their own credentials.
#[derive(Clone)]
struct SentinelSpec {
    url: SentinelUrl,
    /// One per Sentinel, credentials set.
    infos: Vec<ConnectionInfo>,
    password: Option<String>,
}

impl NodeSpec {
    /// Parses a `redis://`, `rediss://`, `redis+sentinel://` or `rediss+sentinel://` URL,
    /// filling in credentials it lacks.
    ///
    /// The error never contains the URL itself (it may hold a password); it names
    /// the node by its position in the list instead.
    pub fn parse(position: usize, url: &str, creds: &Credentials) -> Result<NodeSpec, ConfigError> {
        let bad = |why: &str| ConfigError::new("--redis", format!("node #{}: {why}", position + 1));
        if sentinel::is_sentinel_url(url) {
            return NodeSpec::parse_sentinel(url, creds).map_err(|why| bad(&why));
        }
        let scheme = url.split("://").next().unwrap_or_default();
        if !matches!(scheme, "redis" | "rediss") || !url.contains("://") {
            return Err(bad(
                "URL must start with redis://, rediss://, redis+sentinel:// or rediss+sentinel://",
            ));
        }
        let info = url
            .into_connection_info()
            .map_err(|_| bad("not a valid Redis URL"))?;
        let (label, tls) = match info.addr() {
            ConnectionAddr::Tcp(host, port) => (format!("{host}:{port}"), false),
            ConnectionAddr::TcpTls { host, port, .. } => (format!("{host}:{port}"), true),
            ConnectionAddr::Unix(path) => (format!("unix:{}", path.display()), false),
            _ => return Err(bad("unsupported address type")),
        };
        let url_has_password = info.redis_settings().password().is_some();
        let spec = NodeSpec {
            label,
            info: with_credentials(info, creds.username.as_ref(), creds.password.as_ref()),
            tls,
            ca_pem: creds.ca_pem.clone(),
            client_cert: creds.client_cert.clone(),
            sentinel: None,
            files: creds.files.clone(),
            url_has_password,
        };
        spec.check_tls()?;
        Ok(spec)
    }

    fn parse_sentinel(url: &str, creds: &Credentials) -> Result<NodeSpec, String> {
        let parsed = SentinelUrl::parse(url)?;
        let (first_host, first_port) = parsed.sentinels[0].clone();
        let info = parsed.master_info(&first_host, first_port)?;
        let infos = parsed
            .sentinel_infos()?
            .into_iter()
            .map(|info| {
                let info = with_credentials(
                    info,
                    creds.sentinel_username.as_ref(),
                    creds.sentinel_password.as_ref(),
                );
                // A Sentinel before 7.2 refuses CLIENT SETINFO; say nothing it does not need.
                let settings = info.redis_settings().clone().set_skip_set_lib_name();
                info.set_redis_settings(settings)
            })
            .collect();
        let url_has_password = info.redis_settings().password().is_some();
        let spec = NodeSpec {
            files: creds.files.clone(),
            url_has_password,
            label: parsed.label(),
            info: with_credentials(info, creds.username.as_ref(), creds.password.as_ref()),
            tls: parsed.tls,
            ca_pem: creds.ca_pem.clone(),
            client_cert: creds.client_cert.clone(),
            sentinel: Some(SentinelSpec {
                url: parsed,
                infos,
                password: creds.sentinel_password.clone(),
            }),
        };
        spec.check_tls().map_err(|e| e.to_string())?;
        Ok(spec)
    }

    /// Unparsable PEM is a configuration error now, not a connection error on every call.
    fn check_tls(&self) -> Result<(), ConfigError> {
        if self.tls {
            if let Some(ca) = &self.ca_pem {
                tls_client(&self.info, Some(ca), None).map_err(|_| {
                    ConfigError::new("--redis-ca-file", "not a valid PEM bundle of certificates")
                })?;
            }
            if self.client_cert.is_some() {
                self.client_for(&self.info).map_err(|_| {
                    ConfigError::new(
                        "--redis-client-cert",
                        "the client certificate or its key (--redis-client-key) is not valid PEM",
                    )
                })?;
            }
        }
        Ok(())
    }

    /// `host:port`, safe to log and to use as a metric label.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The identity used to refuse a node listed twice: address (host lower-cased) and
    /// database; for a Sentinel group, its Sentinels and master name. (The node set names
    /// servers by what they show instead, see [`super::votes::NodeSet`].)
    pub fn identity(&self) -> (String, i64) {
        let db = self.info.redis_settings().db();
        match &self.sentinel {
            Some(sentinel) => (sentinel.url.identity(), db),
            None => (self.label.to_lowercase(), db),
        }
    }

    /// The name of the master, if this node is a Sentinel group.
    pub fn sentinel_master(&self) -> Option<&str> {
        self.sentinel.as_ref().map(|s| s.url.master.as_str())
    }

    fn password(&self) -> Option<&str> {
        self.info.redis_settings().password()
    }

    /// This spec with the credential files read again (rotated secrets), or as it is when
    /// none comes from a file. The files are read off this thread, within a deadline.
    async fn current(&self) -> Result<NodeSpec, NodeError> {
        if !self.files.any() && self.files.sentinel_password.is_none() {
            return Ok(self.clone());
        }
        let loaded = self.files.reload().await.map_err(|err| NodeError {
            kind: NodeErrorKind::Auth,
            message: err.to_string(),
        })?;
        let mut spec = self.clone();
        if let (Some(password), false) = (loaded.password, self.url_has_password) {
            let settings = spec.info.redis_settings().clone().set_password(password);
            spec.info = spec.info.set_redis_settings(settings);
        }
        if let (Some(password), Some(sentinel)) = (loaded.sentinel_password, &mut spec.sentinel) {
            for info in &mut sentinel.infos {
                let settings = info.redis_settings().clone().set_password(password.clone());
                *info = info.clone().set_redis_settings(settings);
            }
            sentinel.password = Some(password);
        }
        spec.ca_pem = loaded.ca_pem.or(spec.ca_pem);
        spec.client_cert = loaded.client_cert.or(spec.client_cert);
        Ok(spec)
    }

    /// Clients for the Sentinels of a `redis+sentinel://` node, with their credentials.
    fn sentinel_clients(&self, sentinel: &SentinelSpec) -> Result<Vec<Client>, NodeError> {
        sentinel
            .infos
            .iter()
            .map(|info| self.client_for(info))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| NodeError::from_redis(&e, sentinel.password.as_deref()))
    }

    /// The password to scrub from error texts.
    pub(super) fn password_for_errors(&self) -> Option<&str> {
        self.password()
    }

    /// The database index the URL selects.
    pub(super) fn db(&self) -> i64 {
        self.info.redis_settings().db()
    }

    /// This node's connection info (credentials, db, TLS) for the server at `host:port`.
    pub(super) fn info_at(&self, host: &str, port: u16) -> Result<ConnectionInfo, NodeError> {
        let scheme = if self.tls { "rediss" } else { "redis" };
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        let addr = format!("{scheme}://{host}:{port}")
            .into_connection_info()
            .map_err(|_| NodeError {
                kind: NodeErrorKind::Protocol,
                message: format!("{host}:{port} is not an address to dial"),
            })?;
        Ok(self.info.clone().set_addr(addr.addr().clone()))
    }

    /// A client for the server at `host:port`, with this node's credentials and TLS settings.
    pub(super) fn client_at(&self, host: &str, port: u16) -> Result<Client, NodeError> {
        self.client_for(&self.info_at(host, port)?)
            .map_err(|e| NodeError::from_redis(&e, self.password()))
    }

    /// A client for the server `info` names, with this node's TLS settings.
    fn client_for(&self, info: &ConnectionInfo) -> Result<Client, RedisError> {
        if !self.tls || (self.ca_pem.is_none() && self.client_cert.is_none()) {
            return Client::open(info.clone());
        }
        tls_client(info, self.ca_pem.as_ref(), self.client_cert.as_ref())
    }
}

/// `info` with the given credentials where it has none, and our library name.
fn with_credentials(
    info: ConnectionInfo,
    username: Option<&String>,
    password: Option<&String>,
) -> ConnectionInfo {
    let mut settings = info.redis_settings().clone();
    if settings.password().is_none() {
        if let Some(password) = password {
            settings = settings.set_password(password);
        }
        if settings.username().is_none() {
            if let Some(username) = username {
                settings = settings.set_username(username);
            }
        }
    }
    info.set_redis_settings(settings.set_lib_name("redlock-sidecar", env!("CARGO_PKG_VERSION")))
}

/// A TLS client with a private CA (else the system roots) and an optional client certificate.
fn tls_client(
    info: &ConnectionInfo,
    ca_pem: Option<&Vec<u8>>,
    client_cert: Option<&ClientCert>,
) -> Result<Client, RedisError> {
    Client::build_with_tls(
        info.clone(),
        TlsCertificates {
            client_tls: client_cert.map(|c| ClientTlsConfig {
                client_cert: c.cert_pem.clone(),
                client_key: c.key_pem.clone(),
            }),
            root_cert: ca_pem.cloned(),
        },
    )
}

impl fmt::Debug for NodeSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeSpec({})", self.label)
    }
}

impl fmt::Display for NodeSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label)
    }
}

/// Why a call to one node failed, in a small fixed set (used as a metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NodeErrorKind {
    /// No answer within the per-node timeout.
    Timeout,
    /// Refused, reset, unreachable or unknown host.
    Connection,
    /// Wrong password or user, or a password is required.
    Auth,
    /// The peer answered something that is not the expected Redis reply.
    Protocol,
    /// Any other error the node returned.
    Other,
}

impl NodeErrorKind {
    /// Every kind, for pre-initialising metrics.
    pub const ALL: [NodeErrorKind; 5] = [
        NodeErrorKind::Timeout,
        NodeErrorKind::Connection,
        NodeErrorKind::Auth,
        NodeErrorKind::Protocol,
        NodeErrorKind::Other,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeErrorKind::Timeout => "timeout",
            NodeErrorKind::Connection => "connection",
            NodeErrorKind::Auth => "auth",
            NodeErrorKind::Protocol => "protocol",
            NodeErrorKind::Other => "other",
        }
    }
}

impl fmt::Display for NodeErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed call to one node: its kind and a scrubbed message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct NodeError {
    /// The class of failure.
    pub kind: NodeErrorKind,
    /// What the client library said, with any password removed.
    pub message: String,
}

impl NodeError {
    /// Whether the node refused a command because the ACL user may not run it (`NOPERM`).
    pub fn is_acl_denial(&self) -> bool {
        self.kind == NodeErrorKind::Auth && self.message.to_ascii_lowercase().contains("noperm")
    }

    pub(crate) fn timeout(after: Duration) -> NodeError {
        NodeError {
            kind: NodeErrorKind::Timeout,
            message: format!("no answer within {after:?}"),
        }
    }

    pub(super) fn from_redis(err: &RedisError, password: Option<&str>) -> NodeError {
        let code = err.code().unwrap_or_default();
        let kind = if err.is_timeout() {
            NodeErrorKind::Timeout
        } else if matches!(err.kind(), redis::ErrorKind::AuthenticationFailed)
            || matches!(code, "NOAUTH" | "WRONGPASS" | "NOPERM")
        {
            NodeErrorKind::Auth
        } else if matches!(
            err.kind(),
            redis::ErrorKind::Parse | redis::ErrorKind::UnexpectedReturnType
        ) {
            NodeErrorKind::Protocol
        } else if err.is_io_error() || err.is_connection_refusal() || err.is_connection_dropped() {
            NodeErrorKind::Connection
        } else {
            NodeErrorKind::Other
        };
        let mut message = err.to_string();
        if let Some(password) = password.filter(|p| !p.is_empty()) {
            message = message.replace(password, "<redacted>");
        }
        NodeError { kind, message }
    }
}

/// Connection settings shared by all nodes.
#[derive(Clone, Copy, Debug)]
pub struct ConnectSettings {
    /// Bound on establishing a connection (TCP, TLS, AUTH). Each request is bounded by its
    /// caller's timeout instead (one timer per call, not two).
    pub connect_timeout: Duration,
    /// The hash slot of the lock's keys: a cluster-mode node is reached at the master serving it.
    pub slot: u16,
    /// Whether connecting to a cluster stamps every slot's epoch marker (see `cluster`).
    pub stamp_slots: bool,
}

/// What a node says about itself, read once per connection: a restart always drops the
/// connection, so these facts stay true for as long as it lives.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// The server process' id (`INFO server`): new with every restart.
    pub run_id: String,
    /// `maxmemory-policy` (`INFO memory`): anything but `noeviction` may evict lock keys.
    pub maxmemory_policy: String,
    /// `role` (`INFO replication`): `master`, or `slave` for a replica.
    pub role: String,
    /// The `host:port` the connection reaches: the URL's, the master a Sentinel named, or the
    /// cluster master serving the lock's slot.
    pub address: String,
    /// `cluster_enabled:1` (`INFO cluster`): the connection reaches the master of the lock's
    /// slot, and the epoch marker is that slot's (see `cluster`).
    pub cluster: bool,
    /// The connection speaks RESP3 and carries the node's pushed messages.
    pub push: bool,
}

impl NodeFacts {
    /// Whether the node may evict keys that have a ttl, such as lock keys.
    pub fn may_evict(&self) -> bool {
        self.maxmemory_policy != "noeviction"
    }

    /// The facts in the text of `INFO server`, `INFO replication` and `INFO memory` (any of
    /// them may be one text holding several sections).
    pub fn parse(server: &str, replication: &str, memory: &str) -> NodeFacts {
        NodeFacts {
            run_id: info_field(server, "run_id"),
            maxmemory_policy: info_field(memory, "maxmemory_policy"),
            role: info_field(replication, "role"),
            address: String::new(),
            cluster: false,
            push: false,
        }
    }
}

/// The value of `name` in an `INFO` text, empty when absent.
pub fn info_field(text: &str, name: &str) -> String {
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default()
}

/// The state of a node's one connection.
#[derive(Clone)]
enum Link {
    /// No connection; the next call makes one.
    Idle,
    /// A connection is being made (by a background task, so a short node timeout cannot
    /// cancel a slow TLS handshake half-way).
    Connecting,
    /// Connected (connection number `u64`), with the facts read on it and when they were read.
    Up(MultiplexedConnection, Arc<NodeFacts>, u64, Instant),
    /// The last attempt failed; the next call tries again.
    Down(NodeError),
}

/// A live node: its address and its self-reconnecting connection.
pub struct Node {
    spec: NodeSpec,
    dial: Arc<Dial>,
    settings: ConnectSettings,
    link: Arc<watch::Sender<Link>>,
    connections: Arc<AtomicU64>,
    refreshing: Arc<AtomicBool>,
    /// The server the last connection reached ([`super::votes::server_identity`]), kept after
    /// the connection is gone: the node-set fingerprint names a node by it.
    server: Arc<std::sync::Mutex<Option<String>>>,
    /// Set once the Sentinel group's `+switch-master` subscription runs.
    following: AtomicBool,
    /// Cluster mode: the masters the last `CLUSTER SLOTS` listed, dialled when the URL's node
    /// does not answer.
    seeds: Arc<std::sync::Mutex<Vec<(String, u16)>>>,
    /// What the node's RESP3 connections push, read by one listener at a time.
    pushed: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<(u64, PushInfo)>>>,
    push_tx: mpsc::UnboundedSender<(u64, PushInfo)>,
    stop: CancellationToken,
    _stop_on_drop: DropGuard,
}

/// Forwards what connection `id` pushes to its node, tagged with the connection's number (a
/// message of a connection since replaced is told apart and dropped).
#[derive(Clone)]
pub(super) struct PushTag {
    id: u64,
    tx: mpsc::UnboundedSender<(u64, PushInfo)>,
}

impl redis::aio::AsyncPushSender for PushTag {
    fn send(&self, info: PushInfo) -> Result<(), redis::aio::SendError> {
        self.tx
            .send((self.id, info))
            .map_err(|_| redis::aio::SendError)
    }
}

/// Messages of the channels a waiter subscribed: `(channel, payload)`; the stream ends when
/// the connection that carries them is gone.
pub type Pushes = BoxStream<'static, (String, String)>;

/// How a node's server is reached.
enum Dial {
    /// The URL's server.
    Direct(Box<Client>),
    /// The master the group's Sentinels name at the time of connecting.
    Sentinel(Arc<Group>),
}

impl Dial {
    /// A client for the server to connect to now, and its `host:port`.
    async fn client(
        &self,
        spec: &NodeSpec,
        timeout: Duration,
    ) -> Result<(Client, String), NodeError> {
        // Credentials kept in files are read again for every connection.
        let fresh = spec.current().await?;
        let spec = &fresh;
        match self {
            Dial::Direct(client) if !spec.files.any() => {
                Ok((Client::clone(client), spec.label.clone()))
            }
            Dial::Direct(_) => {
                let client = spec
                    .client_for(&spec.info)
                    .map_err(|e| NodeError::from_redis(&e, spec.password()))?;
                Ok((client, spec.label.clone()))
            }
            Dial::Sentinel(group) => {
                if let Some(sentinel) = &spec.sentinel {
                    let password = sentinel.password.as_deref();
                    if !group.has_password(password) {
                        let clients = spec.sentinel_clients(sentinel)?;
                        group.set_credentials(clients, sentinel.password.clone());
                    }
                }
                let (host, port) = group.resolve(timeout).await?;
                let info = spec.info_at(&host, port)?;
                let client = spec
                    .client_for(&info)
                    .map_err(|e| NodeError::from_redis(&e, spec.password()))?;
                Ok((client, sentinel::addr_label(&info)))
            }
        }
    }
}

/// How old a connection's eviction policy may get before it is read again in the background
/// (one `INFO memory`): the run id cannot change under a live connection, but the policy can
/// (`CONFIG SET`). 30 s keeps an idle standby under one command per node per second.
pub const FACTS_MAX_AGE: Duration = Duration::from_secs(30);

/// What [`Node::read_key`] reports as the remaining time of a key without expiry.
const NO_EXPIRY: Duration = Duration::from_secs(365 * 24 * 3600);

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Node({})", self.spec.label)
    }
}

impl Node {
    /// Prepares the connection; nothing is sent until the first call.
    pub fn new(spec: NodeSpec, settings: ConnectSettings) -> Result<Node, NodeError> {
        let dial = match &spec.sentinel {
            None => Dial::Direct(Box::new(
                spec.client_for(&spec.info)
                    .map_err(|e| NodeError::from_redis(&e, spec.password()))?,
            )),
            Some(sentinel) => {
                let clients = spec.sentinel_clients(sentinel)?;
                Dial::Sentinel(Arc::new(Group::new(
                    sentinel.url.clone(),
                    clients,
                    sentinel.password.clone(),
                )))
            }
        };
        let stop = CancellationToken::new();
        let (push_tx, pushed) = mpsc::unbounded_channel();
        Ok(Node {
            spec,
            dial: Arc::new(dial),
            settings,
            link: Arc::new(watch::channel(Link::Idle).0),
            connections: Arc::new(AtomicU64::new(0)),
            refreshing: Arc::new(AtomicBool::new(false)),
            server: Arc::default(),
            following: AtomicBool::new(false),
            seeds: Arc::default(),
            pushed: Arc::new(tokio::sync::Mutex::new(pushed)),
            push_tx,
            _stop_on_drop: stop.clone().drop_guard(),
            stop,
        })
    }

    /// The name of the master, if this node is a Sentinel group.
    pub fn sentinel_master(&self) -> Option<&str> {
        self.spec.sentinel_master()
    }

    /// Whether the node is reached over TLS.
    pub fn is_tls(&self) -> bool {
        self.spec.tls
    }

    /// `host:port`.
    pub fn label(&self) -> &str {
        self.spec.label()
    }

    /// The database index the node's URL selects.
    pub fn db(&self) -> i64 {
        self.spec.info.redis_settings().db()
    }

    /// The facts of the live connection, if there is one (no I/O).
    pub fn facts(&self) -> Option<Arc<NodeFacts>> {
        match &*self.link.borrow() {
            Link::Up(_, facts, _, _) => Some(facts.clone()),
            _ => None,
        }
    }

    /// The server the node's last connection reached (kept after it is gone), `None` before
    /// the first connection or when the server shows no run id (no I/O).
    pub fn server(&self) -> Option<String> {
        self.server
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether [`Node::server`] may be out of date: no connection was ever made, or the last
    /// one was dropped (a restart, a failover) and none has been tried since.
    pub fn server_stale(&self) -> bool {
        matches!(*self.link.borrow(), Link::Idle) || self.server().is_none()
    }

    /// Connects if no connection is up, within `timeout`; errors are left to the next call.
    pub async fn connect(&self, timeout: Duration) {
        let _ = self.connection(timeout).await;
    }

    /// The live connection and its facts, connecting first if needed (within `timeout`).
    async fn connection(
        &self,
        timeout: Duration,
    ) -> Result<(MultiplexedConnection, Arc<NodeFacts>, u64), NodeError> {
        if let Some(up) = self.up(&self.link.borrow()) {
            return Ok(up);
        }
        self.connection_quiet(timeout).await
    }

    /// The connection, made if needed, without refreshing stale facts: plain reads need none,
    /// so an idle standby sends nothing else.
    async fn connection_quiet(
        &self,
        timeout: Duration,
    ) -> Result<(MultiplexedConnection, Arc<NodeFacts>, u64), NodeError> {
        if let Link::Up(conn, facts, id, _) = &*self.link.borrow() {
            return Ok((conn.clone(), facts.clone(), *id));
        }
        let start_connecting = |link: &mut Link| {
            let idle = matches!(link, Link::Idle | Link::Down(_));
            if idle {
                *link = Link::Connecting;
            }
            idle
        };
        if self.link.send_if_modified(start_connecting) {
            self.connect_in_background();
        }
        let mut link = self.link.subscribe();
        let settled = tokio::time::timeout(
            timeout,
            link.wait_for(|link| !matches!(link, Link::Connecting)),
        )
        .await;
        match settled {
            Ok(Ok(link)) => match (self.up(&link), &*link) {
                (Some(up), _) => Ok(up),
                (None, Link::Down(err)) => Err(err.clone()),
                (None, _) => Err(NodeError::timeout(timeout)),
            },
            _ => Err(NodeError::timeout(timeout)),
        }
    }

    /// The connection `link` holds, if it is up; starts a refresh of stale facts.
    fn up(&self, link: &Link) -> Option<(MultiplexedConnection, Arc<NodeFacts>, u64)> {
        let Link::Up(conn, facts, id, read_at) = link else {
            return None;
        };
        if read_at.elapsed() > FACTS_MAX_AGE {
            self.refresh_facts(conn.clone(), *id);
        }
        Some((conn.clone(), facts.clone(), *id))
    }

    /// Connects (for a Sentinel group: to the master the Sentinels name now) and reads the
    /// node's facts, bounded by the connect timeout; publishes the result on the link.
    fn connect_in_background(&self) {
        self.follow_failovers();
        let dial = self.dial.clone();
        let spec = self.spec.clone();
        let link = self.link.clone();
        let server = self.server.clone();
        let db = self.db();
        let settings = self.settings;
        let id = self.connections.fetch_add(1, Ordering::Relaxed) + 1;
        let seeds = self.seeds.clone();
        let tag = PushTag {
            id,
            tx: self.push_tx.clone(),
        };
        let connect = async move {
            let (client, address) = dial.client(&spec, settings.connect_timeout).await?;
            let (conn, mut facts) = match open(&spec, &client, settings, Some(&tag)).await {
                Ok(opened) => opened,
                // A cluster node that is down: another master of the cluster will do.
                Err(err) => open_any(&spec, &seeds, settings, &tag).await.ok_or(err)?,
            };
            if facts.address.is_empty() {
                facts.address = address;
            }
            let (conn, facts) = if facts.cluster {
                cluster::route(&spec, conn, facts, settings, &seeds, &tag).await?
            } else {
                (conn, facts)
            };
            if let Some(group) = spec.sentinel_master() {
                if facts.role != "master" {
                    return Err(NodeError {
                        kind: NodeErrorKind::Other,
                        message: format!(
                            "a Sentinel named {} as master of {group}, but it reports role:{}",
                            facts.address, facts.role
                        ),
                    });
                }
            }
            Ok::<_, NodeError>((conn, facts))
        };
        let connect_timeout = settings.connect_timeout;
        tokio::spawn(async move {
            let next = match tokio::time::timeout(connect_timeout, connect).await {
                Ok(Ok((conn, facts))) => {
                    *server.lock().unwrap_or_else(|e| e.into_inner()) =
                        super::votes::server_identity(&facts.run_id, db);
                    Link::Up(conn, Arc::new(facts), id, Instant::now())
                }
                Ok(Err(err)) => Link::Down(err),
                Err(_) => Link::Down(NodeError::timeout(connect_timeout)),
            };
            link.send_replace(next);
        });
    }

    /// For a Sentinel group, starts (once) the subscription that drops the connection when
    /// the group's master changes.
    fn follow_failovers(&self) {
        let Dial::Sentinel(group) = &*self.dial else {
            return;
        };
        if self.following.swap(true, Ordering::AcqRel) {
            return;
        }
        let link = self.link.clone();
        let switched = move || {
            link.send_if_modified(|link| {
                let settled = matches!(link, Link::Up(..) | Link::Down(_));
                if settled {
                    *link = Link::Idle;
                }
                settled
            });
        };
        let follow =
            group
                .clone()
                .follow(self.settings.connect_timeout, self.stop.clone(), switched);
        tokio::spawn(follow);
    }

    /// Reads the eviction policy of connection `id` again in the background (one refresh at a
    /// time).
    fn refresh_facts(&self, mut conn: MultiplexedConnection, id: u64) {
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let (link, refreshing) = (self.link.clone(), self.refreshing.clone());
        let timeout = self.settings.connect_timeout;
        tokio::spawn(async move {
            let mut info = redis::cmd("INFO");
            info.arg("memory");
            let read = info.query_async::<String>(&mut conn);
            if let Ok(Ok(memory)) = tokio::time::timeout(timeout, read).await {
                link.send_if_modified(|link| match link {
                    Link::Up(_, facts, current, read_at) if *current == id => {
                        *facts = Arc::new(NodeFacts {
                            maxmemory_policy: info_field(&memory, "maxmemory_policy"),
                            ..NodeFacts::clone(facts)
                        });
                        *read_at = Instant::now();
                        true
                    }
                    _ => false,
                });
            }
            refreshing.store(false, Ordering::Release);
        });
    }

    /// Forgets connection `id` after an error that means it is broken, or that the server is
    /// no longer the master to ask (`READONLY`, `MASTERDOWN`, `MOVED`); the next call
    /// reconnects (for a Sentinel group: to the master named then; in cluster mode: to the
    /// slot's master then) and reads the node's facts again.
    fn drop_if_broken(&self, id: u64, err: &RedisError) {
        let demoted = matches!(err.code(), Some("READONLY" | "MASTERDOWN" | "MOVED"));
        if demoted
            || err.is_io_error()
            || err.is_connection_dropped()
            || err.is_connection_refusal()
        {
            self.link.send_if_modified(|link| match link {
                Link::Up(_, _, current, _) if *current == id => {
                    *link = Link::Idle;
                    true
                }
                _ => false,
            });
        }
    }

    /// After a call on connection `id` failed with `e`: drops the connection if broken, and
    /// returns the error to give, or `None` to retry once on the new owner (`MOVED`).
    fn failed(&self, id: u64, e: &RedisError, retried: &mut bool) -> Option<NodeError> {
        self.drop_if_broken(id, e);
        if e.code() == Some("MOVED") && !*retried {
            *retried = true;
            return None;
        }
        Some(NodeError::from_redis(e, self.spec.password()))
    }

    /// Runs `script` with `keys` and `args`, bounded by `timeout` (connecting included).
    /// The node's database index is appended as the last argument (the scripts' data-age proof
    /// names it), and the connection's facts are returned with the answer. In cluster mode the
    /// epoch marker among `keys` is replaced by the lock slot's, a `MOVED` answer is retried
    /// once on the new owner, and an `ASK` answer is followed for this call.
    pub async fn eval<T: FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
        timeout: Duration,
    ) -> Result<(T, Arc<NodeFacts>), NodeError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut retried = false;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let (mut conn, facts, id) = self.connection(left).await?;
            let slot_marker = facts
                .cluster
                .then(|| cluster::epoch_key(self.settings.slot));
            let keys: Vec<&str> = keys
                .iter()
                .map(|key| match &slot_marker {
                    Some(marker) if *key == super::EPOCH_KEY => marker.as_str(),
                    _ => key,
                })
                .collect();
            let mut invocation = script.prepare_invoke();
            for key in &keys {
                invocation.key(*key);
            }
            for arg in args {
                invocation.arg(*arg);
            }
            invocation.arg(self.db());
            match tokio::time::timeout_at(deadline, invocation.invoke_async(&mut conn)).await {
                Ok(Ok(value)) => return Ok((value, facts)),
                Ok(Err(e)) if e.code() == Some("ASK") => {
                    let asked = cluster::ask(&self.spec, &e, script, &keys, args, self.db());
                    return match tokio::time::timeout_at(deadline, asked).await {
                        Ok(result) => result.map(|value| (value, facts)),
                        Err(_) => Err(NodeError::timeout(timeout)),
                    };
                }
                Ok(Err(e)) => match self.failed(id, &e, &mut retried) {
                    None => continue,
                    Some(err) => return Err(err),
                },
                Err(_) => return Err(NodeError::timeout(timeout)),
            }
        }
    }

    /// The key of the epoch marker this node's scripts use: the node's, or in cluster mode the
    /// lock slot's (known once connected).
    pub fn epoch_key(&self) -> String {
        match self.facts() {
            Some(facts) if facts.cluster => cluster::epoch_key(self.settings.slot),
            _ => super::EPOCH_KEY.to_owned(),
        }
    }

    /// The hash slot of the lock's keys (used in cluster mode).
    pub fn slot(&self) -> u16 {
        self.settings.slot
    }

    /// Runs one plain command, bounded by `timeout` (used by the operator commands).
    pub async fn command<T: FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        timeout: Duration,
    ) -> Result<T, NodeError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let (mut conn, _, id) = self.connection(timeout).await?;
        match tokio::time::timeout_at(deadline, cmd.query_async(&mut conn)).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                self.drop_if_broken(id, &e);
                Err(NodeError::from_redis(&e, self.spec.password()))
            }
            Err(_) => Err(NodeError::timeout(timeout)),
        }
    }

    /// Reads `key` with plain commands (`GET` and `PTTL`, pipelined in one round trip),
    /// bounded by `timeout`: its value and remaining time, or `None` if there is none. A
    /// `MOVED` answer (cluster mode) is retried once on the new owner.
    pub async fn read_key(
        &self,
        key: &str,
        timeout: Duration,
    ) -> Result<Option<(String, Duration)>, NodeError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut retried = false;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let (mut conn, _, id) = self.connection_quiet(left).await?;
            let mut pipe = redis::pipe();
            pipe.cmd("GET").arg(key).cmd("PTTL").arg(key);
            let read = pipe.query_async::<(Option<String>, i64)>(&mut conn);
            match tokio::time::timeout_at(deadline, read).await {
                Ok(Ok((Some(value), pttl))) => {
                    // −1: no expiry (not a key of ours); −2: gone between the two commands.
                    return Ok(match u64::try_from(pttl) {
                        Ok(ms) => Some((value, Duration::from_millis(ms))),
                        Err(_) if pttl == -1 => Some((value, NO_EXPIRY)),
                        Err(_) => None,
                    });
                }
                Ok(Ok((None, _))) => return Ok(None),
                Ok(Err(e)) => match self.failed(id, &e, &mut retried) {
                    None => continue,
                    Some(err) => return Err(err),
                },
                Err(_) => return Err(NodeError::timeout(timeout)),
            }
        }
    }

    /// Subscribes to `channels`, and to `optional` where the node allows it (an ACL that
    /// does not list it costs only its messages), and streams what they carry: on the node's
    /// connection where it speaks RESP3 (connecting first if needed, within `timeout`), else on
    /// a dedicated pub/sub connection (for a Sentinel group, to the master named now). One
    /// stream at a time per node. `dropped` is a channel an earlier stream on the same
    /// connection subscribed to and this one does not want.
    pub async fn pushes(
        &self,
        channels: &[&str],
        optional: Option<&str>,
        dropped: Option<&str>,
        timeout: Duration,
    ) -> Result<Pushes, NodeError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let scrub = |e: RedisError| NodeError::from_redis(&e, self.spec.password());
        let (mut conn, facts, id) = self.connection_quiet(timeout).await?;
        if !facts.push {
            return self.dedicated_pushes(channels, optional, timeout).await;
        }
        let pushed = tokio::time::timeout_at(deadline, self.pushed.clone().lock_owned())
            .await
            .map_err(|_| NodeError::timeout(timeout))?;
        let subscribe = async {
            conn.subscribe(channels).await?;
            if let Some(optional) = optional {
                let _ = conn.subscribe(optional).await;
            }
            if let Some(dropped) = dropped {
                // Left subscribed, it only hears releases as before.
                let _ = conn.unsubscribe(dropped).await;
            }
            Ok::<_, RedisError>(())
        };
        match tokio::time::timeout_at(deadline, subscribe).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                self.drop_if_broken(id, &e);
                return Err(scrub(e));
            }
            Err(_) => return Err(NodeError::timeout(timeout)),
        }
        let state = (pushed, self.link.clone(), self.link.subscribe(), id);
        let stream = futures_util::stream::unfold(
            state,
            |(mut pushed, sender, mut link, id)| async move {
                loop {
                    let message = tokio::select! {
                        message = pushed.recv() => message,
                        changed = link.wait_for(|link| !matches!(link, Link::Up(_, _, current, _) if *current == id)) => {
                            let _ = changed;
                            return None;
                        }
                    };
                    match message {
                        Some((from, info)) if from == id => match info.kind {
                            redis::PushKind::Message => {
                                if let Some(message) = channel_message(&info.data) {
                                    return Some((message, (pushed, sender, link, id)));
                                }
                            }
                            redis::PushKind::Disconnection => {
                                // Gone: the next call dials again rather than fail on it first.
                                sender.send_if_modified(|link| match link {
                                    Link::Up(_, _, current, _) if *current == id => {
                                        *link = Link::Idle;
                                        true
                                    }
                                    _ => false,
                                });
                                return None;
                            }
                            _ => {}
                        },
                        Some(_) => {}
                        None => return None,
                    }
                }
            },
        );
        Ok(stream.boxed())
    }

    /// [`Node::pushes`] on a dedicated pub/sub connection (RESP2 servers and proxies).
    async fn dedicated_pushes(
        &self,
        channels: &[&str],
        optional: Option<&str>,
        timeout: Duration,
    ) -> Result<Pushes, NodeError> {
        let scrub = |e: RedisError| NodeError::from_redis(&e, self.spec.password());
        let connect = async {
            let (client, _) = self.dial.client(&self.spec, timeout).await?;
            let mut pubsub = client.get_async_pubsub().await.map_err(scrub)?;
            pubsub.subscribe(channels).await.map_err(scrub)?;
            if let Some(optional) = optional {
                let _ = pubsub.subscribe(optional).await;
            }
            Ok(pubsub)
        };
        let pubsub = match tokio::time::timeout(timeout, connect).await {
            Ok(result) => result?,
            Err(_) => return Err(NodeError::timeout(timeout)),
        };
        let messages = pubsub.into_on_message().map(|msg| {
            let payload: String = msg.get_payload().unwrap_or_default();
            (msg.get_channel_name().to_owned(), payload)
        });
        Ok(messages.boxed())
    }
}

/// The channel and payload of a pushed `message`; `None` for anything malformed.
fn channel_message(data: &[redis::Value]) -> Option<(String, String)> {
    let [channel, payload] = data else {
        return None;
    };
    let channel = String::from_redis_value_ref(channel).ok()?;
    let payload = String::from_redis_value_ref(payload).ok()?;
    Some((channel, payload))
}

/// Reads a node's [`NodeFacts`] on `conn`.
async fn read_facts(conn: &mut MultiplexedConnection) -> Result<NodeFacts, RedisError> {
    let (server, replication, memory, cluster): (String, String, String, String) = redis::pipe()
        .cmd("INFO")
        .arg("server")
        .cmd("INFO")
        .arg("replication")
        .cmd("INFO")
        .arg("memory")
        .cmd("INFO")
        .arg("cluster")
        .query_async(conn)
        .await?;
    let mut facts = NodeFacts::parse(&server, &replication, &memory);
    facts.cluster = info_field(&cluster, "cluster_enabled") == "1";
    Ok(facts)
}

/// Connects with `client` (bounded by the connect timeout) and reads the node's facts.
/// With `push`, the connection speaks RESP3 and forwards what is pushed on it, unless the
/// server refuses RESP3 (then RESP2, and the facts say `push: false`).
pub(super) async fn open(
    spec: &NodeSpec,
    client: &Client,
    settings: ConnectSettings,
    push: Option<&PushTag>,
) -> Result<(MultiplexedConnection, NodeFacts), NodeError> {
    let scrub = |e: RedisError| NodeError::from_redis(&e, spec.password());
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(settings.connect_timeout))
        .set_response_timeout(None);
    if let Some(tag) = push {
        let info = client.get_connection_info().clone();
        let resp3 = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let client = Client::open(info.set_redis_settings(resp3)).map_err(scrub)?;
        let config = config.clone().set_push_sender(tag.clone());
        match client
            .get_multiplexed_async_connection_with_config(&config)
            .await
        {
            Ok(mut conn) => {
                let mut facts = read_facts(&mut conn).await.map_err(scrub)?;
                facts.push = true;
                return Ok((conn, facts));
            }
            Err(e) if !refuses_resp3(&e) => return Err(scrub(e)),
            Err(_) => {}
        }
    }
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .map_err(scrub)?;
    let facts = read_facts(&mut conn).await.map_err(scrub)?;
    Ok((conn, facts))
}

/// Whether a failed RESP3 connection attempt is worth one in RESP2: the server answered, and
/// not about credentials (Redis 5 and some proxies do not know `HELLO`).
fn refuses_resp3(err: &RedisError) -> bool {
    !(err.is_io_error()
        || err.is_connection_refusal()
        || err.is_timeout()
        || matches!(err.code(), Some("WRONGPASS" | "NOAUTH")))
}

/// Connects to `host:port` with `spec`'s credentials and TLS, and reads its facts; the facts'
/// address is `host:port`. With `push`, as [`open`].
pub(super) async fn open_at(
    spec: &NodeSpec,
    host: &str,
    port: u16,
    settings: ConnectSettings,
    push: Option<&PushTag>,
) -> Result<(MultiplexedConnection, NodeFacts), NodeError> {
    // Credentials kept in files are read again for every connection.
    let spec = &spec.current().await?;
    let client = spec.client_at(host, port)?;
    let (conn, mut facts) = open(spec, &client, settings, push).await?;
    facts.address = sentinel::addr_label(&spec.info_at(host, port)?);
    Ok((conn, facts))
}

/// The first of `seeds` (a cluster's masters) that answers.
async fn open_any(
    spec: &NodeSpec,
    seeds: &std::sync::Mutex<Vec<(String, u16)>>,
    settings: ConnectSettings,
    push: &PushTag,
) -> Option<(MultiplexedConnection, NodeFacts)> {
    let seeds = seeds.lock().map(|s| s.clone()).unwrap_or_default();
    for (host, port) in seeds {
        if let Ok(opened) = open_at(spec, &host, port, settings, Some(push)).await {
            return Some(opened);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_come_from_the_info_sections() {
        let facts = NodeFacts::parse(
            "# Server\r\nredis_version:7.0.15\r\nrun_id:abc123\r\n",
            "# Replication\r\nrole:slave\r\n",
            "# Memory\r\nmaxmemory:0\r\nmaxmemory_policy:allkeys-lru\r\n",
        );
        assert_eq!(facts.run_id, "abc123");
        assert_eq!(facts.role, "slave");
        assert_eq!(facts.maxmemory_policy, "allkeys-lru");
        assert!(facts.may_evict());
        assert!(!NodeFacts::parse("", "", "maxmemory_policy:noeviction").may_evict());
    }
}

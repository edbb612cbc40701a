//! One Redis master: its address (credentials kept secret), its connection, its errors.
//!
//! ## Behaviour
//! - One multiplexed connection per node, made lazily (in the background, bounded by the
//!   connect timeout) and remade after I/O errors.
//! - On every new connection the node's [`NodeFacts`] (run id, eviction policy) are read
//!   once. The run id serves "one server, one vote" and `check`; the data-age proof does not
//!   rely on it (a proxy may keep a connection while it re-dials another server): the scripts
//!   read the server's lineage themselves. The eviction policy can change under a live
//!   connection: it is read again in the background once it is older than [`FACTS_MAX_AGE`].
//! - Credentials kept in files are read again for every new connection (see `secrets`).
//! - Every call is bounded by the caller's timeout: a hung node costs at most that.
//! - Scripts go by `EVALSHA`, falling back to `EVAL` when the node does not know them
//!   (after a restart, say).
//! - Passwords never leave this module: `Debug` and `Display` show `host:port`, and
//!   error texts are scrubbed of the password before they are kept.

use std::fmt;
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, Client, ClientTlsConfig, ConnectionAddr, ConnectionInfo, FromRedisValue,
    IntoConnectionInfo, RedisError, Script, TlsCertificates,
};
use tokio::sync::watch;

use super::error::ConfigError;
use super::secrets::SecretFiles;

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
            .field("files", &self.files)
            .finish()
    }
}

/// A parsed node address. `Debug`/`Display` show only `host:port`.
#[derive(Clone)]
pub struct NodeSpec {
    label: String,
    info: ConnectionInfo,
    tls: bool,
    ca_pem: Option<Vec<u8>>,
    client_cert: Option<ClientCert>,
    /// Read again for every new connection; the URL's own password wins over the file's.
    files: SecretFiles,
    url_has_password: bool,
}

impl NodeSpec {
    /// Parses a `redis://` or `rediss://` URL, filling in credentials it lacks.
    ///
    /// The error never contains the URL itself (it may hold a password); it names
    /// the node by its position in the list instead.
    pub fn parse(position: usize, url: &str, creds: &Credentials) -> Result<NodeSpec, ConfigError> {
        let bad = |why: &str| ConfigError::new("--redis", format!("node #{}: {why}", position + 1));
        let scheme = url.split("://").next().unwrap_or_default();
        if !matches!(scheme, "redis" | "rediss") || !url.contains("://") {
            return Err(bad("URL must start with redis:// or rediss://"));
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
        let mut settings = info.redis_settings().clone();
        let url_has_password = settings.password().is_some();
        if settings.password().is_none() {
            if let Some(password) = &creds.password {
                settings = settings.set_password(password);
            }
            if settings.username().is_none() {
                if let Some(username) = &creds.username {
                    settings = settings.set_username(username);
                }
            }
        }
        let info = info.set_redis_settings(
            settings.set_lib_name("redlock-sidecar", env!("CARGO_PKG_VERSION")),
        );
        let spec = NodeSpec {
            label,
            info,
            tls,
            ca_pem: creds.ca_pem.clone(),
            client_cert: creds.client_cert.clone(),
            files: creds.files.clone(),
            url_has_password,
        };
        // Unparsable PEM is a configuration error now, not a connection error on every call.
        if tls {
            if let Some(ca) = &spec.ca_pem {
                tls_client(&spec.info, Some(ca), None).map_err(|_| {
                    ConfigError::new("--redis-ca-file", "not a valid PEM bundle of certificates")
                })?;
            }
            if spec.client_cert.is_some() {
                spec.client().map_err(|_| {
                    ConfigError::new(
                        "--redis-client-cert",
                        "the client certificate or its key (--redis-client-key) is not valid PEM",
                    )
                })?;
            }
        }
        Ok(spec)
    }

    /// `host:port`, safe to log and to use as a metric label.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The identity used to refuse duplicates and to fingerprint the node set: address
    /// (host lower-cased) and database.
    pub fn identity(&self) -> (String, i64) {
        (self.label.to_lowercase(), self.info.redis_settings().db())
    }

    fn password(&self) -> Option<&str> {
        self.info.redis_settings().password()
    }

    /// This spec with the credential files read again (rotated secrets), or as it is when
    /// none comes from a file.
    fn current(&self) -> Result<NodeSpec, ConfigError> {
        if !self.files.any() {
            return Ok(self.clone());
        }
        let loaded = self.files.load()?;
        let mut spec = self.clone();
        if let (Some(password), false) = (loaded.password, self.url_has_password) {
            let settings = spec.info.redis_settings().clone().set_password(password);
            spec.info = spec.info.set_redis_settings(settings);
        }
        spec.ca_pem = loaded.ca_pem.or(spec.ca_pem);
        spec.client_cert = loaded.client_cert.or(spec.client_cert);
        Ok(spec)
    }

    /// A client for the credentials as they are now (see [`NodeSpec::current`]), and the
    /// password it uses (to scrub it from error texts).
    fn fresh_client(&self) -> Result<(Client, Option<String>), NodeError> {
        let spec = self.current().map_err(|err| NodeError {
            kind: NodeErrorKind::Auth,
            message: err.to_string(),
        })?;
        let password = spec.password().map(str::to_owned);
        let client = spec
            .client()
            .map_err(|e| NodeError::from_redis(&e, password.as_deref()))?;
        Ok((client, password))
    }

    fn client(&self) -> Result<Client, RedisError> {
        if !self.tls || (self.ca_pem.is_none() && self.client_cert.is_none()) {
            return Client::open(self.info.clone());
        }
        tls_client(&self.info, self.ca_pem.as_ref(), self.client_cert.as_ref())
    }
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
    fn timeout(after: Duration) -> NodeError {
        NodeError {
            kind: NodeErrorKind::Timeout,
            message: format!("no answer within {after:?}"),
        }
    }

    fn from_redis(err: &RedisError, password: Option<&str>) -> NodeError {
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
}

/// What a node says about itself, read once per connection (the policy again every
/// [`FACTS_MAX_AGE`]). Behind a proxy that keeps connections the server may change under it,
/// so the data-age proof does not rest on the run id: the scripts read the lineage themselves.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// The server process' id (`INFO server`): new with every restart.
    pub run_id: String,
    /// `maxmemory-policy` (`INFO memory`): anything but `noeviction` may evict lock keys.
    pub maxmemory_policy: String,
}

impl NodeFacts {
    /// Whether the node may evict keys that have a ttl, such as lock keys.
    pub fn may_evict(&self) -> bool {
        self.maxmemory_policy != "noeviction"
    }

    fn parse(server: &str, memory: &str) -> NodeFacts {
        let field = |text: &str, name: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                .map(|v| v.trim().to_owned())
                .unwrap_or_default()
        };
        NodeFacts {
            run_id: field(server, "run_id"),
            maxmemory_policy: field(memory, "maxmemory_policy"),
        }
    }
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
    /// The password of the latest connection (rotated passwords included), to scrub errors.
    password: Arc<std::sync::Mutex<Option<String>>>,
    settings: ConnectSettings,
    link: Arc<watch::Sender<Link>>,
    connections: Arc<AtomicU64>,
    refreshing: Arc<AtomicBool>,
}

/// How old a connection's eviction policy may get before it is read again in the background
/// (one `INFO memory`): the policy can change under a live connection (`CONFIG SET`). 30 s keeps an idle standby under one command per node per second.
pub const FACTS_MAX_AGE: Duration = Duration::from_secs(30);

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Node({})", self.spec.label)
    }
}

impl Node {
    /// Prepares the connection; nothing is sent until the first call.
    pub fn new(spec: NodeSpec, settings: ConnectSettings) -> Result<Node, NodeError> {
        spec.client()
            .map_err(|e| NodeError::from_redis(&e, spec.password()))?;
        Ok(Node {
            password: Arc::new(std::sync::Mutex::new(spec.password().map(str::to_owned))),
            spec,
            settings,
            link: Arc::new(watch::channel(Link::Idle).0),
            connections: Arc::new(AtomicU64::new(0)),
            refreshing: Arc::new(AtomicBool::new(false)),
        })
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

    /// The live connection and its facts, connecting first if needed (within `timeout`).
    async fn connection(
        &self,
        timeout: Duration,
    ) -> Result<(MultiplexedConnection, Arc<NodeFacts>, u64), NodeError> {
        if let Some(up) = self.up(&self.link.borrow()) {
            return Ok(up);
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

    /// Connects and reads the node's facts, bounded by the connect timeout; publishes the
    /// result on the link.
    fn connect_in_background(&self) {
        let link = self.link.clone();
        // Credentials from files are read again for every connection: a rotation is used
        // from the next one on.
        let (client, password) = match self.spec.fresh_client() {
            Ok(fresh) => fresh,
            Err(err) => {
                link.send_replace(Link::Down(err));
                return;
            }
        };
        *self.password.lock().unwrap_or_else(|e| e.into_inner()) = password.clone();
        let settings = self.settings;
        let id = self.connections.fetch_add(1, Ordering::Relaxed) + 1;
        let connect = async move {
            let config = AsyncConnectionConfig::new()
                .set_connection_timeout(Some(settings.connect_timeout))
                .set_response_timeout(None);
            let mut conn = client
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            let facts = read_facts(&mut conn).await?;
            Ok::<_, RedisError>((conn, facts))
        };
        let connect_timeout = settings.connect_timeout;
        tokio::spawn(async move {
            let next = match tokio::time::timeout(connect_timeout, connect).await {
                Ok(Ok((conn, facts))) => Link::Up(conn, Arc::new(facts), id, Instant::now()),
                Ok(Err(err)) => Link::Down(NodeError::from_redis(&err, password.as_deref())),
                Err(_) => Link::Down(NodeError::timeout(connect_timeout)),
            };
            link.send_replace(next);
        });
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
                        let policy = NodeFacts::parse("", &memory).maxmemory_policy;
                        *facts = Arc::new(NodeFacts {
                            run_id: facts.run_id.clone(),
                            maxmemory_policy: policy,
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

    /// Forgets connection `id` after an error that means it is broken; the next call
    /// reconnects (and reads the node's facts again).
    fn drop_if_broken(&self, id: u64, err: &RedisError) {
        if err.is_io_error() || err.is_connection_dropped() || err.is_connection_refusal() {
            self.link.send_if_modified(|link| match link {
                Link::Up(_, _, current, _) if *current == id => {
                    *link = Link::Idle;
                    true
                }
                _ => false,
            });
        }
    }

    /// Runs `script` with `keys` and `args`, bounded by `timeout` (connecting included).
    /// The node's database index is appended as the last argument (the scripts' data-age proof
    /// names it), and the connection's facts are returned with the answer.
    pub async fn eval<T: FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
        timeout: Duration,
    ) -> Result<(T, Arc<NodeFacts>), NodeError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let (mut conn, facts, id) = self.connection(timeout).await?;
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(*key);
        }
        for arg in args {
            invocation.arg(*arg);
        }
        invocation.arg(self.spec.info.redis_settings().db());
        match tokio::time::timeout_at(deadline, invocation.invoke_async(&mut conn)).await {
            Ok(Ok(value)) => Ok((value, facts)),
            Ok(Err(e)) => {
                self.drop_if_broken(id, &e);
                Err(self.error(&e))
            }
            Err(_) => Err(NodeError::timeout(timeout)),
        }
    }

    /// `err` as a [`NodeError`], scrubbed of the password in use.
    fn error(&self, err: &RedisError) -> NodeError {
        let password = self.password.lock().unwrap_or_else(|e| e.into_inner());
        NodeError::from_redis(err, password.as_deref())
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
                Err(self.error(&e))
            }
            Err(_) => Err(NodeError::timeout(timeout)),
        }
    }

    /// A dedicated pub/sub connection (pub/sub cannot share the multiplexed one).
    pub async fn pubsub(&self, timeout: Duration) -> Result<redis::aio::PubSub, NodeError> {
        let (client, password) = self.spec.fresh_client()?;
        match tokio::time::timeout(timeout, client.get_async_pubsub()).await {
            Ok(result) => result.map_err(|e| NodeError::from_redis(&e, password.as_deref())),
            Err(_) => Err(NodeError::timeout(timeout)),
        }
    }
}

/// Reads a node's [`NodeFacts`] on `conn`.
async fn read_facts(conn: &mut MultiplexedConnection) -> Result<NodeFacts, RedisError> {
    let (server, memory): (String, String) = redis::pipe()
        .cmd("INFO")
        .arg("server")
        .cmd("INFO")
        .arg("memory")
        .query_async(conn)
        .await?;
    Ok(NodeFacts::parse(&server, &memory))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_come_from_the_info_sections() {
        let facts = NodeFacts::parse(
            "# Server\r\nredis_version:7.0.15\r\nrun_id:abc123\r\n",
            "# Memory\r\nmaxmemory:0\r\nmaxmemory_policy:allkeys-lru\r\n",
        );
        assert_eq!(facts.run_id, "abc123");
        assert_eq!(facts.maxmemory_policy, "allkeys-lru");
        assert!(facts.may_evict());
        assert!(!NodeFacts::parse("", "maxmemory_policy:noeviction").may_evict());
    }
}

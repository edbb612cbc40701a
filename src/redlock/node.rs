//! One Redis master: its address (credentials kept secret), its connection, its errors.
//!
//! ## Behaviour
//! - One multiplexed connection per node, made lazily and remade after I/O errors
//!   (redis-rs `ConnectionManager`), with connect and response timeouts always set.
//! - Every call is bounded by the caller's timeout: a hung node costs at most that.
//! - Scripts go by `EVALSHA`, falling back to `EVAL` when the node does not know them
//!   (after a restart, say).
//! - Passwords never leave this module: `Debug` and `Display` show `host:port`, and
//!   error texts are scrubbed of the password before they are kept.

use std::fmt;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{
    Client, ClientTlsConfig, ConnectionAddr, ConnectionInfo, FromRedisValue, IntoConnectionInfo,
    RedisError, Script, TlsCertificates,
};

use super::error::ConfigError;

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

    /// The identity used to refuse duplicates: address and database.
    pub fn identity(&self) -> (String, i64) {
        (self.label.clone(), self.info.redis_settings().db())
    }

    fn password(&self) -> Option<&str> {
        self.info.redis_settings().password()
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
    /// Bound on establishing a connection (TCP, TLS, AUTH).
    pub connect_timeout: Duration,
    /// Bound on one request once connected.
    pub response_timeout: Duration,
}

/// A live node: its address and its self-reconnecting connection.
pub struct Node {
    spec: NodeSpec,
    client: Client,
    conn: ConnectionManager,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Node({})", self.spec.label)
    }
}

impl Node {
    /// Prepares the connection; nothing is sent until the first call.
    pub fn new(spec: NodeSpec, settings: ConnectSettings) -> Result<Node, NodeError> {
        let password = spec.password().map(str::to_owned);
        let scrub = |e: RedisError| NodeError::from_redis(&e, password.as_deref());
        let client = spec.client().map_err(scrub)?;
        // No retries inside a call: a failed connect surfaces as its own error (auth,
        // protocol, refused) and the next call tries again.
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(settings.connect_timeout))
            .set_response_timeout(Some(settings.response_timeout))
            .set_number_of_retries(0);
        let conn =
            ConnectionManager::new_lazy_with_config(client.clone(), config).map_err(scrub)?;
        Ok(Node { spec, client, conn })
    }

    /// `host:port`.
    pub fn label(&self) -> &str {
        self.spec.label()
    }

    /// Runs `script` with `keys` and `args`, bounded by `timeout`.
    pub async fn eval<T: FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
        timeout: Duration,
    ) -> Result<T, NodeError> {
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(*key);
        }
        for arg in args {
            invocation.arg(*arg);
        }
        let mut conn = self.conn.clone();
        match tokio::time::timeout(timeout, invocation.invoke_async(&mut conn)).await {
            Ok(result) => result.map_err(|e| NodeError::from_redis(&e, self.spec.password())),
            Err(_) => Err(NodeError::timeout(timeout)),
        }
    }

    /// Runs one plain command, bounded by `timeout` (used by the operator commands).
    pub async fn command<T: FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        timeout: Duration,
    ) -> Result<T, NodeError> {
        let mut conn = self.conn.clone();
        match tokio::time::timeout(timeout, cmd.query_async(&mut conn)).await {
            Ok(result) => result.map_err(|e| NodeError::from_redis(&e, self.spec.password())),
            Err(_) => Err(NodeError::timeout(timeout)),
        }
    }

    /// A dedicated pub/sub connection (pub/sub cannot share the multiplexed one).
    pub async fn pubsub(&self, timeout: Duration) -> Result<redis::aio::PubSub, NodeError> {
        match tokio::time::timeout(timeout, self.client.get_async_pubsub()).await {
            Ok(result) => result.map_err(|e| NodeError::from_redis(&e, self.spec.password())),
            Err(_) => Err(NodeError::timeout(timeout)),
        }
    }
}

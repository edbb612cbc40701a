//! Where a node is and how to authenticate to it: parsed URLs, credentials and TLS, no I/O
//! beyond reading rotated credential files (see `secrets`).
//!
//! ## Behaviour
//! - Passwords never leave this module: `Debug` and `Display` show `host:port`, and error
//!   texts are scrubbed of the password before they are kept.
//! - Credentials kept in files are read again for every new connection (`NodeSpec::current`).
//! - Unparsable PEM is a configuration error at start-up, not a connection error on every call.

use std::fmt;

use redis::{
    Client, ClientTlsConfig, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisError,
    TlsCertificates,
};

use super::error::{node_error, ConfigError, NodeError, NodeErrorKind};
use super::secrets::{ClientCert, SecretFiles};
use super::sentinel::{self, SentinelUrl};

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
    pub(super) label: String,
    /// The node; for a Sentinel group, the master as first named (its credentials and db; the
    /// address is replaced by the one the Sentinels give).
    pub(super) info: ConnectionInfo,
    pub(super) tls: bool,
    pub(super) ca_pem: Option<Vec<u8>>,
    pub(super) client_cert: Option<ClientCert>,
    pub(super) sentinel: Option<SentinelSpec>,
    /// Read again for every new connection; the URL's own password wins over the file's.
    pub(super) files: SecretFiles,
    pub(super) url_has_password: bool,
}

/// The Sentinels of a `redis+sentinel://` node, with their own credentials.
#[derive(Clone)]
pub(super) struct SentinelSpec {
    pub(super) url: SentinelUrl,
    /// One per Sentinel, credentials set.
    pub(super) infos: Vec<ConnectionInfo>,
    pub(super) password: Option<String>,
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
    /// servers by what they show instead, see `votes::NodeSet`.)
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

    pub(super) fn password(&self) -> Option<&str> {
        self.info.redis_settings().password()
    }

    /// This spec with the credential files read again (rotated secrets), or as it is when
    /// none comes from a file. The files are read off this thread, within a deadline.
    pub(super) async fn current(&self) -> Result<NodeSpec, NodeError> {
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
    pub(super) fn sentinel_clients(
        &self,
        sentinel: &SentinelSpec,
    ) -> Result<Vec<Client>, NodeError> {
        sentinel
            .infos
            .iter()
            .map(|info| self.client_for(info))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| node_error(&e, sentinel.password.as_deref()))
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
            .map_err(|e| node_error(&e, self.password()))
    }

    /// A client for the server `info` names, with this node's TLS settings.
    pub(super) fn client_for(&self, info: &ConnectionInfo) -> Result<Client, RedisError> {
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

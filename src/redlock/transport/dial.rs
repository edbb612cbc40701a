//! Dialling one server: the URL's, the master a Sentinel group names, or (see `cluster`) the
//! master of the lock's slot. Opens a connection and reads the node's facts on it.
//!
//! ## Behaviour
//! - Every connection is bounded by the connect timeout; requests carry their caller's.
//! - A connection speaks RESP3 where the server does, so pushes ride on it (`PushTag`); a
//!   server or proxy that refuses `HELLO 3` gets RESP2 (and its facts say `push: false`).
//! - Credentials kept in files are read again for every connection (see `secrets`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, ProtocolVersion, PushInfo, RedisError};
use tokio::sync::watch;

use super::error::{node_error, NodeError};
use super::facts::{read_facts, NodeFacts};
use super::hub::Hub;
use super::link::Link;
use super::sentinel::{self, Group};
use super::spec::NodeSpec;

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

/// Routes what connection `id` pushes to the streams of its node that subscribed, tagged with
/// the connection's number (a message of a connection since replaced is told apart and
/// dropped). Routed as the connection reads it, with no hand-over to another task on the way
/// to a waiter.
#[derive(Clone)]
pub(super) struct PushTag {
    pub(super) id: u64,
    pub(super) hub: Arc<Hub>,
    pub(super) link: Arc<watch::Sender<Link>>,
}

impl redis::aio::AsyncPushSender for PushTag {
    fn send(&self, info: PushInfo) -> Result<(), redis::aio::SendError> {
        self.hub.handle(self.id, info, &self.link);
        Ok(())
    }
}

/// How a node's server is reached.
pub(super) enum Dial {
    /// The URL's server.
    Direct(Box<Client>),
    /// The master the group's Sentinels name at the time of connecting.
    Sentinel(Arc<Group>),
}

impl Dial {
    /// How `spec` is reached; nothing is sent yet.
    pub(super) fn new(spec: &NodeSpec) -> Result<Dial, NodeError> {
        Ok(match &spec.sentinel {
            None => Dial::Direct(Box::new(
                spec.client_for(&spec.info)
                    .map_err(|e| node_error(&e, spec.password()))?,
            )),
            Some(sentinel) => {
                let clients = spec.sentinel_clients(sentinel)?;
                Dial::Sentinel(Arc::new(Group::new(
                    sentinel.url.clone(),
                    clients,
                    sentinel.password.clone(),
                )))
            }
        })
    }

    /// A client for the server to connect to now, and its `host:port`.
    pub(super) async fn client(
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
                    .map_err(|e| node_error(&e, spec.password()))?;
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
                    .map_err(|e| node_error(&e, spec.password()))?;
                Ok((client, sentinel::addr_label(&info)))
            }
        }
    }
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
    let scrub = |e: RedisError| node_error(&e, spec.password());
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
pub(super) async fn open_any(
    spec: &NodeSpec,
    seeds: &Mutex<Vec<(String, u16)>>,
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

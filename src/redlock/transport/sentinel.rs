//! A node that is a Sentinel-monitored group: one voter, resolved to its current master.
//!
//! URL: `redis+sentinel://[user:pass@]s1[:26379],s2[:26379],.../MASTER[/DB]` (and
//! `rediss+sentinel://`, TLS to the Sentinels and the master alike). The URL's credentials and
//! `--redis-username`/`--redis-password` authenticate to the *master*; the Sentinels get
//! `--sentinel-username`/`--sentinel-password` (none by default), since a Sentinel's
//! `requirepass` is its own setting.
//!
//! ## Behaviour
//! - Every new connection asks all Sentinels at once, `SENTINEL GET-MASTER-ADDR-BY-NAME`, and
//!   dials the first address one gives; it is used only if that server's `INFO replication`
//!   says `role:master`. The whole resolution fits in the connect timeout.
//! - The connection is dropped (so the next call resolves again) when it breaks, when the
//!   server answers `READONLY` or `MASTERDOWN` (a demoted or cut-off master), and when a
//!   Sentinel announces `+switch-master` for the group (one subscription per group, moved to
//!   the next Sentinel when it breaks).
//! - Safety does not rest on any of this being prompt: a failover gives the group a master
//!   with another run id and replication id, so its epoch marker is young and its grants do
//!   not count for ttl + drift (see `votes`). Following the group only makes the lock
//!   available again.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use redis::{AsyncConnectionConfig, Client, ConnectionAddr, ConnectionInfo, IntoConnectionInfo};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::error::{node_error, NodeError, NodeErrorKind};
use crate::clock::{self, Deadline};

/// The Sentinel port when the URL gives none.
pub const DEFAULT_SENTINEL_PORT: u16 = 26379;

/// At most this many Sentinels per group (a deployment has 3 or 5).
const MAX_SENTINELS: usize = 16;

/// The channel on which Sentinels announce a new master: `NAME OLD-IP OLD-PORT NEW-IP NEW-PORT`.
const SWITCH_MASTER: &str = "+switch-master";

/// A `redis+sentinel://` URL, parsed (no I/O).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SentinelUrl {
    /// `rediss+sentinel://`: TLS to the Sentinels and the master.
    pub tls: bool,
    /// The URL's `user:pass`, still percent-encoded, for the master.
    pub userinfo: Option<String>,
    /// The Sentinels' addresses, in the URL's order.
    pub sentinels: Vec<(String, u16)>,
    /// The monitored master's name (`sentinel monitor NAME ...`).
    pub master: String,
    /// The database index on the master.
    pub db: i64,
}

/// Whether `url` names a Sentinel group (its scheme ends in `+sentinel`).
pub fn is_sentinel_url(url: &str) -> bool {
    matches!(
        url.split_once("://").map(|(scheme, _)| scheme),
        Some("redis+sentinel" | "rediss+sentinel")
    )
}

impl SentinelUrl {
    /// Parses a Sentinel URL; the error says what is wrong and never repeats the URL.
    pub fn parse(url: &str) -> Result<SentinelUrl, String> {
        let (scheme, rest) = url
            .split_once("://")
            .ok_or("URL must start with redis+sentinel:// or rediss+sentinel://")?;
        let tls = match scheme {
            "redis+sentinel" => false,
            "rediss+sentinel" => true,
            _ => return Err("URL must start with redis+sentinel:// or rediss+sentinel://".into()),
        };
        if rest.contains(['?', '#']) {
            return Err("a Sentinel URL takes no query or fragment".into());
        }
        let (authority, path) = rest
            .split_once('/')
            .ok_or("the master's name is missing: redis+sentinel://HOST[:PORT],.../MASTER[/DB]")?;
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo.to_owned()), hosts),
            None => (None, authority),
        };
        let sentinels = hosts
            .split(',')
            .map(parse_host_port)
            .collect::<Result<Vec<_>, _>>()?;
        if sentinels.len() > MAX_SENTINELS {
            return Err(format!("at most {MAX_SENTINELS} Sentinels per group"));
        }
        let (master, db) = match path.split_once('/') {
            Some((master, db)) => (master, db),
            None => (path, "0"),
        };
        if master.is_empty()
            || master.len() > 200
            || master.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(
                "the master's name must be 1 to 200 characters without spaces or control characters"
                    .into(),
            );
        }
        let db: i64 = match db.parse::<u32>() {
            Ok(db) if db < 1 << 16 => i64::from(db),
            _ => return Err("the database index must be a number from 0 to 65535".into()),
        };
        Ok(SentinelUrl {
            tls,
            userinfo,
            sentinels,
            master: master.to_owned(),
            db,
        })
    }

    /// `MASTER@s1:26379,s2:26379`: safe to log and to use as a metric label.
    pub fn label(&self) -> String {
        let mut label = format!("{}@", self.master);
        for (i, (host, port)) in self.sentinels.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            let _ = write!(label, "{sep}{}", host_port(host, *port));
        }
        label
    }

    /// The identity of the group for refusing duplicates: the master's
    /// name and the Sentinels (host lower-cased, sorted, so their order does not matter).
    pub fn identity(&self) -> String {
        let mut hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|(host, port)| host_port(&host.to_lowercase(), *port))
            .collect();
        hosts.sort();
        hosts.dedup();
        format!("sentinel:{}/{}", hosts.join(","), self.master)
    }

    fn scheme(&self) -> &'static str {
        if self.tls {
            "rediss"
        } else {
            "redis"
        }
    }

    /// The connection info of the master at `host:port`, with the URL's credentials and db.
    pub fn master_info(&self, host: &str, port: u16) -> Result<ConnectionInfo, String> {
        let userinfo = self
            .userinfo
            .as_ref()
            .map_or(String::new(), |u| format!("{u}@"));
        format!(
            "{}://{userinfo}{}/{}",
            self.scheme(),
            host_port(host, port),
            self.db
        )
        .into_connection_info()
        .map_err(|_| "the credentials or an address do not form a valid Redis URL".to_owned())
    }

    /// The connection info of every Sentinel (no credentials yet).
    pub fn sentinel_infos(&self) -> Result<Vec<ConnectionInfo>, String> {
        self.sentinels
            .iter()
            .map(|(host, port)| {
                format!("{}://{}", self.scheme(), host_port(host, *port))
                    .into_connection_info()
                    .map_err(|_| "a Sentinel address is not valid".to_owned())
            })
            .collect()
    }
}

/// `host:port`, with brackets around an IPv6 address.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// `host`, `host:port`, `[v6]`, `[v6]:port`.
fn parse_host_port(text: &str) -> Result<(String, u16), String> {
    let bad = || "each Sentinel must be HOST or HOST:PORT (IPv6 in brackets)".to_owned();
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or_else(bad)?;
        match after {
            "" => (host, None),
            _ => (host, Some(after.strip_prefix(':').ok_or_else(bad)?)),
        }
    } else {
        match text.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (text, None),
        }
    };
    let valid_host = !host.is_empty()
        && host.len() <= 253
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':'));
    if !valid_host || (host.contains(':') && !text.starts_with('[')) {
        return Err(bad());
    }
    let port = match port {
        None => DEFAULT_SENTINEL_PORT,
        Some(port) => match port.parse::<u16>() {
            Ok(port) if port > 0 => port,
            _ => return Err(bad()),
        },
    };
    Ok((host.to_owned(), port))
}

/// A Sentinel group at run time: clients for its Sentinels, and how to dial its master.
pub struct Group {
    url: SentinelUrl,
    /// Replaced when the Sentinels' password file changes ([`Group::set_credentials`]).
    sentinels: std::sync::RwLock<Arc<Sentinels>>,
    /// The Sentinel that answered last: asked first next time (they are all asked at once,
    /// so this only orders the log).
    preferred: AtomicUsize,
}

/// Clients for every Sentinel of a group, with the password they carry.
struct Sentinels {
    clients: Vec<Client>,
    /// Scrubbed from every error kept.
    password: Option<String>,
}

impl Sentinels {
    fn error(&self, err: &redis::RedisError) -> NodeError {
        node_error(err, self.password.as_deref())
    }
}

impl Group {
    /// Clients for every Sentinel of `url`, with `sentinels` (ready-made connection infos,
    /// credentials set) built by the caller, which owns TLS.
    pub fn new(url: SentinelUrl, sentinels: Vec<Client>, password: Option<String>) -> Group {
        Group {
            url,
            sentinels: std::sync::RwLock::new(Arc::new(Sentinels {
                clients: sentinels,
                password,
            })),
            preferred: AtomicUsize::new(0),
        }
    }

    /// Whether the Sentinels' clients carry `password`.
    pub fn has_password(&self, password: Option<&str>) -> bool {
        self.sentinels().password.as_deref() == password
    }

    /// New clients for the Sentinels (a rotated password): used from the next request on.
    pub fn set_credentials(&self, sentinels: Vec<Client>, password: Option<String>) {
        let fresh = Arc::new(Sentinels {
            clients: sentinels,
            password,
        });
        *self
            .sentinels
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = fresh;
    }

    fn sentinels(&self) -> Arc<Sentinels> {
        self.sentinels
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The master's name.
    pub fn master(&self) -> &str {
        &self.url.master
    }

    /// The parsed URL.
    pub fn url(&self) -> &SentinelUrl {
        &self.url
    }

    /// Asks every Sentinel at once for the master's address; the first that gives one wins.
    /// Each Sentinel's attempt is bounded by `timeout`.
    pub async fn resolve(&self, timeout: Duration) -> Result<(String, u16), NodeError> {
        let count = self.url.sentinels.len();
        let preferred = self.preferred.load(Ordering::Relaxed) % count.max(1);
        let order = (0..count).map(|i| (i + preferred) % count);
        let mut asks: FuturesUnordered<_> = order
            .map(|index| async move { (index, self.ask(index, timeout).await) })
            .collect();
        let mut unknown = 0;
        let mut errors = Vec::new();
        while let Some((index, answer)) = asks.next().await {
            match answer {
                Ok(Some(addr)) => {
                    self.preferred.store(index, Ordering::Relaxed);
                    return Ok(addr);
                }
                Ok(None) => unknown += 1,
                Err(err) => errors.push(format!(
                    "{}: {err}",
                    host_port(&self.url.sentinels[index].0, self.url.sentinels[index].1)
                )),
            }
        }
        if unknown > 0 {
            return Err(NodeError {
                kind: NodeErrorKind::Other,
                message: format!(
                    "{unknown} Sentinel(s) answered but do not monitor a master named {:?}",
                    self.url.master
                ),
            });
        }
        Err(NodeError {
            kind: NodeErrorKind::Connection,
            message: format!(
                "no Sentinel of {} answered: {}",
                self.url.master,
                errors.join("; ")
            ),
        })
    }

    /// One Sentinel's answer: the master's address, `None` if it does not know the name.
    async fn ask(
        &self,
        index: usize,
        timeout: Duration,
    ) -> Result<Option<(String, u16)>, NodeError> {
        let ask = async {
            let config = AsyncConnectionConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout));
            let sentinels = self.sentinels();
            let mut conn = sentinels.clients[index]
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .map_err(|e| sentinels.error(&e))?;
            let answer: Option<(String, String)> = redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(&self.url.master)
                .query_async(&mut conn)
                .await
                .map_err(|e| sentinels.error(&e))?;
            match answer {
                None => Ok(None),
                Some((host, port)) => match port.parse::<u16>() {
                    Ok(port) if !host.is_empty() => Ok(Some((host, port))),
                    _ => Err(NodeError {
                        kind: NodeErrorKind::Protocol,
                        message: "the Sentinel answered an address that is not HOST PORT".into(),
                    }),
                },
            }
        };
        match clock::within(timeout, ask).await {
            Ok(answer) => answer,
            Err(_) => Err(NodeError {
                kind: NodeErrorKind::Timeout,
                message: format!("no answer within {timeout:?}"),
            }),
        }
    }

    /// Subscribes to `+switch-master` on one Sentinel after another (backing off while none
    /// answers) and calls `switched` whenever the group's master changes, until `stop`.
    pub async fn follow(
        self: Arc<Self>,
        timeout: Duration,
        stop: CancellationToken,
        switched: impl Fn(),
    ) {
        let mut backoff = Duration::from_millis(250);
        let mut index = self.preferred.load(Ordering::Relaxed);
        loop {
            index %= self.url.sentinels.len().max(1);
            let watch = async {
                let client = self.sentinels().clients[index].clone();
                let pubsub = clock::within(timeout, client.get_async_pubsub()).await;
                let Ok(Ok(mut pubsub)) = pubsub else {
                    return false;
                };
                if pubsub.subscribe(SWITCH_MASTER).await.is_err() {
                    return false;
                }
                let mut messages = pubsub.on_message();
                while let Some(message) = messages.next().await {
                    let payload: String = message.get_payload().unwrap_or_default();
                    if let Some(to) = switched_to(&payload, &self.url.master) {
                        info!(group = %self.url.master, master = %to, "Sentinel switched the master; following it");
                        switched();
                    }
                }
                true
            };
            let subscribed = tokio::select! {
                _ = stop.cancelled() => return,
                subscribed = watch => subscribed,
            };
            if subscribed {
                backoff = Duration::from_millis(250);
            } else {
                backoff = (backoff * 2).min(Duration::from_secs(5));
                if index + 1 == self.url.sentinels.len() {
                    warn!(group = %self.url.master, "no Sentinel accepts a +switch-master subscription; failovers are followed on errors only");
                }
            }
            index += 1;
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = clock::sleep_until_deadline(Deadline::now() + backoff) => {}
            }
        }
    }
}

/// The new master's `host:port` if `payload` (a `+switch-master` message) is about `master`.
fn switched_to(payload: &str, master: &str) -> Option<String> {
    let words: Vec<&str> = payload.split_whitespace().collect();
    match words.as_slice() {
        [name, _, _, host, port] if *name == master => Some(host_port(host, port.parse().ok()?)),
        _ => None,
    }
}

/// The address a connection info dials, as `host:port`.
pub fn addr_label(info: &ConnectionInfo) -> String {
    match info.addr() {
        ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
            host_port(host, *port)
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_sentinel_url_names_the_sentinels_the_master_and_the_db() {
        let url =
            SentinelUrl::parse("redis+sentinel://u:p%40ss@s1,s2:26380,[::1]:5/mymaster/3").unwrap();
        assert_eq!(
            url,
            SentinelUrl {
                tls: false,
                userinfo: Some("u:p%40ss".into()),
                sentinels: vec![
                    ("s1".into(), 26379),
                    ("s2".into(), 26380),
                    ("::1".into(), 5)
                ],
                master: "mymaster".into(),
                db: 3,
            }
        );
        assert_eq!(url.label(), "mymaster@s1:26379,s2:26380,[::1]:5");
        let info = url.master_info("10.0.0.7", 6379).unwrap();
        assert_eq!(info.redis_settings().password(), Some("p@ss"));
        assert_eq!(info.redis_settings().db(), 3);
        assert_eq!(addr_label(&info), "10.0.0.7:6379");
        let tls = SentinelUrl::parse("rediss+sentinel://s1/m").unwrap();
        assert!(tls.tls && tls.db == 0);
        assert!(matches!(
            tls.master_info("h", 1).unwrap().addr(),
            ConnectionAddr::TcpTls { .. }
        ));
    }

    #[test]
    fn the_identity_ignores_the_order_of_the_sentinels() {
        let a = SentinelUrl::parse("redis+sentinel://S1:1,s2:2/m").unwrap();
        let b = SentinelUrl::parse("redis+sentinel://s2:2,s1:1/m").unwrap();
        assert_eq!(a.identity(), b.identity());
        let other = SentinelUrl::parse("redis+sentinel://s2:2,s1:1/n").unwrap();
        assert_ne!(a.identity(), other.identity());
    }

    #[test]
    fn bad_sentinel_urls_say_why_without_repeating_the_url() {
        for (url, why) in [
            ("redis+sentinel://s1", "master's name is missing"),
            ("redis+sentinel://s1/", "master's name must be"),
            ("redis+sentinel://s1,,s2/m", "HOST or HOST:PORT"),
            ("redis+sentinel://s1:0/m", "HOST or HOST:PORT"),
            ("redis+sentinel://s1:99999/m", "HOST or HOST:PORT"),
            ("redis+sentinel://::1/m", "HOST or HOST:PORT"),
            ("redis+sentinel://:secret@/m", "HOST or HOST:PORT"),
            ("redis+sentinel://s1/m/x", "database index"),
            ("redis+sentinel://s1/m?x=1", "no query"),
            ("http+sentinel://s1/m", "must start with"),
        ] {
            let err = SentinelUrl::parse(url).unwrap_err();
            assert!(err.contains(why), "{url}: {err}");
            assert!(!err.contains("secret"));
        }
    }

    #[test]
    fn switch_master_messages_are_matched_by_group() {
        assert_eq!(
            switched_to("mymaster 127.0.0.1 6379 127.0.0.1 6380", "mymaster"),
            Some("127.0.0.1:6380".into())
        );
        assert_eq!(switched_to("other 1 2 3 4", "mymaster"), None);
        assert_eq!(switched_to("mymaster garbage", "mymaster"), None);
    }

    proptest! {
        #[test]
        fn parsing_any_text_never_panics(url in "(redis|rediss)\\+sentinel://[a-z0-9:@,\\[\\]/%.]{0,40}") {
            if let Ok(parsed) = SentinelUrl::parse(&url) {
                prop_assert!(!parsed.sentinels.is_empty());
                prop_assert!(!parsed.master.is_empty());
                let _ = parsed.master_info("h", 1);
                let _ = parsed.sentinel_infos();
            }
        }
    }
}

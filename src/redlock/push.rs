//! What the nodes push to waiters: releases, acquisitions and keyspace events of the lock key.
//!
//! ## Behaviour
//! - One subscription per node, on the node's connection where it speaks RESP3 (else on a
//!   dedicated pub/sub connection, see [`super::Node::pushes`]), to the acquisition
//!   channel `redlock:{name}:acquired` (a won round announces itself there from Rust, see
//!   [`Acquired`]) and, where this contender watches releases (about 50 per node past 50
//!   contenders, see [`watches_releases`]), the release channel `redlock:{name}:released` (the
//!   release script publishes the released value there; unchanged, so older versions, which
//!   always subscribe, understand it).
//! - Channels are scoped like keys: on a database other than 0 its index is part of the
//!   names (`redlock:{name}:db1:acquired`, see [`Channels::new`]), so one deployment's
//!   announcements and subscriber counts never reach another database's contenders.
//!   Announcements are input from anyone who may `PUBLISH` there: what a waiter takes from
//!   them is bounded by what the nodes show (see [`super::standby`]).
//! - With `keyspace_events` (opt-in), also the node's keyspace channel of the lock key
//!   (`__keyspace@<db>__:redlock:{name}`). Events arrive only where the node is configured to
//!   publish them (`notify-keyspace-events`); nothing asks the node's configuration (managed
//!   services often refuse `CONFIG`): events that come are used, events that do not cost
//!   nothing. Opt-in because every write to the key is one message per subscriber: with 1,000
//!   waiters, the writes of one contended wake-up (each losing round's `SET` and clean-up)
//!   became about a million messages, and the herd bench did not recover (see `redis.md`).
//! - The keyspace channel is subscribed on its own: an ACL user whose channel patterns do not
//!   cover it (`&__keyspace@*__:redlock:*`) loses only the keyspace events.
//! - A lost subscription is redialled with backoff (500 ms doubling to 30 s); its state is
//!   published per node so waiters read the nodes (and metrics show it) while it is missing.
//! - Nothing a node pushes can panic the parser: an unknown message is ignored.
//! - A won round is announced unless this lock's last announcement, less than
//!   [`QUIET_ANNOUNCEMENTS_FOR`] ago, reached no subscriber on any node ([`worth_announcing`]):
//!   a lock taken again and again with nobody waiting pays no `PUBLISH` per node each time. A
//!   waiter that subscribed since learns the holder from its own reads and rounds, as it would
//!   from a lost announcement.

use std::sync::Weak;
use std::time::Duration;

use crate::clock::{Clock, Deadline};

use futures_util::StreamExt;

use super::standby::{key_event, release_recheck_in, watches_releases, KeyEvent, READERS};
use super::Inner;

/// One message from node `node`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Push {
    /// The node it came from (configured order).
    pub node: usize,
    /// What it says.
    pub kind: PushKind,
}

/// What a push says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PushKind {
    /// A holder released; the identity part of its value.
    Released(String),
    /// A round was won.
    Acquired(Acquired),
    /// The lock key changed on this node.
    Key(KeyEvent),
}

/// The announcement of a won round: `v1 <fencing token> <validity ms> <waiters> <identity>`.
/// It never carries the lock value (whoever knows the value can release the lock). Anyone
/// who may `PUBLISH` can send one: a waiter takes from it only what the nodes bear out (see
/// [`super::standby`]), and not the waiter count, which is sent for older versions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acquired {
    /// The winner's identity.
    pub identity: String,
    /// Its fencing token.
    pub fencing_token: u64,
    /// Its validity when announced.
    pub validity: Duration,
    /// Subscribers of the acquisition channel on the node just before (the waiters).
    pub waiters: u64,
}

/// How long a lock whose last acquisition announcement reached nobody stops announcing.
pub const QUIET_ANNOUNCEMENTS_FOR: Duration = Duration::from_secs(1);

/// Whether a round won at `now` is announced, given the lock's last announcement: when it
/// was made and the most subscribers it reached on one node (`None`: none made, or no node
/// answered it yet).
pub fn worth_announcing(last: Option<(Deadline, Option<u64>)>, now: Deadline) -> bool {
    match last {
        Some((at, Some(0))) => now.saturating_duration_since(at) >= QUIET_ANNOUNCEMENTS_FOR,
        _ => true,
    }
}

impl Acquired {
    /// The message text.
    pub fn encode(&self) -> String {
        format!(
            "v1 {} {} {} {}",
            self.fencing_token,
            self.validity.as_millis(),
            self.waiters,
            self.identity
        )
    }

    /// Parses a message text; `None` for anything else.
    pub fn parse(text: &str) -> Option<Acquired> {
        let mut parts = text.splitn(5, ' ');
        if parts.next()? != "v1" {
            return None;
        }
        let fencing_token = parts.next()?.parse().ok()?;
        let validity = Duration::from_millis(parts.next()?.parse().ok()?);
        let waiters = parts.next()?.parse().ok()?;
        let identity = parts.next()?.to_owned();
        if identity.is_empty() {
            return None;
        }
        Some(Acquired {
            identity,
            fencing_token,
            validity,
            waiters,
        })
    }
}

/// The channels of one lock on one node.
#[derive(Clone, Debug)]
pub struct Channels {
    /// Release announcements (the release script publishes the value here).
    pub released: String,
    /// Acquisition announcements.
    pub acquired: String,
    /// The node's keyspace channel of the lock key.
    pub keyspace: String,
}

impl Channels {
    /// The channels of the lock whose key is `key`, on database `db`.
    ///
    /// Pub/sub is server-wide, whatever database a client selected, so the announcements are
    /// scoped like the keys: a database other than 0 is part of the name
    /// (`redlock:{name}:db3:released`). Database 0 keeps the names of older versions (and the
    /// only database of cluster mode); the `{name}` hash tag stays, so a channel lives in the
    /// lock key's slot.
    pub fn new(key: &str, db: i64) -> Channels {
        let scope = if db == 0 {
            String::new()
        } else {
            format!(":db{db}")
        };
        Channels {
            released: format!("{key}{scope}:released"),
            acquired: format!("{key}{scope}:acquired"),
            keyspace: format!("__keyspace@{db}__:{key}"),
        }
    }

    /// What a message on `channel` says; `None` if nothing we understand.
    pub fn decode(&self, channel: &str, payload: &str) -> Option<PushKind> {
        if channel == self.released {
            Some(PushKind::Released(super::identity_of(payload).to_owned()))
        } else if channel == self.acquired {
            Acquired::parse(payload).map(PushKind::Acquired)
        } else if channel == self.keyspace {
            key_event(payload).map(PushKind::Key)
        } else {
            None
        }
    }
}

/// Keeps node `index`'s subscription, reconnecting with backoff; publishes its state and
/// every message it understands. The release channel is subscribed only by those that
/// watch releases there (see [`watches_releases`]): decided on each subscription from the
/// channel's subscribers, and again at each count of the waiters (a change subscribes again).
pub(super) async fn listen(inner: Weak<Inner>, index: usize) {
    let mut backoff = Duration::from_millis(500);
    loop {
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let channels = strong.channels(index);
        let connect_timeout = strong.cfg.connect_timeout;
        let keyspace = strong.cfg.keyspace_events;
        let ttl = strong.cfg.ttl;
        let watchers = strong.release_watchers(index, &channels.released).await;
        let watching = strong.decide_release_watch(index, watchers);
        let mut announcements = vec![channels.acquired.as_str()];
        if watching {
            announcements.push(channels.released.as_str());
        }
        // Apart, so that an ACL that does not list the keyspace channel costs only the
        // keyspace events.
        let optional = keyspace.then_some(channels.keyspace.as_str());
        // A stream before this one on the same connection may have taken it.
        let dropped = (!watching).then_some(channels.released.as_str());
        let messages = strong.nodes[index]
            .subscribe(&announcements, optional, dropped, connect_timeout)
            .await;
        let pushes = strong.pushes().clone();
        let subscribed = strong.subscribed.clone();
        let mut changed = strong.watching_releases.subscribe();
        let observer = strong.observer.clone();
        drop(strong);
        let mut resubscribe = false;
        if let Ok(mut messages) = messages {
            backoff = Duration::from_millis(500);
            subscribed.send_modify(|s| s[index] = true);
            observer.subscription(index, true);
            let recheck =
                watching.then(|| Deadline::now() + release_recheck_in(ttl, true, rand::random()));
            // One timer for as long as the deadline stands, not one per message.
            let mut recheck_due = Box::pin(Clock::Boot.sleep_until_some(recheck));
            loop {
                tokio::select! {
                    message = messages.next() => {
                        let Some((channel, payload)) = message else { break };
                        if let Some(kind) = channels.decode(&channel, &payload) {
                            let _ = pushes.send(Push { node: index, kind });
                        }
                    }
                    alive = async { changed.wait_for(|w| w[index] != watching).await.is_ok() } => {
                        if !alive {
                            return;
                        }
                        resubscribe = true;
                        break;
                    }
                    () = &mut recheck_due => {
                        let Some(strong) = inner.upgrade() else {
                            return;
                        };
                        let watchers = strong.release_watchers(index, &channels.released).await;
                        // A change ends this stream (above).
                        strong.decide_release_watch(index, watchers);
                        let recheck = (watchers >= READERS).then(|| {
                            Deadline::now() + release_recheck_in(ttl, false, rand::random())
                        });
                        recheck_due.set(Clock::Boot.sleep_until_some(recheck));
                    }
                }
            }
            subscribed.send_modify(|s| s[index] = false);
            observer.subscription(index, false);
        }
        if !resubscribe {
            Clock::Boot.sleep_until(Deadline::now() + backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(30));
        }
    }
}

/// How many pushes a waiter may fall behind before it reads the nodes instead
/// (`RecvError::Lagged`). Pushes of one name are few (an acquisition or a release per node),
/// and the channel's slots are allocated with it (about 100 bytes each), so a long queue
/// would cost every name waited on more than its waiters do.
pub(super) const PUSH_QUEUE: usize = 64;

impl Inner {
    /// The channel this lock's pushes are handed to its waiters on, made the first time
    /// (a lock nobody waits on, a held request lock for one, never pays for its slots).
    pub(super) fn pushes(&self) -> &tokio::sync::broadcast::Sender<Push> {
        self.pushes
            .get_or_init(|| tokio::sync::broadcast::channel(PUSH_QUEUE).0)
    }

    /// The subscribers of node `index`'s release channel `channel` (0 when it does not answer).
    async fn release_watchers(&self, index: usize, channel: &str) -> u64 {
        self.nodes[index]
            .command::<(String, u64)>(
                redis::cmd("PUBSUB").arg("NUMSUB").arg(channel),
                self.cfg.node_timeout,
            )
            .await
            .map_or(0, |(_, n)| n)
    }

    /// Decides again whether this contender watches releases on node `index`, from the
    /// subscribers of its release channel just counted (see [`watches_releases`]), and
    /// records it: a change makes that node's subscription take or drop the channel.
    pub(super) fn decide_release_watch(&self, index: usize, watchers: u64) -> bool {
        // The read guard ends with this statement, before the send below.
        let was = self.watching_releases.borrow()[index];
        let watching = watches_releases(was, watchers, rand::random());
        self.watching_releases.send_if_modified(|w| {
            let changed = w[index] != watching;
            w[index] = watching;
            changed
        });
        self.observer.release_watch(index, watching);
        watching
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_nobody_listens_to_announces_once_per_quiet_period() {
        let t0 = Deadline::from_boottime(Duration::from_secs(100));
        assert!(worth_announcing(None, t0), "the first is always announced");
        assert!(
            worth_announcing(Some((t0, None)), t0),
            "one still unanswered"
        );
        assert!(
            worth_announcing(Some((t0, Some(1))), t0),
            "someone listened"
        );
        assert!(!worth_announcing(Some((t0, Some(0))), t0));
        let later = t0 + QUIET_ANNOUNCEMENTS_FOR;
        assert!(!worth_announcing(
            Some((t0, Some(0))),
            later - Duration::from_millis(1)
        ));
        assert!(worth_announcing(Some((t0, Some(0))), later));
    }

    #[test]
    fn an_announcement_round_trips_and_keeps_spaces_in_the_identity() {
        let a = Acquired {
            identity: "pod a:1".into(),
            fencing_token: 42,
            validity: Duration::from_millis(9876),
            waiters: 1000,
        };
        assert_eq!(Acquired::parse(&a.encode()), Some(a));
        assert_eq!(Acquired::parse("v2 1 2 3 x"), None);
        assert_eq!(Acquired::parse("v1 1 2 3 "), None);
    }

    #[test]
    fn the_channels_of_a_lock_are_scoped_by_database_like_its_keys() {
        let zero = Channels::new("redlock:{x}", 0);
        assert_eq!(zero.released, "redlock:{x}:released");
        assert_eq!(zero.acquired, "redlock:{x}:acquired");
        let one = Channels::new("redlock:{x}", 1);
        assert_eq!(one.released, "redlock:{x}:db1:released");
        assert_eq!(one.acquired, "redlock:{x}:db1:acquired");
        assert_eq!(one.decode(&zero.released, "a:1"), None);
        assert_eq!(one.decode(&zero.acquired, "v1 1 1 1 a"), None);
    }

    #[test]
    fn messages_are_told_apart_by_channel() {
        let c = Channels::new("redlock:{x}", 3);
        assert_eq!(c.keyspace, "__keyspace@3__:redlock:{x}");
        assert_eq!(
            c.decode("redlock:{x}:db3:released", "pod-a:abcdef"),
            Some(PushKind::Released("pod-a".into()))
        );
        assert_eq!(
            c.decode("__keyspace@3__:redlock:{x}", "expired"),
            Some(PushKind::Key(KeyEvent::Gone))
        );
        assert_eq!(c.decode("other", "x"), None);
    }

    proptest::proptest! {
        #[test]
        fn no_message_panics_the_parser(channel in ".{0,40}", payload in "(v1 )?.{0,60}") {
            let c = Channels::new("redlock:{x}", 0);
            let _ = c.decode(&channel, &payload);
            let _ = c.decode("redlock:{x}:acquired", &payload);
            let _ = Acquired::parse(&payload);
        }
    }
}

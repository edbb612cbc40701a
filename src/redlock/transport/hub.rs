//! One router per node for what its connections push, routing each message by channel to the
//! streams that subscribed it: every lock of a process shares the node's one connection and its
//! subscriptions.
//!
//! ## Behaviour
//! - A message is routed as the connection reads it (the connection's push sender calls
//!   [`Hub::handle`]; no task in between): a message of channel `C` pushed on connection `id`
//!   goes to every stream that subscribed `C` on `id`; messages of connections since replaced
//!   are dropped.
//! - A channel is subscribed on the connection when its first stream asks for it, and
//!   unsubscribed when its last stream has been gone for [`UNSUBSCRIBE_AFTER`]: a lock
//!   subscribes while it waits, and the node carries only the channels someone listens to. `SUBSCRIBE` and `UNSUBSCRIBE` go out one
//!   at a time, each decided on the routes of that moment, so a late unsubscribe never undoes a
//!   newer subscribe. Messages of a channel while no stream listens are dropped.
//! - A disconnection ends every stream of that connection (their owners subscribe again on the
//!   next one) and marks the node's connection for redialling.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::{FromRedisValue, PushInfo};
use tokio::sync::{mpsc, watch};

use super::link::Link;
use crate::clock;

/// Messages of the channels a waiter subscribed: `(channel, payload)`; the stream ends when
/// the connection that carries them is gone.
pub type Pushes = futures_util::stream::BoxStream<'static, (String, String)>;

/// How long a channel nobody listens to stays subscribed: a stream replaced by its owner
/// (to take or drop a channel) comes back well within it.
const UNSUBSCRIBE_AFTER: std::time::Duration = std::time::Duration::from_secs(2);

/// One subscriber of a channel on one connection.
struct Route {
    /// The stream that asked ([`Hub::register`]).
    stream: u64,
    /// The connection it subscribed on.
    conn: u64,
    tx: mpsc::UnboundedSender<(String, String)>,
}

#[derive(Default)]
struct Routes {
    by_channel: HashMap<String, Vec<Route>>,
    next_stream: u64,
}

impl Routes {
    /// How many streams listen to `channel` on connection `conn`.
    fn listeners(&self, channel: &str, conn: u64) -> usize {
        self.by_channel
            .get(channel)
            .map_or(0, |routes| routes.iter().filter(|r| r.conn == conn).count())
    }

    /// Hands a message to the streams of `channel` on `conn`; forgets streams dropped since.
    fn deliver(&mut self, conn: u64, channel: String, payload: String) {
        let Some(routes) = self.by_channel.get_mut(&channel) else {
            return;
        };
        routes.retain(|r| r.conn != conn || r.tx.send((channel.clone(), payload.clone())).is_ok());
    }

    /// Ends every stream of connection `conn`.
    fn close(&mut self, conn: u64) {
        for routes in self.by_channel.values_mut() {
            routes.retain(|r| r.conn != conn);
        }
        self.by_channel.retain(|_, routes| !routes.is_empty());
    }

    /// Forgets stream `stream`.
    fn remove(&mut self, stream: u64) {
        for routes in self.by_channel.values_mut() {
            routes.retain(|r| r.stream != stream);
        }
        self.by_channel.retain(|_, routes| !routes.is_empty());
    }
}

/// A node's push routes, shared by every stream on it.
#[derive(Default)]
pub(super) struct Hub {
    routes: Mutex<Routes>,
    /// Held while `SUBSCRIBE`/`UNSUBSCRIBE` is decided and sent (see the module doc).
    commands: tokio::sync::Mutex<()>,
}

impl Hub {
    fn routes(&self) -> std::sync::MutexGuard<'_, Routes> {
        self.routes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes in one push of connection `conn`, as the connection reads it: a message goes to
    /// the streams of its channel; a disconnection ends the connection's streams and marks it
    /// for redialling. Never blocks (a short lock of the routes, unbounded sends).
    pub(super) fn handle(&self, conn: u64, info: PushInfo, link: &watch::Sender<Link>) {
        match info.kind {
            redis::PushKind::Message => {
                if let Some((channel, payload)) = channel_message(&info.data) {
                    self.routes().deliver(conn, channel, payload);
                }
            }
            redis::PushKind::Disconnection => {
                // Gone: the next call dials again rather than fail on it first.
                link.send_if_modified(|link| match link {
                    Link::Up(_, _, current, _) if *current == conn => {
                        *link = Link::Idle;
                        true
                    }
                    _ => false,
                });
                self.routes().close(conn);
            }
            _ => {}
        }
    }

    /// Routes `channels` and `optional` of connection `conn` (number `id`) to a new stream, and
    /// subscribes those no other stream listens to there; an `optional` channel the node
    /// refuses costs only its messages. The stream ends when the connection is gone.
    pub(super) async fn subscribe(
        self: &Arc<Self>,
        mut conn: MultiplexedConnection,
        id: u64,
        channels: &[&str],
        optional: Option<&str>,
        link: &Arc<watch::Sender<Link>>,
    ) -> Result<Pushes, redis::RedisError> {
        let _order = self.commands.lock().await;
        let (tx, rx) = mpsc::unbounded_channel();
        let (stream, fresh, fresh_optional) = {
            let mut routes = self.routes();
            let stream = routes.next_stream;
            routes.next_stream += 1;
            let fresh: Vec<&str> = channels
                .iter()
                .copied()
                .filter(|c| routes.listeners(c, id) == 0)
                .collect();
            let fresh_optional = optional.filter(|c| routes.listeners(c, id) == 0);
            for channel in channels.iter().copied().chain(optional) {
                routes
                    .by_channel
                    .entry(channel.to_owned())
                    .or_default()
                    .push(Route {
                        stream,
                        conn: id,
                        tx: tx.clone(),
                    });
            }
            (stream, fresh, fresh_optional)
        };
        let guard = RouteGuard {
            hub: self.clone(),
            link: link.clone(),
            stream,
            conn: id,
            channels: channels
                .iter()
                .copied()
                .chain(optional)
                .map(str::to_owned)
                .collect(),
        };
        if !fresh.is_empty() {
            // On failure the guard drops the routes again.
            conn.subscribe(&fresh).await?;
        }
        if let Some(optional) = fresh_optional {
            let _ = conn.subscribe(optional).await;
        }
        Ok(stream_of(rx, guard, link.subscribe(), id))
    }
}

/// A stream's routes: dropped, it removes them and unsubscribes what nobody listens to now.
struct RouteGuard {
    hub: Arc<Hub>,
    link: Arc<watch::Sender<Link>>,
    stream: u64,
    conn: u64,
    channels: Vec<String>,
}

impl Drop for RouteGuard {
    fn drop(&mut self) {
        self.hub.routes().remove(self.stream);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Link::Up(conn, _, current, _) = &*self.link.borrow() else {
            return;
        };
        if *current != self.conn {
            return;
        }
        let (mut conn, id) = (conn.clone(), self.conn);
        let hub = self.hub.clone();
        let channels = std::mem::take(&mut self.channels);
        runtime.spawn(async move {
            // A lock that subscribes again at once (to take or drop a channel) keeps the rest
            // without a gap, as if it had never left.
            clock::pause(UNSUBSCRIBE_AFTER).await;
            let _order = hub.commands.lock().await;
            let unused: Vec<String> = {
                let routes = hub.routes();
                channels
                    .into_iter()
                    .filter(|c| routes.listeners(c, id) == 0)
                    .collect()
            };
            if !unused.is_empty() {
                // Bounded: a hung node must not hold the next subscriber for long.
                let unsubscribe = conn.unsubscribe(&unused);
                let _ = clock::within(std::time::Duration::from_secs(1), unsubscribe).await;
            }
        });
    }
}

/// The messages routed to `rx` until connection `id` is gone; dropping it drops `guard`.
fn stream_of(
    rx: mpsc::UnboundedReceiver<(String, String)>,
    guard: RouteGuard,
    link: watch::Receiver<Link>,
    id: u64,
) -> Pushes {
    let state = (rx, link, guard);
    futures_util::stream::unfold(state, move |(mut rx, mut link, guard)| async move {
        let message = tokio::select! {
            message = rx.recv() => message,
            _ = link.wait_for(|link| !matches!(link, Link::Up(_, _, current, _) if *current == id)) => None,
        };
        message.map(|message| (message, (rx, link, guard)))
    })
    .boxed()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn route(
        routes: &mut Routes,
        stream: u64,
        conn: u64,
        channel: &str,
    ) -> mpsc::UnboundedReceiver<(String, String)> {
        let (tx, rx) = mpsc::unbounded_channel();
        routes
            .by_channel
            .entry(channel.to_owned())
            .or_default()
            .push(Route { stream, conn, tx });
        rx
    }

    #[test]
    fn a_message_reaches_only_the_streams_of_its_channel_on_its_connection() {
        let mut routes = Routes::default();
        let mut a = route(&mut routes, 1, 7, "a");
        let mut b = route(&mut routes, 2, 7, "b");
        let mut old = route(&mut routes, 3, 6, "a");
        routes.deliver(7, "a".into(), "x".into());
        assert_eq!(a.try_recv().ok(), Some(("a".into(), "x".into())));
        assert!(b.try_recv().is_err());
        assert!(old.try_recv().is_err());
        assert_eq!(routes.listeners("a", 7), 1);
        routes.remove(1);
        assert_eq!(routes.listeners("a", 7), 0);
        routes.close(7);
        assert_eq!(routes.listeners("b", 7), 0);
        assert_eq!(routes.listeners("a", 6), 1);
    }
}

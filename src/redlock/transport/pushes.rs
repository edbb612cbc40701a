//! What a node pushes: the channels a waiter subscribes, on the node's one connection.
//!
//! ## Behaviour
//! - **One connection carries pushes too.** The connection speaks RESP3 where the server does
//!   (Redis 6+), so a waiter's subscriptions ride on it ([`Node::pushes`]) and a sidecar holds
//!   one connection per node, not two: a node's idle cost grows with its clients. A server or
//!   proxy that refuses `HELLO 3` gets RESP2 and a dedicated pub/sub connection.
//! - A stream ends when the connection that carries it is gone (dropped, replaced or
//!   disconnected); a disconnection also marks the node's connection for redialling.

use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use redis::{FromRedisValue, PushInfo, RedisError};
use tokio::sync::{mpsc, watch, OwnedMutexGuard};

use super::error::NodeError;
use super::node::{Link, Node};

/// Messages of the channels a waiter subscribed: `(channel, payload)`; the stream ends when
/// the connection that carries them is gone.
pub type Pushes = BoxStream<'static, (String, String)>;

impl Node {
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
        Ok(messages_of(pushed, self.link.clone(), id))
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

/// The messages connection `id` pushes (from the node's one receiver, held while the stream
/// lives), until that connection is gone.
fn messages_of(
    pushed: OwnedMutexGuard<mpsc::UnboundedReceiver<(u64, PushInfo)>>,
    sender: Arc<watch::Sender<Link>>,
    id: u64,
) -> Pushes {
    let state = (pushed, sender.subscribe(), sender, id);
    let stream = futures_util::stream::unfold(
        state,
        |(mut pushed, mut link, sender, id)| async move {
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
                                return Some((message, (pushed, link, sender, id)));
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
    stream.boxed()
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

//! What a node pushes: the channels a waiter subscribes, on the node's one connection.
//!
//! ## Behaviour
//! - **One connection carries pushes too.** The connection speaks RESP3 where the server does
//!   (Redis 6+), so a waiter's subscriptions ride on it ([`Node::pushes`]) and a sidecar holds
//!   one connection per node, not two: a node's idle cost grows with its clients. A server or
//!   proxy that refuses `HELLO 3` gets RESP2 and a dedicated pub/sub connection.
//! - **Shared by every lock.** Streams of many locks ride on the one connection; one router per
//!   node routes each message by channel, as the connection reads it, to the streams that asked
//!   for it (see `hub`).
//! - A stream ends when the connection that carries it is gone (dropped, replaced or
//!   disconnected); a disconnection also marks the node's connection for redialling.

use std::time::Duration;

use futures_util::StreamExt;
use redis::RedisError;

use super::error::{node_error, NodeError};
use super::node::Node;
use crate::clock;

pub use super::hub::Pushes;

impl Node {
    /// Subscribes to `channels`, and to `optional` where the node allows it (an ACL that
    /// does not list it costs only its messages), and streams what they carry: on the node's
    /// connection where it speaks RESP3 (connecting first if needed, within `timeout`), else on
    /// a dedicated pub/sub connection (for a Sentinel group, to the master named now). Any
    /// number of streams at a time per node; a channel stays subscribed while a stream wants it,
    /// so `_dropped` (what an earlier stream of the caller's took) needs no unsubscribe.
    pub async fn pushes(
        &self,
        channels: &[&str],
        optional: Option<&str>,
        _dropped: Option<&str>,
        timeout: Duration,
    ) -> Result<Pushes, NodeError> {
        // The call's own relative bound, on Tokio's timer (see `node`).
        let bound = clock::CallBound::after(timeout);
        let (conn, facts, id) = self.connection_quiet(timeout).await?;
        if !facts.push {
            return self.dedicated_pushes(channels, optional, timeout).await;
        }
        let subscribe = self.hub.subscribe(conn, id, channels, optional, &self.link);
        match bound.run(subscribe).await {
            Ok(Ok(pushes)) => Ok(pushes),
            Ok(Err(e)) => {
                self.drop_if_broken(id, &e);
                Err(node_error(&e, self.spec.password()))
            }
            Err(_) => Err(NodeError::timeout(timeout)),
        }
    }

    /// [`Node::pushes`] on a dedicated pub/sub connection (RESP2 servers and proxies).
    async fn dedicated_pushes(
        &self,
        channels: &[&str],
        optional: Option<&str>,
        timeout: Duration,
    ) -> Result<Pushes, NodeError> {
        let scrub = |e: RedisError| node_error(&e, self.spec.password());
        let connect = async {
            let (client, _) = self.dial.client(&self.spec, timeout).await?;
            let mut pubsub = client.get_async_pubsub().await.map_err(scrub)?;
            pubsub.subscribe(channels).await.map_err(scrub)?;
            if let Some(optional) = optional {
                let _ = pubsub.subscribe(optional).await;
            }
            Ok(pubsub)
        };
        let pubsub = match clock::within(timeout, connect).await {
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

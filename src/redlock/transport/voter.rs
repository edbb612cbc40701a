//! The seam between the engine and the transport: what the engine asks of one node.
//!
//! Like tower's `Service`, it is the whole of what the engine may do with a node, so the
//! engine's fan-out, its rounds and the vote rules can be driven by a fake node in a unit test
//! (no Redis, no clock). The real [`Node`] implements it; `fake::FakeNode` (tests only)
//! answers from a script of replies. The trait is object-safe (answers are raw [`Value`]s,
//! futures are boxed): the engine holds its nodes as [`Voter`]s, and the typed helpers on
//! `dyn VoteNode` decode what they answer.
//!
//! Every call is bounded by the `timeout` it is given; every failure is a [`NodeError`].

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use redis::{FromRedisValue, Script, Value};

use super::error::{NodeError, NodeErrorKind};
use super::facts::NodeFacts;
use super::node::Node;
use super::pushes::Pushes;

/// One node as the engine holds it (shared by every lock of an engine).
pub type Voter = Arc<dyn VoteNode>;

/// One node, as the engine sees it.
pub trait VoteNode: Send + Sync {
    /// `host:port` (a Sentinel group: `MASTER@sentinels`), safe to log and to label votes.
    fn label(&self) -> &str;

    /// The database index the node's URL selects (the scripts' lineage names it).
    fn db(&self) -> i64;

    /// The facts of the live connection, if there is one (no I/O).
    fn facts(&self) -> Option<Arc<NodeFacts>>;

    /// The server the last connection reached (see `votes::server_identity`), kept after it
    /// is gone; `None` before the first connection (no I/O).
    fn server(&self) -> Option<String>;

    /// Whether [`VoteNode::server`] may be out of date (no connection since the last drop).
    fn server_stale(&self) -> bool;

    /// The key of the epoch marker this node's scripts use (per slot in cluster mode).
    fn epoch_key(&self) -> String;

    /// The real connection behind this node, for what only it knows (how it was dialled,
    /// the credentials it uses); `None` for a fake.
    fn connection(&self) -> Option<&Node>;

    /// Connects if no connection is up; errors are left to the next call.
    fn connect(&self, timeout: Duration) -> BoxFuture<'_, ()>;

    /// Runs `script` with `keys` and `args` (the database index appended as the last
    /// argument); the raw reply and the facts of the connection that carried it.
    fn run_script<'a>(
        &'a self,
        script: &'a Script,
        keys: &'a [&'a str],
        args: &'a [&'a str],
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(Value, Arc<NodeFacts>), NodeError>>;

    /// Runs one plain command; its raw reply.
    fn run_command<'a>(
        &'a self,
        cmd: &'a redis::Cmd,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Value, NodeError>>;

    /// Runs `pipe` (one round trip; atomic if `pipe` is), without refreshing stale facts;
    /// its raw reply.
    fn run_pipeline<'a>(
        &'a self,
        pipe: &'a redis::Pipeline,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Value, NodeError>>;

    /// `key`'s value and remaining time (`GET` and `PTTL`), `None` if there is none.
    fn read_key<'a>(
        &'a self,
        key: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Option<(String, Duration)>, NodeError>>;

    /// Streams what `channels` carry (and `optional`, where the node allows it); `dropped` is
    /// a channel an earlier stream subscribed that this one does not want.
    fn subscribe<'a>(
        &'a self,
        channels: &'a [&'a str],
        optional: Option<&'a str>,
        dropped: Option<&'a str>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Pushes, NodeError>>;
}

/// A raw reply as `T`; a reply of another shape is a protocol error, never a panic.
pub fn decode<T: FromRedisValue>(reply: Value) -> Result<T, NodeError> {
    T::from_redis_value(reply).map_err(|e| NodeError {
        kind: NodeErrorKind::Protocol,
        message: e.to_string(),
    })
}

/// Typed forms of the raw calls.
impl dyn VoteNode {
    /// [`VoteNode::run_script`], its reply decoded as `T`.
    pub async fn eval<T: FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
        timeout: Duration,
    ) -> Result<(T, Arc<NodeFacts>), NodeError> {
        let (reply, facts) = self.run_script(script, keys, args, timeout).await?;
        Ok((decode(reply)?, facts))
    }

    /// [`VoteNode::run_command`], its reply decoded as `T`.
    pub async fn command<T: FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        timeout: Duration,
    ) -> Result<T, NodeError> {
        decode(self.run_command(cmd, timeout).await?)
    }

    /// [`VoteNode::run_pipeline`], its reply decoded as `T`.
    pub async fn query_pipeline<T: FromRedisValue>(
        &self,
        pipe: &redis::Pipeline,
        timeout: Duration,
    ) -> Result<T, NodeError> {
        decode(self.run_pipeline(pipe, timeout).await?)
    }
}

impl VoteNode for Node {
    fn label(&self) -> &str {
        Node::label(self)
    }

    fn db(&self) -> i64 {
        Node::db(self)
    }

    fn facts(&self) -> Option<Arc<NodeFacts>> {
        Node::facts(self)
    }

    fn server(&self) -> Option<String> {
        Node::server(self)
    }

    fn server_stale(&self) -> bool {
        Node::server_stale(self)
    }

    fn epoch_key(&self) -> String {
        Node::epoch_key(self)
    }

    fn connection(&self) -> Option<&Node> {
        Some(self)
    }

    fn connect(&self, timeout: Duration) -> BoxFuture<'_, ()> {
        Box::pin(Node::connect(self, timeout))
    }

    fn run_script<'a>(
        &'a self,
        script: &'a Script,
        keys: &'a [&'a str],
        args: &'a [&'a str],
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(Value, Arc<NodeFacts>), NodeError>> {
        Box::pin(Node::eval::<Value>(self, script, keys, args, timeout))
    }

    fn run_command<'a>(
        &'a self,
        cmd: &'a redis::Cmd,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Value, NodeError>> {
        Box::pin(Node::command::<Value>(self, cmd, timeout))
    }

    fn run_pipeline<'a>(
        &'a self,
        pipe: &'a redis::Pipeline,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Value, NodeError>> {
        Box::pin(Node::query_pipeline::<Value>(self, pipe, timeout))
    }

    fn read_key<'a>(
        &'a self,
        key: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Option<(String, Duration)>, NodeError>> {
        Box::pin(Node::read_key(self, key, timeout))
    }

    fn subscribe<'a>(
        &'a self,
        channels: &'a [&'a str],
        optional: Option<&'a str>,
        dropped: Option<&'a str>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Pushes, NodeError>> {
        Box::pin(self.pushes(channels, optional, dropped, timeout))
    }
}

/// A node that answers from a script of replies, for unit tests of the vote rules.
#[cfg(test)]
pub(crate) mod fake {
    use std::collections::{HashMap, VecDeque};
    use std::sync::Mutex;

    use futures_util::StreamExt;

    use super::*;
    use crate::redlock::transport::cluster::EPOCH_KEY;

    /// What a [`FakeNode`] was asked, in order.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub(crate) enum Call {
        /// `run_script` with these keys and arguments.
        Script(Vec<String>, Vec<String>),
        /// `read_key`.
        Read(String),
        /// `publish` on a channel.
        Publish(String, String),
        /// `subscribe` to these channels.
        Subscribe(Vec<String>),
        /// `connect`.
        Connect,
    }

    /// A node whose connection shows `facts` (none: not connected) and whose answers are
    /// queued in advance; an empty queue answers a timeout, like a hung node.
    pub(crate) struct FakeNode {
        pub(crate) label: String,
        pub(crate) db: i64,
        pub(crate) facts: Mutex<Option<Arc<NodeFacts>>>,
        /// Facts a `connect` brings up (a node reached for the first time, or again).
        pub(crate) on_connect: Mutex<Option<NodeFacts>>,
        pub(crate) replies: Mutex<VecDeque<Result<Value, NodeError>>>,
        pub(crate) keys: Mutex<HashMap<String, (String, Duration)>>,
        pub(crate) messages: Mutex<Vec<(String, String)>>,
        pub(crate) calls: Mutex<Vec<Call>>,
    }

    impl FakeNode {
        /// A node named `label`, connected to a server with `run_id` (empty: never reached).
        pub(crate) fn new(label: &str, run_id: &str) -> FakeNode {
            let facts = (!run_id.is_empty()).then(|| {
                Arc::new(NodeFacts {
                    run_id: run_id.to_owned(),
                    maxmemory_policy: "noeviction".to_owned(),
                    role: "master".to_owned(),
                    address: label.to_owned(),
                    cluster: false,
                    push: true,
                })
            });
            FakeNode {
                label: label.to_owned(),
                db: 0,
                facts: Mutex::new(facts),
                on_connect: Mutex::new(None),
                replies: Mutex::new(VecDeque::new()),
                keys: Mutex::new(HashMap::new()),
                messages: Mutex::new(Vec::new()),
                calls: Mutex::new(Vec::new()),
            }
        }

        /// Queues the answer to the next script.
        pub(crate) fn answer(&self, reply: Result<Value, NodeError>) {
            self.replies.lock().unwrap().push_back(reply);
        }

        /// The server restarts or fails over: its connection is gone until the next
        /// `connect`, which shows `run_id`.
        pub(crate) fn restart(&self, run_id: &str) {
            let mut next = self
                .facts
                .lock()
                .unwrap()
                .as_deref()
                .cloned()
                .unwrap_or_default();
            next.run_id = run_id.to_owned();
            *self.on_connect.lock().unwrap() = Some(next);
            *self.facts.lock().unwrap() = None;
        }

        /// What the node was asked.
        pub(crate) fn calls(&self) -> Vec<Call> {
            self.calls.lock().unwrap().clone()
        }

        fn record(&self, call: Call) {
            self.calls.lock().unwrap().push(call);
        }
    }

    impl VoteNode for FakeNode {
        fn label(&self) -> &str {
            &self.label
        }

        fn db(&self) -> i64 {
            self.db
        }

        fn facts(&self) -> Option<Arc<NodeFacts>> {
            self.facts.lock().unwrap().clone()
        }

        fn server(&self) -> Option<String> {
            let facts = self.facts()?;
            crate::redlock::transport::facts::server_identity(&facts.run_id, self.db)
        }

        fn server_stale(&self) -> bool {
            self.facts().is_none()
        }

        fn epoch_key(&self) -> String {
            EPOCH_KEY.to_owned()
        }

        fn connection(&self) -> Option<&Node> {
            None
        }

        fn connect(&self, _timeout: Duration) -> BoxFuture<'_, ()> {
            self.record(Call::Connect);
            if let Some(facts) = self.on_connect.lock().unwrap().take() {
                *self.facts.lock().unwrap() = Some(Arc::new(facts));
            }
            Box::pin(async {})
        }

        fn run_script<'a>(
            &'a self,
            _script: &'a Script,
            keys: &'a [&'a str],
            args: &'a [&'a str],
            timeout: Duration,
        ) -> BoxFuture<'a, Result<(Value, Arc<NodeFacts>), NodeError>> {
            let owned = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect();
            self.record(Call::Script(owned(keys), owned(args)));
            let answer = self.facts().ok_or_else(|| NodeError::timeout(timeout));
            let answer = answer.and_then(|facts| {
                let reply = self.replies.lock().unwrap().pop_front();
                Ok((
                    reply.unwrap_or_else(|| Err(NodeError::timeout(timeout)))?,
                    facts,
                ))
            });
            Box::pin(async move { answer })
        }

        fn run_command<'a>(
            &'a self,
            cmd: &'a redis::Cmd,
            timeout: Duration,
        ) -> BoxFuture<'a, Result<Value, NodeError>> {
            let words: Vec<String> = cmd
                .args_iter()
                .filter_map(|arg| match arg {
                    redis::Arg::Simple(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
                    _ => None,
                })
                .collect();
            let answer = match words.as_slice() {
                [publish, channel, message] if publish == "PUBLISH" => {
                    self.record(Call::Publish(channel.clone(), message.clone()));
                    Ok(Value::Int(0))
                }
                [ping] if ping == "PING" => Ok(Value::SimpleString("PONG".into())),
                _ => Err(NodeError::timeout(timeout)),
            };
            Box::pin(async move { answer })
        }

        fn run_pipeline<'a>(
            &'a self,
            _pipe: &'a redis::Pipeline,
            timeout: Duration,
        ) -> BoxFuture<'a, Result<Value, NodeError>> {
            Box::pin(async move { Err(NodeError::timeout(timeout)) })
        }

        fn read_key<'a>(
            &'a self,
            key: &'a str,
            timeout: Duration,
        ) -> BoxFuture<'a, Result<Option<(String, Duration)>, NodeError>> {
            self.record(Call::Read(key.to_owned()));
            let answer = match self.facts() {
                None => Err(NodeError::timeout(timeout)),
                Some(_) => Ok(self.keys.lock().unwrap().get(key).cloned()),
            };
            Box::pin(async move { answer })
        }

        fn subscribe<'a>(
            &'a self,
            channels: &'a [&'a str],
            _optional: Option<&'a str>,
            _dropped: Option<&'a str>,
            _timeout: Duration,
        ) -> BoxFuture<'a, Result<Pushes, NodeError>> {
            let wanted: Vec<String> = channels.iter().map(|c| (*c).to_owned()).collect();
            self.record(Call::Subscribe(wanted.clone()));
            let messages: Vec<(String, String)> = self
                .messages
                .lock()
                .unwrap()
                .iter()
                .filter(|(channel, _)| wanted.contains(channel))
                .cloned()
                .collect();
            let stream: Pushes = futures_util::stream::iter(messages).boxed();
            Box::pin(async move { Ok(stream) })
        }
    }
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;

    use super::fake::{Call, FakeNode};
    use super::*;

    const TIMEOUT: Duration = Duration::from_millis(100);

    #[test]
    fn a_reply_of_another_shape_is_a_protocol_error_not_a_panic() {
        let reply = Value::Array(vec![Value::Int(1), Value::Nil]);
        assert_eq!(
            decode::<(i64, Option<String>)>(reply.clone()),
            Ok((1, None))
        );
        let err = decode::<(i64, i64, i64)>(reply).unwrap_err();
        assert_eq!(err.kind, NodeErrorKind::Protocol);
        assert_eq!(
            decode::<String>(Value::SimpleString("OK".into())),
            Ok("OK".to_owned())
        );
    }

    #[tokio::test]
    async fn a_fake_node_answers_scripts_in_order_with_its_facts_and_then_times_out() {
        let node = FakeNode::new("a:1", "run-a");
        node.answer(Ok(Value::Int(1)));
        let script = Script::new("return 1");
        let (reply, facts) = node
            .run_script(&script, &["k", EPOCH], &["v"], TIMEOUT)
            .await
            .unwrap();
        assert_eq!(decode::<i64>(reply), Ok(1));
        assert_eq!(facts.run_id, "run-a");
        let silent = node.run_script(&script, &["k"], &[], TIMEOUT).await;
        assert_eq!(silent.unwrap_err().kind, NodeErrorKind::Timeout);
        assert_eq!(
            node.calls()[0],
            Call::Script(vec!["k".into(), EPOCH.into()], vec!["v".into()])
        );
    }

    const EPOCH: &str = crate::redlock::transport::EPOCH_KEY;

    #[tokio::test]
    async fn a_restarted_fake_node_shows_its_new_server_only_after_connecting_again() {
        let node = FakeNode::new("a:1", "before");
        assert_eq!(node.server().as_deref(), Some("before/0"));
        node.restart("after");
        assert!(node.server_stale());
        assert_eq!(node.server(), None);
        node.connect(TIMEOUT).await;
        assert_eq!(node.server().as_deref(), Some("after/0"));
        assert!(!node.server_stale());
    }

    #[tokio::test]
    async fn a_fake_node_streams_only_the_channels_subscribed() {
        let node = FakeNode::new("a:1", "run-a");
        node.messages.lock().unwrap().extend([
            ("x:acquired".to_owned(), "v1".to_owned()),
            ("y:acquired".to_owned(), "v2".to_owned()),
        ]);
        let got: Vec<_> = node
            .subscribe(&["x:acquired"], None, None, TIMEOUT)
            .await
            .unwrap()
            .collect()
            .await;
        assert_eq!(got, [("x:acquired".to_owned(), "v1".to_owned())]);
    }
}

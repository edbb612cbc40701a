//! The seam between the votes and the transport: what the vote layer asks of one node.
//!
//! Like tower's `Service`, it is the whole of what a caller may do with a node, so a rule
//! written against it can be driven by a fake node in a unit test (no Redis, no clock). The
//! real [`Node`] implements it; `fake::FakeNode` (tests only) answers from a script of replies.
//!
//! Every call is bounded by the `timeout` it is given; every failure is a [`NodeError`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redis::{FromRedisValue, Script, Value};

use super::error::{NodeError, NodeErrorKind};
use super::facts::NodeFacts;
use super::node::Node;
use super::pushes::Pushes;

/// One node, as the vote layer sees it.
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

    /// Connects if no connection is up; errors are left to the next call.
    fn connect(&self, timeout: Duration) -> impl Future<Output = ()> + Send;

    /// Runs `script` with `keys` and `args` (the database index appended as the last
    /// argument); the raw reply and the facts of the connection that carried it.
    fn run_script(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
        timeout: Duration,
    ) -> impl Future<Output = Result<(Value, Arc<NodeFacts>), NodeError>> + Send;

    /// `key`'s value and remaining time (`GET` and `PTTL`), `None` if there is none.
    fn read_key(
        &self,
        key: &str,
        timeout: Duration,
    ) -> impl Future<Output = Result<Option<(String, Duration)>, NodeError>> + Send;

    /// Publishes `message` on `channel`; how many subscribers it reached.
    fn publish(
        &self,
        channel: &str,
        message: &str,
        timeout: Duration,
    ) -> impl Future<Output = Result<u64, NodeError>> + Send;

    /// Streams what `channels` carry (and `optional`, where the node allows it); `dropped` is
    /// a channel an earlier stream subscribed that this one does not want.
    fn subscribe(
        &self,
        channels: &[&str],
        optional: Option<&str>,
        dropped: Option<&str>,
        timeout: Duration,
    ) -> impl Future<Output = Result<Pushes, NodeError>> + Send;
}

/// A script's raw reply as `T`; a reply of another shape is a protocol error, never a panic.
pub fn decode<T: FromRedisValue>(reply: Value) -> Result<T, NodeError> {
    T::from_redis_value(reply).map_err(|e| NodeError {
        kind: NodeErrorKind::Protocol,
        message: e.to_string(),
    })
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

    fn connect(&self, timeout: Duration) -> impl Future<Output = ()> + Send {
        Node::connect(self, timeout)
    }

    fn run_script(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
        timeout: Duration,
    ) -> impl Future<Output = Result<(Value, Arc<NodeFacts>), NodeError>> + Send {
        self.eval::<Value>(script, keys, args, timeout)
    }

    fn read_key(
        &self,
        key: &str,
        timeout: Duration,
    ) -> impl Future<Output = Result<Option<(String, Duration)>, NodeError>> + Send {
        Node::read_key(self, key, timeout)
    }

    async fn publish(
        &self,
        channel: &str,
        message: &str,
        timeout: Duration,
    ) -> Result<u64, NodeError> {
        let publish = redis::cmd("PUBLISH").arg(channel).arg(message).clone();
        self.command::<u64>(&publish, timeout).await
    }

    fn subscribe(
        &self,
        channels: &[&str],
        optional: Option<&str>,
        dropped: Option<&str>,
        timeout: Duration,
    ) -> impl Future<Output = Result<Pushes, NodeError>> + Send {
        self.pushes(channels, optional, dropped, timeout)
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

        async fn connect(&self, _timeout: Duration) {
            self.record(Call::Connect);
            if let Some(facts) = self.on_connect.lock().unwrap().take() {
                *self.facts.lock().unwrap() = Some(Arc::new(facts));
            }
        }

        async fn run_script(
            &self,
            _script: &Script,
            keys: &[&str],
            args: &[&str],
            timeout: Duration,
        ) -> Result<(Value, Arc<NodeFacts>), NodeError> {
            let owned = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect();
            self.record(Call::Script(owned(keys), owned(args)));
            let facts = self.facts().ok_or_else(|| NodeError::timeout(timeout))?;
            let reply = self.replies.lock().unwrap().pop_front();
            let reply = reply.unwrap_or_else(|| Err(NodeError::timeout(timeout)))?;
            Ok((reply, facts))
        }

        async fn read_key(
            &self,
            key: &str,
            timeout: Duration,
        ) -> Result<Option<(String, Duration)>, NodeError> {
            self.record(Call::Read(key.to_owned()));
            if self.facts().is_none() {
                return Err(NodeError::timeout(timeout));
            }
            Ok(self.keys.lock().unwrap().get(key).cloned())
        }

        async fn publish(
            &self,
            channel: &str,
            message: &str,
            _timeout: Duration,
        ) -> Result<u64, NodeError> {
            self.record(Call::Publish(channel.to_owned(), message.to_owned()));
            Ok(0)
        }

        async fn subscribe(
            &self,
            channels: &[&str],
            _optional: Option<&str>,
            _dropped: Option<&str>,
            _timeout: Duration,
        ) -> Result<Pushes, NodeError> {
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
            Ok(futures_util::stream::iter(messages).boxed())
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

//! Sending one script to every node at once, and keeping deletes of our key behind the calls
//! that may still write it on the same node.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use redis::Script;

use super::finish::FinishOnDrop;
use super::{push, Inner, NodeError, NodeFacts, Op, Redlock, CLEANUP, EPOCH_KEY};
use crate::clock;

/// One node's answer to a script, with the facts of the connection it came on.
pub(super) type Answer<T> = (usize, Result<(T, Arc<NodeFacts>), NodeError>);

/// The answers of one round, in the order they come.
///
/// Dropped while calls are still running (a round decided at quorum), it hands them to a
/// task: every request is finished, so no node is left with a half-done call and every
/// `KeyWrite` is released when its answer arrives.
pub(super) struct Answers<T: Send + 'static> {
    pub(super) calls: FuturesUnordered<BoxFuture<'static, Answer<T>>>,
}

impl<T: Send + 'static> Answers<T> {
    /// The next answer, or `None` once every node has answered or timed out.
    pub(super) async fn recv(&mut self) -> Option<Answer<T>> {
        self.calls.next().await
    }
}

impl<T: Send + 'static> Drop for Answers<T> {
    fn drop(&mut self) {
        if self.calls.is_empty() {
            return;
        }
        let mut calls = std::mem::take(&mut self.calls);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { while calls.next().await.is_some() {} });
        }
    }
}

/// How a call is ordered against the others that touch our key on the same node.
///
/// A round is decided at quorum, so a slow node's `SET` may not even be sent when the
/// holder releases. Were the delete sent first, the late `SET` would leave a key that
/// blocks that node's vote for a whole ttl. Deletes therefore wait (bounded by the node
/// timeout) until no call that may write the key there is in flight; from then on, the
/// connection's own order keeps them behind it. And a delete is never given up before it is
/// sent (see `Inner::delete_on`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Order {
    /// Touches nothing a delete could race with.
    Free,
    /// May write our key: tracked until its answer arrives.
    MayWrite,
    /// Deletes our key: sent only after the node's writes have settled.
    AfterWrites,
}

/// One call that may still write our key on a node; counted until dropped.
pub(super) struct KeyWrite {
    inner: Arc<Inner>,
    index: usize,
}

impl KeyWrite {
    pub(super) fn start(inner: &Arc<Inner>, index: usize) -> KeyWrite {
        inner.key_writes[index].send_modify(|n| *n += 1);
        KeyWrite {
            inner: inner.clone(),
            index,
        }
    }
}

impl Drop for KeyWrite {
    fn drop(&mut self) {
        self.inner.key_writes[self.index].send_modify(|n| *n -= 1);
    }
}

impl Inner {
    /// The keys every script gets, in the order `scripts` documents.
    pub(super) fn keys(&self) -> [&str; 6] {
        [
            &self.key,
            &self.fence_key,
            &self.ttl_key,
            EPOCH_KEY,
            &self.node_set_key,
            &self.refreshed_key,
        ]
    }

    /// The lock's channels on node `index` (they are scoped by its database).
    pub(super) fn channels(&self, index: usize) -> push::Channels {
        push::Channels::new(&self.key, self.nodes[index].db())
    }

    /// Arguments 4 on of the scripts that keep the fencing counter: its retention in ms.
    pub(super) fn retention_ms(&self) -> String {
        self.cfg.fence_retention.as_millis().to_string()
    }

    /// Waits until no call that may write our key on node `index` is in flight. Each such
    /// call is bounded by the node timeout, and so is this wait.
    async fn key_writes_settled(&self, index: usize) {
        if *self.key_writes[index].borrow() == 0 {
            return;
        }
        let mut writes = self.key_writes[index].subscribe();
        let _ = clock::within(self.cfg.node_timeout, writes.wait_for(|n| *n == 0)).await;
    }

    /// Runs `script`, a delete of our key, on node `index` once the node's writes have settled,
    /// and waits for its answer for up to twice the node timeout. The call is never dropped
    /// before its end (bounded by the ttl): the client sheds a request whose caller has given
    /// up before its connection wrote it, and a delete so shed (on a busy client) left our
    /// key, and so a lost round's split or an old holder's lock, for a whole ttl. It runs in
    /// place (no hand-over to a task on the release's path), and as a task of its own once
    /// nobody waits for it.
    pub(super) async fn delete_on<T: redis::FromRedisValue + Send + 'static>(
        self: Arc<Self>,
        index: usize,
        script: &'static Script,
        args: Arc<[String]>,
    ) -> Result<(T, Arc<NodeFacts>), NodeError> {
        let wait = self.cfg.node_timeout.saturating_mul(2);
        let bound = self.cfg.ttl.max(wait);
        let call = FinishOnDrop::new(async move {
            self.key_writes_settled(index).await;
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            self.nodes[index]
                .eval::<T>(script, &self.keys(), &args, bound)
                .await
        });
        match clock::within(wait, call.run()).await {
            Ok(answer) => answer,
            Err(_) => Err(NodeError::timeout(wait)),
        }
    }
}

impl Redlock {
    /// Sends `script` to every node at once; answers arrive in the order they come. The
    /// calls are polled by whoever awaits the answers, with no task hop on the hot path; see
    /// [`Answers`] for what happens to calls still running when the answers are dropped.
    pub(super) fn fan_out<T>(
        &self,
        op: Op,
        order: Order,
        script: &'static Script,
        args: Vec<String>,
    ) -> Answers<T>
    where
        T: redis::FromRedisValue + Send + 'static,
    {
        let args: Arc<[String]> = args.into();
        self.fan_out_each(op, order, script, |_| args.clone())
    }

    /// [`Redlock::fan_out`] with arguments of each node's own (`args(index)`).
    pub(super) fn fan_out_each<T>(
        &self,
        op: Op,
        order: Order,
        script: &'static Script,
        args: impl Fn(usize) -> Arc<[String]>,
    ) -> Answers<T>
    where
        T: redis::FromRedisValue + Send + 'static,
    {
        let calls = (0..self.inner.nodes.len())
            .map(|index| {
                let inner = self.inner.clone();
                let args = args(index);
                // Counted now, so that a delete issued right after this returns waits for it.
                let write = (order == Order::MayWrite).then(|| KeyWrite::start(&inner, index));
                let call: BoxFuture<'static, Answer<T>> = Box::pin(async move {
                    // The call's latency, for the metrics only: no deadline.
                    let start = clock::Stopwatch::start();
                    let result = if order == Order::AfterWrites {
                        inner.clone().delete_on::<T>(index, script, args).await
                    } else {
                        let args: Vec<&str> = args.iter().map(String::as_str).collect();
                        inner.nodes[index]
                            .eval::<T>(script, &inner.keys(), &args, inner.cfg.node_timeout)
                            .await
                    };
                    drop(write);
                    let outcome = result.as_ref().map(|_| ()).map_err(|e| e.kind);
                    inner
                        .observer
                        .node_call(index, op, start.elapsed(), outcome);
                    (index, result)
                });
                call
            })
            .collect();
        Answers { calls }
    }

    /// Deletes `value` on the nodes `which` lists, and the node-set record `fingerprint`
    /// where no lock key is left, and waits for the answers (each bounded by the node
    /// timeout). Owner-checked, and silent: a lost round must not wake the waiters.
    pub(super) async fn clean_up(&self, value: &str, fingerprint: &str, which: &[usize]) {
        let args: Arc<[String]> = vec![value.to_owned(), fingerprint.to_owned()].into();
        let calls = which.iter().map(|index| {
            self.inner
                .clone()
                .delete_on::<i64>(*index, &CLEANUP, args.clone())
        });
        futures_util::future::join_all(calls).await;
    }

    /// Runs `script`, which may write our key, on node `index` in the background, bounded
    /// by the node timeout.
    pub(super) fn spawn_on(&self, index: usize, script: &'static Script, args: Arc<[String]>) {
        let inner = self.inner.clone();
        let write = KeyWrite::start(&inner, index);
        tokio::spawn(async move {
            let _write = write;
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let _ = inner.nodes[index]
                .eval::<i64>(script, &inner.keys(), &args, inner.cfg.node_timeout)
                .await;
        });
    }

    /// Reads `key` on every node at once (`GET` + `PTTL`, each bounded by the node timeout),
    /// timed and counted as `op`: per node, the value and its remaining time, `None` if absent.
    pub(super) async fn read_everywhere(
        &self,
        key: &str,
        op: Op,
    ) -> Vec<Result<Option<(String, Duration)>, NodeError>> {
        let inner = &self.inner;
        let reads = inner
            .nodes
            .iter()
            .enumerate()
            .map(|(index, node)| async move {
                // The read's latency, for the metrics only: no deadline.
                let start = clock::Stopwatch::start();
                let result = node.read_key(key, inner.cfg.node_timeout).await;
                let outcome = result.as_ref().map(|_| ()).map_err(|e| e.kind);
                inner
                    .observer
                    .node_call(index, op, start.elapsed(), outcome);
                result
            });
        futures_util::future::join_all(reads).await
    }
}

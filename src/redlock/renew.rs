//! Renewing and releasing a lease, carried out for the round state machines (`round::extend`,
//! `round::release`).

use std::sync::Arc;

use super::batch::{self, ExtendWire};
use super::round::release::RawReleaseReply;
use super::round::{ExtendReply, ExtendRound, ExtendStep, ReleaseTally, Rules};
use super::votes::DataAge;
use super::{
    clock, quorum, Answers, KeyWrite, Lease, LockError, NodeError, NodeFacts, Op, Order, Redlock,
    Vote, EXTEND, PROOF_EVERY, RELEASE, RESTORE,
};
use crate::clock::Deadline;

impl Redlock {
    /// Extends `lease` to a fresh ttl on a quorum, within its remaining validity.
    ///
    /// Returns the lease with its new validity. Nodes that lost our key get it back only
    /// after the quorum is proven, and only where nobody else has the key. When a quorum
    /// shows another holder's key or none at all, the lease is gone for good:
    /// [`LockError::Superseded`], so the holder steps down at once instead of retrying.
    pub async fn extend(&self, lease: &Lease) -> Result<Lease, LockError> {
        let cfg = &self.inner.cfg;
        let start = Deadline::now();
        let valid_until = lease.valid_until;
        let args = vec![
            lease.value.clone(),
            cfg.ttl.as_millis().to_string(),
            lease.fencing_token.to_string(),
            self.inner.retention_ms(),
            self.node_set().fingerprint,
            // Most renewals skip the data-age proof (see `PROOF_EVERY`).
            u8::from(self.proof_due(lease)).to_string(),
        ];
        let mut round = ExtendRound::new(
            self.inner.nodes.len(),
            cfg.ttl,
            start,
            valid_until,
            Rules::ALL,
        );
        if round.poll(start) == ExtendStep::Expired {
            return Err(self.expired());
        }
        // An answer "key missing" calls for a restore: each node counts as writing our key
        // until its answer has been handled.
        let writes: Vec<Option<KeyWrite>> = (0..self.inner.nodes.len())
            .map(|index| Some(KeyWrite::start(&self.inner, index)))
            .collect();
        let mut answers = match &self.inner.batches {
            Some(batches) => {
                let left = valid_until.saturating_duration_since(start);
                let (answers, sent) = batch::fan_out(&self.inner, batches, &args, left).await;
                // Measured from when the renewal went out, after its wait in the batch.
                round = ExtendRound::new(
                    self.inner.nodes.len(),
                    cfg.ttl,
                    sent,
                    valid_until,
                    Rules::ALL,
                );
                answers
            }
            None => self.fan_out::<ExtendWire>(Op::Extend, Order::Free, &EXTEND, args.clone()),
        };
        let step = self.run_extend(&mut round, &mut answers).await;
        let (valid_until, restore) = match step {
            ExtendStep::Renewed {
                valid_until,
                restore,
                ..
            } => (valid_until, restore),
            ExtendStep::Lost(votes) => return Err(self.extend_lost(votes, false)),
            ExtendStep::Superseded(votes) => return Err(self.extend_lost(votes, true)),
            ExtendStep::Expired | ExtendStep::Listen => return Err(self.expired()),
        };
        self.restore_lost_keys(round, answers, writes, args.into(), restore);
        Ok(Lease {
            valid_until,
            renewals: lease.renewals.wrapping_add(1),
            ..lease.clone()
        })
    }

    /// After a won renewal: a node that lost our key (data loss) gets it back, now the quorum
    /// is proven. The slowest nodes answer after the quorum, so their answers are awaited in
    /// the background (each node counts as writing our key until its answer is handled).
    fn restore_lost_keys(
        &self,
        mut round: ExtendRound,
        mut answers: Answers<ExtendWire>,
        mut writes: Vec<Option<KeyWrite>>,
        args: Arc<[String]>,
        restore: Vec<usize>,
    ) {
        for index in restore {
            self.spawn_on(index, &RESTORE, args.clone());
        }
        for (index, vote) in round.votes().iter().enumerate() {
            if vote.is_some() {
                writes[index] = None;
            }
        }
        let this = self.clone();
        tokio::spawn(async move {
            while let Some((index, answer)) = answers.recv().await {
                if this.feed_extend(&mut round, index, answer) == Vote::Missing {
                    this.spawn_on(index, &RESTORE, args.clone());
                }
                writes[index] = None;
            }
        });
    }

    /// Feeds `round` answers until it decides or the lease's validity ends.
    async fn run_extend(
        &self,
        round: &mut ExtendRound,
        answers: &mut Answers<ExtendWire>,
    ) -> ExtendStep {
        let expiry =
            clock::sleep_until_deadline(round.poll_timeout().unwrap_or_else(Deadline::now));
        tokio::pin!(expiry);
        loop {
            let step = round.poll(Deadline::now());
            if step != ExtendStep::Listen {
                return step;
            }
            tokio::select! {
                biased;
                answer = answers.recv() => match answer {
                    Some((index, answer)) => {
                        self.feed_extend(round, index, answer);
                    }
                    None => return step,
                },
                _ = &mut expiry => return ExtendStep::Expired,
            }
        }
    }

    /// Node `index`'s extend answer into `round`; returns its vote. Extend votes need no
    /// data-age rule (a node that lost our key says so), but an answer with a proof keeps the
    /// node's reported health current (most renewals carry none, see [`PROOF_EVERY`]).
    fn feed_extend(
        &self,
        round: &mut ExtendRound,
        index: usize,
        answer: Result<(ExtendWire, Arc<NodeFacts>), NodeError>,
    ) -> Vote {
        let answer = answer.map(|(raw, facts)| {
            let reply = ExtendReply::parse(raw.0);
            if reply.proof.data_age == DataAge::NotProven {
                self.learn_max_ttl(reply.proof.max_ttl);
            } else {
                let _ = self.judge(index, &facts, reply.proof);
            }
            reply
        });
        round.handle(index, answer)
    }

    /// Whether this renewal of `lease` asks the nodes for their data-age proof: every
    /// [`PROOF_EVERY`]th renewal, and every renewal while a node's last verdict did not count.
    fn proof_due(&self, lease: &Lease) -> bool {
        lease.renewals.wrapping_add(1).is_multiple_of(PROOF_EVERY)
            || self
                .inner
                .uncounted
                .iter()
                .any(|node| node.load(std::sync::atomic::Ordering::Relaxed))
    }

    fn expired(&self) -> LockError {
        LockError::Expired {
            lock: self.inner.cfg.lock.clone(),
        }
    }

    /// The error of a renewal that did not win: superseded when a quorum showed another
    /// holder's key or none.
    fn extend_lost(&self, votes: Vec<Option<Vote>>, superseded: bool) -> LockError {
        let lock = self.inner.cfg.lock.clone();
        let votes = self.label_votes(votes);
        if superseded {
            LockError::Superseded { lock, votes }
        } else {
            LockError::Lost { lock, votes }
        }
    }

    /// Releases `lease` on every node (owner-checked) and announces it to waiters, on each
    /// node's own release channel (see [`push::Channels`]).
    ///
    /// Returns how many nodes deleted our key. Bounded by twice the node timeout: on each
    /// node, a call that may still write our key there is let finish first (see [`Order`]).
    pub async fn release(&self, lease: &Lease) -> usize {
        self.release_then(lease, || {}).await
    }

    /// [`Redlock::release`], calling `gone` as soon as our key is gone from a quorum of nodes
    /// (or, failing that, when every node has answered): from then on a round of this
    /// process can win, while the slower nodes still answer.
    pub async fn release_then(&self, lease: &Lease, gone: impl FnOnce()) -> usize {
        let mut answers = self.fan_out_each::<RawReleaseReply>(
            Op::Release,
            Order::AfterWrites,
            &RELEASE,
            |index| vec![lease.value.clone(), self.inner.channels(index).released].into(),
        );
        let mut gone = Some(gone);
        let needed = quorum(self.inner.nodes.len());
        let mut tally = ReleaseTally::default();
        while let Some((_, answer)) = answers.recv().await {
            tally.handle(answer.map(|(deleted, _)| deleted));
            if tally.gone() >= needed {
                if let Some(gone) = gone.take() {
                    gone();
                }
            }
        }
        if let Some(gone) = gone {
            gone();
        }
        tally.deleted()
    }
}

//! Taking the lock: one round on every node, carried out for [`AcquireRound`].
//!
//! The round's rules (when it is decided, which votes count, young nodes, the node-set
//! conflict, clean-up, the token) are the state machine's, in `round::acquire`; this module
//! only fans the requests out, feeds the answers in and does what the machine says.
//!
//! ## Behaviour
//! - A round takes the node set (see `votes`, rule 7) when it starts, after connecting nodes
//!   whose server is not known (bounded by the node timeout), and sends its fingerprint with
//!   every request.
//! - A lost round deletes its key (silently, without waking waiters) where the machine says,
//!   and waits for those deletes; answers after a won round are judged in the background
//!   (their counters and node health stay current).
//! - A node-set conflict is logged (at most once a minute) and counted. A won round is
//!   announced on every node in the background.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use rand::Rng;
use tracing::{debug, warn};

use super::round::acquire::RawAcquireReply;
use super::round::{
    AcquireParams, AcquireReply, AcquireRound, AcquireStep, Lost, NodeAnswer, RoundLost, Rules,
    TokenPlan,
};
use super::timing::recheck_window;
use super::{Answers, Lease, LockError, NodeError, NodeFacts, Op, Order, Redlock, ACQUIRE};
use crate::clock::{Clock, Deadline};

/// How often a node-set conflict is logged at most.
const CONFLICT_LOG_EVERY: Duration = Duration::from_secs(60);

impl Redlock {
    /// One acquisition round: `Ok` with a lease, or why not. Never waits or retries.
    pub async fn try_acquire(&self) -> Result<Lease, LockError> {
        let cfg = &self.inner.cfg;
        let value = format!("{}:{}", cfg.identity, random_hex());
        let candidate = self.next_token(self.inner.fence_seen.load(Ordering::Relaxed));
        let node_set = self.round_node_set().await;
        let fingerprint = node_set.fingerprint.clone();
        let start = Deadline::now();
        let since = SystemTime::now();
        let (stale_set, stale_after) = self.stale_record_args(start);
        let mut answers = self.fan_out::<RawAcquireReply>(
            Op::Acquire,
            Order::MayWrite,
            &ACQUIRE,
            vec![
                value.clone(),
                cfg.ttl.as_millis().to_string(),
                candidate.to_string(),
                self.inner.retention_ms(),
                fingerprint.clone(),
                stale_set,
                stale_after,
            ],
        );
        let params = AcquireParams {
            ttl: cfg.ttl,
            longest_ttl: self.known_longest_ttl(),
            candidate,
            node_set,
            allow_evicting: cfg.allow_evicting_nodes,
            recheck_for: recheck_window(cfg.ttl, cfg.node_timeout, cfg.connect_timeout),
            rules: Rules::ALL,
        };
        let mut round = AcquireRound::new(self.inner.nodes.len(), params, start);
        let step = self.run_round(&mut round, &mut answers).await;
        self.keep_stale_record(&round, &step);
        self.inner
            .fence_seen
            .fetch_max(round.fence_seen(), Ordering::Relaxed);
        let plan = match step {
            AcquireStep::Won(plan) => plan,
            lost => return Err(self.after_lost(&round, lost, &value, &fingerprint).await),
        };
        let valid = round.validity();
        self.judge_late_answers(round, answers);
        let fencing_token = match self.mint(plan).await {
            Ok(token) => token,
            Err(err) => {
                self.clean_up_everywhere(&value, &fingerprint).await;
                return Err(err);
            }
        };
        self.inner
            .fence_seen
            .fetch_max(fencing_token, Ordering::Relaxed);
        let valid_until = match valid.at(Deadline::now()) {
            Ok(until) => until,
            Err(elapsed) => {
                self.clean_up_everywhere(&value, &fingerprint).await;
                return Err(self.too_short(elapsed));
            }
        };
        let lease = Lease {
            value,
            fencing_token,
            acquired_at: start,
            since,
            valid_until,
            renewals: 0,
        };
        self.announce_acquired(&lease);
        Ok(lease)
    }

    /// A lost round leaves the next one its leave to replace a stale record; any other
    /// outcome ends it.
    fn keep_stale_record(&self, round: &AcquireRound, step: &AcquireStep) {
        let stale = match step {
            AcquireStep::Lost { .. } => round.stale_record(),
            _ => None,
        };
        *self
            .inner
            .stale_record
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = stale.map(|stale| (stale, Deadline::now()));
    }

    /// Cleans up after a round that did not win (`step`), and says why it did not.
    async fn after_lost(
        &self,
        round: &AcquireRound,
        step: AcquireStep,
        value: &str,
        fingerprint: &str,
    ) -> LockError {
        match step {
            AcquireStep::Lost { clean_up, lost } => {
                self.clean_up(value, fingerprint, &clean_up).await;
                self.round_lost(lost, fingerprint)
            }
            AcquireStep::TooShort { elapsed } => {
                self.clean_up_everywhere(value, fingerprint).await;
                self.too_short(elapsed)
            }
            // Every call ends in an answer, so a round does not run out of them undecided;
            // were it to, nothing was won. (A won round does not come here.)
            AcquireStep::Listen | AcquireStep::Recheck(_) | AcquireStep::Won(_) => {
                self.clean_up_everywhere(value, fingerprint).await;
                LockError::QuorumUnreachable {
                    lock: self.inner.cfg.lock.clone(),
                    needed: super::quorum(self.inner.nodes.len()),
                    votes: self.label_votes(round.votes().to_vec()),
                }
            }
        }
    }

    /// The acquire script's leave to replace another set's record that the last round judged
    /// stale: its fingerprint and the age (ms) it must still exceed at `now`, or nothing.
    fn stale_record_args(&self, now: Deadline) -> (String, String) {
        let stale = self
            .inner
            .stale_record
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match &*stale {
            Some((stale, judged)) => {
                let after = stale.after + now.saturating_duration_since(*judged);
                (stale.set.clone(), after.as_millis().to_string())
            }
            None => (String::new(), "0".to_owned()),
        }
    }

    /// The token of a won round: the stored candidate, or a raise above every counter seen.
    async fn mint(&self, plan: TokenPlan) -> Result<u64, LockError> {
        match plan {
            TokenPlan::Stored(token) => Ok(token),
            TokenPlan::RaiseAbove(highest) => self
                .raise_fence(self.next_token(highest))
                .await
                .map_err(|votes| LockError::QuorumUnreachable {
                    lock: self.inner.cfg.lock.clone(),
                    needed: super::quorum(self.inner.nodes.len()),
                    votes,
                }),
        }
    }

    /// Feeds `round` every answer it asks for, and the registers it asks to read again, until
    /// it decides.
    async fn run_round(
        &self,
        round: &mut AcquireRound,
        answers: &mut Answers<RawAcquireReply>,
    ) -> AcquireStep {
        let mut rechecks = FuturesUnordered::new();
        let mut reading = vec![false; self.inner.nodes.len()];
        loop {
            let now = Deadline::now();
            round.handle_timeout(now);
            match round.poll(now) {
                AcquireStep::Listen => {}
                AcquireStep::Recheck(nodes) => {
                    let until = round.poll_timeout().unwrap_or(now);
                    if !reading.contains(&true) {
                        debug!(
                            lock = %self.inner.cfg.lock,
                            nodes = ?nodes,
                            "young nodes' grants would win: reading again the max-ttl register of nodes that did not answer in time"
                        );
                    }
                    for index in nodes {
                        if !std::mem::replace(&mut reading[index], true) {
                            rechecks.push(self.read_register(index, until));
                        }
                    }
                }
                step => return step,
            }
            if answers.calls.is_empty() && rechecks.is_empty() && round.poll_timeout().is_none() {
                // Every call ends in an answer, so this is not reached; were it, the caller
                // counts nothing won.
                return AcquireStep::Listen;
            }
            tokio::select! {
                Some((index, answer)) = answers.recv(), if !answers.calls.is_empty() => {
                    self.feed(round, index, answer);
                }
                Some((index, register)) = rechecks.next(), if !rechecks.is_empty() => {
                    reading[index] = false;
                    round.handle_register(index, register, Deadline::now());
                    self.learn_max_ttl(round.register_seen());
                }
                () = Clock::Boot.sleep_until_some(round.poll_timeout()) => {}
            }
        }
    }

    /// Node `index`'s max-ttl register, read with plain commands once its connection is up
    /// (made by `until`): the connection's set-up does not eat the read's node timeout.
    async fn read_register(
        &self,
        index: usize,
        until: Deadline,
    ) -> (usize, Result<Duration, NodeError>) {
        let node = &self.inner.nodes[index];
        node.connect(until.saturating_duration_since(Deadline::now()))
            .await;
        let read = node
            .read_key(&self.inner.ttl_key, self.inner.cfg.node_timeout)
            .await;
        let register = read.map(|value| {
            value
                .and_then(|(ms, _)| ms.parse().ok())
                .map_or(Duration::ZERO, Duration::from_millis)
        });
        (index, register)
    }

    /// Node `index`'s answer into `round`; what it judged goes to the metrics and the
    /// longest ttl known.
    fn feed(
        &self,
        round: &mut AcquireRound,
        index: usize,
        answer: Result<(RawAcquireReply, Arc<NodeFacts>), NodeError>,
    ) {
        let answer = answer.map(|(raw, facts)| NodeAnswer {
            reply: AcquireReply::parse(raw),
            conn: self.connection(index, facts),
        });
        round.handle(index, answer);
        self.learn_max_ttl(round.register_seen());
        for (index, counted) in round.take_verdicts() {
            self.inner.observer.node_counted(index, counted);
        }
    }

    /// Answers after a won round still carry counters (the next candidate starts above them)
    /// and tell whether their node's vote counts, so every node's report stays current.
    fn judge_late_answers(&self, mut round: AcquireRound, mut answers: Answers<RawAcquireReply>) {
        let this = self.clone();
        tokio::spawn(async move {
            while let Some((index, answer)) = answers.recv().await {
                this.feed(&mut round, index, answer);
            }
            this.inner
                .fence_seen
                .fetch_max(round.fence_seen(), Ordering::Relaxed);
        });
    }

    fn too_short(&self, elapsed: Duration) -> LockError {
        LockError::ValidityTooShort {
            lock: self.inner.cfg.lock.clone(),
            elapsed,
            ttl: self.inner.cfg.ttl,
        }
    }

    /// Deletes our key of a round that cannot lead on every node.
    async fn clean_up_everywhere(&self, value: &str, fingerprint: &str) {
        let all: Vec<usize> = (0..self.inner.nodes.len()).collect();
        self.clean_up(value, fingerprint, &all).await;
    }

    /// The error a lost round reports.
    fn round_lost(&self, lost: RoundLost, ours: &str) -> LockError {
        let lock = self.inner.cfg.lock.clone();
        let votes = self.label_votes(lost.votes);
        match lost.why {
            Lost::NodeSetConflict { theirs } => {
                self.inner.observer.node_set_conflict();
                self.log_node_set_conflict(ours, &theirs);
                LockError::NodeSetConflict { lock, votes }
            }
            Lost::NotYetTrusted { ready_in } => LockError::NotYetTrusted {
                lock,
                ready_in,
                votes,
            },
            Lost::Contended => LockError::Contended { lock, votes },
            Lost::Busy {
                holder,
                holder_ttl,
                holder_fence,
            } => LockError::Busy {
                lock,
                holder,
                holder_ttl,
                holder_fence,
                votes,
            },
            Lost::QuorumUnreachable { needed } => LockError::QuorumUnreachable {
                lock,
                needed,
                votes,
            },
        }
    }

    /// One line, at most once a minute: the operator must make every contender list the same
    /// nodes (or stop the old ones).
    fn log_node_set_conflict(&self, ours: &str, theirs: &str) {
        let now = Deadline::now();
        let mut last = self
            .inner
            .conflict_logged_at
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if last.is_none_or(|at| now - at >= CONFLICT_LOG_EVERY) {
            *last = Some(now);
            warn!(
                lock = %self.inner.cfg.lock,
                ours,
                theirs,
                "another contender of this lock lists other Redis nodes; refusing to lead until every contender lists the same nodes"
            );
        }
    }
}

/// 128 random bits as hex.
fn random_hex() -> String {
    let bytes: [u8; 16] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

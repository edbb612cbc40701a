//! Taking the lock: one round on every node, and the wait for the lock across rounds.
//!
//! ## Behaviour
//! - A round sends the acquire script to every node at once and decides as soon as a quorum
//!   for or against is certain, with one exception: a grant from a node that has kept its
//!   data for less than the bound on any ttl (see `votes`) is judged only once every node has
//!   answered or timed out, so every reachable node's max-ttl register is known first.
//! - A round that a quorum would win, were it not for nodes whose data age is still short,
//!   fails with [`LockError::NotYetTrusted`] and says how long until they count; the wait
//!   retries then, also past its deadline (never longer than the longest ttl plus drift).
//! - A wait with a deadline retries, for up to one ttl past it, rounds that said nothing about
//!   a holder: a split among contenders, a round left short of a quorum by timeouts or
//!   connection errors (a busy host, not an outage), and a round too slow to leave any
//!   validity. Rounds that showed a holder, or failures a retry cannot mend (a wrong
//!   password, votes that do not count), end the wait at its deadline.
//! - A round takes the node set (see `votes`, rule 7) when it starts, after connecting nodes
//!   whose server is not known (bounded by the node timeout), and sends its fingerprint with
//!   every request; a grant counts only from the server the set named.
//! - Any answer that shows a live node-set record of another node set (another contender of
//!   this lock lists other servers) makes the round refuse to lead:
//!   [`LockError::NodeSetConflict`], logged (at most once a minute) and counted. A round won on
//!   nodes that carry no record at all (the lock unused for twice its ttl) hears every node
//!   first (each bounded by the node timeout), since the other list's record may stand on a
//!   node that answers last.
//! - The wait runs no round while a round showed the lock held: it watches (see `standby`)
//!   until reads, a keyspace event or an announcement say the lock may be free. A won round is
//!   announced on every node in the background.
//! - A node reporting a fencing counter at or above 2^53 (beyond what Lua compares exactly)
//!   is a protocol error for that node, not a number to build on.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use rand::Rng;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use tokio::sync::broadcast;

use super::error::Tally;
use super::fencing::MAX_TOKEN;
use super::push::{Push, PushKind};
use super::standby::{Action, Announced, Standby, SPREAD_SLOT};
use super::timing::{self, CLOCK_DRIFT_FLOOR};
use super::votes::{server_identity, DataAge, NodeSet, NotCounted, Proof};
use super::{
    clock, identity_of, quorum, validity, Lease, LockError, NodeError, NodeErrorKind, NodeFacts,
    Op, Order, Redlock, Vote, ACQUIRE,
};

/// `{granted, fence, epoch_age_ms, max_ttl_ms, candidate_stored, holder_value, holder_pttl,
/// node_set}`; `granted` is 1, 0 (held by `holder_value`) or −1 (another node set's record).
type AcquireReply = (i64, u64, i64, u64, i64, String, i64, String);

/// Subscribers of a lock's channels on one node (0: not counted).
#[derive(Clone, Copy, Debug, Default)]
struct Counted {
    /// Of the acquisition channel: every contender that waits (and the holder).
    waiters: u64,
    /// Of the release channel: those a release wakes.
    watchers: u64,
}

impl Counted {
    fn apply_to(self, standby: &mut Standby, now: Instant) {
        standby.set_waiters(now, self.waiters);
        standby.set_release_watchers(self.watchers);
    }
}

/// How often a node-set conflict is logged at most.
const CONFLICT_LOG_EVERY: Duration = Duration::from_secs(60);

/// What the acquire answers of one round say about the lock besides the votes.
#[derive(Default)]
struct Seen {
    /// The highest fencing counter any node reported.
    fence: u64,
    /// The shortest remaining ttl of another holder's key.
    holder_ttl: Option<Duration>,
    /// Other holders' lock values and on how many nodes each was seen.
    holders: Vec<(String, usize)>,
    /// A live node-set record of another node list, if any answer showed one.
    foreign_node_set: Option<String>,
}

impl Seen {
    /// Takes one answer into account; returns the holder's identity if the key was taken.
    fn add(&mut self, reply: &AcquireReply, own_node_set: &str) -> Option<String> {
        let (granted, fence, _, _, _, holder_value, pttl, node_set) = reply;
        self.fence = self.fence.max(*fence);
        if !node_set.is_empty() && node_set != own_node_set {
            self.foreign_node_set = Some(node_set.clone());
        }
        if *granted != 0 {
            return None;
        }
        if let Ok(ms) = u64::try_from(*pttl) {
            let ttl = Duration::from_millis(ms);
            self.holder_ttl = Some(self.holder_ttl.map_or(ttl, |t| t.min(ttl)));
        }
        match self.holders.iter_mut().find(|(v, _)| v == holder_value) {
            Some((_, nodes)) => *nodes += 1,
            None => self.holders.push((holder_value.clone(), 1)),
        }
        Some(identity_of(holder_value).to_owned())
    }

    /// On how many nodes the most widespread other holder was seen.
    fn most_held(&self) -> usize {
        self.holders
            .iter()
            .map(|(_, nodes)| *nodes)
            .max()
            .unwrap_or(0)
    }
}

/// One node's acquire answer, judged.
struct Judged {
    vote: Vote,
    /// The node stored our candidate token (its counter was lower).
    stored: bool,
    /// For a grant from a node whose data age is below the settled age: what it proved, to be
    /// judged once every node has answered.
    pending: Option<(Arc<NodeFacts>, Proof)>,
    /// For a grant that does not count only because the node's data age is short: how long
    /// until it would.
    ready_in: Option<Duration>,
    /// A grant from a node that carried no node-set record.
    unrecorded: bool,
}

impl Judged {
    fn vote(vote: Vote) -> Judged {
        Judged {
            vote,
            stored: false,
            pending: None,
            ready_in: None,
            unrecorded: false,
        }
    }
}

impl Redlock {
    /// Judges node `index`'s acquire answer. `decided` marks answers that came after the round
    /// was decided: a grant then is too late.
    fn acquire_vote(
        &self,
        index: usize,
        answer: Result<(AcquireReply, Arc<NodeFacts>), NodeError>,
        node_set: &NodeSet,
        seen: &mut Seen,
        decided: bool,
    ) -> Judged {
        let (reply, facts) = match answer {
            Ok(answer) => answer,
            Err(err) => return Judged::vote(Vote::Failed(err)),
        };
        if reply.1 > MAX_TOKEN {
            return Judged::vote(Vote::Failed(NodeError {
                kind: NodeErrorKind::Protocol,
                message: format!(
                    "fencing counter {} is beyond 2^53, where the scripts no longer compare exactly",
                    reply.1
                ),
            }));
        }
        let proof = Proof {
            data_age: DataAge::from_script(reply.2),
            max_ttl: Duration::from_millis(reply.3),
        };
        // Every answer carries the node's max-ttl register, busy ones too.
        self.learn_max_ttl(proof.max_ttl);
        if let Some(holder) = seen.add(&reply, &node_set.fingerprint) {
            return Judged::vote(Vote::HeldBy(holder));
        }
        if reply.0 == -1 {
            return Judged::vote(Vote::NotCounted(
                "another contender of this lock lists other Redis nodes".to_owned(),
            ));
        }
        if decided {
            // Still judged, so the node's reported health stays current.
            let _ = self.judge(index, &facts, proof);
            return Judged::vote(Vote::NotCounted(
                "granted after the round was decided".to_owned(),
            ));
        }
        let settled = matches!(proof.data_age, DataAge::Proven(age) if age >= super::votes::settled_data_age());
        let unrecorded = reply.7.is_empty();
        let server = server_identity(&facts.run_id, self.inner.nodes[index].db());
        let judged = self.judge(index, &facts, proof);
        match node_set.admits(index, server.as_deref()).and(judged) {
            Ok(()) => Judged {
                vote: Vote::Granted,
                stored: reply.4 == 1,
                pending: (!settled).then_some((facts, proof)),
                ready_in: None,
                unrecorded,
            },
            Err(NotCounted { why, ready_in }) => Judged {
                ready_in,
                ..Judged::vote(Vote::NotCounted(why))
            },
        }
    }

    /// One acquisition round: `Ok` with a lease, or why not. Never waits or retries.
    pub async fn try_acquire(&self) -> Result<Lease, LockError> {
        let cfg = &self.inner.cfg;
        let n = self.inner.nodes.len();
        let needed = quorum(n);
        let value = format!("{}:{}", cfg.identity, random_hex());
        let candidate = self.next_token(self.inner.fence_seen.load(Ordering::Relaxed));
        let node_set = self.round_node_set().await;
        let start = clock::now();
        let since = SystemTime::now();
        let mut answers = self.fan_out::<AcquireReply>(
            Op::Acquire,
            Order::MayWrite,
            &ACQUIRE,
            vec![
                value.clone(),
                cfg.ttl.as_millis().to_string(),
                candidate.to_string(),
                self.inner.retention_ms(),
                node_set.fingerprint.clone(),
            ],
        );
        let mut tally = Tally::new(n);
        let mut seen = Seen::default();
        // Counted grants whose node stored our candidate token (its counter was lower).
        let mut candidate_stored = 0;
        // Grants from young nodes, judged once every node has answered.
        let mut pending = Vec::new();
        // Per node: how long until a grant that does not count yet would.
        let mut ready_in: Vec<Option<Duration>> = vec![None; n];
        // Whether a grant came from a node without a node-set record.
        let mut unrecorded = false;
        while let Some((index, answer)) = answers.recv().await {
            let judged = self.acquire_vote(index, answer, &node_set, &mut seen, false);
            ready_in[index] = judged.ready_in;
            unrecorded |= judged.unrecorded;
            if let Some((facts, proof)) = judged.pending {
                pending.push((index, facts, proof, judged.stored));
                continue;
            }
            candidate_stored += usize::from(judged.stored);
            if tally.record(index, judged.vote) {
                break;
            }
        }
        // Unless the round was decided without them, every node has answered or timed out:
        // every reachable register is known now. (Decided, they only complete the report.)
        for (index, facts, proof, stored) in pending {
            let vote = match self.judge(index, &facts, proof) {
                Ok(()) => {
                    candidate_stored += usize::from(stored);
                    Vote::Granted
                }
                Err(NotCounted {
                    why,
                    ready_in: wait,
                }) => {
                    ready_in[index] = wait;
                    Vote::NotCounted(why)
                }
            };
            tally.record(index, vote);
        }
        let granted = tally.granted();
        let quorum_granted = tally.won();
        let mut votes = tally.votes;
        if quorum_granted && unrecorded {
            // Nodes of the quorum carry no node-set record: another node list's record may
            // stand on a node that has not answered yet, so every answer is heard first.
            while let Some((index, answer)) = answers.recv().await {
                votes[index] = Some(
                    self.acquire_vote(index, answer, &node_set, &mut seen, true)
                        .vote,
                );
            }
        }
        // Nodes may have stored the candidate even if this round fails: start above it next time.
        self.inner
            .fence_seen
            .fetch_max(seen.fence.max(candidate), Ordering::Relaxed);
        let won = quorum_granted && seen.foreign_node_set.is_none();
        if !won {
            // The remaining answers (each bounded by the node timeout) complete the report,
            // so followers see the holder most nodes agree on, and show where to clean up.
            while let Some((index, answer)) = answers.recv().await {
                votes[index] = Some(
                    self.acquire_vote(index, answer, &node_set, &mut seen, true)
                        .vote,
                );
            }
            self.inner
                .fence_seen
                .fetch_max(seen.fence, Ordering::Relaxed);
            // Our key may stand wherever a node did not answer "held by someone else".
            self.clean_up(
                &value,
                &node_set.fingerprint,
                |vote| !matches!(vote, Some(Vote::HeldBy(_))),
                &votes,
            )
            .await;
            return Err(self.round_lost(votes, &seen, &node_set, granted, &ready_in));
        }
        // Answers after the quorum still carry counters (the next candidate starts above
        // them) and tell whether their node's vote counts, so every node's report stays current.
        let this = self.clone();
        let late_set = node_set.clone();
        tokio::spawn(async move {
            let node_set = late_set;
            let mut late = Seen::default();
            while let Some((index, answer)) = answers.recv().await {
                this.acquire_vote(index, answer, &node_set, &mut late, true);
            }
            this.inner
                .fence_seen
                .fetch_max(late.fence, Ordering::Relaxed);
        });
        let elapsed = || clock::now().saturating_duration_since(start);
        let too_short = || LockError::ValidityTooShort {
            lock: cfg.lock.clone(),
            elapsed: elapsed(),
            ttl: cfg.ttl,
        };
        if validity(cfg.ttl, elapsed()).is_none() {
            self.clean_up(&value, &node_set.fingerprint, |_| true, &votes)
                .await;
            return Err(too_short());
        }
        // The candidate is safe once a quorum stored it; otherwise a node already had a
        // counter at least as high, and a write-back round mints the next token.
        let fencing_token = if candidate_stored >= needed {
            candidate
        } else {
            match self
                .raise_fence(self.next_token(seen.fence.max(candidate)))
                .await
            {
                Ok(token) => token,
                Err(votes_fence) => {
                    self.clean_up(&value, &node_set.fingerprint, |_| true, &votes)
                        .await;
                    return Err(LockError::QuorumUnreachable {
                        lock: cfg.lock.clone(),
                        needed,
                        votes: votes_fence,
                    });
                }
            }
        };
        self.inner
            .fence_seen
            .fetch_max(fencing_token, Ordering::Relaxed);
        let Some(valid) = validity(cfg.ttl, elapsed()) else {
            self.clean_up(&value, &node_set.fingerprint, |_| true, &votes)
                .await;
            return Err(too_short());
        };
        let lease = Lease {
            value,
            fencing_token,
            acquired_at: start,
            since,
            valid_until: start + valid,
            renewals: 0,
        };
        self.announce_acquired(&lease);
        Ok(lease)
    }

    /// Why a round that was not won was lost, from every answer it got.
    fn round_lost(
        &self,
        votes: Vec<Option<Vote>>,
        seen: &Seen,
        node_set: &NodeSet,
        granted: usize,
        ready_in: &[Option<Duration>],
    ) -> LockError {
        let cfg = &self.inner.cfg;
        let n = votes.len();
        let needed = quorum(n);
        let lock = cfg.lock.clone();
        if let Some(theirs) = &seen.foreign_node_set {
            self.inner.observer.node_set_conflict();
            self.log_node_set_conflict(&node_set.fingerprint, theirs);
            return LockError::NodeSetConflict {
                lock,
                votes: self.label_votes(votes),
            };
        }
        let holder = most_common_holder(&votes);
        let answered = votes
            .iter()
            .filter(|v| matches!(v, Some(v) if !matches!(v, Vote::Failed(_))))
            .count();
        // Nodes whose grants will count soon: enough of them to make a quorum is a wait.
        let mut soon: Vec<Duration> = ready_in.iter().flatten().copied().collect();
        soon.sort();
        let missing = needed.saturating_sub(granted);
        let wait = (missing > 0 && soon.len() >= missing).then(|| soon[missing - 1]);
        let votes = self.label_votes(votes);
        // Not even the nodes that did not answer could give any one holder a quorum:
        // a split among contenders, who all clean up. Not busy: nobody holds the lock.
        let split = seen.most_held() + (n - answered) < needed;
        if let Some(ready_in) = wait {
            LockError::NotYetTrusted {
                lock,
                ready_in,
                votes,
            }
        } else if holder.is_some() && answered >= needed && split {
            LockError::Contended { lock, votes }
        } else if holder.is_some() && answered >= needed {
            LockError::Busy {
                lock,
                holder,
                holder_ttl: seen.holder_ttl,
                holder_fence: seen.fence,
                votes,
            }
        } else {
            LockError::QuorumUnreachable {
                lock,
                needed,
                votes,
            }
        }
    }

    /// One line, at most once a minute: the operator must make every contender list the same
    /// nodes (or stop the old ones).
    fn log_node_set_conflict(&self, ours: &str, theirs: &str) {
        let now = Instant::now();
        let mut last = self
            .inner
            .conflict_logged_at
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if last.is_none_or(|at| now.duration_since(at) >= CONFLICT_LOG_EVERY) {
            *last = Some(now);
            warn!(
                lock = %self.inner.cfg.lock,
                ours,
                theirs,
                "another contender of this lock lists other Redis nodes; refusing to lead until every contender lists the same nodes"
            );
        }
    }

    /// Waits for the lock: retries with growing random delays, and at once when a
    /// holder announces a release, until `deadline` (then the last error) or `cancel`.
    ///
    /// `on_attempt` sees every round's outcome and duration (to publish who holds the lock).
    pub async fn acquire(
        &self,
        deadline: Option<Instant>,
        cancel: &CancellationToken,
        on_attempt: impl FnMut(&Result<Lease, LockError>, Duration),
    ) -> Result<Lease, LockError> {
        self.acquire_watching(deadline, cancel, on_attempt, |_| {})
            .await
    }

    /// [`Redlock::acquire`], and `on_holder` sees every holder learnt between rounds (from a
    /// push or a read of the nodes; `None`: released).
    ///
    /// While the lock is held by someone else, no round runs until the lock may be free: see
    /// [`super::standby`] for what is read and when.
    pub async fn acquire_watching(
        &self,
        deadline: Option<Instant>,
        cancel: &CancellationToken,
        mut on_attempt: impl FnMut(&Result<Lease, LockError>, Duration),
        mut on_holder: impl FnMut(Option<HolderSeen>),
    ) -> Result<Lease, LockError> {
        self.listen_for_releases();
        let cfg = &self.inner.cfg;
        let mut pushes = self.inner.pushes.subscribe();
        let mut attempt = 0u32;
        let mut waited_for_trust = false;
        let mut counted_waiters = false;
        let mut standby = Standby::new(
            self.inner.nodes.len(),
            quorum(self.inner.nodes.len()),
            self.known_longest_ttl(),
            cfg.retry_max,
        );
        loop {
            // A started round is never abandoned half-way: it is short (node timeout) and
            // dropping it could leave keys behind until their ttl.
            let round = Instant::now();
            let started = clock::now();
            let result = self.try_acquire().await;
            on_attempt(&result, round.elapsed());
            let err = match result {
                Ok(lease) => return Ok(lease),
                Err(err) => err,
            };
            if let LockError::Busy {
                holder,
                holder_ttl,
                holder_fence,
                votes,
                ..
            } = &err
            {
                // Held: watch instead of asking again (see `standby`).
                let held: Vec<bool> = self
                    .inner
                    .nodes
                    .iter()
                    .map(|node| {
                        votes.0.iter().any(|(label, vote)| {
                            label == node.label() && matches!(vote, Vote::HeldBy(_))
                        })
                    })
                    .collect();
                standby.set_longest_ttl(self.known_longest_ttl());
                if !counted_waiters {
                    // Once: how many wait with us, so a release does not wake them all at once.
                    counted_waiters = true;
                    let counted = self.count_waiters().await;
                    counted.apply_to(&mut standby, clock::now());
                }
                standby.round_busy(
                    started,
                    &held,
                    *holder_ttl,
                    holder.as_deref(),
                    *holder_fence,
                );
                match self
                    .watch(&mut standby, &mut pushes, deadline, cancel, &mut on_holder)
                    .await
                {
                    Watched::Round => {
                        attempt = 0;
                        continue;
                    }
                    Watched::Cancelled => return Err(LockError::Cancelled),
                    Watched::Deadline => return Err(err),
                }
            }
            let mut delay = match &err {
                // Nodes that will count soon: retry when they do (their clocks may run up to
                // the drift factor slower than ours).
                LockError::NotYetTrusted { ready_in, .. } => {
                    if !waited_for_trust {
                        waited_for_trust = true;
                        info!(lock = %cfg.lock, wait = ?ready_in, error = %err, "waiting for nodes whose votes count once they have kept their data for ttl + drift");
                    }
                    *ready_in + timing::drift(*ready_in)
                }
                // Otherwise random and growing, so a struggling fleet is not hammered.
                _ => timing::retry_delay(cfg.retry_delay, cfg.retry_max, attempt),
            };
            if let Some(deadline) = deadline {
                let deadline = retry_until(&err, deadline, cfg.ttl, round + delay);
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(err);
                }
                delay = delay.min(left);
            }
            let sleep = tokio::time::sleep(delay);
            tokio::pin!(sleep);
            loop {
                tokio::select! {
                    biased;
                    _ = cancel.cancelled() => return Err(LockError::Cancelled),
                    push = pushes.recv() => {
                        // A release: retry after a pause that spreads the waiters out.
                        if let Ok(Push { kind: PushKind::Released(_), .. }) = push {
                            let spread = SPREAD_SLOT.mul_f64(rand::rng().random_range(0.0..=1.0));
                            tokio::time::sleep(spread).await;
                            break;
                        }
                        if let Err(broadcast::error::RecvError::Closed) = push {
                            (&mut sleep).await;
                            break;
                        }
                    }
                    _ = &mut sleep => break,
                }
            }
            attempt = attempt.saturating_add(1);
        }
    }

    /// The subscribers of the acquisition channel (the waiters) and of the release channel
    /// (those a release wakes) on the first node that answers, from a random one on (0 if
    /// none): counts spread over the nodes. Every count, the first or a recount, also goes
    /// into the next acquisition announcement (`waiters_seen`), and decides again whether to
    /// watch releases on that node (see `standby::watches_releases`).
    async fn count_waiters(&self) -> Counted {
        let nodes = &self.inner.nodes;
        let first = rand::rng().random_range(0..nodes.len().max(1));
        for index in (0..nodes.len()).cycle().skip(first).take(nodes.len()) {
            let node = &nodes[index];
            let channels = self.inner.channels(index);
            let numsub = node
                .command::<(String, u64, String, u64)>(
                    redis::cmd("PUBSUB")
                        .arg("NUMSUB")
                        .arg(&channels.acquired)
                        .arg(&channels.released),
                    self.inner.cfg.node_timeout,
                )
                .await;
            if let Ok((_, waiters, _, watchers)) = numsub {
                self.inner
                    .waiters_seen
                    .fetch_max(waiters, Ordering::Relaxed);
                self.inner.observer.waiters_counted(waiters);
                self.inner.decide_release_watch(index, watchers);
                return Counted { waiters, watchers };
            }
        }
        Counted::default()
    }

    /// The longest ttl any contender of this lock is known to use.
    fn known_longest_ttl(&self) -> Duration {
        let seen = Duration::from_millis(self.inner.max_ttl_seen.load(Ordering::Relaxed));
        self.inner.cfg.longest_ttl().max(seen)
    }

    /// Carries out what `standby` decides until it calls for a round (or `deadline`, or
    /// `cancel`): waits, reads the nodes, and takes in what they push.
    async fn watch(
        &self,
        standby: &mut Standby,
        pushes: &mut broadcast::Receiver<Push>,
        deadline: Option<Instant>,
        cancel: &CancellationToken,
        on_holder: &mut impl FnMut(Option<HolderSeen>),
    ) -> Watched {
        let mut subscribed = self.inner.subscribed.subscribe();
        loop {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Watched::Deadline;
            }
            for (index, up) in subscribed.borrow_and_update().iter().enumerate() {
                standby.subscription(index, *up);
            }
            // Re-read after anything that can move it.
            let now = clock::now();
            let (action, at) = standby.next(now);
            if matches!(action, Action::Read { .. } | Action::Skip) && standby.recount_due(now) {
                // Counted before the turn is decided; then decide again at the new now.
                self.count_waiters().await.apply_to(standby, now);
                continue;
            }
            match action {
                Action::Round => return Watched::Round,
                Action::Read { fallback } => {
                    self.inner.observer.standby_read(fallback);
                    let started = clock::now();
                    let reads = self.read_keys().await;
                    let mut holders: Vec<(&str, usize)> = Vec::new();
                    for (index, read) in reads.iter().enumerate() {
                        standby.read(
                            started,
                            index,
                            match read {
                                Ok(read) => Ok(read.as_ref().map(|(_, pttl)| *pttl)),
                                Err(_) => Err(()),
                            },
                        );
                        if let Ok(Some((identity, _))) = read {
                            match holders.iter_mut().find(|(id, _)| id == identity) {
                                Some((_, n)) => *n += 1,
                                None => holders.push((identity, 1)),
                            }
                        }
                    }
                    let needed = quorum(reads.len());
                    let shown = holders
                        .iter()
                        .find(|(_, n)| *n >= needed)
                        .map(|(identity, _)| *identity);
                    standby.shown(shown);
                    let mut rng = rand::rng();
                    standby.turn_taken(rng.random_range(0.0..=1.0));
                    standby.settle(clock::now(), rng.random_range(0.0..=1.0), false);
                    if let Some(identity) = shown {
                        on_holder(Some(HolderSeen {
                            identity: identity.to_owned(),
                            fencing_token: None,
                        }));
                    }
                    continue;
                }
                Action::Skip => {
                    self.inner.observer.standby_read_skipped();
                    standby.skip(now, rand::rng().random_range(0.0..=1.0));
                    continue;
                }
                Action::Wait => {}
            }
            let wake = match (at, deadline) {
                (Some(at), Some(deadline)) => {
                    Some(at.min(clock::now() + deadline.saturating_duration_since(Instant::now())))
                }
                (at, deadline) => at
                    .or(deadline
                        .map(|d| clock::now() + d.saturating_duration_since(Instant::now()))),
            };
            let sleep = async {
                match wake {
                    Some(wake) => clock::sleep_until(wake).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return Watched::Cancelled,
                push = pushes.recv() => match push {
                    Ok(push) => self.take_push(standby, push, on_holder),
                    Err(broadcast::error::RecvError::Lagged(_)) => standby.forget(),
                    Err(broadcast::error::RecvError::Closed) => {}
                },
                _ = subscribed.changed() => {}
                // The deadline is checked at the top of the loop.
                _ = sleep => {}
            }
        }
    }

    /// Takes one push into `standby`, and tells `on_holder` of a new holder or a release.
    fn take_push(
        &self,
        standby: &mut Standby,
        push: Push,
        on_holder: &mut impl FnMut(Option<HolderSeen>),
    ) {
        let now = clock::now();
        match push.kind {
            PushKind::Released(identity) => {
                let jitter = rand::rng().random_range(0.0..=1.0);
                if standby.released(now, push.node, &identity, jitter) {
                    on_holder(None);
                }
            }
            PushKind::Acquired(acquired) => {
                if acquired.identity == self.inner.cfg.identity {
                    // Our own announcement (a lease this engine won on another path).
                    return;
                }
                // The announced count of waiters is not taken: counts come from the nodes.
                let fencing_token = acquired.fencing_token;
                let news = standby.acquired(
                    now,
                    Announced {
                        identity: acquired.identity.clone(),
                        fencing_token,
                    },
                    acquired.validity,
                );
                if news {
                    on_holder(Some(HolderSeen {
                        identity: acquired.identity,
                        fencing_token: Some(fencing_token),
                    }));
                }
            }
            PushKind::Key(event) => standby.key_event(now, push.node, event),
        }
        standby.settle(now, rand::rng().random_range(0.0..=1.0), true);
    }
}

/// How a watch ended.
enum Watched {
    /// The lock may be free: run a round.
    Round,
    Cancelled,
    Deadline,
}

/// A holder learnt between rounds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderSeen {
    /// Its identity.
    pub identity: String,
    /// Its fencing token, when announced (a read does not show it).
    pub fencing_token: Option<u64>,
}

/// Until when a wait with `deadline` retries after a round that failed with `err`; `next` is
/// when the next round would start. Past the deadline, only rounds that said nothing about a
/// holder are retried, each for a bounded time:
/// - a split among contenders, and a round too slow to count (timeouts or connection errors
///   left it short of a quorum, or it took the whole validity): up to one ttl past the
///   deadline. A busy host that misses the node timeout once is not an outage; by then every
///   key of such a round has expired. A node that stays down still ends the wait then.
/// - votes that count soon: until they do (at most the longest ttl + drift).
fn retry_until(err: &LockError, deadline: Instant, ttl: Duration, next: Instant) -> Instant {
    match err {
        LockError::Contended { .. } | LockError::ValidityTooShort { .. } => deadline + ttl,
        LockError::QuorumUnreachable { votes, .. } if slow_or_unreachable(votes) => deadline + ttl,
        LockError::NotYetTrusted { .. } => deadline.max(next + CLOCK_DRIFT_FLOOR),
        _ => deadline,
    }
}

/// Whether some node failed to answer in time or could not be reached: a retry may get its
/// vote. Other failures (a wrong password, a node that may evict keys) stay as they are.
fn slow_or_unreachable(votes: &super::Votes) -> bool {
    votes.0.iter().any(|(_, vote)| {
        matches!(vote, Vote::Failed(err) if matches!(err.kind, NodeErrorKind::Timeout | NodeErrorKind::Connection))
    })
}

/// The identity that holds the key on the most nodes among `votes`.
fn most_common_holder(votes: &[Option<Vote>]) -> Option<String> {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for vote in votes.iter().flatten() {
        if let Vote::HeldBy(identity) = vote {
            match counts.iter_mut().find(|(id, _)| id == identity) {
                Some((_, n)) => *n += 1,
                None => counts.push((identity, 1)),
            }
        }
    }
    counts
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .map(|(id, _)| id.to_owned())
}

/// 128 random bits as hex.
fn random_hex() -> String {
    let bytes: [u8; 16] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redlock::Votes;

    fn votes(failed: &[NodeErrorKind]) -> Votes {
        let mut votes = vec![("a:1".to_owned(), Vote::Granted)];
        for (i, kind) in failed.iter().enumerate() {
            let err = NodeError {
                kind: *kind,
                message: String::new(),
            };
            votes.push((format!("n{i}:1"), Vote::Failed(err)));
        }
        Votes(votes)
    }

    fn unreachable(failed: &[NodeErrorKind]) -> LockError {
        LockError::QuorumUnreachable {
            lock: "l".to_owned(),
            needed: 2,
            votes: votes(failed),
        }
    }

    #[test]
    fn rounds_short_of_a_quorum_for_timeouts_or_connection_errors_are_retried_for_one_ttl() {
        let deadline = Instant::now();
        let ttl = Duration::from_secs(10);
        let next = deadline + Duration::from_millis(200);
        for failed in [
            &[NodeErrorKind::Timeout, NodeErrorKind::Timeout][..],
            &[NodeErrorKind::Connection, NodeErrorKind::Timeout],
            &[NodeErrorKind::Auth, NodeErrorKind::Connection],
        ] {
            let err = unreachable(failed);
            assert_eq!(
                retry_until(&err, deadline, ttl, next),
                deadline + ttl,
                "{err}"
            );
        }
        let slow = LockError::ValidityTooShort {
            lock: "l".to_owned(),
            elapsed: ttl,
            ttl,
        };
        assert_eq!(retry_until(&slow, deadline, ttl, next), deadline + ttl);
        let split = LockError::Contended {
            lock: "l".to_owned(),
            votes: Votes::default(),
        };
        assert_eq!(retry_until(&split, deadline, ttl, next), deadline + ttl);
    }

    #[test]
    fn other_failures_end_the_wait_at_its_deadline() {
        let deadline = Instant::now();
        let ttl = Duration::from_secs(10);
        let next = deadline + Duration::from_millis(200);
        // Nodes that answered but cannot count, or refuse our password: a retry changes nothing.
        let refused = unreachable(&[NodeErrorKind::Auth, NodeErrorKind::Protocol]);
        assert_eq!(retry_until(&refused, deadline, ttl, next), deadline);
        let not_counted = LockError::QuorumUnreachable {
            lock: "l".to_owned(),
            needed: 2,
            votes: Votes(vec![(
                "a:1".to_owned(),
                Vote::NotCounted("may evict keys".to_owned()),
            )]),
        };
        assert_eq!(retry_until(&not_counted, deadline, ttl, next), deadline);
        let busy = LockError::Busy {
            lock: "l".to_owned(),
            holder: None,
            holder_ttl: None,
            holder_fence: 0,
            votes: Votes::default(),
        };
        assert_eq!(retry_until(&busy, deadline, ttl, next), deadline);
        let conflict = LockError::NodeSetConflict {
            lock: "l".to_owned(),
            votes: Votes::default(),
        };
        assert_eq!(retry_until(&conflict, deadline, ttl, next), deadline);
        // Votes that count soon: waited for, past the deadline if need be.
        let soon = LockError::NotYetTrusted {
            lock: "l".to_owned(),
            ready_in: Duration::from_secs(3),
            votes: Votes::default(),
        };
        let later = deadline + Duration::from_secs(3);
        assert_eq!(
            retry_until(&soon, deadline, ttl, later),
            later + CLOCK_DRIFT_FLOOR
        );
    }
}

//! The acquire round as a state machine: every node's answer goes in, and out comes "listen
//! on", "lost (clean up here)", "too slow (clean up everywhere)" or "won (this token, or raise
//! the fence first)".
//!
//! ## The rules, in the order an answer meets them
//! 1. An error is a failed vote. A fencing counter at or above 2^53 (beyond what Lua compares
//!    exactly) is a protocol error for that node, not a number to build on.
//! 2. Every answer, busy ones too, carries the node's max-ttl register (learnt: the longest
//!    ttl in use), its fencing counter (the next candidate starts above it) and its node-set
//!    record (another set's live record: the round refuses to lead).
//! 3. A key held by another value is a vote against (`HeldBy`).
//! 4. A grant under another set's record (`-1`) is not counted (see rule 10).
//! 5. A grant is judged (`votes`): same server as an earlier node, eviction, data age, and the
//!    server the round's node set named. A grant from a node whose data age is below the
//!    settled age (`votes::settled_data_age`) is judged only once every node has answered
//!    (or the round is decided without it), so every reachable register is known first.
//!    Where such young grants would win the round while a node did not answer in time (a
//!    timeout: slow, paused, its connection still being set up; or a broken connection being
//!    remade), the round is not decided on a guess about that node's register: it reads the
//!    node's register again (`Recheck`) until it answers or the recheck window ends (see
//!    `timing::recheck_window`). A node still silent then is taken as unreachable: the case
//!    `--max-ttl` covers.
//! 6. The round is decided as soon as a quorum for or against is certain. A grant that comes
//!    after that is not counted (it is still judged, for the node's reported health).
//! 7. A round won on a node that carried no node-set record hears every node before it leads,
//!    since another set's record may stand on a node that answers last.
//! 8. A round not won hears every node (the report, and where to clean up), then deletes its
//!    key wherever a node did not show another holder.
//! 9. A won round leads only with validity left (`ttl − elapsed − drift`) and a token: the
//!    candidate if a quorum of counted grants stored it, else a raise above every counter
//!    seen (see [`super::fence`]).
//! 10. Another set's record is judged once every node has answered: beside a held key, or
//!     naming a server of ours that is older than the record, it is a conflict (the round
//!     refuses to lead); beside a free key, where every server of ours that it does not name
//!     came up after it was written (`votes::NodeSet::explains`: a restart its writer did not
//!     live to see), it is stale. A round that saw stale records, or whose grants replaced one
//!     (the acquire script does, on the next round's word, see [`StaleRecord`]), leads only if
//!     every node answered; one that cannot tell (a new server of ours showed no age) does not
//!     lead, and it is not a conflict.

use std::time::Duration;

pub use super::answer::{identity_of, AcquireReply, AcquireStatus, RawAcquireReply};
use super::answer::{most_common_holder, Seen};
use super::fence::MAX_TOKEN;
pub use super::outcome::{AcquireStep, Lost, RoundLost, StaleRecord, TokenPlan, Validity};
use super::{Connection, NodeAnswer, Rules};
use crate::clock::Deadline;
use crate::error::{NodeError, NodeErrorKind};
use crate::error::{Tally, Vote};
use crate::timing::quorum;
use crate::votes::{self, judge_vote, DataAge, NodeSet, NotCounted, Proof, RecordVerdict};

/// One node's answer, judged.
struct Judged {
    vote: Vote,
    /// The node stored our candidate token.
    stored: bool,
    /// A grant from a node whose data age is below the settled age: judged once every node
    /// has answered.
    pending: Option<(Connection, Proof)>,
    /// A grant that does not count only because the node's data age is short: how long until
    /// it would.
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

/// Where a round stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Counting votes until a quorum for or against is certain.
    Counting,
    /// Young grants would win, but nodes that may hold a longer ttl's register did not
    /// answer: their registers are read again before the young grants are judged.
    Rechecking,
    /// Won on a node without a node-set record: every answer is heard before leading.
    HearingAll,
    /// Decided; a lost round still hears every answer before it reports.
    Decided,
}

/// What a round makes of the other sets' records it saw (rule 10).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Records {
    /// None seen, and none replaced.
    Clear,
    /// Every one predates a restart of our servers; the round may lead.
    Stale(Option<StaleRecord>),
    /// Cannot tell: the round does not lead, and it is not a conflict.
    Unsure,
    /// Another set's record (beside a held key, or naming a server of ours that is not new).
    Conflict(String),
}

/// What an acquire round is started with.
#[derive(Clone, Debug)]
pub struct AcquireParams {
    /// Our `--ttl`.
    pub ttl: Duration,
    /// The longest ttl known to be in use when the round starts (`--max-ttl`, registers).
    pub longest_ttl: Duration,
    /// The candidate token the requests carry.
    pub candidate: u64,
    /// The node set the requests record.
    pub node_set: NodeSet,
    /// `--allow-evicting-nodes`.
    pub allow_evicting: bool,
    /// How long after the round's start silent nodes' registers are read again before young
    /// grants are judged without them (`timing::recheck_window`).
    pub recheck_for: Duration,
    /// The rules (all on, but in the model).
    pub rules: Rules,
}

/// One acquire round over `n` nodes.
pub struct AcquireRound {
    params: AcquireParams,
    start: Deadline,
    tally: Tally,
    answered: usize,
    seen: Seen,
    /// The longest register any answer reported.
    register: Duration,
    /// Counted grants whose node stored our candidate token.
    candidate_stored: usize,
    /// Grants from young nodes, judged once every node has answered.
    pending: Vec<(usize, Connection, Proof, bool)>,
    /// While rechecking: the nodes whose register is still awaited.
    silent: Vec<usize>,
    /// Per node: how long until a grant that does not count yet would.
    ready_in: Vec<Option<Duration>>,
    /// Per node: the data age its grant proved in this round.
    ages: Vec<Option<Duration>>,
    /// A counted grant came from a node without a node-set record.
    unrecorded: bool,
    stage: Stage,
    /// Counted grants when the round was decided.
    granted: usize,
    quorum_granted: bool,
    /// Verdicts on grants (node, counted) not yet taken by the caller (for metrics).
    verdicts: Vec<(usize, bool)>,
}

impl AcquireRound {
    /// A round over `nodes` nodes whose requests went out at `start`.
    pub fn new(nodes: usize, params: AcquireParams, start: Deadline) -> AcquireRound {
        AcquireRound {
            params,
            start,
            tally: Tally::new(nodes),
            answered: 0,
            seen: Seen::default(),
            register: Duration::ZERO,
            candidate_stored: 0,
            pending: Vec::new(),
            silent: Vec::new(),
            ready_in: vec![None; nodes],
            ages: vec![None; nodes],
            unrecorded: false,
            stage: Stage::Counting,
            granted: 0,
            quorum_granted: false,
            verdicts: Vec::new(),
        }
    }

    fn nodes(&self) -> usize {
        self.tally.votes.len()
    }

    /// The longest ttl known now: the round's start value and, with the register rule, every
    /// register reported.
    pub fn longest_ttl(&self) -> Duration {
        if self.params.rules.register {
            self.params.longest_ttl.max(self.register)
        } else {
            self.params.longest_ttl
        }
    }

    /// The longest max-ttl register any answer reported.
    pub fn register_seen(&self) -> Duration {
        self.register
    }

    /// The highest fencing counter any answer reported, and the candidate (nodes may have
    /// stored it even if the round fails): the next candidate starts above it.
    pub fn fence_seen(&self) -> u64 {
        self.seen.fence.max(self.params.candidate)
    }

    /// The verdicts on grants since last asked: (node, counted), for the node-health metric.
    pub fn take_verdicts(&mut self) -> Vec<(usize, bool)> {
        std::mem::take(&mut self.verdicts)
    }

    /// Node `index`'s answer.
    pub fn handle(&mut self, index: usize, answer: Result<NodeAnswer<AcquireReply>, NodeError>) {
        self.answered += 1;
        let decided = self.stage != Stage::Counting;
        let judged = self.judge_answer(index, answer, decided);
        if decided {
            // Completes the report only.
            self.tally.votes[index] = Some(judged.vote);
            return;
        }
        self.ready_in[index] = judged.ready_in;
        self.unrecorded |= judged.unrecorded;
        match judged.pending {
            Some((conn, proof)) => self.pending.push((index, conn, proof, judged.stored)),
            None => {
                self.candidate_stored += usize::from(judged.stored);
                self.tally.record(index, judged.vote);
            }
        }
        self.decide_when_certain();
    }

    /// Once a quorum for or against is certain, or every node has answered: the young nodes'
    /// grants are judged (every reachable register is known now, unless the round was decided
    /// without them, or a silent node's register is read again first), and the round is
    /// decided.
    fn decide_when_certain(&mut self) {
        if !(self.tally.decided() || self.answered == self.nodes()) {
            return;
        }
        self.silent = self.to_recheck();
        if self.silent.is_empty() {
            self.decide();
        } else {
            self.stage = Stage::Rechecking;
        }
    }

    /// The nodes whose register must be read again before the young grants are judged: those
    /// that did not answer in time, when the young grants would win the round without them.
    fn to_recheck(&self) -> Vec<usize> {
        if !self.params.rules.recheck_silent || self.tally.decided() || self.pending.is_empty() {
            return Vec::new();
        }
        let longest = self.longest_ttl();
        let would_count = self
            .pending
            .iter()
            .filter(|(_, conn, proof, _)| {
                let (allow, rules) = (self.params.allow_evicting, self.params.rules);
                judge_vote(conn, *proof, longest, allow, rules).is_ok()
            })
            .count();
        if self.tally.granted() + would_count < quorum(self.nodes()) {
            return Vec::new();
        }
        (0..self.nodes())
            .filter(|i| matches!(&self.tally.votes[*i], Some(Vote::Failed(err)) if may_answer(err)))
            .collect()
    }

    /// Judges the young nodes' grants with every register known, and decides the round.
    fn decide(&mut self) {
        for (index, conn, proof, stored) in std::mem::take(&mut self.pending) {
            let vote = match self.judge_grant(index, &conn, proof, false) {
                Ok(()) => {
                    self.candidate_stored += usize::from(stored);
                    Vote::Granted
                }
                Err(NotCounted { why, ready_in }) => {
                    self.ready_in[index] = ready_in;
                    Vote::NotCounted(why)
                }
            };
            self.tally.record(index, vote);
        }
        self.silent.clear();
        self.granted = self.tally.granted();
        self.quorum_granted = self.tally.won();
        self.stage = if self.quorum_granted && self.unrecorded {
            Stage::HearingAll
        } else {
            Stage::Decided
        };
    }

    /// Node `index`'s register, read again while rechecking (see [`AcquireStep::Recheck`]):
    /// the value (zero if absent), or why it could not be read. A timeout before the recheck
    /// window ends leaves the node to be read again; any other failure means it cannot be
    /// reached.
    pub fn handle_register(
        &mut self,
        index: usize,
        register: Result<Duration, NodeError>,
        now: Deadline,
    ) {
        if self.stage != Stage::Rechecking || !self.silent.contains(&index) {
            return;
        }
        match register {
            Ok(register) => self.register = self.register.max(register),
            Err(err) if err.kind == NodeErrorKind::Timeout && now < self.recheck_until() => return,
            Err(_) => {}
        }
        self.silent.retain(|i| *i != index);
        if self.silent.is_empty() {
            self.decide();
        }
    }

    /// Past the recheck window, nodes still silent are taken as unreachable (the case
    /// `--max-ttl` covers) and the round is decided.
    pub fn handle_timeout(&mut self, now: Deadline) {
        if self.stage == Stage::Rechecking && now >= self.recheck_until() {
            self.decide();
        }
    }

    /// When a recheck gives up on the nodes still silent.
    fn recheck_until(&self) -> Deadline {
        self.start + self.params.recheck_for
    }

    /// What to do next, at `now`.
    pub fn poll(&self, now: Deadline) -> AcquireStep {
        let heard_all = self.answered >= self.nodes();
        match self.stage {
            Stage::Counting => return AcquireStep::Listen,
            Stage::Rechecking => return AcquireStep::Recheck(self.silent.clone()),
            Stage::HearingAll if !heard_all => return AcquireStep::Listen,
            _ => {}
        }
        let records_seen = self.params.rules.node_set_conflict
            && (!self.seen.foreign.is_empty() || self.seen.replaced);
        if (!self.quorum_granted || records_seen) && !heard_all {
            return AcquireStep::Listen;
        }
        let refused = matches!(self.records(), Records::Unsure | Records::Conflict(_));
        if !self.quorum_granted || refused {
            // Our key may stand wherever a node did not answer "held by someone else".
            let clean_up = (0..self.nodes())
                .filter(|i| !matches!(self.tally.votes[*i], Some(Vote::HeldBy(_))))
                .collect();
            return AcquireStep::Lost {
                clean_up,
                lost: self.lost(),
            };
        }
        if let Err(elapsed) = self.validity().at(now) {
            return AcquireStep::TooShort { elapsed };
        }
        let candidate = self.params.candidate;
        AcquireStep::Won(if self.candidate_stored >= quorum(self.nodes()) {
            TokenPlan::Stored(candidate)
        } else {
            TokenPlan::RaiseAbove(self.seen.fence.max(candidate))
        })
    }

    /// When to call [`AcquireRound::handle_timeout`]: the end of a recheck. The answers
    /// awaited otherwise carry no deadline of the round's (each node's call is bounded by the
    /// node timeout).
    pub fn poll_timeout(&self) -> Option<Deadline> {
        (self.stage == Stage::Rechecking).then(|| self.recheck_until())
    }

    /// The validity clock of this round, to check again once the token is minted.
    pub fn validity(&self) -> Validity {
        Validity {
            start: self.start,
            ttl: self.params.ttl,
            rules: self.params.rules,
        }
    }

    /// The other sets' records this round saw (rule 10), once every node has answered: each
    /// beside a free key and explained by a restart of our servers (`votes::NodeSet::explains`)
    /// is stale; one beside a held key, or naming a server of ours that is not new, is a
    /// conflict. Stale records, and grants that replaced one, let the round lead only if every
    /// node answered: a node not heard may hold the writer's key.
    fn records(&self) -> Records {
        if !self.params.rules.node_set_conflict
            || (self.seen.foreign.is_empty() && !self.seen.replaced)
        {
            return Records::Clear;
        }
        let mut stale: Option<StaleRecord> = None;
        let mut unsure = false;
        for record in &self.seen.foreign {
            if record.held {
                return Records::Conflict(record.set.clone());
            }
            match self
                .params
                .node_set
                .explains(&record.set, record.age, &self.ages)
            {
                RecordVerdict::OtherSet => return Records::Conflict(record.set.clone()),
                RecordVerdict::Unknown => unsure = true,
                RecordVerdict::Restarted { after } => {
                    if stale.as_ref().is_none_or(|s| s.after < after) {
                        stale = Some(StaleRecord {
                            set: record.set.clone(),
                            after,
                        });
                    }
                }
            }
        }
        let all_answered = self
            .tally
            .votes
            .iter()
            .all(|v| matches!(v, Some(v) if !matches!(v, Vote::Failed(_))));
        if unsure || !all_answered {
            Records::Unsure
        } else {
            Records::Stale(stale)
        }
    }

    /// Another set's record this round judged stale, which the next round may replace.
    pub fn stale_record(&self) -> Option<StaleRecord> {
        match self.records() {
            Records::Stale(stale) => stale,
            _ => None,
        }
    }

    /// Every vote so far, by node index.
    pub fn votes(&self) -> &[Option<Vote>] {
        &self.tally.votes
    }

    /// Judges node `index`'s answer. `decided` marks answers that came after the round was
    /// decided: a grant then is too late.
    fn judge_answer(
        &mut self,
        index: usize,
        answer: Result<NodeAnswer<AcquireReply>, NodeError>,
        decided: bool,
    ) -> Judged {
        let NodeAnswer { reply, conn } = match answer {
            Ok(answer) => answer,
            Err(err) => return Judged::vote(Vote::Failed(err)),
        };
        if reply.fence > MAX_TOKEN {
            return Judged::vote(Vote::Failed(NodeError {
                kind: NodeErrorKind::Protocol,
                message: format!(
                    "fencing counter {} is beyond 2^53, where the scripts no longer compare exactly",
                    reply.fence
                ),
            }));
        }
        let proof = reply.proof;
        // Every answer carries the node's max-ttl register, busy ones too.
        self.register = self.register.max(proof.max_ttl);
        let own = self.params.node_set.fingerprint.clone();
        if let Some(holder) = self.seen.add(&reply, &own) {
            return Judged::vote(Vote::HeldBy(holder));
        }
        if reply.status == AcquireStatus::Granted {
            if let DataAge::Proven(age) = reply.proof.data_age {
                self.ages[index] = Some(age);
            }
        }
        if reply.status == AcquireStatus::OtherNodeSet {
            return Judged::vote(Vote::NotCounted(
                "another contender of this lock lists other Redis nodes".to_owned(),
            ));
        }
        if decided {
            // Still judged, so the node's reported health stays current.
            let _ = self.judge_grant(index, &conn, proof, false);
            return Judged::vote(Vote::NotCounted(
                "granted after the round was decided".to_owned(),
            ));
        }
        let settled = !self.params.rules.wait_for_all
            || matches!(proof.data_age, DataAge::Proven(age) if age >= votes::settled_data_age());
        match self.judge_grant(index, &conn, proof, true) {
            Ok(()) => Judged {
                vote: Vote::Granted,
                stored: reply.candidate_stored,
                pending: (!settled).then_some((conn, proof)),
                ready_in: None,
                unrecorded: reply.node_set != own,
            },
            Err(NotCounted { why, ready_in }) => Judged {
                ready_in,
                ..Judged::vote(Vote::NotCounted(why))
            },
        }
    }

    /// Whether node `index`'s grant counts (see `votes`); the verdict is kept for the caller's
    /// node-health metric.
    /// `admits`: whether the node set's rule is checked too (on arrival; a young node's grant
    /// judged again later was admitted then).
    fn judge_grant(
        &mut self,
        index: usize,
        conn: &Connection,
        proof: Proof,
        admits: bool,
    ) -> Result<(), NotCounted> {
        let rules = self.params.rules;
        let admitted = if rules.same_server && admits {
            self.params.node_set.admits(index, conn.server.as_deref())
        } else {
            Ok(())
        };
        let verdict = judge_vote(
            conn,
            proof,
            self.longest_ttl(),
            self.params.allow_evicting,
            rules,
        );
        self.verdicts.push((index, verdict.is_ok()));
        admitted.and(verdict)
    }

    /// Why the round was lost, from every answer it got.
    fn lost(&self) -> RoundLost {
        let votes = self.tally.votes.clone();
        let n = votes.len();
        let needed = quorum(n);
        if let Records::Conflict(theirs) = self.records() {
            return RoundLost {
                why: Lost::NodeSetConflict { theirs },
                votes,
            };
        }
        let holder = most_common_holder(&votes);
        let answered = votes
            .iter()
            .filter(|v| matches!(v, Some(v) if !matches!(v, Vote::Failed(_))))
            .count();
        // Nodes whose grants will count soon: enough of them to make a quorum is a wait.
        let mut soon: Vec<Duration> = self.ready_in.iter().flatten().copied().collect();
        soon.sort();
        let missing = needed.saturating_sub(self.granted);
        let wait = (missing > 0 && soon.len() >= missing).then(|| soon[missing - 1]);
        // Not even the nodes that did not answer could give any one holder a quorum:
        // a split among contenders, who all clean up. Not busy: nobody holds the lock.
        let split = self.seen.most_held() + (n - answered) < needed;
        let why = if let Some(ready_in) = wait {
            Lost::NotYetTrusted { ready_in }
        } else if holder.is_some() && answered >= needed && split {
            Lost::Contended
        } else if holder.is_some() && answered >= needed {
            Lost::Busy {
                holder,
                holder_ttl: self.seen.holder_ttl,
                holder_fence: self.seen.fence,
            }
        } else if self.records() != Records::Clear {
            // Nodes refused under a record judged stale, or one that cannot be judged yet:
            // the next round (with leave to replace it) may win.
            Lost::Contended
        } else {
            Lost::QuorumUnreachable { needed }
        };
        RoundLost { why, votes }
    }
}

/// Whether a node whose call failed with `err` may still answer a second read: it was slow
/// (a timeout, a connection still being set up) or its connection broke and is remade. A
/// node that answered an error (auth, protocol, another) has said all it will.
fn may_answer(err: &NodeError) -> bool {
    matches!(err.kind, NodeErrorKind::Timeout | NodeErrorKind::Connection)
}

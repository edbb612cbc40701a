//! A model of `run --shards`: members that split a few shards by the core's planner
//! (`redlock_core::shards::decide`) and hold each by the core's lease machine
//! (`redlock_core::tenure::Tenure`), checked by stateright for "never two owners": at no tick
//! may two members' apps act on one shard.
//!
//! ## What is modelled
//! - **Nodes** hold per shard a key (owner, nonce, expiry tick), set if absent, extended and
//!   deleted only by its owner (the scripts' owner check). A node's clock runs a tick fast: a
//!   key expires a tick early.
//! - **A member's cycle** reads every node (each read at its own tick, so views are stale and
//!   members read mid-move), merges the answers as `src/shards/view.rs` does (an owner needs a
//!   quorum, a free shard a quorum of no key, else unsettled) and as `plan::owners` does (a
//!   shard the view gives to this member that it does not hold is nobody's), asks `decide`,
//!   ends its app's work on what it releases before the deletes go out, and sends an acquire
//!   round for what it takes.
//! - **A shard's round** wins on a quorum of counted grants; its lease is valid until the
//!   round's start plus `timing::validity`'s ttl − drift, and `Tenure` (the engine's policy:
//!   renew every third of the ttl, retry a tick later, step down a tick before the end) says
//!   when to renew and when to step down. A lost round deletes what it set.
//! - **The app** acts on a shard from the won round until the lease machine's step-down
//!   instant, a tick late (its clock runs slow), whether or not the member is paused: the app
//!   reads the step-down instant, not the member's loop.
//! - **Faults**: a request lost; a member paused (its requests do not go out, it reacts to
//!   nothing) and resumed; a node flushed (its keys gone); a member leaving (SIGTERM: its app
//!   stops, its deletes go out).
//!
//! ## What is abstracted
//! - The round is a quorum of `SET NX` grants: the engine's full round (fencing counter,
//!   max-ttl register, node-set record, epoch marker) is the protocol model's
//!   (`protocol.rs`), checked there for one lock. A flushed node's grants do not count for a
//!   ttl after the flush: the epoch-marker rule that model checks.
//! - Membership is known to every member at once (the group's hash decides the split, not
//!   safety, which rests on each shard's lock).

use std::time::Duration;

use redlock_core::clock::Deadline;
use redlock_core::shards::decide;
use redlock_core::tenure::{Event, Failure, Policy, RenewFrom, Step, Tenure};
use redlock_core::timing::{quorum, validity};
use stateright::{Model, Property};

pub const NODES: usize = 3;
pub const SHARDS: usize = 2;
pub const MEMBERS: usize = 2;
/// Requests a member may have in flight to one node (a read, and per shard a round and its
/// clean-up or a renewal and a release).
pub const QUEUE: usize = 6;

/// The rules that keep two members off one shard, each of which can be switched off.
#[derive(Clone, Copy, Debug)]
pub struct Rules {
    /// The app stops at the lease machine's step-down instant (off: at the validity's end
    /// plus the ttl's drift, as if no margin were kept).
    pub step_down: bool,
    /// A round needs a quorum of grants (off: one grant wins).
    pub quorum: bool,
    /// A flushed node's grants count only a ttl after the flush.
    pub young_nodes_wait: bool,
}

impl Rules {
    pub const ALL: Rules = Rules {
        step_down: true,
        quorum: true,
        young_nodes_wait: true,
    };
}

#[derive(Clone, Debug)]
pub struct Config {
    /// The shards' ttl, in ticks (one tick is a millisecond of the core's arithmetic).
    pub ttl: u8,
    pub rules: Rules,
    /// Cycles each member may run.
    pub cycles: u8,
    pub losses: u8,
    pub pauses: u8,
    pub flushes: u8,
    pub leaves: u8,
    pub horizon: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    pub member: u8,
    pub nonce: u8,
    /// The tick at which it is gone.
    pub expires: u8,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Node {
    pub keys: [Option<Key>; SHARDS],
    /// Its grants count from this tick on (a flush makes it young).
    pub counts_from: u8,
}

/// A request on its way to a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// The cycle's read of every shard's key.
    Read,
    Acquire {
        shard: u8,
        nonce: u8,
    },
    Extend {
        shard: u8,
        nonce: u8,
    },
    Delete {
        shard: u8,
        nonce: u8,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Msg {
    pub op: Op,
    /// The last tick it may be executed at.
    pub deadline: u8,
    /// Deferred: not taken before this tick.
    pub not_before: u8,
}

/// What a node answered a round: nothing yet, no answer (timed out), or how it went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ans {
    Pending,
    None,
    /// A grant, counted or not (a young node's).
    Granted(bool),
    /// Another key stands.
    Other,
    Extended,
    Missing,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Shard {
    Free,
    Acquiring {
        start: u8,
        nonce: u8,
        answers: [Ans; NODES],
    },
    Held {
        nonce: u8,
        /// Takes by this member when it was won (the planner gives up the latest first).
        taken: u8,
        tenure: Tenure,
        /// A renewal: its start and answers.
        renewal: Option<(u8, [Ans; NODES])>,
    },
}

/// One node's read in a cycle: `None` while pending, `Some(None)` when it timed out, else
/// each shard's holder as the node showed it (`None`: no key).
pub type Read = Option<Option<[Option<u8>; SHARDS]>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Member {
    pub shards: [Shard; SHARDS],
    /// Requests per node, executed in order.
    pub pending: [[Option<Msg>; QUEUE]; NODES],
    /// The cycle's reads; `None` when no cycle runs.
    pub reading: Option<[Read; NODES]>,
    pub cycles_left: u8,
    pub paused: bool,
    pub left: bool,
    pub nonce: u8,
    pub takes: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub now: u8,
    /// No request has been taken yet in this tick: members and faults may still act.
    pub opening: bool,
    pub nodes: [Node; NODES],
    pub members: [Member; MEMBERS],
    pub losses_left: u8,
    pub pauses_left: u8,
    pub flushes_left: u8,
    pub leaves_left: u8,
    /// The last member whose app acted on each shard.
    pub last_owner: [Option<u8>; SHARDS],
    /// A shard's app work passed from one member to another.
    pub handed_over: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Cycle(usize),
    /// Node executes the member's oldest request there, and the member hears the answer.
    Deliver(usize, usize),
    /// The request waits for the next tick.
    Defer(usize, usize),
    /// The request is lost (loss budget).
    Drop(usize, usize),
    Pause(usize),
    Resume(usize),
    Flush(usize),
    Leave(usize),
    Tick,
}

fn ms(ticks: u8) -> Duration {
    Duration::from_millis(u64::from(ticks))
}

fn at(tick: u8) -> Deadline {
    Deadline::from_boottime(ms(tick))
}

/// An instant in ticks, rounded up.
fn ticks(at: Deadline) -> u8 {
    u8::try_from(at.boottime().as_nanos().div_ceil(1_000_000)).unwrap_or(u8::MAX)
}

impl Config {
    /// The engine's renewal policy at the model's scale.
    fn policy(&self) -> Policy {
        Policy {
            renew_every: ms((self.ttl / 3).max(1)),
            renew_from: RenewFrom::End,
            retry_after: ms(1),
            step_down_before: ms(1),
            pause_after: None,
        }
    }

    /// The end of validity a round that started at `start` proves.
    fn valid_until(&self, start: u8, now: u8) -> Option<Deadline> {
        let left = validity(ms(self.ttl), ms(now - start))?;
        Some(at(now) + left)
    }

    /// The first tick at which the app no longer acts on a shard held under `tenure`.
    fn acts_until(&self, tenure: &Tenure) -> u8 {
        let end = if self.rules.step_down {
            tenure.step_down_at()
        } else {
            tenure.valid_until() + redlock_core::timing::drift(ms(self.ttl))
        };
        // The app's clock runs slow: a tick late in real time.
        ticks(end).saturating_add(1)
    }

    /// Which members' apps act on `shard` now.
    pub fn acting(&self, s: &State, shard: usize) -> Vec<u8> {
        (0..MEMBERS)
            .filter(|&m| match s.members[m].shards[shard] {
                Shard::Held { tenure, .. } => s.now < self.acts_until(&tenure),
                _ => false,
            })
            .map(|m| m as u8)
            .collect()
    }

    fn send(&self, s: &mut State, m: usize, node: usize, op: Op) {
        let deadline = s.now + 1;
        let queue = &mut s.members[m].pending[node];
        let free = queue
            .iter_mut()
            .find(|q| q.is_none())
            .expect("a member has at most QUEUE requests in flight to a node");
        *free = Some(Msg {
            op,
            deadline,
            not_before: 0,
        });
    }

    fn send_all(&self, s: &mut State, m: usize, op: Op) {
        for node in 0..NODES {
            self.send(s, m, node, op);
        }
    }

    /// Ends the app's work on `shard` and sends the deletes.
    fn release(&self, s: &mut State, m: usize, shard: usize) {
        if let Shard::Held { nonce, .. } = s.members[m].shards[shard] {
            s.members[m].shards[shard] = Shard::Free;
            let op = Op::Delete {
                shard: shard as u8,
                nonce,
            };
            self.send_all(s, m, op);
        }
    }

    /// The cycle's decision once every read answered or timed out.
    fn decide(&self, s: &mut State, m: usize) {
        let Some(reads) = s.members[m].reading else {
            return;
        };
        if reads.iter().any(Option::is_none) {
            return;
        }
        s.members[m].reading = None;
        let answered: Vec<[Option<u8>; SHARDS]> =
            reads.iter().filter_map(|r| r.flatten()).collect();
        if answered.len() < quorum(NODES) {
            return;
        }
        let me = name(m as u8);
        let owners: Vec<Option<String>> = (0..SHARDS)
            .map(|shard| {
                if matches!(s.members[m].shards[shard], Shard::Held { .. }) {
                    return Some(me.clone());
                }
                let seen = |who: Option<u8>| answered.iter().filter(|a| a[shard] == who).count();
                let holder = (0..MEMBERS as u8).find(|&o| seen(Some(o)) >= quorum(NODES));
                match holder {
                    // An old key of its own that it does not hold: nobody's.
                    Some(o) if o as usize == m => Some("~unsettled".to_owned()),
                    Some(o) => Some(name(o)),
                    None if seen(None) >= quorum(NODES) => None,
                    None => Some("~unsettled".to_owned()),
                }
            })
            .collect();
        let members: Vec<String> = (0..MEMBERS as u8)
            .filter(|&o| !s.members[o as usize].left)
            .map(name)
            .collect();
        let taken: Vec<u8> = s.members[m]
            .shards
            .iter()
            .map(|sh| match sh {
                Shard::Held { taken, .. } => *taken,
                _ => 0,
            })
            .collect();
        let moves = decide(&me, &members, &owners, |shard| {
            u64::from(taken[shard as usize])
        });
        for shard in moves.release {
            self.release(s, m, shard as usize);
        }
        for shard in moves.take {
            let member = &mut s.members[m];
            if member.shards[shard as usize] != Shard::Free {
                continue;
            }
            member.nonce += 1;
            let nonce = member.nonce;
            member.shards[shard as usize] = Shard::Acquiring {
                start: s.now,
                nonce,
                answers: [Ans::Pending; NODES],
            };
            let op = Op::Acquire {
                shard: shard as u8,
                nonce,
            };
            self.send_all(s, m, op);
        }
    }

    /// A round's answers changed: win, lose or wait.
    fn settle_round(&self, s: &mut State, m: usize, shard: usize) {
        let Shard::Acquiring {
            start,
            nonce,
            answers,
        } = s.members[m].shards[shard]
        else {
            return;
        };
        let counted = answers.iter().filter(|a| **a == Ans::Granted(true)).count();
        let needed = if self.rules.quorum { quorum(NODES) } else { 1 };
        if counted >= needed {
            if let Some(valid_until) = self.valid_until(start, s.now) {
                let member = &mut s.members[m];
                member.takes += 1;
                member.shards[shard] = Shard::Held {
                    nonce,
                    taken: member.takes,
                    tenure: Tenure::new(self.policy(), at(start), valid_until),
                    renewal: None,
                };
                return;
            }
        }
        if answers.iter().all(|a| *a != Ans::Pending) {
            // Lost (or won too late): delete what it set.
            s.members[m].shards[shard] = Shard::Free;
            let op = Op::Delete {
                shard: shard as u8,
                nonce,
            };
            self.send_all(s, m, op);
        }
    }

    /// A renewal's answers changed: proven, failed or wait.
    fn settle_renewal(&self, s: &mut State, m: usize, shard: usize) {
        let Shard::Held {
            nonce,
            taken,
            mut tenure,
            renewal: Some((start, answers)),
        } = s.members[m].shards[shard]
        else {
            return;
        };
        let count = |a: Ans| answers.iter().filter(|x| **x == a).count();
        let event = if count(Ans::Extended) >= quorum(NODES) {
            let Some(valid_until) = self.valid_until(start, s.now) else {
                return;
            };
            Event::Renewed {
                started: at(start),
                ended: at(s.now),
                valid_until,
            }
        } else if answers.iter().all(|a| *a != Ans::Pending) {
            let failure = if count(Ans::Missing) >= quorum(NODES) {
                Failure::Expired
            } else if count(Ans::Other) >= quorum(NODES) {
                Failure::Superseded
            } else {
                Failure::Retry
            };
            Event::RenewFailed {
                at: at(s.now),
                failure,
            }
        } else {
            return;
        };
        tenure.handle(event);
        s.members[m].shards[shard] = Shard::Held {
            nonce,
            taken,
            tenure,
            renewal: None,
        };
    }

    /// At a tick's start, each member that is awake does what its lease machines say.
    fn react(&self, s: &mut State) {
        for m in 0..MEMBERS {
            if s.members[m].paused || s.members[m].left {
                continue;
            }
            for shard in 0..SHARDS {
                let Shard::Held {
                    nonce,
                    taken,
                    tenure,
                    renewal,
                } = s.members[m].shards[shard]
                else {
                    continue;
                };
                match tenure.poll(at(s.now)) {
                    Step::StepDown(_) => s.members[m].shards[shard] = Shard::Free,
                    Step::Renew if renewal.is_none() => {
                        s.members[m].shards[shard] = Shard::Held {
                            nonce,
                            taken,
                            tenure,
                            renewal: Some((s.now, [Ans::Pending; NODES])),
                        };
                        let op = Op::Extend {
                            shard: shard as u8,
                            nonce,
                        };
                        self.send_all(s, m, op);
                    }
                    _ => {}
                }
            }
        }
    }

    /// Node `node` executes `op` of member `m`, and the member hears the answer.
    fn execute(&self, s: &mut State, m: usize, node: usize, op: Op) {
        let now = s.now;
        let counts = !self.rules.young_nodes_wait || now >= s.nodes[node].counts_from;
        let expires = (now + self.ttl).saturating_sub(1);
        let keys = &mut s.nodes[node].keys;
        let answer = match op {
            Op::Read => {
                let seen: [Option<u8>; SHARDS] = std::array::from_fn(|i| keys[i].map(|k| k.member));
                if let Some(reads) = s.members[m].reading.as_mut() {
                    reads[node] = Some(Some(seen));
                }
                self.decide(s, m);
                return;
            }
            Op::Acquire { shard, nonce } => {
                let key = &mut keys[shard as usize];
                if key.is_none() {
                    *key = Some(Key {
                        member: m as u8,
                        nonce,
                        expires,
                    });
                    (shard, Ans::Granted(counts))
                } else {
                    (shard, Ans::Other)
                }
            }
            Op::Extend { shard, nonce } => {
                let key = &mut keys[shard as usize];
                match key {
                    Some(k) if k.member == m as u8 && k.nonce == nonce => {
                        k.expires = k.expires.max(expires);
                        (shard, Ans::Extended)
                    }
                    Some(_) => (shard, Ans::Other),
                    None => (shard, Ans::Missing),
                }
            }
            Op::Delete { shard, nonce } => {
                let key = &mut keys[shard as usize];
                if key.is_some_and(|k| k.member == m as u8 && k.nonce == nonce) {
                    *key = None;
                }
                return;
            }
        };
        let (shard, answer) = answer;
        self.answer(s, m, node, shard as usize, op, answer);
    }

    /// Member `m` records `answer` from `node` for `op` on `shard`.
    fn answer(&self, s: &mut State, m: usize, node: usize, shard: usize, op: Op, answer: Ans) {
        match (op, &mut s.members[m].shards[shard]) {
            (
                Op::Acquire { nonce, .. },
                Shard::Acquiring {
                    nonce: n, answers, ..
                },
            ) if nonce == *n => {
                answers[node] = answer;
                self.settle_round(s, m, shard);
            }
            (
                Op::Extend { nonce, .. },
                Shard::Held {
                    nonce: n,
                    renewal: Some((_, answers)),
                    ..
                },
            ) if nonce == *n => {
                answers[node] = answer;
                self.settle_renewal(s, m, shard);
            }
            _ => {}
        }
    }

    /// A request that was not executed: the member hears nothing (a timeout).
    fn time_out(&self, s: &mut State, m: usize, node: usize, op: Op) {
        match op {
            Op::Read => {
                if let Some(reads) = s.members[m].reading.as_mut() {
                    reads[node] = Some(None);
                }
                self.decide(s, m);
            }
            Op::Acquire { shard, .. } | Op::Extend { shard, .. } => {
                self.answer(s, m, node, shard as usize, op, Ans::None);
            }
            Op::Delete { .. } => {}
        }
    }

    /// The first request to take now: an awake member's, not deferred past now.
    fn next_request(s: &State) -> Option<(usize, usize)> {
        (0..MEMBERS)
            .filter(|&m| !s.members[m].paused)
            .flat_map(|m| (0..NODES).map(move |node| (m, node)))
            .find(|&(m, node)| {
                s.members[m].pending[node][0].is_some_and(|msg| msg.not_before <= s.now)
            })
    }

    /// Pops member `m`'s oldest request to `node`.
    fn pop(s: &mut State, m: usize, node: usize) -> Option<Msg> {
        let queue = &mut s.members[m].pending[node];
        let first = queue[0].take()?;
        queue.rotate_left(1);
        Some(first)
    }

    /// Keeps the app-work record: who acts on each shard, and whether it changed hands.
    fn note_owners(&self, s: &mut State) {
        for shard in 0..SHARDS {
            if let [only] = self.acting(s, shard)[..] {
                if s.last_owner[shard].is_some_and(|o| o != only) {
                    s.handed_over = true;
                }
                s.last_owner[shard] = Some(only);
            }
        }
    }
}

fn name(member: u8) -> String {
    format!("m{member}")
}

impl Model for Config {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let member = Member {
            shards: [Shard::Free; SHARDS],
            pending: [[None; QUEUE]; NODES],
            reading: None,
            cycles_left: self.cycles,
            paused: false,
            left: false,
            nonce: 0,
            takes: 0,
        };
        vec![State {
            now: 0,
            opening: true,
            nodes: [Node::default(); NODES],
            members: [member; MEMBERS],
            losses_left: self.losses,
            pauses_left: self.pauses,
            flushes_left: self.flushes,
            leaves_left: self.leaves,
            last_owner: [None; SHARDS],
            handed_over: false,
        }]
    }

    /// Requests are taken in a fixed order (member by member, node by node), each executed,
    /// deferred to the next tick if its deadline allows, or lost: deferring makes every order
    /// of two requests reachable a tick apart, without every interleaving of one tick.
    /// Members and faults act at a tick's opening, before any request is taken.
    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        if s.opening {
            for m in 0..MEMBERS {
                let member = &s.members[m];
                if member.left {
                    continue;
                }
                if member.paused {
                    actions.push(Action::Resume(m));
                    continue;
                }
                if member.reading.is_none() && member.cycles_left > 0 {
                    actions.push(Action::Cycle(m));
                }
                if s.pauses_left > 0 {
                    actions.push(Action::Pause(m));
                }
                if s.leaves_left > 0 {
                    actions.push(Action::Leave(m));
                }
            }
            if s.flushes_left > 0 {
                for node in 0..NODES {
                    actions.push(Action::Flush(node));
                }
            }
        }
        if let Some((m, node)) = Config::next_request(s) {
            actions.push(Action::Deliver(m, node));
            // Only a read's or a grant's moment changes what anyone decides: an extend or a
            // delete taken later only keeps a key longer, which lets nobody in.
            let deferrable = s.members[m].pending[node][0].is_some_and(|msg| {
                msg.deadline > s.now && matches!(msg.op, Op::Read | Op::Acquire { .. })
            });
            if deferrable {
                actions.push(Action::Defer(m, node));
            }
            if s.losses_left > 0 {
                actions.push(Action::Drop(m, node));
            }
        } else if s.now < self.horizon {
            actions.push(Action::Tick);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Cycle(m) => {
                s.members[m].cycles_left -= 1;
                s.members[m].reading = Some([None; NODES]);
                self.send_all(&mut s, m, Op::Read);
            }
            Action::Deliver(m, node) => {
                s.opening = false;
                let msg = Config::pop(&mut s, m, node)?;
                self.execute(&mut s, m, node, msg.op);
            }
            Action::Defer(m, node) => {
                s.opening = false;
                let msg = s.members[m].pending[node][0].as_mut()?;
                msg.not_before = s.now + 1;
            }
            Action::Drop(m, node) => {
                s.opening = false;
                s.losses_left -= 1;
                let msg = Config::pop(&mut s, m, node)?;
                // Lost on the way, or its answer lost: the node may have executed it.
                self.time_out(&mut s, m, node, msg.op);
            }
            Action::Pause(m) => {
                s.pauses_left -= 1;
                s.members[m].paused = true;
            }
            Action::Resume(m) => s.members[m].paused = false,
            Action::Flush(node) => {
                s.flushes_left -= 1;
                s.nodes[node].keys = [None; SHARDS];
                s.nodes[node].counts_from = s.now + self.ttl;
            }
            Action::Leave(m) => {
                s.leaves_left -= 1;
                for shard in 0..SHARDS {
                    self.release(&mut s, m, shard);
                }
                s.members[m].left = true;
                s.members[m].reading = None;
            }
            Action::Tick => {
                s.now += 1;
                s.opening = true;
                for node in &mut s.nodes {
                    for key in &mut node.keys {
                        if key.is_some_and(|k| k.expires <= s.now) {
                            *key = None;
                        }
                    }
                }
                // A paused member's requests past their deadline never went out.
                for m in 0..MEMBERS {
                    for node in 0..NODES {
                        while s.members[m].pending[node][0].is_some_and(|msg| msg.deadline < s.now)
                        {
                            if let Some(msg) = Config::pop(&mut s, m, node) {
                                self.time_out(&mut s, m, node, msg.op);
                            }
                        }
                    }
                }
                self.react(&mut s);
            }
        }
        self.note_owners(&mut s);
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("never two owners", |cfg: &Config, s: &State| {
                (0..SHARDS).all(|shard| cfg.acting(s, shard).len() <= 1)
            }),
            Property::sometimes("a hand-over", |_: &Config, s: &State| s.handed_over),
        ]
    }
}

//! The lock protocol as a state machine for stateright: Redis nodes with the lock key, fence
//! counter, max-ttl register, node-set record and epoch marker; clients that acquire, mint
//! tokens, renew, step down, keep a lost lease's promise and release; and the faults.
//!
//! The clients' round decisions are not written here: each client keeps the answers its nodes
//! gave and asks the engine's own state machines (`redlock::round`, through `engine`) what to
//! do next.
//!
//! ## Time
//! Real time is a tick counter (one tick is one millisecond of the engine's arithmetic, see
//! `engine`). Every clock misjudges an interval by at most one tick, in the direction that
//! hurts: nodes run fast (keys, registers and records expire a tick early, epoch markers look
//! a tick older), clients run slow (the app's validity ends a tick late in real time). At the
//! model's ttls (a few ms) the engine's drift is its 2 ms floor plus a few hundredths, so the
//! two clock errors use up exactly the margin the engine keeps.
//!
//! ## Rounds and ticks
//! A tick opens with what clients and faults do (start a round, pause, resume, resign, a fault
//! on a node). Then the requests in flight are taken in a fixed order (node by node, client by
//! client): each is executed atomically with its answer delivered, or deferred to the next
//! tick if its timeout allows, or (spending the loss budget) executed with its answer lost,
//! or never executed, or (spending the late budget) executed with its answer coming after the
//! node timeout. Deferring makes every order of two requests reachable, one of them a tick
//! later. Requests from one client to one node are executed in the order sent. A client
//! reacts to an answer at once (decides, sends what follows) unless it is paused.
//!
//! ## Lost and late answers
//! Both are a timeout to the round. A lost request stands for a node cut off from the client
//! for the rest of the round: when the round reads the registers of the nodes that did not
//! answer in time (`round::acquire`, rule 5), it reads nothing from that node, and waits out
//! the recheck window. A late answer comes from a node that is only slow (paused, busy): it
//! executed the request, and it answers the round's register read like any request.

use stateright::{Model, Property};

use redlock_core::round;

mod clients;
mod nodes;
mod trace;

use crate::engine::{
    self, AcquireAns, AcquireNext, AcquireView, Age, ExtendAns, ExtendNext, Held, HoldNext,
    RaiseNext, RegisterRead,
};

/// How many ttls the max-ttl register and the node-set record live: the engine's own.
const LIFE: u8 = redlock_core::timing::RECORD_LIFE as u8;

/// Node slots a model may use.
pub const MAX_NODES: usize = 4;
/// Clients a model may use.
pub const MAX_CLIENTS: usize = 3;

/// How the acquire and extend scripts decide whether the epoch marker is their node's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineageRule {
    /// The server's run id and replication id, read inside the script (the rule).
    InScript,
    /// Only the run id, read inside the script: misses a resync and failback.
    RunIdOnly,
    /// Run id and replication id, read once per connection: misses a failback and a
    /// failover behind a proxy that keeps the client's connection.
    CachedPerConnection,
    /// No lineage at all: a marker restored with an older copy proves the copy's age.
    Unchecked,
}

/// The rules of the protocol, each of which can be switched off to see what it prevents.
///
/// The rounds' rules are the engine's own ([`round::Rules`], obeyed by the engine's state
/// machines the clients call); the model keeps only the switches of what happens on the
/// nodes (the scripts) and in the lease.
#[derive(Clone, Copy, Debug)]
pub struct Rules {
    /// How the marker's lineage is checked (in the scripts).
    pub lineage: LineageRule,
    /// The scripts write node-set records and grant nothing under a foreign one.
    pub fingerprint: bool,
    /// After a loss, what is still held is released only once the validity has run out
    /// (the lease).
    pub keep_promise: bool,
    /// The rounds' rules: data age, register, wait for all answers, recheck of silent nodes,
    /// drift margin, node-set conflict, same server, longest promise.
    pub engine: round::Rules,
}

impl Rules {
    /// The rules as implemented.
    pub const ALL: Rules = Rules {
        lineage: LineageRule::InScript,
        fingerprint: true,
        keep_promise: true,
        engine: round::Rules::ALL,
    };
}

/// What can happen to a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// Restart without persistence: empty dataset, new run id and replication id.
    Restart,
    /// Restart with persistence (RDB/AOF of the current data): new run id and replication id.
    RestartPersisted,
    /// An older copy of the data takes over at the node's address with new run id and
    /// replication id, and connections drop: a restart from an older snapshot, or a failover
    /// to a lagging replica (its copy holds the marker the old master stamped).
    OlderCopy,
    /// The same failover behind a proxy that re-dials and keeps the client's connection.
    ProxyFailover,
    /// Resync and failback: the same server process full-syncs an older copy that holds its
    /// own old marker, then is promoted (new replication id, same run id, connections kept).
    Failback,
    /// `FLUSHALL`: the dataset is emptied, the server identity stays.
    Flush,
    /// The older copy (snapshot file, lagging replica) catches up with the data as it is now.
    Snapshot,
    /// Another name of the lock's namespace takes a token here: the fencing counter the
    /// namespace shares per hash slot rises to that name's candidate, minted by the client
    /// whose clock runs furthest ahead (see `fencing`, namespaces).
    OtherName,
}

/// One client (contender) of the lock.
#[derive(Clone, Debug)]
pub struct ClientCfg {
    /// Its `--ttl`, in ticks.
    pub ttl: u8,
    /// Its `--max-ttl`, if given.
    pub max_ttl: Option<u8>,
    /// The node slots it is configured with.
    pub nodes: Vec<usize>,
    /// Its wall clock (the token floor) reads real time plus this.
    pub wall_offset: u16,
    /// How many acquire rounds it may start.
    pub attempts: u8,
    /// Nodes it has not reached when the run starts (their servers are `?` in its node set);
    /// it is connected to every other node of its list.
    pub unreached: Vec<usize>,
}

/// A model instance: what exists, which rules hold, which faults may happen and how often.
#[derive(Clone, Debug)]
pub struct Config {
    /// Node slots in use.
    pub nodes: usize,
    pub clients: Vec<ClientCfg>,
    pub rules: Rules,
    /// Fault kinds that may strike any node.
    pub faults: Vec<Fault>,
    /// How many faults may strike in one run.
    pub fault_budget: u8,
    /// How many requests may be lost (never executed, or executed with the answer lost).
    pub losses: u8,
    /// How many answers may come after the node timeout (executed, but the client timed out;
    /// the node answers what is asked of it next).
    pub late: u8,
    /// How many times a client may stall (for any time).
    pub pauses: u8,
    /// How many graceful releases (SIGTERM: the app stops, then the client releases).
    pub resigns: u8,
    /// Real time ends here.
    pub horizon: u8,
    /// A request is executed at most this many ticks after it was sent, or not at all.
    pub node_timeout: u8,
    /// Ticks a node's clock may gain over any interval.
    pub node_clock_fast: u8,
    /// Ticks a client's clock may lose over any interval.
    pub client_clock_slow: u8,
    /// The lease stops claiming (and renewing) this many ticks before its validity ends.
    pub safety_margin: u8,
    /// The node-set record of this client's set is live on its nodes when the run starts
    /// (it held the lock just before), for `RECORD_LIFE` times its ttl.
    pub records_at_start: Option<usize>,
}

// ---------------------------------------------------------------------------------------
// State
// ---------------------------------------------------------------------------------------

/// A server identity: the lineage the marker records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Id {
    pub run: u8,
    pub repl: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    pub client: u8,
    pub nonce: u8,
    /// Real tick at which it is gone.
    pub expires: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Marker {
    pub lineage: Id,
    /// Real tick of the stamp; `None`: long before the model's time began.
    pub stamped: Option<u8>,
}

/// One node's dataset (what a flush empties and an older copy replaces).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Data {
    pub key: Option<Key>,
    /// The fencing counter (0: absent).
    pub fence: u16,
    /// The max-ttl register: (longest ttl written, real tick at which it is gone).
    pub register: Option<(u8, u8)>,
    /// The node-set record: (fingerprint, real tick at which it is gone, real tick at which
    /// it was written).
    pub record: Option<(u64, u8, u8)>,
    /// The refresh marker: (the fingerprint it holds, real tick at which it is gone).
    pub refreshed: Option<(u64, u8)>,
    pub marker: Option<Marker>,
}

impl Data {
    fn expire(&mut self, now: u8) {
        if self.key.is_some_and(|k| k.expires <= now) {
            self.key = None;
        }
        if self.register.is_some_and(|(_, at)| at <= now) {
            self.register = None;
        }
        if self.record.is_some_and(|(_, at, _)| at <= now) {
            self.record = None;
        }
        if self.refreshed.is_some_and(|(_, at)| at <= now) {
            self.refreshed = None;
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Node {
    pub data: Data,
    /// The older copy: the last snapshot, or what a lagging replica holds.
    pub backup: Data,
    pub id: Id,
    /// Identities handed out so far (fresh ones come from here).
    ids: u8,
}

/// A request on its way to a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// `set`: the fingerprint the round records (the scripts' `ARGV`), as in every op below;
    /// `stale`: another set's record an earlier round judged stale, which may be replaced where
    /// it is at least this old (ticks of the node's clock).
    Acquire {
        nonce: u8,
        cand: u16,
        set: u64,
        stale: Option<(u64, u8)>,
    },
    /// `won`: the round was won, so a late "missing" calls for a restore.
    Extend {
        nonce: u8,
        token: u16,
        won: bool,
        set: u64,
    },
    Restore {
        nonce: u8,
        token: u16,
        set: u64,
    },
    Raise {
        token: u16,
    },
    Release {
        nonce: u8,
    },
    Cleanup {
        nonce: u8,
        set: u64,
    },
    /// The max-ttl register read again while acquire round `nonce` rechecks (plain `GET`).
    Register {
        nonce: u8,
    },
}

impl Op {
    /// Whether taking it a tick later can matter. A later extend, restore, release or clean-up
    /// only makes a key live longer, which never lets anyone in; a later acquire, raise or
    /// register answer changes what a round decides.
    fn deferrable(self) -> bool {
        matches!(
            self,
            Op::Acquire { .. } | Op::Raise { .. } | Op::Register { .. }
        )
    }

    /// Whether the client waits for (and can lose) an answer.
    fn answered(self) -> bool {
        matches!(
            self,
            Op::Acquire { .. } | Op::Extend { .. } | Op::Raise { .. } | Op::Register { .. }
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Msg {
    pub op: Op,
    /// Last tick at which it may be executed.
    pub deadline: u8,
    /// Deferred: not taken before this tick.
    pub not_before: u8,
}

/// One node's answer in a round, as the client recorded it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ans {
    /// Not asked (not in the client's node set).
    Unused,
    Pending,
    /// Timed out: never executed, or its answer was lost.
    NoAnswer,
    /// Acquire: timed out, but the node executed the request and is only slow: it answers a
    /// register read.
    Late,
    /// Acquire: granted, with the data age proven, whether the candidate token was stored,
    /// the run id the answer's connection showed, and whether a node-set record stood there.
    /// `longest`, in every acquire answer: the longest register the client knew once it had
    /// this answer (the engine judges an answer with what it knows when the answer arrives).
    Granted {
        age: Age,
        stored: bool,
        server: u8,
        recorded: bool,
        /// Another set's record it replaced (on the round's word that it was stale).
        replaced: Option<u64>,
        longest: u8,
    },
    /// Acquire or extend: another value holds the key (`foreign`: beside another set's record,
    /// and its age).
    Held {
        foreign: Option<(u64, u8)>,
        longest: u8,
    },
    /// Acquire: no grant under a live foreign node-set record (its fingerprint and age).
    Conflict {
        set: u64,
        age: u8,
        longest: u8,
    },
    /// Extend: our key, extended.
    Extended,
    /// Extend: no key at all.
    Missing,
    /// Raise: the counter before.
    Before(u16),
    /// Register read: the max-ttl register (0: absent).
    Register(u8),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Waiting to contend.
    Idle,
    /// An acquire round, until the engine's round decides (a lost one hears every answer
    /// first, then cleans up).
    Acquire {
        start: u8,
        nonce: u8,
        cand: u16,
        /// The round's node set: per node, the server it names (`None`: `?`), and its
        /// fingerprint.
        servers: [Option<u8>; MAX_NODES],
        set: u64,
        answers: [Ans; MAX_NODES],
        /// Per node, the register read again while the round rechecked, and the tick it
        /// came at.
        reads: [Option<(u8, u8)>; MAX_NODES],
    },
    /// Minting the token by raise rounds after a won acquire round.
    Raise {
        start: u8,
        nonce: u8,
        token: u16,
        attempt: u8,
        answers: [Ans; MAX_NODES],
        set: u64,
    },
    /// A won round that cannot lead (no validity left, no token): delete our key everywhere
    /// once every request in flight has been executed or timed out.
    Cleanup { nonce: u8, set: u64 },
    /// Leading.
    Hold {
        nonce: u8,
        token: u16,
        /// Start of the acquire round (step-down is never before it).
        acquired: u8,
        /// Real tick at which the validity last obtained runs out.
        end: u8,
        next_renew: u8,
        /// A renewal: when it started, its answers, the fingerprint it records.
        extend: Option<(u8, [Ans; MAX_NODES], u64)>,
    },
    /// Stepped down; waits for `end` before releasing (with `keep_promise`).
    Lost { nonce: u8, end: u8 },
}

/// A client's connection to a node, as the engine's `NodeFacts` and `Node::server` keep it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Conn {
    /// What `INFO` showed when it was made.
    pub id: Id,
    /// Still up: a restart or failover that drops connections clears it, and the next request
    /// connects again (and reads the server then).
    pub live: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Client {
    pub phase: Phase,
    pub pending: [Option<Msg>; MAX_NODES],
    /// The next request per node, sent once the one pending there has been executed.
    pub queued: [Option<Op>; MAX_NODES],
    /// Restores due after a won extend (sent before anything queued, once not paused).
    pub restores: [Option<Op>; MAX_NODES],
    pub paused: bool,
    /// Acquire rounds started (the nonce of the last one).
    pub nonce: u8,
    /// The highest fencing counter any answer ever showed.
    pub seen_fence: u16,
    /// The longest ttl any register ever showed.
    pub seen_ttl: u8,
    /// Per node, the server identity the last connection read when it was made (`None`: never
    /// connected); the node set names the node by its run id, the cached lineage rule by both.
    pub conns: [Option<Conn>; MAX_NODES],
    /// The app may act in `[since, until)` (real ticks): the tenure as the app sees it.
    pub window: Option<(u8, u8)>,
    /// Another set's record the last acquire round judged stale: its fingerprint, the age
    /// it had to exceed then, and the tick of that round's end (the engine's
    /// `Redlock::stale_record`).
    pub stale: Option<(u64, u8, u8)>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub now: u8,
    /// No request has been taken yet in this tick: clients and faults may still act.
    pub opening: bool,
    pub nodes: [Node; MAX_NODES],
    pub clients: [Client; MAX_CLIENTS],
    pub faults_left: u8,
    pub losses_left: u8,
    pub late_left: u8,
    pub pauses_left: u8,
    pub resigns_left: u8,
    /// The highest token any tenure was handed, and by whom.
    pub last_tenure: Option<(u16, u8)>,
    /// A tenure was handed a token not above every earlier tenure's.
    pub token_regressed: bool,
    /// A tenure followed another client's (a handoff happened).
    pub handoff: bool,
    /// A grant replaced another set's record judged stale.
    pub stale_replaced: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// An idle client starts an acquire round.
    Start(usize),
    /// The node executes the client's pending request and the client gets the answer.
    Deliver(usize, usize),
    /// The request waits for the next tick.
    Defer(usize, usize),
    /// The node executes it, the answer is lost (loss budget).
    DeliverUnanswered(usize, usize),
    /// The request is never executed (loss budget).
    Drop(usize, usize),
    /// The node executes it, the answer comes after the node timeout (late budget).
    DeliverLate(usize, usize),
    /// SIGTERM: the app stops now, the client releases at once.
    Resign(usize),
    Pause(usize),
    Resume(usize),
    Fault(Fault, usize),
    Tick,
}

// ---------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------

impl Model for Config {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        assert!(self.nodes <= MAX_NODES && self.clients.len() <= MAX_CLIENTS);
        let id = Id { run: 1, repl: 1 };
        let data = Data {
            marker: Some(Marker {
                lineage: id,
                stamped: None,
            }),
            ..Data::default()
        };
        let mut nodes = [Node {
            data,
            backup: data,
            id,
            ids: 1,
        }; MAX_NODES];
        if let Some(c) = self.records_at_start {
            let ttl = self.clients[c].ttl;
            let set = self.fingerprint(c, &[Some(id.run); MAX_NODES]);
            for n in &self.clients[c].nodes {
                let gone = self.node_expiry(0, LIFE * ttl);
                nodes[*n].data.register = Some((ttl, gone));
                nodes[*n].data.record = Some((set, gone, 0));
            }
        }
        let client = Client {
            phase: Phase::Idle,
            pending: [None; MAX_NODES],
            queued: [None; MAX_NODES],
            restores: [None; MAX_NODES],
            paused: false,
            nonce: 0,
            seen_fence: 0,
            seen_ttl: 0,
            conns: [None; MAX_NODES],
            window: None,
            stale: None,
        };
        let mut clients = [client; MAX_CLIENTS];
        for (c, cfg) in self.clients.iter().enumerate() {
            for n in cfg.nodes.iter().filter(|n| !cfg.unreached.contains(n)) {
                clients[c].conns[*n] = Some(Conn { id, live: true });
            }
        }
        vec![State {
            now: 0,
            opening: true,
            nodes,
            clients,
            faults_left: self.fault_budget,
            losses_left: self.losses,
            late_left: self.late,
            pauses_left: self.pauses,
            resigns_left: self.resigns,
            last_tenure: None,
            token_regressed: false,
            handoff: false,
            stale_replaced: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        if s.opening {
            for c in 0..self.clients.len() {
                let client = &s.clients[c];
                if !client.paused
                    && client.phase == Phase::Idle
                    && Self::idle_wire(client)
                    && client.nonce < self.clients[c].attempts
                {
                    actions.push(Action::Start(c));
                }
                let stoppable = match client.phase {
                    Phase::Hold { extend: None, .. } => Self::idle_wire(client),
                    Phase::Lost { .. } => Self::idle_wire(client),
                    _ => false,
                };
                if s.resigns_left > 0 && !client.paused && stoppable {
                    actions.push(Action::Resign(c));
                }
                if client.paused {
                    actions.push(Action::Resume(c));
                } else if s.pauses_left > 0 && client.phase != Phase::Idle {
                    actions.push(Action::Pause(c));
                }
            }
        }
        if let Some((c, n, msg)) = self.next_request(s) {
            // A fault between two contacts with a node shows only at the second one, so
            // faults strike just before a request is taken (several may strike in a row).
            if s.faults_left > 0 {
                for kind in &self.faults {
                    actions.push(Action::Fault(*kind, n));
                }
            }
            actions.push(Action::Deliver(c, n));
            if msg.deadline > s.now && msg.op.deferrable() {
                actions.push(Action::Defer(c, n));
            }
            if s.losses_left > 0 {
                actions.push(Action::Drop(c, n));
                if msg.op.answered() {
                    actions.push(Action::DeliverUnanswered(c, n));
                }
            }
            if s.late_left > 0 && msg.op.answered() {
                actions.push(Action::DeliverLate(c, n));
            }
        } else if s.now < self.horizon {
            actions.push(Action::Tick);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Start(c) => {
                let client = &mut s.clients[c];
                client.nonce += 1;
                let nonce = client.nonce;
                let cand = self.next_token(&s, c, s.clients[c].seen_fence);
                // The node set as the client's connections have shown it so far (the engine
                // connects unknown nodes first; the model lets that fail).
                let servers = self.servers(&s, c);
                let set = self.fingerprint(c, &servers);
                let now = s.now;
                let stale = s.clients[c]
                    .stale
                    .map(|(stale, after, judged)| (stale, after.saturating_add(now - judged)));
                s.clients[c].phase = Phase::Acquire {
                    start: s.now,
                    nonce,
                    cand,
                    servers,
                    set,
                    answers: self.round(c),
                    reads: [None; MAX_NODES],
                };
                self.send_all(&mut s, c, |_| {
                    Some(Op::Acquire {
                        nonce,
                        cand,
                        set,
                        stale,
                    })
                });
            }
            Action::Defer(c, n) => {
                s.opening = false;
                let msg = s.clients[c].pending[n].as_mut().expect("pending");
                msg.not_before = s.now + 1;
            }
            Action::Deliver(c, n)
            | Action::DeliverUnanswered(c, n)
            | Action::Drop(c, n)
            | Action::DeliverLate(c, n) => self.deliver(&mut s, action, c, n),
            Action::Resign(c) => {
                s.resigns_left -= 1;
                let now = s.now;
                let client = &mut s.clients[c];
                client.window = client
                    .window
                    .map(|(since, until)| (since, until.min(now)))
                    .filter(|(since, until)| since < until);
                let nonce = match client.phase {
                    Phase::Hold { nonce, .. } | Phase::Lost { nonce, .. } => nonce,
                    _ => unreachable!("resign only while holding"),
                };
                client.phase = Phase::Idle;
                self.send_all(&mut s, c, |_| Some(Op::Release { nonce }));
            }
            Action::Pause(c) => {
                s.pauses_left -= 1;
                s.clients[c].paused = true;
            }
            Action::Resume(c) => s.clients[c].paused = false,
            Action::Fault(kind, n) => {
                s.faults_left -= 1;
                self.fault(&mut s, kind, n);
            }
            Action::Tick => {
                s.now += 1;
                s.opening = true;
                let now = s.now;
                for node in &mut s.nodes {
                    node.data.expire(now);
                    node.backup.expire(now);
                }
                for client in &mut s.clients {
                    if client.window.is_some_and(|(_, until)| until <= now) {
                        client.window = None;
                    }
                }
            }
        }
        self.settle_all(&mut s);
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("mutual exclusion", |model, s| {
                (0..model.clients.len())
                    .filter(|c| Config::inside(s, *c))
                    .count()
                    <= 1
            }),
            Property::always("token order", |_, s: &State| !s.token_regressed),
            Property::sometimes("a tenure", |_, s: &State| s.last_tenure.is_some()),
            Property::sometimes("a handoff", |_, s: &State| s.handoff),
            Property::sometimes("a stale record replaced", |_, s: &State| s.stale_replaced),
        ]
    }

    fn format_action(&self, action: &Action) -> String {
        format!("{action:?}")
    }
}

impl Config {
    /// Client `c`'s request to node `n` is executed (`Deliver`), executed with its answer
    /// lost (`DeliverUnanswered`), never executed (`Drop`), or executed with its answer
    /// coming after the node timeout (`DeliverLate`).
    fn deliver(&self, s: &mut State, action: Action, c: usize, n: usize) {
        s.opening = false;
        let msg = s.clients[c].pending[n].take().expect("pending");
        let late = matches!(action, Action::DeliverLate(..));
        if late {
            s.late_left -= 1;
        } else if !matches!(action, Action::Deliver(..)) {
            s.losses_left -= 1;
        }
        let reply = if matches!(action, Action::Drop(..)) {
            None
        } else {
            self.execute(s, c, n, msg.op)
        };
        let reply = if matches!(action, Action::Deliver(..)) {
            reply
        } else {
            None
        };
        if msg.op.answered() {
            self.receive(s, c, n, msg.op, reply, late);
        }
    }
}

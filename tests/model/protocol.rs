//! The lock protocol as a state machine for stateright: Redis nodes with the lock key, fence
//! counter, max-ttl register, node-set record and epoch marker; clients that acquire, mint
//! tokens, renew, step down, keep a lost lease's promise and release; and the faults.
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
//! or never executed. Deferring makes every order of two requests reachable, one of them a
//! tick later. Requests from one client to one node are executed in the order sent. A client
//! reacts to an answer at once (decides, sends what follows) unless it is paused.

use std::fmt::{self, Write as _};

use stateright::{Model, Property};

use crate::engine::{self, Age};

/// Node slots a model may use.
pub const MAX_NODES: usize = 4;
/// Clients a model may use.
pub const MAX_CLIENTS: usize = 3;
/// Raise rounds before a mint gives up (the engine's `RAISE_ATTEMPTS`).
const RAISE_ATTEMPTS: u8 = 3;

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
#[derive(Clone, Copy, Debug)]
pub struct Rules {
    /// How the marker's lineage is checked.
    pub lineage: LineageRule,
    /// A grant counts only from a node whose data age covers the longest ttl plus drift.
    pub data_age: bool,
    /// Clients learn the longest ttl in use from the nodes' max-ttl registers.
    pub register: bool,
    /// A grant from a node younger than `MAX_TTL` + drift counts only once every node of the
    /// round has answered or timed out.
    pub wait_for_all: bool,
    /// Validity subtracts the drift (`ttl − elapsed − drift`).
    pub drift_margin: bool,
    /// After a loss, what is still held is released only once the validity has run out.
    pub keep_promise: bool,
    /// Node-set records: no grant under a foreign record, no lead after seeing one.
    pub fingerprint: bool,
    /// A grant counts only if its connection shows the server the round's node set named
    /// (`votes`, rule 7): a node first reached, or reached anew, during the round counts from
    /// the next round on.
    pub same_server: bool,
    /// A renewal never moves the validity's end earlier than one already published, so a
    /// lost lease waits for the latest promise (`timing::renewed_until`; found by this model).
    pub longest_promise: bool,
}

impl Rules {
    /// The rules as implemented.
    pub const ALL: Rules = Rules {
        lineage: LineageRule::InScript,
        data_age: true,
        register: true,
        wait_for_all: true,
        drift_margin: true,
        keep_promise: true,
        fingerprint: true,
        same_server: true,
        longest_promise: true,
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
    /// (it held the lock just before), until twice its ttl.
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
    /// The node-set record: (fingerprint, real tick at which it is gone).
    pub record: Option<(u64, u8)>,
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
        if self.record.is_some_and(|(_, at)| at <= now) {
            self.record = None;
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
    /// `set`: the fingerprint the round records (the scripts' `ARGV`), as in every op below.
    Acquire {
        nonce: u8,
        cand: u16,
        set: u64,
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
}

impl Op {
    /// Whether taking it a tick later can matter. A later extend, restore, release or clean-up
    /// only makes a key live longer, which never lets anyone in; a late acquire or raise
    /// answer changes what a round decides.
    fn deferrable(self) -> bool {
        matches!(self, Op::Acquire { .. } | Op::Raise { .. })
    }

    /// Whether the client waits for (and can lose) an answer.
    fn answered(self) -> bool {
        matches!(
            self,
            Op::Acquire { .. } | Op::Extend { .. } | Op::Raise { .. }
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
    /// Acquire: granted, with the data age proven and whether the candidate token was stored.
    Granted {
        age: Age,
        stored: bool,
    },
    /// Acquire or extend: another value holds the key.
    Held,
    /// Acquire: no grant under a live foreign node-set record.
    Conflict,
    /// Acquire: granted on a connection that shows another server than the round's node set
    /// named there (a `?`, or a server since restarted): not counted (rule 7).
    OtherServer,
    /// Extend: our key, extended.
    Extended,
    /// Extend: no key at all.
    Missing,
    /// Raise: the counter before.
    Before(u16),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Waiting to contend.
    Idle,
    /// An acquire round; `lost` once decided against (it then waits for every answer and
    /// cleans up).
    Acquire {
        start: u8,
        nonce: u8,
        cand: u16,
        /// The round's node set: per node, the server it names (`None`: `?`), and its
        /// fingerprint.
        servers: [Option<u8>; MAX_NODES],
        set: u64,
        answers: [Ans; MAX_NODES],
        foreign: bool,
        lost: bool,
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
    pub pauses_left: u8,
    pub resigns_left: u8,
    /// The highest token any tenure was handed, and by whom.
    pub last_tenure: Option<(u16, u8)>,
    /// A tenure was handed a token not above every earlier tenure's.
    pub token_regressed: bool,
    /// A tenure followed another client's (a handoff happened).
    pub handoff: bool,
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
    /// SIGTERM: the app stops now, the client releases at once.
    Resign(usize),
    Pause(usize),
    Resume(usize),
    Fault(Fault, usize),
    Tick,
}

// ---------------------------------------------------------------------------------------
// Nodes: the scripts
// ---------------------------------------------------------------------------------------

/// What an acquire or extend answer tells the client besides its vote.
struct Reply {
    ans: Ans,
    register: u8,
    fence: u16,
    foreign: bool,
    /// The run id the answer's connection shows.
    server: u8,
}

impl Config {
    fn set_mask(&self, client: usize) -> u8 {
        self.clients[client]
            .nodes
            .iter()
            .fold(0, |mask, n| mask | 1 << n)
    }

    /// The node set client `c` knows now: per node, the run id of its last connection.
    fn servers(&self, s: &State, c: usize) -> [Option<u8>; MAX_NODES] {
        std::array::from_fn(|n| s.clients[c].conns[n].map(|conn| conn.id.run))
    }

    /// The fingerprint client `c` records for `servers` (the engine's).
    fn fingerprint(&self, c: usize, servers: &[Option<u8>; MAX_NODES]) -> u64 {
        let list: Vec<(usize, Option<u8>)> = self.clients[c]
            .nodes
            .iter()
            .map(|n| (*n, servers[*n]))
            .collect();
        engine::fingerprint(&list)
    }

    /// Whether client `c`'s round on `servers` counts a grant node `n` gave on a connection
    /// showing run id `server` (the engine's `NodeSet::admits`).
    fn admits(&self, c: usize, servers: &[Option<u8>; MAX_NODES], n: usize, server: u8) -> bool {
        if !self.rules.same_server {
            return true;
        }
        let list: Vec<(usize, Option<u8>)> = self.clients[c]
            .nodes
            .iter()
            .map(|n| (*n, servers[*n]))
            .collect();
        let index = self.clients[c].nodes.iter().position(|m| *m == n);
        engine::admits(&list, index.expect("a node of the list"), (n, server))
    }

    fn in_set(&self, client: usize, node: usize) -> bool {
        self.set_mask(client) & 1 << node != 0
    }

    fn quorum(&self, client: usize) -> usize {
        engine::quorum_of(self.clients[client].nodes.len())
    }

    /// A node-clock interval of `d` real ticks, as the (fast) node measures it.
    fn node_measures(&self, d: u8) -> u8 {
        if d == 0 {
            0
        } else {
            d.saturating_add(self.node_clock_fast)
        }
    }

    /// The real tick at which something written now to live `ttl` node-clock ticks is gone.
    fn node_expiry(&self, now: u8, ttl: u8) -> u8 {
        self.cap(now + ttl - self.node_clock_fast.min(ttl - 1))
    }

    /// Instants after the horizon are all alike: one value for them keeps states few.
    fn cap(&self, t: u8) -> u8 {
        t.min(self.horizon + 1)
    }

    /// The same for the end of a validity, whose step-down comes a safety margin earlier.
    fn cap_end(&self, t: u8) -> u8 {
        t.min(self.horizon + 1 + self.safety_margin)
    }

    /// The data-age proof of the acquire and extend scripts: the marker's age if it holds the
    /// lineage the script reads, else a fresh stamp (age 0).
    fn prove(&self, node: &mut Node, lineage: Id, now: u8) -> Age {
        let proven = node.data.marker.and_then(|m| {
            let measured = match m.stamped {
                None => Age::Ancient,
                Some(at) => Age::Ticks(self.node_measures(now - at)),
            };
            let (marker, current) = match self.rules.lineage {
                LineageRule::InScript | LineageRule::CachedPerConnection => (
                    format!("{}.{}", m.lineage.run, m.lineage.repl),
                    format!("{}.{}", lineage.run, lineage.repl),
                ),
                LineageRule::RunIdOnly => (m.lineage.run.to_string(), lineage.run.to_string()),
                LineageRule::Unchecked => (String::new(), String::new()),
            };
            engine::proven_age(&marker, measured, &current)
        });
        proven.unwrap_or_else(|| {
            node.data.marker = Some(Marker {
                lineage,
                stamped: Some(now),
            });
            Age::Ticks(0)
        })
    }

    /// Records our ttl in the register (if `raise` says so) and writes our node-set record.
    fn record_ttl(&self, node: &mut Node, set: u64, ttl: u8, now: u8, grant: bool) {
        let reg = node.data.register;
        let write = match reg {
            None => true,
            Some((v, at)) if grant => v < ttl || (v == ttl && at - now < ttl),
            Some((v, _)) => v <= ttl,
        };
        if write {
            node.data.register = Some((ttl, self.node_expiry(now, 2 * ttl)));
        }
        if self.rules.fingerprint {
            let longest = node.data.register.map_or(ttl, |(v, _)| v.max(ttl));
            node.data.record = Some((set, self.node_expiry(now, 2 * longest)));
        }
    }

    fn foreign_record(&self, node: &Node, ours: u64) -> bool {
        self.rules.fingerprint && node.data.record.is_some_and(|(set, _)| set != ours)
    }

    /// Executes `op` from `client` on node `n`; the reply if the op has one.
    fn execute(&self, s: &mut State, client: usize, n: usize, op: Op) -> Option<Reply> {
        let now = s.now;
        // The request goes on the live connection, or on a new one that reads the server now.
        let conn = match s.clients[client].conns[n] {
            Some(conn) if conn.live => conn,
            _ => Conn {
                id: s.nodes[n].id,
                live: true,
            },
        };
        s.clients[client].conns[n] = Some(conn);
        let lineage = match self.rules.lineage {
            LineageRule::CachedPerConnection => conn.id,
            _ => s.nodes[n].id,
        };
        let server = conn.id.run;
        let ttl = self.clients[client].ttl;
        let foreign = match op {
            Op::Acquire { set, .. } => self.foreign_record(&s.nodes[n], set),
            _ => false,
        };
        let node = &mut s.nodes[n];
        let ours = |node: &Node, nonce: u8| {
            node.data
                .key
                .is_some_and(|k| k.client == client as u8 && k.nonce == nonce)
        };
        match op {
            Op::Acquire { nonce, cand, set } => {
                let age = self.prove(node, lineage, now);
                let fence = node.data.fence;
                let register = node.data.register.map_or(0, |(v, _)| v);
                let ans = if node.data.key.is_some() {
                    Ans::Held
                } else if foreign {
                    Ans::Conflict
                } else {
                    node.data.key = Some(Key {
                        client: client as u8,
                        nonce,
                        expires: self.node_expiry(now, ttl),
                    });
                    let stored = fence < cand;
                    if stored {
                        node.data.fence = cand;
                    }
                    self.record_ttl(node, set, ttl, now, true);
                    Ans::Granted { age, stored }
                };
                Some(Reply {
                    ans,
                    register,
                    fence,
                    foreign,
                    server,
                })
            }
            // Our key stands: the renewal refreshes the register and the record only when due
            // (the register has less than a ttl left, or the record is not ours), and neither
            // proves nor writes the counter. The engine also sends everything on every
            // `PROOF_EVERY`th renewal; the model never does, the case with the fewest writes.
            Op::Extend { nonce, set, .. } if ours(node, nonce) => {
                let register = node.data.register.map_or(0, |(v, _)| v);
                let due = node.data.register.is_none_or(|(_, at)| at - now < ttl);
                if due {
                    self.record_ttl(node, set, ttl, now, false);
                } else if self.rules.fingerprint
                    && node.data.record.is_none_or(|(recorded, _)| recorded != set)
                {
                    node.data.record = Some((set, self.node_expiry(now, 2 * register.max(ttl))));
                }
                node.data.key = Some(Key {
                    client: client as u8,
                    nonce,
                    expires: self.node_expiry(now, ttl),
                });
                Some(Reply {
                    ans: Ans::Extended,
                    register,
                    fence: node.data.fence,
                    foreign,
                    server,
                })
            }
            Op::Extend {
                nonce, token, set, ..
            } => {
                self.prove(node, lineage, now);
                let register = node.data.register.map_or(0, |(v, _)| v);
                let fence = node.data.fence;
                let ans = if ours(node, nonce) {
                    node.data.key = Some(Key {
                        client: client as u8,
                        nonce,
                        expires: self.node_expiry(now, ttl),
                    });
                    node.data.fence = node.data.fence.max(token);
                    self.record_ttl(node, set, ttl, now, false);
                    Ans::Extended
                } else if node.data.key.is_some() {
                    Ans::Held
                } else {
                    Ans::Missing
                };
                Some(Reply {
                    ans,
                    register,
                    fence,
                    foreign,
                    server,
                })
            }
            Op::Restore { nonce, token, set } => {
                if node.data.key.is_none() {
                    node.data.key = Some(Key {
                        client: client as u8,
                        nonce,
                        expires: self.node_expiry(now, ttl),
                    });
                    node.data.fence = node.data.fence.max(token);
                    self.record_ttl(node, set, ttl, now, false);
                }
                None
            }
            Op::Raise { token } => {
                let before = node.data.fence;
                node.data.fence = before.max(token);
                Some(Reply {
                    ans: Ans::Before(before),
                    register: 0,
                    fence: before,
                    foreign: false,
                    server,
                })
            }
            Op::Release { nonce } => {
                if ours(node, nonce) {
                    node.data.key = None;
                }
                None
            }
            Op::Cleanup { nonce, set } => {
                if ours(node, nonce) {
                    node.data.key = None;
                }
                // Where no key is left, the round's own record goes too.
                if node.data.key.is_none() && node.data.record.is_some_and(|(r, _)| r == set) {
                    node.data.record = None;
                }
                None
            }
        }
    }

    fn fault(&self, s: &mut State, kind: Fault, n: usize) {
        let now = s.now;
        let node = &mut s.nodes[n];
        let fresh = |node: &mut Node| {
            node.ids += 1;
            node.ids
        };
        let mut drop_conns = false;
        match kind {
            Fault::Restart => {
                node.data = Data::default();
                let id = fresh(node);
                node.id = Id { run: id, repl: id };
                drop_conns = true;
            }
            Fault::RestartPersisted => {
                let id = fresh(node);
                node.id = Id { run: id, repl: id };
                drop_conns = true;
            }
            Fault::OlderCopy | Fault::ProxyFailover => {
                node.data = node.backup;
                let id = fresh(node);
                node.id = Id { run: id, repl: id };
                drop_conns = kind == Fault::OlderCopy;
            }
            Fault::Failback => {
                node.data = node.backup;
                node.id.repl = fresh(node);
            }
            Fault::Flush => node.data = Data::default(),
            Fault::Snapshot => node.backup = node.data,
        }
        node.data.expire(now);
        if drop_conns {
            for c in &mut s.clients {
                if let Some(conn) = &mut c.conns[n] {
                    conn.live = false;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Clients: the engine's and the lease's decisions
// ---------------------------------------------------------------------------------------

/// How a grant stands when the round's answers so far are known.
enum Standing {
    Counted,
    /// Counts once every node has answered (young node, wait-for-all rule).
    Waiting,
    NotCounted,
}

impl Config {
    /// The longest ttl the client knows to be in use.
    fn longest(&self, s: &State, c: usize) -> u8 {
        let cfg = &self.clients[c];
        let mut longest = cfg.ttl.max(cfg.max_ttl.unwrap_or(0));
        if self.rules.register {
            longest = longest.max(s.clients[c].seen_ttl);
        }
        longest
    }

    fn standing(&self, s: &State, c: usize, age: Age) -> Standing {
        if !self.rules.data_age {
            return Standing::Counted;
        }
        if !engine::counts(age, self.longest(s, c)) {
            return Standing::NotCounted;
        }
        if self.rules.wait_for_all && !engine::old_beyond_any_ttl(age) {
            return Standing::Waiting;
        }
        Standing::Counted
    }

    fn next_token(&self, s: &State, c: usize, highest: u16) -> u16 {
        (highest + 1).max(u16::from(s.now) + self.clients[c].wall_offset)
    }

    fn send(&self, s: &mut State, c: usize, n: usize, op: Op) {
        let client = &mut s.clients[c];
        if client.pending[n].is_none() {
            client.pending[n] = Some(Msg {
                op,
                deadline: s.now + self.node_timeout,
                not_before: s.now,
            });
        } else {
            // A raise not yet sent is superseded by the next one (higher, same effect).
            let replaceable = matches!(
                (client.queued[n], op),
                (None, _) | (Some(Op::Raise { .. }), Op::Raise { .. })
            );
            assert!(replaceable, "one request queued per node");
            client.queued[n] = Some(op);
        }
    }

    fn send_all(&self, s: &mut State, c: usize, op: impl Fn(usize) -> Option<Op>) {
        for n in 0..self.nodes {
            if self.in_set(c, n) {
                if let Some(op) = op(n) {
                    self.send(s, c, n, op);
                }
            }
        }
    }

    fn idle_wire(client: &Client) -> bool {
        client.pending.iter().all(Option::is_none)
            && client.queued.iter().all(Option::is_none)
            && client.restores.iter().all(Option::is_none)
    }

    fn round(&self, c: usize) -> [Ans; MAX_NODES] {
        std::array::from_fn(|n| {
            if n < self.nodes && self.in_set(c, n) {
                Ans::Pending
            } else {
                Ans::Unused
            }
        })
    }

    /// The client's answer to a request executed on node `n` (`None`: answer lost).
    fn receive(&self, s: &mut State, c: usize, n: usize, op: Op, reply: Option<Reply>) {
        if let Some(r) = &reply {
            let client = &mut s.clients[c];
            client.seen_fence = client.seen_fence.max(r.fence);
            client.seen_ttl = client.seen_ttl.max(r.register);
        }
        let ans = reply.as_ref().map_or(Ans::NoAnswer, |r| r.ans);
        let admitted = match (&reply, s.clients[c].phase) {
            (Some(r), Phase::Acquire { servers, .. }) => self.admits(c, &servers, n, r.server),
            _ => true,
        };
        let phase = &mut s.clients[c].phase;
        match (op, phase) {
            (
                Op::Acquire { nonce, .. },
                Phase::Acquire {
                    nonce: current,
                    answers,
                    foreign,
                    ..
                },
            ) if nonce == *current => {
                answers[n] = match ans {
                    Ans::Granted { .. } if !admitted => Ans::OtherServer,
                    ans => ans,
                };
                *foreign |= reply.is_some_and(|r| r.foreign);
            }
            (
                Op::Extend {
                    nonce, won: false, ..
                },
                Phase::Hold {
                    nonce: current,
                    extend: Some((_, answers, _)),
                    ..
                },
            ) if nonce == *current => answers[n] = ans,
            (
                Op::Raise { token },
                Phase::Raise {
                    token: current,
                    answers,
                    ..
                },
            ) if token == *current && answers[n] == Ans::Pending => answers[n] = ans,
            (Op::Raise { token }, _) => {
                // A late raise answer: the next candidate starts above what it shows.
                let client = &mut s.clients[c];
                client.seen_fence = client.seen_fence.max(token);
            }
            (
                Op::Extend {
                    nonce,
                    token,
                    won: true,
                    set,
                },
                _,
            ) if ans == Ans::Missing => {
                // A late "missing" after a won extend: the engine restores in the background.
                s.clients[c].restores[n] = Some(Op::Restore { nonce, token, set });
            }
            _ => {}
        }
    }

    /// Starts the tenure the client just won (token minted, validity checked again).
    fn lead(&self, s: &mut State, c: usize, start: u8, nonce: u8, token: u16, set: u64) {
        let now = s.now;
        let ttl = self.clients[c].ttl;
        let Some(valid) = engine::validity_ticks(ttl, now - start, self.rules.drift_margin) else {
            s.clients[c].phase = Phase::Cleanup { nonce, set };
            return;
        };
        let end = self.cap_end(start + valid + self.client_clock_slow);
        if end > now {
            if let Some((last, who)) = s.last_tenure {
                if token <= last {
                    s.token_regressed = true;
                }
                if who != c as u8 {
                    s.handoff = true;
                }
            }
            s.last_tenure = Some((token.max(s.last_tenure.map_or(0, |t| t.0)), c as u8));
            let client = &mut s.clients[c];
            client.window = Some(match client.window {
                Some((since, until)) => (since, until.max(end)),
                None => (now, end),
            });
        }
        let client = &mut s.clients[c];
        client.seen_fence = client.seen_fence.max(token);
        client.phase = Phase::Hold {
            nonce,
            token,
            acquired: start,
            end,
            next_renew: self.cap(start + (ttl / 3).max(1)),
            extend: None,
        };
    }

    /// Lets client `c` react to everything it knows at `now`, until nothing changes.
    fn settle(&self, s: &mut State, c: usize) {
        if s.clients[c].paused {
            return;
        }
        loop {
            let before = s.clients[c];
            // Requests queued behind one in flight go out once it is done.
            for n in 0..self.nodes {
                let client = &mut s.clients[c];
                if client.pending[n].is_none() {
                    if let Some(op) = client.restores[n]
                        .take()
                        .or_else(|| client.queued[n].take())
                    {
                        client.pending[n] = Some(Msg {
                            op,
                            deadline: s.now + self.node_timeout,
                            not_before: s.now,
                        });
                    }
                }
            }
            self.step(s, c);
            if s.clients[c] == before {
                return;
            }
        }
    }

    fn step(&self, s: &mut State, c: usize) {
        let now = s.now;
        let q = self.quorum(c);
        match s.clients[c].phase {
            Phase::Idle => {}
            Phase::Acquire {
                start,
                nonce,
                cand,
                set,
                answers,
                foreign,
                lost: false,
                ..
            } => {
                let all_in = !answers.contains(&Ans::Pending);
                let (mut counted, mut maybe, mut stored) = (0, 0, 0);
                for ans in answers {
                    match ans {
                        Ans::Pending => maybe += 1,
                        Ans::Granted { age, stored: st } => {
                            let counts = match self.standing(s, c, age) {
                                Standing::Counted => true,
                                Standing::Waiting if all_in => true,
                                Standing::Waiting => {
                                    maybe += 1;
                                    false
                                }
                                Standing::NotCounted => false,
                            };
                            if counts {
                                counted += 1;
                                stored += usize::from(st);
                            }
                        }
                        _ => {}
                    }
                }
                let refuse = foreign && self.rules.fingerprint;
                if !refuse && counted >= q {
                    if engine::validity_ticks(
                        self.clients[c].ttl,
                        now - start,
                        self.rules.drift_margin,
                    )
                    .is_none()
                    {
                        s.clients[c].phase = Phase::Cleanup { nonce, set };
                    } else if stored >= q {
                        self.lead(s, c, start, nonce, cand, set);
                    } else {
                        let seen = s.clients[c].seen_fence.max(cand);
                        let token = self.next_token(s, c, seen);
                        s.clients[c].phase = Phase::Raise {
                            start,
                            nonce,
                            token,
                            attempt: 1,
                            answers: self.round(c),
                            set,
                        };
                        self.send_all(s, c, |_| Some(Op::Raise { token }));
                    }
                } else if refuse || counted + maybe < q {
                    if let Phase::Acquire { lost, .. } = &mut s.clients[c].phase {
                        *lost = true;
                    }
                }
            }
            Phase::Acquire {
                nonce,
                answers,
                set,
                lost: true,
                ..
            } => {
                // Decided against: once every answer is in, delete our key wherever a node
                // did not show another holder (and our record where no key is left).
                if Self::idle_wire(&s.clients[c]) {
                    s.clients[c].phase = Phase::Idle;
                    self.send_all(s, c, |n| {
                        (!matches!(answers[n], Ans::Held | Ans::Conflict))
                            .then_some(Op::Cleanup { nonce, set })
                    });
                }
            }
            Phase::Raise {
                start,
                nonce,
                token,
                attempt,
                answers,
                set,
            } => {
                let answered: Vec<u16> = answers
                    .iter()
                    .filter_map(|a| match a {
                        Ans::Before(v) => Some(*v),
                        _ => None,
                    })
                    .collect();
                let pending = answers.iter().filter(|a| **a == Ans::Pending).count();
                if answered.len() >= q {
                    let highest = answered.iter().copied().max().unwrap_or(0);
                    let client = &mut s.clients[c];
                    client.seen_fence = client.seen_fence.max(highest).max(token);
                    if highest < token {
                        self.lead(s, c, start, nonce, token, set);
                    } else if attempt < RAISE_ATTEMPTS {
                        let token = self.next_token(s, c, highest);
                        s.clients[c].phase = Phase::Raise {
                            start,
                            nonce,
                            token,
                            attempt: attempt + 1,
                            answers: self.round(c),
                            set,
                        };
                        self.send_all(s, c, |_| Some(Op::Raise { token }));
                    } else {
                        s.clients[c].phase = Phase::Cleanup { nonce, set };
                    }
                } else if answered.len() + pending < q {
                    s.clients[c].phase = Phase::Cleanup { nonce, set };
                }
            }
            Phase::Cleanup { nonce, set } => {
                if Self::idle_wire(&s.clients[c]) {
                    s.clients[c].phase = Phase::Idle;
                    self.send_all(s, c, |_| Some(Op::Cleanup { nonce, set }));
                }
            }
            Phase::Hold {
                nonce,
                token,
                acquired,
                end,
                next_renew,
                extend,
            } => {
                let lose = |s: &mut State| s.clients[c].phase = Phase::Lost { nonce, end };
                let step_down = end.saturating_sub(self.safety_margin).max(acquired);
                match extend {
                    Some((started, answers, set)) => {
                        let count = |f: fn(&Ans) -> bool| answers.iter().filter(|a| f(a)).count();
                        let extended = count(|a| *a == Ans::Extended);
                        let pending = count(|a| *a == Ans::Pending);
                        let contrary = count(|a| matches!(a, Ans::Held | Ans::Missing));
                        if now >= end {
                            lose(s);
                        } else if extended >= q {
                            let ttl = self.clients[c].ttl;
                            let Some(valid) =
                                engine::validity_ticks(ttl, now - started, self.rules.drift_margin)
                            else {
                                return lose(s);
                            };
                            let new_end = self.cap_end(started + valid + self.client_clock_slow);
                            let client = &mut s.clients[c];
                            if let Some((_, until)) = &mut client.window {
                                *until = (*until).max(new_end);
                            }
                            for msg in client.pending.iter_mut().flatten() {
                                if let Op::Extend { won, .. } = &mut msg.op {
                                    *won = true;
                                }
                            }
                            let end = if self.rules.longest_promise {
                                new_end.max(end)
                            } else {
                                new_end
                            };
                            client.phase = Phase::Hold {
                                nonce,
                                token,
                                acquired,
                                end,
                                next_renew: self.cap(started + (ttl / 3).max(1)),
                                extend: None,
                            };
                            // Nodes that lost our key get it back, now the quorum is proven.
                            self.send_all(s, c, |n| {
                                (answers[n] == Ans::Missing).then_some(Op::Restore {
                                    nonce,
                                    token,
                                    set,
                                })
                            });
                        } else if extended + pending < q {
                            if contrary >= q {
                                lose(s); // superseded
                            } else if let Phase::Hold {
                                extend, next_renew, ..
                            } = &mut s.clients[c].phase
                            {
                                *extend = None;
                                *next_renew = now + 1; // fast retry
                            }
                        }
                    }
                    None => {
                        if now >= step_down {
                            lose(s);
                        } else if now >= next_renew && Self::idle_wire(&s.clients[c]) {
                            // A renewal records the node set as the client knows it now.
                            let set = self.fingerprint(c, &self.servers(s, c));
                            let answers = self.round(c);
                            if let Phase::Hold { extend, .. } = &mut s.clients[c].phase {
                                *extend = Some((now, answers, set));
                            }
                            self.send_all(s, c, |_| {
                                Some(Op::Extend {
                                    nonce,
                                    token,
                                    won: false,
                                    set,
                                })
                            });
                        }
                    }
                }
            }
            Phase::Lost { nonce, end } => {
                // The release goes out behind the requests still in flight.
                if (!self.rules.keep_promise || now >= end) && Self::idle_wire(&s.clients[c]) {
                    s.clients[c].phase = Phase::Idle;
                    self.send_all(s, c, |_| Some(Op::Release { nonce }));
                }
            }
        }
    }

    fn settle_all(&self, s: &mut State) {
        for c in 0..self.clients.len() {
            self.settle(s, c);
        }
    }

    /// The request taken next in this tick: node by node, client by client.
    fn next_request(&self, s: &State) -> Option<(usize, usize, Msg)> {
        (0..self.nodes).find_map(|n| {
            (0..self.clients.len()).find_map(|c| {
                s.clients[c].pending[n]
                    .filter(|m| m.not_before <= s.now)
                    .map(|m| (c, n, m))
            })
        })
    }

    /// Whether client `c`'s app may act at the current tick.
    pub fn inside(s: &State, c: usize) -> bool {
        s.clients[c]
            .window
            .is_some_and(|(since, until)| since <= s.now && s.now < until)
    }
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
                let gone = self.node_expiry(0, 2 * ttl);
                nodes[*n].data.register = Some((ttl, gone));
                nodes[*n].data.record = Some((set, gone));
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
            pauses_left: self.pauses,
            resigns_left: self.resigns,
            last_tenure: None,
            token_regressed: false,
            handoff: false,
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
                s.clients[c].phase = Phase::Acquire {
                    start: s.now,
                    nonce,
                    cand,
                    servers,
                    set,
                    answers: self.round(c),
                    foreign: false,
                    lost: false,
                };
                self.send_all(&mut s, c, |_| Some(Op::Acquire { nonce, cand, set }));
            }
            Action::Defer(c, n) => {
                s.opening = false;
                let msg = s.clients[c].pending[n].as_mut().expect("pending");
                msg.not_before = s.now + 1;
            }
            Action::Deliver(c, n) | Action::DeliverUnanswered(c, n) | Action::Drop(c, n) => {
                s.opening = false;
                let msg = s.clients[c].pending[n].take().expect("pending");
                if !matches!(action, Action::Deliver(..)) {
                    s.losses_left -= 1;
                }
                let reply = if matches!(action, Action::Drop(..)) {
                    None
                } else {
                    self.execute(&mut s, c, n, msg.op)
                };
                let reply = if matches!(action, Action::Deliver(..)) {
                    reply
                } else {
                    None
                };
                if msg.op.answered() {
                    self.receive(&mut s, c, n, msg.op, reply);
                }
            }
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
        ]
    }

    fn format_action(&self, action: &Action) -> String {
        format!("{action:?}")
    }
}

// ---------------------------------------------------------------------------------------
// Traces
// ---------------------------------------------------------------------------------------

impl Config {
    /// One line for a state: the time, each node, each client.
    pub fn describe(&self, s: &State) -> String {
        let mut f = String::new();
        self.describe_into(&mut f, s).expect("writing to a String");
        f
    }

    fn describe_into(&self, f: &mut String, s: &State) -> fmt::Result {
        write!(f, "t={:<2}", s.now)?;
        for (n, node) in s.nodes.iter().enumerate().take(self.nodes) {
            let d = &node.data;
            let mut line = String::new();
            match d.key {
                Some(k) => write!(line, "key=c{}#{}<{}", k.client, k.nonce, k.expires)?,
                None => line.push_str("key=-"),
            }
            write!(line, " fence={}", d.fence)?;
            if let Some((v, at)) = d.register {
                write!(line, " reg={v}<{at}")?;
            }
            if let Some((set, at)) = d.record {
                write!(line, " rec={:04x}<{at}", set & 0xffff)?;
            }
            match d.marker {
                Some(m) => write!(
                    line,
                    " epoch={}.{}@{}",
                    m.lineage.run,
                    m.lineage.repl,
                    m.stamped.map_or("old".to_owned(), |t| t.to_string())
                )?,
                None => line.push_str(" epoch=-"),
            }
            write!(f, " | n{n}[{line} id={}.{}]", node.id.run, node.id.repl)?;
        }
        for (c, client) in s.clients.iter().enumerate().take(self.clients.len()) {
            let phase = match client.phase {
                Phase::Idle => "idle".to_owned(),
                Phase::Acquire { start, lost, .. } => {
                    format!("acquire@{start}{}", if lost { " lost" } else { "" })
                }
                Phase::Raise { token, .. } => format!("raise {token}"),
                Phase::Cleanup { .. } => "cleanup".to_owned(),
                Phase::Hold {
                    token, end, extend, ..
                } => format!(
                    "hold token={token} end={end}{}",
                    if extend.is_some() { " extending" } else { "" }
                ),
                Phase::Lost { end, .. } => format!("lost end={end}"),
            };
            let window = client
                .window
                .map_or(String::new(), |(a, b)| format!(" app=[{a},{b})"));
            let paused = if client.paused { " paused" } else { "" };
            write!(f, " | c{c}[{phase}{window}{paused}]")?;
        }
        Ok(())
    }
}

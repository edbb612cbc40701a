//! The model's clients: they send, receive and carry out what the engine's round state
//! machines decide (see `engine`), and keep the lease's promise.

use super::nodes::Reply;
use super::*;

// ---------------------------------------------------------------------------------------

impl Config {
    /// The longest ttl client `c` was configured with (`--ttl`, `--max-ttl`); what it learns
    /// from the registers, the engine's round adds.
    pub(super) fn configured_longest(&self, c: usize) -> u8 {
        let cfg = &self.clients[c];
        cfg.ttl.max(cfg.max_ttl.unwrap_or(0))
    }

    /// Client `c`'s wall clock (the token floor).
    pub(super) fn wall(&self, s: &State, c: usize) -> u16 {
        u16::from(s.now) + self.clients[c].wall_offset
    }

    /// The token client `c` proposes above `highest` (the engine's).
    pub(super) fn next_token(&self, s: &State, c: usize, highest: u16) -> u16 {
        engine::token_above_ticks(highest, self.wall(s, c))
    }

    /// The client's node list with, per node, what the round records of it.
    pub(super) fn list(
        &self,
        c: usize,
        servers: &[Option<u8>; MAX_NODES],
    ) -> Vec<(usize, Option<u8>)> {
        self.clients[c]
            .nodes
            .iter()
            .map(|n| (*n, servers[*n]))
            .collect()
    }

    /// The answers of a round in list order: (position in the client's list, answer), for
    /// the nodes that have answered.
    pub(super) fn answered<A: Copy, T>(
        &self,
        c: usize,
        answers: &[A; MAX_NODES],
        f: impl Fn(A) -> Option<T>,
    ) -> Vec<(usize, T)> {
        self.clients[c]
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| f(answers[*n]).map(|a| (i, a)))
            .collect()
    }

    /// The node of position `i` in client `c`'s list.
    pub(super) fn node_at(&self, c: usize, i: usize) -> usize {
        self.clients[c].nodes[i]
    }

    pub(super) fn send(&self, s: &mut State, c: usize, n: usize, op: Op) {
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

    pub(super) fn send_all(&self, s: &mut State, c: usize, op: impl Fn(usize) -> Option<Op>) {
        for n in 0..self.nodes {
            if self.in_set(c, n) {
                if let Some(op) = op(n) {
                    self.send(s, c, n, op);
                }
            }
        }
    }

    pub(super) fn idle_wire(client: &Client) -> bool {
        client.pending.iter().all(Option::is_none)
            && client.queued.iter().all(Option::is_none)
            && client.restores.iter().all(Option::is_none)
    }

    pub(super) fn round(&self, c: usize) -> [Ans; MAX_NODES] {
        std::array::from_fn(|n| {
            if n < self.nodes && self.in_set(c, n) {
                Ans::Pending
            } else {
                Ans::Unused
            }
        })
    }

    /// The client's answer to a request executed on node `n` (`None`: answer lost, or `late`:
    /// it comes after the node timeout, when the client has given up on it).
    pub(super) fn receive(
        &self,
        s: &mut State,
        c: usize,
        n: usize,
        op: Op,
        reply: Option<Reply>,
        late: bool,
    ) {
        if let Some(r) = &reply {
            let client = &mut s.clients[c];
            client.seen_fence = client.seen_fence.max(r.fence);
            client.seen_ttl = client.seen_ttl.max(r.register);
        }
        let known = s.clients[c].seen_ttl;
        let timed_out = if late && matches!(op, Op::Acquire { .. }) {
            Ans::Late
        } else {
            Ans::NoAnswer
        };
        let now = s.now;
        let ans = match reply.as_ref().map_or(timed_out, |r| r.ans) {
            Ans::Granted {
                age,
                stored,
                server,
                recorded,
                replaced,
                ..
            } => Ans::Granted {
                age,
                stored,
                server,
                recorded,
                replaced,
                longest: known,
            },
            Ans::Held { foreign, .. } => Ans::Held {
                foreign,
                longest: known,
            },
            Ans::Conflict { set, age, .. } => Ans::Conflict {
                set,
                age,
                longest: known,
            },
            ans => ans,
        };
        let phase = &mut s.clients[c].phase;
        match (op, phase) {
            (
                Op::Acquire { nonce, .. },
                Phase::Acquire {
                    nonce: current,
                    answers,
                    ..
                },
            ) if nonce == *current => answers[n] = ans,
            (
                Op::Register { nonce },
                Phase::Acquire {
                    nonce: current,
                    reads,
                    ..
                },
            ) if nonce == *current => {
                // A read that timed out is not kept: the round asks the node again.
                if let Ans::Register(register) = ans {
                    reads[n] = Some((register, now));
                }
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
    pub(super) fn lead(&self, s: &mut State, c: usize, start: u8, nonce: u8, token: u16, set: u64) {
        let now = s.now;
        let ttl = self.clients[c].ttl;
        let Some(valid) = engine::validity_ticks(self.rules.engine, ttl, now - start) else {
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
        let next_renew = self.cap(engine::first_renewal(self.held(c, start, end, 0)));
        let client = &mut s.clients[c];
        client.seen_fence = client.seen_fence.max(token);
        client.phase = Phase::Hold {
            nonce,
            token,
            acquired: start,
            end,
            next_renew,
            extend: None,
        };
    }

    /// Lets client `c` react to everything it knows at `now`, until nothing changes.
    pub(super) fn settle(&self, s: &mut State, c: usize) {
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

    /// What client `c` does next, as the engine's round state machines decide.
    pub(super) fn step(&self, s: &mut State, c: usize) {
        let now = s.now;
        match s.clients[c].phase {
            Phase::Idle => {}
            Phase::Acquire { .. } => self.step_acquire(s, c),
            Phase::Raise { .. } => self.step_raise(s, c),
            Phase::Cleanup { nonce, set } => {
                if Self::idle_wire(&s.clients[c]) {
                    s.clients[c].phase = Phase::Idle;
                    self.send_all(s, c, |_| Some(Op::Cleanup { nonce, set }));
                }
            }
            Phase::Hold {
                extend: Some(_), ..
            } => self.step_extend(s, c),
            Phase::Hold {
                nonce,
                token,
                acquired,
                end,
                next_renew,
                extend: None,
            } => {
                let held = self.held(c, acquired, end, next_renew);
                let next = engine::hold_next(self.rules.engine, held, now);
                if next == HoldNext::StepDown {
                    s.clients[c].phase = Phase::Lost { nonce, end };
                } else if next == HoldNext::Renew && Self::idle_wire(&s.clients[c]) {
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
            Phase::Lost { nonce, end } => {
                // The release goes out behind the requests still in flight.
                if (!self.rules.keep_promise || now >= end) && Self::idle_wire(&s.clients[c]) {
                    s.clients[c].phase = Phase::Idle;
                    self.send_all(s, c, |_| Some(Op::Release { nonce }));
                }
            }
        }
    }

    /// An acquire round: the engine's `AcquireRound` decides on the answers so far.
    pub(super) fn step_acquire(&self, s: &mut State, c: usize) {
        let Phase::Acquire {
            start,
            nonce,
            cand,
            servers,
            set,
            answers,
            reads,
        } = s.clients[c].phase
        else {
            return;
        };
        let list = self.list(c, &servers);
        let view = AcquireView {
            ttl: self.clients[c].ttl,
            longest: self.configured_longest(c),
            candidate: cand,
            start,
            list: &list,
            seen_fence: s.clients[c].seen_fence,
            node_timeout: self.node_timeout,
            rules: self.rules.engine,
        };
        let answered = self.answered(c, &answers, |a| match a {
            // Lost or late, the round sees a timeout.
            Ans::NoAnswer | Ans::Late => Some(AcquireAns::NoAnswer),
            Ans::Granted {
                age,
                stored,
                server,
                recorded,
                replaced,
                longest,
            } => Some(AcquireAns::Granted {
                age,
                stored,
                server,
                recorded,
                replaced,
                longest,
            }),
            Ans::Held { foreign, longest } => Some(AcquireAns::Held { foreign, longest }),
            Ans::Conflict { set, age, longest } => Some(AcquireAns::Conflict { set, age, longest }),
            _ => None,
        });
        let reads: Vec<RegisterRead> = self
            .answered(c, &reads, |read| read)
            .into_iter()
            .map(|(index, (register, at))| RegisterRead {
                index,
                register,
                at,
            })
            .collect();
        match engine::acquire_next(&view, &answered, &reads, s.now) {
            AcquireNext::Listen => {}
            AcquireNext::Recheck(positions) => {
                // The engine reads every node it names; a node whose request was lost is cut
                // off for the round (its read is never answered), so only the slow ones are
                // asked, once at a time.
                for n in positions.into_iter().map(|i| self.node_at(c, i)) {
                    if answers[n] == Ans::Late && s.clients[c].pending[n].is_none() {
                        self.send(s, c, n, Op::Register { nonce });
                    }
                }
            }
            AcquireNext::Lost(clean_up, stale) => {
                // Once every request is done, our key goes wherever the round says it may stand.
                if Self::idle_wire(&s.clients[c]) {
                    s.clients[c].phase = Phase::Idle;
                    s.clients[c].stale = stale.map(|(set, after)| (set, after, s.now));
                    let nodes: Vec<usize> = clean_up.iter().map(|i| self.node_at(c, *i)).collect();
                    self.send_all(s, c, |n| {
                        nodes.contains(&n).then_some(Op::Cleanup { nonce, set })
                    });
                }
            }
            AcquireNext::TooShort => {
                s.clients[c].stale = None;
                s.clients[c].phase = Phase::Cleanup { nonce, set };
            }
            AcquireNext::Lead(token) => {
                s.clients[c].stale = None;
                self.lead(s, c, start, nonce, token, set);
            }
            AcquireNext::Raise(above) => {
                s.clients[c].stale = None;
                let token = self.next_token(s, c, above);
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
        }
    }

    /// Raising the fence: the engine's `FenceRaise` decides on the answers so far.
    pub(super) fn step_raise(&self, s: &mut State, c: usize) {
        let Phase::Raise {
            start,
            nonce,
            token,
            attempt,
            answers,
            set,
        } = s.clients[c].phase
        else {
            return;
        };
        let answered = self.answered(c, &answers, |a| match a {
            Ans::Before(v) => Some(Some(v)),
            Ans::NoAnswer => Some(None),
            _ => None,
        });
        let nodes = self.clients[c].nodes.len();
        let (next, seen) =
            engine::raise_next(nodes, token, attempt - 1, &answered, self.wall(s, c));
        if next != RaiseNext::Listen {
            let client = &mut s.clients[c];
            client.seen_fence = client.seen_fence.max(seen);
        }
        match next {
            RaiseNext::Listen => {}
            RaiseNext::Minted(token) => self.lead(s, c, start, nonce, token, set),
            RaiseNext::Again(token) => {
                s.clients[c].phase = Phase::Raise {
                    start,
                    nonce,
                    token,
                    attempt: attempt + 1,
                    answers: self.round(c),
                    set,
                };
                self.send_all(s, c, |_| Some(Op::Raise { token }));
            }
            RaiseNext::Failed => s.clients[c].phase = Phase::Cleanup { nonce, set },
        }
    }

    /// A renewal: the engine's `ExtendRound` decides on the answers so far.
    pub(super) fn step_extend(&self, s: &mut State, c: usize) {
        let Phase::Hold {
            nonce,
            token,
            acquired,
            end,
            next_renew,
            extend: Some((started, answers, set)),
        } = s.clients[c].phase
        else {
            return;
        };
        let now = s.now;
        let ttl = self.clients[c].ttl;
        let answered = self.answered(c, &answers, |a| match a {
            Ans::NoAnswer => Some(ExtendAns::NoAnswer),
            Ans::Extended => Some(ExtendAns::Extended),
            Ans::Held { .. } => Some(ExtendAns::Held),
            Ans::Missing => Some(ExtendAns::Missing),
            _ => None,
        });
        let nodes = self.clients[c].nodes.len();
        let rules = self.rules.engine;
        match engine::extend_next(rules, nodes, ttl, started, end, &answered, now) {
            ExtendNext::Listen => {}
            ExtendNext::Gone => s.clients[c].phase = Phase::Lost { nonce, end },
            ExtendNext::Lost => {
                let held = self.held(c, acquired, end, next_renew);
                let retry = self.cap(engine::renewal_failed(rules, held, now));
                if let Phase::Hold {
                    extend, next_renew, ..
                } = &mut s.clients[c].phase
                {
                    *extend = None;
                    *next_renew = retry;
                }
            }
            ExtendNext::Renewed { proven, restore } => {
                // The client's clock runs slow: what it proved ends a little later in real time.
                let new_end = self.cap_end(proven.saturating_add(self.client_clock_slow));
                let held = self.held(c, acquired, end, next_renew);
                let (end, next_renew) = engine::renewed(rules, held, started, now, new_end);
                let client = &mut s.clients[c];
                if let Some((_, until)) = &mut client.window {
                    *until = (*until).max(new_end);
                }
                for msg in client.pending.iter_mut().flatten() {
                    if let Op::Extend { won, .. } = &mut msg.op {
                        *won = true;
                    }
                }
                client.phase = Phase::Hold {
                    nonce,
                    token,
                    acquired,
                    end: self.cap_end(end),
                    next_renew: self.cap(next_renew),
                    extend: None,
                };
                // Nodes that lost our key get it back, now the quorum is proven.
                let nodes: Vec<usize> = restore.iter().map(|i| self.node_at(c, *i)).collect();
                self.send_all(s, c, |n| {
                    nodes
                        .contains(&n)
                        .then_some(Op::Restore { nonce, token, set })
                });
            }
        }
    }

    /// Client `c`'s tenure as the engine's lease machine sees it.
    fn held(&self, c: usize, acquired: u8, end: u8, next_renew: u8) -> Held {
        Held {
            ttl: self.clients[c].ttl,
            safety_margin: self.safety_margin,
            acquired,
            end,
            next_renew,
        }
    }

    pub(super) fn settle_all(&self, s: &mut State) {
        for c in 0..self.clients.len() {
            self.settle(s, c);
        }
    }

    /// The request taken next in this tick: node by node, client by client.
    pub(super) fn next_request(&self, s: &State) -> Option<(usize, usize, Msg)> {
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

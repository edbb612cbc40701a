//! The model's Redis nodes: what each script does to a node's data, and the faults.

use super::*;

// ---------------------------------------------------------------------------------------

/// What an acquire or extend answer tells the client besides its vote.
pub(super) struct Reply {
    pub(super) ans: Ans,
    pub(super) register: u8,
    pub(super) fence: u16,
}

/// Who runs a request on a node, and what the script reads there.
#[derive(Clone, Copy)]
struct At {
    client: usize,
    now: u8,
    ttl: u8,
    /// The lineage the script reads (see `LineageRule`).
    lineage: Id,
    /// The run id the request's connection shows.
    server: u8,
}

impl Config {
    pub(super) fn set_mask(&self, client: usize) -> u8 {
        self.clients[client]
            .nodes
            .iter()
            .fold(0, |mask, n| mask | 1 << n)
    }

    /// The node set client `c` knows now: per node, the run id of its last connection.
    pub(super) fn servers(&self, s: &State, c: usize) -> [Option<u8>; MAX_NODES] {
        std::array::from_fn(|n| s.clients[c].conns[n].map(|conn| conn.id.run))
    }

    /// The fingerprint client `c` records for `servers` (the engine's).
    pub(super) fn fingerprint(&self, c: usize, servers: &[Option<u8>; MAX_NODES]) -> u64 {
        let list: Vec<(usize, Option<u8>)> = self.clients[c]
            .nodes
            .iter()
            .map(|n| (*n, servers[*n]))
            .collect();
        engine::fingerprint(&list)
    }

    pub(super) fn in_set(&self, client: usize, node: usize) -> bool {
        self.set_mask(client) & 1 << node != 0
    }

    /// A node-clock interval of `d` real ticks, as the (fast) node measures it.
    pub(super) fn node_measures(&self, d: u8) -> u8 {
        if d == 0 {
            0
        } else {
            d.saturating_add(self.node_clock_fast)
        }
    }

    /// The real tick at which something written now to live `ttl` node-clock ticks is gone.
    pub(super) fn node_expiry(&self, now: u8, ttl: u8) -> u8 {
        self.cap(now + ttl - self.node_clock_fast.min(ttl - 1))
    }

    /// Instants after the horizon are all alike: one value for them keeps states few.
    pub(super) fn cap(&self, t: u8) -> u8 {
        t.min(self.horizon + 1)
    }

    /// The same for the end of a validity, whose step-down comes a safety margin earlier.
    pub(super) fn cap_end(&self, t: u8) -> u8 {
        t.min(self.horizon + 1 + self.safety_margin)
    }

    /// The data-age proof of the acquire and extend scripts: the marker's age if it holds the
    /// lineage the script reads, else a fresh stamp (age 0).
    pub(super) fn prove(&self, node: &mut Node, lineage: Id, now: u8) -> Age {
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

    /// Records our ttl in the register as the scripts' `record_ttl` does (a grant; a renewal's
    /// refresh, `grant` false, also rewrites a register of our own ttl) and writes our
    /// node-set record. A longer ttl's register with less than our ttl left is kept, at its
    /// value, for as long as ours would live.
    pub(super) fn record_ttl(&self, node: &mut Node, set: u64, ttl: u8, now: u8, grant: bool) {
        let expires = self.node_expiry(now, LIFE * ttl);
        node.data.register = match node.data.register {
            None => Some((ttl, expires)),
            Some((v, _)) if v < ttl || (!grant && v == ttl) => Some((ttl, expires)),
            Some((v, at)) if at - now < ttl => Some((v, expires)),
            kept => kept,
        };
        if self.rules.fingerprint {
            let longest = node.data.register.map_or(ttl, |(v, _)| v.max(ttl));
            node.data.record = Some((set, self.node_expiry(now, LIFE * longest), now));
        }
    }

    /// Another set's record on `node`, if any: its fingerprint, and its age on the node's
    /// clock (what the acquire script reads as its life less its `PTTL`).
    pub(super) fn foreign_record(&self, node: &Node, ours: u64, now: u8) -> Option<(u64, u8)> {
        if !self.rules.fingerprint {
            return None;
        }
        node.data
            .record
            .filter(|(set, _, _)| *set != ours)
            .map(|(set, _, written)| (set, self.node_measures(now - written)))
    }

    /// Executes `op` from `client` on node `n`; the reply if the op has one.
    pub(super) fn execute(&self, s: &mut State, client: usize, n: usize, op: Op) -> Option<Reply> {
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
            Op::Acquire { set, .. } => self.foreign_record(&s.nodes[n], set, now),
            _ => None,
        };
        let node = &mut s.nodes[n];
        let ours = |node: &Node, nonce: u8| {
            node.data
                .key
                .is_some_and(|k| k.client == client as u8 && k.nonce == nonce)
        };
        match op {
            Op::Acquire {
                nonce,
                cand,
                set,
                stale,
            } => {
                let at = At {
                    client,
                    now,
                    ttl,
                    lineage,
                    server,
                };
                let reply = self.acquire_on(node, at, (nonce, cand, set), foreign, stale);
                if matches!(
                    reply.ans,
                    Ans::Granted {
                        replaced: Some(_),
                        ..
                    }
                ) {
                    s.stale_replaced = true;
                }
                Some(reply)
            }
            // Our key stands: the renewal refreshes the register and the record only when the
            // refresh marker does not hold our fingerprint, and neither proves nor writes the
            // counter. The marker goes a ttl before the register does. The engine also sends
            // everything on every `PROOF_EVERY`th renewal; the model never does, the case with
            // the fewest writes.
            Op::Extend { nonce, set, .. } if ours(node, nonce) => {
                let register = if node.data.refreshed.is_some_and(|(marked, _)| marked == set) {
                    0
                } else {
                    let before = node.data.register.map_or(0, |(v, _)| v);
                    self.record_ttl(node, set, ttl, now, false);
                    node.data.refreshed = node.data.register.and_then(|(_, gone)| {
                        let by_register = if gone > self.horizon {
                            u8::MAX
                        } else {
                            gone.saturating_sub(ttl)
                        };
                        let at = self.node_expiry(now, (LIFE - 1) * ttl).min(by_register);
                        (at > now).then_some((set, at))
                    });
                    before
                };
                node.data.key = Some(Key {
                    client: client as u8,
                    nonce,
                    expires: self.node_expiry(now, ttl),
                });
                Some(Reply {
                    ans: Ans::Extended,
                    register,
                    fence: node.data.fence,
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
                    Ans::Held {
                        foreign: None,
                        longest: 0,
                    }
                } else {
                    Ans::Missing
                };
                Some(Reply {
                    ans,
                    register,
                    fence,
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
                })
            }
            Op::Release { nonce } => {
                // The release script: our key, and the node-set record beside it (ours).
                if ours(node, nonce) {
                    node.data.key = None;
                    node.data.record = None;
                }
                None
            }
            Op::Register { .. } => {
                let register = node.data.register.map_or(0, |(v, _)| v);
                Some(Reply {
                    ans: Ans::Register(register),
                    register,
                    fence: 0,
                })
            }
            Op::Cleanup { nonce, set } => {
                if ours(node, nonce) {
                    node.data.key = None;
                }
                // Where no key is left, the round's own record goes too.
                if node.data.key.is_none() && node.data.record.is_some_and(|(r, _, _)| r == set) {
                    node.data.record = None;
                }
                None
            }
        }
    }

    /// The acquire script on `node`: `SET NX` unless held or under a foreign record (unless
    /// it is the `stale` one, old enough), with the data-age proof, the fence and the
    /// register as they were.
    fn acquire_on(
        &self,
        node: &mut Node,
        at: At,
        (nonce, cand, set): (u8, u16, u64),
        foreign: Option<(u64, u8)>,
        stale: Option<(u64, u8)>,
    ) -> Reply {
        let At {
            client,
            now,
            ttl,
            lineage,
            server,
        } = at;
        let age = self.prove(node, lineage, now);
        let fence = node.data.fence;
        let register = node.data.register.map_or(0, |(v, _)| v);
        let recorded = node.data.record.is_some();
        let ans = if node.data.key.is_some() {
            Ans::Held {
                foreign,
                longest: 0,
            }
        } else if let Some((theirs, age)) = foreign.filter(|(theirs, age)| {
            !stale.is_some_and(|(stale, after)| stale == *theirs && *age >= after)
        }) {
            Ans::Conflict {
                set: theirs,
                age,
                longest: 0,
            }
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
            Ans::Granted {
                age,
                stored,
                server,
                recorded,
                replaced: foreign.map(|(theirs, _)| theirs),
                longest: 0,
            }
        };
        Reply {
            ans,
            register,
            fence,
        }
    }

    pub(super) fn fault(&self, s: &mut State, kind: Fault, n: usize) {
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
            Fault::OtherName => {
                let fastest = self.clients.iter().map(|c| c.wall_offset).max();
                let candidate = u16::from(now) + fastest.unwrap_or(0);
                node.data.fence = node.data.fence.saturating_add(1).max(candidate);
            }
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

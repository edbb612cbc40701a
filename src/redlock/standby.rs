//! What a waiting standby does next, and when: a pure decision over what it has seen.
//!
//! A standby that lost a round to a holder does not run acquire rounds to ask "still held?".
//! It keeps, per node, what it knows of the lock key there, and runs a round only when the
//! lock may have become free. The async loop (`Redlock::acquire`) only feeds events in, asks
//! [`Standby::next`], and waits until the instant it names or the next event.
//!
//! ## Behaviour
//! - **Only a quorum can hold the lock.** With `held` nodes still holding a key, the lock can
//!   only become free once fewer than a quorum do: after the (`held` − quorum + 1)-th earliest
//!   key expiry. The standby sleeps until then (plus the drift floor) and reads the nodes again
//!   (a plain `GET` + `PTTL`, no script): renewals pushed the expiries later, so it sleeps again.
//!   When the reads show that fewer than a quorum may still hold a key, it runs a round.
//! - **Unknown nodes are read first.** A node whose state is unknown (never read, or its
//!   subscription just came back and may have missed events) is read before anything else.
//!   A node whose read failed is read again after `poll_every`: until then it counts as
//!   holding, so a slow or unreachable node does not send every standby into a round at once
//!   (only nodes read free call for one). This delays a takeover by at most `poll_every`, and
//!   only when the failed node's key is one a quorum needs.
//! - **Spread rounds.** A round the reads or events call for is scheduled like one after a
//!   release push (below), spread over the waiters that saw the same: every standby whose turn
//!   it is reads at about the same moment after a crash.
//! - **Release push**, to those that watch releases ([`watches_releases`]: every waiter up to
//!   [`READERS`] subscribers of a node's release channel, about that many past it). A release
//!   announcement schedules a round after a random pause within `SPREAD_SLOT` × the number of
//!   other watchers (else of other waiters: a lone waiter starts at once; capped at
//!   `SPREAD_MAX`; both counted on a node with
//!   `PUBSUB NUMSUB` when the standby starts watching and again every few ttls): the first of
//!   many waiters starts within about one slot, and the acquisition announcement of the winner
//!   reaches the others before most of them start. An announcement of a release by someone
//!   other than the known holder (announced, or shown by the nodes) is stale and ignored.
//! - **Acquisition push.** An announcement is news if its fencing token is above the last one
//!   announced and above the counter the last round saw on the nodes. News names the holder,
//!   cancels a scheduled round (the standby stands down), and marks the nodes read free held
//!   until the announced validity ends, at most the longest ttl from receipt (no node of the
//!   winner's quorum drops the key before); a key whose expiry was read keeps that expiry (the
//!   new holder's keys live longer: the read then shows them).
//! - **Announcements are bounded by what the nodes show**: anyone who may `PUBLISH` on a node
//!   can send them. An announcement that is not news changes nothing, and the waiter count
//!   it carries is never taken (counts come from `PUBSUB NUMSUB`). Until a read or a round shows
//!   an announced holder on a quorum, later announcements name the holder but stand nothing
//!   down; a read that shows another holder, or the lock free, forgets it (and its token), and
//!   if nothing had confirmed it, no announcement is taken until the next round, which then
//!   runs whatever is announced. So a standby still reads at the key's own expiry, false
//!   announcements put a round off by at most about one longest ttl, and a forged token never
//!   outlives the next read or round that contradicts it.
//! - **Keyspace events** (opt-in), where a node publishes them: a write to the key (`set`,
//!   `expire`, a renewal) marks the node held for the longest ttl from the event, but never
//!   past three longest ttls after the last read or round (events can be forged too); `del`,
//!   `expired` or `evicted` marks it free. Events that never come cost nothing: the read at the
//!   deadline still happens.
//! - **No push, then polling.** While no node has a live subscription, the nodes are read at
//!   least every `poll_every`.
//! - **Many waiters take turns.** With more than [`READERS`] waiters, a standby reads at a
//!   deadline only by a draw of chance `READERS / waiters` and skips it otherwise (its keys are
//!   taken for renewed, at the pace of its last read); a read so drawn is followed by one read
//!   at the deadline it shows, so whoever saw the holder's last renewal also reads when that
//!   key expires. About `2 × READERS` standbys' worth of reads reach a node, whatever the
//!   number of waiters; acquisitions still reach every standby by push, releases the watchers. Reads
//!   made for want of push, of unknown nodes, and with fewer waiters are never skipped. A
//!   standby that takes turns counts the waiters again before a deadline once its count is
//!   half a longest ttl old (one `PUBSUB NUMSUB` on one node, about one per deadline in place
//!   of a read of every node; with fewer waiters every three ttls): a crowd that has left
//!   silences its reads for about a ttl, not for as long as the crowd was large.

use std::time::Duration;

use super::timing::CLOCK_DRIFT_FLOOR;
use crate::clock::Deadline;

/// How long one waiter's share of a release wake-up is: the spread of the waiters' rounds
/// grows by this much per waiter, so the first starts within about one slot.
pub const SPREAD_SLOT: Duration = Duration::from_micros(250);

/// The longest spread of the rounds after one release.
pub const SPREAD_MAX: Duration = Duration::from_millis(250);

/// Up to this many waiters, every standby reads at every deadline; beyond, they take turns
/// (about this many standbys' worth of drawn reads, each followed by one at its key's expiry).
///
/// Whoever read in the ttl before a crash reads at the key's expiry: with this many drawn
/// readers per read interval, the chance that none did is below e^-40.
pub const READERS: u64 = 50;

/// Whether a contender subscribes to a node's release announcements (`watching`: it does
/// now), given how many subscribers the node's release channel has (`PUBSUB NUMSUB`; 0 when
/// the count failed), on subscribing and at each count of the waiters: below [`READERS`] it
/// does; above (many contenders that started at once) one that does stays with chance
/// `READERS / watchers` (`draw` in [0, 1]), so about [`READERS`] remain.
///
/// So a release wakes about [`READERS`] waiters per node, not all of them (the node writes
/// one message per subscriber and the waiters' hosts take each in), the first round still
/// starts within about one [`SPREAD_SLOT`], and the others learn of the new holder from its
/// acquisition announcement (or, should no watcher take over, at their next read).
pub fn watches_releases(watching: bool, watchers: u64, draw: f64) -> bool {
    if watchers < READERS {
        true
    } else if watching && watchers > READERS {
        draw * (watchers as f64) < READERS as f64
    } else {
        watching
    }
}

/// When a contender that watches releases on a node counts that channel's subscribers
/// again (see [`watches_releases`]): once between a half and one and a half `ttl` after it
/// subscribed (`first`; many that started at once thin out then), and afterwards, while they
/// were [`READERS`] or more, three times as rarely; `draw` in [0, 1] spreads them.
pub fn release_recheck_in(ttl: Duration, first: bool, draw: f64) -> Duration {
    let every = if first {
        ttl
    } else {
        ttl.saturating_mul(RECOUNT_EVERY_TTLS)
    };
    every.mul_f64(0.5 + draw.clamp(0.0, 1.0))
}

/// How often, in ttls, a standby counts the waiters again (a fleet may grow without any
/// announcement), with up to [`READERS`] waiters; taking turns, it counts at about every
/// deadline (see [`Standby::recount_due`]).
const RECOUNT_EVERY_TTLS: u32 = 3;

/// For how many longest ttls after the last read or round keyspace events alone may put the
/// next read off: anyone who may `PUBLISH` can send them.
const EVENTS_TRUSTED_TTLS: u32 = 3;

/// What a standby knows of the lock key on one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Key {
    /// Not known: read it.
    Unknown,
    /// No key.
    Free,
    /// A key that lives at least until then (and is taken for held until read again).
    Held(Deadline),
}

/// A keyspace event on the lock key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyEvent {
    /// Written or renewed (`set`, `expire`, ...).
    Written,
    /// Gone (`del`, `expired`, `evicted`).
    Gone,
}

/// What to do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Run a full acquire round.
    Round,
    /// Read every node (`GET` + `PTTL`); `fallback` when a subscription is missing.
    Read {
        /// Whether the read is made because push is missing.
        fallback: bool,
    },
    /// Leave this deadline's read to other waiters: call [`Standby::skip`].
    Skip,
    /// Wait for the instant returned (if any) or the next event.
    Wait,
}

/// Whether the standby reads at its next deadline (with many waiters, see [`READERS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Turn {
    /// Read: drawn, or too few waiters to take turns.
    Read,
    /// Read: it follows a drawn read, to see the key it showed expire.
    Follow,
    /// Skip.
    Skip,
}

/// How far acquisition announcements are taken: they come from anyone who may `PUBLISH` on
/// the nodes, so what they may put off is bounded by what the nodes show.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Trust {
    /// No announcement that stood the standby down waits for the nodes to confirm it: the next
    /// one may stand it down.
    Open,
    /// An announcement stood the standby down and no read or round has shown its holder yet:
    /// later ones still name the holder, but stand nothing down.
    Pending,
    /// The nodes contradicted an announcement before confirming it: until the next round,
    /// announcements change nothing.
    Doubted,
}

/// The holder as announced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Announced {
    /// The holder's identity.
    pub identity: String,
    /// Its fencing token.
    pub fencing_token: u64,
}

/// The standby's knowledge of one lock.
#[derive(Clone, Debug)]
pub struct Standby {
    quorum: usize,
    keys: Vec<Key>,
    subscribed: Vec<bool>,
    /// Per node: whether a subscription was ever live (one that comes up again is a resubscription).
    ever_subscribed: Vec<bool>,
    /// A subscription came back: the next read is made for want of push.
    resubscribed: bool,
    /// A round scheduled by a release announcement.
    round_at: Option<Deadline>,
    /// The holder last announced, until the nodes show another or none.
    holder: Option<Announced>,
    /// Whom a quorum of the nodes showed holding the key at the last read or round.
    on_nodes: Option<String>,
    /// The fencing counter the last round saw on the nodes: an announced token at or below it
    /// is old news.
    fence: u64,
    trust: Trust,
    /// Who released last, until a round shows the lock again: an acquisition announcement of
    /// theirs that arrives after their release is stale (it would stand the waiters down for
    /// a validity that the release already ended).
    released_by: Option<String>,
    /// The number of waiters last counted on a node (`PUBSUB NUMSUB`).
    waiters: u64,
    /// The subscribers of a node's release channel, last counted: those a release wakes.
    release_watchers: Option<u64>,
    /// When the waiters were last counted (or the count was tried).
    counted_at: Option<Deadline>,
    longest_ttl: Duration,
    poll_every: Duration,
    last_read: Option<Deadline>,
    /// The last read or busy round: what the nodes themselves showed.
    checked_at: Option<Deadline>,
    /// Whether the next deadline's read is made or skipped.
    turn: Turn,
    /// The last read or skip: a skip keeps the pace of the reads before it.
    paced_from: Option<Deadline>,
}

impl Standby {
    /// A standby of a lock on `nodes` nodes that knows nothing yet.
    pub fn new(nodes: usize, quorum: usize, longest_ttl: Duration, poll_every: Duration) -> Self {
        Standby {
            quorum,
            keys: vec![Key::Unknown; nodes],
            subscribed: vec![false; nodes],
            ever_subscribed: vec![false; nodes],
            resubscribed: false,
            round_at: None,
            holder: None,
            on_nodes: None,
            fence: 0,
            trust: Trust::Open,
            released_by: None,
            waiters: 1,
            release_watchers: None,
            counted_at: None,
            longest_ttl,
            poll_every,
            last_read: None,
            checked_at: None,
            turn: Turn::Read,
            paced_from: None,
        }
    }

    /// What to do at `now`, and until when to wait if nothing happens.
    pub fn next(&self, now: Deadline) -> (Action, Option<Deadline>) {
        if let Some(at) = self.round_at {
            return if now >= at {
                (Action::Round, None)
            } else {
                (Action::Wait, Some(at))
            };
        }
        let fallback = !self.subscribed.iter().any(|s| *s);
        if self.keys.contains(&Key::Unknown) {
            let fallback = fallback || self.resubscribed;
            return (Action::Read { fallback }, None);
        }
        // A key is taken for gone only once a read or an event says so: until then it may
        // have been renewed.
        let mut until: Vec<Deadline> = self
            .keys
            .iter()
            .filter_map(|key| match key {
                Key::Held(until) => Some(*until),
                _ => None,
            })
            .collect();
        if until.len() < self.quorum {
            return (Action::Round, None);
        }
        until.sort();
        let mut deadline = until[until.len() - self.quorum] + CLOCK_DRIFT_FLOOR;
        if fallback {
            let poll = self.last_read.map_or(now, |at| at + self.poll_every);
            deadline = deadline.min(poll);
        }
        if now >= deadline {
            if !fallback && self.turn == Turn::Skip && self.takes_turns() {
                return (Action::Skip, None);
            }
            (Action::Read { fallback }, None)
        } else {
            (Action::Wait, Some(deadline))
        }
    }

    /// A round found the lock held by `holder` (on the most nodes): `held` lists the nodes that
    /// showed another holder's key, which lives at least `holder_ttl` from `started` (the
    /// shortest seen), and `fence` is the highest fencing counter the nodes reported. The other
    /// nodes are read before anything is decided. What the round saw replaces what was
    /// announced.
    pub fn round_busy(
        &mut self,
        started: Deadline,
        held: &[bool],
        holder_ttl: Option<Duration>,
        holder: Option<&str>,
        fence: u64,
    ) {
        self.round_at = None;
        self.checked_at = Some(started);
        self.released_by = None;
        self.holder = None;
        self.on_nodes = holder.map(str::to_owned);
        self.fence = fence;
        self.trust = Trust::Open;
        for (key, held) in self.keys.iter_mut().zip(held) {
            *key = match (held, holder_ttl) {
                (true, Some(ttl)) => Key::Held(started + ttl),
                _ => Key::Unknown,
            };
        }
    }

    /// Node `index` was read, starting at `started`: `Ok(Some(pttl))` a key living that much
    /// longer, `Ok(None)` no key, `Err(())` no answer.
    pub fn read(&mut self, started: Deadline, index: usize, answer: Result<Option<Duration>, ()>) {
        self.last_read = Some(started);
        self.checked_at = Some(started);
        self.paced_from = Some(started);
        self.resubscribed = false;
        if let Some(key) = self.keys.get_mut(index) {
            *key = match answer {
                Ok(Some(pttl)) => Key::Held(started + pttl),
                Ok(None) => Key::Free,
                // Not known: read again later, and until then no round on its account.
                Err(()) => Key::Held(started + self.poll_every),
            };
        }
    }

    /// Every node was read (see [`Standby::read`]), and a quorum of them showed `holder`'s key
    /// (`None`: no one's). That confirms an announced holder, or contradicts it: then it is
    /// forgotten (its token too), and if no read or round had confirmed it yet, announcements
    /// are not taken until the next round.
    pub fn shown(&mut self, holder: Option<&str>) {
        let free = self.keys.iter().filter(|key| **key == Key::Free).count() >= self.quorum;
        if holder.is_some() || free {
            self.on_nodes = holder.map(str::to_owned);
        }
        let Some(announced) = &self.holder else {
            return;
        };
        if holder == Some(announced.identity.as_str()) {
            if self.trust == Trust::Pending {
                self.trust = Trust::Open;
            }
        } else if holder.is_some() || free {
            self.holder = None;
            if self.trust == Trust::Pending {
                self.trust = Trust::Doubted;
            }
        }
    }

    /// A release by `identity` was announced by node `index`; `jitter` in [0, 1] picks the
    /// moment of the round within the spread. Returns false if the announcement is stale: the
    /// holder is known (announced, or shown by the nodes) and is someone else.
    pub fn released(&mut self, now: Deadline, index: usize, identity: &str, jitter: f64) -> bool {
        let announced = self.holder.as_ref().map(|h| h.identity.as_str());
        let known = [announced, self.on_nodes.as_deref()];
        if known.iter().any(Option::is_some) && !known.contains(&Some(identity)) {
            return false;
        }
        if let Some(key) = self.keys.get_mut(index) {
            *key = Key::Free;
        }
        // Those who subscribe to releases hear it (every waiter, up to `READERS`).
        let woken = self.release_watchers.unwrap_or(self.waiters);
        self.schedule_round(now, jitter, woken);
        self.holder = None;
        if self.on_nodes.as_deref() == Some(identity) {
            self.on_nodes = None;
        }
        self.released_by = Some(identity.to_owned());
        true
    }

    /// Schedules a round within the spread of `waking` waiters, unless one is scheduled already.
    /// The count includes this standby, so the spread is over the others: a lone waiter starts
    /// at once.
    fn schedule_round(&mut self, now: Deadline, jitter: f64, waking: u64) {
        let others = u32::try_from(waking.saturating_sub(1)).unwrap_or(u32::MAX);
        let spread = (SPREAD_SLOT * others).min(SPREAD_MAX);
        let at = now + spread.mul_f64(jitter.clamp(0.0, 1.0));
        // Every node announces the same release: the first copy decides.
        self.round_at.get_or_insert(at);
    }

    /// Called after reads or events: if they show that fewer than a quorum of nodes may
    /// still hold a key, a round is scheduled within the spread of the waiters that saw the
    /// same (`pushed`: every waiter heard it; otherwise only those whose turn it was to read),
    /// and the first winner's announcement stands the others down.
    pub fn settle(&mut self, now: Deadline, jitter: f64, pushed: bool) {
        let held = self
            .keys
            .iter()
            .filter(|key| matches!(key, Key::Held(_)))
            .count();
        if self.round_at.is_none() && !self.keys.contains(&Key::Unknown) && held < self.quorum {
            let waking = if pushed {
                self.waiters
            } else {
                self.waiters.min(2 * READERS)
            };
            self.schedule_round(now, jitter, waking);
        }
    }

    /// The nodes were read: `draw` in [0, 1] decides whether the next deadline's read is this
    /// standby's turn (see [`READERS`]); a drawn read is followed by one regardless.
    pub fn turn_taken(&mut self, draw: f64) {
        self.turn = match self.turn {
            Turn::Read if self.takes_turns() => Turn::Follow,
            _ => self.draw_turn(draw),
        };
    }

    /// The deadline's read was left to others: the keys are taken for renewed at the pace of
    /// the last read (at least `poll_every`), and the next turn is drawn with `draw` in [0, 1].
    pub fn skip(&mut self, now: Deadline, draw: f64) {
        let pace = self
            .paced_from
            .map_or(self.poll_every, |from| now.saturating_duration_since(from))
            .max(self.poll_every);
        self.paced_from = Some(now);
        for key in &mut self.keys {
            if let Key::Held(until) = key {
                *key = Key::Held(*until + pace);
            }
        }
        self.turn = self.draw_turn(draw);
    }

    /// Whether there are more waiters than [`READERS`]: then they take turns reading.
    fn takes_turns(&self) -> bool {
        self.waiters > READERS
    }

    fn draw_turn(&self, draw: f64) -> Turn {
        if !self.takes_turns() || draw * (self.waiters as f64) < READERS as f64 {
            Turn::Read
        } else {
            Turn::Skip
        }
    }

    /// An acquisition was announced; `validity` is what it claims. Returns true if it is news:
    /// a fencing token above the last one announced and above the counter the last round saw,
    /// while the nodes have not contradicted an unconfirmed announcement (see [`Standby::shown`]).
    ///
    /// News names the holder. While no other announcement waits for the nodes to confirm it,
    /// it also stands the standby down: a scheduled round is cancelled, and the nodes read
    /// free are taken for held until the claimed validity ends, at most the longest ttl from
    /// now; a key whose expiry was read is never taken for living longer than that. So
    /// whatever it is told, a standby still reads at the key's own expiry, and a false
    /// announcement puts a round off by at most one ttl.
    pub fn acquired(&mut self, now: Deadline, announced: Announced, validity: Duration) -> bool {
        let known = self
            .holder
            .as_ref()
            .map_or(self.fence, |h| h.fencing_token.max(self.fence));
        // A late copy of the releaser's own announcement; if they really hold the lock again,
        // the round still to come finds it so.
        let released = self.released_by.as_deref() == Some(announced.identity.as_str());
        if self.trust == Trust::Doubted || announced.fencing_token <= known || released {
            return false;
        }
        self.released_by = None;
        self.holder = Some(announced);
        if self.trust == Trust::Pending {
            return true;
        }
        self.trust = Trust::Pending;
        self.round_at = None;
        let until = now + validity.min(self.longest_ttl);
        for key in &mut self.keys {
            *key = match *key {
                Key::Free => Key::Held(until),
                Key::Held(read) => Key::Held(read.min(until)),
                Key::Unknown => Key::Unknown,
            };
        }
        true
    }

    /// A keyspace event on node `index`'s lock key.
    pub fn key_event(&mut self, now: Deadline, index: usize, event: KeyEvent) {
        // The write happened before we heard of it and set at most the longest ttl: the key
        // expires by then (a node clock that runs slow only makes the read early, which is
        // harmless: it reads the key again). Events can be forged: they never put the read
        // off for more than a few ttls after what the nodes last showed.
        let trusted_until = self.checked_at.map_or(now, |at| {
            at + self.longest_ttl.saturating_mul(EVENTS_TRUSTED_TTLS)
        });
        if let Some(key) = self.keys.get_mut(index) {
            *key = match event {
                KeyEvent::Written => Key::Held((now + self.longest_ttl).min(trusted_until)),
                KeyEvent::Gone => Key::Free,
            };
        }
    }

    /// Node `index`'s subscription came up or went away. One that comes up may have missed
    /// events: the node is read again.
    pub fn subscription(&mut self, index: usize, up: bool) {
        let Some(was) = self.subscribed.get_mut(index) else {
            return;
        };
        if up && !*was {
            self.keys[index] = Key::Unknown;
            self.resubscribed |= self.ever_subscribed[index];
            self.ever_subscribed[index] = true;
        }
        *was = up;
    }

    /// Every subscription may have missed events (a lagging receiver): read every node.
    pub fn forget(&mut self) {
        self.keys.iter_mut().for_each(|key| *key = Key::Unknown);
    }

    /// The number of waiters, as counted at `now` on a node (`PUBSUB NUMSUB`); 0 (no answer)
    /// keeps the last count, and the count is tried again later.
    pub fn set_waiters(&mut self, now: Deadline, waiters: u64) {
        self.counted_at = Some(now);
        if waiters > 0 {
            self.waiters = waiters;
        }
    }

    /// The subscribers of a node's release channel, counted with the waiters (0: no answer).
    pub fn set_release_watchers(&mut self, watchers: u64) {
        if watchers > 0 {
            self.release_watchers = Some(watchers);
        }
    }

    /// Whether to count the waiters again before a read or a skip: every three of the longest
    /// ttl, and while the count says to take turns, once it is half a ttl old (so about at
    /// every deadline). A count is what one node showed at one moment: a crowd that has left
    /// since must not silence this standby's reads for longer than about a ttl.
    pub fn recount_due(&self, now: Deadline) -> bool {
        let every = if self.takes_turns() {
            self.longest_ttl / 2
        } else {
            self.longest_ttl.saturating_mul(RECOUNT_EVERY_TTLS)
        };
        self.counted_at
            .is_none_or(|at| now.saturating_duration_since(at) >= every)
    }

    /// The longest ttl any contender uses, as learnt since.
    pub fn set_longest_ttl(&mut self, ttl: Duration) {
        self.longest_ttl = self.longest_ttl.max(ttl);
    }
}

/// Parses a keyspace event name.
pub fn key_event(name: &str) -> Option<KeyEvent> {
    match name {
        "del" | "expired" | "evicted" | "unlink" => Some(KeyEvent::Gone),
        "set" | "expire" | "persist" | "rename_to" | "restore" => Some(KeyEvent::Written),
        _ => None,
    }
}

#[cfg(test)]
mod tests;

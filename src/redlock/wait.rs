//! Waiting for the lock: rounds, and between them a watch of the holder or a pause.
//!
//! ## Behaviour
//! - Each round starts the contender's handicap late, if it has one (a `run` sidecar that
//!   defers to a preferred candidate, see `candidacy`).
//! - A round that showed the lock held is not followed by another until the lock may be free:
//!   the wait watches (see `standby`) until reads, a keyspace event or an announcement say so.
//! - A round that failed otherwise is retried after a random, growing pause (at once, spread
//!   out, when a holder announces a release); a round that a quorum would win once young
//!   nodes count is retried when they do (see `round::retry`).
//! - A wait with a deadline retries, for up to one ttl past it, rounds that said nothing about
//!   a holder: a split among contenders, a round left short of a quorum by timeouts or
//!   connection errors (a busy host, not an outage), and a round too slow to leave any
//!   validity. Rounds that showed a holder, or failures a retry cannot mend (a wrong
//!   password, votes that do not count), end the wait at its deadline. Votes that count soon
//!   are waited for past it (never longer than the longest ttl plus drift).

use std::sync::atomic::Ordering;
use std::time::Duration;

use rand::Rng;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::push::{Push, PushKind};
use super::round::retry::{retry_until, Backoff};
use super::standby::{Action, Announced, Standby, SPREAD_SLOT};
use super::{quorum, Lease, LockError, Redlock, Vote};
use crate::clock::{self, Clock, Deadline};

/// Subscribers of a lock's channels on one node (0: not counted).
#[derive(Clone, Copy, Debug, Default)]
struct Counted {
    /// Of the acquisition channel: every contender that waits (and the holder).
    waiters: u64,
    /// Of the release channel: those a release wakes.
    watchers: u64,
}

impl Counted {
    fn apply_to(self, standby: &mut Standby, now: Deadline) {
        standby.set_waiters(now, self.waiters);
        standby.set_release_watchers(self.watchers);
    }
}

/// What a wait keeps between rounds.
struct Waiting {
    pushes: broadcast::Receiver<Push>,
    standby: Standby,
    backoff: Backoff,
    waited_for_trust: bool,
    counted_waiters: bool,
}

impl Redlock {
    /// Waits for the lock: retries with growing random delays, and at once when a
    /// holder announces a release, until `deadline` (then the last error) or `cancel`.
    ///
    /// `on_attempt` sees every round's outcome and duration (to publish who holds the lock).
    pub async fn acquire(
        &self,
        deadline: Option<Deadline>,
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
        deadline: Option<Deadline>,
        cancel: &CancellationToken,
        mut on_attempt: impl FnMut(&Result<Lease, LockError>, Duration),
        mut on_holder: impl FnMut(Option<HolderSeen>),
    ) -> Result<Lease, LockError> {
        self.listen_for_releases();
        let cfg = &self.inner.cfg;
        let mut waiting = Waiting {
            pushes: self.inner.pushes().subscribe(),
            standby: Standby::new(
                self.inner.nodes.len(),
                quorum(self.inner.nodes.len()),
                self.known_longest_ttl(),
                cfg.retry_max,
            ),
            backoff: Backoff {
                base: cfg.retry_delay,
                max: cfg.retry_max,
                attempt: 0,
            },
            waited_for_trust: false,
            counted_waiters: false,
        };
        loop {
            // A contender that defers to a preferred one lets that one's round come first.
            let handicap = self.handicap();
            if !handicap.is_zero() {
                tokio::select! {
                    biased;
                    _ = cancel.cancelled() => return Err(LockError::Cancelled),
                    _ = clock::pause(handicap) => {}
                }
            }
            // A started round is never abandoned half-way: it is short (node timeout) and
            // dropping it could leave keys behind until their ttl.
            let started = Deadline::now();
            let result = self.try_acquire().await;
            on_attempt(&result, Deadline::now() - started);
            let err = match result {
                Ok(lease) => return Ok(lease),
                Err(err) => err,
            };
            let next = if matches!(err, LockError::Busy { .. }) {
                self.watch_held(
                    &mut waiting,
                    &err,
                    started,
                    deadline,
                    cancel,
                    &mut on_holder,
                )
                .await
            } else {
                self.pause_before_retry(&mut waiting, &err, started, deadline, cancel)
                    .await
            };
            match next {
                Watched::Round => {}
                Watched::Cancelled => return Err(LockError::Cancelled),
                Watched::Deadline => return Err(err),
            }
        }
    }

    /// After a round that showed the lock held (`err` is `Busy`): watch instead of asking
    /// again (see `standby`) until the lock may be free.
    async fn watch_held(
        &self,
        waiting: &mut Waiting,
        err: &LockError,
        started: Deadline,
        deadline: Option<Deadline>,
        cancel: &CancellationToken,
        on_holder: &mut impl FnMut(Option<HolderSeen>),
    ) -> Watched {
        let LockError::Busy {
            holder,
            holder_ttl,
            holder_fence,
            votes,
            ..
        } = err
        else {
            return Watched::Round;
        };
        let held: Vec<bool> =
            self.inner
                .nodes
                .iter()
                .map(|node| {
                    votes.0.iter().any(|(label, vote)| {
                        label == node.label() && matches!(vote, Vote::HeldBy(_))
                    })
                })
                .collect();
        let standby = &mut waiting.standby;
        standby.set_longest_ttl(self.known_longest_ttl());
        if !waiting.counted_waiters {
            // Once: how many wait with us, so a release does not wake them all at once.
            waiting.counted_waiters = true;
            let counted = self.count_waiters().await;
            counted.apply_to(standby, Deadline::now());
        }
        standby.round_busy(
            started,
            &held,
            *holder_ttl,
            holder.as_deref(),
            *holder_fence,
        );
        let watched = self
            .watch(standby, &mut waiting.pushes, deadline, cancel, on_holder)
            .await;
        if matches!(watched, Watched::Round) {
            waiting.backoff.reset();
        }
        watched
    }

    /// After a round that failed otherwise: sleep as the backoff says (bounded by how long
    /// the wait retries `err`), or until a holder announces a release.
    async fn pause_before_retry(
        &self,
        waiting: &mut Waiting,
        err: &LockError,
        round: Deadline,
        deadline: Option<Deadline>,
        cancel: &CancellationToken,
    ) -> Watched {
        let cfg = &self.inner.cfg;
        if let LockError::NotYetTrusted { ready_in, .. } = err {
            if !waiting.waited_for_trust {
                waiting.waited_for_trust = true;
                info!(lock = %cfg.lock, wait = ?ready_in, error = %err, "waiting for nodes whose votes count once they have kept their data for ttl + drift");
            }
        }
        let mut delay = waiting
            .backoff
            .delay_after(err, rand::rng().random_range(0.0..=1.0));
        if let Some(deadline) = deadline {
            let next = round + delay;
            let until = retry_until(err, deadline, cfg.ttl, next);
            let left = until.saturating_duration_since(Deadline::now());
            if left.is_zero() {
                return Watched::Deadline;
            }
            delay = delay.min(left);
        }
        // A pause, not a deadline: on Tokio's timer, which is cheap with hundreds of waiters
        // (a timerfd per pause cost the 400-waiter test its holder's renewals); a suspend
        // only makes it longer.
        let sleep = clock::pause(delay);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return Watched::Cancelled,
                push = waiting.pushes.recv() => {
                    // A release: retry after a pause that spreads the waiters out.
                    if let Ok(Push { kind: PushKind::Released(_), .. }) = push {
                        let spread = SPREAD_SLOT.mul_f64(rand::rng().random_range(0.0..=1.0));
                        clock::pause(spread).await;
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
        waiting.backoff.next();
        Watched::Round
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
    pub(super) fn known_longest_ttl(&self) -> Duration {
        let seen = Duration::from_millis(self.inner.max_ttl_seen.load(Ordering::Relaxed));
        self.inner.cfg.longest_ttl().max(seen)
    }

    /// Carries out what `standby` decides until it calls for a round (or `deadline`, or
    /// `cancel`): waits, reads the nodes, and takes in what they push.
    async fn watch(
        &self,
        standby: &mut Standby,
        pushes: &mut broadcast::Receiver<Push>,
        deadline: Option<Deadline>,
        cancel: &CancellationToken,
        on_holder: &mut impl FnMut(Option<HolderSeen>),
    ) -> Watched {
        let mut subscribed = self.inner.subscribed.subscribe();
        loop {
            if deadline.is_some_and(|d| Deadline::now() >= d) {
                return Watched::Deadline;
            }
            for (index, up) in subscribed.borrow_and_update().iter().enumerate() {
                standby.subscription(index, *up);
            }
            // Re-read after anything that can move it.
            let now = Deadline::now();
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
                    self.read_for_standby(standby, on_holder).await;
                    continue;
                }
                Action::Skip => {
                    self.inner.observer.standby_read_skipped();
                    standby.skip(now, rand::rng().random_range(0.0..=1.0));
                    continue;
                }
                Action::Wait => {}
            }
            let wake = [at, deadline].into_iter().flatten().min();
            let sleep = Clock::Boot.sleep_until_some(wake);
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

    /// Reads the key on every node for `standby`, and tells `on_holder` of a holder a quorum
    /// shows.
    async fn read_for_standby(
        &self,
        standby: &mut Standby,
        on_holder: &mut impl FnMut(Option<HolderSeen>),
    ) {
        let started = Deadline::now();
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
        standby.settle(Deadline::now(), rng.random_range(0.0..=1.0), false);
        if let Some(identity) = shown {
            on_holder(Some(HolderSeen {
                identity: identity.to_owned(),
                fencing_token: None,
            }));
        }
    }

    /// Takes one push into `standby`, and tells `on_holder` of a new holder or a release.
    fn take_push(
        &self,
        standby: &mut Standby,
        push: Push,
        on_holder: &mut impl FnMut(Option<HolderSeen>),
    ) {
        let now = Deadline::now();
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

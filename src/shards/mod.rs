//! `run --shards N`: the sidecars of one lock split N shards among themselves, each shard a
//! quorum lock of its own (`LOCK/shard/I`) with its own fencing token, with no coordinator.
//!
//! ## Behaviour
//! - **A cycle** every renew interval, and at once (at most every [`MIN_CYCLE_GAP`]) when the
//!   group's channel says a member joined, left or released shards, or while the member is
//!   under its share or shards it read stay free (see [`next_cycle_after`]): the member announces itself
//!   and reads the members and every shard's owner (`view`), works out who the shards are split
//!   among (`plan`), and carries out the core planner's moves (`redlock_core::shards::decide`):
//!   it releases only its excess, and tries only free shards, up to its share.
//! - **Holding** (`held`): every held shard is a lease of the process' one engine, renewed
//!   together (one batch per node, beside the loop) and dropped, with no I/O, at its lease
//!   machine's step-down instant when renewals fail.
//! - **Leaving**: at shutdown every held shard is released and the member's entry removed,
//!   both announced, so the others take the shards within a cycle run at once.
//! - The app reads its shards from `GET /v1/shards` on the control listener.

pub mod api;
pub mod held;
pub mod plan;
pub mod view;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::candidacy::CandidacyRx;
use crate::clock::{self, Clock, Deadline};
use crate::config::Renewal;
use crate::metrics::Metrics;
use crate::redlock::{Engine, Redlock};
use redlock_core::shards::decide;

use api::AppSide;
pub use held::Owned;
use held::{Held, Released};
use view::{Announce, Member};

/// The least time between two cycles that the group's channel or lost races start.
pub const MIN_CYCLE_GAP: Duration = Duration::from_millis(20);

/// The most shards one cycle tries to take (the next cycle follows at once).
const TAKE_PER_CYCLE: usize = 256;

/// What the app reads: the group and this member's shards.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// The shard count this member was started with.
    pub count: u32,
    /// The live members the last cycle read: identity and readiness.
    pub members: Vec<(String, bool)>,
    /// The shards this member holds.
    pub owned: BTreeMap<u32, Owned>,
    /// Why this member takes no part, if it does not.
    pub refused: Option<String>,
}

/// The receiving end of the snapshots.
pub type ShardsRx = watch::Receiver<Snapshot>;

/// What the group's loop needs.
pub struct Group {
    pub engine: Engine,
    /// The app's side: its watch streams and acknowledgements.
    pub app: Arc<AppSide>,
    /// How long a revoked shard waits for the app's acknowledgement (while it acknowledges).
    pub revoke_timeout: Duration,
    /// The group's lock (the leadership lock): its name, identity and nodes.
    pub redlock: Redlock,
    pub count: u32,
    pub renewal: Renewal,
    /// The app's readiness.
    pub candidacy: CandidacyRx,
    pub born_ms: u64,
    pub metrics: Arc<Metrics>,
    pub cancel: CancellationToken,
}

/// A channel for the snapshots, empty until the first cycle.
pub fn channel(count: u32) -> (watch::Sender<Snapshot>, ShardsRx) {
    watch::channel(Snapshot {
        count,
        ..Snapshot::default()
    })
}

/// Runs the member until `cancel`, then leaves the group (releases every shard, removes its
/// entry).
pub async fn run(group: Group, tx: watch::Sender<Snapshot>) {
    let cfg = group.redlock.config().clone();
    let mut held = Held::new(group.engine.clone(), cfg.clone(), &group.renewal);
    let wake = Arc::new(Notify::new());
    for index in 0..group.redlock.nodes().len() {
        tokio::spawn(listen(
            group.redlock.clone(),
            index,
            wake.clone(),
            group.cancel.clone(),
        ));
    }
    let mut next_cycle = Deadline::now();
    let mut last_cycle = Deadline::now();
    let mut seen = Seen::default();
    let keys = view::Keys::new(&cfg.lock, group.count);
    // Cycles in a row that asked for the next one soon.
    let mut soon: u32 = 0;
    let mut renewing = None;
    loop {
        let now = Deadline::now();
        let lost = held.step_down_due(now);
        if !lost.is_empty() {
            group.metrics.shards().moved("lost", lost.len());
            publish_owned(&tx, &held);
        }
        let revoked = revoked(&group, &mut held, now);
        if !revoked.is_empty() {
            give_up(&group, &held, &tx, revoked).await;
        }
        // A renewal may wait in the engine's batch (a sixth of the ttl): the loop goes on.
        if renewing.is_none() {
            renewing = held.renewal(now);
        }
        if Deadline::now() >= next_cycle {
            last_cycle = Deadline::now();
            let more = cycle(&group, &mut held, &tx, false, &mut seen, &keys).await;
            soon = if more { soon + 1 } else { 0 };
            next_cycle = last_cycle + next_cycle_after(soon, group.renewal.interval);
        }
        publish_owned(&tx, &held);
        group.metrics.shards().owned(held.count());
        // While a renewal runs, only the step-downs and releases are due (its result wakes
        // the loop).
        let due = match renewing {
            Some(_) => held.next_step_down(),
            None => held.next_due(),
        };
        let wake_at = due.map_or(next_cycle, |due| due.min(next_cycle));
        tokio::select! {
            biased;
            () = group.cancel.cancelled() => break,
            // The branch runs only while a renewal is (its precondition), so `expect` holds.
            renewal = async { renewing.as_mut().expect("running").await }, if renewing.is_some() => {
                renewing = None;
                held.apply(renewal);
            }
            () = group.app.acked() => {}
            () = wake.notified() => {
                next_cycle = next_cycle.min(last_cycle + MIN_CYCLE_GAP);
            }
            () = Clock::Boot.sleep_until(wake_at) => {}
        }
    }
    leave(&group, &mut held, &tx).await;
    cycle(&group, &mut held, &tx, true, &mut seen, &keys).await;
}

/// Revokes every held shard, and releases each once the app acknowledged it or its deadline
/// came (at once when no app watches).
async fn leave(group: &Group, held: &mut Held, tx: &watch::Sender<Snapshot>) {
    held.revoke(&held.ids(), revoke_by(group));
    publish_owned(tx, held);
    loop {
        let revoked = revoked(group, held, Deadline::now());
        if !revoked.is_empty() {
            give_up(group, held, tx, revoked).await;
        }
        let Some(next) = held.next_revoke() else {
            break;
        };
        tokio::select! {
            () = group.app.acked() => {}
            () = Clock::Boot.sleep_until(next) => {}
        }
    }
    group.metrics.shards().owned(0);
}

/// The revoked shards to release at `now`: those the app acknowledged, those past their
/// deadline, and all once no stream that acknowledges is open (their acknowledgements will
/// not come).
fn revoked(group: &Group, held: &mut Held, now: Deadline) -> Released {
    held.revoked(now, &group.app.take_acks(), group.app.acknowledges())
}

/// When shards revoked now are released unless the app acknowledges them sooner: only an app
/// that said it acknowledges (a watch with `?ack=true`) is waited for.
fn revoke_by(group: &Group) -> Deadline {
    let now = Deadline::now();
    if group.app.acknowledges() {
        now + group.revoke_timeout
    } else {
        now
    }
}

/// Releases shards revoked from the app (which was told when they left its snapshot), and
/// tells the group they are free.
async fn give_up(group: &Group, held: &Held, tx: &watch::Sender<Snapshot>, revoked: Released) {
    publish_owned(tx, held);
    group.metrics.shards().moved("released", revoked.len());
    revoked.release().await;
    announce_changed(&group.redlock).await;
}

/// When the next cycle runs after one that asked for it soon `soon` times in a row (0: not):
/// at [`MIN_CYCLE_GAP`] for the first [`SOON_AT_ONCE`] (a hand-over's races settle within a
/// few), then doubling up to the renew interval, so a group that cannot settle (members
/// reading different views) backs off to one cycle per interval.
pub fn next_cycle_after(soon: u32, interval: Duration) -> Duration {
    if soon == 0 {
        return interval;
    }
    let doublings = soon.saturating_sub(SOON_AT_ONCE).min(16);
    MIN_CYCLE_GAP.saturating_mul(1 << doublings).min(interval)
}

/// Cycles in a row at [`MIN_CYCLE_GAP`] before they back off.
const SOON_AT_ONCE: u32 = 10;

/// One cycle (see the module docs); `leaving`: remove the entry and take nothing; `seen`: what
/// the cycles saw before, for the metrics; `keys`: the group's. Whether to run the next one
/// soon ([`next_cycle_after`]): the member is still under its share, or shards stay free.
async fn cycle(
    group: &Group,
    held: &mut Held,
    tx: &watch::Sender<Snapshot>,
    leaving: bool,
    seen: &mut Seen,
    keys: &view::Keys,
) -> bool {
    let cfg = group.redlock.config();
    let me = &cfg.identity;
    let mine = Member {
        ready: group.candidacy.borrow().app_ready(Deadline::now()),
        shards: group.count,
        born_ms: group.born_ms,
    };
    let announce = Announce {
        identity: me,
        member: &mine,
        leaving,
        life: view::member_life(group.renewal.interval),
    };
    let view = view::read(&group.redlock, keys, Some(announce)).await;
    let planned = match in_cluster_mode(&group.redlock) {
        Some(node) => Err(format!(
            "--shards does not support cluster mode: node {node} is a Redis Cluster, and the \
             shard locks hash to many slots, which one script cannot read; this member takes no \
             shard (use masters or Sentinel groups)"
        )),
        None => plan::members(&view, me, &mine),
    };
    tx.send_modify(|s| {
        s.members = view
            .members
            .iter()
            .map(|(id, m)| (id.clone(), m.ready))
            .collect();
        let refused = planned.as_ref().err().cloned();
        if refused.is_some() && refused != s.refused {
            warn!("{}", refused.as_deref().unwrap_or_default());
        }
        s.refused = refused;
    });
    if leaving || view.owners.is_empty() {
        return false;
    }
    let members = planned.unwrap_or_default();
    let owners = plan::owners(&view, me, |s| held.holds(s));
    let moves = decide(me, &members, &owners, |s| held.taken(s));
    seen.cycle(&group.metrics, &view, &members, &owners, &moves);
    // One revocation at a time: the next cycle decides again once it is over.
    if !held.revoking() && !moves.release.is_empty() {
        held.revoke(&moves.release, revoke_by(group));
        publish_owned(tx, held);
        let revoked = revoked(group, held, Deadline::now());
        if !revoked.is_empty() {
            give_up(group, held, tx, revoked).await;
        }
    }
    let take = &moves.take[..moves.take.len().min(TAKE_PER_CYCLE)];
    let taken = held.take(take).await;
    group.metrics.shards().moved("taken", taken.len());
    // Under its share still (shards left to try, races lost to others, shards unsettled when
    // read), or shards left free: the next cycle finds the rest.
    let share = moves.share;
    let held_now = held.count();
    debug!(
        members = members.len(),
        share,
        held = held_now,
        tried = take.len(),
        taken = taken.len(),
        released = moves.release.len(),
        "shards cycle"
    );
    // Members that read the group mid-move may each see the ceiling share go to another and
    // leave a shard free: the next cycle, on the counts as they are then, gives it to one.
    let free = owners.iter().filter(|o| o.is_none()).count();
    share.is_some_and(|share| held_now < share as usize) || free > taken.len()
}

/// What the cycles saw before, for the metrics: since when some shard has been free, and the
/// members of the last cycle and since when the group has been rebalancing.
#[derive(Debug, Default)]
struct Seen {
    unowned_since: Option<Deadline>,
    members: Vec<String>,
    rebalancing_since: Option<Deadline>,
}

impl Seen {
    /// Takes in a cycle's `view`, planned `members`, `owners` and `moves`.
    fn cycle(
        &mut self,
        metrics: &Metrics,
        view: &view::View,
        members: &[String],
        owners: &[Option<String>],
        moves: &redlock_core::shards::Moves,
    ) {
        let now = Deadline::now();
        let free = view
            .owners
            .iter()
            .filter(|o| **o == view::Owner::Free)
            .count();
        let (free_for, rebalanced) = self.update(now, free, members, settled(owners, moves));
        metrics.shards().unowned(free, free_for.as_secs_f64());
        if let Some(took) = rebalanced {
            metrics.shards().rebalanced(took.as_secs_f64());
        }
    }

    /// At `now`, with `free` shards free and `members`; `settled`: every shard owned and this
    /// member at its share. How long some shard has been free, and the length of a rebalance
    /// that just ended.
    fn update(
        &mut self,
        now: Deadline,
        free: usize,
        members: &[String],
        settled: bool,
    ) -> (Duration, Option<Duration>) {
        self.unowned_since = (free > 0).then(|| self.unowned_since.unwrap_or(now));
        let free_for = self
            .unowned_since
            .map_or(Duration::ZERO, |at| now.saturating_duration_since(at));
        if self.members != members {
            self.members = members.to_vec();
            self.rebalancing_since = self.rebalancing_since.or(Some(now));
        }
        let rebalanced = match self.rebalancing_since {
            Some(since) if settled => {
                self.rebalancing_since = None;
                Some(now.saturating_duration_since(since))
            }
            _ => None,
        };
        (free_for, rebalanced)
    }
}

/// Whether every shard is owned and this member, having nothing to move, is at its share.
fn settled(owners: &[Option<String>], moves: &redlock_core::shards::Moves) -> bool {
    owners.iter().all(Option::is_some) && moves.release.is_empty() && moves.take.is_empty()
}

/// Publishes the held shards.
fn publish_owned(tx: &watch::Sender<Snapshot>, held: &Held) {
    let owned = held.owned();
    tx.send_if_modified(|s| {
        let changed = s.owned != owned;
        s.owned = owned;
        changed
    });
}

/// The first node in cluster mode, by its label, as its last connection showed it.
fn in_cluster_mode(redlock: &Redlock) -> Option<String> {
    redlock.nodes().iter().find_map(|node| {
        let node = node.connection()?;
        node.facts()?.cluster.then(|| node.label().to_owned())
    })
}

/// Tells the group on every node that shards came free (each publish bounded by the node
/// timeout).
async fn announce_changed(redlock: &Redlock) {
    let cfg = redlock.config();
    let mut publish = redis::cmd("PUBLISH");
    publish.arg(view::channel(&cfg.lock)).arg(&cfg.identity);
    let calls = redlock
        .nodes()
        .iter()
        .map(|node| node.command::<i64>(&publish, cfg.node_timeout));
    futures_util::future::join_all(calls).await;
}

/// Wakes the loop whenever node `index` carries a message on the group's channel; subscribes
/// again after a pause when the subscription ends.
async fn listen(redlock: Redlock, index: usize, wake: Arc<Notify>, cancel: CancellationToken) {
    let cfg = redlock.config().clone();
    let channel = view::channel(&cfg.lock);
    while !cancel.is_cancelled() {
        let node = &redlock.nodes()[index];
        let subscribed = node
            .subscribe(&[channel.as_str()], None, None, cfg.connect_timeout)
            .await;
        if let Ok(mut messages) = subscribed {
            // A message may have been missed while not subscribed.
            wake.notify_one();
            loop {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    message = messages.next() => match message {
                        Some((_, from)) if from != cfg.identity => wake.notify_one(),
                        Some(_) => {}
                        None => break,
                    },
                }
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = clock::pause(cfg.retry_max) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rebalance_runs_from_a_change_of_members_to_a_settled_cycle_and_free_time_accrues() {
        let start = Deadline::now();
        let at = |ms| start + Duration::from_millis(ms);
        let (a, ab) = (vec!["a".to_owned()], vec!["a".to_owned(), "b".to_owned()]);
        let mut seen = Seen::default();
        // The first cycle's members are a change: settled at once, it took no time.
        assert_eq!(seen.update(at(0), 0, &a, true).1, Some(Duration::ZERO));
        assert_eq!(seen.update(at(10), 0, &a, true), (Duration::ZERO, None));
        // b joins; shards come free while they move; settled 300 ms after the change.
        assert_eq!(seen.update(at(100), 0, &ab, false).1, None);
        assert_eq!(seen.update(at(200), 3, &ab, false), (Duration::ZERO, None));
        assert_eq!(
            seen.update(at(350), 1, &ab, false),
            (Duration::from_millis(150), None)
        );
        let (free_for, took) = seen.update(at(400), 0, &ab, true);
        assert_eq!(free_for, Duration::ZERO);
        assert_eq!(took, Some(Duration::from_millis(300)));
        assert_eq!(seen.update(at(500), 0, &ab, true).1, None, "counted once");
    }

    #[test]
    fn cycles_that_ask_for_more_back_off_from_the_least_gap_to_the_renew_interval() {
        let interval = Duration::from_millis(667);
        let gaps: Vec<u64> = [0, 1, 10, 11, 12, 14, 15, 16]
            .into_iter()
            .map(|soon| next_cycle_after(soon, interval).as_millis() as u64)
            .collect();
        assert_eq!(gaps, [667, 20, 20, 40, 80, 320, 640, 667]);
        assert_eq!(next_cycle_after(u32::MAX, interval), interval);
    }
}

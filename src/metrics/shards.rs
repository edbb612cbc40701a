//! The shard families (`redlock_shards_*`, `run --shards`): no label per shard (a group may
//! split thousands), only small fixed sets.

use prometheus::{Gauge, Histogram, IntCounterVec, IntGauge};

use super::families::Names;

/// How a shard changed hands here (`redlock_shard_moves_total{kind}`).
pub const SHARD_MOVES: [&str; 3] = ["taken", "released", "lost"];

/// Rebalance buckets: a leave's hand-over (milliseconds) to a crashed member's leases running
/// out (a ttl) and a slow group's back-off.
const REBALANCE_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// The shard families.
#[derive(Clone)]
pub struct ShardMetrics {
    owned: IntGauge,
    unowned: IntGauge,
    unowned_for: Gauge,
    moves: IntCounterVec,
    rebalance: Histogram,
}

impl ShardMetrics {
    pub(super) fn new(names: &Names<'_>) -> ShardMetrics {
        // As in `families`, the `unwrap`s cannot fail at run time: the names and label names
        // are constants.
        let m = ShardMetrics {
            owned: IntGauge::with_opts(names.opts(
                "redlock_shards_owned",
                "Shards this member holds (run --shards)",
            ))
            .unwrap(),
            unowned: IntGauge::with_opts(names.opts(
                "redlock_shards_unowned",
                "Shards a quorum of nodes showed free at this member's last cycle",
            ))
            .unwrap(),
            unowned_for: Gauge::with_opts(names.opts(
                "redlock_shards_unowned_seconds",
                "How long some shard has been seen free, without a break, by this member's cycles (0: none free at the last cycle)",
            ))
            .unwrap(),
            moves: IntCounterVec::new(
                names.opts(
                    "redlock_shard_moves_total",
                    "Shards this member took, released (its excess, or leaving) and lost (a renewal failed before the step-down)",
                ),
                &["kind"],
            )
            .unwrap(),
            rebalance: Histogram::with_opts(
                names
                    .hist(
                        "redlock_shards_rebalance_seconds",
                        "Time from a change of the group's members, as this member's cycles saw it, to a cycle that saw every shard owned and this member at its share",
                    )
                    .buckets(REBALANCE_BUCKETS.to_vec()),
            )
            .unwrap(),
        };
        for kind in SHARD_MOVES {
            m.moves.with_label_values(&[kind]);
        }
        m
    }

    pub(super) fn collectors(&self) -> Vec<Box<dyn prometheus::core::Collector>> {
        vec![
            Box::new(self.owned.clone()),
            Box::new(self.unowned.clone()),
            Box::new(self.unowned_for.clone()),
            Box::new(self.moves.clone()),
            Box::new(self.rebalance.clone()),
        ]
    }

    /// This member holds `owned` shards.
    pub fn owned(&self, owned: usize) {
        self.owned.set(i64::try_from(owned).unwrap_or(i64::MAX));
    }

    /// The last cycle saw `unowned` shards free, some of them for `for_secs` without a break.
    pub fn unowned(&self, unowned: usize, for_secs: f64) {
        self.unowned.set(i64::try_from(unowned).unwrap_or(i64::MAX));
        self.unowned_for.set(for_secs);
    }

    /// A rebalance took `seconds`.
    pub fn rebalanced(&self, seconds: f64) {
        self.rebalance.observe(seconds);
    }

    /// `count` shards moved by `kind` (one of [`SHARD_MOVES`]).
    pub fn moved(&self, kind: &'static str, count: usize) {
        self.moves
            .with_label_values(&[kind])
            .inc_by(u64::try_from(count).unwrap_or(u64::MAX));
    }
}

//! The request-lock families (`redlock_app_*`): no label per lock name (names are
//! unbounded), only small fixed sets.

use std::time::Duration;

use prometheus::{HistogramVec, IntCounterVec, IntGauge};

use super::families::Names;

/// Results of a request-lock acquisition (`redlock_app_lock_acquire_seconds{result}`).
pub const APP_ACQUIRE_RESULTS: [&str; 5] =
    ["acquired", "busy", "no_quorum", "refused", "cancelled"];
/// How a request lock's lease ended (`redlock_app_leases_ended_total{reason}`).
pub const APP_LEASE_ENDS: [&str; 4] = ["released", "abandoned", "lost", "shutdown"];

/// The request-lock families: no label per lock name (names are unbounded), only the small
/// fixed sets above.
#[derive(Clone)]
pub struct AppLockMetrics {
    leases: IntGauge,
    waiting: IntGauge,
    acquire: HistogramVec,
    ended: IntCounterVec,
}

impl AppLockMetrics {
    pub(super) fn new(names: &Names<'_>) -> AppLockMetrics {
        // As in `families`, the `unwrap`s cannot fail at run time: the names, label names
        // and buckets are constants; the lock name is a label value.
        let m = AppLockMetrics {
            leases: IntGauge::with_opts(names.opts(
                "redlock_app_leases",
                "Request-lock leases this sidecar holds for its app",
            ))
            .unwrap(),
            waiting: IntGauge::with_opts(names.opts(
                "redlock_app_lock_waiting",
                "Request-lock acquisitions waiting for a lock now",
            ))
            .unwrap(),
            acquire: HistogramVec::new(
                names.hist(
                    "redlock_app_lock_acquire_seconds",
                    "Request-lock acquisitions, from the request to the answer, by result",
                ),
                &["result"],
            )
            .unwrap(),
            ended: IntCounterVec::new(
                names.opts(
                    "redlock_app_leases_ended_total",
                    "Request-lock leases ended: released by the app, abandoned (not kept alive for a ttl), lost (renewal failed; the app was told), shutdown",
                ),
                &["reason"],
            )
            .unwrap(),
        };
        for result in APP_ACQUIRE_RESULTS {
            m.acquire.with_label_values(&[result]);
        }
        for reason in APP_LEASE_ENDS {
            m.ended.with_label_values(&[reason]);
        }
        m
    }

    pub(super) fn collectors(&self) -> Vec<Box<dyn prometheus::core::Collector>> {
        vec![
            Box::new(self.leases.clone()),
            Box::new(self.waiting.clone()),
            Box::new(self.acquire.clone()),
            Box::new(self.ended.clone()),
        ]
    }

    /// A lease began (`+1`) or ended (`-1`).
    pub fn leases_add(&self, delta: i64) {
        self.leases.add(delta);
    }

    /// An acquisition started (`+1`) or answered (`-1`) waiting.
    pub fn waiting_add(&self, delta: i64) {
        self.waiting.add(delta);
    }

    /// Acquisitions waiting now (what `redlock_app_lock_waiting` shows).
    pub fn waiting(&self) -> i64 {
        self.waiting.get()
    }

    /// An acquisition answered with `result` (one of [`APP_ACQUIRE_RESULTS`]) after `elapsed`.
    pub fn acquired(&self, result: &'static str, elapsed: Duration) {
        self.acquire
            .with_label_values(&[result])
            .observe(elapsed.as_secs_f64());
    }

    /// A lease ended for `reason` (one of [`APP_LEASE_ENDS`]).
    pub fn ended(&self, reason: &'static str) {
        self.ended.with_label_values(&[reason]).inc();
    }
}

//! What guard tells about a run besides its exit code and outcome line: the
//! `redlock_guard_runs_total` and `redlock_lock_lost_total` counters, and Kubernetes Events.

use std::sync::Arc;

use tracing::warn;

use crate::k8s::Kube;
use crate::metrics::Metrics;

/// The run's metrics and Event sink, and whether it has counted a lost tenure yet.
pub struct Report {
    metrics: Arc<Metrics>,
    kube: Option<Kube>,
    lock: String,
    lost: Option<&'static str>,
}

impl Report {
    pub fn new(metrics: Arc<Metrics>, kube: Option<Kube>, lock: &str) -> Report {
        Report {
            metrics,
            kube,
            lock: lock.to_owned(),
            lost: None,
        }
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Counts a run in `redlock_guard_runs_total{result}`.
    pub fn run(&self, result: &str) {
        self.metrics.guard_run(result);
    }

    /// Counts and logs the loss of the lock, once per run (the first reason stands).
    pub fn lock_lost(&mut self, reason: &'static str) {
        if self.lost.is_none() {
            self.lost = Some(reason);
            self.metrics.lock_lost(reason);
            warn!(lock = %self.lock, reason, "lock lost");
        }
    }

    /// Records a Kubernetes Event, if Events are on; a failure is only logged.
    pub async fn event(&self, reason: &str, message: &str, warning: bool) {
        if let Some(kube) = &self.kube {
            if let Err(err) = kube.event(reason, message, warning).await {
                warn!(reason, error = %err, "could not record a Kubernetes event");
            }
        }
    }
}

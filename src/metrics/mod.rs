//! Prometheus metrics: one registry built at startup and passed down.
//!
//! Every series is created at startup so dashboards show 0 rather than nothing.
//! Labels are bounded: `lock` (a constant label), `node` (`host:port`), `workload` (one
//! configured value, on `redlock_info` only), and small fixed sets for `result`, `reason`,
//! `op`, `kind`, `direction`. Never identities or error text. State gauges (leader, token, validity) are computed from the leadership
//! state at scrape time, so they are exact even if the lease task is stalled.
//!
//! | file | concern |
//! |---|---|
//! | [`families`] | the families, in groups of one concern, and how each is named |
//! | [`app_locks`] | the request-lock families (`redlock_app_*`) |
//! | [`shards`] | the shard families (`redlock_shards_*`, `redlock_shard_*`) |

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus::{Encoder, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

use crate::clock::Deadline;
use crate::leadership::{Leadership, LeadershipRx};
use crate::redlock::{NodeErrorKind, Observer, Op};
use families::{Names, Nodes, Process, Rounds, Settings, Tenure, Waits};

pub mod app_locks;
pub mod families;
pub mod shards;

pub use app_locks::{AppLockMetrics, APP_ACQUIRE_RESULTS, APP_LEASE_ENDS};
pub use shards::{ShardMetrics, SHARD_MOVES};

/// Results of an acquisition attempt (`redlock_acquire_attempts_total{result}`).
pub const ACQUIRE_RESULTS: [&str; 5] = ["acquired", "busy", "no_quorum", "expired", "error"];
/// Why a held lock was given up (`redlock_lock_lost_total{reason}`).
pub const LOST_REASONS: [&str; 4] = ["renew_failed", "expired", "paused", "superseded"];
/// Outcomes of a guard run (`redlock_guard_runs_total{result}`).
/// `unrecorded` counts a run (already counted as `ran`) whose slot record reached too few nodes.
pub const GUARD_RESULTS: [&str; 6] = [
    "ran",
    "skipped",
    "already_ran",
    "lost",
    "failed",
    "unrecorded",
];

/// Latency buckets from 100 µs to 5 s (node calls on loopback to slow WAN links).
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// All metric families of one process (one lock).
pub struct Metrics {
    registry: Registry,
    tenure: Tenure,
    rounds: Rounds,
    nodes: Nodes,
    waits: Waits,
    settings: Settings,
    process: Process,
    app_locks: AppLockMetrics,
    shards: ShardMetrics,
    /// The nodes' labels (`host:port`), by index.
    node_labels: Vec<String>,
}

impl Metrics {
    /// Builds and registers every family for `lock` on `nodes` (labels `host:port`).
    pub fn new(
        lock: &str,
        nodes: &[String],
        kubernetes_errors: Option<IntCounterVec>,
    ) -> Arc<Metrics> {
        let names = Names::new(lock);
        let m = Metrics {
            registry: Registry::new(),
            tenure: Tenure::new(&names),
            rounds: Rounds::new(&names),
            nodes: Nodes::new(&names),
            waits: Waits::new(&names),
            settings: Settings::new(&names),
            process: Process::new(&names),
            app_locks: AppLockMetrics::new(&names),
            shards: ShardMetrics::new(&names),
            node_labels: nodes.to_vec(),
        };
        m.register_all(kubernetes_errors);
        m.initialise_series();
        Arc::new(m)
    }

    fn register_all(&self, kubernetes_errors: Option<IntCounterVec>) {
        let build_info = IntGaugeVec::new(
            Opts::new("redlock_build_info", "Build information; always 1"),
            &["version"],
        )
        .unwrap();
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(build_info),
            Box::new(prometheus::process_collector::ProcessCollector::for_self()),
        ];
        for collector in collectors
            .into_iter()
            .chain(self.tenure.collectors())
            .chain(self.rounds.collectors())
            .chain(self.nodes.collectors())
            .chain(self.waits.collectors())
            .chain(self.settings.collectors())
            .chain(self.process.collectors())
            .chain(self.app_locks.collectors())
            .chain(self.shards.collectors())
            .chain(kubernetes_errors.map(|c| Box::new(c) as Box<_>))
        {
            self.registry
                .register(collector)
                .expect("metric names are unique");
        }
    }

    fn initialise_series(&self) {
        self.settings.info.with_label_values(&[""]).set(1);
        self.candidacy(crate::candidacy::Standing::Contending, true);
        self.credentials(None);
        for direction in ["gained", "lost"] {
            self.tenure.transitions.with_label_values(&[direction]);
        }
        for result in ACQUIRE_RESULTS {
            self.rounds.acquire_attempts.with_label_values(&[result]);
            self.rounds.acquire_duration.with_label_values(&[result]);
        }
        for result in ["ok", "failed"] {
            self.rounds.renewals.with_label_values(&[result]);
        }
        for reason in LOST_REASONS {
            self.rounds.lock_lost.with_label_values(&[reason]);
        }
        for result in GUARD_RESULTS {
            self.process.guard_runs.with_label_values(&[result]);
        }
        for reason in ["deadline", "fallback"] {
            self.waits.standby_reads.with_label_values(&[reason]);
        }
        for node in &self.node_labels {
            self.nodes.node_up.with_label_values(&[node]).set(0);
            self.waits.push_subscribed.with_label_values(&[node]).set(0);
            self.waits.release_watch.with_label_values(&[node]).set(0);
            self.nodes
                .node_vote_counted
                .with_label_values(&[node])
                .set(0);
            for op in Op::ALL {
                self.nodes
                    .node_request_duration
                    .with_label_values(&[node, op.as_str()]);
            }
            for kind in NodeErrorKind::ALL {
                self.nodes
                    .node_errors
                    .with_label_values(&[node, kind.as_str()]);
            }
        }
    }

    /// Publishes the lock's timing, so alerts can judge the validity margin against this
    /// process's own settings rather than one fixed threshold.
    pub fn set_timing(&self, ttl: Duration, renew_interval: Duration, safety_margin: Duration) {
        self.settings.ttl.set(ttl.as_secs_f64());
        self.settings
            .renew_interval
            .set(renew_interval.as_secs_f64());
        self.settings.safety_margin.set(safety_margin.as_secs_f64());
    }

    /// The request-lock families (`redlock_app_*`).
    pub fn app_locks(&self) -> &AppLockMetrics {
        &self.app_locks
    }

    /// The shard families (`run --shards`).
    pub fn shards(&self) -> &ShardMetrics {
        &self.shards
    }

    /// Names the workload in `redlock_info{workload}` (one series, replacing the empty one).
    pub fn set_workload(&self, workload: &str) {
        self.settings.info.reset();
        self.settings.info.with_label_values(&[workload]).set(1);
    }

    /// Records one acquisition round; `result` is one of [`ACQUIRE_RESULTS`].
    pub fn acquire_attempt(&self, result: &str, elapsed: Duration) {
        self.rounds
            .acquire_attempts
            .with_label_values(&[result])
            .inc();
        self.rounds
            .acquire_duration
            .with_label_values(&[result])
            .observe(elapsed.as_secs_f64());
        if result == "busy" {
            self.rounds.contention.inc();
        }
    }

    /// Records one extend round.
    pub fn renewal(&self, ok: bool, elapsed: Duration) {
        self.rounds
            .renewals
            .with_label_values(&[if ok { "ok" } else { "failed" }])
            .inc();
        self.rounds.renew_duration.observe(elapsed.as_secs_f64());
    }

    /// Records how late the renew task woke up.
    pub fn renew_lag(&self, lag: Duration) {
        self.rounds.renew_lag.observe(lag.as_secs_f64());
    }

    /// Records a tenure that ended without a release; `reason` is one of [`LOST_REASONS`].
    pub fn lock_lost(&self, reason: &str) {
        self.rounds.lock_lost.with_label_values(&[reason]).inc();
    }

    /// This sidecar's standing now (one series at 1, the others at 0) and whether its app
    /// counts as ready.
    pub fn candidacy(&self, standing: crate::candidacy::Standing, app_ready: bool) {
        for state in crate::candidacy::Standing::ALL {
            self.process
                .candidacy
                .with_label_values(&[state.as_str()])
                .set(i64::from(state == standing));
        }
        self.process.app_ready.set(i64::from(app_ready));
    }

    /// The fingerprint of the credentials new connections use now (`None`: no password, or
    /// the file cannot be read now: an empty fingerprint). One series at a time.
    pub fn credentials(&self, fingerprint: Option<&str>) {
        self.settings.credentials.reset();
        self.settings
            .credentials
            .with_label_values(&[fingerprint.unwrap_or_default()])
            .set(1);
    }

    /// The app's state became unreadable long enough to count it as ready.
    pub fn app_state_unread(&self) {
        self.process.app_state_unread.inc();
    }

    /// Records a guard outcome; `result` is one of [`GUARD_RESULTS`].
    pub fn guard_run(&self, result: &str) {
        self.process.guard_runs.with_label_values(&[result]).inc();
    }

    /// Sets the state gauges from `state` as of `now`.
    fn set_state(&self, state: &Leadership, now: Deadline) {
        match state.leading_at(now) {
            Some(term) => {
                let left = term.valid_until.saturating_duration_since(now);
                let expiry = SystemTime::now() + left;
                self.tenure.is_leader.set(1);
                self.tenure
                    .fencing_token
                    .set(i64::try_from(term.fencing_token).unwrap_or(i64::MAX));
                self.tenure.validity_remaining.set(left.as_secs_f64());
                self.tenure.lease_expiry.set(unix_seconds(expiry));
                self.tenure.leader_since.set(unix_seconds(term.since));
            }
            None => {
                self.tenure.is_leader.set(0);
                self.tenure.fencing_token.set(0);
                self.tenure.validity_remaining.set(0.0);
                self.tenure.lease_expiry.set(0.0);
                self.tenure.leader_since.set(0.0);
            }
        }
    }

    /// The text exposition of every family, with state gauges as of now.
    pub fn render(&self, state: &Leadership) -> String {
        self.set_state(state, Deadline::now());
        let dropped = crate::logging::dropped_lines();
        self.process
            .log_lines_dropped
            .inc_by(dropped.saturating_sub(self.process.log_lines_dropped.get()));
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }

    /// Counts leadership transitions by following the channel until its sender is gone.
    pub async fn follow(self: Arc<Self>, mut rx: LeadershipRx) {
        let mut leading = false;
        loop {
            let now_leading = rx.borrow_and_update().leading_at(Deadline::now()).is_some();
            if now_leading != leading {
                let direction = if now_leading { "gained" } else { "lost" };
                self.tenure
                    .transitions
                    .with_label_values(&[direction])
                    .inc();
                leading = now_leading;
            }
            self.set_state(&rx.borrow(), Deadline::now());
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    fn node_label(&self, index: usize) -> &str {
        self.node_labels
            .get(index)
            .map_or("unknown", String::as_str)
    }

    /// Sets a per-node 0/1 gauge for node `index`.
    fn set_node_flag(&self, gauge: &IntGaugeVec, index: usize, on: bool) {
        gauge
            .with_label_values(&[self.node_label(index)])
            .set(i64::from(on));
    }
}

impl Observer for Metrics {
    fn node_call(
        &self,
        index: usize,
        op: Op,
        elapsed: Duration,
        result: Result<(), NodeErrorKind>,
    ) {
        let node = self.node_label(index);
        self.nodes
            .node_request_duration
            .with_label_values(&[node, op.as_str()])
            .observe(elapsed.as_secs_f64());
        match result {
            Ok(()) => self.nodes.node_up.with_label_values(&[node]).set(1),
            Err(kind) => {
                self.nodes.node_up.with_label_values(&[node]).set(0);
                self.nodes
                    .node_errors
                    .with_label_values(&[node, kind.as_str()])
                    .inc();
            }
        }
    }

    fn node_counted(&self, index: usize, counted: bool) {
        self.set_node_flag(&self.nodes.node_vote_counted, index, counted);
    }

    fn node_set_conflict(&self) {
        self.nodes.node_set_conflicts.inc();
    }

    fn subscription(&self, index: usize, up: bool) {
        self.set_node_flag(&self.waits.push_subscribed, index, up);
    }

    fn standby_read(&self, fallback: bool) {
        let reason = if fallback { "fallback" } else { "deadline" };
        self.waits.standby_reads.with_label_values(&[reason]).inc();
    }

    fn standby_read_skipped(&self) {
        self.waits.standby_reads_skipped.inc();
    }

    fn release_watch(&self, index: usize, watching: bool) {
        self.set_node_flag(&self.waits.release_watch, index, watching);
    }

    fn waiters_counted(&self, waiters: u64) {
        self.waits
            .standby_waiters
            .set(i64::try_from(waiters).unwrap_or(i64::MAX));
    }
}

/// Seconds since the Unix epoch, as Prometheus timestamps are written (0 before the epoch).
fn unix_seconds(at: SystemTime) -> f64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

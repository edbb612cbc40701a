//! Prometheus metrics: one registry built at startup and passed down.
//!
//! Every series is created at startup so dashboards show 0 rather than nothing.
//! Labels are bounded: `lock` (a constant label), `node` (`host:port`), `workload` (one
//! configured value, on `redlock_info` only), and small fixed sets for `result`, `reason`,
//! `op`, `kind`, `direction`. Never identities or error text. State gauges (leader, token, validity) are computed from the leadership
//! state at scrape time, so they are exact even if the lease task is stalled.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::clock::Deadline;
use crate::leadership::{Leadership, LeadershipRx};
use crate::redlock::{NodeErrorKind, Observer, Op};

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
    is_leader: IntGauge,
    transitions: IntCounterVec,
    fencing_token: IntGauge,
    validity_remaining: Gauge,
    lease_expiry: Gauge,
    leader_since: Gauge,
    acquire_duration: HistogramVec,
    acquire_attempts: IntCounterVec,
    contention: IntCounter,
    renewals: IntCounterVec,
    renew_duration: Histogram,
    lock_lost: IntCounterVec,
    renew_lag: Histogram,
    node_up: IntGaugeVec,
    node_request_duration: HistogramVec,
    node_errors: IntCounterVec,
    node_vote_counted: IntGaugeVec,
    guard_runs: IntCounterVec,
    node_set_conflicts: IntCounter,
    push_subscribed: IntGaugeVec,
    release_watch: IntGaugeVec,
    standby_reads: IntCounterVec,
    standby_reads_skipped: IntCounter,
    standby_waiters: IntGauge,
    log_lines_dropped: IntCounter,
    ttl: Gauge,
    renew_interval: Gauge,
    safety_margin: Gauge,
    info: IntGaugeVec,
    candidacy: IntGaugeVec,
    app_ready: IntGauge,
    credentials: IntGaugeVec,
    app_state_unread: IntCounter,
    app_locks: AppLockMetrics,
    nodes: Vec<String>,
}

impl Metrics {
    /// Builds and registers every family for `lock` on `nodes` (labels `host:port`).
    pub fn new(
        lock: &str,
        nodes: &[String],
        kubernetes_errors: Option<IntCounterVec>,
    ) -> Arc<Metrics> {
        let registry = Registry::new();
        let opts = |name: &str, help: &str| Opts::new(name, help).const_label("lock", lock);
        let hist = |name: &str, help: &str| {
            HistogramOpts::new(name, help)
                .const_label("lock", lock)
                .buckets(LATENCY_BUCKETS.to_vec())
        };
        // The `unwrap`s below cannot fail at run time: metric constructors reject only invalid
        // names, label names and buckets, and those are constants here (the lock name is a
        // label *value*, which any string may be). Every test that builds a sidecar runs them.
        let m = Metrics {
            is_leader: IntGauge::with_opts(opts(
                "redlock_is_leader",
                "1 while this process holds the lock",
            ))
            .unwrap(),
            transitions: IntCounterVec::new(
                opts(
                    "redlock_leader_transitions_total",
                    "Leadership changes of this process",
                ),
                &["direction"],
            )
            .unwrap(),
            fencing_token: IntGauge::with_opts(opts(
                "redlock_fencing_token",
                "Fencing token of the current tenure (0 when not leading)",
            ))
            .unwrap(),
            validity_remaining: Gauge::with_opts(opts(
                "redlock_validity_remaining_seconds",
                "Validity left on the held lock (0 when not leading)",
            ))
            .unwrap(),
            lease_expiry: Gauge::with_opts(opts(
                "redlock_lease_expiry_timestamp_seconds",
                "Unix time at which the held lock's validity ends (0 when not leading)",
            ))
            .unwrap(),
            leader_since: Gauge::with_opts(opts(
                "redlock_leader_since_timestamp_seconds",
                "Unix time at which the current tenure began (0 when not leading)",
            ))
            .unwrap(),
            acquire_duration: HistogramVec::new(
                hist(
                    "redlock_acquire_duration_seconds",
                    "Duration of one acquisition round",
                ),
                &["result"],
            )
            .unwrap(),
            acquire_attempts: IntCounterVec::new(
                opts(
                    "redlock_acquire_attempts_total",
                    "Acquisition rounds by result",
                ),
                &["result"],
            )
            .unwrap(),
            contention: IntCounter::with_opts(opts(
                "redlock_contention_total",
                "Acquisition rounds that found another holder",
            ))
            .unwrap(),
            renewals: IntCounterVec::new(
                opts("redlock_renewals_total", "Extend rounds by result"),
                &["result"],
            )
            .unwrap(),
            renew_duration: Histogram::with_opts(hist(
                "redlock_renew_duration_seconds",
                "Duration of one extend round",
            ))
            .unwrap(),
            lock_lost: IntCounterVec::new(
                opts(
                    "redlock_lock_lost_total",
                    "Tenures that ended without a release, by reason",
                ),
                &["reason"],
            )
            .unwrap(),
            renew_lag: Histogram::with_opts(hist(
                "redlock_renew_lag_seconds",
                "How much later than scheduled the renew task woke up",
            ))
            .unwrap(),
            node_up: IntGaugeVec::new(
                opts("redlock_node_up", "1 if the node's last call succeeded"),
                &["node"],
            )
            .unwrap(),
            node_request_duration: HistogramVec::new(
                hist(
                    "redlock_node_request_duration_seconds",
                    "Duration of one call to one node",
                ),
                &["node", "op"],
            )
            .unwrap(),
            node_errors: IntCounterVec::new(
                opts(
                    "redlock_node_errors_total",
                    "Failed calls to a node, by kind",
                ),
                &["node", "kind"],
            )
            .unwrap(),
            node_vote_counted: IntGaugeVec::new(
                opts(
                    "redlock_node_vote_counted",
                    "0 while a node's votes are not counted (data kept for less than ttl + drift, or an evicting maxmemory-policy)",
                ),
                &["node"],
            )
            .unwrap(),
            guard_runs: IntCounterVec::new(
                opts("redlock_guard_runs_total", "guard runs by outcome"),
                &["result"],
            )
            .unwrap(),
            node_set_conflicts: IntCounter::with_opts(opts(
                "redlock_node_set_conflicts_total",
                "Rounds that refused to lead because another contender of the lock lists other Redis nodes",
            ))
            .unwrap(),
            push_subscribed: IntGaugeVec::new(
                opts(
                    "redlock_push_subscribed",
                    "1 while the subscription to a node's release, acquisition and keyspace channels is live",
                ),
                &["node"],
            )
            .unwrap(),
            release_watch: IntGaugeVec::new(
                opts(
                    "redlock_release_watch",
                    "1 while this sidecar subscribes to a node's release announcements: past 50 subscribers there, newcomers do not (a release wakes about 50; the others learn of the new holder from its announcement)",
                ),
                &["node"],
            )
            .unwrap(),
            standby_reads: IntCounterVec::new(
                opts(
                    "redlock_standby_reads_total",
                    "Plain reads of the nodes by a waiting standby: at a key's expiry (deadline) or because a push subscription was missing (fallback)",
                ),
                &["reason"],
            )
            .unwrap(),
            standby_reads_skipped: IntCounter::with_opts(opts(
                "redlock_standby_reads_skipped_total",
                "Key expiries at which a waiting standby left the read to others: past 50 waiters, standbys take turns",
            ))
            .unwrap(),
            standby_waiters: IntGauge::with_opts(opts(
                "redlock_standby_waiters",
                "Sidecars subscribed to the lock's acquisition channel on one node (leader included), as this standby last counted them; 0 until counted",
            ))
            .unwrap(),
            log_lines_dropped: IntCounter::with_opts(opts(
                "redlock_log_lines_dropped_total",
                "Log lines dropped because stderr did not drain (logging never blocks the lock's renewals)",
            ))
            .unwrap(),
            ttl: Gauge::with_opts(opts(
                "redlock_ttl_seconds",
                "Configured lock ttl (--ttl); 0 until set",
            ))
            .unwrap(),
            renew_interval: Gauge::with_opts(opts(
                "redlock_renew_interval_seconds",
                "Configured renewal interval (--renew-interval); 0 until set",
            ))
            .unwrap(),
            safety_margin: Gauge::with_opts(opts(
                "redlock_safety_margin_seconds",
                "Configured safety margin (--safety-margin): a leader steps down this long before validity ends; 0 until set",
            ))
            .unwrap(),
            info: IntGaugeVec::new(
                opts(
                    "redlock_info",
                    "Always 1; names the workload this sidecar runs in (--workload, empty when not set)",
                ),
                &["workload"],
            )
            .unwrap(),
            candidacy: IntGaugeVec::new(
                opts(
                    "redlock_candidacy",
                    "1 for this sidecar's standing: contending, deferring (to a preferred candidate), app_not_ready (still contends when no ready candidate waits), app_state_unknown (the app's state could not be read for long; counted as ready), resigned",
                ),
                &["state"],
            )
            .unwrap(),
            credentials: IntGaugeVec::new(
                opts(
                    "redlock_credentials_info",
                    "Always 1; fingerprint: empty without a password (or while its file cannot be read), else 16 hex digits of a salted SHA-256 of the Redis credentials new connections use now (compare pods during a rotation; never the secret)",
                ),
                &["fingerprint"],
            )
            .unwrap(),
            app_ready: IntGauge::with_opts(opts(
                "redlock_app_ready",
                "1 while the app counts as ready for leadership (always 1 without an app check)",
            ))
            .unwrap(),
            app_state_unread: IntCounter::with_opts(opts(
                "redlock_app_state_unread_total",
                "Times the app's state became unreadable long enough to count it as ready",
            ))
            .unwrap(),
            app_locks: AppLockMetrics::new(lock),
            nodes: nodes.to_vec(),
            registry,
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
            Box::new(self.is_leader.clone()),
            Box::new(self.transitions.clone()),
            Box::new(self.fencing_token.clone()),
            Box::new(self.validity_remaining.clone()),
            Box::new(self.lease_expiry.clone()),
            Box::new(self.leader_since.clone()),
            Box::new(self.acquire_duration.clone()),
            Box::new(self.acquire_attempts.clone()),
            Box::new(self.contention.clone()),
            Box::new(self.renewals.clone()),
            Box::new(self.renew_duration.clone()),
            Box::new(self.lock_lost.clone()),
            Box::new(self.renew_lag.clone()),
            Box::new(self.node_up.clone()),
            Box::new(self.node_request_duration.clone()),
            Box::new(self.node_errors.clone()),
            Box::new(self.node_vote_counted.clone()),
            Box::new(self.guard_runs.clone()),
            Box::new(self.node_set_conflicts.clone()),
            Box::new(self.push_subscribed.clone()),
            Box::new(self.release_watch.clone()),
            Box::new(self.standby_reads.clone()),
            Box::new(self.standby_reads_skipped.clone()),
            Box::new(self.standby_waiters.clone()),
            Box::new(self.log_lines_dropped.clone()),
            Box::new(self.ttl.clone()),
            Box::new(self.renew_interval.clone()),
            Box::new(self.safety_margin.clone()),
            Box::new(self.info.clone()),
            Box::new(self.candidacy.clone()),
            Box::new(self.app_ready.clone()),
            Box::new(self.credentials.clone()),
            Box::new(self.app_state_unread.clone()),
            Box::new(build_info),
            Box::new(prometheus::process_collector::ProcessCollector::for_self()),
        ];
        for collector in collectors
            .into_iter()
            .chain(self.app_locks.collectors())
            .chain(kubernetes_errors.map(|c| Box::new(c) as Box<_>))
        {
            self.registry
                .register(collector)
                .expect("metric names are unique");
        }
    }

    fn initialise_series(&self) {
        self.info.with_label_values(&[""]).set(1);
        self.candidacy(crate::candidacy::Standing::Contending, true);
        self.credentials(None);
        for direction in ["gained", "lost"] {
            self.transitions.with_label_values(&[direction]);
        }
        for result in ACQUIRE_RESULTS {
            self.acquire_attempts.with_label_values(&[result]);
            self.acquire_duration.with_label_values(&[result]);
        }
        for result in ["ok", "failed"] {
            self.renewals.with_label_values(&[result]);
        }
        for reason in LOST_REASONS {
            self.lock_lost.with_label_values(&[reason]);
        }
        for result in GUARD_RESULTS {
            self.guard_runs.with_label_values(&[result]);
        }
        for reason in ["deadline", "fallback"] {
            self.standby_reads.with_label_values(&[reason]);
        }
        for node in &self.nodes {
            self.node_up.with_label_values(&[node]).set(0);
            self.push_subscribed.with_label_values(&[node]).set(0);
            self.release_watch.with_label_values(&[node]).set(0);
            self.node_vote_counted.with_label_values(&[node]).set(0);
            for op in Op::ALL {
                self.node_request_duration
                    .with_label_values(&[node, op.as_str()]);
            }
            for kind in NodeErrorKind::ALL {
                self.node_errors.with_label_values(&[node, kind.as_str()]);
            }
        }
    }

    /// Publishes the lock's timing, so alerts can judge the validity margin against this
    /// process's own settings rather than one fixed threshold.
    pub fn set_timing(&self, ttl: Duration, renew_interval: Duration, safety_margin: Duration) {
        self.ttl.set(ttl.as_secs_f64());
        self.renew_interval.set(renew_interval.as_secs_f64());
        self.safety_margin.set(safety_margin.as_secs_f64());
    }

    /// The request-lock families (`redlock_app_*`).
    pub fn app_locks(&self) -> &AppLockMetrics {
        &self.app_locks
    }

    /// Names the workload in `redlock_info{workload}` (one series, replacing the empty one).
    pub fn set_workload(&self, workload: &str) {
        self.info.reset();
        self.info.with_label_values(&[workload]).set(1);
    }

    /// Records one acquisition round; `result` is one of [`ACQUIRE_RESULTS`].
    pub fn acquire_attempt(&self, result: &str, elapsed: Duration) {
        self.acquire_attempts.with_label_values(&[result]).inc();
        self.acquire_duration
            .with_label_values(&[result])
            .observe(elapsed.as_secs_f64());
        if result == "busy" {
            self.contention.inc();
        }
    }

    /// Records one extend round.
    pub fn renewal(&self, ok: bool, elapsed: Duration) {
        self.renewals
            .with_label_values(&[if ok { "ok" } else { "failed" }])
            .inc();
        self.renew_duration.observe(elapsed.as_secs_f64());
    }

    /// Records how late the renew task woke up.
    pub fn renew_lag(&self, lag: Duration) {
        self.renew_lag.observe(lag.as_secs_f64());
    }

    /// Records a tenure that ended without a release; `reason` is one of [`LOST_REASONS`].
    pub fn lock_lost(&self, reason: &str) {
        self.lock_lost.with_label_values(&[reason]).inc();
    }

    /// This sidecar's standing now (one series at 1, the others at 0) and whether its app
    /// counts as ready.
    pub fn candidacy(&self, standing: crate::candidacy::Standing, app_ready: bool) {
        for state in crate::candidacy::Standing::ALL {
            self.candidacy
                .with_label_values(&[state.as_str()])
                .set(i64::from(state == standing));
        }
        self.app_ready.set(i64::from(app_ready));
    }

    /// The fingerprint of the credentials new connections use now (`None`: no password, or
    /// the file cannot be read now: an empty fingerprint). One series at a time.
    pub fn credentials(&self, fingerprint: Option<&str>) {
        self.credentials.reset();
        self.credentials
            .with_label_values(&[fingerprint.unwrap_or_default()])
            .set(1);
    }

    /// The app's state became unreadable long enough to count it as ready.
    pub fn app_state_unread(&self) {
        self.app_state_unread.inc();
    }

    /// Records a guard outcome; `result` is one of [`GUARD_RESULTS`].
    pub fn guard_run(&self, result: &str) {
        self.guard_runs.with_label_values(&[result]).inc();
    }

    /// Sets the state gauges from `state` as of `now`.
    fn set_state(&self, state: &Leadership, now: Deadline) {
        match state.leading_at(now) {
            Some(term) => {
                let left = term.valid_until.saturating_duration_since(now);
                let expiry = SystemTime::now() + left;
                self.is_leader.set(1);
                self.fencing_token
                    .set(i64::try_from(term.fencing_token).unwrap_or(i64::MAX));
                self.validity_remaining.set(left.as_secs_f64());
                self.lease_expiry.set(unix_seconds(expiry));
                self.leader_since.set(unix_seconds(term.since));
            }
            None => {
                self.is_leader.set(0);
                self.fencing_token.set(0);
                self.validity_remaining.set(0.0);
                self.lease_expiry.set(0.0);
                self.leader_since.set(0.0);
            }
        }
    }

    /// The text exposition of every family, with state gauges as of now.
    pub fn render(&self, state: &Leadership) -> String {
        self.set_state(state, Deadline::now());
        let dropped = crate::logging::dropped_lines();
        self.log_lines_dropped
            .inc_by(dropped.saturating_sub(self.log_lines_dropped.get()));
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
                self.transitions.with_label_values(&[direction]).inc();
                leading = now_leading;
            }
            self.set_state(&rx.borrow(), Deadline::now());
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    fn node_label(&self, index: usize) -> &str {
        self.nodes.get(index).map_or("unknown", String::as_str)
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
        self.node_request_duration
            .with_label_values(&[node, op.as_str()])
            .observe(elapsed.as_secs_f64());
        match result {
            Ok(()) => self.node_up.with_label_values(&[node]).set(1),
            Err(kind) => {
                self.node_up.with_label_values(&[node]).set(0);
                self.node_errors
                    .with_label_values(&[node, kind.as_str()])
                    .inc();
            }
        }
    }

    fn node_counted(&self, index: usize, counted: bool) {
        self.set_node_flag(&self.node_vote_counted, index, counted);
    }

    fn node_set_conflict(&self) {
        self.node_set_conflicts.inc();
    }

    fn subscription(&self, index: usize, up: bool) {
        self.set_node_flag(&self.push_subscribed, index, up);
    }

    fn standby_read(&self, fallback: bool) {
        let reason = if fallback { "fallback" } else { "deadline" };
        self.standby_reads.with_label_values(&[reason]).inc();
    }

    fn standby_read_skipped(&self) {
        self.standby_reads_skipped.inc();
    }

    fn release_watch(&self, index: usize, watching: bool) {
        self.set_node_flag(&self.release_watch, index, watching);
    }

    fn waiters_counted(&self, waiters: u64) {
        self.standby_waiters
            .set(i64::try_from(waiters).unwrap_or(i64::MAX));
    }
}

/// Seconds since the Unix epoch, as Prometheus timestamps are written (0 before the epoch).
fn unix_seconds(at: SystemTime) -> f64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

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
    fn new(lock: &str) -> AppLockMetrics {
        let opts = |name: &str, help: &str| Opts::new(name, help).const_label("lock", lock);
        // As in `Metrics::new`, the `unwrap`s cannot fail at run time: the names, label names
        // and buckets are constants; the lock name is a label value.
        let m = AppLockMetrics {
            leases: IntGauge::with_opts(opts(
                "redlock_app_leases",
                "Request-lock leases this sidecar holds for its app",
            ))
            .unwrap(),
            waiting: IntGauge::with_opts(opts(
                "redlock_app_lock_waiting",
                "Request-lock acquisitions waiting for a lock now",
            ))
            .unwrap(),
            acquire: HistogramVec::new(
                HistogramOpts::new(
                    "redlock_app_lock_acquire_seconds",
                    "Request-lock acquisitions, from the request to the answer, by result",
                )
                .const_label("lock", lock)
                .buckets(LATENCY_BUCKETS.to_vec()),
                &["result"],
            )
            .unwrap(),
            ended: IntCounterVec::new(
                opts(
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

    fn collectors(&self) -> Vec<Box<dyn prometheus::core::Collector>> {
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

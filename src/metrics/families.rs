//! The metric families, in groups of one concern each: built for one lock (the `lock`
//! label), registered together.
//!
//! The `unwrap`s below cannot fail at run time: metric constructors reject only invalid
//! names, label names and buckets, and those are constants here (the lock name is a label
//! *value*, which any string may be). Every test that builds a sidecar runs them.

use prometheus::core::Collector;
use prometheus::{
    Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts,
};

use super::LATENCY_BUCKETS;

/// The options of a family of one lock: its name and help, the `lock` label.
pub(super) struct Names<'a> {
    lock: &'a str,
}

impl<'a> Names<'a> {
    /// The families of `lock`.
    pub(super) fn new(lock: &'a str) -> Names<'a> {
        Names { lock }
    }

    /// A counter's or gauge's options.
    pub(super) fn opts(&self, name: &str, help: &str) -> Opts {
        Opts::new(name, help).const_label("lock", self.lock)
    }

    /// A latency histogram's options: [`LATENCY_BUCKETS`].
    pub(super) fn hist(&self, name: &str, help: &str) -> HistogramOpts {
        HistogramOpts::new(name, help)
            .const_label("lock", self.lock)
            .buckets(LATENCY_BUCKETS.to_vec())
    }
}

/// The tenure's state gauges (set from the leadership state at each scrape) and its
/// transitions.
pub(super) struct Tenure {
    pub(super) is_leader: IntGauge,
    pub(super) transitions: IntCounterVec,
    pub(super) fencing_token: IntGauge,
    pub(super) validity_remaining: Gauge,
    pub(super) lease_expiry: Gauge,
    pub(super) leader_since: Gauge,
}

impl Tenure {
    /// The group's families, for the lock `names` builds for.
    pub(super) fn new(names: &Names<'_>) -> Tenure {
        Tenure {
            is_leader: IntGauge::with_opts(
                names.opts("redlock_is_leader", "1 while this process holds the lock"),
            )
            .unwrap(),
            transitions: IntCounterVec::new(
                names.opts(
                    "redlock_leader_transitions_total",
                    "Leadership changes of this process",
                ),
                &["direction"],
            )
            .unwrap(),
            fencing_token: IntGauge::with_opts(names.opts(
                "redlock_fencing_token",
                "Fencing token of the current tenure (0 when not leading)",
            ))
            .unwrap(),
            validity_remaining: Gauge::with_opts(names.opts(
                "redlock_validity_remaining_seconds",
                "Validity left on the held lock (0 when not leading)",
            ))
            .unwrap(),
            lease_expiry: Gauge::with_opts(names.opts(
                "redlock_lease_expiry_timestamp_seconds",
                "Unix time at which the held lock's validity ends (0 when not leading)",
            ))
            .unwrap(),
            leader_since: Gauge::with_opts(names.opts(
                "redlock_leader_since_timestamp_seconds",
                "Unix time at which the current tenure began (0 when not leading)",
            ))
            .unwrap(),
        }
    }

    /// Its families, to register.
    pub(super) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.is_leader.clone()),
            Box::new(self.transitions.clone()),
            Box::new(self.fencing_token.clone()),
            Box::new(self.validity_remaining.clone()),
            Box::new(self.lease_expiry.clone()),
            Box::new(self.leader_since.clone()),
        ]
    }
}

/// The acquisition and extend rounds, and the tenures lost.
pub(super) struct Rounds {
    pub(super) acquire_duration: HistogramVec,
    pub(super) acquire_attempts: IntCounterVec,
    pub(super) contention: IntCounter,
    pub(super) renewals: IntCounterVec,
    pub(super) renew_duration: Histogram,
    pub(super) lock_lost: IntCounterVec,
    pub(super) renew_lag: Histogram,
}

impl Rounds {
    /// The group's families, for the lock `names` builds for.
    pub(super) fn new(names: &Names<'_>) -> Rounds {
        Rounds {
            acquire_duration: HistogramVec::new(
                names.hist(
                    "redlock_acquire_duration_seconds",
                    "Duration of one acquisition round",
                ),
                &["result"],
            )
            .unwrap(),
            acquire_attempts: IntCounterVec::new(
                names.opts(
                    "redlock_acquire_attempts_total",
                    "Acquisition rounds by result",
                ),
                &["result"],
            )
            .unwrap(),
            contention: IntCounter::with_opts(names.opts(
                "redlock_contention_total",
                "Acquisition rounds that found another holder",
            ))
            .unwrap(),
            renewals: IntCounterVec::new(
                names.opts("redlock_renewals_total", "Extend rounds by result"),
                &["result"],
            )
            .unwrap(),
            renew_duration: Histogram::with_opts(names.hist(
                "redlock_renew_duration_seconds",
                "Duration of one extend round",
            ))
            .unwrap(),
            lock_lost: IntCounterVec::new(
                names.opts(
                    "redlock_lock_lost_total",
                    "Tenures that ended without a release, by reason",
                ),
                &["reason"],
            )
            .unwrap(),
            renew_lag: Histogram::with_opts(names.hist(
                "redlock_renew_lag_seconds",
                "How much later than scheduled the renew task woke up",
            ))
            .unwrap(),
        }
    }

    /// Its families, to register.
    pub(super) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.acquire_duration.clone()),
            Box::new(self.acquire_attempts.clone()),
            Box::new(self.contention.clone()),
            Box::new(self.renewals.clone()),
            Box::new(self.renew_duration.clone()),
            Box::new(self.lock_lost.clone()),
            Box::new(self.renew_lag.clone()),
        ]
    }
}

/// Each node's calls, errors and votes, and the node-set conflicts.
pub(super) struct Nodes {
    pub(super) node_up: IntGaugeVec,
    pub(super) node_request_duration: HistogramVec,
    pub(super) node_errors: IntCounterVec,
    pub(super) node_vote_counted: IntGaugeVec,
    pub(super) node_set_conflicts: IntCounter,
}

impl Nodes {
    /// The group's families, for the lock `names` builds for.
    pub(super) fn new(names: &Names<'_>) -> Nodes {
        Nodes {
            node_up: IntGaugeVec::new(
                names.opts("redlock_node_up", "1 if the node's last call succeeded"),
                &["node"],
            )
            .unwrap(),
            node_request_duration: HistogramVec::new(
                names.hist(
                    "redlock_node_request_duration_seconds",
                    "Duration of one call to one node",
                ),
                &["node", "op"],
            )
            .unwrap(),
            node_errors: IntCounterVec::new(
                names.opts(
                    "redlock_node_errors_total",
                    "Failed calls to a node, by kind",
                ),
                &["node", "kind"],
            )
            .unwrap(),
            node_vote_counted: IntGaugeVec::new(
                names.opts(
                    "redlock_node_vote_counted",
                    "0 while a node's votes are not counted (data kept for less than ttl + drift, or an evicting maxmemory-policy)",
                ),
                &["node"],
            )
            .unwrap(),
            node_set_conflicts: IntCounter::with_opts(names.opts(
                "redlock_node_set_conflicts_total",
                "Rounds that refused to lead because another contender of the lock lists other Redis nodes",
            ))
            .unwrap(),
        }
    }

    /// Its families, to register.
    pub(super) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.node_up.clone()),
            Box::new(self.node_request_duration.clone()),
            Box::new(self.node_errors.clone()),
            Box::new(self.node_vote_counted.clone()),
            Box::new(self.node_set_conflicts.clone()),
        ]
    }
}

/// How standbys wait: subscriptions, release watches, reads at expiry, waiters.
pub(super) struct Waits {
    pub(super) push_subscribed: IntGaugeVec,
    pub(super) release_watch: IntGaugeVec,
    pub(super) standby_reads: IntCounterVec,
    pub(super) standby_reads_skipped: IntCounter,
    pub(super) standby_waiters: IntGauge,
}

impl Waits {
    /// The group's families, for the lock `names` builds for.
    pub(super) fn new(names: &Names<'_>) -> Waits {
        Waits {
            push_subscribed: IntGaugeVec::new(
                names.opts(
                    "redlock_push_subscribed",
                    "1 while the subscription to a node's release, acquisition and keyspace channels is live",
                ),
                &["node"],
            )
            .unwrap(),
            release_watch: IntGaugeVec::new(
                names.opts(
                    "redlock_release_watch",
                    "1 while this sidecar subscribes to a node's release announcements: past 50 subscribers there, newcomers do not (a release wakes about 50; the others learn of the new holder from its announcement)",
                ),
                &["node"],
            )
            .unwrap(),
            standby_reads: IntCounterVec::new(
                names.opts(
                    "redlock_standby_reads_total",
                    "Plain reads of the nodes by a waiting standby: at a key's expiry (deadline) or because a push subscription was missing (fallback)",
                ),
                &["reason"],
            )
            .unwrap(),
            standby_reads_skipped: IntCounter::with_opts(names.opts(
                "redlock_standby_reads_skipped_total",
                "Key expiries at which a waiting standby left the read to others: past 50 waiters, standbys take turns",
            ))
            .unwrap(),
            standby_waiters: IntGauge::with_opts(names.opts(
                "redlock_standby_waiters",
                "Sidecars subscribed to the lock's acquisition channel on one node (leader included), as this standby last counted them; 0 until counted",
            ))
            .unwrap(),
        }
    }

    /// Its families, to register.
    pub(super) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.push_subscribed.clone()),
            Box::new(self.release_watch.clone()),
            Box::new(self.standby_reads.clone()),
            Box::new(self.standby_reads_skipped.clone()),
            Box::new(self.standby_waiters.clone()),
        ]
    }
}

/// What this sidecar runs with: its timing, workload and credentials.
pub(super) struct Settings {
    pub(super) ttl: Gauge,
    pub(super) renew_interval: Gauge,
    pub(super) safety_margin: Gauge,
    pub(super) info: IntGaugeVec,
    pub(super) credentials: IntGaugeVec,
}

impl Settings {
    /// The group's families, for the lock `names` builds for.
    pub(super) fn new(names: &Names<'_>) -> Settings {
        Settings {
            ttl: Gauge::with_opts(names.opts(
                "redlock_ttl_seconds",
                "Configured lock ttl (--ttl); 0 until set",
            ))
            .unwrap(),
            renew_interval: Gauge::with_opts(names.opts(
                "redlock_renew_interval_seconds",
                "Configured renewal interval (--renew-interval); 0 until set",
            ))
            .unwrap(),
            safety_margin: Gauge::with_opts(names.opts(
                "redlock_safety_margin_seconds",
                "Configured safety margin (--safety-margin): a leader steps down this long before validity ends; 0 until set",
            ))
            .unwrap(),
            info: IntGaugeVec::new(
                names.opts(
                    "redlock_info",
                    "Always 1; names the workload this sidecar runs in (--workload, empty when not set)",
                ),
                &["workload"],
            )
            .unwrap(),
            credentials: IntGaugeVec::new(
                names.opts(
                    "redlock_credentials_info",
                    "Always 1; fingerprint: empty without a password (or while its file cannot be read), else 16 hex digits of a salted SHA-256 of the Redis credentials new connections use now (compare pods during a rotation; never the secret)",
                ),
                &["fingerprint"],
            )
            .unwrap(),
        }
    }

    /// Its families, to register.
    pub(super) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.ttl.clone()),
            Box::new(self.renew_interval.clone()),
            Box::new(self.safety_margin.clone()),
            Box::new(self.info.clone()),
            Box::new(self.credentials.clone()),
        ]
    }
}

/// This sidecar's standing, its guard runs and its dropped log lines.
pub(super) struct Process {
    pub(super) candidacy: IntGaugeVec,
    pub(super) app_ready: IntGauge,
    pub(super) app_state_unread: IntCounter,
    pub(super) guard_runs: IntCounterVec,
    pub(super) log_lines_dropped: IntCounter,
}

impl Process {
    /// The group's families, for the lock `names` builds for.
    pub(super) fn new(names: &Names<'_>) -> Process {
        Process {
            candidacy: IntGaugeVec::new(
                names.opts(
                    "redlock_candidacy",
                    "1 for this sidecar's standing: contending, deferring (to a preferred candidate), app_not_ready (still contends when no ready candidate waits), app_state_unknown (the app's state could not be read for long; counted as ready), resigned",
                ),
                &["state"],
            )
            .unwrap(),
            app_ready: IntGauge::with_opts(names.opts(
                "redlock_app_ready",
                "1 while the app counts as ready for leadership (always 1 without an app check)",
            ))
            .unwrap(),
            app_state_unread: IntCounter::with_opts(names.opts(
                "redlock_app_state_unread_total",
                "Times the app's state became unreadable long enough to count it as ready",
            ))
            .unwrap(),
            guard_runs: IntCounterVec::new(
                names.opts("redlock_guard_runs_total", "guard runs by outcome"),
                &["result"],
            )
            .unwrap(),
            log_lines_dropped: IntCounter::with_opts(names.opts(
                "redlock_log_lines_dropped_total",
                "Log lines dropped because stderr did not drain (logging never blocks the lock's renewals)",
            ))
            .unwrap(),
        }
    }

    /// Its families, to register.
    pub(super) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.candidacy.clone()),
            Box::new(self.app_ready.clone()),
            Box::new(self.app_state_unread.clone()),
            Box::new(self.guard_runs.clone()),
            Box::new(self.log_lines_dropped.clone()),
        ]
    }
}

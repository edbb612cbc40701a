//! `run`: wire the lock loop to its observers (HTTP, metrics, Kubernetes) and shut down in order.
//!
//! Shutdown order: signal → stop claiming leadership (endpoints flip to 503) and stop taking
//! request locks → release on all nodes (the leadership lock and every request-lock lease,
//! side by side) and announce it → Kubernetes label flushed → HTTP stops → exit 0, all
//! bounded by `--shutdown-timeout`, which must stay below the pod's
//! `terminationGracePeriodSeconds`. Until HTTP stops, an app's call on a released lease
//! answers 410 with `"ended": "shutdown"`.
//!
//! At start, before anything else, the soft limit on open files is raised to the hard limit
//! ([`raise_open_files_limit`]); nothing is logged when that works, one warning when not.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::candidacy::{presence, probe, Candidacy};
use crate::clock;
use crate::config::{AppProbe, RunConfig};
use crate::control_thread::ControlThread;
use crate::http::{self, AdminState};
use crate::k8s::{self, Kube};
use crate::lease;
use crate::locks;
use crate::redlock::drift;
use crate::{ops, shutdown};

/// Runs the sidecar until SIGTERM/SIGINT; returns the exit code.
pub async fn run(cfg: RunConfig) -> i32 {
    if let Err(err) = raise_open_files_limit() {
        warn!(error = %err, "cannot raise the soft limit on open files to the hard limit; connections and leases may run out of file descriptors");
    }
    let signals = shutdown::Signals::install().expect("signal handlers can be installed");
    let listener = match http::bind(cfg.listen).await {
        Ok(listener) => listener,
        Err(err) => {
            crate::config::exit_invalid(&format!("--listen: cannot bind {}: {err}", cfg.listen))
        }
    };
    // Start-up, before the lock loop runs: a failure here leaves no lock held.
    let control_thread = match ControlThread::start() {
        Ok(thread) => thread,
        Err(err) => {
            eprintln!("redlock-sidecar: cannot start the control listener's thread: {err}");
            return crate::exit::OS_ERROR;
        }
    };
    // Bound on its own thread (see `control_thread`), so that thread's reactor serves it.
    let bound = control_thread.spawn(http::bind(cfg.control_listen)).await;
    let control_listener = match bound.map_err(std::io::Error::other).and_then(|bound| bound) {
        Ok(listener) => listener,
        Err(err) => crate::config::exit_invalid(&format!(
            "--control-listen: cannot bind {}: {err}",
            cfg.control_listen
        )),
    };
    // Dapr's gRPC API, if asked for: bound now, beside the control listener, on its thread.
    let dapr_grpc = cfg.locks.as_ref().and_then(|l| l.dapr_grpc_listen);
    let dapr_grpc_listener = match dapr_grpc {
        Some(addr) => {
            let bound = control_thread.spawn(http::bind(addr)).await;
            match bound.map_err(std::io::Error::other).and_then(|bound| bound) {
                Ok(listener) => Some(listener),
                Err(err) => crate::config::exit_invalid(&format!(
                    "--dapr-grpc-listen: cannot bind {addr}: {err}"
                )),
            }
        }
        None => None,
    };
    let kube_errors = k8s::errors_counter();
    // One engine for every lock of the process: the leadership lock and the request locks
    // share its connections (see `redlock::Engine`). Connected first (bounded by the connect
    // timeout), so that the nodes' mode is known and the leadership lock takes the shared set.
    let engine = crate::redlock::Engine::new(&cfg.redlock)
        .unwrap_or_else(|err| crate::config::exit_invalid(&err.to_string()));
    engine.connect(cfg.redlock.connect_timeout).await;
    let (redlock, metrics) =
        lease::instrumented_lock_on(&engine, &cfg.redlock, Some(kube_errors.clone()))
            .unwrap_or_else(|err| crate::config::exit_invalid(&err.to_string()));
    metrics.set_timing(
        cfg.redlock.ttl,
        cfg.renewal.interval,
        cfg.renewal.safety_margin,
    );
    metrics.set_workload(&cfg.workload);
    let kube = match Kube::connect(cfg.kubernetes.clone(), kube_errors).await {
        Ok(kube) => kube,
        Err(err) => crate::config::exit_invalid(&format!("--kubernetes: {err}")),
    };
    log_timing(&cfg);
    tokio::spawn(ops::warn_about_nodes(redlock.clone()));

    let (tx, rx) = lease::channel(&redlock);
    let cancel = CancellationToken::new();
    let http_stop = CancellationToken::new();
    let admin = AdminState {
        leadership: rx.clone(),
        metrics: metrics.clone(),
        ready_when: cfg.ready_when,
        shutdown: http_stop.clone(),
    };
    info!(listen = %cfg.listen, lock = %cfg.redlock.lock, identity = %cfg.redlock.identity, nodes = cfg.redlock.nodes.len(), "redlock-sidecar running");
    let http_task = tokio::spawn(async move {
        if let Err(err) = http::serve(listener, admin).await {
            warn!(error = %err, "admin endpoint stopped");
        }
    });
    let candidacy = match &cfg.app_check {
        Some(check) => Candidacy::checked(check.unready_after),
        None => Candidacy::unchecked(),
    };
    let (candidacy_tx, candidacy_rx) =
        tokio::sync::watch::channel(candidacy.named(&cfg.redlock.identity, presence::born_ms()));
    tokio::spawn(follow_credentials(redlock.clone(), metrics.clone()));
    tokio::spawn(presence::run(
        redlock.clone(),
        candidacy_tx.clone(),
        metrics.clone(),
        cancel.clone(),
    ));
    if let Some(check) = cfg.app_check.clone() {
        match check.probe {
            AppProbe::Http(url) => {
                tokio::spawn(probe::run(url, check.interval, candidacy_tx.clone()));
            }
            AppProbe::Container(name) => {
                let Some(kube) = kube.clone() else {
                    crate::config::exit_invalid(
                        "--follow-container: needs the Kubernetes integration (in a pod, with POD_NAME set and --kubernetes auto or on)",
                    )
                };
                tokio::spawn(kube.follow_container(name, check.interval, candidacy_tx.clone()));
            }
        }
    }
    let locks = cfg.locks.as_ref().map(|settings| {
        control_thread.enter(|| {
            let engine = locks::RedlockEngine::new(
                engine.clone(),
                cfg.redlock.clone(),
                &settings.prefix,
                metrics.clone(),
            );
            locks::Locks::new(engine, settings.max_leases, metrics.app_locks().clone())
        })
    });
    let dapr_runtime = cfg.locks.as_ref().map(|settings| {
        let (identity, store) = (&cfg.redlock.identity, &settings.dapr_store);
        locks::dapr::Runtime::new(identity, store, dapr_grpc, rx.clone(), cancel.clone())
    });
    let locks_routes = locks
        .as_ref()
        .zip(cfg.locks.as_ref())
        .zip(dapr_runtime.clone())
        .map(|((locks, settings), runtime)| {
            locks::router(locks::Api {
                locks: Arc::clone(locks),
                dapr_store: settings.dapr_store.clone(),
            })
            .merge(locks::dapr::runtime_router(runtime))
        });
    let dapr_grpc_task = dapr_grpc_listener.zip(locks.clone().zip(dapr_runtime)).map(
        |(listener, (locks, runtime))| {
            let api = locks::Api {
                locks,
                dapr_store: runtime.store.clone(),
            };
            let grpc = locks::dapr_grpc::DaprGrpc::new(api, runtime);
            control_thread.spawn(locks::dapr_grpc::serve(listener, grpc, http_stop.clone()))
        },
    );
    let control = http::control_router(
        http::ControlState {
            leadership: rx.clone(),
            candidacy: candidacy_tx,
            default_hold: cfg.redlock.ttl,
        },
        locks_routes,
    );
    let control_task = control_thread.spawn(http::serve_router(
        control_listener,
        control,
        http_stop.clone(),
    ));
    tokio::spawn(Arc::clone(&metrics).follow(rx.clone()));
    let kube_task = kube
        .map(|kube| tokio::spawn(kube.observe(rx.clone(), cancel.clone(), cfg.shutdown_timeout)));
    let lease_task = tokio::spawn(lease::run(
        redlock,
        cfg.renewal,
        tx,
        metrics,
        candidacy_rx,
        cancel.clone(),
    ));

    signals.first().await;
    cancel.cancel();
    let drained = clock::within(cfg.shutdown_timeout, async {
        let leadership = async {
            let _ = lease_task.await;
            if let Some(kube_task) = kube_task {
                let _ = kube_task.await;
            }
        };
        let request_locks = async {
            if let Some(locks) = locks.clone() {
                let _ = control_thread
                    .spawn(async move { locks.shutdown().await })
                    .await;
            }
        };
        tokio::join!(leadership, request_locks);
    })
    .await;
    match drained {
        Ok(()) => info!("shutdown complete"),
        Err(_) => {
            warn!(timeout = ?cfg.shutdown_timeout, "shutdown timed out; the lock expires on its own")
        }
    }
    http_stop.cancel();
    let _ = clock::within(Duration::from_secs(1), http_task).await;
    let _ = clock::within(Duration::from_secs(1), control_task).await;
    if let Some(task) = dapr_grpc_task {
        let _ = clock::within(Duration::from_secs(1), task).await;
    }
    drop(control_thread);
    crate::exit::OK
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit; returns the limits now in force
/// (soft, hard).
///
/// Every connection of the two listeners and every connection to a node is a descriptor,
/// and container runtimes start processes at a soft limit of 1,024 under a much higher hard
/// limit: the soft one would run out long before the sidecar's own bounds do. Only `run`
/// raises it: `guard`'s CMD inherits its limits, and must get them as given (a program
/// that closes every descriptor up to the soft limit would be slowed down).
pub fn raise_open_files_limit() -> std::io::Result<(libc::rlim_t, libc::rlim_t)> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit for the call to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if limit.rlim_cur < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: `limit` is a valid rlimit; the kernel only reads it.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok((limit.rlim_cur, limit.rlim_max))
}

/// Logs the figures the timing model implies, once.
fn log_timing(cfg: &RunConfig) {
    let r = &cfg.redlock;
    let crash_takeover = r.ttl + r.retry_max;
    info!(
        ttl = ?r.ttl,
        renew_interval = ?cfg.renewal.interval,
        safety_margin = ?cfg.renewal.safety_margin,
        node_timeout = ?r.node_timeout,
        drift = ?drift(r.ttl),
        worst_case_takeover_after_crash = ?crash_takeover,
        takeover_after_release = "one round trip (pub/sub wake-up)",
        shutdown_timeout = ?cfg.shutdown_timeout,
        "timing model"
    );
}

/// How often the credentials' fingerprint is taken again (a rotated Secret reaches the pod's
/// files within about a minute).
const CREDENTIALS_EVERY: Duration = Duration::from_secs(5);

/// Keeps `redlock_credentials_info` on the fingerprint of the credentials the first node's
/// next connection uses (every node gets the same flags and files).
async fn follow_credentials(
    redlock: crate::redlock::Redlock,
    metrics: Arc<crate::metrics::Metrics>,
) {
    let Some(node) = redlock.nodes().first() else {
        return;
    };
    let salt = redlock.config().lock.clone();
    loop {
        metrics.credentials(node.credentials_fingerprint(&salt).await.as_deref());
        clock::pause(CREDENTIALS_EVERY).await;
    }
}

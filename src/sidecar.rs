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

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::candidacy::{presence, probe, Candidacy, CandidacyRx, CandidacyTx};
use crate::clock;
use crate::config::{AppProbe, RunConfig};
use crate::control_thread::ControlThread;
use crate::http::{self, AdminState};
use crate::k8s::{self, Kube};
use crate::leadership::LeadershipRx;
use crate::lease;
use crate::locks;
use crate::metrics::Metrics;
use crate::redlock::{drift, Engine, Redlock};
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
    let (control_listener, dapr_grpc_listener) = bind_control(&cfg, &control_thread).await;
    let Connected {
        engine,
        redlock,
        metrics,
        kube,
    } = connect(&cfg).await;
    log_timing(&cfg);
    tokio::spawn(ops::warn_about_nodes(redlock.clone()));

    let (tx, rx) = lease::channel(&redlock);
    let wiring = Wiring {
        cfg: &cfg,
        control_thread: &control_thread,
        metrics: &metrics,
        rx: &rx,
        cancel: CancellationToken::new(),
        http_stop: CancellationToken::new(),
    };
    info!(listen = %cfg.listen, lock = %cfg.redlock.lock, identity = %cfg.redlock.identity, nodes = cfg.redlock.nodes.len(), "redlock-sidecar running");
    let http_task = wiring.serve_admin(listener);
    let (candidacy_tx, candidacy_rx) = wiring.candidacy(&redlock, kube.as_ref());
    let request_locks = wiring.request_locks(&engine, dapr_grpc_listener);
    let (shards_task, shards_routes) = wiring.shards(&engine, &redlock, &candidacy_rx);
    let routes = match (request_locks.routes, shards_routes) {
        (Some(locks), Some(shards)) => Some(locks.merge(shards)),
        (locks, shards) => locks.or(shards),
    };
    let control_task = wiring.serve_control(control_listener, candidacy_tx, routes);
    tokio::spawn(Arc::clone(&metrics).follow(rx.clone()));
    let kube_task = kube.map(|kube| {
        tokio::spawn(kube.observe(rx.clone(), wiring.cancel.clone(), cfg.shutdown_timeout))
    });
    let lease_task = tokio::spawn(lease::run(
        redlock,
        cfg.renewal,
        tx,
        Arc::clone(&metrics),
        candidacy_rx,
        wiring.cancel.clone(),
    ));

    signals.first().await;
    let leadership = async {
        let _ = lease_task.await;
        if let Some(kube_task) = kube_task {
            let _ = kube_task.await;
        }
        if let Some(shards_task) = shards_task {
            let _ = shards_task.await;
        }
    };
    wiring.release(leadership, request_locks.locks).await;
    wiring
        .stop_listeners(http_task, control_task, request_locks.dapr_grpc_task)
        .await;
    drop(control_thread);
    crate::exit::OK
}

/// Binds the control listener, and Dapr's gRPC API if asked for, on the control thread (see
/// `control_thread`), so that its reactor serves them; exits 2 when one cannot be bound.
async fn bind_control(
    cfg: &RunConfig,
    control_thread: &ControlThread,
) -> (TcpListener, Option<TcpListener>) {
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
    (control_listener, dapr_grpc_listener)
}

/// The engine on the nodes, the leadership lock on it with its metrics, and the Kubernetes
/// client (if on).
struct Connected {
    engine: Engine,
    redlock: Redlock,
    metrics: Arc<Metrics>,
    kube: Option<Kube>,
}

/// Connects to the nodes and to the Kubernetes API; exits 2 on a configuration they refuse.
async fn connect(cfg: &RunConfig) -> Connected {
    let kube_errors = k8s::errors_counter();
    // One engine for every lock of the process: the leadership lock and the request locks
    // share its connections (see `redlock::Engine`). Connected first (bounded by the connect
    // timeout), so that the nodes' mode is known and the leadership lock takes the shared set.
    let engine = Engine::new(&cfg.redlock)
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
    Connected {
        engine,
        redlock,
        metrics,
        kube,
    }
}

/// What the parts of a running sidecar share.
struct Wiring<'a> {
    cfg: &'a RunConfig,
    control_thread: &'a ControlThread,
    metrics: &'a Arc<Metrics>,
    rx: &'a LeadershipRx,
    /// Ends the lock loop and the tasks that follow it (first, at shutdown).
    cancel: CancellationToken,
    /// Ends the listeners (last, at shutdown).
    http_stop: CancellationToken,
}

/// The request locks, when on.
struct RequestLocks {
    /// The service, on the control thread.
    locks: Option<Arc<locks::Locks<locks::RedlockEngine>>>,
    /// Its routes and Dapr's HTTP API, for the control listener.
    routes: Option<axum::Router>,
    /// Dapr's gRPC API, on its own listener.
    dapr_grpc_task: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
}

impl Wiring<'_> {
    /// Serves the admin endpoint on `listener` until the listeners stop.
    fn serve_admin(&self, listener: TcpListener) -> JoinHandle<()> {
        let admin = AdminState {
            leadership: self.rx.clone(),
            metrics: self.metrics.clone(),
            ready_when: self.cfg.ready_when,
            shutdown: self.http_stop.clone(),
        };
        tokio::spawn(async move {
            if let Err(err) = http::serve(listener, admin).await {
                warn!(error = %err, "admin endpoint stopped");
            }
        })
    }

    /// Serves the control listener on its thread (resign, and the request locks' `routes`)
    /// until the listeners stop.
    fn serve_control(
        &self,
        listener: TcpListener,
        candidacy: CandidacyTx,
        routes: Option<axum::Router>,
    ) -> JoinHandle<std::io::Result<()>> {
        let control = http::control_router(
            http::ControlState {
                leadership: self.rx.clone(),
                candidacy,
                default_hold: self.cfg.redlock.ttl,
            },
            routes,
        );
        self.control_thread.spawn(http::serve_router(
            listener,
            control,
            self.http_stop.clone(),
        ))
    }

    /// This sidecar's standing as a candidate, kept by its tasks: the credentials'
    /// fingerprint, its presence on the nodes, and the app's readiness (when checked).
    fn candidacy(&self, redlock: &Redlock, kube: Option<&Kube>) -> (CandidacyTx, CandidacyRx) {
        let cfg = self.cfg;
        let candidacy = match &cfg.app_check {
            Some(check) => Candidacy::checked(check.unready_after),
            None => Candidacy::unchecked(),
        };
        let (candidacy_tx, candidacy_rx) = tokio::sync::watch::channel(
            candidacy.named(&cfg.redlock.identity, presence::born_ms()),
        );
        tokio::spawn(follow_credentials(redlock.clone(), self.metrics.clone()));
        tokio::spawn(presence::run(
            redlock.clone(),
            candidacy_tx.clone(),
            self.metrics.clone(),
            self.cancel.clone(),
        ));
        if let Some(check) = cfg.app_check.clone() {
            match check.probe {
                AppProbe::Http(url) => {
                    tokio::spawn(probe::run(url, check.interval, candidacy_tx.clone()));
                }
                AppProbe::Container(name) => {
                    let Some(kube) = kube.cloned() else {
                        crate::config::exit_invalid(
                            "--follow-container: needs the Kubernetes integration (in a pod, with POD_NAME set and --kubernetes auto or on)",
                        )
                    };
                    tokio::spawn(kube.follow_container(name, check.interval, candidacy_tx.clone()));
                }
            }
        }
        (candidacy_tx, candidacy_rx)
    }

    /// The shards, with `--shards`: the member's loop on `engine` (stopped by `cancel`) and its
    /// route for the control listener.
    fn shards(
        &self,
        engine: &Engine,
        redlock: &Redlock,
        candidacy: &CandidacyRx,
    ) -> (Option<JoinHandle<()>>, Option<axum::Router>) {
        let Some(shards) = self.cfg.shards else {
            return (None, None);
        };
        let count = shards.count;
        let (tx, rx) = crate::shards::channel(count);
        let app = crate::shards::api::AppSide::new();
        let group = crate::shards::Group {
            engine: engine.clone(),
            app: Arc::clone(&app),
            revoke_timeout: shards.revoke_timeout,
            redlock: redlock.clone(),
            count,
            renewal: self.cfg.renewal,
            candidacy: candidacy.clone(),
            born_ms: candidacy
                .borrow()
                .announced(crate::clock::Deadline::now())
                .born_ms,
            metrics: Arc::clone(self.metrics),
            cancel: self.cancel.clone(),
        };
        let task = tokio::spawn(crate::shards::run(group, tx));
        let routes = crate::shards::api::router(rx, self.cfg.redlock.identity.clone(), app);
        (Some(task), Some(routes))
    }

    /// The request locks, if on: the service on the control thread over `engine`, its routes
    /// with Dapr's, and Dapr's gRPC API served on `dapr_grpc_listener`.
    fn request_locks(
        &self,
        engine: &Engine,
        dapr_grpc_listener: Option<TcpListener>,
    ) -> RequestLocks {
        let cfg = self.cfg;
        let locks = cfg.locks.as_ref().map(|settings| {
            self.control_thread.enter(|| {
                let engine = locks::RedlockEngine::new(
                    engine.clone(),
                    cfg.redlock.clone(),
                    &settings.prefix,
                    self.metrics.clone(),
                );
                locks::Locks::new(
                    engine,
                    settings.max_leases,
                    self.metrics.app_locks().clone(),
                )
            })
        });
        let dapr_runtime = cfg.locks.as_ref().map(|settings| {
            let (identity, store) = (&cfg.redlock.identity, &settings.dapr_store);
            let dapr_grpc = settings.dapr_grpc_listen;
            locks::dapr::Runtime::new(
                identity,
                store,
                dapr_grpc,
                self.rx.clone(),
                self.cancel.clone(),
            )
        });
        let routes = locks
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
                self.control_thread.spawn(locks::dapr_grpc::serve(
                    listener,
                    grpc,
                    self.http_stop.clone(),
                ))
            },
        );
        RequestLocks {
            locks,
            routes,
            dapr_grpc_task,
        }
    }

    /// The shutdown's releases, side by side and within `--shutdown-timeout`: the leadership
    /// lock (`leadership`: the lock loop, then the Kubernetes label) and every request lock.
    async fn release(
        &self,
        leadership: impl std::future::Future<Output = ()>,
        locks: Option<Arc<locks::Locks<locks::RedlockEngine>>>,
    ) {
        self.cancel.cancel();
        let drained = clock::within(self.cfg.shutdown_timeout, async {
            let request_locks = async {
                if let Some(locks) = locks {
                    let _ = self
                        .control_thread
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
                warn!(timeout = ?self.cfg.shutdown_timeout, "shutdown timed out; the lock expires on its own")
            }
        }
    }

    /// The end of the shutdown: the listeners stop, each given a second to finish what it
    /// serves.
    async fn stop_listeners(
        &self,
        http_task: JoinHandle<()>,
        control_task: JoinHandle<std::io::Result<()>>,
        dapr_grpc_task: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
    ) {
        self.http_stop.cancel();
        let _ = clock::within(Duration::from_secs(1), http_task).await;
        let _ = clock::within(Duration::from_secs(1), control_task).await;
        if let Some(task) = dapr_grpc_task {
            let _ = clock::within(Duration::from_secs(1), task).await;
        }
    }
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
    let Some(node) = redlock.nodes().first().and_then(|node| node.connection()) else {
        return;
    };
    let salt = redlock.config().lock.clone();
    loop {
        metrics.credentials(node.credentials_fingerprint(&salt).await.as_deref());
        clock::pause(CREDENTIALS_EVERY).await;
    }
}

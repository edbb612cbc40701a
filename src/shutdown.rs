//! Signals in one place.
//!
//! SIGTERM is how Kubernetes (and most supervisors) ask a container to stop; SIGINT is
//! Ctrl-C in a terminal. The first one starts the graceful shutdown (step down, release,
//! exit 0); a second one exits at once, for an operator who does not want to wait.

use tokio::signal::unix::{signal, SignalKind};
use tracing::{info, warn};

/// Completes on the first SIGTERM or SIGINT, then arms the second-signal exit.
pub async fn first_signal() {
    let name = wait_for_signal().await;
    info!(
        signal = name,
        "shutting down: stepping down and releasing the lock"
    );
    tokio::spawn(async {
        let name = wait_for_signal().await;
        warn!(signal = name, "second signal: exiting at once");
        std::process::exit(130);
    });
}

async fn wait_for_signal() -> &'static str {
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler can be installed");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler can be installed");
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

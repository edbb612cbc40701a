//! Signals in one place.
//!
//! SIGTERM is how Kubernetes (and most supervisors) ask a container to stop; SIGINT is
//! Ctrl-C in a terminal. The first one starts the graceful shutdown (step down, release,
//! exit 0); a second one exits at once, for an operator who does not want to wait.
//! The handlers are installed before anything else starts, so a SIGTERM that arrives
//! right after the first acquisition still releases the lock instead of killing the process.

use tokio::signal::unix::{signal, Signal, SignalKind};
use tracing::{info, warn};

/// SIGTERM and SIGINT handlers, installed.
pub struct Signals {
    term: Signal,
    int: Signal,
}

impl Signals {
    /// Installs the handlers (must run inside the Tokio runtime).
    pub fn install() -> std::io::Result<Signals> {
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// Completes on the first SIGTERM or SIGINT; a later one exits the process at once.
    pub async fn first(mut self) {
        let name = self.next().await;
        info!(
            signal = name,
            "shutting down: stepping down and releasing the lock"
        );
        tokio::spawn(async move {
            let name = self.next().await;
            warn!(signal = name, "second signal: exiting at once");
            crate::exit::now(crate::exit::INTERRUPTED);
        });
    }

    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

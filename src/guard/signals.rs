//! The signals guard handles: before CMD starts they stop guard, then they go to CMD.

use tokio::signal::unix::{signal, Signal, SignalKind};

/// Handlers for SIGTERM, SIGINT, SIGHUP and SIGQUIT, installed on creation.
pub struct Signals(Vec<(i32, Signal)>);

impl Signals {
    /// Installs the handlers; guard creates this first, so that no signal from then on can
    /// kill it with the lock left behind.
    pub fn new() -> Signals {
        let kinds = [
            (libc::SIGTERM, SignalKind::terminate()),
            (libc::SIGINT, SignalKind::interrupt()),
            (libc::SIGHUP, SignalKind::hangup()),
            (libc::SIGQUIT, SignalKind::quit()),
        ];
        Signals(
            kinds
                .into_iter()
                .filter_map(|(num, kind)| signal(kind).ok().map(|s| (num, s)))
                .collect(),
        )
    }

    /// The next signal's number (cancel-safe: a signal counts once it is returned).
    pub async fn recv(&mut self) -> i32 {
        if self.0.is_empty() {
            return std::future::pending().await;
        }
        let waits = self.0.iter_mut().map(|(num, s)| {
            let num = *num;
            Box::pin(async move {
                if s.recv().await.is_none() {
                    std::future::pending::<()>().await;
                }
                num
            })
        });
        futures_util::future::select_all(waits).await.0
    }
}

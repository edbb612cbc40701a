//! Logging that never blocks the threads that renew the lock and fence CMD.
//!
//! Log lines go to stderr through a bounded queue and a writer thread of their own
//! (`tracing-appender`'s non-blocking writer, lossy). A stderr that stops draining (a pipe
//! nobody reads, a stalled log collector) fills the queue; from then on new lines are dropped
//! and counted ([`dropped_lines`], exported as `redlock_log_lines_dropped_total`) instead of
//! stopping the runtime thread in `write(2)` with the lock's renewals and deadlines behind it.

use std::sync::OnceLock;

use tracing_appender::non_blocking::{ErrorCounter, NonBlockingBuilder, WorkerGuard};

use crate::config::LogFormat;

/// Lines held for a slow stderr before new ones are dropped.
const QUEUED_LINES: usize = 16_384;

static DROPPED: OnceLock<ErrorCounter> = OnceLock::new();

/// Flushes what is queued when dropped (bounded: about a second at most, then gives up).
pub struct Flush(#[allow(dead_code)] WorkerGuard);

/// Installs the global subscriber: `REDLOCK_LOG` filter (default `info`), text or JSON. Keep
/// the returned [`Flush`] until the process exits.
pub fn init(format: LogFormat) -> Flush {
    let (writer, guard) = NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(QUEUED_LINES)
        .thread_name("redlock-log")
        .finish(std::io::stderr());
    let _ = DROPPED.set(writer.error_counter());
    let filter = tracing_subscriber::EnvFilter::try_from_env("REDLOCK_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(writer);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
    Flush(guard)
}

/// Log lines dropped so far because stderr did not keep up.
pub fn dropped_lines() -> u64 {
    DROPPED.get().map_or(0, |c| c.dropped_lines() as u64)
}

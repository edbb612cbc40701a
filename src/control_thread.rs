//! The control listener and the request locks behind it, on a thread of their own.
//!
//! ## Why
//! - **One thread for a request's whole path.** An app's lock request is read, decided,
//!   sent to the nodes and answered on this one thread, with its own reactor: no wake-up of
//!   another worker thread between the steps. On two shared cores that took 30 to 70 µs
//!   off the p50 of an acquire + release over HTTP (`cargo bench --bench locks`, see
//!   docs/benchmarks-history.md).
//! - **App traffic never delays the leadership lock.** Its renewals and its step-down stay on
//!   the main runtime, whatever load the apps put on the request-lock API.
//!
//! Everything the control listener serves runs here: its routes, the request-lock service
//! (its one timer task, and a task for each lease only while it renews or releases), and the
//! connections of their engine (they are dialled from here, so this thread's reactor drives
//! them). Its timers cost no descriptor: they wait on the process' shared boot-clock timer
//! (`crate::clock::shared`), whose thread wakes them here.

use std::future::Future;
use std::thread::JoinHandle;

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

/// The thread's name (shown by `top -H`, `perf` and panics).
pub const NAME: &str = "redlock-control";

/// A single-threaded runtime on its own OS thread; stopped when dropped (its tasks are
/// dropped with it).
pub struct ControlThread {
    handle: Handle,
    stop: CancellationToken,
    thread: Option<JoinHandle<()>>,
}

impl ControlThread {
    /// Starts the thread and its runtime.
    pub fn start() -> std::io::Result<ControlThread> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name(NAME.to_owned())
            .spawn(move || runtime.block_on(stopped.cancelled()))?;
        Ok(ControlThread {
            handle,
            stop,
            thread: Some(thread),
        })
    }

    /// Runs `task` on the thread; its handle can be awaited from any runtime.
    pub fn spawn<F>(&self, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.handle.spawn(task)
    }

    /// Runs `make` with this runtime as the current one: whatever it spawns or registers
    /// belongs to the thread.
    pub fn enter<T>(&self, make: impl FnOnce() -> T) -> T {
        let _entered = self.handle.enter();
        make()
    }
}

impl Drop for ControlThread {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(thread) = self.thread.take() {
            // Returns as soon as the runtime's current task yields: its tasks are dropped.
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tasks_and_what_they_register_run_on_the_control_thread_until_it_is_dropped() {
        let control = ControlThread::start().expect("the thread starts");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        listener.set_nonblocking(true).expect("non-blocking");
        let addr = listener.local_addr().expect("bound");
        // Registered with the control thread's reactor, then served there.
        let listener = control.enter(|| tokio::net::TcpListener::from_std(listener).unwrap());
        let served = control.spawn(async move {
            let (_stream, _) = listener.accept().await.expect("accepts");
            std::thread::current().name().map(str::to_owned)
        });
        let _client = tokio::net::TcpStream::connect(addr)
            .await
            .expect("connects");
        let thread = crate::clock::within(std::time::Duration::from_secs(10), served)
            .await
            .expect("served within the deadline")
            .expect("no panic");
        assert_eq!(thread.as_deref(), Some(NAME));

        let forever = control.spawn(std::future::pending::<()>());
        drop(control);
        let ended = forever.await.expect_err("a task of a dropped thread ends");
        assert!(ended.is_cancelled());
    }
}

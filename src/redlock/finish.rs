//! Work that must never stop half-way, run where it is awaited.

use std::future::Future;
use std::pin::Pin;

/// A future run in place that, if dropped before it finishes, finishes as a task of its own:
/// the cheap way to run work that must never stop half-way (an acquisition round may have
/// written keys; a delete the client sheds unsent leaves our key for a ttl) from a caller
/// that may go away or stop waiting. Run in place, it costs no hand-over to another task.
pub(crate) struct FinishOnDrop<F>(Option<Pin<Box<F>>>)
where
    F: Future + Send + 'static,
    F::Output: Send + 'static;

impl<F> FinishOnDrop<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    pub(crate) fn new(work: F) -> Self {
        FinishOnDrop(Some(Box::pin(work)))
    }

    /// Runs the work to its end here (dropped first: to its end as a task).
    pub(crate) async fn run(mut self) -> F::Output {
        std::future::poll_fn(|cx| {
            // Cannot fail: `poll_fn` is not polled again once it returned `Ready`, and only
            // that return takes the work out.
            let work = self.0.as_mut().expect("polled only until it finishes");
            let done = work.as_mut().poll(cx);
            if done.is_ready() {
                self.0 = None;
            }
            done
        })
        .await
    }
}

impl<F> Drop for FinishOnDrop<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        if let Some(work) = self.0.take() {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn(work)),
                // No runtime (it is shutting down): nothing can run any more.
                Err(_) => drop(work),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::sync::Notify;

    use super::*;

    #[tokio::test]
    async fn work_dropped_half_way_finishes_as_its_own_task() {
        let go = Arc::new(Notify::new());
        let done = Arc::new(AtomicUsize::new(0));
        let run = FinishOnDrop::new({
            let (go, done) = (Arc::clone(&go), Arc::clone(&done));
            async move {
                go.notified().await;
                done.fetch_add(1, Ordering::SeqCst);
            }
        })
        .run();
        // Started, then dropped while it waits (its caller went away).
        let started = crate::clock::within(Duration::from_millis(20), run).await;
        assert!(started.is_err(), "it waits for `go`");
        go.notify_one();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while done.load(Ordering::SeqCst) == 0 {
            assert!(tokio::time::Instant::now() < deadline, "it finished");
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn work_run_to_its_end_runs_once_and_gives_its_output() {
        let done = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&done);
        let output = FinishOnDrop::new(async move { counted.fetch_add(1, Ordering::SeqCst) + 7 })
            .run()
            .await;
        tokio::task::yield_now().await;
        assert_eq!(output, 7);
        assert_eq!(done.load(Ordering::SeqCst), 1);
    }
}

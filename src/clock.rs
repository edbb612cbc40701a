//! Waiting on the lock clock: sleeps and timeouts on `CLOCK_BOOTTIME`, counting time the host
//! spent suspended.
//!
//! The clock itself ([`Deadline`], [`boottime`]) lives in the lease core
//! (`redlock_core::clock`), which only reads it. Tokio's timers follow `CLOCK_MONOTONIC`, which
//! stops while the host is suspended, so every timer of the engine, the lease, guard and the
//! Kubernetes observer waits here instead; clippy's `disallowed-methods` (clippy.toml) keeps
//! Tokio's and std's own sleeps and `Instant::now()` out of the rest of `src/`.
//!
//! `Instant` stays where a value only measures an elapsed time for a metric or a log.
//!
//! ## Behaviour
//! - [`sleep_until_deadline`] waits on the process' one shared `CLOCK_BOOTTIME` timer (see
//!   [`shared`]): a deadline that passed during a suspend fires as soon as the process runs
//!   again, and a sleep costs no file descriptor of its own, however many wait at once (every
//!   request lease, waiter and node call of the sidecar sleeps there). Should the kernel refuse
//!   the timer or its thread, each sleep arms a timerfd of its own, and without one it sleeps
//!   on Tokio's timer in slices of at most [`FALLBACK_SLICE`].

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;

pub use redlock_core::clock::{boottime, Deadline};

/// Longest single Tokio sleep when no timerfd is available.
pub const FALLBACK_SLICE: Duration = Duration::from_millis(100);

/// Sleeps until the clock reaches `deadline`, counting suspended time.
pub async fn sleep_until_deadline(deadline: Deadline) {
    if let Some(timer) = shared::Timer::get() {
        return timer.sleep_until(deadline).await;
    }
    if let Some(timer) = boot_timer(deadline.boottime()) {
        // One wake-up: the timer fires at the deadline, or at once if it is past.
        let _ = timer.readable().await;
    }
    // Without a timer (and as a guard against an early wake-up): short Tokio sleeps.
    loop {
        let left = deadline.saturating_duration_since(Deadline::now());
        if left.is_zero() {
            return;
        }
        pause(left.min(FALLBACK_SLICE)).await;
    }
}

pub mod shared {
    //! One `CLOCK_BOOTTIME` timer for every sleep of the process.
    //!
    //! A timerfd per sleep costs a descriptor and five system calls, and a process that holds
    //! a thousand request leases (or waits a thousand node calls at once) would need a thousand
    //! descriptors for its timers alone. Here every sleeper is one entry in an ordered map
    //! (deadline, sleeper) → waker, and one timerfd, armed for the earliest entry, is waited on
    //! by one small thread (`redlock-timer`) that wakes the sleepers whose deadline has come.
    //!
    //! ## Behaviour
    //! - One descriptor and one thread for the process, made on first use; runtime-agnostic
    //!   (wakers from any Tokio runtime, the control thread's included).
    //! - A sleep re-reads the boot clock whenever it is polled: it ends at its deadline or
    //!   later, never before, and a deadline that passed during a host suspend ends at once
    //!   when the host resumes (the timer counts suspended time).
    //! - A sleep dropped before its deadline leaves the map at once.
    //! - In a process forked from this one without `exec` (the thread does not survive a
    //!   fork), [`Timer::get`] answers `None`, and the caller arms a timer of its own.

    use std::collections::BTreeMap;
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
    use std::task::{Context, Poll, Waker};

    use super::{BootTimer, Deadline};

    /// The timer thread's stack: it only moves wakers.
    const STACK: usize = 64 * 1024;

    /// The process' timer; `None` if it could not be made.
    static TIMER: LazyLock<Option<Arc<Timer>>> = LazyLock::new(Timer::start);

    /// The shared timer: the sleepers, and the one timerfd armed for the earliest.
    pub struct Timer {
        fd: BootTimer,
        state: Mutex<State>,
        /// The process that started the thread.
        pid: u32,
    }

    #[derive(Default)]
    struct State {
        /// Every pending sleep: (deadline, sleep id) → its waker.
        sleepers: BTreeMap<(Deadline, u64), Waker>,
        next_id: u64,
        /// The deadline the timerfd is armed for, while one is.
        armed: Option<Deadline>,
    }

    impl Timer {
        /// The process' timer, if there is one in this process.
        pub fn get() -> Option<&'static Timer> {
            let timer = TIMER.as_deref()?;
            (timer.pid == std::process::id()).then_some(timer)
        }

        fn start() -> Option<Arc<Timer>> {
            let timer = Arc::new(Timer {
                fd: BootTimer::new()?,
                state: Mutex::new(State::default()),
                pid: std::process::id(),
            });
            let runs = Arc::clone(&timer);
            std::thread::Builder::new()
                .name("redlock-timer".to_owned())
                .stack_size(STACK)
                .spawn(move || runs.run())
                .ok()?;
            Some(timer)
        }

        fn state(&self) -> MutexGuard<'_, State> {
            self.state.lock().unwrap_or_else(|e| e.into_inner())
        }

        /// Sleeps until the boot clock reaches `deadline`.
        pub fn sleep_until(&'static self, deadline: Deadline) -> Sleep {
            Sleep {
                timer: self,
                deadline,
                id: None,
            }
        }

        /// How many sleeps are pending (for tests and status).
        pub fn pending(&self) -> usize {
            self.state().sleepers.len()
        }

        #[cfg(test)]
        pub(super) fn state_for_tests(&self) -> BTreeMap<(Deadline, u64), Waker> {
            self.state().sleepers.clone()
        }

        /// The thread: waits for the timerfd, wakes the sleepers that are due, arms for the
        /// next one.
        fn run(&self) {
            loop {
                let mut ready = libc::pollfd {
                    fd: std::os::fd::AsRawFd::as_raw_fd(&self.fd),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: poll reads and writes the one pollfd we own; the descriptor lives
                // as long as `self`.
                let polled = unsafe { libc::poll(&mut ready, 1, -1) };
                if polled < 0 {
                    // EINTR; anything else cannot happen with one valid descriptor.
                    continue;
                }
                self.fd.clear();
                let due = self.take_due(Deadline::now());
                for waker in due {
                    waker.wake();
                }
            }
        }

        /// Removes the sleepers due at `now` (their wakers, to wake outside the lock) and
        /// arms the timer for the next one.
        fn take_due(&self, now: Deadline) -> Vec<Waker> {
            let mut state = self.state();
            let later = state.sleepers.split_off(&(now, u64::MAX));
            let due = std::mem::replace(&mut state.sleepers, later);
            state.armed = None;
            if let Some(&(next, _)) = state.sleepers.keys().next() {
                self.arm(&mut state, next);
            }
            due.into_values().collect()
        }

        /// Arms the timerfd for `at` (under the state's lock, so that the thread and the
        /// sleepers agree on what it is armed for).
        fn arm(&self, state: &mut State, at: Deadline) {
            if self.fd.arm(at.boottime()).is_ok() {
                state.armed = Some(at);
            }
        }

        /// Registers (or updates) sleep `id` for `deadline`; its id.
        fn register(&self, id: Option<u64>, deadline: Deadline, waker: &Waker) -> u64 {
            let mut state = self.state();
            let id = id.unwrap_or_else(|| {
                state.next_id += 1;
                state.next_id
            });
            match state.sleepers.get_mut(&(deadline, id)) {
                Some(known) if known.will_wake(waker) => {}
                Some(known) => known.clone_from(waker),
                None => {
                    state.sleepers.insert((deadline, id), waker.clone());
                }
            }
            if state.armed.is_none_or(|armed| deadline < armed) {
                self.arm(&mut state, deadline);
            }
            id
        }

        fn deregister(&self, deadline: Deadline, id: u64) {
            self.state().sleepers.remove(&(deadline, id));
        }
    }

    /// A sleep on the shared timer (see [`Timer::sleep_until`]).
    pub struct Sleep {
        timer: &'static Timer,
        deadline: Deadline,
        /// Its entry in the map, once registered.
        pub(super) id: Option<u64>,
    }

    impl Future for Sleep {
        type Output = ();

        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            if Deadline::now() >= self.deadline {
                if let Some(id) = self.id.take() {
                    self.timer.deregister(self.deadline, id);
                }
                return Poll::Ready(());
            }
            let id = self.timer.register(self.id, self.deadline, cx.waker());
            self.id = Some(id);
            Poll::Pending
        }
    }

    impl Drop for Sleep {
        fn drop(&mut self) {
            if let Some(id) = self.id.take() {
                self.timer.deregister(self.deadline, id);
            }
        }
    }
}

/// Where a component reads and waits for its deadlines: the boot clock (what runs), or
/// Tokio's clock, for tests that pause and advance time (`tokio::time::pause` moves Tokio's
/// clock; the boot clock would not move). Deadlines are [`Deadline`]s either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Clock {
    /// `CLOCK_BOOTTIME`: counts time the host spent suspended.
    #[default]
    Boot,
    /// Tokio's clock (`CLOCK_MONOTONIC`, or the paused clock of a test).
    Tokio,
}

impl Clock {
    /// The clock's reading now.
    pub fn now(self) -> Deadline {
        match self {
            Clock::Boot => Deadline::now(),
            #[allow(clippy::disallowed_methods)] // the test clock, paused in tests
            Clock::Tokio => Deadline::from_instant(tokio::time::Instant::now().into_std()),
        }
    }

    /// Sleeps until this clock reaches `deadline`.
    pub async fn sleep_until(self, deadline: Deadline) {
        match self {
            Clock::Boot => sleep_until_deadline(deadline).await,
            Clock::Tokio => {
                let at = tokio::time::Instant::from_std(deadline.to_instant());
                #[allow(clippy::disallowed_methods)] // the test clock's own sleep
                tokio::time::sleep_until(at).await
            }
        }
    }

    /// Sleeps until `deadline` if there is one; never returns otherwise (a `select!` branch
    /// for "the next thing due, if any").
    pub async fn sleep_until_some(self, deadline: Option<Deadline>) {
        match deadline {
            Some(at) => self.sleep_until(at).await,
            None => std::future::pending().await,
        }
    }

    /// Runs `future` until this clock reaches `deadline`.
    pub async fn timeout_at<F: std::future::Future>(
        self,
        deadline: Deadline,
        future: F,
    ) -> Result<F::Output, DeadlinePassed> {
        tokio::select! {
            biased;
            output = future => Ok(output),
            () = self.sleep_until(deadline) => Err(DeadlinePassed),
        }
    }

    /// Runs `future` for at most `limit` on this clock.
    pub async fn timeout<F: std::future::Future>(
        self,
        limit: Duration,
        future: F,
    ) -> Result<F::Output, DeadlinePassed> {
        self.timeout_at(self.now() + limit, future).await
    }
}

/// `future` did not finish by its deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("deadline passed")]
pub struct DeadlinePassed;

/// A pause of `duration` on Tokio's timer, for what no lock deadline depends on (a poll period,
/// a spread among waiters, a grace before closing): cheap with many sleepers; a suspend only
/// makes it longer. A lock deadline waits with [`sleep_until_deadline`].
#[allow(clippy::disallowed_methods)] // the one place Tokio's relative sleep is made
pub fn pause(duration: Duration) -> tokio::time::Sleep {
    tokio::time::sleep(duration)
}

/// Runs `future` for at most `bound` on Tokio's timer: one call's own bound (a read, a
/// connection, a grace), never a lock deadline, which is a [`Deadline`] and waits with
/// [`timeout_at`].
#[allow(clippy::disallowed_methods)] // the one place Tokio's relative timeout is made
pub async fn within<F: std::future::Future>(
    bound: Duration,
    future: F,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    tokio::time::timeout(bound, future).await
}

/// One call's own bound, fixed when the call starts and shared by its steps (a retry after a
/// reconnect gets what is left), on Tokio's timer like [`within`].
#[derive(Clone, Copy, Debug)]
pub struct CallBound(tokio::time::Instant);

impl CallBound {
    /// A bound `duration` from now.
    #[allow(clippy::disallowed_methods)] // Tokio's clock, for Tokio's timer
    pub fn after(duration: Duration) -> CallBound {
        CallBound(tokio::time::Instant::now() + duration)
    }

    /// What is left of the bound now (zero once it passed).
    #[allow(clippy::disallowed_methods)] // Tokio's clock, for Tokio's timer
    pub fn left(self) -> Duration {
        self.0
            .saturating_duration_since(tokio::time::Instant::now())
    }

    /// Runs `future` until the bound.
    #[allow(clippy::disallowed_methods)] // the one place Tokio's timeout_at is made
    pub async fn run<F: std::future::Future>(
        self,
        future: F,
    ) -> Result<F::Output, tokio::time::error::Elapsed> {
        tokio::time::timeout_at(self.0, future).await
    }
}

/// Measures how long something took, for a metric or a log only (on `CLOCK_MONOTONIC`: never
/// a deadline).
#[derive(Clone, Copy, Debug)]
pub struct Stopwatch(Instant);

impl Stopwatch {
    /// Started now.
    #[allow(clippy::disallowed_methods)] // a latency, not a deadline
    pub fn start() -> Stopwatch {
        Stopwatch(Instant::now())
    }

    /// Time since the start.
    pub fn elapsed(self) -> Duration {
        self.0.elapsed()
    }
}

/// Runs `future` until the clock reaches `deadline`, counting suspended time (Tokio's
/// `timeout_at` would not: its clock stops while the host is suspended).
pub async fn timeout_at<F: std::future::Future>(
    deadline: Deadline,
    future: F,
) -> Result<F::Output, DeadlinePassed> {
    Clock::Boot.timeout_at(deadline, future).await
}

/// A non-blocking timerfd on `CLOCK_BOOTTIME` that fires at `target` (absolute).
fn boot_timer(target: Duration) -> Option<AsyncFd<OwnedFd>> {
    let fd = BootTimer::new()?;
    fd.arm(target).ok()?;
    // SAFETY: the descriptor is owned by the AsyncFd, so it stays open while registered.
    unsafe { AsyncFd::register(fd.0).ok() }
}

/// The latest reading a timer is armed for (about 272 years after boot): a deadline past it
/// (one that never comes, as `Deadline::from_boottime(Duration::MAX)`) waits there.
const LATEST_ARMABLE_SECS: u64 = 1 << 33;

/// A non-blocking timerfd on `CLOCK_BOOTTIME`: readable once the instant it is armed for has
/// come, counting time the host spent suspended. Usable from `poll(2)` without a runtime.
pub struct BootTimer(OwnedFd);

impl BootTimer {
    /// A disarmed timer; `None` if the kernel refuses one.
    pub fn new() -> Option<BootTimer> {
        // SAFETY: timerfd_create returns a new descriptor that only OwnedFd owns from here.
        unsafe {
            let fd =
                libc::timerfd_create(libc::CLOCK_BOOTTIME, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC);
            (fd >= 0).then(|| BootTimer(OwnedFd::from_raw_fd(fd)))
        }
    }

    /// Fires at `target` (a [`boottime`] reading), at once if it has passed; replaces any
    /// earlier arming.
    pub fn arm(&self, target: Duration) -> std::io::Result<()> {
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                // The kernel refuses readings past about 292 years; later is never anyway.
                tv_sec: target.as_secs().min(LATEST_ARMABLE_SECS) as libc::time_t,
                // A zero it_value would disarm the timer; a target in the past fires at once.
                tv_nsec: target.subsec_nanos().max(1) as libc::c_long,
            },
        };
        // SAFETY: timerfd_settime reads `spec`; the descriptor is ours.
        let armed = unsafe {
            libc::timerfd_settime(
                self.0.as_raw_fd(),
                libc::TFD_TIMER_ABSTIME,
                &spec,
                std::ptr::null_mut(),
            )
        };
        if armed != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Takes the expiry count, so that the descriptor is readable only at the next firing.
    pub fn clear(&self) {
        let mut count = 0u64;
        // SAFETY: read of 8 bytes into a local u64; the descriptor is non-blocking.
        unsafe { libc::read(self.0.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
    }
}

impl AsRawFd for BootTimer {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sleep_until_deadline_wakes_at_the_deadline_not_before() {
        let deadline = Deadline::now() + Duration::from_millis(30);
        sleep_until_deadline(deadline).await;
        assert!(Deadline::now() >= deadline);
    }

    #[tokio::test]
    async fn timeout_at_gives_the_output_in_time_and_gives_up_at_the_deadline() {
        let soon = Deadline::now() + Duration::from_secs(5);
        assert_eq!(timeout_at(soon, async { 7 }).await, Ok(7));
        let deadline = Deadline::now() + Duration::from_millis(20);
        let never = timeout_at(deadline, std::future::pending::<()>()).await;
        assert_eq!(never, Err(DeadlinePassed));
        assert!(Deadline::now() >= deadline);
    }

    #[tokio::test]
    async fn sleep_until_some_waits_for_a_deadline_and_forever_without_one() {
        let deadline = Deadline::now() + Duration::from_millis(20);
        Clock::Boot.sleep_until_some(Some(deadline)).await;
        assert!(Deadline::now() >= deadline);
        let forever = Clock::Boot.sleep_until_some(None);
        let after = Deadline::now() + Duration::from_millis(20);
        assert_eq!(timeout_at(after, forever).await, Err(DeadlinePassed));
    }

    #[tokio::test(start_paused = true)]
    async fn the_tokio_clock_follows_paused_time_and_the_boot_clock_does_not() {
        let (boot, tokio) = (Clock::Boot.now(), Clock::Tokio.now());
        Clock::Tokio
            .sleep_until(tokio + Duration::from_secs(3600))
            .await;
        let moved = Clock::Tokio.now().saturating_duration_since(tokio);
        assert!(moved >= Duration::from_secs(3600), "{moved:?}");
        let boot_moved = Clock::Boot.now().saturating_duration_since(boot);
        assert!(boot_moved < Duration::from_secs(60), "{boot_moved:?}");
        let gave_up = Clock::Tokio.timeout(Duration::from_secs(5), std::future::pending::<()>());
        assert_eq!(gave_up.await, Err(DeadlinePassed));
    }

    #[test]
    fn a_timer_takes_a_deadline_that_never_comes() {
        let timer = BootTimer::new().expect("a timerfd");
        timer
            .arm(Duration::MAX)
            .expect("armed at the latest reading");
    }

    /// The timerfds this process has open.
    fn timer_descriptors() -> usize {
        std::fs::read_dir("/proc/self/fd")
            .map(|dir| {
                dir.flatten()
                    .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                    .filter(|target| target.to_string_lossy().contains("timerfd"))
                    .count()
            })
            .unwrap_or(0)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_thousand_sleeps_share_one_timer_and_each_ends_at_its_deadline() {
        let timer = shared::Timer::get().expect("the shared timer runs");
        let start = Deadline::now();
        let sleeps: Vec<_> = (0..1_000u64)
            .map(|i| {
                let at = start + Duration::from_millis(200 + i % 50);
                tokio::spawn(async move {
                    sleep_until_deadline(at).await;
                    Deadline::now() >= at
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Other tests of this process may hold a timer or two of their own.
        assert!(
            timer_descriptors() < 10,
            "{} timerfds while 1,000 sleeps wait",
            timer_descriptors()
        );
        assert!(timer.pending() >= 900, "{} pending", timer.pending());
        for sleep in sleeps {
            assert!(sleep.await.unwrap(), "ended before its deadline");
        }
    }

    #[tokio::test]
    async fn a_sleep_dropped_before_its_deadline_leaves_the_timer() {
        let timer = shared::Timer::get().expect("the shared timer runs");
        let far = Deadline::now() + Duration::from_secs(3_600);
        let mut sleep = Box::pin(timer.sleep_until(far));
        assert!(futures_util::poll!(sleep.as_mut()).is_pending());
        assert!(timer.pending() >= 1);
        let sleep_id = sleep.id;
        drop(sleep);
        let state = timer.state_for_tests();
        assert!(sleep_id.is_some_and(|id| !state.contains_key(&(far, id))));
    }

    #[tokio::test]
    async fn sleep_until_a_past_deadline_returns_at_once() {
        let start = Deadline::now();
        sleep_until_deadline(start - Duration::from_millis(5)).await;
        assert!(Deadline::now() - start < Duration::from_secs(1));
    }
}

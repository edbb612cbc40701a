//! The clock every lock deadline is measured on: monotonic, and counting time the host
//! spent suspended.
//!
//! `std::time::Instant` follows `CLOCK_MONOTONIC`, which stops while the host is suspended
//! (VM pause, live migration, laptop sleep). The keys on the Redis nodes keep expiring
//! meanwhile, so a deadline on that clock would let a resumed process believe it still leads.
//! Every deadline of the rounds and the lease machine is therefore a [`Deadline`]: a
//! `CLOCK_BOOTTIME` reading, a type of its own so that it cannot be mixed with an `Instant` by
//! mistake.
//!
//! This crate only reads the clock and computes with its readings; nothing here sleeps. The
//! sidecar's `clock` module waits on it (one shared timer for the process).
//!
//! ## Behaviour
//! - Without a suspend, [`Deadline::now`] moves as `Instant::now()` does; after one, it is
//!   ahead by the time spent suspended.
//! - A pure decision or the protocol model makes a `Deadline` from a number
//!   ([`Deadline::from_boottime`]) without reading any clock.

use std::sync::LazyLock;
use std::time::{Duration, Instant};

/// Process start on both clocks: the origin that maps `CLOCK_BOOTTIME` onto `Instant`.
#[allow(clippy::disallowed_methods)] // the one read of the monotonic clock: the origin
static ORIGIN: LazyLock<(Instant, Duration)> = LazyLock::new(|| (Instant::now(), boottime()));

/// The `CLOCK_BOOTTIME` reading: the same in every process of the host, so a deadline on it
/// can be handed to another process (guard's supervisor).
pub fn boottime() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own; CLOCK_BOOTTIME exists since Linux 2.6.39.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The `CLOCK_BOOTTIME` reading of the instant `at`, with the two clocks made to agree at
/// process start (they part only by time the host spent suspended since).
fn boottime_of(at: Instant) -> Duration {
    let (instant, boot) = *ORIGIN;
    match at.checked_duration_since(instant) {
        Some(after) => boot + after,
        None => boot.saturating_sub(instant - at),
    }
}

/// `start + duration`, saturating: if the sum is past what an `Instant` can hold, the latest
/// instant within reach (a deadline that never comes) instead of a panic.
fn saturating_add(start: Instant, duration: Duration) -> Instant {
    let mut duration = duration;
    loop {
        if let Some(at) = start.checked_add(duration) {
            return at;
        }
        // Halving ends: `start + 0` always fits.
        duration /= 2;
    }
}

/// A point in time on `CLOCK_BOOTTIME`: the one type every lock timer is measured in.
///
/// It is a plain reading (time since boot), so it is the same in every process of the host,
/// it orders and hashes, and a pure decision or the protocol model can make one from a number
/// (`Deadline::from_boottime`) without a clock. [`Deadline::now`] reads the clock;
/// [`sleep_until_deadline`] waits on it, counting time the host spent suspended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Deadline(Duration);

impl Deadline {
    /// The clock's reading now.
    pub fn now() -> Deadline {
        Deadline(boottime())
    }

    /// The instant whose `CLOCK_BOOTTIME` reading is `since_boot`.
    pub const fn from_boottime(since_boot: Duration) -> Deadline {
        Deadline(since_boot)
    }

    /// The `CLOCK_BOOTTIME` reading of this instant (what guard's supervisor is handed).
    pub const fn boottime(self) -> Duration {
        self.0
    }

    /// The same instant as an `Instant` (the two clocks made to agree at process start), for
    /// Tokio's timer ([`Clock::Tokio`]) and records kept as `Instant`s.
    pub fn to_instant(self) -> Instant {
        let (instant, boot) = *ORIGIN;
        match self.0.checked_sub(boot) {
            Some(after) => saturating_add(instant, after),
            None => instant.checked_sub(boot - self.0).unwrap_or(instant),
        }
    }

    /// The instant `at` as a deadline (the inverse of [`Deadline::to_instant`]).
    pub fn from_instant(at: Instant) -> Deadline {
        Deadline(boottime_of(at))
    }

    /// How long from `earlier` to this instant; zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Deadline) -> Duration {
        self.0.saturating_sub(earlier.0)
    }

    /// How long from `earlier` to this instant; `None` if `earlier` is later.
    pub fn checked_duration_since(self, earlier: Deadline) -> Option<Duration> {
        self.0.checked_sub(earlier.0)
    }

    /// This instant plus `d`, saturating at the latest instant there is.
    pub fn saturating_add(self, d: Duration) -> Deadline {
        Deadline(self.0.saturating_add(d))
    }

    /// This instant minus `d`, saturating at boot.
    pub fn saturating_sub(self, d: Duration) -> Deadline {
        Deadline(self.0.saturating_sub(d))
    }
}

impl std::ops::Add<Duration> for Deadline {
    type Output = Deadline;
    /// Saturating: a deadline past the end of time is one that never comes.
    fn add(self, d: Duration) -> Deadline {
        self.saturating_add(d)
    }
}

impl std::ops::Sub<Duration> for Deadline {
    type Output = Deadline;
    /// Saturating at boot.
    fn sub(self, d: Duration) -> Deadline {
        self.saturating_sub(d)
    }
}

impl std::ops::AddAssign<Duration> for Deadline {
    fn add_assign(&mut self, d: Duration) {
        *self = *self + d;
    }
}

impl std::ops::SubAssign<Duration> for Deadline {
    fn sub_assign(&mut self, d: Duration) {
        *self = *self - d;
    }
}

impl std::ops::Sub<Deadline> for Deadline {
    type Output = Duration;
    /// How long from `earlier` to this instant; zero if `earlier` is later (as `Instant`).
    fn sub(self, earlier: Deadline) -> Duration {
        self.saturating_duration_since(earlier)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Now on the boot clock, as an `Instant`.
    fn now() -> Instant {
        Deadline::now().to_instant()
    }

    #[test]
    fn now_follows_the_monotonic_clock_without_a_suspend() {
        let (a, b) = (Instant::now(), now());
        let diff = if b > a { b - a } else { a - b };
        assert!(diff < Duration::from_millis(50), "{diff:?}");
    }

    #[test]
    fn saturating_add_adds_and_never_overflows() {
        let start = now();
        let second = Duration::from_secs(1);
        assert_eq!(saturating_add(start, second), start + second);
        let far = saturating_add(start, Duration::MAX);
        assert!(
            far > start + Duration::from_secs(100 * 365 * 24 * 3600),
            "{far:?}"
        );
        assert!(far.checked_add(Duration::MAX).is_none());
    }

    #[test]
    fn boottime_of_maps_instants_onto_the_boot_clock() {
        let at = now();
        let boot = boottime_of(at);
        let read = boottime();
        assert!(read >= boot && read - boot < Duration::from_millis(50));
        assert_eq!(
            boottime_of(at + Duration::from_secs(3)) - boot,
            Duration::from_secs(3)
        );
        assert_eq!(
            boot - boottime_of(at - Duration::from_millis(7)),
            Duration::from_millis(7)
        );
    }

    #[test]
    fn deadlines_are_boottime_readings_that_add_and_subtract_without_overflow() {
        let at = Deadline::from_boottime(Duration::from_secs(5));
        assert_eq!(
            (at + Duration::from_secs(2)).boottime(),
            Duration::from_secs(7)
        );
        assert_eq!(
            at - Duration::from_secs(9),
            Deadline::from_boottime(Duration::ZERO)
        );
        assert_eq!(at + Duration::MAX, Deadline::from_boottime(Duration::MAX));
        let later = at + Duration::from_millis(3);
        assert_eq!(
            later.saturating_duration_since(at),
            Duration::from_millis(3)
        );
        assert_eq!(at.saturating_duration_since(later), Duration::ZERO);
        assert_eq!(at.checked_duration_since(later), None);
        assert_eq!(later - at, Duration::from_millis(3));
        assert_eq!(at - later, Duration::ZERO);
        let mut moved = at;
        moved += Duration::from_secs(4);
        moved -= Duration::from_secs(1);
        assert_eq!(moved, at + Duration::from_secs(3));
    }

    #[test]
    fn deadlines_and_instants_map_onto_each_other() {
        let now_instant = now();
        let deadline = Deadline::from_instant(now_instant);
        let back = deadline.to_instant();
        let diff = if back > now_instant {
            back - now_instant
        } else {
            now_instant - back
        };
        assert!(diff < Duration::from_micros(1), "{diff:?}");
        let read = Deadline::now();
        assert!(
            read >= deadline
                && read.saturating_duration_since(deadline) < Duration::from_millis(50)
        );
    }
}

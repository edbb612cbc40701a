//! The fence: when CMD must get SIGTERM and SIGKILL, shared by guard with the helper
//! processes that carry it out on their own ([`super::supervisor`]).
//!
//! guard writes it, the helpers read it. It lives in one 64-bit word of a shared memory file
//! (`memfd_create`), stored and loaded atomically: a helper always reads the fence as it
//! stands, never a torn or an old one, however long it was stopped and however often guard
//! moved the fence meanwhile. A pipe per helper (the doorbell) only wakes it when the fence
//! moved; a doorbell that is full already has a wake-up queued, so guard never waits on it.
//!
//! ## The word
//! The SIGKILL point in milliseconds of `CLOCK_BOOTTIME` (42 bits: 139 years after boot) and
//! how long before it SIGTERM comes (22 bits: up to 69 minutes, longer than the longest
//! `--kill-grace`). Both are rounded down, so a helper never signals later than guard asked.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::clock::Deadline;

/// Bits of the word that hold the SIGTERM lead.
const LEAD_BITS: u32 = 22;
const LEAD_MAX_MS: u64 = (1 << LEAD_BITS) - 1;
const KILL_MAX_MS: u64 = (1 << (64 - LEAD_BITS)) - 1;

/// When CMD must get SIGTERM and SIGKILL, as `CLOCK_BOOTTIME` readings
/// ([`crate::clock::boottime`]), the same in every process of the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fence {
    pub term_at: Duration,
    pub kill_at: Duration,
}

impl Fence {
    /// The fence for SIGTERM at `term_at` and SIGKILL at `kill_at`.
    pub fn at(term_at: Deadline, kill_at: Deadline) -> Fence {
        Fence {
            term_at: term_at.boottime(),
            kill_at: kill_at.boottime(),
        }
    }

    /// The word that stands for this fence (both points rounded down to the millisecond;
    /// SIGTERM never after SIGKILL, and at most [`LEAD_MAX_MS`] before it).
    pub fn encode(&self) -> u64 {
        let kill_ms = millis(self.kill_at).min(KILL_MAX_MS);
        let lead_ms = kill_ms
            .saturating_sub(millis(self.term_at))
            .min(LEAD_MAX_MS);
        (kill_ms << LEAD_BITS) | lead_ms
    }

    pub fn decode(word: u64) -> Fence {
        let kill_ms = word >> LEAD_BITS;
        let lead_ms = word & LEAD_MAX_MS;
        Fence {
            term_at: Duration::from_millis(kill_ms - lead_ms),
            kill_at: Duration::from_millis(kill_ms),
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The shared word: created by guard ([`FenceCell::create`], read and write), mapped by each
/// helper from the descriptor it inherited ([`FenceCell::open`], read only).
pub struct FenceCell {
    word: NonNull<AtomicU64>,
    fd: OwnedFd,
}

// SAFETY: the mapping is only ever accessed through the atomic, which is Sync.
unsafe impl Send for FenceCell {}
// SAFETY: as above.
unsafe impl Sync for FenceCell {}

impl FenceCell {
    /// A new shared word holding `fence`; its descriptor is closed on exec.
    pub fn create(fence: Fence) -> std::io::Result<FenceCell> {
        // SAFETY: memfd_create reads the NUL-terminated name and returns a new descriptor.
        let raw = unsafe { libc::memfd_create(c"redlock-guard-fence".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: just created, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = std::mem::size_of::<AtomicU64>() as libc::off_t;
        // SAFETY: ftruncate on a descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let cell = FenceCell::map(fd, libc::PROT_READ | libc::PROT_WRITE)?;
        cell.store(fence);
        Ok(cell)
    }

    /// Maps the word guard created, read only, from the inherited descriptor `fd`.
    pub fn open(fd: OwnedFd) -> std::io::Result<FenceCell> {
        FenceCell::map(fd, libc::PROT_READ)
    }

    fn map(fd: OwnedFd, prot: libc::c_int) -> std::io::Result<FenceCell> {
        // SAFETY: maps the first bytes of a file we hold; the kernel picks the address. A
        // file shorter than the word faults on access, so check its size first.
        let mut stat = unsafe { std::mem::zeroed::<libc::stat>() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let size = std::mem::size_of::<AtomicU64>();
        if (stat.st_size as u64) < size as u64 {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: as above.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let word = NonNull::new(at.cast::<AtomicU64>())
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        Ok(FenceCell { word, fd })
    }

    /// Publishes `fence` to every helper at once.
    pub fn store(&self, fence: Fence) {
        self.atomic().store(fence.encode(), Ordering::SeqCst);
    }

    /// The fence as it stands.
    pub fn load(&self) -> Fence {
        Fence::decode(self.atomic().load(Ordering::SeqCst))
    }

    fn atomic(&self) -> &AtomicU64 {
        // SAFETY: a page-aligned mapping of at least 8 bytes that lives as long as `self`;
        // every process touches it only through this atomic.
        unsafe { self.word.as_ref() }
    }
}

impl AsFd for FenceCell {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Drop for FenceCell {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping made in `map`; nothing refers to it past `self`.
        unsafe { libc::munmap(self.word.as_ptr().cast(), std::mem::size_of::<AtomicU64>()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fence(term_ms: u64, kill_ms: u64) -> Fence {
        Fence {
            term_at: Duration::from_millis(term_ms),
            kill_at: Duration::from_millis(kill_ms),
        }
    }

    #[test]
    fn a_fence_survives_the_word_rounded_down_to_the_millisecond() {
        let f = fence(12_000, 14_000);
        assert_eq!(Fence::decode(f.encode()), f);
        let precise = Fence {
            term_at: Duration::from_nanos(12_000_999_999),
            kill_at: Duration::from_nanos(14_000_999_999),
        };
        assert_eq!(Fence::decode(precise.encode()), f, "never later than asked");
        // A year after boot, an hour's grace.
        let year = 365 * 24 * 3_600_000;
        let f = fence(year - 3_600_000, year);
        assert_eq!(Fence::decode(f.encode()), f);
    }

    #[test]
    fn sigterm_never_comes_after_sigkill_nor_too_early_to_fit() {
        // SIGTERM asked after SIGKILL (a decision after the step-down point): both at SIGKILL.
        assert_eq!(
            Fence::decode(fence(20_000, 15_000).encode()),
            fence(15_000, 15_000)
        );
        // A lead longer than the word holds: SIGTERM later, SIGKILL unchanged.
        let f = Fence::decode(fence(0, 100_000_000).encode());
        assert_eq!(f.kill_at, Duration::from_millis(100_000_000));
        assert_eq!(f.kill_at - f.term_at, Duration::from_millis(LEAD_MAX_MS));
    }

    #[test]
    fn every_mapping_reads_what_was_stored_last() {
        let cell = FenceCell::create(fence(1_000, 2_000)).expect("memfd");
        let fd = cell.as_fd().try_clone_to_owned().expect("dup");
        let reader = FenceCell::open(fd).expect("map");
        assert_eq!(reader.load(), fence(1_000, 2_000));
        cell.store(fence(5_000, 7_000));
        assert_eq!(reader.load(), fence(5_000, 7_000));
    }
}

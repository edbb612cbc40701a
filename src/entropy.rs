//! The operating system's random source, checked once at start-up.
//!
//! Lock values, retry jitter and TLS all draw from it. rand's thread-local generator panics
//! ("could not initialize ThreadRng") when its first seed cannot be read, e.g. a `getrandom`
//! system call denied by seccomp in a binary that has no `/dev/urandom` to fall back on. Reading
//! it here first turns that into one clear line and exit code [`crate::exit::OS_ERROR`]
//! before anything connects.
//!
//! ## Limits
//! The generator reseeds itself from the same source later (every 64 KiB of output) and rand
//! panics if that fails. That needs the source to break while the process runs: with the
//! `getrandom` system call (always used by the static build, see `scripts/build-static.sh`, and
//! by glibc builds on any kernel since 3.17) it does not.

use rand::rngs::OsRng;
use rand::TryRngCore;

/// The random source could not be read.
#[derive(Debug, thiserror::Error)]
#[error("no random source: {0} (needs the getrandom system call, or a readable /dev/urandom)")]
pub struct NoRandomSource(#[from] rand::rand_core::OsError);

/// Reads a few bytes from the OS random source.
pub fn check() -> Result<(), NoRandomSource> {
    let mut probe = [0u8; 16];
    OsRng.try_fill_bytes(&mut probe)?;
    Ok(())
}

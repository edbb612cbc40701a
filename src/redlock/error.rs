//! Typed outcomes of a round: per-node votes and the lock-level errors built from them (the
//! core's, `redlock_core::error`).

pub use redlock_core::error::{ConfigError, LockError, Vote, Votes};

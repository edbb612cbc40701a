//! The lease core of redlock-sidecar: the protocol without input or output.
//!
//! Everything here is a pure function or a state machine in the style of `quinn-proto`: what a
//! node answered goes in, the next step comes out, and the next instant to wake for is asked
//! of the machine. No socket, no timer, no runtime: this crate depends on neither Tokio nor a
//! Redis client nor Kubernetes, so the compiler keeps it that way. The sidecar's engine fans
//! rounds out to the nodes and carries the steps out; the protocol model (tests/model) drives
//! these same machines, so what it checks is what runs.
//!
//! - [`round`]: the acquire, extend, fence-raise and release rounds, and the retry policy;
//! - [`votes`]: which answer counts as a vote (data age, lineage, one server one vote, the
//!   node set a grant came from);
//! - [`tenure`]: a lease's whole life once won (renew cadence, fast retry, the step-down
//!   deadline, the kept promise, pause suspicion);
//! - [`timing`]: quorum, drift, validity, backoff; [`clock`]: the deadline type every timer
//!   is measured in; [`error`]: votes and the lock-level errors; [`facts`]: what a node says
//!   about itself.

// Unit tests may read the monotonic clock (clippy.toml keeps it out of the code itself).
#![cfg_attr(test, allow(clippy::disallowed_methods))]

pub mod clock;
pub mod error;
pub mod facts;
pub mod round;
pub mod shards;
pub mod tenure;
pub mod timing;
pub mod votes;

//! Mutual exclusion under faults, proven against real `redis-server` processes and the real binary.
//!
//! Every critical section writes to a fenced store ([`support::fenced`]) at its start, while it
//! runs and at its end; the store accepts a write only if its fencing token is at least the highest
//! it has accepted. The checker ([`support::checker`]) turns the records into sessions and asserts,
//! per scenario: tokens strictly increase in the order sessions begin; where no holder is paused,
//! no two sessions overlap and no write within its writer's validity is refused; where holders are
//! paused past their ttl, every overlap is fenced (the stale holder's writes were refused); and
//! the lock is taken again once a quorum is healthy.
//!
//! Critical sections come short and long: guard contenders hold for 0.4 s or for 2–4 × ttl
//! (only renewals keep those legitimate), and every guard run no fault was aimed at must exit
//! 0, its CMD's own code. Library contenders hold a section of 2–4 × ttl on request: every
//! other fault of the restart, data-loss and cut-off scenarios and every third of the soak
//! strikes such a section once it has been held for a ttl; the rolling restart asks for one
//! per round, the latency scenario one per phase (but the last).
//!
//! Each scenario prints a row of a summary table (`cargo test --test faults -- --nocapture`).
//! `REDLOCK_SOAK=N` makes the `soak` test run N handoffs under random faults
//! (`REDLOCK_SOAK_SEED=S` replays one run); see `scripts/soak.sh` and `docs/reliability.md`.
//!
//! One file per scenario (kills, pauses, restarts, partitions, latency, strikes, soak, liveness,
//! requests: request locks through two sidecars),
//! beside the contenders they share (library, guards, runs), the cluster set-up and the report.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

#[path = "../support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redlock_sidecar::clock::Deadline;
use redlock_sidecar::redlock::{quorum, Lease, Redlock, RedlockConfig};
use support::checker::{self, analyse, Analysis, Mode, Row};
use support::fenced::{FencedStore, Kind, Record, StoreServer};
use support::{FaultProxy, Proc, RedisCluster, RedisNode};
use tokio::task::{block_in_place, JoinHandle};
use tokio_util::sync::CancellationToken;

/// The ttl of in-process (library) contenders: short, so that faults cost little time.
const LIB_TTL: Duration = Duration::from_secs(1);
/// The ttl of the real binary's contenders (guard, run): room for their timers on a busy machine.
const PROC_TTL: Duration = Duration::from_secs(2);
/// Timing flags of every guard and run process (validated by the binary: see `guard --help`).
const PROC_TIMING: [&str; 10] = [
    "--ttl",
    "2s",
    "--safety-margin",
    "500ms",
    "--node-timeout",
    "50ms",
    "--connect-timeout",
    "250ms",
    "--retry-delay",
    "20ms",
];
/// Poll period of the supervisors and of the `run` sidecars' apps.
const POLL: Duration = Duration::from_millis(10);
/// A crashed holder's key lives out its ttl; the next holder must follow within this much more.
const TAKEOVER_SLACK: Duration = Duration::from_secs(3);
/// Writes of guard's long critical sections, 50 ms apart: 4, 5.5 and 7 s of sleeps (2 to
/// 3.5 × `PROC_TTL`, a little more with bash's own time). Only renewals keep them legitimate.
const LONG_SECTIONS: [u32; 3] = [80, 110, 140];
/// Writes of a short guard critical section (0.4 s).
const SHORT_SECTION: u32 = 8;
/// An upper bound on the longest guard critical section.
const LONGEST_SECTION: Duration = Duration::from_secs(9);

mod cluster;
mod guards;
mod kills;
mod latency;
mod library;
mod liveness;
mod partitions;
mod pauses;
mod report;
mod requests;
mod restarts;
mod runs;
mod selftest;
mod shards;
mod soak;
mod strikes;

// Every module sees the others' helpers through `use super::*`.
use cluster::*;
use guards::*;
use library::*;
use partitions::*;
use report::*;
use restarts::*;
use runs::*;
use strikes::*;

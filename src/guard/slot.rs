//! `--slot`: a schedule slot runs once. See `redlock::slot` for the record and what it
//! survives.
//!
//! ## Behaviour
//! - After guard took the lock and before CMD starts, it reads the slot's record on every
//!   node. A record on any node: the slot ran; the lock is released at once and guard exits
//!   0 with outcome `already-ran` (`redlock_guard_runs_total{result="already_ran"}`, a
//!   `RunSkipped` Event). No record on a quorum of answers: CMD runs. Fewer answers than a
//!   quorum are read again (after the engine's retry delays) until the first renewal is due,
//!   then guard releases and exits 69 without running CMD.
//! - When CMD exits 0 under the lock (not stopped for a loss or `--max-hold`, the renewals
//!   not lost), the holder records the slot with its fencing token at once, before
//!   `--min-hold` and the release. A failed, lost or killed run records nothing, so a retry
//!   runs the slot. A record that reached fewer than a quorum (nodes cut off or refusing
//!   writes as CMD exits), or none because the lock was lost before CMD's exit was seen: a
//!   later run of the slot may run it again, so the run says so: a warning, a
//!   `SlotNotRecorded` Event, outcome `unrecorded` and exit 69 (CMD's 0 is not passed on).

use std::time::Duration;

use tracing::{error, info, warn};

use super::outcome::{Kind, Outcome};
use super::report::Report;
use crate::clock::{self, Deadline};
use crate::config::{GuardConfig, Slot};
use crate::exit;
use crate::lease;
use crate::redlock::{quorum, slot_seen, timing, Lease, Redlock, SlotSeen};

/// Whether `slot` may run under `lease`: `Ok` to start CMD, or the outcome of a run that
/// will not (the lock is released then).
pub async fn check(
    cfg: &GuardConfig,
    slot: &Slot,
    redlock: &Redlock,
    lease: &Lease,
    report: &Report,
) -> Result<(), Outcome> {
    let lock = &cfg.redlock.lock;
    let until = read_until(lease, cfg);
    let mut attempt = 0;
    let seen = loop {
        let seen = slot_seen(&redlock.read_slot(&slot.id).await);
        let delay = timing::retry_delay(cfg.redlock.retry_delay, cfg.redlock.retry_max, attempt);
        match read_again(
            &seen,
            Deadline::now(),
            delay,
            cfg.redlock.node_timeout,
            until,
        ) {
            Some(at) => {
                attempt += 1;
                clock::sleep_until_deadline(at).await;
            }
            None => break seen,
        }
    };
    let token = lease.fencing_token;
    match seen {
        SlotSeen::NotRan => Ok(()),
        SlotSeen::Ran(recorded) => {
            info!(lock = %lock, slot = %slot.id, recorded_fencing_token = %recorded, "slot already ran; not running CMD");
            lease::release(redlock, lease).await;
            report.run("already_ran");
            report
                .event(
                    "RunSkipped",
                    &format!(
                        "slot {} of lock {lock} already ran (fencing token {recorded})",
                        slot.id
                    ),
                    false,
                )
                .await;
            Err(Outcome {
                kind: Kind::AlreadyRan,
                exit_code: 0,
                fencing_token: Some(token),
            })
        }
        SlotSeen::Unknown => {
            error!(lock = %lock, slot = %slot.id, "too few nodes answered to tell whether the slot already ran; not running CMD");
            lease::release(redlock, lease).await;
            report.run("failed");
            Err(Outcome {
                kind: Kind::Unreachable,
                exit_code: exit::UNREACHABLE,
                fencing_token: Some(token),
            })
        }
    }
}

/// When to read the record again after reads that showed `seen` at `now`: after `delay`, if
/// nothing was decided and that read (bounded by `node_timeout`) ends before `until`.
fn read_again(
    seen: &SlotSeen,
    now: Deadline,
    delay: Duration,
    node_timeout: Duration,
    until: Deadline,
) -> Option<Deadline> {
    let at = now + delay;
    (*seen == SlotSeen::Unknown && at + node_timeout < until).then_some(at)
}

/// Reads of the record stop once the first renewal of `lease` is due: CMD then still starts
/// with most of the validity ahead.
fn read_until(lease: &Lease, cfg: &GuardConfig) -> Deadline {
    lease.acquired_at + cfg.renewal.interval
}

/// Records that `slot` ran under `lease` (CMD exited 0); whether a quorum has it (logged).
pub async fn record(cfg: &GuardConfig, slot: &Slot, redlock: &Redlock, lease: &Lease) -> bool {
    let lock = &cfg.redlock.lock;
    let written = redlock.record_slot(lease, &slot.id, slot.retention).await;
    let nodes = cfg.redlock.nodes.len();
    let recorded = written >= quorum(nodes);
    if recorded {
        info!(lock = %lock, slot = %slot.id, fencing_token = lease.fencing_token, nodes = written, "recorded that the slot ran");
    } else {
        warn!(lock = %lock, slot = %slot.id, nodes = written, needed = quorum(nodes), "the slot's record reached too few nodes; a later run of this slot may run it again");
    }
    recorded
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn undecided_reads_are_repeated_only_while_one_more_ends_before_the_bound() {
        let now = Deadline::from_boottime(Duration::from_secs(1_000));
        let (delay, timeout) = (Duration::from_millis(200), Duration::from_millis(50));
        let until = now + Duration::from_secs(1);
        assert_eq!(
            read_again(&SlotSeen::Unknown, now, delay, timeout, until),
            Some(now + delay)
        );
        // The next read would end past the bound: no more.
        let late = until - Duration::from_millis(250);
        assert_eq!(
            read_again(&SlotSeen::Unknown, late, delay, timeout, until),
            None
        );
        // Decided: never read again.
        for seen in [SlotSeen::NotRan, SlotSeen::Ran("7".to_owned())] {
            assert_eq!(read_again(&seen, now, delay, timeout, until), None);
        }
    }
}

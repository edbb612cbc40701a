//! The model's coupling to the engine: the engine's own round state machines
//! (`redlock::round`) and pure functions, called on whole-millisecond ticks (one model tick is
//! one millisecond of the engine's arithmetic). The model keeps each round's answers as it
//! recorded them; every decision about them is made here, by feeding them to a fresh state
//! machine of the engine and asking it what to do next. When the engine's signatures change,
//! this file is the one to adapt.

use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use redlock_core::clock::Deadline;
use redlock_core::error::{NodeError, NodeErrorKind};
use redlock_core::facts::NodeFacts;
use redlock_core::round::acquire::AcquireStatus;
use redlock_core::round::extend::ExtendStatus;
use redlock_core::round::fence::token_above;
use redlock_core::round::{
    AcquireParams, AcquireReply, AcquireRound, AcquireStep, Connection, ExtendReply, ExtendRound,
    ExtendStep, FenceRaise, NodeAnswer, RaiseStep, Rules, TokenPlan,
};
use redlock_core::tenure::{Event, Failure, Policy, RenewFrom, Step as TenureStep, Tenure};
use redlock_core::timing;
use redlock_core::votes::{self, DataAge, NodeSet, Proof, EPOCH_LIFETIME_MS};

/// A marker stamped before the model's time begins proves this much (beyond `MAX_TTL` + drift).
const ANCIENT: Duration = Duration::from_secs(2 * timing::MAX_TTL.as_secs());

/// A data age as a node's clock measures it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Age {
    /// Whole ticks since the epoch marker was stamped.
    Ticks(u8),
    /// Stamped long before the model's time began.
    Ancient,
}

impl Age {
    fn duration(self) -> Duration {
        match self {
            Age::Ticks(t) => ms(t),
            Age::Ancient => ANCIENT,
        }
    }
}

/// One tick as the engine's `Duration`.
pub fn ms(ticks: u8) -> Duration {
    Duration::from_millis(u64::from(ticks))
}

/// Tick `t` as the engine's time.
fn at(t: u8) -> Deadline {
    Deadline::from_boottime(ms(t))
}

/// An instant of the engine's time in ticks, rounded up (the app may act until any instant
/// before it).
fn ticks(at: Deadline) -> u8 {
    let ns = at.boottime().as_nanos().div_ceil(1_000_000);
    u8::try_from(ns).unwrap_or(u8::MAX)
}

/// The age an epoch marker holding lineage `marker` proves, measured `measured` on the node's
/// clock, to a script that reads the lineage `current` (the engine's `votes::data_age`);
/// `None` when the lineages differ and the marker must be stamped again.
pub fn proven_age(marker: &str, measured: Age, current: &str) -> Option<Age> {
    let age_ms = u64::try_from(measured.duration().as_millis()).expect("age fits in u64");
    let pttl = i64::try_from(EPOCH_LIFETIME_MS - age_ms).expect("pttl fits in i64");
    let proven = votes::data_age(marker, pttl, current)?;
    Some(if proven >= ANCIENT {
        Age::Ancient
    } else {
        Age::Ticks(u8::try_from(proven.as_millis()).expect("young ages fit in u8"))
    })
}

/// Node `n`'s server while it runs as run `run`, as the engine names a server (run ids are
/// unique across servers, so the node's index is part of the model's).
fn server(n: usize, run: u8) -> String {
    votes::server_identity(&format!("n{n}r{run}"), 0).expect("a run id")
}

/// The node set of a list of nodes, each with the run id its client knows (`None`: `?`).
fn node_set(list: &[(usize, Option<u8>)]) -> NodeSet {
    NodeSet::of_servers(
        list.iter()
            .map(|(n, run)| run.map(|run| server(*n, run)))
            .collect(),
    )
}

/// The fingerprints met so far: a model state keeps a fingerprint as its index here.
static FINGERPRINTS: LazyLock<Mutex<Vec<String>>> = LazyLock::new(|| Mutex::new(Vec::new()));

/// The number that stands for `fingerprint` in model states.
fn intern(fingerprint: &str) -> u64 {
    let mut all = FINGERPRINTS.lock().unwrap_or_else(|e| e.into_inner());
    let index = all
        .iter()
        .position(|f| f == fingerprint)
        .unwrap_or_else(|| {
            all.push(fingerprint.to_owned());
            all.len() - 1
        });
    u64::try_from(index).expect("few fingerprints")
}

/// The fingerprint number `set` stands for.
fn fingerprint_of(set: u64) -> String {
    let all = FINGERPRINTS.lock().unwrap_or_else(|e| e.into_inner());
    all[usize::try_from(set).expect("an index")].clone()
}

/// The fingerprint the engine records for `list`, as a number (see [`intern`]).
pub fn fingerprint(list: &[(usize, Option<u8>)]) -> u64 {
    intern(&node_set(list).fingerprint)
}

/// The facts every model node's connection shows: a run id, and no eviction.
static FACTS: LazyLock<Arc<NodeFacts>> = LazyLock::new(|| {
    Arc::new(NodeFacts {
        run_id: "model".to_owned(),
        maxmemory_policy: "noeviction".to_owned(),
        role: "master".to_owned(),
        ..NodeFacts::default()
    })
});

fn no_answer() -> NodeError {
    NodeError {
        kind: NodeErrorKind::Timeout,
        message: "no answer".to_owned(),
    }
}

// ---------------------------------------------------------------------------------------
// The acquire round
// ---------------------------------------------------------------------------------------

/// A node's answer to an acquire request, as the model's node gave it. `longest`: the
/// longest register the client knew once this answer was in (the register it reported, and
/// every one before).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AcquireAns {
    /// Never executed, or the answer was lost or came after the node timeout: the call timed
    /// out.
    NoAnswer,
    /// Our key was set: the data age proven, whether the candidate token was stored, the run
    /// id the answer's connection shows, whether the node carried a node-set record, and the
    /// other set's record it replaced (judged stale by an earlier round), if any.
    Granted {
        age: Age,
        stored: bool,
        server: u8,
        recorded: bool,
        replaced: Option<u64>,
        longest: u8,
    },
    /// Another value holds the key; `foreign`: another set's record stands beside it, and its
    /// age on the node's clock.
    Held {
        foreign: Option<(u64, u8)>,
        longest: u8,
    },
    /// No grant under another set's live record (its fingerprint and age).
    Conflict { set: u64, age: u8, longest: u8 },
}

impl AcquireAns {
    fn longest(self) -> u8 {
        match self {
            AcquireAns::NoAnswer => 0,
            AcquireAns::Granted { longest, .. }
            | AcquireAns::Held { longest, .. }
            | AcquireAns::Conflict { longest, .. } => longest,
        }
    }
}

/// What a client knows when it asks its acquire round what to do.
pub struct AcquireView<'a> {
    pub ttl: u8,
    /// The longest ttl it was configured with (`--ttl`, `--max-ttl`).
    pub longest: u8,
    pub candidate: u16,
    pub start: u8,
    /// The round's node set: per position in the client's list, the node and the run id named.
    pub list: &'a [(usize, Option<u8>)],
    /// The highest counter the client's answers ever showed (the model keeps it per client,
    /// not per answer: every answer reports it).
    pub seen_fence: u16,
    /// The node timeout, in ticks: with the ttl, it sets how long the round reads silent
    /// nodes' registers again (`timing::recheck_window`).
    pub node_timeout: u8,
    pub rules: Rules,
}

/// A register read again while the round rechecks: the node's position in the list, the
/// register it showed (0: absent), and the tick at which the answer came.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegisterRead {
    pub index: usize,
    pub register: u8,
    pub at: u8,
}

/// What the engine's acquire round says to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AcquireNext {
    Listen,
    /// Read the register again at these positions of the list (those not being read yet),
    /// and listen.
    Recheck(Vec<usize>),
    /// Lost: clean up at these positions of the list; another set's record judged stale
    /// (its fingerprint, and the age in whole ticks it must still exceed), which the next
    /// round may replace.
    Lost(Vec<usize>, Option<(u64, u8)>),
    /// Won without validity left: clean up everywhere.
    TooShort,
    /// Won with this token.
    Lead(u16),
    /// Won, but the fence must be raised above this.
    Raise(u16),
}

/// Another set's record as an answer shows it: its fingerprint and age.
fn record(set: u64, age: u8) -> (String, Option<Duration>) {
    (fingerprint_of(set), Some(ms(age)))
}

/// Feeds `answers` (position in the list, answer) to a fresh acquire round of the engine, then
/// the registers read again while it rechecked (`reads`), and asks it what to do at `now`.
/// The answers go in the order the registers became known (then list order), so that each is
/// judged with what the client knew when it arrived; the reads in the order they came, each
/// after the round has been told the time it came at (as the engine's loop does before it
/// takes the next event: at the end of the recheck window, the window's end is taken first).
/// A register read that timed out is not fed: before the window's end the engine asks the
/// node again, and after it the window's end has decided the round already.
pub fn acquire_next(
    view: &AcquireView,
    answers: &[(usize, AcquireAns)],
    reads: &[RegisterRead],
    now: u8,
) -> AcquireNext {
    let mut answers = answers.to_vec();
    answers.sort_by_key(|(i, ans)| (ans.longest(), *i));
    let set = node_set(view.list);
    let own = set.fingerprint.clone();
    let params = AcquireParams {
        ttl: ms(view.ttl),
        longest_ttl: ms(view.longest),
        candidate: u64::from(view.candidate),
        node_set: set,
        allow_evicting: false,
        // The model's connections are made within a request's node timeout.
        recheck_for: timing::recheck_window(
            ms(view.ttl),
            ms(view.node_timeout),
            ms(view.node_timeout),
        ),
        rules: view.rules,
    };
    let mut round = AcquireRound::new(view.list.len(), params, at(view.start));
    for (index, ans) in &answers {
        let (status, age, stored, run, (node_set, node_set_age)) = match *ans {
            AcquireAns::NoAnswer => {
                round.handle(*index, Err(no_answer()));
                continue;
            }
            AcquireAns::Granted {
                age,
                stored,
                server,
                recorded,
                replaced,
                ..
            } => (
                AcquireStatus::Granted,
                age,
                stored,
                server,
                match replaced {
                    Some(set) => record(set, 0),
                    None if recorded => (own.clone(), None),
                    None => (String::new(), None),
                },
            ),
            AcquireAns::Held { foreign, .. } => (
                AcquireStatus::Held,
                Age::Ancient,
                false,
                0,
                foreign.map_or((String::new(), None), |(set, age)| record(set, age)),
            ),
            AcquireAns::Conflict { set, age, .. } => (
                AcquireStatus::OtherNodeSet,
                Age::Ancient,
                false,
                0,
                record(set, age),
            ),
        };
        let reply = AcquireReply {
            status,
            fence: u64::from(view.seen_fence),
            proof: Proof {
                data_age: DataAge::Proven(age.duration()),
                max_ttl: ms(ans.longest()),
            },
            candidate_stored: stored,
            holder_value: "holder:1".to_owned(),
            holder_pttl: None,
            node_set,
            node_set_age,
        };
        let conn = Connection {
            facts: FACTS.clone(),
            server: Some(server(view.list[*index].0, run)),
            same_server_as: None,
        };
        round.handle(*index, Ok(NodeAnswer { reply, conn }));
    }
    let mut reads = reads.to_vec();
    reads.sort_by_key(|read| (read.at, read.index));
    for read in reads {
        round.handle_timeout(at(read.at));
        round.handle_register(read.index, Ok(ms(read.register)), at(read.at));
    }
    let token = |t: u64| u16::try_from(t).expect("model tokens fit in u16");
    round.handle_timeout(at(now));
    match round.poll(at(now)) {
        AcquireStep::Listen => AcquireNext::Listen,
        AcquireStep::Recheck(nodes) => AcquireNext::Recheck(nodes),
        AcquireStep::Lost { clean_up, .. } => {
            let stale = round.stale_record().map(|stale| {
                let after = stale.after.as_nanos().div_ceil(1_000_000);
                (intern(&stale.set), u8::try_from(after).unwrap_or(u8::MAX))
            });
            AcquireNext::Lost(clean_up, stale)
        }
        AcquireStep::TooShort { .. } => AcquireNext::TooShort,
        AcquireStep::Won(TokenPlan::Stored(t)) => AcquireNext::Lead(token(t)),
        AcquireStep::Won(TokenPlan::RaiseAbove(t)) => AcquireNext::Raise(token(t)),
    }
}

/// The validity a round that started at `start` has left at `now` (the engine's), in ticks
/// from `start`, rounded up; `None` when nothing is left.
pub fn validity_ticks(rules: Rules, ttl: u8, elapsed: u8) -> Option<u8> {
    let left = rules.validity(ms(ttl), ms(elapsed))?;
    Some(ticks(at(0) + left))
}

/// The token to propose above `highest` when the client's wall clock reads `wall` (the
/// engine's `fencing::token_above`).
pub fn token_above_ticks(highest: u16, wall: u16) -> u16 {
    u16::try_from(token_above(u64::from(highest), u64::from(wall))).expect("fits in u16")
}

// ---------------------------------------------------------------------------------------
// Raising the fence
// ---------------------------------------------------------------------------------------

/// What the engine's raise round says to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RaiseNext {
    Listen,
    Minted(u16),
    Again(u16),
    Failed,
}

/// Feeds a raise round of `token` (attempt `attempt`, 0-based) over `nodes` nodes the answers
/// (position, counter before or `None` for no answer), and asks it what to do when the wall
/// clock reads `wall`. Also returns the highest counter it saw.
pub fn raise_next(
    nodes: usize,
    token: u16,
    attempt: u8,
    answers: &[(usize, Option<u16>)],
    wall: u16,
) -> (RaiseNext, u16) {
    let mut raise = FenceRaise::new(nodes, u64::from(token), usize::from(attempt));
    for (index, before) in answers {
        raise.handle(*index, before.map(|b| b.to_string()).ok_or_else(no_answer));
    }
    let t = |t: u64| u16::try_from(t).expect("model tokens fit in u16");
    let next = match raise.poll(u64::from(wall)) {
        RaiseStep::Listen => RaiseNext::Listen,
        RaiseStep::Minted(token) => RaiseNext::Minted(t(token)),
        RaiseStep::Again(token) => RaiseNext::Again(t(token)),
        RaiseStep::Failed(_) => RaiseNext::Failed,
    };
    (next, t(raise.fence_seen()))
}

// ---------------------------------------------------------------------------------------
// The extend round
// ---------------------------------------------------------------------------------------

/// A node's answer to an extend request, as the model's node gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExtendAns {
    NoAnswer,
    Extended,
    Held,
    Missing,
}

/// What the engine's extend round says to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtendNext {
    Listen,
    /// Expired or superseded: the lease is gone.
    Gone,
    /// No quorum this time.
    Lost,
    /// Renewed: what the round proved (ticks, rounded up), and where to restore (positions).
    Renewed {
        proven: u8,
        restore: Vec<usize>,
    },
}

/// Feeds a renewal over `nodes` nodes started at `started`, of a lease whose validity ends at
/// `end`, the answers (position, answer), and asks it what to do at `now`.
pub fn extend_next(
    rules: Rules,
    nodes: usize,
    ttl: u8,
    started: u8,
    end: u8,
    answers: &[(usize, ExtendAns)],
    now: u8,
) -> ExtendNext {
    let mut round = ExtendRound::new(nodes, ms(ttl), at(started), at(end), rules);
    for (index, ans) in answers {
        let status = match ans {
            ExtendAns::NoAnswer => {
                round.handle(*index, Err(no_answer()));
                continue;
            }
            ExtendAns::Extended => ExtendStatus::Extended,
            ExtendAns::Held => ExtendStatus::Held,
            ExtendAns::Missing => ExtendStatus::Missing,
        };
        let proof = Proof {
            data_age: DataAge::NotProven,
            max_ttl: Duration::ZERO,
        };
        round.handle(*index, Ok(ExtendReply { status, proof }));
    }
    match round.poll(at(now)) {
        ExtendStep::Listen => ExtendNext::Listen,
        ExtendStep::Expired | ExtendStep::Superseded(_) => ExtendNext::Gone,
        ExtendStep::Lost(_) => ExtendNext::Lost,
        ExtendStep::Renewed {
            proven_until,
            restore,
            ..
        } => ExtendNext::Renewed {
            proven: ticks(proven_until),
            restore,
        },
    }
}

// ---------------------------------------------------------------------------------------
// The lease machine
// ---------------------------------------------------------------------------------------

/// A model client's tenure: the instants the model keeps (ticks), and its timing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub ttl: u8,
    pub safety_margin: u8,
    pub acquired: u8,
    pub end: u8,
    pub next_renew: u8,
}

/// What the lease machine says a model client does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldNext {
    Renew,
    StepDown,
    Wait,
}

/// The model's timing for the engine's lease machine: renew every third of the ttl (at
/// least a tick) from the round's start, retry a tick after a failure, step down the safety
/// margin before the end; no pause suspicion (a paused client does not act at all).
fn policy(held: Held) -> Policy {
    Policy {
        renew_every: ms((held.ttl / 3).max(1)),
        renew_from: RenewFrom::Start,
        retry_after: ms(1),
        step_down_before: ms(held.safety_margin),
        pause_after: None,
    }
}

fn tenure(rules: Rules, held: Held) -> Tenure {
    Tenure::resume(
        policy(held),
        at(held.acquired),
        at(held.end),
        at(held.next_renew),
    )
    .under(rules)
}

/// The first renewal of a tenure won by a round that started at `held.acquired`.
pub fn first_renewal(held: Held) -> u8 {
    ticks(Tenure::new(policy(held), at(held.acquired), at(held.end)).next_renew())
}

/// What the lease machine says at `now`.
pub fn hold_next(rules: Rules, held: Held, now: u8) -> HoldNext {
    match tenure(rules, held).poll(at(now)) {
        TenureStep::Renew => HoldNext::Renew,
        TenureStep::StepDown(_) => HoldNext::StepDown,
        TenureStep::WaitUntil(_) => HoldNext::Wait,
    }
}

/// A renewal round that started at `started` proved `proven` at `now`: the new end and
/// next renewal.
pub fn renewed(rules: Rules, held: Held, started: u8, now: u8, proven: u8) -> (u8, u8) {
    let mut t = tenure(rules, held);
    t.handle(Event::Renewed {
        started: at(started),
        ended: at(now),
        valid_until: at(proven),
    });
    (ticks(t.valid_until()), ticks(t.next_renew()))
}

/// A renewal short of a quorum at `now`: the next renewal.
pub fn renewal_failed(rules: Rules, held: Held, now: u8) -> u8 {
    let mut t = tenure(rules, held);
    t.handle(Event::RenewFailed {
        at: at(now),
        failure: Failure::Retry,
    });
    ticks(t.next_renew())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_round_the_engine_arithmetic_as_the_model_documents() {
        let all = Rules::ALL;
        let lax = Rules {
            drift_margin: false,
            ..Rules::ALL
        };
        // ttl 6 ms: drift is 2.06 ms, so 3.94 ms are left, which the app may use up to its end.
        assert_eq!(validity_ticks(all, 6, 0), Some(4));
        assert_eq!(validity_ticks(all, 6, 1), Some(3));
        assert_eq!(validity_ticks(all, 6, 4), None);
        assert_eq!(validity_ticks(lax, 6, 0), Some(6));
        assert_eq!(proven_age("a", Age::Ticks(3), "a"), Some(Age::Ticks(3)));
        assert_eq!(proven_age("a", Age::Ancient, "a"), Some(Age::Ancient));
        assert_eq!(proven_age("a", Age::Ticks(3), "b"), None);
        assert_eq!(token_above_ticks(7, 3), 8);
        assert_eq!(token_above_ticks(7, 30), 30);
    }

    #[test]
    fn the_engines_acquire_round_judges_the_models_answers() {
        let list = [(0, Some(1)), (1, Some(1)), (2, Some(1))];
        let view = AcquireView {
            ttl: 6,
            longest: 6,
            candidate: 5,
            start: 0,
            list: &list,
            seen_fence: 0,
            node_timeout: 1,
            rules: Rules::ALL,
        };
        let grant = |age, server| AcquireAns::Granted {
            age,
            stored: true,
            server,
            recorded: true,
            replaced: None,
            longest: 6,
        };
        // Two old grants win at once.
        let old = [(0, grant(Age::Ancient, 1)), (2, grant(Age::Ancient, 1))];
        assert_eq!(acquire_next(&view, &old, &[], 1), AcquireNext::Lead(5));
        // ttl 6 ms needs 8.06 ms of data age: 9 whole ticks on the node's clock, and a young
        // node waits for every answer.
        let young = [(0, grant(Age::Ticks(9), 1)), (1, grant(Age::Ticks(9), 1))];
        assert_eq!(acquire_next(&view, &young, &[], 1), AcquireNext::Listen);
        // The third timed out: its register is read again, for up to 3 ticks (half the ttl)
        // from the round's start.
        let mut all_in = young.to_vec();
        all_in.push((2, AcquireAns::NoAnswer));
        assert_eq!(
            acquire_next(&view, &all_in, &[], 1),
            AcquireNext::Recheck(vec![2])
        );
        assert_eq!(
            acquire_next(&view, &all_in, &[], 2),
            AcquireNext::Recheck(vec![2])
        );
        assert_eq!(acquire_next(&view, &all_in, &[], 3), AcquireNext::Lead(5));
        let read = |register, at| RegisterRead {
            index: 2,
            register,
            at,
        };
        assert_eq!(
            acquire_next(&view, &all_in, &[read(0, 2)], 2),
            AcquireNext::Lead(5)
        );
        assert_eq!(
            acquire_next(&view, &all_in, &[read(12, 2)], 2),
            AcquireNext::Lost(vec![0, 1, 2], None),
            "a longer ttl's register: the young grants do not count"
        );
        assert_eq!(
            acquire_next(&view, &all_in, &[read(12, 3)], 3),
            AcquireNext::Lead(5),
            "a read that comes as the window ends is too late"
        );
        let too_young = [
            (0, grant(Age::Ticks(8), 1)),
            (1, grant(Age::Ticks(8), 1)),
            (2, AcquireAns::NoAnswer),
        ];
        assert_eq!(
            acquire_next(&view, &too_young, &[], 1),
            AcquireNext::Lost(vec![0, 1, 2], None)
        );
        // A grant from a restarted server does not count.
        let restarted = [
            (0, grant(Age::Ancient, 2)),
            (1, grant(Age::Ancient, 1)),
            (
                2,
                AcquireAns::Held {
                    foreign: None,
                    longest: 6,
                },
            ),
        ];
        assert_eq!(
            acquire_next(&view, &restarted, &[], 1),
            AcquireNext::Lost(vec![0, 1], None)
        );
    }
}

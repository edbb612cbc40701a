//! The checker for the fault tests: turns a [`FencedStore`](super::fenced::FencedStore)'s
//! records into critical sections, finds overlaps and violations, and measures handoffs.
//!
//! ## Sessions
//! A session is one critical section: the records of one writer with one fencing token. It
//! spans from its first record to its last record that was not late ([`Record::is_late`]: the
//! writer had paused past its own validity before writing, the case fencing exists for). It
//! ends `Released` (wrote `end`), `Gone` (its connection closed first) or `Open` (neither: it
//! stopped writing, e.g. after a failed renewal).
//!
//! ## Violations
//! 1. A session that began after another must carry a strictly greater token.
//! 2. The store never accepts a token below one it accepted before (self-check).
//! 3. [`Mode::Strict`] (no holder pauses): no two sessions overlap, and no write that was not
//!    late is refused.
//!    [`Mode::Fenced`] (holder pauses): sessions may overlap, but inside an overlap every write
//!    of the older session must have been refused ("fenced"); an unfenced overlap is a violation.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::fenced::{Kind, Record};

/// How sessions may relate in a scenario.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// No holder pauses: exclusion must hold outright.
    Strict,
    /// Holders are paused past their ttl: overlaps must be caught by fencing.
    Fenced,
}

/// How a session ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    Released,
    Gone,
    Open,
}

#[derive(Clone, Debug)]
pub struct Session {
    pub who: String,
    pub token: u64,
    pub begin: Instant,
    pub end: Instant,
    pub ended: Ended,
    pub writes: usize,
    pub refused: usize,
    pub late: usize,
}

#[derive(Clone, Debug)]
pub struct Overlap {
    /// (who, token) of the session that began first.
    pub older: (String, u64),
    pub newer: (String, u64),
    pub from: Instant,
    pub to: Instant,
    /// Every write of the older session inside the overlap was refused.
    pub fenced: bool,
}

impl Overlap {
    pub fn length(&self) -> Duration {
        self.to.saturating_duration_since(self.from)
    }
}

/// Everything the checker found in one scenario's records.
#[derive(Debug)]
pub struct Analysis {
    pub sessions: Vec<Session>,
    pub overlaps: Vec<Overlap>,
    pub violations: Vec<String>,
    /// Writes decided after their writer's validity (paused writers).
    pub late_writes: usize,
    /// Refused writes: a newer token had been accepted before them (fencing at work).
    pub stale_refused: usize,
    /// Gap between a released session's last write and the next session's first.
    pub release_takeovers: Vec<Duration>,
    /// From each crash to the first session that began after it.
    pub crash_takeovers: Vec<Duration>,
    /// Sum and maximum of the gaps in which no session was open.
    pub leaderless_total: Duration,
    pub leaderless_max: Duration,
    /// From the first session's start to the last one's end.
    pub span: Duration,
}

impl Analysis {
    /// Handoffs: every acquisition after the first.
    pub fn handoffs(&self) -> usize {
        self.sessions.len().saturating_sub(1)
    }

    /// The first session that began at or after `at`.
    pub fn first_begin_after(&self, at: Instant) -> Option<&Session> {
        self.sessions.iter().find(|s| s.begin >= at)
    }

    /// Panics with the violations (at most 20 shown) if there are any.
    pub fn assert_no_violations(&self, scenario: &str) {
        if !self.violations.is_empty() {
            let shown: Vec<&String> = self.violations.iter().take(20).collect();
            panic!(
                "{scenario}: {} violation(s) of mutual exclusion or token order:\n{}",
                self.violations.len(),
                shown
                    .iter()
                    .map(|v| format!("  {v}"))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }
}

/// Analyses `records` (in decision order). `crashes` are the moments holders were killed.
pub fn analyse(records: &[Record], mode: Mode, crashes: &[Instant]) -> Analysis {
    let origin = records.first().map(|r| r.at);
    let ms =
        |at: Instant| origin.map_or(0.0, |o| at.saturating_duration_since(o).as_secs_f64() * 1e3);
    let mut violations = Vec::new();

    // Rule 2: the store's own contract, re-checked from the log.
    let mut highest = 0u64;
    for r in records.iter().filter(|r| r.kind != Kind::Gone) {
        if r.accepted {
            if r.token < highest {
                violations.push(format!(
                    "store accepted token {} of {} at {:.1} ms after {highest}",
                    r.token,
                    r.who,
                    ms(r.at)
                ));
            }
            highest = highest.max(r.token);
        } else if r.token >= highest {
            violations.push(format!(
                "store refused token {} of {} at {:.1} ms though the highest was {highest}",
                r.token,
                r.who,
                ms(r.at)
            ));
        }
    }

    // Sessions, in order of their first record.
    let mut sessions: Vec<Session> = Vec::new();
    let mut index: std::collections::HashMap<(String, u64), usize> = Default::default();
    let mut late_writes = 0;
    for r in records {
        let key = (r.who.clone(), r.token);
        let i = *index.entry(key).or_insert_with(|| {
            sessions.push(Session {
                who: r.who.clone(),
                token: r.token,
                begin: r.at,
                end: r.at,
                ended: Ended::Open,
                writes: 0,
                refused: 0,
                late: 0,
            });
            sessions.len() - 1
        });
        let s = &mut sessions[i];
        match r.kind {
            Kind::Gone => {
                if !r.is_late() {
                    s.end = s.end.max(r.at);
                }
                if s.ended == Ended::Open {
                    s.ended = Ended::Gone;
                }
            }
            _ => {
                s.writes += 1;
                if !r.accepted {
                    s.refused += 1;
                }
                if r.is_late() {
                    s.late += 1;
                    late_writes += 1;
                } else {
                    s.end = s.end.max(r.at);
                }
                if r.kind == Kind::End {
                    s.ended = Ended::Released;
                }
            }
        }
    }

    // Rule 1: tokens strictly increase in the order sessions began.
    let mut max_before: Option<(u64, &Session)> = None;
    for s in &sessions {
        if let Some((max, earlier)) = max_before {
            if s.token <= max {
                violations.push(format!(
                    "token did not increase: {} began at {:.1} ms with {} after {} had {max}",
                    s.who,
                    ms(s.begin),
                    s.token,
                    earlier.who
                ));
            }
        }
        if max_before.is_none_or(|(max, _)| s.token > max) {
            max_before = Some((s.token, s));
        }
    }

    // Overlaps between any two sessions (few are open at once: a sweep in begin order).
    let mut overlaps = Vec::new();
    for (i, a) in sessions.iter().enumerate() {
        for b in sessions[i + 1..].iter() {
            if b.begin >= a.end {
                // Sessions are sorted by begin, but a later one may still end earlier than `a`;
                // only a begin past `a`'s end rules out every later session.
                break;
            }
            let (from, to) = (b.begin, a.end.min(b.end));
            let older_writes_inside: Vec<&Record> = records
                .iter()
                .filter(|r| {
                    r.who == a.who
                        && r.token == a.token
                        && r.kind != Kind::Gone
                        && r.at >= from
                        && r.at <= to
                })
                .collect();
            let fenced = older_writes_inside.iter().all(|r| !r.accepted);
            overlaps.push(Overlap {
                older: (a.who.clone(), a.token),
                newer: (b.who.clone(), b.token),
                from,
                to,
                fenced,
            });
        }
    }

    // Rule 3. By the store's rule a refused write always met a newer accepted token: within
    // its writer's validity that means two holders at once.
    let mut stale_refused = 0;
    for r in records
        .iter()
        .filter(|r| r.kind != Kind::Gone && !r.accepted)
    {
        stale_refused += 1;
        if mode == Mode::Strict && !r.is_late() {
            violations.push(format!(
                "{} was refused at {:.1} ms with token {} within its validity",
                r.who,
                ms(r.at),
                r.token
            ));
        }
    }
    for o in &overlaps {
        let describe = || {
            format!(
                "{} (token {}) and {} (token {}) overlapped {:.1}..{:.1} ms",
                o.older.0,
                o.older.1,
                o.newer.0,
                o.newer.1,
                ms(o.from),
                ms(o.to)
            )
        };
        match mode {
            Mode::Strict => violations.push(describe()),
            Mode::Fenced if !o.fenced => {
                violations.push(format!("{}, and the older one wrote inside", describe()))
            }
            Mode::Fenced => {}
        }
    }

    // Handoff times.
    let mut release_takeovers = Vec::new();
    for pair in sessions.windows(2) {
        let (prev, next) = (&pair[0], &pair[1]);
        if prev.ended == Ended::Released && next.begin >= prev.end {
            release_takeovers.push(next.begin - prev.end);
        }
    }
    let crash_takeovers = crashes
        .iter()
        .filter_map(|&c| sessions.iter().find(|s| s.begin >= c).map(|s| s.begin - c))
        .collect();
    let (mut leaderless_total, mut leaderless_max) = (Duration::ZERO, Duration::ZERO);
    let mut covered_until: Option<Instant> = None;
    for s in &sessions {
        if let Some(until) = covered_until {
            if s.begin > until {
                let gap = s.begin - until;
                leaderless_total += gap;
                leaderless_max = leaderless_max.max(gap);
            }
        }
        covered_until = Some(covered_until.map_or(s.end, |u| u.max(s.end)));
    }
    let span = match (sessions.first(), covered_until) {
        (Some(first), Some(until)) => until.saturating_duration_since(first.begin),
        _ => Duration::ZERO,
    };
    Analysis {
        sessions,
        overlaps,
        violations,
        late_writes,
        stale_refused,
        release_takeovers,
        crash_takeovers,
        leaderless_total,
        leaderless_max,
        span,
    }
}

/// The `q`-quantile (0..=1) of `values` by nearest rank; `None` when empty.
pub fn quantile(values: &[Duration], q: f64) -> Option<Duration> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort();
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

/// One row of the summary table.
#[derive(Clone, Debug)]
pub struct Row {
    pub scenario: String,
    pub contenders: String,
    pub handoffs: usize,
    pub faults: usize,
    pub violations: usize,
    pub overlaps: usize,
    pub fenced_overlaps: usize,
    pub stale_refused: usize,
    pub late_writes: usize,
    pub release: Vec<Duration>,
    pub crash: Vec<Duration>,
    pub leaderless_total: Duration,
    pub leaderless_max: Duration,
    pub span: Duration,
}

impl Row {
    pub fn new(scenario: &str, contenders: &str, faults: usize, a: &Analysis) -> Row {
        Row {
            scenario: scenario.to_owned(),
            contenders: contenders.to_owned(),
            handoffs: a.handoffs(),
            faults,
            violations: a.violations.len(),
            overlaps: a.overlaps.len(),
            fenced_overlaps: a.overlaps.iter().filter(|o| o.fenced).count(),
            stale_refused: a.stale_refused,
            late_writes: a.late_writes,
            release: a.release_takeovers.clone(),
            crash: a.crash_takeovers.clone(),
            leaderless_total: a.leaderless_total,
            leaderless_max: a.leaderless_max,
            span: a.span,
        }
    }
}

fn fmt_ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms >= 100.0 {
        format!("{ms:.0}")
    } else {
        format!("{ms:.1}")
    }
}

fn p50_max(values: &[Duration]) -> String {
    match (quantile(values, 0.5), quantile(values, 1.0)) {
        (Some(p50), Some(max)) => format!("{} / {} (n={})", fmt_ms(p50), fmt_ms(max), values.len()),
        _ => "–".to_owned(),
    }
}

/// A Markdown table of `rows`.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    out.push_str(
        "| scenario | contenders | handoffs | faults | violations | overlaps (fenced) | stale writes refused | late writes | takeover after release p50 / max ms | takeover after crash p50 / max ms | no leader total / longest ms | span s |\n",
    );
    out.push_str("|---|---|---:|---:|---:|---:|---:|---:|---|---|---|---:|\n");
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} ({}) | {} | {} | {} | {} | {} / {} | {:.1} |",
            r.scenario,
            r.contenders,
            r.handoffs,
            r.faults,
            r.violations,
            r.overlaps,
            r.fenced_overlaps,
            r.stale_refused,
            r.late_writes,
            p50_max(&r.release),
            p50_max(&r.crash),
            fmt_ms(r.leaderless_total),
            fmt_ms(r.leaderless_max),
            r.span.as_secs_f64()
        );
    }
    out
}

/// Rows of every scenario finished so far in this test binary.
static FINISHED: Mutex<Vec<Row>> = Mutex::new(Vec::new());

/// Adds `rows` to the finished scenarios and prints the table of all of them so far, in one
/// write so that parallel tests do not interleave: the last table printed has every row.
pub fn report(rows: Vec<Row>) {
    let mut finished = FINISHED.lock().unwrap_or_else(|e| e.into_inner());
    finished.extend(rows);
    let text = format!(
        "\nfault scenarios finished so far ({}):\n{}",
        finished.len(),
        table(&finished)
    );
    println!("{text}");
}

//! Watching each sidecar's `/leader`, and the tenures the answers describe, checked: never two
//! leaders at once, fencing tokens growing from tenure to tenure.
//!
//! A tenure's extent is known from what the sidecar itself reported, not from catching two 200s
//! in one poll: its claim began after the sidecar logged the acquisition of its fencing token
//! (leadership is published right after; `leader_since` is the start of that round). It lasts
//! as an app sees it: until the validity the last 200 promised runs out (`validity_ms` from
//! when it was asked), or until the sidecar logged its release on SIGTERM (the app is stopped
//! first), whichever is first. A round that began before the previous claim ended but took the
//! lock after it is a handoff, not an overlap.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{http, Proc};

/// Default bound on every wait for a leader: votes count after ttl + drift, plus a loaded machine.
pub const ELECTION: Duration = Duration::from_secs(25);
/// How often each sidecar's `/leader` is asked.
pub const POLL: Duration = Duration::from_millis(10);

/// A `run` sidecar the watch can poll: its name (`--identity`), HTTP address and process.
pub trait Sidecar {
    fn name(&self) -> &str;
    fn addr(&self) -> SocketAddr;
    fn proc(&self) -> &Proc;
}

#[derive(Clone, Debug)]
pub enum Answer {
    Leader {
        token: u64,
        since: SystemTime,
        validity: Duration,
    },
    Follower,
    /// No usable answer (not serving yet, a timeout): says nothing about leadership.
    Unknown,
}

#[derive(Clone, Debug)]
pub struct Seen {
    pub who: usize,
    pub sent: SystemTime,
    pub received: SystemTime,
    pub answer: Answer,
}

/// One tenure of one sidecar, bounded by what its answers said.
#[derive(Clone, Debug)]
pub struct Tenure {
    pub who: String,
    pub token: u64,
    /// When the round that took the lock began, as the sidecar reported it.
    pub since: SystemTime,
    /// The claim began after this: when the sidecar logged the acquisition (it publishes
    /// leadership right after), or `since` if the log does not say.
    pub claimed_after: SystemTime,
    /// When the first answer saying "leader" with this token came back: the claim began
    /// before.
    pub first_seen: SystemTime,
    /// When the last answer saying "leader" with this token was asked for: it lasted at least
    /// until then.
    pub leading_at: SystemTime,
    /// The sidecar stopped answering "leader" by here: when it logged its step-down or
    /// release, the first later "not leader" answer, or when the validity its last answer
    /// reported ran out, whichever is first.
    pub stopped_by: SystemTime,
    /// The claim ended here, as an app sees it: when the validity the last 200 promised ran
    /// out (counted from when it was asked), or at the release the sidecar logged on SIGTERM.
    pub ended_by: SystemTime,
}

/// When a sidecar's log says each of its tenures (by fencing token) was acquired, stepped
/// down, and released on SIGTERM.
#[derive(Default)]
pub struct LogTimes {
    pub acquired: HashMap<u64, SystemTime>,
    pub stepped_down: HashMap<u64, SystemTime>,
    pub released: HashMap<u64, SystemTime>,
}

/// Reads the sidecar's text log: a timestamp first, the message, `fencing_token=N`.
pub fn log_times(log: &str) -> LogTimes {
    let mut times = LogTimes::default();
    for line in log.lines() {
        let Some(at) = line
            .split_whitespace()
            .next()
            .and_then(|t| humantime::parse_rfc3339(t).ok())
        else {
            continue;
        };
        let Some(token) = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("fencing_token="))
            .and_then(|t| t.parse::<u64>().ok())
        else {
            continue;
        };
        if line.contains("acquired the lock") {
            times.acquired.insert(token, at);
        } else if line.contains("stepped down") || line.contains("released the lock") {
            times.stepped_down.entry(token).or_insert(at);
        }
        // On SIGTERM the app is stopped first, and the claim ends as the release begins: a
        // standby may take the lock once a quorum deleted the key, before the release's last
        // node (a slow one) answers and "released the lock" is logged.
        if line.contains("released the lock") || line.contains("stepped down for shutdown") {
            times.released.entry(token).or_insert(at);
        }
    }
    times
}

/// Polls every added sidecar's `/leader` until stopped.
pub struct Watch {
    /// Bound on every wait for a tenure.
    election: Duration,
    names: Vec<String>,
    /// Each added sidecar's stderr file, for failure messages.
    log_files: Vec<std::path::PathBuf>,
    /// The logs of sidecars that have exited, by name.
    logs: HashMap<String, String>,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Watch {
    pub fn new() -> Watch {
        Watch::with_election(ELECTION)
    }

    /// A watch whose waits for a tenure give up after `election`.
    pub fn with_election(election: Duration) -> Watch {
        Watch {
            election,
            names: Vec::new(),
            log_files: Vec::new(),
            logs: HashMap::new(),
            seen: Arc::default(),
            stop: CancellationToken::new(),
            tasks: Vec::new(),
        }
    }

    /// Starts polling `c`.
    pub fn add(&mut self, c: &impl Sidecar) {
        let who = self.names.len();
        self.names.push(c.name().to_owned());
        self.log_files.push(c.proc().stderr_path());
        self.tasks.push(tokio::spawn(poll_leader(
            who,
            c.addr(),
            self.seen.clone(),
            self.stop.clone(),
        )));
    }

    /// Keeps the log of sidecar `name`, which has exited, for the analysis.
    pub fn keep_log(&mut self, name: String, log: String) {
        self.logs.insert(name, log);
    }

    pub fn tenures(&self) -> Vec<Tenure> {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let logs: Vec<LogTimes> = self
            .names
            .iter()
            .map(|n| log_times(self.logs.get(n).map_or("", String::as_str)))
            .collect();
        tenures(&seen, &self.names, &logs)
    }

    /// Waits for a tenure that began after `after` (by `by`, if given) and returns it.
    /// Panics naming `what`, with the logs of `running`, if none comes within the watch's election bound.
    pub async fn next_tenure<S: Sidecar>(
        &self,
        after: SystemTime,
        by: Option<&str>,
        what: &str,
        running: &[&S],
    ) -> Tenure {
        let end = tokio::time::Instant::now() + self.election;
        loop {
            let found = self
                .tenures()
                .into_iter()
                .find(|t| t.since > after && by.is_none_or(|n| n == t.who));
            if let Some(t) = found {
                return t;
            }
            if tokio::time::Instant::now() >= end {
                let logs: Vec<String> = running
                    .iter()
                    .map(|c| format!("--- {} ---\n{}", c.name(), c.proc().output_text()))
                    .collect();
                panic!(
                    "timed out after {:?} waiting for: {what}\n{}",
                    self.election,
                    logs.join("\n")
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until the tenure `t` has lasted `long` by its answers.
    pub async fn lasted(&self, t: &Tenure, long: Duration) {
        let lasted = || {
            self.tenures()
                .iter()
                .any(|u| u.who == t.who && u.token == t.token && u.leading_at >= t.since + long)
        };
        let end = tokio::time::Instant::now() + self.election;
        while !lasted() {
            if tokio::time::Instant::now() >= end {
                panic!(
                    "timed out after {:?} waiting for: {} leads for {long:?}\ntenures: {:?}\n{}",
                    self.election,
                    t.who,
                    self.tenures(),
                    self.logs_so_far()
                );
            }
            tokio::time::sleep(super::POLL_EVERY).await;
        }
    }

    /// The logs of every added sidecar so far, labelled.
    fn logs_so_far(&self) -> String {
        self.names
            .iter()
            .zip(&self.log_files)
            .map(|(name, file)| {
                format!(
                    "--- {name} ---\n{}",
                    std::fs::read_to_string(file).unwrap_or_default()
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Stops polling and returns every tenure seen, checked: never two at once, tokens growing.
    /// `running` are the sidecars still running (their logs so far are read).
    pub async fn finish<S: Sidecar>(mut self, running: &[&S]) -> Vec<Tenure> {
        self.stop.cancel();
        for task in self.tasks.drain(..) {
            task.await.expect("poller did not panic");
        }
        for c in running {
            self.logs
                .insert(c.name().to_owned(), c.proc().stderr_text());
        }
        for (name, log) in &self.logs {
            assert!(
                !log_times(log).acquired.is_empty() || !self.tenures().iter().any(|t| &t.who == name),
                "{name}'s log shows when it acquired the lock (`acquired the lock … fencing_token=N`):\n{log}"
            );
        }
        let tenures = self.tenures();
        assert_one_leader_at_a_time(&tenures);
        tenures
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

pub async fn poll_leader(
    who: usize,
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        let sent = SystemTime::now();
        let answer = match http::get(addr, "/leader").await {
            Ok(r) => parse_answer(r.status, &r.body),
            Err(_) => Answer::Unknown,
        };
        let received = SystemTime::now();
        seen.lock().unwrap_or_else(|e| e.into_inner()).push(Seen {
            who,
            sent,
            received,
            answer,
        });
        tokio::time::sleep(POLL).await;
    }
}

pub fn parse_answer(status: u16, body: &str) -> Answer {
    let Ok(body) = serde_json::from_str::<serde_json::Value>(body) else {
        return Answer::Unknown;
    };
    assert_eq!(
        body["is_leader"].as_bool(),
        Some(status == 200),
        "status {status} and body agree: {body}"
    );
    if status != 200 {
        return Answer::Follower;
    }
    let token = body["fencing_token"].as_u64().expect("a leader's token");
    let since = body["leader_since"]
        .as_str()
        .and_then(|s| humantime::parse_rfc3339(s).ok())
        .expect("a leader's leader_since");
    let validity = Duration::from_millis(body["validity_ms"].as_u64().expect("validity_ms"));
    Answer::Leader {
        token,
        since,
        validity,
    }
}

/// The tenures the answers describe, narrowed by each sidecar's log, in the order they began.
pub fn tenures(seen: &[Seen], names: &[String], logs: &[LogTimes]) -> Vec<Tenure> {
    let mut out = Vec::new();
    for (who, name) in names.iter().enumerate() {
        let log = &logs[who];
        let mut close = |mut t: Tenure, bound: Option<SystemTime>| {
            if let Some(bound) = bound {
                t.stopped_by = t.stopped_by.min(bound);
            }
            if let Some(&stepped_down) = log.stepped_down.get(&t.token) {
                t.stopped_by = t.stopped_by.min(stepped_down);
            }
            if let Some(&released) = log.released.get(&t.token) {
                t.ended_by = t.ended_by.min(released);
            }
            out.push(t);
        };
        let mut open: Option<Tenure> = None;
        for s in seen.iter().filter(|s| s.who == who) {
            match s.answer {
                Answer::Leader {
                    token,
                    since,
                    validity,
                } => {
                    let valid_end = s.received + validity;
                    let promised = s.sent + validity;
                    match open.as_mut() {
                        Some(t) if t.token == token => {
                            t.leading_at = s.sent;
                            t.stopped_by = valid_end;
                            t.ended_by = t.ended_by.max(promised);
                        }
                        _ => {
                            if let Some(t) = open.take() {
                                close(t, Some(s.received));
                            }
                            open = Some(Tenure {
                                who: name.clone(),
                                token,
                                since,
                                claimed_after: log.acquired.get(&token).copied().unwrap_or(since),
                                first_seen: s.received,
                                leading_at: s.sent,
                                stopped_by: valid_end,
                                ended_by: promised,
                            });
                        }
                    }
                }
                Answer::Follower => {
                    if let Some(t) = open.take() {
                        close(t, Some(s.received));
                    }
                }
                Answer::Unknown => {}
            }
        }
        if let Some(t) = open {
            close(t, None);
        }
    }
    out.sort_by_key(|t| t.since);
    out
}

pub fn ms_between(from: SystemTime, to: SystemTime) -> f64 {
    match to.duration_since(from) {
        Ok(d) => d.as_secs_f64() * 1e3,
        Err(e) => -e.duration().as_secs_f64() * 1e3,
    }
}

/// Panics if a tenure began before an earlier one had ended, or if a token did not grow.
pub fn assert_one_leader_at_a_time(tenures: &[Tenure]) {
    let Some(origin) = tenures.first().map(|t| t.since) else {
        return;
    };
    let at = |t: SystemTime| ms_between(origin, t);
    let describe = |t: &Tenure| {
        format!(
            "{} (token {}, round began {:.1} ms, claimed after {:.1} ms, led at least until \
             {:.1} ms, stopped by {:.1} ms, claim ended {:.1} ms)",
            t.who,
            t.token,
            at(t.since),
            at(t.claimed_after),
            at(t.leading_at),
            at(t.stopped_by),
            at(t.ended_by)
        )
    };
    let mut violations = Vec::new();
    for (i, a) in tenures.iter().enumerate() {
        for b in &tenures[i + 1..] {
            // A round that began before `a` ended but took the lock after it is a handoff.
            if b.claimed_after >= a.ended_by {
                continue;
            }
            let how = if b.first_seen < a.leading_at {
                "two leaders"
            } else {
                "two leaders within one poll interval"
            };
            violations.push(format!("{how}: {} and {}", describe(a), describe(b)));
        }
    }
    for pair in tenures.windows(2) {
        if pair[1].token <= pair[0].token {
            violations.push(format!(
                "the token did not grow: {} after {}",
                describe(&pair[1]),
                describe(&pair[0])
            ));
        }
    }
    assert!(
        violations.is_empty(),
        "{}\nall tenures:\n{}",
        violations.join("\n"),
        tenures.iter().map(describe).collect::<Vec<_>>().join("\n")
    );
}

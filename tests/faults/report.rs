//! Checking a scenario's records and printing its summary row.

use super::*;

/// Analyses `store` and panics on any violation, after printing the scenario's row either way.
pub(crate) fn check(
    scenario: &str,
    contenders: &str,
    faults: usize,
    records: &[Record],
    mode: Mode,
    crashes: &[Instant],
) -> (Analysis, Row) {
    let analysis = analyse(records, mode, crashes);
    let row = Row::new(scenario, contenders, faults, &analysis);
    if !analysis.violations.is_empty() {
        checker::report(vec![row.clone()]);
    }
    analysis.assert_no_violations(scenario);
    (analysis, row)
}

/// Counts the votes the restart rule refused to count.
#[derive(Default)]
pub(crate) struct VoteCounter {
    pub(crate) not_counted: AtomicUsize,
}

impl redlock_sidecar::redlock::Observer for VoteCounter {
    fn node_counted(&self, _index: usize, counted: bool) {
        if !counted {
            self.not_counted.fetch_add(1, Ordering::Relaxed);
        }
    }
}

//! How a guard run ended, as one line for whoever runs guard (`--outcome-file`).

use std::path::Path;

use tracing::warn;

/// What happened to CMD.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// CMD ran under the lock and exited; the exit code is its own.
    Ran,
    /// The lock was busy and `--on-busy skip` said not to run (exit 0).
    Skipped,
    /// The lock was busy and `--on-busy fail` said to fail (exit 75).
    Busy,
    /// No quorum of nodes could be reached (exit 69).
    Unreachable,
    /// The lock was lost while CMD ran; CMD was stopped (exit 76).
    Lost,
    /// `--max-hold` was reached; CMD was stopped (exit 124).
    MaxHold,
    /// CMD was never started: it could not be executed (126/127), or a signal stopped
    /// guard before it started (128+S).
    NotStarted,
    /// `--slot`: the slot had already run, CMD was not started (exit 0).
    AlreadyRan,
    /// `--slot`: CMD exited 0 but the record that the slot ran reached fewer than a quorum of
    /// nodes (or the lock was lost before CMD's exit was seen): a later run of the slot may
    /// run it again (exit 69).
    Unrecorded,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Ran => "ran",
            Kind::Skipped => "skipped",
            Kind::Busy => "busy",
            Kind::Unreachable => "unreachable",
            Kind::Lost => "lost",
            Kind::MaxHold => "max-hold",
            Kind::NotStarted => "not-started",
            Kind::AlreadyRan => "already-ran",
            Kind::Unrecorded => "unrecorded",
        }
    }
}

/// The end of one guard run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub kind: Kind,
    pub exit_code: i32,
    /// Set when this run held the lock.
    pub fencing_token: Option<u64>,
}

impl Outcome {
    /// An outcome of a run that never held the lock.
    pub fn without_lock(kind: Kind, exit_code: i32) -> Outcome {
        Outcome {
            kind,
            exit_code,
            fencing_token: None,
        }
    }

    /// `outcome=<kind> exit_code=<n> lock=<name>[ fencing_token=<t>]`.
    pub fn line(&self, lock: &str) -> String {
        let mut line = format!(
            "outcome={} exit_code={} lock={lock}",
            self.kind.as_str(),
            self.exit_code
        );
        if let Some(token) = self.fencing_token {
            line.push_str(&format!(" fencing_token={token}"));
        }
        line
    }

    /// Writes [`Outcome::line`] to `path`; a failure is logged and changes nothing else.
    pub fn write(&self, path: &Path, lock: &str) {
        if let Err(err) = std::fs::write(path, format!("{}\n", self.line(lock))) {
            warn!(path = %path.display(), error = %err, "could not write the outcome file");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_carries_the_token_only_when_the_lock_was_held() {
        let ran = Outcome {
            kind: Kind::Ran,
            exit_code: 3,
            fencing_token: Some(42),
        };
        assert_eq!(
            ran.line("nightly"),
            "outcome=ran exit_code=3 lock=nightly fencing_token=42"
        );
        let skipped = Outcome::without_lock(Kind::Skipped, 0);
        assert_eq!(
            skipped.line("nightly"),
            "outcome=skipped exit_code=0 lock=nightly"
        );
        let already = Outcome {
            kind: Kind::AlreadyRan,
            exit_code: 0,
            fencing_token: Some(7),
        };
        assert_eq!(
            already.line("x"),
            "outcome=already-ran exit_code=0 lock=x fencing_token=7"
        );
        assert_eq!(
            Outcome::without_lock(Kind::MaxHold, 124).line("x"),
            "outcome=max-hold exit_code=124 lock=x"
        );
    }
}

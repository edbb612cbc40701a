//! Running the real `redlock-sidecar` binary (or any program) as a child with captured output.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::{send_signal, wait_stopped_state, TempDir, POLL_EVERY};

/// The binary under test: `REDLOCK_SIDECAR_BIN` when set (a release build, or a copy kept
/// apart from the target directory for a long stress run), else the one cargo built for these
/// integration tests.
pub fn bin() -> PathBuf {
    std::env::var_os("REDLOCK_SIDECAR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_redlock-sidecar")))
}

/// A child process whose stdout/stderr go to files in its own temp dir. Drop kills and waits.
pub struct Proc {
    child: Child,
    /// Set once the child has been reaped; after that its pid is never signalled again.
    status: Option<ExitStatus>,
    stopped: bool,
    dir: TempDir,
}

impl Proc {
    /// Spawns [`bin()`] with `args` and extra environment variables (the rest is inherited).
    pub fn spawn(args: &[&str], envs: &[(&str, &str)]) -> Proc {
        Proc::spawn_program(&bin(), args, envs)
    }

    /// Starts `program`. Every binary the tests start gets `REDLOCK_NODE_SET` =
    /// [`super::TEST_NODE_SET`] (see there); an entry `("REDLOCK_NODE_SET", "")` in `envs`
    /// removes it (the fingerprint of the servers applies).
    pub fn spawn_program(program: &Path, args: &[&str], envs: &[(&str, &str)]) -> Proc {
        Proc::spawn_with_stderr(program, args, envs, None)
    }

    /// [`Proc::spawn_program`] with stderr going to `stderr` (e.g. a pipe nobody reads)
    /// instead of a file the test can read.
    pub fn spawn_with_stderr(
        program: &Path,
        args: &[&str],
        envs: &[(&str, &str)],
        stderr: Option<Stdio>,
    ) -> Proc {
        let dir = TempDir::new("proc");
        let out = File::create(dir.path().join("stdout"))
            .unwrap_or_else(|e| panic!("cannot create stdout file: {e}"));
        let err = match stderr {
            Some(stderr) => stderr,
            None => Stdio::from(
                File::create(dir.path().join("stderr"))
                    .unwrap_or_else(|e| panic!("cannot create stderr file: {e}")),
            ),
        };
        let mut command = Command::new(program);
        command.env("REDLOCK_NODE_SET", super::TEST_NODE_SET);
        // Many sidecars run at once here: each gets a control port of its own unless the test
        // names one.
        command.env("REDLOCK_CONTROL_LISTEN", "127.0.0.1:0");
        for (key, value) in envs {
            if *key == "REDLOCK_NODE_SET" && value.is_empty() {
                command.env_remove(key);
            } else {
                command.env(key, value);
            }
        }
        let child = command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot spawn {}: {e}", program.display()));
        Proc {
            child,
            status: None,
            stopped: false,
            dir,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `sig` unless the child has already been reaped; true if delivered.
    pub fn signal(&mut self, sig: libc::c_int) -> bool {
        self.status.is_none() && send_signal(self.pid(), sig)
    }

    pub fn sigterm(&mut self) -> bool {
        self.signal(libc::SIGTERM)
    }

    pub fn sigint(&mut self) -> bool {
        self.signal(libc::SIGINT)
    }

    pub fn sigkill(&mut self) -> bool {
        self.signal(libc::SIGKILL)
    }

    /// SIGSTOP, then waits (bounded) until the process is actually stopped.
    pub fn sigstop(&mut self) -> bool {
        let sent = self.signal(libc::SIGSTOP);
        if sent {
            self.stopped = true;
            wait_stopped_state(self.pid(), true);
        }
        sent
    }

    pub fn sigcont(&mut self) -> bool {
        let sent = self.signal(libc::SIGCONT);
        if sent {
            self.stopped = false;
            wait_stopped_state(self.pid(), false);
        }
        sent
    }

    /// The exit status if the child has exited (reaps it), without waiting.
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            if let Ok(Some(s)) = self.child.try_wait() {
                self.status = Some(s);
            }
        }
        self.status
    }

    pub fn is_running(&mut self) -> bool {
        self.try_status().is_none()
    }

    /// Waits up to `deadline` for the child to exit.
    pub fn wait_exit(&mut self, deadline: Duration) -> Option<ExitStatus> {
        let end = Instant::now() + deadline;
        loop {
            if let Some(s) = self.try_status() {
                return Some(s);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(POLL_EVERY);
        }
    }

    /// Async twin of [`Proc::wait_exit`] (does not block the runtime while polling).
    pub async fn wait_exit_async(&mut self, deadline: Duration) -> Option<ExitStatus> {
        let end = Instant::now() + deadline;
        loop {
            if let Some(s) = self.try_status() {
                return Some(s);
            }
            if Instant::now() >= end {
                return None;
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }

    pub fn stdout_text(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stdout")).unwrap_or_default()
    }

    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(self.stderr_path()).unwrap_or_default()
    }

    /// Where the child's stderr is written (readable after the `Proc` is gone, while its
    /// directory lives).
    pub fn stderr_path(&self) -> std::path::PathBuf {
        self.dir.path().join("stderr")
    }

    /// Both streams, labelled, for failure messages.
    pub fn output_text(&self) -> String {
        format!(
            "--- stdout ---\n{}--- stderr ---\n{}",
            self.stdout_text(),
            self.stderr_text()
        )
    }

    /// Waits until stdout or stderr contains `needle`; panics with the output on timeout, or
    /// early if the process exits without printing it.
    pub fn wait_for_output(&mut self, needle: &str, deadline: Duration) {
        let end = Instant::now() + deadline;
        while !self.output_seen(needle, end, deadline) {
            std::thread::sleep(POLL_EVERY);
        }
    }

    /// Async twin of [`Proc::wait_for_output`] (does not block the runtime, so an in-process
    /// `FaultProxy` keeps running).
    pub async fn wait_for_output_async(&mut self, needle: &str, deadline: Duration) {
        let end = Instant::now() + deadline;
        while !self.output_seen(needle, end, deadline) {
            tokio::time::sleep(POLL_EVERY).await;
        }
    }

    fn output_seen(&mut self, needle: &str, end: Instant, deadline: Duration) -> bool {
        let seen = |p: &Proc| p.stdout_text().contains(needle) || p.stderr_text().contains(needle);
        if seen(self) {
            return true;
        }
        if let Some(status) = self.try_status() {
            // One last look: it may have printed it just before exiting.
            if seen(self) {
                return true;
            }
            panic!(
                "process exited ({status}) without printing {needle:?}\n{}",
                self.output_text()
            );
        }
        if Instant::now() >= end {
            panic!(
                "no {needle:?} in the output within {deadline:?}\n{}",
                self.output_text()
            );
        }
        false
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.status.is_none() {
            if self.stopped {
                send_signal(self.pid(), libc::SIGCONT);
            }
            let _ = self.child.kill();
            if let Ok(s) = self.child.wait() {
                self.status = Some(s);
            }
        }
    }
}

/// Runs the binary with invalid `args` and asserts the contract for bad configuration: exit
/// code 2 and exactly one line on stderr, naming `flag`. Returns that line. The lock and node
/// variables are blanked so the environment cannot fill in what the case leaves out.
pub fn assert_invalid_config(args: &[&str], flag: &str) -> String {
    assert_invalid_config_with_env(args, &[], flag)
}

/// [`assert_invalid_config`] with extra environment variables.
pub fn assert_invalid_config_with_env(args: &[&str], envs: &[(&str, &str)], flag: &str) -> String {
    let mut all = vec![("REDLOCK_REDIS", ""), ("REDLOCK_LOCK", "")];
    all.extend_from_slice(envs);
    let mut proc = Proc::spawn(args, &all);
    let status = proc.wait_exit(Duration::from_secs(10)).expect("exits");
    let stderr = proc.stderr_text();
    assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "{args:?}: one line: {stderr}"
    );
    assert!(stderr.contains(flag), "{args:?} names {flag}: {stderr}");
    stderr
}

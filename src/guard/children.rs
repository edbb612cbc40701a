//! guard's side of its children: the supervisor it starts CMD under, CMD's process group,
//! and orphans re-parented to guard (it is a child subreaper, e.g. as a container's PID 1).
//!
//! CMD's environment is guard's, without guard's own settings (every `REDLOCK_*` variable:
//! `REDLOCK_REDIS` may carry passwords inline, `REDLOCK_REDIS_PASSWORD` is one), plus
//! `REDLOCK_LOCK`, `REDLOCK_FENCING_TOKEN` and `REDLOCK_HOLDER`.

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::signal::unix::{signal, SignalKind};
use tracing::{debug, warn};

use super::supervisor::{self, Fence};
use super::tree;
use crate::clock::Deadline;
use crate::config::GuardConfig;

/// The prefix of guard's own settings, none of which CMD inherits.
const PRIVATE_PREFIX: &str = "REDLOCK_";

/// CMD's process group (CMD leads it), and the pipe on which the supervisor gets its fence.
pub struct CmdGroup {
    pgid: i32,
    /// Non-blocking: a write never waits for the supervisor.
    fence: std::fs::File,
    /// The fence last handed over.
    fenced: Fence,
}

impl CmdGroup {
    /// Sends `sig` to every process of the group.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) with a negative pid signals the process group; no memory involved.
        // The group cannot be reused while the supervisor runs: it has not reaped CMD.
        unsafe { libc::kill(-self.pgid, sig) };
    }

    /// Hands the supervisor new SIGTERM and SIGKILL points (it signals CMD at them on its
    /// own); false if it could not take them at once (it is gone, or not reading).
    pub fn fence(&mut self, term_at: Deadline, kill_at: Deadline) -> bool {
        let fence = Fence::at(term_at, kill_at);
        if fence == self.fenced {
            return true;
        }
        // One line, shorter than PIPE_BUF: written whole or not at all.
        let sent = (&self.fence).write_all(fence.encode().as_bytes()).is_ok();
        if sent {
            self.fenced = fence;
        }
        sent
    }
}

/// guard's children: the supervisor (and through it CMD), and orphans re-parented here.
pub struct Children {
    sigchld: Option<tokio::signal::unix::Signal>,
    supervisor: Option<i32>,
}

impl Children {
    /// Becomes a child subreaper and starts listening for SIGCHLD.
    pub fn new() -> Children {
        if let Err(err) = tree::become_subreaper() {
            warn!(error = %err, "cannot become a child subreaper; orphans go to PID 1");
        }
        Children {
            sigchld: signal(SignalKind::child()).ok(),
            supervisor: None,
        }
    }

    /// Starts the supervisor, which starts CMD with SIGTERM and SIGKILL due at `term_at` and
    /// `kill_at` (moved later by [`CmdGroup::fence`]); returns CMD's process group.
    pub async fn start(
        &mut self,
        cfg: &GuardConfig,
        token: u64,
        identity: &str,
        (term_at, kill_at): (Deadline, Deadline),
    ) -> std::io::Result<CmdGroup> {
        let (read, write) = pipe()?;
        // The supervisor's fence: the first one is in the pipe before it starts.
        let (fence_read, fence_write) = pipe()?;
        let fenced = Fence::at(term_at, kill_at);
        let mut fence = std::fs::File::from(fence_write);
        fence.write_all(fenced.encode().as_bytes())?;
        set_nonblocking(&fence)?;
        // Above the descriptors they go to, so that moving one cannot overwrite the other.
        let report_fd = dup_above(&write, supervisor::FENCE_FD)?;
        let fence_fd = dup_above(&fence_read, supervisor::FENCE_FD)?;
        drop(fence_read);
        let mut command = std::process::Command::new("/proc/self/exe");
        // The supervisor passes its environment on to CMD.
        for (name, _) in std::env::vars_os() {
            if name.as_bytes().starts_with(PRIVATE_PREFIX.as_bytes()) {
                command.env_remove(name);
            }
        }
        command
            .arg("supervise")
            .arg("--parent")
            .arg(std::process::id().to_string())
            .arg("--")
            .args(&cfg.command)
            .env("REDLOCK_LOCK", &cfg.redlock.lock)
            .env("REDLOCK_FENCING_TOKEN", token.to_string())
            .env("REDLOCK_HOLDER", identity)
            // A group of its own: a SIGKILL to guard's process group (or to CMD's) leaves it
            // alive to clean up.
            .process_group(0);
        let (report_raw, fence_raw) = (report_fd.as_raw_fd(), fence_fd.as_raw_fd());
        // SAFETY: getpid, getppid, dup2, prctl and _exit are async-signal-safe, as pre_exec
        // requires.
        let parent = unsafe { libc::getpid() };
        unsafe {
            command.pre_exec(move || {
                // dup2 leaves the new descriptors open across exec.
                if libc::dup2(report_raw, supervisor::REPORT_FD) < 0
                    || libc::dup2(fence_raw, supervisor::FENCE_FD) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                // guard's death, even by SIGKILL, reaches the supervisor as SIGTERM.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    libc::_exit(128 + libc::SIGKILL);
                }
                Ok(())
            });
        }
        // Its failure is guard's, not CMD's: never reported as "CMD not found" (127).
        let child = command.spawn().map_err(|err| {
            std::io::Error::other(format!(
                "cannot start the supervisor from /proc/self/exe (is /proc mounted?): {err}"
            ))
        })?;
        self.supervisor = Some(child.id() as i32);
        // Reaped through `supervisor_exit`, never through std's handle.
        drop(child);
        drop((write, report_fd, fence_fd));
        let mut report = String::new();
        tokio::net::unix::pipe::Receiver::from_owned_fd(read)?
            .read_to_string(&mut report)
            .await?;
        let mut words = report.split_whitespace();
        match (
            words.next(),
            words.next().and_then(|w| w.parse::<i32>().ok()),
        ) {
            (Some("started"), Some(pid)) => Ok(CmdGroup {
                pgid: pid,
                fence,
                fenced,
            }),
            (Some("error"), Some(errno)) => Err(std::io::Error::from_raw_os_error(errno)),
            _ => Err(std::io::Error::other(
                "the supervisor ended before starting CMD",
            )),
        }
    }

    /// Reaps exited children until the supervisor is among them; returns its exit code
    /// (CMD's code, or 128+S). Orphans re-parented to guard are reaped on the way.
    pub async fn supervisor_exit(&mut self) -> i32 {
        loop {
            if let Some(code) = self.reap() {
                return code;
            }
            match self.sigchld.as_mut() {
                Some(sigchld) => {
                    if sigchld.recv().await.is_none() {
                        std::future::pending::<()>().await;
                    }
                }
                // Without a SIGCHLD handler, poll.
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// Reaps every exited child; the supervisor's exit code once it is among them.
    fn reap(&mut self) -> Option<i32> {
        let mut supervisor_code = None;
        tree::reap_exited(|pid, code| {
            if Some(pid) == self.supervisor {
                self.supervisor = None;
                supervisor_code = Some(code);
            } else {
                debug!(pid, code, "reaped an orphaned process");
            }
        });
        supervisor_code
    }

    /// SIGKILLs every process below guard and reaps it (bounded: a process stuck in
    /// the kernel is left after about a second, with a warning).
    pub async fn kill_all_below(&mut self) {
        let me = std::process::id() as i32;
        for _ in 0..200 {
            self.reap();
            if tree::kill_descendants(me) == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        warn!("processes of CMD's tree survived SIGKILL for a second");
    }
}

/// A pipe whose ends are closed on exec.
/// A close-on-exec copy of `fd` numbered above `min`.
fn dup_above(fd: &OwnedFd, min: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: fcntl returns a new descriptor, owned by nobody else.
    let copy = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, min + 1) };
    if copy < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: just created above.
    Ok(unsafe { OwnedFd::from_raw_fd(copy) })
}

fn set_nonblocking(file: &std::fs::File) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor we own.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0
        || unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0
    {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into `fds`.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

//! guard's side of its children: the helpers it starts CMD under (the watchdog, and below it
//! the supervisor, see [`super::supervisor`]), the fence it publishes to them, what they
//! report, CMD's process group, and orphans re-parented to guard (it is a child subreaper,
//! e.g. as a container's PID 1).
//!
//! CMD's environment is guard's, without guard's own settings (every `REDLOCK_*` variable:
//! `REDLOCK_REDIS` may carry passwords inline, `REDLOCK_REDIS_PASSWORD` is one), plus
//! `REDLOCK_LOCK`, `REDLOCK_FENCING_TOKEN` and `REDLOCK_HOLDER`.

use std::collections::VecDeque;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::AsyncReadExt;
use tokio::signal::unix::{signal, SignalKind};
use tracing::{debug, warn};

use super::fence::{Fence, FenceCell};
use super::supervisor::{self, Line};
use super::tree;
use crate::clock::{self, Deadline};
use crate::config::GuardConfig;

/// The prefix of guard's own settings, none of which CMD inherits.
const PRIVATE_PREFIX: &str = "REDLOCK_";

/// CMD's process group (CMD leads it), the fence guard publishes to its helpers, and what
/// they report.
pub struct CmdGroup {
    pgid: i32,
    /// CMD's parent.
    supervisor: i32,
    fence: FenceCell,
    /// The write ends of the helpers' doorbells, non-blocking: a ring never waits.
    doorbells: [std::fs::File; 2],
    /// The helpers' report pipe, after the start line.
    reports: Reports,
    /// CMD as a pidfd: readable once CMD has exited, whether or not its parent (the
    /// supervisor, which reaps it) runs. `None` before Linux 5.3.
    cmd_exit: Option<AsyncFd<OwnedFd>>,
}

/// What [`CmdGroup::watch`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// A helper reported signalling CMD at the fence.
    Fenced,
    /// CMD has exited (its parent may not have reaped it yet).
    CmdGone,
}

impl CmdGroup {
    /// Sends `sig` to every process of the group.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) with a negative pid signals the process group; no memory involved.
        // The group cannot be reused while the supervisor runs: it has not reaped CMD.
        unsafe { libc::kill(-self.pgid, sig) };
    }

    /// Publishes new SIGTERM and SIGKILL points to both helpers (they signal CMD at them on
    /// their own) and wakes them. Never waits.
    pub fn fence(&mut self, term_at: Deadline, kill_at: Deadline) {
        let fence = Fence::at(term_at, kill_at);
        if Fence::decode(fence.encode()) == self.fence.load() {
            return;
        }
        self.fence.store(fence);
        for doorbell in &self.doorbells {
            // A full doorbell already has a wake-up queued.
            let _ = (&*doorbell).write(b"!");
        }
    }

    /// Whether the supervisor is there to send CMD the SIGTERM it is due (not stopped, not
    /// dead): if not, guard sends it itself.
    pub fn supervisor_running(&self) -> bool {
        tree::stat(self.supervisor)
            .is_some_and(|(state, _)| !matches!(state, 'T' | 't' | 'Z' | 'X'))
    }

    /// Waits until a helper reports that it signalled CMD at the fence (guard's own thread
    /// was late), if `fenced`, or until CMD has exited, if `gone`; each is seen once (then,
    /// and without either, this waits forever).
    pub async fn watch(&mut self, fenced: bool, gone: bool) -> Seen {
        let cmd_exit = self.cmd_exit.as_ref();
        tokio::select! {
            _ = self.reports.fenced(), if fenced => Seen::Fenced,
            Ok(_) = async { cmd_exit.expect("polled only when set").readable().await }, if gone && cmd_exit.is_some() => Seen::CmdGone,
            else => std::future::pending().await,
        }
    }

    /// CMD's exit code (128+S if signal S ended it), when the helpers may not pass it on:
    /// as the supervisor reported it, or read from CMD's zombie the supervisor has not reaped
    /// (stopped), or from the supervisor's zombie the watchdog has not reaped.
    pub fn cmd_exit_code(&mut self) -> Option<i32> {
        self.reports.fenced_now();
        self.reports
            .cmd_code
            .or_else(|| tree::exit_code(self.pgid))
            .or_else(|| tree::exit_code(self.supervisor))
    }

    /// Whether a helper has reported signalling CMD at the fence, reading what is in the pipe
    /// without waiting.
    pub fn fenced_now(&mut self) -> bool {
        self.reports.fenced_now()
    }
}

/// The helpers' report pipe.
struct Reports {
    pipe: Option<tokio::net::unix::pipe::Receiver>,
    /// A line not complete yet.
    partial: Vec<u8>,
    /// Lines read and not yet asked for.
    lines: VecDeque<Line>,
    /// A helper reported signalling CMD at the fence.
    fenced: bool,
    /// CMD's code, as the supervisor reported it when it reaped CMD.
    cmd_code: Option<i32>,
}

impl Reports {
    fn new(pipe: tokio::net::unix::pipe::Receiver) -> Reports {
        Reports {
            pipe: Some(pipe),
            partial: Vec::new(),
            lines: VecDeque::new(),
            fenced: false,
            cmd_code: None,
        }
    }

    /// Takes in `bytes` read from the pipe.
    fn take(&mut self, bytes: &[u8]) {
        self.partial.extend_from_slice(bytes);
        while let Some(end) = self.partial.iter().position(|&b| b == b'\n') {
            let text: Vec<u8> = self.partial.drain(..=end).collect();
            if let Some(line) = Line::parse(&String::from_utf8_lossy(&text)) {
                match line {
                    Line::Fenced(_) => self.fenced = true,
                    Line::Exited(code) => self.cmd_code = Some(code),
                    _ => {}
                }
                self.lines.push_back(line);
            }
        }
    }

    /// The next line, waiting for it; `None` at end-of-file (both helpers gone).
    async fn next(&mut self) -> Option<Line> {
        let mut buf = [0u8; 256];
        loop {
            if let Some(line) = self.lines.pop_front() {
                return Some(line);
            }
            let read = match self.pipe.as_mut() {
                Some(pipe) => pipe.read(&mut buf).await,
                None => return None,
            };
            match read {
                Ok(n) if n > 0 => self.take(&buf[..n]),
                _ => self.pipe = None,
            }
        }
    }

    async fn fenced(&mut self) {
        while !self.fenced {
            if self.next().await.is_none() {
                break;
            }
        }
        std::future::pending::<()>().await
    }

    fn fenced_now(&mut self) -> bool {
        let mut buf = [0u8; 256];
        while let Some(pipe) = &self.pipe {
            match pipe.try_read(&mut buf) {
                Ok(n) if n > 0 => {
                    self.take(&buf[..n]);
                }
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => break,
                _ => self.pipe = None,
            }
        }
        self.fenced
    }
}

/// guard's children: the watchdog (and through it the supervisor and CMD), and orphans
/// re-parented here.
pub struct Children {
    sigchld: Option<tokio::signal::unix::Signal>,
    /// guard's own child: the watchdog.
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

    /// Starts the watchdog, which starts the supervisor, which starts CMD, with SIGTERM and
    /// SIGKILL due at `term_at` and `kill_at` (moved by [`CmdGroup::fence`]); returns CMD's
    /// process group.
    pub async fn start(
        &mut self,
        cfg: &GuardConfig,
        token: u64,
        identity: &str,
        (term_at, kill_at): (Deadline, Deadline),
    ) -> std::io::Result<CmdGroup> {
        // The fence is in place before any helper starts.
        let fence = FenceCell::create(Fence::at(term_at, kill_at))?;
        let (report_read, report_write) = pipe()?;
        let (watchdog_bell, watchdog_ring) = pipe()?;
        let (supervisor_bell, supervisor_ring) = pipe()?;
        let doorbells = [
            std::fs::File::from(watchdog_ring),
            std::fs::File::from(supervisor_ring),
        ];
        for doorbell in &doorbells {
            set_nonblocking(doorbell)?;
        }
        // Above the descriptors they go to, so that moving one cannot overwrite another.
        let top = supervisor::NEXT_DOORBELL_FD;
        let moved = [
            (dup_above(&report_write, top)?, supervisor::REPORT_FD),
            (dup_above(&watchdog_bell, top)?, supervisor::DOORBELL_FD),
            (
                dup_above(&fence.as_fd().try_clone_to_owned()?, top)?,
                supervisor::FENCE_FD,
            ),
            (
                dup_above(&supervisor_bell, top)?,
                supervisor::NEXT_DOORBELL_FD,
            ),
        ];
        drop((report_write, watchdog_bell, supervisor_bell));
        let child = spawn_watchdog(cfg, token, identity, &moved)?;
        self.supervisor = Some(child.id() as i32);
        // Reaped through `supervisor_exit`, never through std's handle.
        drop(child);
        drop(moved);
        let reports = Reports::new(tokio::net::unix::pipe::Receiver::from_owned_fd(
            report_read,
        )?);
        cmd_started(reports, fence, doorbells).await
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
                None => clock::pause(Duration::from_millis(50)).await,
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

    /// SIGKILLs every process below guard now (CMD's tree and the helpers), once, without
    /// waiting: the kill at the fence's SIGKILL point.
    pub fn kill_below(&self) {
        tree::kill_descendants(std::process::id() as i32);
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
            clock::pause(Duration::from_millis(5)).await;
        }
        warn!("processes of CMD's tree survived SIGKILL for a second");
    }
}

/// Spawns the watchdog (`supervise`, from this very binary) for CMD, with `moved`'s
/// descriptors put in place for it, in a process group of its own; it dies with guard.
fn spawn_watchdog(
    cfg: &GuardConfig,
    token: u64,
    identity: &str,
    moved: &[(OwnedFd, i32)],
) -> std::io::Result<std::process::Child> {
    let mut command = std::process::Command::new("/proc/self/exe");
    // The helpers pass their environment on to CMD.
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
    let raw: Vec<(i32, i32)> = moved.iter().map(|(fd, to)| (fd.as_raw_fd(), *to)).collect();
    // SAFETY: getpid, getppid, dup2, prctl and _exit are async-signal-safe, as pre_exec
    // requires.
    let parent = unsafe { libc::getpid() };
    unsafe {
        command.pre_exec(move || {
            // dup2 leaves the new descriptors open across exec.
            for &(from, to) in &raw {
                if libc::dup2(from, to) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // guard's death, even by SIGKILL, reaches the watchdog as SIGTERM.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                libc::_exit(crate::exit::killed_by(libc::SIGKILL));
            }
            Ok(())
        });
    }
    // Its failure is guard's, not CMD's: never reported as "CMD not found" (127).
    command.spawn().map_err(|err| {
        std::io::Error::other(format!(
            "cannot start the watchdog from /proc/self/exe (is /proc mounted?): {err}"
        ))
    })
}

/// Waits for the supervisor's report that CMD started (its group, then), or why it did not.
async fn cmd_started(
    mut reports: Reports,
    fence: FenceCell,
    doorbells: [std::fs::File; 2],
) -> std::io::Result<CmdGroup> {
    loop {
        match reports.next().await {
            Some(Line::Started { cmd, supervisor }) => {
                return Ok(CmdGroup {
                    pgid: cmd,
                    supervisor,
                    fence,
                    doorbells,
                    reports,
                    cmd_exit: pidfd(cmd),
                })
            }
            Some(Line::CmdError(errno)) => return Err(std::io::Error::from_raw_os_error(errno)),
            Some(Line::HelperError(errno)) => {
                return Err(std::io::Error::other(format!(
                    "the supervisor could not be set up: {}",
                    std::io::Error::from_raw_os_error(errno)
                )))
            }
            // A helper fenced before CMD was reported (guard was that late): CMD's start line,
            // or the end, follows. (CMD's end cannot come before its start.)
            Some(Line::Fenced(_) | Line::Exited(_)) => {}
            None => {
                return Err(std::io::Error::other(
                    "the supervisor ended before starting CMD",
                ))
            }
        }
    }
}

/// `pid` as a pidfd registered with the runtime; `None` where the kernel has none.
fn pidfd(pid: i32) -> Option<AsyncFd<OwnedFd>> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor (or -1).
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if raw < 0 {
        return None;
    }
    // SAFETY: a new descriptor, owned by nobody else; owned by the AsyncFd, so it stays open
    // while registered.
    unsafe { AsyncFd::register(OwnedFd::from_raw_fd(raw as i32)).ok() }
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

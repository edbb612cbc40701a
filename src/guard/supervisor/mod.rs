//! The two helper processes between guard and CMD, which kill CMD's whole tree by the
//! fence's SIGKILL point whatever guard is doing, and at once when guard dies.
//!
//! ```text
//! guard ── watchdog ── supervisor ── CMD ── CMD's tree (setsid, double forks included)
//! ```
//!
//! A SIGKILLed or SIGSTOPped process cannot act, and the kernel's parent-death signal reaches
//! only a direct child, not CMD's own children. So there are three processes that can each
//! kill CMD's whole tree on their own, and any one of them is enough: whichever two of guard,
//! the watchdog and the supervisor are stopped or killed (in any mix), the third is still
//! running, and it is an ancestor of every process of CMD's tree. That holds because all
//! three are child subreapers: a process whose parent dies is re-parented to the nearest
//! living one of them above it (a stopped one counts as living), never past a running one to
//! PID 1. Both helpers are guard's own binary (the hidden `supervise` subcommand), need no
//! privileges (a PID namespace would need `CAP_SYS_ADMIN` or user namespaces, `cgroup.kill` a
//! delegated cgroup), and need `/proc`.
//!
//! ## Behaviour (both helpers)
//! - **The fence.** guard publishes when CMD must get SIGTERM and SIGKILL (`guard::fence`:
//!   a shared word on [`FENCE_FD`], a doorbell pipe on [`DOORBELL_FD`]; the first fence is in
//!   place before the watchdog starts, a new one after every renewal or decision). Each helper
//!   reads it on every wake and keeps a `CLOCK_BOOTTIME` timer on it (the lease's clock,
//!   counting host suspends). At the SIGKILL point it kills every process below itself,
//!   whatever guard is doing: a guard blocked on a full stderr pipe, a hung file read or
//!   SIGSTOP cannot keep CMD running past the step-down point. The supervisor also sends
//!   SIGTERM to CMD's process group at the SIGTERM point; the watchdog holds only the SIGKILL
//!   point. Each signal is sent once.
//! - **guard's death** (the doorbell's end-of-file, which only guard's exit causes, or the
//!   parent-death signal for the watchdog) → SIGKILL to every process below, reap, exit.
//! - **The process below dies** (the supervisor for the watchdog, CMD for the supervisor) →
//!   SIGKILL to whatever is left below (CMD's tree, also processes that left its process
//!   group), reap, exit with its code (CMD's code, or 128+S if signal S killed it).
//! - **Nothing on the kill path blocks**: no logging, no file but `/proc`, no waiting on guard;
//!   reports to guard ([`REPORT_FD`]: CMD's pid, or why it could not start; a line before each
//!   signal sent at the fence, so that guard can say why CMD ended; CMD's code once reaped)
//!   are non-blocking writes of a few bytes.
//! - Each helper has a process group of its own, neither guard's nor CMD's: guard signals
//!   CMD's group without touching them, and a SIGKILL to guard's whole group (a terminal, a
//!   process manager) leaves them to clean up. Signals sent to them are ignored unless they
//!   mean their parent has died.
//! - CMD gets SIGKILL if the supervisor dies, and the supervisor SIGTERM if the watchdog dies
//!   (parent-death signals).
//!
//! The watchdog is told apart by the descriptor it alone gets ([`NEXT_DOORBELL_FD`]: the
//! supervisor's doorbell, which it hands on).

//!
//! | file | concern |
//! |---|---|
//! | this file | the helpers' logic: start what is below, carry out the fence, reap, report |
//! | [`waiting`] | what a helper waits on without blocking the kill path: its doorbell, its signals (a signalfd), one `poll` |

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::time::Duration;

use super::fence::{Fence, FenceCell};
use super::tree;
use crate::clock::{self, BootTimer};
use crate::exit;
use waiting::{block, inherit, is_fifo, next_signal_now, set_nonblocking, wait_readable};
use waiting::{Bell, Doorbell, SignalFd};

pub mod waiting;

/// Where a helper reports to guard ([`Line`]s); shared by both helpers.
pub const REPORT_FD: i32 = 3;
/// The read end of this helper's doorbell: a byte when the fence moved, end-of-file when
/// guard is gone.
pub const DOORBELL_FD: i32 = 4;
/// The shared fence word (`guard::fence::FenceCell`).
pub const FENCE_FD: i32 = 5;
/// The watchdog's only: the supervisor's doorbell, handed on as its [`DOORBELL_FD`].
pub const NEXT_DOORBELL_FD: i32 = 6;

/// Signals this process waits for instead of handling them asynchronously.
const WATCHED: [i32; 5] = [
    libc::SIGCHLD,
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGQUIT,
];

/// What a helper tells guard, one line each, short enough for one atomic pipe write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Line {
    /// The supervisor started CMD: `started CMD_PID SUPERVISOR_PID`.
    Started { cmd: i32, supervisor: i32 },
    /// CMD could not be started: `error ERRNO`.
    CmdError(i32),
    /// A helper could not be set up: `failed ERRNO`.
    HelperError(i32),
    /// A helper is about to send `signal` to CMD at the fence: `fenced SIGNAL`.
    Fenced(i32),
    /// The supervisor reaped CMD, which ended with `code` (128+S for signal S): `exited CODE`.
    Exited(i32),
}

impl Line {
    pub fn encode(&self) -> String {
        match self {
            Line::Started { cmd, supervisor } => format!("started {cmd} {supervisor}\n"),
            Line::CmdError(errno) => format!("error {errno}\n"),
            Line::HelperError(errno) => format!("failed {errno}\n"),
            Line::Fenced(signal) => format!("fenced {signal}\n"),
            Line::Exited(code) => format!("exited {code}\n"),
        }
    }

    /// The line `text` (without its newline), if it is one.
    pub fn parse(text: &str) -> Option<Line> {
        let mut words = text.split_whitespace();
        let word = words.next()?;
        let mut number = || words.next()?.parse::<i32>().ok();
        let line = match word {
            "started" => Line::Started {
                cmd: number()?,
                supervisor: number()?,
            },
            "error" => Line::CmdError(number()?),
            "failed" => Line::HelperError(number()?),
            "fenced" => Line::Fenced(number()?),
            "exited" => Line::Exited(number()?),
            _ => return None,
        };
        words.next().is_none().then_some(line)
    }
}

/// Which helper this process is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// guard's child; below it, the supervisor.
    Watchdog,
    /// CMD's parent.
    Supervisor,
}

/// What the helper has done to CMD at the fence.
#[derive(Default)]
struct Fenced {
    terminated: bool,
    killed: bool,
}

/// Runs a helper for `parent` (guard for the watchdog, the watchdog for the supervisor) and
/// returns the code to exit with.
pub fn supervise(parent: i32, command: &[String]) -> i32 {
    let mut report = inherit(REPORT_FD).map(std::fs::File::from);
    if let Some(file) = &report {
        let _ = set_nonblocking(file.as_raw_fd());
    }
    let doorbell = inherit(DOORBELL_FD).map(Doorbell::new);
    let fence = inherit(FENCE_FD).and_then(|fd| FenceCell::open(fd).ok());
    let next_doorbell = inherit(NEXT_DOORBELL_FD).filter(is_fifo);
    let watched = block(&WATCHED);
    if let Err(err) = tree::become_subreaper() {
        eprintln!("redlock-sidecar: cannot become a child subreaper: {err}");
    }
    if parent_gone(parent) {
        return exit::HELPER_FAILED;
    }
    // guard publishes the first fence before starting the watchdog: no CMD without one.
    let (Some(fence), Some(mut doorbell)) = (fence, doorbell) else {
        send(&mut report, Line::HelperError(libc::EINVAL));
        return exit::HELPER_FAILED;
    };
    let (below, role) = match next_doorbell {
        Some(next) => match spawn_supervisor(command, &next) {
            Ok(pid) => (pid, Role::Watchdog),
            Err(err) => {
                send(
                    &mut report,
                    Line::HelperError(err.raw_os_error().unwrap_or(libc::EIO)),
                );
                return exit::HELPER_FAILED;
            }
        },
        None => match spawn_cmd(command) {
            Ok(pid) => {
                // SAFETY: getpid has no preconditions.
                let supervisor = unsafe { libc::getpid() };
                send(
                    &mut report,
                    Line::Started {
                        cmd: pid,
                        supervisor,
                    },
                );
                (pid, Role::Supervisor)
            }
            Err(err) => {
                send(&mut report, Line::CmdError(err.raw_os_error().unwrap_or(0)));
                return if err.kind() == std::io::ErrorKind::NotFound {
                    exit::NOT_FOUND
                } else {
                    exit::NOT_EXECUTABLE
                };
            }
        },
    };
    watch(
        below,
        role,
        parent,
        &fence,
        &mut doorbell,
        &mut report,
        &watched,
    )
}

/// Carries out the fence and waits for the process `below` (the supervisor or CMD), guard's
/// death or the parent's; returns the code to exit with.
fn watch(
    below: i32,
    role: Role,
    parent: i32,
    fence: &FenceCell,
    doorbell: &mut Doorbell,
    report: &mut Option<std::fs::File>,
    watched: &libc::sigset_t,
) -> i32 {
    let signals = SignalFd::new(watched);
    let timer = BootTimer::new();
    let mut fenced = Fenced::default();
    loop {
        let (due, next) = fence_due(&fence.load(), &mut fenced, clock::boottime());
        for signal in due {
            if signal == libc::SIGTERM && role == Role::Watchdog {
                continue;
            }
            // Before the signal: once the process below has exited, guard finds it.
            send(report, Line::Fenced(signal));
            signal_below(below, signal);
        }
        if let Some(timer) = &timer {
            // One-shot: once read, it is readable again only if armed again.
            timer.clear();
            if let Some(at) = next {
                let _ = timer.arm(at);
            }
        }
        let timeout = match (&timer, next) {
            (None, Some(at)) => Some(at.saturating_sub(clock::boottime())),
            _ => None,
        };
        wait_readable(
            &[
                signals.as_ref().map(SignalFd::fd),
                Some(doorbell.fd()),
                timer.as_ref().map(BootTimer::as_raw_fd),
            ],
            timeout,
        );
        if doorbell.drain() == Bell::Closed {
            // Only guard holds the other end: it has exited or died, and it exits only after
            // the watchdog did. Nothing below may outlive it.
            tree::kill_and_reap_all();
            return exit::killed_by(libc::SIGKILL);
        }
        let pending = match &signals {
            Some(signals) => signals.take(),
            None => next_signal_now(watched),
        };
        for signal in pending {
            if signal == libc::SIGCHLD {
                if let Some(code) = reap_until(below) {
                    if role == Role::Supervisor {
                        // guard has CMD's code even if the watchdog cannot pass it on.
                        send(report, Line::Exited(code));
                    }
                    tree::kill_and_reap_all();
                    return code;
                }
            } else if parent_gone(parent) {
                tree::kill_and_reap_all();
                return exit::killed_by(libc::SIGKILL);
            }
        }
    }
}

/// The signals `fence` calls for at `now` that were not sent yet (marked sent), and the next
/// point to wake at, if any is left. A pure decision; [`watch`] carries it out.
fn fence_due(fence: &Fence, fenced: &mut Fenced, now: Duration) -> (Vec<i32>, Option<Duration>) {
    let mut due = Vec::new();
    if !fenced.terminated && now >= fence.term_at {
        fenced.terminated = true;
        due.push(libc::SIGTERM);
    }
    if !fenced.killed && now >= fence.kill_at {
        fenced.killed = true;
        due.push(libc::SIGKILL);
    }
    let next = match (fenced.terminated, fenced.killed) {
        (false, _) => Some(fence.term_at.min(fence.kill_at)),
        (true, false) => Some(fence.kill_at),
        (true, true) => None,
    };
    (due, next)
}

/// Sends `signal` to the process group of `below` (CMD's, or the supervisor's own); SIGKILL
/// also goes to every process below this one, those that left the group included.
fn signal_below(below: i32, signal: i32) {
    // SAFETY: kill(2) on the group `below` leads; it is not reaped yet, so the group is ours.
    unsafe { libc::kill(-below, signal) };
    if signal == libc::SIGKILL {
        // SAFETY: getpid has no preconditions.
        tree::kill_descendants(unsafe { libc::getpid() });
    }
}

/// Starts the supervisor below the watchdog: this binary again, in a process group of its
/// own, with the report pipe and the fence, and `next` as its doorbell.
fn spawn_supervisor(command: &[String], next: &OwnedFd) -> std::io::Result<i32> {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let mut supervisor = std::process::Command::new("/proc/self/exe");
    supervisor
        .arg("supervise")
        .arg("--parent")
        .arg(me.to_string())
        .arg("--")
        .args(command)
        .process_group(0);
    let next = next.as_raw_fd();
    // SAFETY: fcntl, dup2, prctl, getppid and _exit are async-signal-safe, as pre_exec
    // requires. They change the child's descriptors only.
    unsafe {
        supervisor.pre_exec(move || {
            // The report pipe and the fence stay open across exec; the doorbell moves to its
            // number (dup2 leaves the copy open across exec); NEXT_DOORBELL_FD is closed on it.
            if libc::fcntl(REPORT_FD, libc::F_SETFD, 0) != 0
                || libc::fcntl(FENCE_FD, libc::F_SETFD, 0) != 0
                || libc::dup2(next, DOORBELL_FD) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // The watchdog's death, even by SIGKILL, reaches the supervisor as SIGTERM.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != me {
                libc::_exit(exit::killed_by(libc::SIGKILL));
            }
            Ok(())
        });
    }
    let child = supervisor.spawn()?;
    // std's Child is not waited through: this process reaps everything itself.
    Ok(child.id() as i32)
}

/// Starts CMD in its own process group; it dies with this process.
fn spawn_cmd(command: &[String]) -> std::io::Result<i32> {
    let mut cmd = std::process::Command::new(&command[0]);
    cmd.args(&command[1..]).process_group(0);
    // SAFETY: getpid, getppid, prctl, sigemptyset, pthread_sigmask and _exit are
    // async-signal-safe, as pre_exec requires.
    let me = unsafe { libc::getpid() };
    unsafe {
        cmd.pre_exec(move || {
            // CMD starts with no blocked signals, whatever this process blocks.
            let mut none = std::mem::zeroed::<libc::sigset_t>();
            libc::sigemptyset(&mut none);
            libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != me {
                libc::_exit(exit::killed_by(libc::SIGKILL));
            }
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    // std's Child is not waited through: this process reaps everything itself.
    Ok(child.id() as i32)
}

/// Reaps every exited child; returns the code of `below` once it is among them.
fn reap_until(below: i32) -> Option<i32> {
    let mut code = None;
    tree::reap_exited(|pid, exit| {
        if pid == below {
            code = Some(exit);
        }
    });
    code
}

fn parent_gone(parent: i32) -> bool {
    // SAFETY: getppid has no preconditions.
    unsafe { libc::getppid() != parent }
}

/// Writes `line` to guard without waiting (a few bytes into a pipe with room for thousands).
fn send(report: &mut Option<std::fs::File>, line: Line) {
    if let Some(file) = report {
        let _ = file.write_all(line.encode().as_bytes());
    }
}

#[cfg(test)]
mod tests;

//! The process between guard and CMD: it outlives guard just long enough to kill CMD's tree.
//!
//! A SIGKILLed guard cannot act, and the kernel's parent-death signal reaches only a direct
//! child, not CMD's own children. So guard starts this small process (its own binary, the
//! hidden `supervise` subcommand), and this process starts CMD. It needs no privileges
//! (a PID namespace would need `CAP_SYS_ADMIN` or user namespaces, which container
//! runtimes usually deny; `cgroup.kill` needs a delegated cgroup).
//!
//! ## Behaviour
//! - It is a child subreaper: a process of CMD's tree whose parent dies is re-parented
//!   here (not to PID 1), so it is still found below this process, and it is reaped.
//! - guard's death (parent-death signal SIGTERM, and this process' parent is no longer
//!   guard) → SIGKILL to every process below it, reap them, exit.
//! - CMD exits → SIGKILL to whatever CMD left behind (its whole tree, also processes that
//!   left its process group), reap, exit with CMD's code (128+S if signal S killed it).
//! - **It fences CMD on its own.** guard hands it the points at which CMD must get SIGTERM
//!   and SIGKILL ([`Fence`], on [`FENCE_FD`]: the first before CMD starts, a new one after
//!   every renewal or decision). It signals CMD's process group at those points on
//!   `CLOCK_BOOTTIME` (the lease's clock, counting host suspends), and at the SIGKILL point
//!   kills CMD's whole tree, whatever guard is doing: a guard blocked on a full stderr pipe,
//!   a hung file read or SIGSTOP cannot keep CMD running past the step-down point. Each
//!   signal is sent once; nothing on this path logs, reads a file or waits on guard.
//! - It reports CMD's pid, or why CMD could not start, to guard on [`REPORT_FD`].
//! - It has a process group of its own, neither guard's nor CMD's: guard signals CMD's
//!   group (forwarded signals, SIGTERM/SIGKILL when stopping CMD) without touching this
//!   process, and a SIGKILL to guard's whole group (a terminal, a process manager) leaves
//!   it alive to clean up. Signals sent to it are ignored unless they mean guard has died.
//! - CMD itself gets SIGKILL if this process dies (parent-death signal).

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::process::CommandExt;
use std::time::Duration;

use super::tree;
use crate::clock::{self, BootTimer, Deadline};

/// The descriptor on which the supervisor reports to guard: `started PID` or `error ERRNO`.
pub const REPORT_FD: i32 = 3;
/// The descriptor on which guard sends the supervisor [`Fence`]s, one per line.
pub const FENCE_FD: i32 = 4;

/// Signals this process waits for instead of handling them asynchronously.
const WATCHED: [i32; 5] = [
    libc::SIGCHLD,
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGQUIT,
];

/// When CMD must get SIGTERM and SIGKILL, as `CLOCK_BOOTTIME` readings ([`clock::boottime`]),
/// the same in guard and here. On the wire: `TERM_NS KILL_NS\n`, short enough for one
/// atomic pipe write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fence {
    pub term_at: Duration,
    pub kill_at: Duration,
}

impl Fence {
    /// The fence for SIGTERM at `term_at` and SIGKILL at `kill_at`.
    pub fn at(term_at: Deadline, kill_at: Deadline) -> Fence {
        Fence {
            term_at: term_at.boottime(),
            kill_at: kill_at.boottime(),
        }
    }

    /// The line guard writes.
    pub fn encode(&self) -> String {
        format!("{} {}\n", self.term_at.as_nanos(), self.kill_at.as_nanos())
    }

    /// The last complete fence in `text` (lines as [`Fence::encode`] writes them); anything
    /// else is ignored.
    pub fn last_in(text: &str) -> Option<Fence> {
        text.lines().rev().find_map(|line| {
            let mut words = line.split(' ');
            let mut nanos = || -> Option<Duration> {
                let ns: u64 = words.next()?.parse().ok()?;
                Some(Duration::from_nanos(ns))
            };
            let fence = Fence {
                term_at: nanos()?,
                kill_at: nanos()?,
            };
            words.next().is_none().then_some(fence)
        })
    }
}

/// What the supervisor has done to CMD of its own accord.
#[derive(Default)]
struct Fenced {
    terminated: bool,
    killed: bool,
}

/// Runs `command` for guard (pid `parent`) and returns the code to exit with.
pub fn supervise(parent: i32, command: &[String]) -> i32 {
    // SAFETY: fcntl on a descriptor number; an invalid one just fails. CMD must not inherit it.
    let report_open = unsafe { libc::fcntl(REPORT_FD, libc::F_SETFD, libc::FD_CLOEXEC) } == 0;
    // SAFETY: the descriptor is open (checked above) and owned by nobody else in this process.
    let mut report = report_open.then(|| unsafe { std::fs::File::from_raw_fd(REPORT_FD) });
    let mut fences = FenceReader::open();
    let watched = block(&WATCHED);
    if let Err(err) = tree::become_subreaper() {
        eprintln!("redlock-sidecar: cannot become a child subreaper: {err}");
    }
    if parent_gone(parent) {
        return 1;
    }
    // guard writes the first fence before starting this process: no CMD without one.
    let Some(mut fence) = fences.as_mut().and_then(FenceReader::read) else {
        send(&mut report, &format!("error {}", libc::EINVAL));
        return 1;
    };
    let child = match spawn(command) {
        Ok(child) => child,
        Err(err) => {
            send(
                &mut report,
                &format!("error {}", err.raw_os_error().unwrap_or(0)),
            );
            return if err.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
        }
    };
    let cmd = child.id() as i32;
    // std's Child is not waited through: this process reaps everything itself.
    drop(child);
    send(&mut report, &format!("started {cmd}"));
    drop(report);
    let signals = SignalFd::new(&watched);
    let timer = BootTimer::new();
    let mut fenced = Fenced::default();
    loop {
        if let Some(newer) = fences.as_mut().and_then(FenceReader::read) {
            fence = newer;
        }
        let (due, next) = fence_due(&fence, &mut fenced, clock::boottime());
        for signal in due {
            signal_cmd(cmd, signal);
        }
        if let Some(timer) = &timer {
            // One-shot: once read, it is readable again only if armed again.
            timer.clear();
            if let Some(at) = next {
                let _ = timer.arm(at);
            }
        }
        let fence_fd = fences.as_ref().map(FenceReader::fd);
        let timeout = match (&timer, next) {
            (None, Some(at)) => Some(at.saturating_sub(clock::boottime())),
            _ => None,
        };
        wait_readable(
            &[
                signals.as_ref().map(SignalFd::fd),
                fence_fd,
                timer.as_ref().map(BootTimer::as_raw_fd),
            ],
            timeout,
        );
        if fences.as_ref().is_some_and(FenceReader::closed) {
            // guard closed its end (it exited or died): the last fence stands.
            fences = None;
        }
        let pending = match &signals {
            Some(signals) => signals.take(),
            None => next_signal_now(&watched),
        };
        for signal in pending {
            if signal == libc::SIGCHLD {
                if let Some(code) = reap_until(cmd) {
                    tree::kill_and_reap_all();
                    return code;
                }
            } else if parent_gone(parent) {
                tree::kill_and_reap_all();
                return 128 + libc::SIGKILL;
            }
        }
    }
}

/// The signals `fence` calls for at `now` that were not sent yet (marked sent), and the next
/// point to wake at, if any is left. A pure decision; [`supervise`] carries it out.
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

/// Sends `signal` to CMD's process group; SIGKILL also goes to every process below this one,
/// those that left the group included.
fn signal_cmd(cmd: i32, signal: i32) {
    // SAFETY: kill(2) on CMD's process group; CMD is not reaped yet, so the group is ours.
    unsafe { libc::kill(-cmd, signal) };
    if signal == libc::SIGKILL {
        // SAFETY: getpid has no preconditions.
        tree::kill_descendants(unsafe { libc::getpid() });
    }
}

/// The read end of guard's fence pipe, non-blocking.
struct FenceReader {
    file: std::fs::File,
    /// A line not complete yet.
    partial: String,
    eof: bool,
}

impl FenceReader {
    fn open() -> Option<FenceReader> {
        // SAFETY: fcntl on a descriptor number; an invalid one just fails.
        let flags = unsafe { libc::fcntl(FENCE_FD, libc::F_GETFL) };
        if flags < 0 {
            return None;
        }
        // SAFETY: as above; CMD must not inherit it, and reads must never block.
        unsafe {
            libc::fcntl(FENCE_FD, libc::F_SETFD, libc::FD_CLOEXEC);
            libc::fcntl(FENCE_FD, libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
        Some(FenceReader {
            // SAFETY: the descriptor is open (checked above) and owned by nobody else here.
            file: unsafe { std::fs::File::from_raw_fd(FENCE_FD) },
            partial: String::new(),
            eof: false,
        })
    }

    /// The newest complete fence written since the last call, without waiting.
    fn read(&mut self) -> Option<Fence> {
        let mut buf = [0u8; 4096];
        loop {
            match self.file.read(&mut buf) {
                Ok(0) => {
                    self.eof = true;
                    break;
                }
                Ok(n) => self.partial.push_str(&String::from_utf8_lossy(&buf[..n])),
                Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        let complete = self.partial.rfind('\n')? + 1;
        let fence = Fence::last_in(&self.partial[..complete]);
        self.partial.drain(..complete);
        fence
    }

    fn closed(&self) -> bool {
        self.eof
    }

    fn fd(&self) -> i32 {
        self.file.as_raw_fd()
    }
}

/// The watched signals as a readable descriptor, so one `poll` waits for signals, fences and
/// the timer alike.
struct SignalFd(std::fs::File);

impl SignalFd {
    fn new(set: &libc::sigset_t) -> Option<SignalFd> {
        // SAFETY: signalfd reads `set` and returns a new descriptor owned by the File.
        let fd = unsafe { libc::signalfd(-1, set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) };
        // SAFETY: a new descriptor, owned by nobody else.
        (fd >= 0).then(|| SignalFd(unsafe { std::fs::File::from_raw_fd(fd) }))
    }

    /// The signals that arrived, without waiting.
    fn take(&self) -> Vec<i32> {
        let mut signals = Vec::new();
        let size = std::mem::size_of::<libc::signalfd_siginfo>();
        loop {
            // SAFETY: an all-zero siginfo is valid; read fills at most `size` bytes of it.
            let mut info = unsafe { std::mem::zeroed::<libc::signalfd_siginfo>() };
            let n = unsafe {
                libc::read(
                    self.0.as_raw_fd(),
                    (&mut info as *mut libc::signalfd_siginfo).cast(),
                    size,
                )
            };
            if n != size as isize {
                return signals;
            }
            signals.push(info.ssi_signo as i32);
        }
    }

    fn fd(&self) -> i32 {
        self.0.as_raw_fd()
    }
}

/// Waits until one of `fds` is readable (or hung up), or `timeout` passes.
fn wait_readable(fds: &[Option<i32>], timeout: Option<Duration>) {
    let mut polled: Vec<libc::pollfd> = fds
        .iter()
        .flatten()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let timeout_ms = timeout.map_or(-1, |t| {
        i32::try_from(t.as_millis().saturating_add(1)).unwrap_or(i32::MAX)
    });
    // SAFETY: poll reads and writes the local array of `polled.len()` entries. An
    // interruption just returns; the caller looks at everything again.
    unsafe {
        libc::poll(
            polled.as_mut_ptr(),
            polled.len() as libc::nfds_t,
            timeout_ms,
        )
    };
}

/// Starts CMD in its own process group; it dies with this process.
fn spawn(command: &[String]) -> std::io::Result<std::process::Child> {
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
                libc::_exit(128 + libc::SIGKILL);
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// Reaps every exited child; returns CMD's exit code once CMD is among them.
fn reap_until(cmd: i32) -> Option<i32> {
    let mut cmd_code = None;
    tree::reap_exited(|pid, code| {
        if pid == cmd {
            cmd_code = Some(code);
        }
    });
    cmd_code
}

fn parent_gone(parent: i32) -> bool {
    // SAFETY: getppid has no preconditions.
    unsafe { libc::getppid() != parent }
}

fn send(report: &mut Option<std::fs::File>, line: &str) {
    if let Some(file) = report {
        let _ = writeln!(file, "{line}");
    }
}

/// Blocks `signals` for this thread (they queue until [`next_signal`] takes them).
fn block(signals: &[i32]) -> libc::sigset_t {
    // SAFETY: sigset operations on a local set; pthread_sigmask changes this thread only.
    unsafe {
        let mut set = std::mem::zeroed::<libc::sigset_t>();
        libc::sigemptyset(&mut set);
        for &signal in signals {
            libc::sigaddset(&mut set, signal);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// The blocked signals in `set` that are pending, without waiting (when no signalfd could
/// be made; `poll` then wakes at least at every deadline).
fn next_signal_now(set: &libc::sigset_t) -> Vec<i32> {
    let mut signals = Vec::new();
    let zero = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    loop {
        // SAFETY: sigtimedwait reads `set` and `zero` and writes the local `info`.
        let signal = unsafe {
            let mut info = std::mem::zeroed::<libc::siginfo_t>();
            libc::sigtimedwait(set, &mut info, &zero)
        };
        if signal <= 0 {
            return signals;
        }
        signals.push(signal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_complete_fence_wins_and_garbage_is_ignored() {
        let a = Fence {
            term_at: Duration::from_secs(5),
            kill_at: Duration::from_secs(7),
        };
        let b = Fence {
            term_at: Duration::from_nanos(12_000_000_001),
            kill_at: Duration::from_nanos(14_000_000_001),
        };
        assert_eq!(Fence::last_in(&a.encode()), Some(a));
        assert_eq!(Fence::last_in(&(a.encode() + &b.encode())), Some(b));
        assert_eq!(Fence::last_in(&(a.encode() + "1 2 3\nx y\n")), Some(a));
        assert_eq!(Fence::last_in(""), None);
        assert_eq!(Fence::last_in("-1 5\n"), None);
    }

    #[test]
    fn each_signal_is_due_once_at_its_point() {
        let fence = Fence {
            term_at: Duration::from_secs(10),
            kill_at: Duration::from_secs(12),
        };
        let mut fenced = Fenced::default();
        let at = Duration::from_secs;
        let mut due = |now| fence_due(&fence, &mut fenced, now);
        assert_eq!(due(at(9)), (vec![], Some(at(10))));
        assert_eq!(due(at(10)), (vec![libc::SIGTERM], Some(at(12))));
        assert_eq!(due(at(11)), (vec![], Some(at(12))));
        assert_eq!(due(at(13)), (vec![libc::SIGKILL], None));
        assert_eq!(due(at(14)), (vec![], None));
        // A fence that arrives late is carried out at once, both signals in order.
        let mut late = Fenced::default();
        assert_eq!(
            fence_due(&fence, &mut late, at(20)),
            (vec![libc::SIGTERM, libc::SIGKILL], None)
        );
    }
}

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
//! - It reports CMD's pid, or why CMD could not start, to guard on [`REPORT_FD`].
//! - It has a process group of its own, neither guard's nor CMD's: guard signals CMD's
//!   group (forwarded signals, SIGTERM/SIGKILL when stopping CMD) without touching this
//!   process, and a SIGKILL to guard's whole group (a terminal, a process manager) leaves
//!   it alive to clean up. Signals sent to it are ignored unless they mean guard has died.
//! - CMD itself gets SIGKILL if this process dies (parent-death signal).

use std::io::Write;
use std::os::fd::FromRawFd;
use std::os::unix::process::CommandExt;

use super::tree;

/// The descriptor on which the supervisor reports to guard: `started PID` or `error ERRNO`.
pub const REPORT_FD: i32 = 3;

/// Signals this process waits for instead of handling them asynchronously.
const WATCHED: [i32; 5] = [
    libc::SIGCHLD,
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGQUIT,
];

/// Runs `command` for guard (pid `parent`) and returns the code to exit with.
pub fn supervise(parent: i32, command: &[String]) -> i32 {
    // SAFETY: fcntl on a descriptor number; an invalid one just fails. CMD must not inherit it.
    let report_open = unsafe { libc::fcntl(REPORT_FD, libc::F_SETFD, libc::FD_CLOEXEC) } == 0;
    // SAFETY: the descriptor is open (checked above) and owned by nobody else in this process.
    let mut report = report_open.then(|| unsafe { std::fs::File::from_raw_fd(REPORT_FD) });
    let watched = block(&WATCHED);
    if let Err(err) = tree::become_subreaper() {
        eprintln!("redlock-sidecar: cannot become a child subreaper: {err}");
    }
    if parent_gone(parent) {
        return 1;
    }
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
    loop {
        let signal = next_signal(&watched);
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

/// Waits for one of the blocked signals in `set`.
fn next_signal(set: &libc::sigset_t) -> i32 {
    loop {
        // SAFETY: sigwaitinfo reads `set` and writes the local `info`.
        let signal = unsafe {
            let mut info = std::mem::zeroed::<libc::siginfo_t>();
            libc::sigwaitinfo(set, &mut info)
        };
        if signal > 0 {
            return signal;
        }
    }
}

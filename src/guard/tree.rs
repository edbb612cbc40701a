//! A process and everything below it, read from procfs.
//!
//! A process group is not enough to find what CMD started: a child can call `setsid` or
//! `setpgid` and leave it. The parent links cannot be left, and a child subreaper
//! (`PR_SET_CHILD_SUBREAPER`) keeps orphans below itself, so "every process whose chain
//! of parents reaches us" is CMD's whole tree.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Makes this process the reaper of orphans below it: a process whose parent dies is
/// re-parented here instead of to PID 1, so it stays in the tree and gets reaped.
pub fn become_subreaper() -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Live (not zombie) processes below `root`, read from `/proc` at one moment.
pub fn descendants(root: i32) -> Vec<i32> {
    below(root).into_keys().collect()
}

/// Live processes below `root` with their parents, read from `/proc` at one moment.
fn below(root: i32) -> HashMap<i32, i32> {
    let mut parent_of = HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return parent_of;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if let Some((state, ppid)) = stat(pid) {
            if state != 'Z' && state != 'X' {
                parent_of.insert(pid, ppid);
            }
        }
    }
    let is_below = |mut pid: i32| {
        // Bounded walk: a pid table changing under us must not loop forever.
        for _ in 0..parent_of.len() {
            match parent_of.get(&pid) {
                Some(&ppid) if ppid == root => return true,
                Some(&ppid) if ppid > 1 => pid = ppid,
                _ => return false,
            }
        }
        false
    };
    parent_of
        .iter()
        .filter(|&(&pid, _)| is_below(pid))
        .map(|(&pid, &ppid)| (pid, ppid))
        .collect()
}

/// SIGKILLs every live process below `root`; returns how many there were.
///
/// The caller need not be the one that reaps them (guard kills below its helpers, which
/// reap): a pid read from `/proc` could be reaped and reused before the signal. So each one
/// is opened as a pidfd, checked to be still below `root` (its parent is `root` or one of the
/// tree), and signalled through that pidfd, which names that one process whatever happens to
/// its pid. Without pidfds (Linux before 5.3), plain kill(2). Nothing here blocks: `/proc`
/// reads and signals only.
pub fn kill_descendants(root: i32) -> usize {
    let tree = below(root);
    for &pid in tree.keys() {
        kill_if_below(pid, root, &tree);
    }
    tree.len()
}

fn kill_if_below(pid: i32, root: i32, tree: &HashMap<i32, i32>) {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor (or -1).
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if raw < 0 {
        if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
            // SAFETY: kill(2), no memory involved.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        return; // ESRCH: gone already
    }
    // SAFETY: a new descriptor, owned by nobody else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
    let still_ours = stat(pid)
        .is_some_and(|(state, ppid)| state != 'Z' && (ppid == root || tree.contains_key(&ppid)));
    if still_ours {
        // SAFETY: pidfd_send_signal on a descriptor we own; no siginfo.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                pidfd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
    }
}

/// Kills everything below this process and reaps it, until no child is left.
///
/// Each reaped child may have re-parented its own children here (we are a subreaper),
/// so the tree is read again after every reap. Blocks; for the supervisor only.
pub fn kill_and_reap_all() {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    loop {
        kill_descendants(me);
        let mut status = 0;
        // SAFETY: waitpid writes only to `status`.
        let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
        if pid < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return; // ECHILD: nothing left below us
        }
    }
}

/// Reaps every child that has exited, without waiting, and calls `reaped(pid, code)` for
/// each, `code` being its exit code or 128+S when signal S ended it.
pub fn reap_exited(mut reaped: impl FnMut(i32, i32)) {
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes only to `status`.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return;
        }
        let code = if libc::WIFSIGNALED(status) {
            crate::exit::killed_by(libc::WTERMSIG(status))
        } else {
            libc::WEXITSTATUS(status)
        };
        reaped(pid, code);
    }
}

/// The exit code of `pid` (128+S if signal S ended it) while it is a zombie, from
/// `/proc/<pid>/stat` (field 52, the status `waitpid` would report; Linux 3.5 and later).
pub fn exit_code(pid: i32) -> Option<i32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name start at field 3 (the state).
    let fields: Vec<&str> = text[text.rfind(')')? + 1..].split_whitespace().collect();
    if fields.first()? != &"Z" {
        return None;
    }
    let status: i32 = fields.get(52 - 3)?.parse().ok()?;
    Some(if libc::WIFSIGNALED(status) {
        crate::exit::killed_by(libc::WTERMSIG(status))
    } else {
        libc::WEXITSTATUS(status)
    })
}

/// Scheduler state and parent pid of `pid`, from `/proc/<pid>/stat`.
pub fn stat(pid: i32) -> Option<(char, i32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may contain anything: fields follow the last ')'.
    let mut fields = text[text.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zombies_exit_code_is_read_until_it_is_reaped() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "exit 7"])
            .spawn()
            .expect("sh runs");
        let pid = child.id() as i32;
        let mut code = None;
        for _ in 0..1000 {
            code = exit_code(pid);
            if code.is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(code, Some(7));
        child.wait().expect("reaped");
        assert_eq!(exit_code(pid), None);
    }

    #[test]
    fn a_process_no_longer_below_the_root_is_not_killed() {
        // A process of ours, listed as if it were below another root: a reused pid.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep runs");
        let pid = child.id() as i32;
        let stale = HashMap::from([(pid, 1)]);
        kill_if_below(pid, 1, &stale);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(child.try_wait().expect("wait"), None, "still running");
        // SAFETY: getpid has no preconditions.
        let me = unsafe { libc::getpid() };
        kill_if_below(pid, me, &HashMap::from([(pid, me)]));
        assert!(child.wait().expect("reaped").code().is_none(), "killed");
    }

    #[test]
    fn a_grandchild_is_a_descendant_and_is_killed() {
        let mut outer = std::process::Command::new("sh")
            .args(["-c", "sh -c 'sleep 30 & wait' & wait"])
            .spawn()
            .expect("sh runs");
        let root = outer.id() as i32;
        let mut found = Vec::new();
        for _ in 0..1000 {
            found = descendants(root);
            if found.len() >= 2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(found.len(), 2, "inner sh and sleep: {found:?}");
        let (inner, sleep) = match stat(found[0]) {
            Some((_, ppid)) if ppid == root => (found[0], found[1]),
            _ => (found[1], found[0]),
        };
        assert_eq!(
            stat(sleep).map(|s| s.1),
            Some(inner),
            "the sleep is a grandchild"
        );
        assert_eq!(kill_descendants(root), 2);
        outer.wait().expect("outer sh reaped");
    }
}

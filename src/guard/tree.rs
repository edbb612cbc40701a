//! A process and everything below it, read from procfs.
//!
//! A process group is not enough to find what CMD started: a child can call `setsid` or
//! `setpgid` and leave it. The parent links cannot be left, and a child subreaper
//! (`PR_SET_CHILD_SUBREAPER`) keeps orphans below itself, so "every process whose chain
//! of parents reaches us" is CMD's whole tree.

use std::collections::HashMap;

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
    let mut parent_of = HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
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
    let below = |mut pid: i32| {
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
        .keys()
        .copied()
        .filter(|&pid| below(pid))
        .collect()
}

/// SIGKILLs every live process below `root`; returns how many there were.
pub fn kill_descendants(root: i32) -> usize {
    let pids = descendants(root);
    for &pid in &pids {
        // SAFETY: kill(2), no memory involved. A pid that exited since the scan is still
        // our descendant's zombie (not reaped yet), so it cannot have been reused.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    pids.len()
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
            128 + libc::WTERMSIG(status)
        } else {
            libc::WEXITSTATUS(status)
        };
        reaped(pid, code);
    }
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

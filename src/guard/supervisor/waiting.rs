//! What a helper waits on, in one `poll` and without blocking its kill path: its doorbell
//! (the fence moved, or guard is gone), its watched signals (a signalfd, or pending signals
//! read at once where none can be made), and the timer.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// Whether a doorbell is still open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Bell {
    Open,
    Closed,
}

/// The read end of guard's doorbell for this helper, non-blocking.
pub(super) struct Doorbell {
    fd: OwnedFd,
    closed: bool,
}

impl Doorbell {
    pub(super) fn new(fd: OwnedFd) -> Doorbell {
        let _ = set_nonblocking(fd.as_raw_fd());
        Doorbell { fd, closed: false }
    }

    /// Takes every ring without waiting; `Closed` once guard's end is closed.
    pub(super) fn drain(&mut self) -> Bell {
        let mut buf = [0u8; 256];
        while !self.closed {
            // SAFETY: read into a local buffer of its length; the descriptor is ours.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            match n {
                0 => self.closed = true,
                n if n > 0 => {}
                _ if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => {}
                _ => break,
            }
        }
        if self.closed {
            Bell::Closed
        } else {
            Bell::Open
        }
    }

    pub(super) fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }
}

/// Takes the descriptor `fd` this process inherited, if it is open; it is closed on exec
/// from now on (what is handed on below is handed on explicitly).
pub(super) fn inherit(fd: i32) -> Option<OwnedFd> {
    // SAFETY: fcntl on a descriptor number; an invalid one just fails.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
        return None;
    }
    // SAFETY: open (checked above), and owned by nobody else in this process.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub(super) fn is_fifo(fd: &OwnedFd) -> bool {
    // SAFETY: fstat writes the local stat buffer.
    let mut stat = unsafe { std::mem::zeroed::<libc::stat>() };
    (unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) } == 0)
        && (stat.st_mode & libc::S_IFMT) == libc::S_IFIFO
}

pub(super) fn set_nonblocking(fd: i32) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor this process holds.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The watched signals as a readable descriptor, so one `poll` waits for signals, the
/// doorbell and the timer alike.
pub(super) struct SignalFd(std::fs::File);

impl SignalFd {
    pub(super) fn new(set: &libc::sigset_t) -> Option<SignalFd> {
        // SAFETY: signalfd reads `set` and returns a new descriptor owned by the File.
        let fd = unsafe { libc::signalfd(-1, set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) };
        // SAFETY: a new descriptor, owned by nobody else.
        (fd >= 0).then(|| SignalFd(unsafe { std::fs::File::from_raw_fd(fd) }))
    }

    /// The signals that arrived, without waiting.
    pub(super) fn take(&self) -> Vec<i32> {
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

    pub(super) fn fd(&self) -> i32 {
        self.0.as_raw_fd()
    }
}

/// Waits until one of `fds` is readable (or hung up), or `timeout` passes.
pub(super) fn wait_readable(fds: &[Option<i32>], timeout: Option<Duration>) {
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

/// Blocks `signals` for this thread (they queue until [`SignalFd`] or [`next_signal_now`]
/// takes them).
pub(super) fn block(signals: &[i32]) -> libc::sigset_t {
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
pub(super) fn next_signal_now(set: &libc::sigset_t) -> Vec<i32> {
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

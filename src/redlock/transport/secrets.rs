//! Credentials kept in files (a mounted Secret, a certificate cert-manager renews), read again
//! for every new connection, so that a rotation needs no restart.
//!
//! ## Behaviour
//! - At start-up every file is read once: unreadable, oversized (a device like `/dev/zero`
//!   never ends) or empty files are configuration errors naming the flag (exit 2).
//! - Every new connection to a node reads the files again: a rotated password (Redis' or the
//!   Sentinels'), CA bundle or client certificate is used from the next connection on. Live
//!   connections keep theirs (Redis and TLS do not ask again). A file that cannot be read then
//!   fails that connection attempt with a message naming the flag and the path, never the
//!   contents; the next attempt reads it again.
//! - **A read never blocks its caller.** Each file is read on a thread of its own, and waited
//!   for at most [`READ_TIMEOUT`]: a path that blocks on open (a FIFO, a hung network or FUSE
//!   mount) fails the attempt (at start-up: exit 2 naming the flag) instead of stalling the
//!   thread that renews the lock. Reads of a path that is being read already wait for that
//!   read instead of starting another (three nodes reconnecting at once read the file once),
//!   so a path that hangs holds one thread, not one per attempt.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use super::error::ConfigError;
use crate::clock::{self, Deadline};

/// Largest PEM file read (a CA bundle of a few hundred certificates fits).
const MAX_PEM_BYTES: u64 = 4 << 20;
/// Largest password file read.
const MAX_PASSWORD_BYTES: u64 = 64 << 10;
/// How long reading the credential files may take, all of them together.
pub const READ_TIMEOUT: Duration = Duration::from_secs(2);

/// Who waits for the outcome of a read.
type Deliver = Box<dyn FnOnce(Result<Vec<u8>, ConfigError>) + Send>;

/// Paths whose read has started and not returned yet, with everyone waiting for it.
static READING: Mutex<Option<HashMap<PathBuf, Vec<Deliver>>>> = Mutex::new(None);

/// A TLS client certificate and its key, both PEM.
#[derive(Clone)]
pub struct ClientCert {
    /// The certificate chain.
    pub cert_pem: Vec<u8>,
    /// The private key; never printed.
    pub key_pem: Vec<u8>,
}

/// Where the file-based credentials live; each is optional.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SecretFiles {
    /// `--redis-password-file`.
    pub password: Option<PathBuf>,
    /// `--redis-ca-file`.
    pub ca: Option<PathBuf>,
    /// `--redis-client-cert` and `--redis-client-key`.
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// `--sentinel-password-file`.
    pub sentinel_password: Option<PathBuf>,
}

/// What the files held when they were last read.
#[derive(Clone, Default)]
pub struct Loaded {
    /// The password, without its trailing line break.
    pub password: Option<String>,
    /// The CA bundle.
    pub ca_pem: Option<Vec<u8>>,
    /// The client certificate and key.
    pub client_cert: Option<ClientCert>,
    /// The Sentinels' password, without its trailing line break.
    pub sentinel_password: Option<String>,
}

/// One file to read: the flag that names it, its path and the most bytes it may hold.
type FileRead = (&'static str, PathBuf, u64);

impl SecretFiles {
    /// Whether any credential of the Redis nodes comes from a file.
    pub fn any(&self) -> bool {
        self.password.is_some() || self.ca.is_some() || self.client_cert.is_some()
    }

    /// Reads every file that is set, waiting for them (at start-up, before any runtime).
    pub fn load(&self) -> Result<Loaded, ConfigError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let reads = self.reads();
        spawn_reads(&reads, move |result| {
            let _ = tx.send(result);
        })?;
        let deadline = Deadline::now() + READ_TIMEOUT;
        let mut contents = HashMap::new();
        for _ in &reads {
            let left = deadline.saturating_duration_since(Deadline::now());
            match rx.recv_timeout(left) {
                Ok(result) => {
                    let (flag, bytes) = result?;
                    contents.insert(flag, bytes);
                }
                Err(_) => return Err(self.timed_out(&reads, &contents)),
            }
        }
        self.assemble(contents)
    }

    /// Reads every file that is set, on threads of their own: never blocks the runtime.
    pub async fn reload(&self) -> Result<Loaded, ConfigError> {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let reads = self.reads();
        spawn_reads(&reads, move |result| {
            let _ = tx.send(result);
        })?;
        let mut contents = HashMap::new();
        let all = async {
            for _ in &reads {
                if let Some(result) = rx.recv().await {
                    let (flag, bytes) = result?;
                    contents.insert(flag, bytes);
                }
            }
            Ok::<_, ConfigError>(())
        };
        match clock::within(READ_TIMEOUT, all).await {
            Ok(done) => done?,
            Err(_) => return Err(self.timed_out(&reads, &contents)),
        }
        self.assemble(contents)
    }

    fn reads(&self) -> Vec<FileRead> {
        let mut reads = Vec::new();
        let mut add = |flag, path: &Option<PathBuf>, max| {
            if let Some(path) = path {
                reads.push((flag, path.clone(), max));
            }
        };
        add("--redis-ca-file", &self.ca, MAX_PEM_BYTES);
        let (cert, key) = self.client_cert.clone().unzip();
        add("--redis-client-cert", &cert, MAX_PEM_BYTES);
        add("--redis-client-key", &key, MAX_PEM_BYTES);
        add("--redis-password-file", &self.password, MAX_PASSWORD_BYTES);
        add(
            "--sentinel-password-file",
            &self.sentinel_password,
            MAX_PASSWORD_BYTES,
        );
        reads
    }

    /// The error for reads that did not return in time: names the first such file.
    fn timed_out(&self, reads: &[FileRead], done: &HashMap<&'static str, Vec<u8>>) -> ConfigError {
        let (flag, path, _) = reads
            .iter()
            .find(|(flag, _, _)| !done.contains_key(flag))
            .unwrap_or(&reads[0]);
        ConfigError::new(
            flag,
            format!(
                "reading {} did not finish within {} s (a FIFO, or a hung mount?)",
                path.display(),
                READ_TIMEOUT.as_secs()
            ),
        )
    }

    fn assemble(
        &self,
        mut contents: HashMap<&'static str, Vec<u8>>,
    ) -> Result<Loaded, ConfigError> {
        let mut password =
            |flag: &'static str, path: &Option<PathBuf>| match (path, contents.remove(flag)) {
                (Some(path), Some(bytes)) => password_in(flag, path, bytes).map(Some),
                _ => Ok(None),
            };
        let redis_password = password("--redis-password-file", &self.password)?;
        let sentinel_password = password("--sentinel-password-file", &self.sentinel_password)?;
        let mut pem =
            |flag: &'static str, path: Option<&PathBuf>| match (path, contents.remove(flag)) {
                (Some(path), Some(bytes)) => pem_in(flag, path, bytes).map(Some),
                _ => Ok(None),
            };
        let ca_pem = pem("--redis-ca-file", self.ca.as_ref())?;
        let (cert, key) = self.client_cert.as_ref().map(|(c, k)| (c, k)).unzip();
        let client_cert = match (
            pem("--redis-client-cert", cert)?,
            pem("--redis-client-key", key)?,
        ) {
            (Some(cert_pem), Some(key_pem)) => Some(ClientCert { cert_pem, key_pem }),
            _ => None,
        };
        Ok(Loaded {
            password: redis_password,
            ca_pem,
            client_cert,
            sentinel_password,
        })
    }
}

/// [`spawn_read`] for each of `reads`, each outcome handed to (a clone of) `deliver`.
fn spawn_reads(
    reads: &[FileRead],
    deliver: impl Fn(Result<(&'static str, Vec<u8>), ConfigError>) + Clone + Send + 'static,
) -> Result<(), ConfigError> {
    for read in reads {
        spawn_read(read, deliver.clone())?;
    }
    Ok(())
}

/// Reads `read` on a thread of its own and hands the outcome to `deliver`; joins the read
/// already under way if there is one.
fn spawn_read(
    (flag, path, max): &FileRead,
    deliver: impl FnOnce(Result<(&'static str, Vec<u8>), ConfigError>) + Send + 'static,
) -> Result<(), ConfigError> {
    let flag = *flag;
    let deliver: Deliver = Box::new(move |result| deliver(result.map(|bytes| (flag, bytes))));
    {
        let mut reading = READING.lock().unwrap_or_else(PoisonError::into_inner);
        let reading = reading.get_or_insert_with(HashMap::new);
        if let Some(waiting) = reading.get_mut(path) {
            waiting.push(deliver);
            return Ok(());
        }
        reading.insert(path.clone(), vec![deliver]);
    }
    let (path, max) = (path.clone(), *max);
    let read = path.clone();
    let spawned = std::thread::Builder::new()
        .name("redlock-secret".into())
        .spawn(move || {
            let result = read_bounded(flag, &read, max);
            for deliver in take_waiting(&read) {
                deliver(result.clone());
            }
        });
    spawned.map(drop).map_err(|e| {
        take_waiting(&path);
        ConfigError::new(flag, format!("cannot start a thread to read the file: {e}"))
    })
}

/// Ends the read of `path`: who waited for it.
fn take_waiting(path: &Path) -> Vec<Deliver> {
    READING
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_mut()
        .and_then(|reading| reading.remove(path))
        .unwrap_or_default()
}

/// The contents of `path`, refused beyond `max` bytes. Blocks: call it through [`spawn_read`].
fn read_bounded(flag: &'static str, path: &Path, max: u64) -> Result<Vec<u8>, ConfigError> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|file| file.take(max + 1).read_to_end(&mut bytes))
        .map_err(|e| ConfigError::new(flag, format!("cannot read {}: {e}", path.display())))?;
    if bytes.len() as u64 > max {
        return Err(ConfigError::new(
            flag,
            format!("{} is larger than {max} bytes", path.display()),
        ));
    }
    Ok(bytes)
}

/// The PEM in `bytes`, read from `path` (given by `flag`), refused when empty or only white
/// space: an empty CA bundle would otherwise pass for one that trusts nothing, or for no
/// bundle at all.
fn pem_in(flag: &'static str, path: &Path, bytes: Vec<u8>) -> Result<Vec<u8>, ConfigError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ConfigError::new(
            flag,
            format!("{} is empty", path.display()),
        ));
    }
    Ok(bytes)
}

/// The password in `bytes`, read from `path` (given by `flag`), without its trailing line
/// break; never echoed in an error.
fn password_in(flag: &'static str, path: &Path, bytes: Vec<u8>) -> Result<String, ConfigError> {
    let text = String::from_utf8(bytes)
        .map_err(|_| ConfigError::new(flag, format!("{} is not UTF-8 text", path.display())))?;
    let password = text.trim_end_matches(['\n', '\r']);
    if password.is_empty() {
        return Err(ConfigError::new(
            flag,
            format!("{} is empty", path.display()),
        ));
    }
    Ok(password.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "redlock-secrets-{name}-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn fifo(dir: &Path) -> PathBuf {
        let path = dir.join("fifo");
        let c = std::ffi::CString::new(path.display().to_string()).unwrap();
        // SAFETY: mkfifo reads the NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        path
    }

    #[tokio::test]
    async fn reads_of_one_file_at_once_all_get_its_contents() {
        let dir = temp_dir("shared");
        let path = dir.join("password");
        std::fs::write(&path, "pw\n").unwrap();
        let files = SecretFiles {
            password: Some(path),
            ..SecretFiles::default()
        };
        let (a, b, c) = tokio::join!(files.reload(), files.reload(), files.reload());
        for loaded in [a, b, c] {
            assert_eq!(loaded.unwrap().password.as_deref(), Some("pw"));
        }
        assert_eq!(files.load().unwrap().password.as_deref(), Some("pw"));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn a_file_that_blocks_fails_the_read_on_time_and_never_blocks_the_caller() {
        let dir = temp_dir("fifo");
        let files = SecretFiles {
            sentinel_password: Some(fifo(&dir)),
            ..SecretFiles::default()
        };
        let started = std::time::Instant::now();
        // Two at once, and one after: all wait for the same stuck read.
        let (a, b) = tokio::join!(files.reload(), files.reload());
        let c = files.reload().await;
        for result in [a, b, c] {
            let err = result
                .err()
                .expect("a FIFO nobody writes never gives a password");
            assert_eq!(err.flag, "--sentinel-password-file");
            assert!(err.reason.contains("did not finish within"), "{err}");
        }
        assert!(started.elapsed() < 3 * READ_TIMEOUT + Duration::from_secs(1));
        // The sync read at start-up is bounded the same way.
        let err = files.load().err().expect("times out");
        assert!(err.reason.contains("did not finish within"), "{err}");
        // Writing the FIFO ends the stuck read (and its thread).
        let path = files.sentinel_password.clone().unwrap();
        let writer = std::thread::spawn(move || std::fs::write(path, "new\n"));
        writer.join().unwrap().unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }
}

//! Credentials kept in files (a mounted Secret, a certificate cert-manager renews), read again
//! for every new connection, so that a rotation needs no restart.
//!
//! ## Behaviour
//! - At start-up every file is read once: unreadable, oversized (a device like `/dev/zero`
//!   never ends) or empty files are configuration errors naming the flag (exit 2).
//! - Every new connection to a node reads the files again: a rotated password, CA bundle or
//!   client certificate is used from the next connection on. Live connections keep theirs
//!   (Redis and TLS do not ask again). A file that cannot be read then fails that connection
//!   attempt with a message naming the flag and the path, never the contents; the next
//!   attempt reads it again.

use std::io::Read;
use std::path::{Path, PathBuf};

use super::error::ConfigError;
use super::node::ClientCert;

/// Largest PEM file read (a CA bundle of a few hundred certificates fits).
const MAX_PEM_BYTES: u64 = 4 << 20;
/// Largest password file read.
const MAX_PASSWORD_BYTES: u64 = 64 << 10;

/// Where the file-based credentials live; each is optional.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SecretFiles {
    /// `--redis-password-file`.
    pub password: Option<PathBuf>,
    /// `--redis-ca-file`.
    pub ca: Option<PathBuf>,
    /// `--redis-client-cert` and `--redis-client-key`.
    pub client_cert: Option<(PathBuf, PathBuf)>,
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
}

impl SecretFiles {
    /// Whether any credential comes from a file.
    pub fn any(&self) -> bool {
        self.password.is_some() || self.ca.is_some() || self.client_cert.is_some()
    }

    /// Reads every file that is set.
    pub fn load(&self) -> Result<Loaded, ConfigError> {
        let ca_pem = self
            .ca
            .as_deref()
            .map(|path| read_pem("--redis-ca-file", path))
            .transpose()?;
        let client_cert = match &self.client_cert {
            Some((cert, key)) => Some(ClientCert {
                cert_pem: read_pem("--redis-client-cert", cert)?,
                key_pem: read_pem("--redis-client-key", key)?,
            }),
            None => None,
        };
        let password = self
            .password
            .as_deref()
            .map(|path| read_password("--redis-password-file", path))
            .transpose()?;
        Ok(Loaded {
            password,
            ca_pem,
            client_cert,
        })
    }
}

/// The contents of `path`, refused beyond `max` bytes.
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

/// The PEM in `path` (given by `flag`), refused when empty or only white space: an empty CA
/// bundle would otherwise pass for one that trusts nothing, or for no bundle at all.
fn read_pem(flag: &'static str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    let bytes = read_bounded(flag, path, MAX_PEM_BYTES)?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ConfigError::new(
            flag,
            format!("{} is empty", path.display()),
        ));
    }
    Ok(bytes)
}

/// The password in `path` (given by `flag`), without its trailing line break; never echoed in
/// an error.
pub fn read_password(flag: &'static str, path: &Path) -> Result<String, ConfigError> {
    let bytes = read_bounded(flag, path, MAX_PASSWORD_BYTES)?;
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

//! `redlock-sidecar install DIR`: copy this very binary into DIR.
//!
//! The image is distroless (no shell, no `cp`), yet a CronJob's init container must put the
//! binary into a shared volume so the job's own container can run `redlock-sidecar guard`.

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The file name the binary is installed under.
pub const FILE_NAME: &str = "redlock-sidecar";

/// Copies the running executable to `dir/redlock-sidecar`, mode 0755, atomically (a reader
/// sees the old file or the complete new one, never half a binary). Returns the path written.
pub fn install(dir: &Path) -> io::Result<PathBuf> {
    let source = std::env::current_exe()?;
    let target = dir.join(FILE_NAME);
    let partial = dir.join(format!(".{FILE_NAME}.partial"));
    let copied = fs::copy(&source, &partial)
        .and_then(|_| fs::set_permissions(&partial, fs::Permissions::from_mode(0o755)))
        .and_then(|()| fs::rename(&partial, &target));
    if copied.is_err() {
        let _ = fs::remove_file(&partial);
    }
    copied.map(|()| target)
}

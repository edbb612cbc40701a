//! A real PostgreSQL server on a free loopback port, in a temp dir, stopped on drop; and `psql`
//! to talk to it. `scripts/ensure-postgres.sh` installs Debian's packages.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use super::{free_port, wait_until, TempDir};

/// A running PostgreSQL cluster (`initdb` + `pg_ctl start`), trust authentication on loopback.
pub struct Postgres {
    port: u16,
    data: PathBuf,
    bin: PathBuf,
    _dir: TempDir,
}

impl Postgres {
    pub fn start() -> Postgres {
        let bin = server_bin_dir();
        let dir = TempDir::new("postgres");
        // initdb and the server refuse to run as root: the directory goes to `postgres`.
        let root = unsafe { libc::geteuid() } == 0;
        if root {
            run(Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir.path()));
        }
        let data = dir.path().join("data");
        run(as_owner(root, &bin.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data));
        let port = free_port();
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            dir.path().display()
        );
        run(as_owner(root, &bin.join("pg_ctl"))
            .arg("-D")
            .arg(&data)
            .args(["-o", &options, "-l"])
            .arg(dir.path().join("log"))
            .args(["-w", "start"]));
        let pg = Postgres {
            port,
            data,
            bin,
            _dir: dir,
        };
        wait_until(
            Duration::from_secs(30),
            "PostgreSQL accepts connections",
            || pg.try_sql("SELECT 1").is_ok_and(|out| out == "1"),
        );
        pg
    }

    /// Runs `sql` with `psql` (unaligned, tuples only) and returns its output, trimmed; panics
    /// on an error.
    pub fn sql(&self, sql: &str) -> String {
        self.try_sql(sql)
            .unwrap_or_else(|err| panic!("psql failed on {sql:?}: {err}"))
    }

    /// [`Postgres::sql`], with the error as a value.
    pub fn try_sql(&self, sql: &str) -> Result<String, String> {
        let out = Command::new("psql")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
            ])
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql])
            .output()
            .map_err(|e| format!("cannot run psql: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let root = unsafe { libc::geteuid() } == 0;
        let _ = as_owner(root, &self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "stop"])
            .output();
    }
}

/// `program` run as the `postgres` user when we are root.
fn as_owner(root: bool, program: &std::path::Path) -> Command {
    if root {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--"]).arg(program);
        cmd
    } else {
        Command::new(program)
    }
}

fn run(cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Where `initdb` and `pg_ctl` live: Debian keeps them out of PATH, under
/// /usr/lib/postgresql/VERSION/bin (the newest version wins).
fn server_bin_dir() -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|dir| dir.flatten().map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    versions.retain(|bin| bin.join("initdb").exists());
    versions.sort_by_key(|bin| {
        bin.parent()
            .and_then(|v| v.file_name()?.to_str()?.parse::<u32>().ok())
            .unwrap_or(0)
    });
    versions.pop().unwrap_or_else(|| {
        panic!("PostgreSQL is not installed: run scripts/ensure-postgres.sh (Debian's postgresql)")
    })
}

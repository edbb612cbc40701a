//! The `redlock-sidecar` binary: parse, set up logging, dispatch, exit with the right code.

use redlock_sidecar::config::{self, Command, LogFormat};
use redlock_sidecar::redlock::{NoObserver, Redlock};
use redlock_sidecar::{entropy, exit, guard, install, logging, ops, sidecar};

fn main() {
    let cli = config::parse_or_exit();
    if !matches!(cli.command, Command::Install(_)) {
        if let Err(err) = entropy::check() {
            eprintln!("redlock-sidecar: {err}");
            std::process::exit(exit::OS_ERROR);
        }
    }
    // Validate everything before anything connects: bad config exits 2 with one line.
    let code = match cli.command {
        Command::Run(args) => {
            let cfg = args
                .config()
                .unwrap_or_else(|e| config::exit_invalid(&e.to_string()));
            let _flush = logging::init(cli.log_format);
            runtime(false).block_on(sidecar::run(cfg))
        }
        Command::Guard(args) => {
            let cfg = args
                .config()
                .unwrap_or_else(|e| config::exit_invalid(&e.to_string()));
            let _flush = logging::init(cli.log_format);
            // One thread: CMD's parent-death signal follows the thread that spawned it.
            runtime(true).block_on(guard::guard(cfg))
        }
        Command::Check(args) => {
            let cfg = args
                .config()
                .unwrap_or_else(|e| config::exit_invalid(&e.to_string()));
            report(cfg, |r| async move { ops::check(&r).await })
        }
        Command::Status(args) => {
            let cfg = args
                .config()
                .unwrap_or_else(|e| config::exit_invalid(&e.to_string()));
            report(cfg, |r| async move { ops::status(&r).await })
        }
        Command::Supervise(args) => guard::supervisor::supervise(args.parent, &args.command),
        Command::Install(args) => {
            if !args.dir.is_dir() {
                config::exit_invalid(&format!("DIR {}: not a directory", args.dir.display()));
            }
            match install::install(&args.dir) {
                Ok(path) => {
                    println!("installed {}", path.display());
                    exit::OK
                }
                Err(err) => {
                    eprintln!(
                        "redlock-sidecar: install into {}: {err}",
                        args.dir.display()
                    );
                    exit::IO_ERROR
                }
            }
        }
    };
    std::process::exit(code);
}

/// Runs an operator command that prints a table; exit 0 with a quorum, 69 without.
fn report<F, Fut>(cfg: redlock_sidecar::redlock::RedlockConfig, command: F) -> i32
where
    F: FnOnce(Redlock) -> Fut,
    Fut: std::future::Future<Output = (String, bool)>,
{
    let _flush = logging::init(LogFormat::Text);
    runtime(true).block_on(async move {
        let redlock = Redlock::new(cfg, std::sync::Arc::new(NoObserver))
            .unwrap_or_else(|e| config::exit_invalid(&e.to_string()));
        let (table, ok) = command(redlock).await;
        print!("{table}");
        if ok {
            exit::OK
        } else {
            exit::UNREACHABLE
        }
    })
}

fn runtime(single_thread: bool) -> tokio::runtime::Runtime {
    let mut builder = if single_thread {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(2);
        b
    };
    builder
        .enable_all()
        .build()
        .expect("the tokio runtime starts")
}

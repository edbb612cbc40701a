//! No input panics, through the real binary: arbitrary values for the flags of `run`,
//! `guard`, `check` and `status` either work or end with exit 2 and one line on stderr,
//! never a panic (exit 101). The library decides first whether a command line is valid
//! (the unit tests in `config` run thousands of cases in-process); the binary must agree.
//!
//! Nothing here can hang or reach a server: the only node is a closed port, and `run` and
//! `guard` are run only with command lines the library refuses.

// Tests and benchmarks use Tokio's and std's timers directly (clippy.toml keeps them
// out of the sidecar's code).
#![allow(clippy::disallowed_methods)]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use proptest::prelude::*;
use redlock_sidecar::config::{invalid_line, Cli, Command as Sub};

/// The one node: nothing listens on port 1.
const CLOSED: &str = "redis://127.0.0.1:1";

fn any_value() -> impl Strategy<Value = String> {
    let units = prop::sample::select(vec!["", "ns", "ms", "s", "m", "h", "d", "y", "x"]);
    prop_oneof![
        (any::<u64>(), units.clone()).prop_map(|(n, u)| format!("{n}{u}")),
        (0u64..3_000, units).prop_map(|(n, u)| format!("{n}{u}")),
        prop::sample::select(vec![
            "18446744073709551615s",
            "18446744073709551616s",
            "99999999999999999999h",
            "-1s",
            "",
            "0",
            "1.5s",
            "∞",
            "10s\n",
            "2h",
            "31d",
            "on",
            "leader",
            "skip",
            "127.0.0.1:0",
        ])
        .prop_map(str::to_owned),
        "-?[0-9]{1,25}",
        // No NUL: it cannot be passed in an argument vector.
        "[^\u{0}]{0,12}",
    ]
}

fn flags_of(command: &str) -> Vec<&'static str> {
    let lock = [
        "--lock",
        "--ttl",
        "--max-ttl",
        "--fence-retention",
        "--retry-delay",
        "--identity",
        "--node-timeout",
        "--connect-timeout",
        "--redis-password",
    ];
    let renew = ["--renew-interval", "--safety-margin"];
    match command {
        "run" => [
            &lock[..],
            &renew[..],
            &[
                "--ready-when",
                "--shutdown-timeout",
                "--leader-label",
                "--kubernetes",
            ][..],
        ]
        .concat(),
        "guard" => [
            &lock[..],
            &renew[..],
            &[
                "--wait",
                "--on-busy",
                "--min-hold",
                "--max-hold",
                "--kill-grace",
            ][..],
        ]
        .concat(),
        "check" => vec![
            "--ttl",
            "--node-timeout",
            "--connect-timeout",
            "--redis-password",
        ],
        _ => lock.to_vec(),
    }
}

fn any_command_line() -> impl Strategy<Value = Vec<String>> {
    prop::sample::select(vec!["run", "guard", "check", "status"]).prop_flat_map(|command| {
        let pair = (prop::sample::select(flags_of(command)), any_value());
        prop::collection::vec(pair, 1..4).prop_map(move |pairs| {
            let mut args = vec![command.to_owned(), "--redis".into(), CLOSED.into()];
            if command != "check" {
                args.extend(["--lock".into(), "l".into()]);
            }
            for (flag, value) in pairs {
                // `--flag=value`: a value starting with `-` stays this flag's value.
                args.push(format!("{flag}={value}"));
            }
            if command == "guard" {
                args.extend(["--".into(), "true".into()]);
            }
            args
        })
    })
}

/// What the library says of `args`: `Ok(())` if valid, else the line the binary must print
/// (`None` for a clap error, whose exact wording is clap's).
fn library_verdict(args: &[String]) -> Result<(), Option<String>> {
    let cli = Cli::try_parse_from(
        std::iter::once("redlock-sidecar".to_owned()).chain(args.iter().cloned()),
    )
    .map_err(|_| None)?;
    let checked = match &cli.command {
        Sub::Run(run) => run.config().map(drop),
        Sub::Guard(guard) => guard.config().map(drop),
        Sub::Check(check) => check.config().map(drop),
        Sub::Status(status) => status.config().map(drop),
        _ => unreachable!("only run, guard, check and status are generated"),
    };
    checked.map_err(|err| Some(invalid_line(&err.to_string())))
}

/// Runs the binary with `args` and a clean environment; (exit code, stderr). Fails if it
/// has not exited within 10 s.
fn run_binary(args: &[String]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_redlock-sidecar"))
        .args(args)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary starts");
    let end = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{args:?}: still running after 10 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    (status.code(), stderr)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_binary_exits_2_with_one_line_or_runs_and_never_panics(args in any_command_line()) {
        let verdict = library_verdict(&args);
        let command = args[0].as_str();
        // A valid `run` or `guard` would start serving or contending: the library's verdict
        // (checked without panic above) is all this test asks of it.
        if verdict.is_ok() && matches!(command, "run" | "guard") {
            return Ok(());
        }
        let (code, stderr) = run_binary(&args);
        prop_assert_ne!(code, Some(101), "{:?} panicked: {}", args, stderr);
        match verdict {
            Err(expected) => {
                prop_assert_eq!(code, Some(2), "{:?}: {}", args, stderr);
                prop_assert_eq!(stderr.lines().count(), 1, "{:?}: {}", args, stderr);
                prop_assert!(stderr.starts_with("redlock-sidecar: "), "{}", stderr);
                if let Some(expected) = expected {
                    prop_assert_eq!(stderr.trim_end(), expected);
                }
            }
            // `check` and `status` against a closed port: no quorum, exit 69.
            Ok(()) => prop_assert_eq!(code, Some(69), "{:?}: {}", args, stderr),
        }
    }
}

#[test]
fn the_environment_cannot_change_the_library_verdict() {
    // The binary runs with a clean environment; the library reads this process' one.
    let set: Vec<String> = std::env::vars()
        .map(|(k, _)| k)
        .filter(|k| k.starts_with("REDLOCK_"))
        .collect();
    assert!(set.is_empty(), "unset these to run the CLI tests: {set:?}");
}

#[test]
fn the_reported_inputs_exit_2_naming_the_flag_and_its_bound() {
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "check",
                "--redis",
                CLOSED,
                "--node-timeout",
                "18446744073709551615s",
            ],
            "--node-timeout",
        ),
        (
            &[
                "status",
                "--lock",
                "l",
                "--redis",
                CLOSED,
                "--max-ttl",
                "18446744073709551615s",
            ],
            "--max-ttl",
        ),
        (
            &[
                "status",
                "--lock",
                "l",
                "--redis",
                CLOSED,
                "--retry-delay",
                "18446744073709551615s",
            ],
            "--retry-delay",
        ),
        (
            &[
                "guard",
                "--lock",
                "l",
                "--redis",
                CLOSED,
                "--wait",
                "18446744073709551615s",
                "--",
                "true",
            ],
            "--wait",
        ),
        (
            &[
                "guard",
                "--lock",
                "l",
                "--redis",
                CLOSED,
                "--max-hold",
                "18446744073709551615s",
                "--",
                "true",
            ],
            "--max-hold",
        ),
        (
            &[
                "guard",
                "--lock",
                "l",
                "--redis",
                CLOSED,
                "--min-hold",
                "18446744073709551615s",
                "--",
                "true",
            ],
            "--min-hold",
        ),
        (
            &["run", "--lock", "l", "--redis", CLOSED, "--ttl", "2h"],
            "--ttl",
        ),
        (
            &[
                "check",
                "--redis",
                CLOSED,
                "--connect-timeout",
                "18446744073709551615s",
            ],
            "--connect-timeout",
        ),
    ];
    for (args, flag) in cases {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let (code, stderr) = run_binary(&args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(
            stderr.contains(flag) && stderr.contains("must be at most"),
            "{stderr}"
        );
    }
}

/// Exit 2 with one line on stderr naming `flag` and containing `why`.
fn assert_refused(args: &[&str], flag: &str, why: &str) {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let (code, stderr) = run_binary(&args);
    assert_eq!(code, Some(2), "{args:?}: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
    assert!(
        stderr.contains(flag) && stderr.contains(why),
        "{args:?}: {stderr}"
    );
}

#[test]
fn a_renew_interval_below_10ms_exits_2_in_run_and_guard() {
    let lock = ["--lock", "l", "--redis", CLOSED, "--renew-interval", "1ns"];
    assert_refused(&[&["run"], &lock[..]].concat(), "--renew-interval", "10ms");
    assert_refused(
        &[&["guard"], &lock[..], &["--", "true"]].concat(),
        "--renew-interval",
        "10ms",
    );
}

#[test]
fn a_lock_name_starting_with_a_closing_brace_exits_2() {
    for command in ["run", "status"] {
        assert_refused(
            &[command, "--lock", "}x", "--redis", CLOSED],
            "--lock",
            "hash tag",
        );
    }
}

#[test]
fn an_empty_ca_file_exits_2() {
    let dir = std::env::temp_dir().join(format!("redlock-cli-ca-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = dir.join("ca.pem");
    for empty in ["", "\n  \n"] {
        std::fs::write(&ca, empty).unwrap();
        let ca = ca.to_str().unwrap();
        let args = ["--redis", "rediss://127.0.0.1:1", "--redis-ca-file", ca];
        assert_refused(
            &[&["check"], &args[..]].concat(),
            "--redis-ca-file",
            "empty",
        );
        assert_refused(
            &[&["run", "--lock", "l"], &args[..]].concat(),
            "--redis-ca-file",
            "empty",
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

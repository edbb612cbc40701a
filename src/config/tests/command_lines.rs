//! Arbitrary command lines and values: every one parses and validates, or is refused in one
//! line naming the flag; a valid one never computes a deadline out of range.

use super::*;

/// Values a user (or a fuzzer) may put after any flag.
fn any_value() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let units = prop::sample::select(vec![
        "", "ns", "us", "ms", "s", "sec", "m", "min", "h", "d", "days", "w", "M", "y", "x",
    ]);
    prop_oneof![
        // Durations of every size and unit, in and far out of bounds.
        (any::<u64>(), units.clone()).prop_map(|(n, u)| format!("{n}{u}")),
        (0u64..5_000, units.clone()).prop_map(|(n, u)| format!("{n}{u}")),
        (0u64..100, units.clone(), 0u64..1000, units)
            .prop_map(|(a, u, b, v)| format!("{a}{u} {b}{v}")),
        prop::sample::select(vec![
            "18446744073709551615s",
            "18446744073709551616s",
            "18446744073709551615ns",
            "99999999999999999999999999h",
            "9223372036854775807s",
            "-1s",
            "-0",
            "0",
            "",
            " ",
            "1e9s",
            "0x10s",
            "1.5s",
            "NaN",
            "inf",
            "∞s",
            "１０s",
            "10s\n",
            "\u{0}",
            "redis://127.0.0.1:1",
            "redis://:pw@127.0.0.1:2",
            "rediss://h:6380/0",
            "a/b",
            "auto",
            "on",
            "off",
            "quorum",
            "leader",
            "skip",
            "fail",
            "json",
            "text",
            "127.0.0.1:0",
            "[::1]:65535",
            "0.0.0.0:65536",
            "--",
            "-",
            "--ttl",
        ])
        .prop_map(str::to_owned),
        "-?[0-9]{1,30}",
        "[a-z0-9:/@.,_ -]{0,40}",
        "rediss?(\\+sentinel)?://[a-z0-9:/@.,\\[\\]_-]{0,40}",
        any::<String>(),
    ]
}

const LOCK_FLAGS: &[&str] = &[
    "--lock",
    "--ttl",
    "--max-ttl",
    "--fence-retention",
    "--retry-delay",
    "--identity",
    "--redis",
    "--redis-username",
    "--redis-password",
    "--redis-password-file",
    "--sentinel-username",
    "--sentinel-password",
    "--sentinel-password-file",
    "--redis-ca-file",
    "--redis-client-cert",
    "--redis-client-key",
    "--node-timeout",
    "--connect-timeout",
    "--allow-evicting-nodes",
    "--keyspace-events",
    "--log-format",
];
const RENEW_FLAGS: &[&str] = &["--renew-interval", "--safety-margin"];
const RUN_FLAGS: &[&str] = &[
    "--listen",
    "--ready-when",
    "--shutdown-timeout",
    "--kubernetes",
    "--leader-label",
    "--mirror-lease",
];
const GUARD_FLAGS: &[&str] = &[
    "--wait",
    "--on-busy",
    "--min-hold",
    "--max-hold",
    "--kill-grace",
    "--listen",
    "--outcome-file",
    "--kubernetes",
    "--slot",
    "--slot-retention",
];
const CHECK_FLAGS: &[&str] = &[
    "--redis",
    "--redis-username",
    "--redis-password",
    "--redis-password-file",
    "--sentinel-username",
    "--sentinel-password",
    "--sentinel-password-file",
    "--node-timeout",
    "--connect-timeout",
    "--allow-evicting-nodes",
    "--keyspace-events",
    "--ttl",
    "--log-format",
];

/// The flags of `command`.
fn flags_of(command: &str) -> Vec<&'static str> {
    match command {
        "run" => [LOCK_FLAGS, RENEW_FLAGS, RUN_FLAGS].concat(),
        "guard" => [LOCK_FLAGS, RENEW_FLAGS, GUARD_FLAGS].concat(),
        "check" => CHECK_FLAGS.to_vec(),
        _ => LOCK_FLAGS.to_vec(),
    }
}

/// A command line: one subcommand, maybe its required flags, then flags with arbitrary
/// values (as `--flag value`, `--flag=value`, or the flag alone), maybe a CMD.
fn any_command_line() -> impl proptest::strategy::Strategy<Value = Vec<String>> {
    use proptest::prelude::*;
    let command = prop::sample::select(vec!["run", "guard", "check", "status"]);
    command.prop_flat_map(|command| {
        let flags = flags_of(command);
        let pair = (prop::sample::select(flags), any_value(), 0u8..4);
        (
            any::<bool>(),
            prop::collection::vec(pair, 1..5),
            any::<bool>(),
        )
            .prop_map(move |(base, pairs, cmd)| {
                let mut args = vec![command.to_owned()];
                if base {
                    args.extend(["--redis", "redis://127.0.0.1:1"].map(String::from));
                    if command != "check" {
                        args.extend(["--lock", "l"].map(String::from));
                    }
                }
                for (flag, value, form) in pairs {
                    match form {
                        0 => args.push(format!("{flag}={value}")),
                        1 => args.push(flag.to_owned()),
                        _ => args.extend([flag.to_owned(), value]),
                    }
                }
                if command == "guard" && cmd {
                    args.extend(["--", "true"].map(String::from));
                }
                args
            })
    })
}

/// What `main` does before anything starts: parse, then validate the chosen command.
/// `Ok(true)` for a valid config; `Err(line)` with the line it prints before exit 2.
fn validate_like_main(args: &[String]) -> Result<bool, String> {
    let cli = Cli::try_parse_from(
        std::iter::once("redlock-sidecar".to_owned()).chain(args.iter().cloned()),
    );
    let cli = match cli {
        Ok(cli) => cli,
        Err(err) if !err.use_stderr() => return Ok(false), // --help, --version: exit 0
        Err(err) => return Err(invalid_line(&one_line(&err.to_string()))),
    };
    let checked = match &cli.command {
        Command::Run(run) => run
            .config()
            .map(|cfg| assert_deadlines_fit(&cfg.redlock, &[cfg.shutdown_timeout])),
        Command::Guard(guard) => guard.config().map(|cfg| {
            let holds = [
                cfg.wait,
                cfg.min_hold,
                cfg.max_hold.unwrap_or_default(),
                cfg.kill_grace,
            ];
            assert_deadlines_fit(&cfg.redlock, &holds)
        }),
        Command::Check(check) => check.config().map(|cfg| assert_deadlines_fit(&cfg, &[])),
        Command::Status(status) => status.config().map(|cfg| assert_deadlines_fit(&cfg, &[])),
        _ => unreachable!("only run, guard, check and status are generated"),
    };
    checked
        .map(|()| true)
        .map_err(|err| invalid_line(&err.to_string()))
}

/// Every duration of a valid config, summed as deadlines would sum them (several ttls,
/// timeouts, waits and holds at once), stays far from what an `Instant` can hold.
fn assert_deadlines_fit(cfg: &RedlockConfig, more: &[Duration]) {
    let parts = [
        cfg.longest_ttl() * 4,
        cfg.node_timeout * 4,
        cfg.connect_timeout * 4,
        cfg.retry_delay * 4,
        cfg.retry_max * 4,
        cfg.fence_retention,
    ];
    let total: Duration = parts.iter().chain(more).sum();
    let century = Duration::from_secs(100 * 365 * 24 * 3600);
    assert!(total < century / 10, "{total:?} from {cfg:?} and {more:?}");
    assert!(std::time::Instant::now().checked_add(century).is_some());
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config {
        cases: 2000,
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    })]

    /// No command line panics: it parses and validates, or it fails with one line.
    #[test]
    fn any_command_line_is_valid_or_refused_in_one_line(args in any_command_line()) {
        match validate_like_main(&args) {
            Ok(_) => {}
            Err(line) => {
                proptest::prop_assert_eq!(line.lines().count(), 1, "{:?}: {}", args, line);
                proptest::prop_assert!(line.len() > "redlock-sidecar: ".len(), "{:?}", args);
            }
        }
    }

    /// A value out of bounds, or not a duration, is refused naming the flag.
    #[test]
    fn a_bad_duration_names_its_flag(
        flag in prop::sample::select(vec![
            "--ttl", "--max-ttl", "--fence-retention", "--retry-delay", "--node-timeout",
            "--connect-timeout", "--renew-interval", "--safety-margin", "--wait",
            "--min-hold", "--max-hold", "--kill-grace",
        ]),
        value in any_value(),
    ) {
        let mut args: Vec<String> = ["guard", "--lock", "l", "--redis", "redis://127.0.0.1:1"]
            .map(String::from)
            .to_vec();
        // `--flag=value`: a value starting with `-` is still this flag's value.
        args.extend([format!("{flag}={value}"), "--".into(), "true".into()]);
        if parse_duration(&value).is_err() {
            let line = validate_like_main(&args).expect_err("refused");
            proptest::prop_assert!(line.contains(flag), "{}", line);
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config {
        cases: 200,
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    })]

    /// Any renew interval below the floor is refused by `run` and `guard` alike, naming
    /// the flag; any at or above it that fits the ttl is taken as given.
    #[test]
    fn the_renew_interval_floor_holds_for_any_value(nanos in 0u64..40_000_000) {
        let interval = format!("{nanos}ns");
        let ttl = ["--ttl", "1s", "--renew-interval", interval.as_str()];
        for verdict in [
            run_config(&ttl).map(|cfg| cfg.renewal.interval),
            guard_config(&ttl).map(|cfg| cfg.renewal.interval),
        ] {
            match verdict {
                Ok(got) => {
                    proptest::prop_assert!(got >= MIN_RENEW_INTERVAL);
                    proptest::prop_assert_eq!(got, Duration::from_nanos(nanos));
                }
                Err(err) => {
                    proptest::prop_assert!(Duration::from_nanos(nanos) < MIN_RENEW_INTERVAL);
                    proptest::prop_assert_eq!(err.flag, "--renew-interval");
                }
            }
        }
    }
}

use proptest::prelude::prop;

#[test]
fn zero_parses_as_a_duration() {
    assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
    assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
}

//! The configs' unit tests: one rule per test, each through the command line as `main`
//! parses it; [`command_lines`] throws arbitrary command lines at it.

use std::time::Duration;

use clap::Parser;

use super::cli::one_line;
use super::values::{is_label_key, parse_duration};
use super::*;
use crate::redlock::timing::MAX_TTL;
use crate::redlock::{ConfigError, Credentials, RedlockConfig};

fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
    Cli::try_parse_from(std::iter::once("redlock-sidecar").chain(args.iter().copied()))
}

fn run_config(extra: &[&str]) -> Result<RunConfig, ConfigError> {
    let mut args = vec![
        "run",
        "--lock",
        "l",
        "--redis",
        "redis://127.0.0.1:1",
        "--identity",
        "me",
    ];
    args.extend_from_slice(extra);
    match parse(&args).expect("parses").command {
        Command::Run(run) => run.config(),
        _ => unreachable!(),
    }
}

#[test]
fn sentinel_urls_survive_the_comma_split_of_the_node_list() {
    let Command::Check(check) = parse(&[
        "check",
        "--redis",
        "redis+sentinel://:pw@s1,s2:26380,s3/mymaster,redis://h:1,rediss+sentinel://t1,t2/other/2",
    ])
    .unwrap()
    .command
    else {
        unreachable!()
    };
    let nodes = check.redis.nodes().expect("valid");
    let labels: Vec<&str> = nodes.iter().map(|n| n.label()).collect();
    assert_eq!(
        labels,
        [
            "mymaster@s1:26379,s2:26380,s3:26379",
            "h:1",
            "other@t1:26379,t2:26379"
        ]
    );
    assert_eq!(nodes[2].identity().1, 2);
    assert!(!format!("{:?}", check.redis).contains("pw"));
    // The same group, its Sentinels listed in another order, is one node listed twice.
    let err = run_config(&[
        "--redis",
        "redis+sentinel://s2,s1/m,redis+sentinel://s1,s2/m",
    ])
    .unwrap_err();
    assert_eq!(err.flag, "--redis");
    assert!(err.reason.contains("listed twice"), "{err}");
    let err = run_config(&["--redis", "redis+sentinel://s1,s2"]).unwrap_err();
    assert!(
        err.reason.contains("node #2: the master's name is missing"),
        "{err}"
    );
}

#[test]
fn defaults_give_a_valid_timing_model() {
    let cfg = run_config(&[]).expect("valid");
    assert_eq!(cfg.renewal.interval, Duration::from_secs(10) / 3);
    assert_eq!(cfg.listen.port(), 9707);
}

fn guard_config(extra: &[&str]) -> Result<GuardConfig, ConfigError> {
    let mut args = vec!["guard", "--lock", "l", "--redis", "redis://127.0.0.1:1"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "true"]);
    match parse(&args).expect("parses").command {
        Command::Guard(guard) => guard.config(),
        _ => unreachable!(),
    }
}

#[test]
fn any_valid_ttl_alone_gives_valid_run_and_guard_configs() {
    let smallest = 217;
    let mut ttls: Vec<u64> = (smallest..5_000).step_by(7).collect();
    ttls.extend([10_000, 60_000, 3_600_000]);
    for ms in ttls {
        let ttl = format!("{ms}ms");
        let run = run_config(&["--ttl", &ttl]).unwrap_or_else(|e| panic!("run {ttl}: {e}"));
        let guard = guard_config(&["--ttl", &ttl]).unwrap_or_else(|e| panic!("guard {ttl}: {e}"));
        assert_eq!(run.renewal, guard.renewal);
    }
    let err = guard_config(&["--ttl", &format!("{}ms", smallest - 1)]).unwrap_err();
    assert_eq!(err.flag, "--ttl");
}

#[test]
fn derived_defaults_keep_the_documented_values_where_they_fit() {
    let cfg = guard_config(&[]).expect("valid");
    assert_eq!(cfg.renewal.safety_margin, Duration::from_secs(1));
    assert_eq!(cfg.kill_grace, Duration::from_secs(2));
    // ttl 2s: floor 72 ms, room 1311 ms → margin midway (691 ms); kill grace half the 619 ms left.
    let cfg = guard_config(&["--ttl", "2s"]).expect("valid");
    assert_eq!(cfg.renewal.safety_margin.as_millis(), 691);
    assert_eq!(cfg.kill_grace.as_millis(), 309);
    let err = guard_config(&["--ttl", "2s", "--kill-grace", "2s"]).unwrap_err();
    assert_eq!(err.flag, "--kill-grace");
}

#[test]
fn renew_interval_must_be_under_half_the_ttl() {
    let err = run_config(&["--renew-interval", "5s"]).unwrap_err();
    assert_eq!(err.flag, "--renew-interval");
}

#[test]
fn renew_interval_has_a_floor_in_run_and_guard() {
    for interval in ["1ns", "9ms", "0"] {
        let run = run_config(&["--renew-interval", interval]).unwrap_err();
        let guard = guard_config(&["--renew-interval", interval]).unwrap_err();
        for err in [run, guard] {
            assert_eq!(err.flag, "--renew-interval");
            assert!(err.reason.contains("below 10ms"), "{err}");
        }
    }
    let cfg = guard_config(&["--ttl", "1s", "--renew-interval", "10ms"]).expect("valid");
    assert_eq!(cfg.renewal.interval, MIN_RENEW_INTERVAL);
}

#[test]
fn a_lock_name_may_hold_braces_but_not_start_with_a_closing_one() {
    let status = |lock: &str| {
        let args = ["status", "--lock", lock, "--redis", "redis://127.0.0.1:1"];
        match parse(&args).expect("parses").command {
            Command::Status(status) => status.config(),
            _ => unreachable!(),
        }
    };
    let err = status("}x").unwrap_err();
    assert_eq!(err.flag, "--lock");
    assert!(err.reason.contains("hash tag"), "{err}");
    for lock in ["a}b", "a{b}", "{x}", "x{"] {
        status(lock).unwrap_or_else(|e| panic!("{lock}: {e}"));
    }
}

#[test]
fn safety_margin_must_exceed_node_timeout_and_drift() {
    let err = run_config(&["--safety-margin", "100ms"]).unwrap_err();
    assert_eq!(err.flag, "--safety-margin");
    assert!(err.reason.contains("node timeout + drift"), "{err}");
}

#[test]
fn duplicate_nodes_are_refused() {
    let err = run_config(&["--redis", "redis://127.0.0.1:1"]).unwrap_err();
    assert_eq!(err.flag, "--redis");
    assert!(err.reason.contains("listed twice"), "{err}");
}

#[test]
fn a_bad_url_error_never_shows_the_url() {
    let err = run_config(&["--redis", "http://user:hunter2@host"]).unwrap_err();
    assert!(!err.to_string().contains("hunter2"), "{err}");
    assert!(err.reason.contains("node #2"), "{err}");
}

#[test]
fn clap_errors_fold_into_one_line_naming_the_flag() {
    let err = parse(&[
        "run",
        "--lock",
        "l",
        "--redis",
        "redis://h",
        "--ttl",
        "soon",
    ])
    .unwrap_err();
    let line = one_line(&err.to_string());
    assert!(!line.contains('\n'));
    assert!(line.contains("--ttl"), "{line}");
}

#[test]
fn every_duration_flag_names_its_bound() {
    let cases: &[(&str, &str, &str)] = &[
        ("--ttl", "61m", "1h"),
        ("--max-ttl", "2h", "1h"),
        ("--node-timeout", "61s", "1m"),
        ("--connect-timeout", "18446744073709551615s", "1m"),
        ("--retry-delay", "2m", "1m"),
        ("--fence-retention", "366d", "1year"),
        ("--fence-retention", "1y 1s", "1year"),
        ("--renew-interval", "2h", "1h"),
        ("--safety-margin", "2h", "1h"),
        ("--shutdown-timeout", "2h", "1h"),
    ];
    for (flag, value, bound) in cases {
        let err =
            parse(&["run", "--lock", "l", "--redis", "redis://h", flag, value]).expect_err(flag);
        let line = one_line(&err.to_string());
        assert!(line.contains(flag), "{line}");
        assert!(line.contains(&format!("must be at most {bound}")), "{line}");
    }
    for flag in [
        "--wait",
        "--min-hold",
        "--max-hold",
        "--kill-grace",
        "--slot-retention",
    ] {
        let args = ["guard", "--lock", "l", "--redis", "redis://h", flag, "31d"];
        let err = parse(&[&args[..], &["--", "true"]].concat()).expect_err(flag);
        let line = one_line(&err.to_string());
        assert!(
            line.contains(flag) && line.contains("must be at most"),
            "{line}"
        );
    }
    // At the bound itself: accepted.
    let cfg = guard_config(&["--ttl", "1h", "--max-ttl", "1h", "--wait", "30d"]).unwrap();
    assert_eq!(cfg.redlock.ttl, MAX_TTL);
    assert_eq!(cfg.wait, MAX_GUARD_DURATION);
}

#[test]
fn a_slot_is_short_printable_text_kept_for_a_bounded_time() {
    let cfg = guard_config(&["--slot", "nightly-29412345"]).unwrap();
    let slot = cfg.slot.expect("a slot");
    assert_eq!(slot.id, "nightly-29412345");
    assert_eq!(slot.retention, Duration::from_secs(24 * 3600));
    assert_eq!(guard_config(&[]).unwrap().slot, None);
    let longest = "x".repeat(MAX_SLOT_LEN);
    assert!(guard_config(&["--slot", &longest]).is_ok());
    for bad in ["", "a b", "a\tb", "a\nb", &"x".repeat(MAX_SLOT_LEN + 1)] {
        let err = guard_config(&["--slot", bad]).unwrap_err();
        assert_eq!(err.flag, "--slot", "{bad:?}");
    }
    let err = guard_config(&["--slot", "s", "--slot-retention", "0"]).unwrap_err();
    assert_eq!(err.flag, "--slot-retention");
    let cfg = guard_config(&["--slot", "s", "--slot-retention", "30d"]).unwrap();
    assert_eq!(cfg.slot.unwrap().retention, MAX_GUARD_DURATION);
}

#[test]
fn a_slot_record_outlives_the_tenure_it_was_written_in() {
    // The default ttl is 10s: the record must outlive it, and --min-hold on top.
    for (retention, min_hold, ok) in [
        ("1ms", "0", false),
        ("9s", "0", false),
        ("10s", "0", true),
        ("39s", "30s", false),
        ("40s", "30s", true),
    ] {
        let args = ["--slot", "s", "--slot-retention", retention];
        let result = guard_config(&[&args[..], &["--min-hold", min_hold]].concat());
        match result {
            Ok(cfg) => assert!(ok, "{retention} with --min-hold {min_hold}: {cfg:?}"),
            Err(err) => {
                assert!(!ok, "{retention} with --min-hold {min_hold}: {err}");
                assert_eq!(err.flag, "--slot-retention");
                assert!(err.to_string().contains("at least"), "{err}");
            }
        }
    }
    // A short ttl still keeps the record a second.
    assert_eq!(
        min_slot_retention(Duration::from_millis(100), Duration::ZERO),
        MIN_SLOT_RETENTION
    );
}

#[test]
fn loopback_means_127_0_0_0_8_and_the_ipv6_loopback_mapped_or_not() {
    for good in [
        "127.0.0.1",
        "127.1.2.3",
        "::1",
        "::ffff:127.0.0.1",
        "::ffff:127.9.9.9",
    ] {
        assert!(is_loopback(good.parse().unwrap()), "{good}");
    }
    for bad in [
        "0.0.0.0",
        "10.0.0.1",
        "::",
        "::ffff:10.0.0.1",
        "::2",
        "fe80::1",
    ] {
        assert!(!is_loopback(bad.parse().unwrap()), "{bad}");
    }
    // A mapped address is bound as its IPv4 address.
    let cfg = run_config(&["--control-listen", "[::ffff:127.0.0.1]:9708"]).unwrap();
    assert_eq!(cfg.control_listen, "127.0.0.1:9708".parse().unwrap());
    let cfg = run_config(&["--control-listen", "[::1]:9708"]).unwrap();
    assert_eq!(cfg.control_listen, "[::1]:9708".parse().unwrap());
    let err = run_config(&["--control-listen", "[::ffff:10.0.0.1]:9708"]).unwrap_err();
    assert_eq!(err.flag, "--control-listen");
}

#[test]
fn dapr_grpc_is_off_unless_given_and_then_on_a_loopback_port_of_its_own() {
    let grpc = |args: &[&str]| {
        run_config(args).map(|cfg| cfg.locks.and_then(|locks| locks.dapr_grpc_listen))
    };
    assert_eq!(grpc(&[]).unwrap(), None);
    assert_eq!(grpc(&["--dapr-grpc-listen", ""]).unwrap(), None);
    assert_eq!(grpc(&["--dapr-grpc-listen", "off"]).unwrap(), None);
    assert_eq!(
        grpc(&["--dapr-grpc-listen", "off", "--locks", "off"]).unwrap(),
        None
    );
    for (given, bound) in [
        ("127.0.0.1:50001", "127.0.0.1:50001"),
        ("[::1]:50001", "[::1]:50001"),
        ("[::ffff:127.0.0.1]:50001", "127.0.0.1:50001"),
    ] {
        assert_eq!(
            grpc(&["--dapr-grpc-listen", given]).unwrap(),
            Some(bound.parse().unwrap())
        );
    }
    for bad in [
        &["--dapr-grpc-listen", "0.0.0.0:50001"][..],
        &["--dapr-grpc-listen", "10.0.0.1:50001"],
        &["--dapr-grpc-listen", "[::ffff:10.0.0.1]:50001"],
        &["--dapr-grpc-listen", "127.0.0.1:9708"],
        &["--dapr-grpc-listen", "127.0.0.1:50001", "--locks", "off"],
        &["--dapr-grpc-listen", "localhost:50001"],
        &["--dapr-grpc-listen", "50001"],
    ] {
        assert_eq!(grpc(bad).unwrap_err().flag, "--dapr-grpc-listen", "{bad:?}");
    }
}

#[test]
fn leader_label_must_be_a_kubernetes_label_key() {
    for good in ["redlock.io/leader", "leader", "a", "x.y-z/A_b.c-9", "L1"] {
        assert!(is_label_key(good), "{good}");
    }
    let long_name = "a".repeat(64);
    for bad in [
        "",
        "/x",
        "x/",
        "é",
        "a b",
        "-a",
        "a-",
        "Redlock.io/leader",
        "a..b/c",
        "a/b/c",
        long_name.as_str(),
    ] {
        assert!(!is_label_key(bad), "{bad:?}");
    }
    let err = run_config(&["--leader-label", "not a label"]).unwrap_err();
    assert_eq!(err.flag, "--leader-label");
}

#[test]
fn a_file_that_never_ends_is_refused_not_read_forever() {
    let err = run_config(&["--redis-password-file", "/dev/zero"]).unwrap_err();
    assert_eq!(err.flag, "--redis-password-file");
    assert!(err.reason.contains("larger than"), "{err}");
    let err = run_config(&["--redis-ca-file", "/dev/zero"]).unwrap_err();
    assert_eq!(err.flag, "--redis-ca-file");
}

#[test]
fn an_error_line_stays_one_line_whatever_the_value_holds() {
    let err = run_config(&["--redis-password-file", "/nonexistent/a\nb\r"]).unwrap_err();
    assert!(
        err.to_string().contains('\n'),
        "the raw message has the path's line break"
    );
    let line = invalid_line(&err.to_string());
    assert_eq!(line.lines().count(), 1, "{line}");
    assert!(
        line.starts_with("redlock-sidecar: --redis-password-file: "),
        "{line}"
    );
}

/// Each public config type, formatted with `{:?}`, from flags carrying passwords in a node
/// URL and as `--redis-password`, and from `--redis-password-file`: no password shows.
#[test]
fn debug_output_never_shows_a_password() {
    const IN_URL: &str = "UrlSecret-4711";
    const IN_FLAG: &str = "FlagSecret-4712";
    const IN_FILE: &str = "FileSecret-4713";
    let url = format!(
        "redis://user:{IN_URL}@127.0.0.1:1,redis://127.0.0.1:2,\
         redis+sentinel://user:{IN_URL}@127.0.0.1:3,127.0.0.1:4/m"
    );
    let file = std::env::temp_dir().join(format!("redlock-debug-test-{}", std::process::id()));
    std::fs::write(&file, format!("{IN_FILE}\n")).unwrap();
    let file = file.to_str().unwrap().to_owned();
    let mut printed = Vec::new();
    for secret_flags in [
        ["--redis-password", IN_FLAG],
        ["--redis-password-file", file.as_str()],
        ["--sentinel-password", IN_FLAG],
        ["--sentinel-password-file", file.as_str()],
    ] {
        let lock = ["--lock", "l", "--identity", "me", "--redis", url.as_str()];
        let args = |cmd: &'static str| {
            let mut args = vec![cmd];
            args.extend(lock);
            args.extend(secret_flags);
            args
        };
        let cli = parse(&args("run")).unwrap();
        printed.push(format!("{cli:?}"));
        let Command::Run(run) = cli.command else {
            unreachable!()
        };
        printed.push(format!("{run:?} {:?} {:?}", run.lock, run.lock.redis));
        let cfg = run.config().unwrap();
        printed.push(format!("{cfg:?} {:?} {:?}", cfg.redlock, cfg.redlock.nodes));

        let mut guard = args("guard");
        guard.extend(["--", "true"]);
        let Command::Guard(guard) = parse(&guard).unwrap().command else {
            unreachable!()
        };
        printed.push(format!("{guard:?} {:?}", guard.config().unwrap()));

        let Command::Status(status) = parse(&args("status")).unwrap().command else {
            unreachable!()
        };
        printed.push(format!("{status:?} {:?}", status.config().unwrap()));

        let check = ["check", "--redis", url.as_str()];
        let Command::Check(check) = parse(&[&check[..], &secret_flags[..]].concat())
            .unwrap()
            .command
        else {
            unreachable!()
        };
        printed.push(format!("{check:?} {:?}", check.config().unwrap()));
        let creds = Credentials {
            password: check.redis.redis_password.clone().or(Some(IN_FILE.into())),
            ..Credentials::default()
        };
        printed.push(format!("{creds:?} {:?}", check.redis));
    }
    std::fs::remove_file(&file).ok();
    for text in &printed {
        for secret in [IN_URL, IN_FLAG, IN_FILE] {
            assert!(!text.contains(secret), "{secret} shows in {text}");
        }
        assert!(text.contains("127.0.0.1:1"), "the nodes still show: {text}");
    }
    assert!(printed.iter().any(|t| t.contains("<redacted>")));
}

mod command_lines;

#[test]
fn the_shard_revoke_timeout_defaults_to_fit_the_shutdown_and_a_given_one_must_fit_it() {
    let shards = |extra: &[&str]| run_config(extra).map(|cfg| cfg.shards);
    let default = shards(&["--shards", "8"]).unwrap().unwrap();
    assert_eq!(default.count, 8);
    assert_eq!(default.revoke_timeout, DEFAULT_SHARD_REVOKE_TIMEOUT);
    // A short shutdown: half of it.
    let short = shards(&["--shards", "8", "--shutdown-timeout", "2s"])
        .unwrap()
        .unwrap();
    assert_eq!(short.revoke_timeout, Duration::from_secs(1));
    let err = shards(&["--shards", "8", "--shard-revoke-timeout", "10s"]).unwrap_err();
    assert_eq!(err.flag, "--shard-revoke-timeout");
    let err = shards(&["--shard-revoke-timeout", "1s"]).unwrap_err();
    assert_eq!(err.flag, "--shard-revoke-timeout");
    let zero = shards(&["--shards", "8", "--shard-revoke-timeout", "0s"])
        .unwrap()
        .unwrap();
    assert_eq!(zero.revoke_timeout, Duration::ZERO);
}

//! A node that is a Redis Cluster (cluster mode): one voter, the shard that owns the lock's
//! hash slot.
//!
//! Cluster mode is recognised from `INFO cluster` (`cluster_enabled:1`) on any `redis://` or
//! `rediss://` node: the URL names any node of the cluster (a configuration endpoint does).
//!
//! ## Behaviour
//! - Every key one script touches shares the lock's hash slot: the lock's keys are hash-tagged
//!   `redlock:{LOCK}...`, and in cluster mode the epoch marker is kept **per slot**,
//!   `redlock:epoch:{TAG}`, where `TAG` is a short string that hashes to that slot
//!   ([`slot_tag`]). A failover, a restart or a flush of the shard changes or deletes it like the
//!   marker of a plain master.
//! - On every new connection the sidecar stamps the markers of every slot each master serves
//!   (those missing or stamped by another lineage; one script per master that allows
//!   cross-slot keys on that master), so a lock name never used before finds its slot's marker
//!   already aging: only a shard met for the first time (or replaced) makes a lock wait ttl +
//!   drift. Best effort: a server that refuses (before Redis 7) leaves each slot's marker to be
//!   stamped by the first grant there.
//! - Connections go to the master that `CLUSTER SLOTS` names for the lock's slot. `MOVED` drops
//!   the connection and the call is retried once on the new owner within its timeout; `ASK`
//!   (the slot is being migrated) is followed for that one call with `ASKING`. While its slot
//!   migrates, a lock whose keys are split between the two masters gets `TRYAGAIN` (Redis runs
//!   no multi-key call across a migration): that vote fails, and the next round, after the
//!   migration, goes to the new owner.
//! - The masters `CLUSTER SLOTS` lists are remembered and dialled when the URL's node is down.

use std::sync::{Arc, LazyLock, Mutex};

use redis::aio::MultiplexedConnection;
use redis::{FromRedisValue, RedisError, Script, Value};
use tracing::debug;

use super::dial::{open_at, ConnectSettings, PushTag};
use super::error::{node_error, NodeError, NodeErrorKind};
use super::facts::NodeFacts;
use super::sentinel::addr_label;
use super::spec::NodeSpec;
use crate::clock;
use crate::redlock::scripts;

static STAMP_SLOTS: LazyLock<Script> = LazyLock::new(|| Script::new(scripts::STAMP_SLOTS));

/// The number of hash slots of a Redis Cluster.
pub const SLOTS: u16 = 16384;

/// CRC16-XMODEM, the checksum Redis Cluster hashes keys with.
pub fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for byte in bytes {
        crc ^= u16::from(*byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The hash slot of `key`: of its hash tag (the text between the first `{` and the next `}`,
/// if not empty), else of the whole key.
pub fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let hashed = bytes
        .iter()
        .position(|b| *b == b'{')
        .and_then(|open| {
            let close = bytes[open + 1..].iter().position(|b| *b == b'}')?;
            (close > 0).then(|| &bytes[open + 1..open + 1 + close])
        })
        .unwrap_or(bytes);
    crc16(hashed) % SLOTS
}

/// The shortest base-36 string (first in order) that hashes to `slot`: the hash tag of the
/// slot's epoch marker.
pub fn slot_tag(slot: u16) -> String {
    static TAGS: std::sync::LazyLock<Vec<String>> = std::sync::LazyLock::new(|| {
        let mut tags = vec![String::new(); usize::from(SLOTS)];
        let mut found = 0;
        let digits = b"0123456789abcdefghijklmnopqrstuvwxyz";
        'lengths: for len in 1..=4u32 {
            for n in 0..36u32.pow(len) {
                let mut tag = Vec::with_capacity(len as usize);
                let mut rest = n;
                for _ in 0..len {
                    tag.push(digits[(rest % 36) as usize]);
                    rest /= 36;
                }
                let slot = usize::from(crc16(&tag) % SLOTS);
                if tags[slot].is_empty() {
                    tags[slot] = String::from_utf8(tag).unwrap_or_default();
                    found += 1;
                    if found == usize::from(SLOTS) {
                        break 'lengths;
                    }
                }
            }
        }
        tags
    });
    TAGS[usize::from(slot % SLOTS)].clone()
}

/// The key of each node's epoch marker (see `votes`): the lineage `<run id>:<replication
/// id>:<db>`, stamped with an expiry its age is read from. In cluster mode each hash slot has
/// its own ([`epoch_key`]).
pub const EPOCH_KEY: &str = "redlock:epoch";

/// The epoch marker of `slot` in cluster mode.
pub fn epoch_key(slot: u16) -> String {
    format!("{EPOCH_KEY}:{{{}}}", slot_tag(slot))
}

/// The epoch marker a node's scripts use: [`EPOCH_KEY`], or in cluster mode the marker of
/// the lock's slot.
pub fn epoch_key_for(facts: Option<&NodeFacts>, slot: u16) -> String {
    match facts {
        Some(facts) if facts.cluster => epoch_key(slot),
        _ => EPOCH_KEY.to_owned(),
    }
}

/// `keys` as a script sends them to a node: in cluster mode (`slot_marker` is the lock slot's
/// epoch marker) [`EPOCH_KEY`] is replaced by it, so every key of the call shares one slot.
pub fn keys_on_node<'a>(keys: &[&'a str], slot_marker: Option<&'a str>) -> Vec<&'a str> {
    keys.iter()
        .map(|key| match slot_marker {
            Some(marker) if *key == EPOCH_KEY => marker,
            _ => key,
        })
        .collect()
}

/// One range of slots and the master that serves it, from `CLUSTER SLOTS`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotRange {
    /// First slot of the range.
    pub start: u16,
    /// Last slot of the range (inclusive).
    pub end: u16,
    /// The master's host, as the cluster announces it.
    pub host: String,
    /// The master's port.
    pub port: u16,
}

/// Parses a `CLUSTER SLOTS` reply: `[[start, end, [host, port, id, ...], replicas...], ...]`.
/// Entries that do not have that shape are skipped (an empty host means "the node you asked",
/// given as `fallback_host`).
pub fn parse_slots(reply: &Value, fallback_host: &str) -> Vec<SlotRange> {
    let Value::Array(ranges) = reply else {
        return Vec::new();
    };
    ranges
        .iter()
        .filter_map(|range| {
            let Value::Array(fields) = range else {
                return None;
            };
            let int = |v: &Value| match v {
                Value::Int(n) => u16::try_from(*n).ok(),
                _ => None,
            };
            let start = int(fields.first()?)?;
            let end = int(fields.get(1)?)?;
            let Value::Array(master) = fields.get(2)? else {
                return None;
            };
            let host = match master.first()? {
                Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok()?,
                Value::SimpleString(text) => text.clone(),
                _ => return None,
            };
            let host = if host.is_empty() || host == "?" {
                fallback_host.to_owned()
            } else {
                host
            };
            let port = int(master.get(1)?)?;
            (start <= end && end < SLOTS && port > 0).then_some(SlotRange {
                start,
                end,
                host,
                port,
            })
        })
        .collect()
}

/// The range serving `slot`, if any.
pub fn owner(ranges: &[SlotRange], slot: u16) -> Option<&SlotRange> {
    ranges.iter().find(|r| r.start <= slot && slot <= r.end)
}

/// The distinct masters of `ranges`, in order of first appearance.
pub fn masters(ranges: &[SlotRange]) -> Vec<(String, u16)> {
    let mut out: Vec<(String, u16)> = Vec::new();
    for r in ranges {
        if !out.iter().any(|(h, p)| *h == r.host && *p == r.port) {
            out.push((r.host.clone(), r.port));
        }
    }
    out
}

/// After connecting to a cluster-mode node: the connection to the master serving
/// `settings.slot` (this one, or a new one), its facts, the cluster's masters remembered in
/// `seeds`, and the markers of every master stamped in the background.
pub(super) async fn route(
    spec: &NodeSpec,
    mut conn: MultiplexedConnection,
    facts: NodeFacts,
    settings: ConnectSettings,
    seeds: &Arc<Mutex<Vec<(String, u16)>>>,
    push: &PushTag,
) -> Result<(MultiplexedConnection, NodeFacts), NodeError> {
    let reply: Value = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut conn)
        .await
        .map_err(|e| node_error(&e, spec.password_for_errors()))?;
    let here = facts
        .address
        .rsplit_once(':')
        .map_or(facts.address.as_str(), |(host, _)| host);
    let ranges = parse_slots(&reply, here.trim_start_matches('[').trim_end_matches(']'));
    if let Ok(mut seeds) = seeds.lock() {
        *seeds = masters(&ranges);
    }
    let Some(owner) = owner(&ranges, settings.slot).cloned() else {
        return Err(NodeError {
            kind: NodeErrorKind::Other,
            message: format!(
                "cluster mode: no master serves the lock's slot {} (CLUSTER SLOTS)",
                settings.slot
            ),
        });
    };
    let owner_address = addr_label(&spec.info_at(&owner.host, owner.port)?);
    if owner_address == facts.address && facts.role == "master" {
        tokio::spawn(stamp_every_master(spec.clone(), ranges, settings));
        return Ok((conn, facts));
    }
    let (conn, facts) = match open_at(spec, &owner.host, owner.port, settings, Some(push)).await {
        Ok((conn, facts)) if facts.cluster && facts.role == "master" => (conn, facts),
        Ok((_, facts)) => {
            return Err(NodeError {
                kind: NodeErrorKind::Other,
                message: format!(
                    "cluster mode: CLUSTER SLOTS names {} for slot {}, but it reports role:{}",
                    facts.address, settings.slot, facts.role
                ),
            })
        }
        Err(err) => return Err(err),
    };
    tokio::spawn(stamp_every_master(spec.clone(), ranges, settings));
    Ok((conn, facts))
}

/// How many slot markers one stamping script checks: a script blocks its server, and a few
/// hundred keys take about a millisecond.
const STAMP_BATCH: usize = 256;

/// Stamps the slot markers of every master in `ranges` (see the module docs), a batch at a
/// time; best effort.
async fn stamp_every_master(spec: NodeSpec, ranges: Vec<SlotRange>, settings: ConnectSettings) {
    if !settings.stamp_slots {
        return;
    }
    for (host, port) in masters(&ranges) {
        let keys: Vec<String> = ranges
            .iter()
            .filter(|r| r.host == host && r.port == port)
            .flat_map(|r| r.start..=r.end)
            .map(epoch_key)
            .collect();
        let db = spec.db().to_string();
        let stamp = async {
            let (mut conn, _) = open_at(&spec, &host, port, settings, None).await?;
            let mut stamped = 0;
            for batch in keys.chunks(STAMP_BATCH) {
                let mut invocation = STAMP_SLOTS.prepare_invoke();
                for key in batch {
                    invocation.arg(key);
                }
                invocation.arg(&db);
                stamped += invocation
                    .invoke_async::<i64>(&mut conn)
                    .await
                    .map_err(|e| node_error(&e, spec.password_for_errors()))?
                    .max(0);
            }
            Ok::<_, NodeError>(stamped)
        };
        let master = format!("{host}:{port}");
        match clock::within(settings.connect_timeout * 8, stamp).await {
            Ok(Ok(stamped)) => debug!(%master, stamped, "slot markers stamped"),
            Ok(Err(err)) => debug!(%master, error = %err, "slot markers not stamped"),
            Err(_) => debug!(%master, "slot markers not stamped in time"),
        }
    }
}

/// Follows an `ASK` redirection for one script call: `ASKING`, then the script, on a new
/// connection to the server `err` names.
pub(super) async fn ask<T: FromRedisValue>(
    spec: &NodeSpec,
    err: &RedisError,
    script: &Script,
    keys: &[&str],
    args: &[&str],
    db: i64,
) -> Result<T, NodeError> {
    let scrub = |e: RedisError| node_error(&e, spec.password_for_errors());
    let target = err.redirect_node().and_then(|(addr, _)| {
        let (host, port) = addr.rsplit_once(':')?;
        Some((host.to_owned(), port.parse::<u16>().ok()?))
    });
    let Some((host, port)) = target else {
        return Err(NodeError {
            kind: NodeErrorKind::Protocol,
            message: "an ASK redirection without an address".to_owned(),
        });
    };
    let settings = ConnectSettings {
        connect_timeout: std::time::Duration::from_secs(60),
        slot: 0,
        stamp_slots: false,
    };
    let (mut conn, _) = open_at(spec, &host, port, settings, None).await?;
    script.load_async(&mut conn).await.map_err(scrub)?;
    // This connection is ours alone: ASKING applies to the very next command on it.
    redis::cmd("ASKING")
        .query_async::<()>(&mut conn)
        .await
        .map_err(scrub)?;
    redis::cmd("EVALSHA")
        .arg(script.get_hash())
        .arg(keys.len())
        .arg(keys)
        .arg(args)
        .arg(db)
        .query_async(&mut conn)
        .await
        .map_err(scrub)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_of_a_lock_shares_one_slot_unless_its_name_starts_with_a_closing_brace() {
        let slots = |name: &str| {
            let key = format!("redlock:{{{name}}}");
            ["", ":fence", ":ttl", ":nodes", ":refreshed"]
                .map(|suffix| key_slot(&format!("{key}{suffix}")))
        };
        for name in ["x", "a}b", "a{b}", "{x}", "x{", "a}"] {
            let slots = slots(name);
            assert!(slots.iter().all(|s| *s == slots[0]), "{name}: {slots:?}");
        }
        let empty_tag = slots("}x");
        assert!(
            empty_tag.iter().any(|s| *s != empty_tag[0]),
            "{empty_tag:?}"
        );
    }

    #[test]
    fn slots_are_computed_as_redis_does() {
        // Figures from a real cluster's CLUSTER KEYSLOT.
        assert_eq!(key_slot("a"), 15495);
        assert_eq!(key_slot("b"), 3300);
        assert_eq!(key_slot("redlock:{x}"), 16287);
        assert_eq!(key_slot("redlock:{x}:fence"), 16287);
        assert_eq!(
            key_slot("{}x"),
            crc16(b"{}x") % SLOTS,
            "an empty tag hashes the whole key"
        );
        assert_eq!(key_slot("a{b}{c}"), key_slot("b"));
        assert_eq!(key_slot("a{b"), crc16(b"a{b") % SLOTS);
    }

    #[test]
    fn in_cluster_mode_only_the_epoch_marker_is_renamed_to_the_lock_slots() {
        let keys = ["redlock:{x}", EPOCH_KEY, "redlock:{x}:fence"];
        assert_eq!(keys_on_node(&keys, None), keys);
        let marker = epoch_key(key_slot("redlock:{x}"));
        let sent = keys_on_node(&keys, Some(&marker));
        assert_eq!(sent, ["redlock:{x}", marker.as_str(), "redlock:{x}:fence"]);
        assert!(sent
            .iter()
            .all(|key| key_slot(key) == key_slot("redlock:{x}")));
        let cluster = NodeFacts {
            cluster: true,
            ..NodeFacts::default()
        };
        assert_eq!(epoch_key_for(Some(&cluster), 7), epoch_key(7));
        assert_eq!(epoch_key_for(None, 7), EPOCH_KEY);
    }

    #[test]
    fn every_slot_has_a_tag_that_hashes_to_it() {
        for slot in 0..SLOTS {
            let tag = slot_tag(slot);
            assert!(!tag.is_empty() && tag.len() <= 4, "slot {slot}: {tag:?}");
            assert_eq!(key_slot(&epoch_key(slot)), slot);
        }
    }

    #[test]
    fn cluster_slots_replies_are_read_and_garbage_skipped() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                Value::Array(vec![bulk("10.0.0.1"), Value::Int(6379), bulk("id1")]),
                Value::Array(vec![bulk("10.0.0.4"), Value::Int(6379), bulk("id4")]),
            ]),
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(16383),
                Value::Array(vec![bulk(""), Value::Int(6380)]),
            ]),
            Value::Array(vec![Value::Int(1), Value::Int(70000)]),
            Value::Nil,
        ]);
        let ranges = parse_slots(&reply, "seed");
        assert_eq!(ranges.len(), 2);
        assert_eq!(owner(&ranges, 5461).map(|r| r.host.as_str()), Some("seed"));
        assert_eq!(owner(&ranges, 0).map(|r| r.port), Some(6379));
        assert_eq!(masters(&ranges).len(), 2);
        assert!(parse_slots(&Value::Int(3), "seed").is_empty());
    }
}

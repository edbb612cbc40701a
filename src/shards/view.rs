//! What a member reads in one cycle: the group's members and every shard's owner, from every
//! node in one script each, merged into one view.
//!
//! ## Behaviour
//! - **One script per node per cycle** ([`CYCLE`]): the member writes its own entry into the
//!   group's hash (`redlock:{LOCK}:shards`: identity → `ready|shards|born|EXPIRY`, EXPIRY on the
//!   node's own clock), deletes expired entries, and reads the live entries and every shard
//!   lock's value (`MGET`, in chunks). A new entry, or one removed, is announced on the group's
//!   channel, so the others run their cycle at once.
//! - **Merged** ([`merge`]): a member seen on any node is live (ready if any node says so); a
//!   shard is owned by the identity a quorum of nodes show, free when a quorum show no key, and
//!   unsettled otherwise (taken by nobody until it settles).
//! - Cluster mode is not supported: the shard locks hash to many slots, so the script fails
//!   with `CROSSSLOT` and the member reads nothing (the loop then refuses to take part, and
//!   says why).

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;

use crate::redlock::{identity_of, Redlock};

/// How long a member's entry lives on a node without being written again, for cycles
/// `interval` apart: three cycles (at least 1 s), so an entry outlives a late cycle or two and a
/// member never drops out of the group (and its shards never move) while it runs.
pub fn member_life(interval: Duration) -> Duration {
    (interval * 3).max(Duration::from_secs(1))
}

/// Shard keys read by one `MGET` (Lua's stack keeps `unpack` below about 8,000 values).
const MGET_CHUNK: usize = 1000;

/// KEYS: the group's hash, then every shard lock's key. ARGV: the member's identity (empty:
/// read only), its entry (`ready|shards|born`), the entry's life in ms, `1` to remove the
/// entry, the group's channel. Returns `{entries (flat name/value list), values of the shard
/// keys}`.
pub static CYCLE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local life = tonumber(ARGV[3])
if ARGV[1] ~= '' then
  local changed
  if ARGV[4] == '1' then
    changed = redis.call('HDEL', KEYS[1], ARGV[1])
  else
    changed = redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. '|' .. (now + life))
  end
  if changed == 1 then redis.call('PUBLISH', ARGV[5], ARGV[1]) end
end
local entries = redis.call('HGETALL', KEYS[1])
local live = {{}}
for i = 1, #entries, 2 do
  local expiry = tonumber(string.match(entries[i + 1], '|(%d+)$') or '0')
  if expiry > now then
    live[#live + 1] = entries[i]
    live[#live + 1] = entries[i + 1]
  else
    redis.call('HDEL', KEYS[1], entries[i])
  end
end
redis.call('PEXPIRE', KEYS[1], 2 * life)
local owners = {{}}
for first = 2, #KEYS, {MGET_CHUNK} do
  local values = redis.call('MGET', unpack(KEYS, first, math.min(first + {MGET_CHUNK} - 1, #KEYS)))
  for i = 1, #values do owners[#owners + 1] = values[i] or '' end
end
return {{live, owners}}
"#
    ))
});

/// A member as its entry shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Its app counts as ready.
    pub ready: bool,
    /// The shard count it was started with.
    pub shards: u32,
    /// Its start (ms of the Unix epoch): the oldest member's count is the group's.
    pub born_ms: u64,
}

impl Member {
    /// The entry's text, without its expiry.
    pub fn entry(&self) -> String {
        format!("{}|{}|{}", u8::from(self.ready), self.shards, self.born_ms)
    }

    /// Parses `ready|shards|born|expiry`; `None` for anything else.
    pub fn parse(text: &str) -> Option<Member> {
        let mut parts = text.split('|');
        let ready = match parts.next()? {
            "1" => true,
            "0" => false,
            _ => return None,
        };
        let shards = parts.next()?.parse().ok()?;
        let born_ms = parts.next()?.parse().ok()?;
        parts.next()?.parse::<u64>().ok()?;
        parts.next().is_none().then_some(Member {
            ready,
            shards,
            born_ms,
        })
    }
}

/// Who holds a shard, as a quorum of nodes shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Owner {
    /// No key on a quorum of nodes.
    Free,
    /// This identity's key on a quorum of nodes.
    Held(String),
    /// Neither (a round in progress, or too few answers).
    Unsettled,
}

/// What one node answered: the live entries and every shard key's value (empty: none).
pub type NodeAnswer = (Vec<String>, Vec<String>);

/// The group as one cycle read it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct View {
    /// The live members, by identity.
    pub members: BTreeMap<String, Member>,
    /// Every shard's owner (empty when no quorum answered).
    pub owners: Vec<Owner>,
}

/// Merges the answers of the nodes that answered (of `nodes` configured) for `shards` shards.
pub fn merge(answers: &[NodeAnswer], nodes: usize, shards: u32) -> View {
    let mut members: BTreeMap<String, Member> = BTreeMap::new();
    for (entries, _) in answers {
        for pair in entries.chunks_exact(2) {
            let Some(member) = Member::parse(&pair[1]) else {
                continue;
            };
            members
                .entry(pair[0].clone())
                .and_modify(|known| known.ready |= member.ready)
                .or_insert(member);
        }
    }
    let quorum = nodes / 2 + 1;
    let owners = if answers.len() < quorum {
        Vec::new()
    } else {
        (0..shards as usize)
            .map(|shard| owner(answers, shard, quorum))
            .collect()
    };
    View { members, owners }
}

/// Shard `shard`'s owner in `answers`.
fn owner(answers: &[NodeAnswer], shard: usize, quorum: usize) -> Owner {
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (_, values) in answers {
        let value = values.get(shard).map_or("", String::as_str);
        let holder = if value.is_empty() {
            ""
        } else {
            identity_of(value)
        };
        *seen.entry(holder).or_default() += 1;
    }
    match seen.into_iter().find(|(_, n)| *n >= quorum) {
        Some(("", _)) => Owner::Free,
        Some((holder, _)) => Owner::Held(holder.to_owned()),
        None => Owner::Unsettled,
    }
}

/// The group's hash of `lock`.
pub fn members_key(lock: &str) -> String {
    format!("redlock:{{{lock}}}:shards")
}

/// The group's channel of `lock` (members joining, leaving, releasing).
pub fn channel(lock: &str) -> String {
    format!("redlock:{{{lock}}}:shards:changed")
}

/// The lock name of shard `shard` of `lock`.
pub fn shard_lock(lock: &str, shard: u32) -> String {
    format!("{lock}/shard/{shard}")
}

/// What `me` says this cycle (`None`: read only).
pub struct Announce<'a> {
    /// The member's identity.
    pub identity: &'a str,
    /// Its entry.
    pub member: &'a Member,
    /// Remove the entry instead (leaving).
    pub leaving: bool,
    /// How long the entry lives ([`member_life`]).
    pub life: Duration,
}

/// The keys [`CYCLE`] reads for a group: its hash, then every shard lock's key (built once
/// per member, not every cycle).
pub struct Keys(Vec<String>);

impl Keys {
    /// The keys of group `lock` with `shards` shards.
    pub fn new(lock: &str, shards: u32) -> Keys {
        let mut keys = vec![members_key(lock)];
        keys.extend((0..shards).map(|s| format!("redlock:{{{}}}", shard_lock(lock, s))));
        Keys(keys)
    }

    /// How many shards.
    fn shards(&self) -> u32 {
        u32::try_from(self.0.len() - 1).unwrap_or(u32::MAX)
    }
}

/// Runs [`CYCLE`] on every node of `redlock` (the group's lock) at once, each bounded by the
/// node timeout, on the group's `keys`; the view of the nodes that answered.
pub async fn read(redlock: &Redlock, keys: &Keys, me: Option<Announce<'_>>) -> View {
    let cfg = redlock.config();
    let shards = keys.shards();
    let keys: Vec<&str> = keys.0.iter().map(String::as_str).collect();
    let (identity, entry, leaving, life) = match &me {
        Some(me) => (me.identity, me.member.entry(), me.leaving, me.life),
        None => ("", String::new(), false, Duration::from_secs(3)),
    };
    let life = life.as_millis().to_string();
    let channel = channel(&cfg.lock);
    let args = [
        identity,
        &entry,
        &life,
        if leaving { "1" } else { "0" },
        &channel,
    ];
    let calls = redlock.nodes().iter().map(|node| {
        let (keys, args) = (&keys, &args);
        async move {
            node.eval::<NodeAnswer>(&CYCLE, keys, args, cfg.node_timeout)
                .await
                .ok()
                .map(|(answer, _)| answer)
        }
    });
    let answers: Vec<NodeAnswer> = futures_util::future::join_all(calls)
        .await
        .into_iter()
        .flatten()
        .collect();
    merge(&answers, redlock.nodes().len(), shards)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_outlives_three_cycles() {
        assert_eq!(
            member_life(Duration::from_millis(200)),
            Duration::from_secs(1)
        );
        let interval = Duration::from_millis(3333);
        assert_eq!(member_life(interval), interval * 3);
    }

    fn entries(members: &[(&str, &str)]) -> Vec<String> {
        members
            .iter()
            .flat_map(|(name, entry)| [(*name).to_owned(), format!("{entry}|99")])
            .collect()
    }

    fn values(owners: &[&str]) -> Vec<String> {
        owners.iter().map(|o| (*o).to_owned()).collect()
    }

    #[test]
    fn an_entry_reads_back_as_written_and_garbage_as_nothing() {
        let member = Member {
            ready: true,
            shards: 12,
            born_ms: 1_700_000_000_000,
        };
        let text = format!("{}|123", member.entry());
        assert_eq!(Member::parse(&text), Some(member));
        for garbage in [
            "",
            "1|12|5",
            "2|12|5|9",
            "1|x|5|9",
            "1|12|5|9|9",
            "1|-1|5|9",
        ] {
            assert_eq!(Member::parse(garbage), None, "{garbage:?}");
        }
    }

    #[test]
    fn owners_need_a_quorum_and_members_are_the_union_of_the_nodes() {
        let answers = vec![
            (
                entries(&[("a", "1|3|1"), ("b", "0|3|2")]),
                values(&["a:x", "", "b:y"]),
            ),
            (entries(&[("b", "1|3|2")]), values(&["a:x", "", ""])),
            (entries(&[("c", "0|3|3")]), values(&["", "c:z", "c:w"])),
        ];
        let view = merge(&answers, 3, 3);
        assert_eq!(
            view.owners,
            [Owner::Held("a".into()), Owner::Free, Owner::Unsettled]
        );
        let ready: Vec<(&str, bool)> = view
            .members
            .iter()
            .map(|(name, m)| (name.as_str(), m.ready))
            .collect();
        assert_eq!(ready, [("a", true), ("b", true), ("c", false)]);
    }

    #[test]
    fn without_a_quorum_of_answers_no_shard_has_an_owner() {
        let answers = vec![(entries(&[("a", "1|2|1")]), values(&["", ""]))];
        let view = merge(&answers, 3, 2);
        assert!(view.owners.is_empty());
        assert_eq!(view.members.len(), 1);
    }
}

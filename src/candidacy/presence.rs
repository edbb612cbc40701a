//! Candidates announce themselves on the nodes, and read who else stands: the field
//! [`Candidacy`] ranks itself in.
//!
//! ## Behaviour
//! - Every [`PERIOD`], one script on every node (each bounded by the node timeout): it writes
//!   this candidate's entry (whether its app counts as ready, when it started) into the lock's
//!   candidates hash (`redlock:{NAME}:candidates`, same hash tag as the lock) with an expiry of
//!   [`LIFE`] on the node's own clock, drops expired entries, and answers the live ones and
//!   the lock key's value. The hash itself expires once nobody announces.
//! - The answers of every node that answered are merged: a candidate seen on any node is
//!   live; the lock is free when a quorum of nodes answered and none of them holds the key.
//! - Nothing here decides or holds anything: a candidate that reads nothing (nodes down)
//!   ranks itself against the field it read last, and a field older than [`LIFE`] is empty,
//!   so a lost announcement can only make a candidate contend, never keep it out.
//! - A resign to a named successor writes a `~successor` entry that lives
//!   [`SUCCESSOR_LIFE`].

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::Script;
use tokio_util::sync::CancellationToken;

use super::{CandidacyTx, Field, Peer, Standing, SUCCESSOR_LIFE};
use crate::clock::{self, Deadline};
use crate::metrics::Metrics;
use crate::redlock::{identity_of, Redlock};
use tracing::warn;

/// How often a candidate announces itself and reads the others.
pub const PERIOD: Duration = Duration::from_secs(1);
/// How long an announcement lives on a node without being renewed.
pub const LIFE: Duration = Duration::from_secs(3);
/// The field name of a resign's named successor (no identity starts with `~`... and if one
/// does, it only names itself a successor).
const SUCCESSOR: &str = "~successor";

/// Writes `ARGV[1]` = `ARGV[2]` into the candidates hash for `ARGV[3]` ms (nothing when
/// `ARGV[1]` is empty), drops expired entries, and answers `{lock value or '', live entries}`.
const ANNOUNCE: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local life = tonumber(ARGV[3])
if ARGV[1] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. '|' .. string.format('%d', now + life))
end
local live = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local expires = tonumber(string.match(all[i + 1], '|(%d+)$') or '0') or 0
  if expires <= now then
    redis.call('HDEL', KEYS[1], all[i])
  else
    live[#live + 1] = all[i]
    live[#live + 1] = all[i + 1]
  end
end
if #live > 0 then
  redis.call('PEXPIRE', KEYS[1], 2 * life)
end
return {redis.call('GET', KEYS[2]) or '', live}
"#;

/// [`ANNOUNCE`], hashed once.
static ANNOUNCE_SCRIPT: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(ANNOUNCE));

/// This process' start, in ms of the Unix epoch: its rank among candidates of equal readiness.
pub fn born_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The candidates hash of `lock`.
fn candidates_key(lock: &str) -> String {
    format!("redlock:{{{lock}}}:candidates")
}

/// What one node answered: the lock's value (empty: free) and the live entries.
type NodeField = (String, Vec<(String, String)>);

/// Runs `ANNOUNCE` with `field` = `value` for `life` on every node at once; the answers of
/// the nodes that answered.
async fn announce(redlock: &Redlock, field: &str, value: &str, life: Duration) -> Vec<NodeField> {
    let script = &*ANNOUNCE_SCRIPT;
    let cfg = redlock.config();
    let key = candidates_key(&cfg.lock);
    let lock_key = format!("redlock:{{{}}}", cfg.lock);
    let life_ms = life.as_millis().to_string();
    let calls = redlock.nodes().iter().map(|node| {
        let keys = [key.as_str(), lock_key.as_str()];
        let args = [field, value, life_ms.as_str()];
        async move {
            node.eval::<(String, Vec<(String, String)>)>(script, &keys, &args, cfg.node_timeout)
                .await
                .ok()
                .map(|(answer, _)| answer)
        }
    });
    futures_util::future::join_all(calls)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// The field the nodes' answers show to `me`: every live candidate but `me` and the holder
/// (the identity most nodes that hold the key name), and a live successor.
fn merge(answers: &[NodeField], me: &str) -> Field {
    let mut holders: BTreeMap<&str, usize> = BTreeMap::new();
    for (held, _) in answers {
        if !held.is_empty() {
            *holders.entry(identity_of(held)).or_default() += 1;
        }
    }
    let holder = holders.into_iter().max_by_key(|(_, n)| *n).map(|(h, _)| h);
    let mut peers = BTreeMap::new();
    let mut successor = None;
    for (_, entries) in answers {
        for (name, value) in entries {
            let Some((entry, _expires)) = value.rsplit_once('|') else {
                continue;
            };
            if name == SUCCESSOR {
                successor = Some(entry.to_owned());
                continue;
            }
            if name == me || Some(name.as_str()) == holder {
                continue;
            }
            let Some((ready, born)) = entry.split_once('|') else {
                continue;
            };
            let Ok(born_ms) = born.parse() else {
                continue;
            };
            let peer = Peer {
                identity: name.clone(),
                ready: ready == "1",
                born_ms,
            };
            peers
                .entry(name.clone())
                .and_modify(|known: &mut Peer| known.ready |= peer.ready)
                .or_insert(peer);
        }
    }
    Field {
        peers: peers.into_values().collect(),
        successor,
    }
}

/// Names `identity` the successor for [`SUCCESSOR_LIFE`] on every node that answers; how many
/// did.
pub async fn name_successor(redlock: &Redlock, identity: &str) -> usize {
    announce(redlock, SUCCESSOR, identity, SUCCESSOR_LIFE)
        .await
        .len()
}

/// Whether `identity` is a live candidate of the lock, as the nodes that answer show it.
pub async fn is_candidate(redlock: &Redlock, identity: &str) -> bool {
    announce(redlock, "", "", LIFE)
        .await
        .iter()
        .any(|(_, entries)| entries.iter().any(|(name, _)| name == identity))
}

/// Announces this candidate every [`PERIOD`] and feeds the field read to `candidacy`, until
/// `cancel`; the candidacy gauge follows.
pub async fn run(
    redlock: Redlock,
    candidacy: CandidacyTx,
    metrics: std::sync::Arc<Metrics>,
    cancel: CancellationToken,
) {
    let handicap = super::handicap(redlock.config().node_timeout);
    let mut read_at: Option<Deadline> = None;
    let mut last = None;
    loop {
        let started = Deadline::now();
        let (me, resigned, successor) = {
            let c = candidacy.borrow();
            let successor = c.handing_over().map(str::to_owned);
            (c.announced(started), c.resigned(started), successor)
        };
        if let Some(successor) = successor {
            if name_successor(&redlock, &successor).await > 0 {
                candidacy.send_modify(|c| c.announced_successor());
            }
        }
        let value = format!("{}|{}", u8::from(me.ready), me.born_ms);
        // A resigned sidecar does not wait for the lock: it reads, and announces nothing.
        let field = if resigned { "" } else { me.identity.as_str() };
        let answers = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            answers = announce(&redlock, field, &value, LIFE) => answers,
        };
        let now = Deadline::now();
        if !answers.is_empty() {
            read_at = Some(now);
            candidacy.send_modify(|c| c.saw(merge(&answers, &me.identity)));
        } else if read_at.is_some_and(|at| now >= at + LIFE) {
            // What was read last has expired on the nodes too: rank against nobody.
            read_at = None;
            candidacy.send_modify(|c| c.saw(Field::default()));
        }
        let (standing, ready, defers) = {
            let c = candidacy.borrow();
            (c.standing(now), c.app_ready(now), c.defers(now))
        };
        metrics.candidacy(standing, ready);
        if last != Some(standing) {
            if standing == Standing::AppStateUnknown {
                metrics.app_state_unread();
            }
            if last.is_some() || standing != Standing::Contending {
                let lock = &redlock.config().lock;
                warn!(lock = %lock, standing = standing.as_str(), "candidacy changed");
            }
            last = Some(standing);
        }
        redlock.set_handicap(if defers { handicap } else { Duration::ZERO });
        // A successor newly named is announced at once (one that could not be, a period on).
        let mut changes = candidacy.subscribe();
        let named_before = candidacy.borrow().handing_over().is_some();
        let newly_named = async {
            if named_before {
                std::future::pending::<()>().await;
            }
            let _ = changes.wait_for(|c| c.handing_over().is_some()).await;
        };
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            () = newly_named => {}
            _ = clock::sleep_until_deadline(started + PERIOD) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn answers_merge_into_the_waiting_peers_and_a_successor() {
        let answers = vec![
            (
                "holder-x:abc".to_owned(),
                entries(&[
                    ("me", "1|5|99"),
                    ("b", "0|7|99"),
                    ("c", "1|9|99"),
                    ("holder-x", "1|11|99"),
                ]),
            ),
            (
                String::new(),
                entries(&[("b", "1|7|99"), ("~successor", "c|99"), ("bad", "x")]),
            ),
        ];
        let field = merge(&answers, "me");
        assert_eq!(
            field.peers,
            vec![
                Peer {
                    identity: "b".into(),
                    ready: true,
                    born_ms: 7
                },
                Peer {
                    identity: "c".into(),
                    ready: true,
                    born_ms: 9
                },
            ],
            "neither we nor the holder wait"
        );
        assert_eq!(field.successor.as_deref(), Some("c"));
    }
}

//! Candidates announce themselves on the nodes, and read who else stands: the field
//! [`Candidacy`] ranks itself in.
//!
//! ## Behaviour
//! - Every [`PERIOD`], on every node (each round trip bounded by the node timeout; plain
//!   commands, so a lock's scripts are only its rounds): this candidate's entry (whether its
//!   app counts as ready, when it started) goes into the lock's candidates hash
//!   (`redlock:{NAME}:candidates`, same hash tag as the lock) with an expiry of [`LIFE`] on the
//!   node's own clock (`TIME`), and the live entries and the lock key's value are read back in
//!   the same transaction; expired entries are deleted. The hash itself expires once nobody
//!   announces.
//! - The answers of every node that answered are merged: a candidate seen on any node is
//!   live; the lock is free when a quorum of nodes answered and none of them holds the key.
//! - Nothing here decides or holds anything: a candidate that reads nothing (nodes down)
//!   ranks itself against the field it read last, and a field older than [`LIFE`] is empty,
//!   so a lost announcement can only make a candidate contend, never keep it out.
//! - A resign to a named successor writes a `~successor` entry that lives
//!   [`SUCCESSOR_LIFE`].

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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

/// On every node at once: writes `field` = `value|EXPIRY` into the candidates hash (nothing
/// when `field` is empty), EXPIRY being the node's own clock plus `life`, keeps the hash for
/// twice `life`, and reads the live entries and the lock key's value; expired entries are
/// deleted. Plain commands (`TIME`, then one `MULTI`: `HSET`, `HGETALL`, `GET`, `PEXPIRE`),
/// each round trip bounded by the node timeout. The answers of the nodes that answered.
async fn announce(redlock: &Redlock, field: &str, value: &str, life: Duration) -> Vec<NodeField> {
    let cfg = redlock.config();
    let key = candidates_key(&cfg.lock);
    let lock_key = format!("redlock:{{{}}}", cfg.lock);
    let life_ms = u64::try_from(life.as_millis()).unwrap_or(u64::MAX);
    let calls = redlock.nodes().iter().map(|node| {
        let (key, lock_key) = (&key, &lock_key);
        async move {
            let (secs, micros): (u64, u64) = node
                .command(&redis::cmd("TIME"), cfg.node_timeout)
                .await
                .ok()?;
            let now_ms = secs * 1000 + micros / 1000;
            let mut pipe = redis::pipe();
            pipe.atomic();
            if !field.is_empty() {
                let entry = format!("{value}|{}", now_ms + life_ms);
                pipe.cmd("HSET").arg(key).arg(field).arg(entry).ignore();
            }
            pipe.cmd("HGETALL").arg(key);
            pipe.cmd("GET").arg(lock_key);
            pipe.cmd("PEXPIRE").arg(key).arg(2 * life_ms).ignore();
            let (entries, held): (Vec<(String, String)>, Option<String>) =
                node.query_pipeline(&pipe, cfg.node_timeout).await.ok()?;
            let (live, expired): (Vec<_>, Vec<_>) = entries
                .into_iter()
                .partition(|(_, value)| expiry_of(value).is_some_and(|at| at > now_ms));
            if !expired.is_empty() {
                let mut hdel = redis::cmd("HDEL");
                hdel.arg(key);
                for (name, _) in &expired {
                    hdel.arg(name);
                }
                let _ = node.command::<i64>(&hdel, cfg.node_timeout).await;
            }
            Some((held.unwrap_or_default(), live))
        }
    });
    futures_util::future::join_all(calls)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// The expiry (ms on the node's clock) an entry's value ends with.
fn expiry_of(value: &str) -> Option<u64> {
    value.rsplit_once('|')?.1.parse().ok()
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

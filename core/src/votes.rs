//! Which votes count: the rules that keep a node that lost data from granting a second lock.
//!
//! Redlock's safety rests on every node of a quorum remembering the keys it granted for as
//! long as they live. A node that loses data (a restart without persistence, a restart from a
//! snapshot, `FLUSHALL`/`FLUSHDB`, eviction, a failover to a replica that missed writes, a
//! resync from an older copy) may grant our `SET NX` although another holder's key was on it a
//! moment ago.
//!
//! ## The rules
//! 1. **Data age.** A grant counts only if the node proves it has kept its data for at least
//!    the longest ttl any contender of the lock uses, plus that ttl's drift. The proof is the
//!    node's epoch marker (see `scripts::ACQUIRE`): its age, on the node's own clock, is how
//!    long the node has provably kept its data. Every key another holder could still rely on
//!    was written less than one ttl ago, so it was written after the marker and would still
//!    be there.
//! 2. **Lineage, read in the same script.** The marker names the server's run id, replication
//!    id and database, read inside the atomic script that grants: a restart, a failover, a
//!    promotion, a full resync, `SWAPDB` or a proxy that re-dials another server all change it,
//!    and the age starts again at 0. A node whose `INFO` shows no run id or replication id
//!    never counts.
//! 3. **The longest ttl** is the largest of our `--ttl`, `--max-ttl`, and every value any node
//!    ever reported from the lock's max-ttl register (written by every grant and restore, and
//!    by a renewal when due: where its refresh marker is gone, and where our key was lost;
//!    living `timing::RECORD_LIFE` times its ttl and rewritten while at least one ttl is left, so it
//!    outlives every key written with that ttl).
//!    A grant from a node whose data age is below [`MAX_TTL`] + drift (the bound on every ttl)
//!    counts only once every node of the round has answered or timed out, so the registers of
//!    all reachable nodes are known before it is judged; where such grants would win while a
//!    node timed out (slow, paused, still connecting) or its connection broke, that node's
//!    register is read again first, for up to `timing::recheck_window` (see `round::acquire`,
//!    rule 5). `--max-ttl` closes the remaining gap: every node that holds the register lost
//!    it or stays unreachable for that window.
//! 4. **Eviction.** A node whose `maxmemory-policy` is not `noeviction` can drop a lock key
//!    under memory pressure without any trace; its grants never count, unless the operator
//!    accepts that with `--allow-evicting-nodes`.
//! 5. **One server, one vote.** Two configured nodes whose connections report the same run id
//!    are one server under two names (`localhost` and `127.0.0.1`): only the first counts.
//! 6. **Trusted again** once the marker is old enough: no memory of earlier verdicts is kept,
//!    each answer is judged on what the node proves in that same atomic script.
//! 7. **Same servers, same set.** Contenders that list different servers must not both lead:
//!    every grant records the fingerprint of the contender's node set beside the lock (and
//!    renewals keep it: with the register, and at once where it is not the holder's), and a round that sees another live fingerprint refuses to lead (see `acquire`).
//!    The fingerprint names the servers, not the addresses ([`NodeSet`]): each node by the run
//!    id its last connection showed and the database, `?` for a node never reached, so
//!    contenders that reach the same servers through other addresses (a proxy per pod,
//!    per-cluster DNS names, `localhost` beside `127.0.0.1`) agree. A round takes the
//!    identities once, when it starts, and a grant counts only if it came on a connection that
//!    shows the same identity ([`NodeSet::admits`]): a node first reached, or restarted, during
//!    the round counts from the next round on. So two contenders with one fingerprint count
//!    grants only from the same servers, out of the same number of nodes, and their quorums
//!    intersect, whatever placeholders their fingerprints hold. `--node-set` names the set
//!    instead, for what cannot be seen from the nodes; then rule 7 counts nothing out.
//!    A restart changes a server's identity, so the record of a holder that died before it
//!    saw the restart names the server as it was: beside a free key, a record whose every
//!    difference from our set is a server of ours that came up after it was written is stale
//!    ([`NodeSet::explains`]), and the next round replaces it (see `round::acquire`, rule 10).
//!    Limit:
//!    the name is what the connection showed when it was made, so a proxy that re-dials
//!    another server under a kept connection keeps the old name until the connection is
//!    remade (rule 2 still restarts that node's data age).

use std::time::Duration;

pub use crate::facts::server_identity;
use crate::facts::NodeFacts;
use crate::round::{Connection, Rules};
use crate::timing::{drift, MAX_TTL};

/// What one node's answer proved about how long it has kept its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataAge {
    /// The epoch marker's age, on the node's own clock.
    Proven(Duration),
    /// The answer made no proof (a held key is answered without one).
    NotProven,
    /// The node's `INFO` shows no run id or replication id: it can prove nothing.
    NoLineage,
}

impl DataAge {
    /// Decodes the scripts' `epoch_age_ms` (−1 no proof made, −2 no lineage).
    pub fn from_script(ms: i64) -> DataAge {
        match u64::try_from(ms) {
            Ok(ms) => DataAge::Proven(Duration::from_millis(ms)),
            Err(_) if ms == -2 => DataAge::NoLineage,
            Err(_) => DataAge::NotProven,
        }
    }
}

/// The data-age proof one node gave in one answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Proof {
    /// How long the node has provably kept its data.
    pub data_age: DataAge,
    /// The lock's max-ttl register on that node (zero if absent).
    pub max_ttl: Duration,
}

/// Why a grant does not count, and when it would if nothing changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotCounted {
    /// For the votes, the logs and `check`.
    pub why: String,
    /// Set when only the node's data age is short: how much longer it must keep its data.
    pub ready_in: Option<Duration>,
}

impl NotCounted {
    fn never(why: String) -> NotCounted {
        NotCounted {
            why,
            ready_in: None,
        }
    }
}

/// The data age a node must prove before its grants count, for a lock whose longest ttl
/// in use is `max_ttl`.
pub fn required_data_age(max_ttl: Duration) -> Duration {
    max_ttl + drift(max_ttl)
}

/// A data age past which no ttl any contender may use could make a grant wait: such a grant
/// can be counted before the other nodes of the round have answered.
pub fn settled_data_age() -> Duration {
    required_data_age(MAX_TTL)
}

/// The expiry (`PX`) an epoch marker is stamped with, about 31 years: its age is this minus
/// its `PTTL`, measured on the node's own clock like every key's expiry.
pub const EPOCH_LIFETIME_MS: u64 = 1_000_000_000_000;

/// The lineage an epoch marker names: the server's run id, its replication id and the
/// database, as the scripts write it.
pub fn lineage(run_id: &str, master_replid: &str, db: i64) -> String {
    format!("{run_id}:{master_replid}:{db}")
}

/// The data age an epoch marker holding `marker` with `pttl_ms` left proves on a node whose
/// lineage (see [`lineage`]) is `current`; `None` when it was stamped by another server
/// process, another replication history or another database, or carries no stamp of ours.
pub fn data_age(marker: &str, pttl_ms: i64, current: &str) -> Option<Duration> {
    let left = u64::try_from(pttl_ms)
        .ok()
        .filter(|left| *left <= EPOCH_LIFETIME_MS)?;
    (marker == current).then(|| Duration::from_millis(EPOCH_LIFETIME_MS - left))
}

/// Whether a grant from a node with `facts` and `proof` counts, when the longest ttl in use
/// is `max_ttl`; the error says why not, for `Vote::NotCounted` and the logs.
pub fn judge(
    facts: &NodeFacts,
    proof: Proof,
    max_ttl: Duration,
    allow_evicting: bool,
) -> Result<(), NotCounted> {
    if facts.may_evict() && !allow_evicting {
        return Err(NotCounted::never(format!(
            "maxmemory-policy {} can evict lock keys (see --allow-evicting-nodes)",
            facts.maxmemory_policy
        )));
    }
    let age = match proof.data_age {
        DataAge::Proven(age) => age,
        DataAge::NoLineage => return Err(NotCounted::never(
            "the node's INFO shows no run_id or master_replid, so it cannot prove it kept its data"
                .to_owned(),
        )),
        DataAge::NotProven => {
            return Err(NotCounted::never(
                "no data-age proof in the answer".to_owned(),
            ))
        }
    };
    let needed = required_data_age(max_ttl);
    if age < needed {
        return Err(NotCounted {
            why: format!(
                "data kept for {} ms only, less than ttl + drift ({} ms)",
                age.as_millis(),
                needed.as_millis()
            ),
            ready_in: Some(needed - age),
        });
    }
    Ok(())
}

/// What a fingerprint names a node by while its server is not known (never reached): the
/// same text for every contender, so those that cannot see the same node still agree.
pub const UNKNOWN_SERVER: &str = "?";

/// The fingerprint of a node set: the sorted list of its servers, each named by
/// [`server_tag`] ([`UNKNOWN_SERVER`] for `None`), joined by commas. Lists that name the same
/// servers in any order and under any address agree; lists that differ in a server, or in
/// how many nodes they hold, do not. A list rather than one hash, so that a contender can tell
/// which servers another set's record names that its own does not (see
/// [`NodeSet::explains`]).
pub fn node_set_fingerprint(servers: &[Option<String>]) -> String {
    let mut tags: Vec<String> = servers
        .iter()
        .map(|server| {
            server
                .as_deref()
                .map_or_else(|| UNKNOWN_SERVER.to_owned(), server_tag)
        })
        .collect();
    tags.sort_unstable();
    tags.join(",")
}

/// A server's name in a node-set fingerprint: FNV-1a (64 bits) of its identity
/// ([`server_identity`]), the first 8 hex digits: short, because every renewal carries the
/// fingerprint, and a collision among the few servers of two sets only hides a difference.
pub fn server_tag(identity: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in identity.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{:08x}", hash >> 32)
}

/// How a node-set record that names other servers than ours is judged (see
/// [`NodeSet::explains`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordVerdict {
    /// Every server it names that we do not is stood in for by one of ours that came up
    /// after the record was written: a restart the record's writer did not live to see. The
    /// record may be replaced; `after` is the age our newest such server showed (plus the
    /// margin), which the record must still exceed when it is replaced.
    Restarted {
        /// The age, on the node's clock, the record must exceed.
        after: Duration,
    },
    /// Another set: contenders on different servers must not both lead.
    OtherSet,
    /// Cannot tell yet: a server of ours that the record does not name showed no data age
    /// in this round (its key was held, or it did not answer).
    Unknown,
}

/// The node set one round or renewal records beside the lock (rule 7).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeSet {
    /// What the scripts record and compare: the fingerprint, or the `--node-set` name.
    pub fingerprint: String,
    /// Per node, the server the fingerprint names (`None`: [`UNKNOWN_SERVER`]); `None` for a
    /// named set, which names no servers.
    servers: Option<Vec<Option<String>>>,
}

impl NodeSet {
    /// The set `--node-set` names: every grant may count.
    pub fn named(name: &str) -> NodeSet {
        NodeSet {
            fingerprint: name.to_owned(),
            servers: None,
        }
    }

    /// The set of these servers, per node as known when the round starts.
    pub fn of_servers(servers: Vec<Option<String>>) -> NodeSet {
        NodeSet {
            fingerprint: node_set_fingerprint(&servers),
            servers: Some(servers),
        }
    }

    /// Whether a grant node `index` gave on a connection that shows `server` may count in a
    /// round that recorded this set: only if the fingerprint names that very server there.
    pub fn admits(&self, index: usize, server: Option<&str>) -> Result<(), NotCounted> {
        let Some(servers) = &self.servers else {
            return Ok(());
        };
        match servers.get(index).and_then(Option::as_deref) {
            Some(named) if Some(named) == server => Ok(()),
            Some(_) => Err(NotCounted::never(
                "the node's server changed (a restart or failover) since the round began; it counts from the next round".to_owned(),
            )),
            None => Err(NotCounted::never(
                "the node's server was not known when the round began; it counts from the next round".to_owned(),
            )),
        }
    }

    /// Judges a record of another set (`theirs`, a fingerprint, written `their_age` ago on
    /// its node's clock), given the data age each of our nodes proved in this round (`ages`,
    /// by node index). A restarted server changes its identity, so the record of a holder that
    /// crashed before it saw the restart names the server as it was, and would keep every
    /// contender out for as long as the record lives. Such a record names as many servers as
    /// ours, and every server of ours that it does not name came up after it was written (by
    /// more than the drift of the record's age, for the nodes' clock rates):
    /// [`RecordVerdict::Restarted`].
    ///
    /// Why that is safe: a record whose writer still holds the lock names the servers its
    /// key stands on; where its key stands we are refused anyway, and a node of ours that the
    /// record does not name and that came up after the record cannot hold that key. A set
    /// that differs in a server older than the record is another set, as before.
    pub fn explains(
        &self,
        theirs: &str,
        their_age: Option<Duration>,
        ages: &[Option<Duration>],
    ) -> RecordVerdict {
        let (Some(servers), Some(their_age)) = (&self.servers, their_age) else {
            return RecordVerdict::OtherSet;
        };
        let margin = drift(their_age);
        let mut named: Vec<&str> = theirs.split(',').collect();
        if named.len() != servers.len() {
            return RecordVerdict::OtherSet;
        }
        let mut newest = Duration::ZERO;
        let mut unknown = false;
        for (index, server) in servers.iter().enumerate() {
            let tag = server
                .as_deref()
                .map_or_else(|| UNKNOWN_SERVER.to_owned(), server_tag);
            if let Some(at) = named.iter().position(|t| *t == tag) {
                named.swap_remove(at);
                continue;
            }
            if server.is_none() {
                return RecordVerdict::OtherSet;
            }
            match ages.get(index).copied().flatten() {
                Some(age) if age + margin < their_age => newest = newest.max(age),
                Some(_) => return RecordVerdict::OtherSet,
                None => unknown = true,
            }
        }
        if unknown {
            return RecordVerdict::Unknown;
        }
        RecordVerdict::Restarted {
            after: newest + margin,
        }
    }
}

/// Whether a grant on `conn` with `proof` counts when the longest ttl in use is `longest`
/// (`votes` rules 1, 4, 5): the connection must show a run id of its own, and the node keep
/// its keys and prove its data age.
pub fn judge_vote(
    conn: &Connection,
    proof: Proof,
    longest: Duration,
    allow_evicting: bool,
    rules: Rules,
) -> Result<(), NotCounted> {
    if conn.facts.run_id.is_empty() {
        return Err(NotCounted {
            why: "the node's INFO shows no run_id: a restart or failover could not be told apart"
                .to_owned(),
            ready_in: None,
        });
    }
    if let Some(other) = &conn.same_server_as {
        return Err(NotCounted {
            why: format!("same server as node {other}: one server is one vote"),
            ready_in: None,
        });
    }
    match judge(&conn.facts, proof, longest, allow_evicting) {
        // Only the data age is short: without the rule, it counts.
        Err(NotCounted {
            ready_in: Some(_), ..
        }) if !rules.data_age => Ok(()),
        verdict => verdict,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(policy: &str) -> NodeFacts {
        NodeFacts {
            run_id: "r".into(),
            maxmemory_policy: policy.into(),
            ..NodeFacts::default()
        }
    }

    fn proof(age_ms: u64) -> Proof {
        Proof {
            data_age: DataAge::Proven(Duration::from_millis(age_ms)),
            max_ttl: Duration::ZERO,
        }
    }

    #[test]
    fn a_node_counts_once_it_kept_its_data_for_ttl_plus_drift() {
        let ttl = Duration::from_secs(10);
        let safe = facts("noeviction");
        assert_eq!(
            judge(&safe, proof(10_001), ttl, false)
                .unwrap_err()
                .ready_in,
            Some(Duration::from_millis(101)),
            "a young node's grant will count once it has kept its data long enough"
        );
        assert!(judge(&safe, proof(10_102), ttl, false).is_ok());
        let no_lineage = Proof {
            data_age: DataAge::NoLineage,
            max_ttl: Duration::ZERO,
        };
        assert_eq!(
            judge(&safe, no_lineage, ttl, false).unwrap_err().ready_in,
            None
        );
    }

    #[test]
    fn a_marker_proves_age_only_for_the_lineage_that_stamped_it() {
        let left = (EPOCH_LIFETIME_MS - 2_500) as i64;
        let stamped = lineage("run", "repl", 0);
        assert_eq!(
            data_age(&stamped, left, &lineage("run", "repl", 0)),
            Some(Duration::from_millis(2_500))
        );
        for other in [
            lineage("restarted", "repl", 0),
            lineage("run", "resynced", 0),
            lineage("run", "repl", 1),
        ] {
            assert_eq!(data_age(&stamped, left, &other), None, "{other}");
        }
        assert_eq!(
            data_age(&stamped, -1, &stamped),
            None,
            "no expiry: not our stamp"
        );
    }

    #[test]
    fn the_script_age_codes_decode() {
        assert_eq!(
            DataAge::from_script(5),
            DataAge::Proven(Duration::from_millis(5))
        );
        assert_eq!(DataAge::from_script(-1), DataAge::NotProven);
        assert_eq!(DataAge::from_script(-2), DataAge::NoLineage);
    }

    fn servers(names: &[&str]) -> Vec<Option<String>> {
        names
            .iter()
            .map(|name| (*name != UNKNOWN_SERVER).then(|| (*name).to_owned()))
            .collect()
    }

    #[test]
    fn node_set_fingerprints_name_servers_in_any_order_and_see_every_node() {
        let fp = |names: &[&str]| node_set_fingerprint(&servers(names));
        let abc = fp(&["a/0", "b/0", "c/0"]);
        assert_eq!(abc, fp(&["c/0", "a/0", "b/0"]));
        assert_ne!(abc, fp(&["a/0", "b/0", "d/0"]), "another server");
        assert_ne!(abc, fp(&["a/0", "b/0", "c/1"]), "another database");
        assert_ne!(abc, fp(&["a/0", "b/0"]), "fewer nodes");
        assert_ne!(abc, fp(&["a/0", "b/0", "?"]), "a node not known yet");
        assert_eq!(fp(&["a/0", "?", "?"]), fp(&["?", "a/0", "?"]));
        assert_eq!(abc.split(',').count(), 3, "{abc}");
        assert!(abc.split(',').all(|tag| tag.len() == 8), "{abc}");
        assert_eq!(server_identity("run", 2).as_deref(), Some("run/2"));
        assert_eq!(server_identity("", 0), None);
    }

    #[test]
    fn a_record_is_explained_only_by_servers_of_ours_that_came_up_after_it() {
        let ms = Duration::from_millis;
        let theirs = node_set_fingerprint(&servers(&["a/0", "b/0", "c/0"]));
        let ours = NodeSet::of_servers(servers(&["a/0", "b/0", "c2/0"]));
        let young = [Some(ms(60_000)), None, Some(ms(900))];
        assert_eq!(
            ours.explains(&theirs, Some(ms(5_000)), &young),
            RecordVerdict::Restarted { after: ms(952) },
        );
        // c2 came up before the record was written (or within the margin): another set.
        let old = [None, None, Some(ms(4_950))];
        assert_eq!(
            ours.explains(&theirs, Some(ms(5_000)), &old),
            RecordVerdict::OtherSet
        );
        // No age seen for c2 in this round: cannot tell yet.
        assert_eq!(
            ours.explains(&theirs, Some(ms(5_000)), &[None, None, None]),
            RecordVerdict::Unknown
        );
        // A majority restarted: both stand-ins must be younger than the record.
        let majority = NodeSet::of_servers(servers(&["a/0", "b2/0", "c2/0"]));
        let ages = [None, Some(ms(100)), Some(ms(300))];
        assert_eq!(
            majority.explains(&theirs, Some(ms(5_000)), &ages),
            RecordVerdict::Restarted { after: ms(352) },
        );
        // Another number of nodes, an unknown age of the record, a node of ours never
        // reached, or a named set: another set.
        let four = node_set_fingerprint(&servers(&["a/0", "b/0", "c/0", "d/0"]));
        assert_eq!(
            ours.explains(&four, Some(ms(5_000)), &young),
            RecordVerdict::OtherSet
        );
        assert_eq!(
            ours.explains(&theirs, None, &young),
            RecordVerdict::OtherSet
        );
        let unreached = NodeSet::of_servers(servers(&["a/0", "b/0", "?"]));
        assert_eq!(
            unreached.explains(&theirs, Some(ms(5_000)), &young),
            RecordVerdict::OtherSet
        );
        assert_eq!(
            NodeSet::named("blue").explains(&theirs, Some(ms(5_000)), &young),
            RecordVerdict::OtherSet
        );
    }

    #[test]
    fn a_grant_counts_only_from_the_server_the_round_began_with() {
        let set = NodeSet::of_servers(servers(&["a/0", "?", "c/0"]));
        assert!(set.admits(0, Some("a/0")).is_ok());
        let restarted = set.admits(0, Some("a2/0")).unwrap_err();
        assert!(restarted.why.contains("changed"), "{restarted:?}");
        assert_eq!(restarted.ready_in, None);
        assert!(set.admits(0, None).is_err(), "no run id: not that server");
        let unknown = set.admits(1, Some("b/0")).unwrap_err();
        assert!(unknown.why.contains("not known"), "{unknown:?}");
        assert!(set.admits(2, Some("c/0")).is_ok());
        assert!(set.admits(3, Some("c/0")).is_err(), "not a node of the set");
        let named = NodeSet::named("blue");
        assert_eq!(named.fingerprint, "blue");
        assert!(
            named.admits(1, None).is_ok(),
            "a named set counts out nothing"
        );
    }

    #[test]
    fn an_evicting_node_counts_only_when_allowed() {
        let ttl = Duration::from_secs(1);
        let lru = facts("allkeys-lru");
        assert!(judge(&lru, proof(60_000), ttl, false)
            .unwrap_err()
            .why
            .contains("allkeys-lru"));
        assert!(judge(&lru, proof(60_000), ttl, true).is_ok());
        let volatile = facts("volatile-ttl");
        assert!(judge(&volatile, proof(60_000), ttl, false).is_err());
    }
}

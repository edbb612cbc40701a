//! Splitting `n` shards among the members of a group, with no coordinator.
//!
//! Every member decides for itself, from what it read in one cycle: the group's members (the
//! sidecars that announced themselves, ready ones only while any is ready) and each shard's
//! owner (the holder of the shard's lock). The decision ([`decide`]) only says which of its
//! own shards a member gives up and which free shards it tries; each shard is a quorum lock of
//! its own, so members that read different views may overshoot for a cycle but never own a
//! shard together.
//!
//! ## The rules
//! 1. **Shares.** With `k` members, a member's share is ⌈n/k⌉ or ⌊n/k⌋. The `n mod k` ceiling
//!    shares go to the members that own the most now (ties: the lower id), so a change of
//!    membership leaves a member that already holds a ceiling share where it is.
//! 2. **Give up only the excess, the latest taken first.** A member that owns more than its
//!    share releases the difference: the shards it took most recently (ties: those it ranks
//!    lowest). It keeps what it has held longest (warm caches, long work), and a shard that
//!    just moved to an old member moves on from there to a new one, not to another old one:
//!    in a rolling update (one member joins, then an old one leaves, in turn) no shard moves
//!    more than twice.
//! 3. **Take only free shards, up to the share.** A member under its share tries the free
//!    shards it ranks highest. The rank is rendezvous hashing (`score`): members rank the
//!    shards differently, so those that take at once mostly try different shards.
//! 4. **Not a member, nothing held.** A sidecar that is not among the members (its app not
//!    ready while others are, or leaving) releases every shard it owns.
//!
//! ## Bounds, when every member reads the same view
//! - Steady state: every shard owned and every member at its share, so shares differ by at
//!   most one.
//! - A member joins: only members above their new share give shards up, exactly their excess,
//!   so the shards that move are the joiner's share, at most ⌈n/(k+1)⌉.
//! - A member leaves: only its shards move.
//! - A rolling update (a member joins, the group settles, an old member leaves, the group
//!   settles, until every old member is gone): each shard moves at most twice (checked by
//!   simulation over group sizes and counts below).

use std::collections::{BTreeMap, BTreeSet};

/// The most shards a group may split: every member reads every shard's owner each cycle (one
/// read per node for all of them), so the bound keeps that read small.
pub const MAX_SHARDS: u32 = 16_384;

/// What a member does this cycle: release its own shards in `release` (after its app was told),
/// and try to take the free shards in `take`, in that order of preference.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Moves {
    /// Shards of ours to give up.
    pub release: Vec<u32>,
    /// Free shards to try, best first.
    pub take: Vec<u32>,
    /// The member's share (`None`: not a member, so none).
    pub share: Option<u32>,
}

/// Each member's share of `shards` (rule 1), given how many each owns now.
pub fn shares(shards: u32, members: &[String], owners: &[Option<String>]) -> BTreeMap<String, u32> {
    let members: BTreeSet<&str> = members.iter().map(String::as_str).collect();
    if members.is_empty() {
        return BTreeMap::new();
    }
    let owned = owned_counts(&members, owners);
    let k = u32::try_from(members.len()).unwrap_or(u32::MAX);
    let (floor, ceilings) = (shards / k, shards % k);
    let mut ranked: Vec<&str> = members.into_iter().collect();
    // Most owned first; ties by id (the set is sorted, and the sort is stable).
    ranked.sort_by_key(|m| std::cmp::Reverse(owned.get(m).copied().unwrap_or(0)));
    ranked
        .into_iter()
        .enumerate()
        .map(|(rank, member)| {
            let ceiling = u32::try_from(rank).is_ok_and(|rank| rank < ceilings);
            (member.to_owned(), floor + u32::from(ceiling))
        })
        .collect()
}

/// How many shards each member owns.
fn owned_counts<'a>(
    members: &BTreeSet<&'a str>,
    owners: &[Option<String>],
) -> BTreeMap<&'a str, u32> {
    let mut owned = BTreeMap::new();
    for owner in owners.iter().flatten() {
        if let Some(member) = members.get(owner.as_str()) {
            *owned.entry(*member).or_insert(0) += 1;
        }
    }
    owned
}

/// What member `me` does this cycle, given the group's `members`, each shard's owner
/// (`owners[i]`: the holder of shard `i`'s lock, `None` when it is free) and, for the shards
/// `me` owns, when it took them (`taken(i)`: any stamp that grows with time). See the rules in
/// the module docs.
pub fn decide(
    me: &str,
    members: &[String],
    owners: &[Option<String>],
    taken: impl Fn(u32) -> u64,
) -> Moves {
    let mine: Vec<u32> = shard_ids(owners)
        .filter(|&s| owners[s as usize].as_deref() == Some(me))
        .collect();
    let shards = u32::try_from(owners.len()).unwrap_or(u32::MAX);
    let share = shares(shards, members, owners).get(me).copied();
    let Some(share) = share else {
        return Moves {
            release: mine,
            take: Vec::new(),
            share: None,
        };
    };
    let held = u32::try_from(mine.len()).unwrap_or(u32::MAX);
    if held > share {
        let mut release = mine;
        release.sort_by_key(|&s| (std::cmp::Reverse(taken(s)), score(me, s)));
        release.truncate((held - share) as usize);
        return Moves {
            release,
            take: Vec::new(),
            share: Some(share),
        };
    }
    let mut take: Vec<u32> = shard_ids(owners)
        .filter(|&s| owners[s as usize].is_none())
        .collect();
    take.sort_by_key(|&s| std::cmp::Reverse(score(me, s)));
    take.truncate((share - held) as usize);
    Moves {
        release: Vec::new(),
        take,
        share: Some(share),
    }
}

/// The ids of `owners`' shards.
fn shard_ids(owners: &[Option<String>]) -> impl Iterator<Item = u32> + '_ {
    (0..owners.len()).filter_map(|s| u32::try_from(s).ok())
}

/// How much `member` wants `shard` (rendezvous hashing): FNV-1a of the member's id, mixed with
/// the shard by SplitMix64's finaliser.
pub fn score(member: &str, shard: u32) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in member.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    let mut z = hash ^ u64::from(shard).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| (*s).to_owned()).collect()
    }

    /// Shards, their owners and when each was taken (a counter of takes).
    #[derive(Clone, Debug, PartialEq)]
    struct Group {
        owners: Vec<Option<String>>,
        taken: Vec<u64>,
        takes: u64,
    }

    impl Group {
        fn new(n: u32) -> Group {
            Group {
                owners: vec![None; n as usize],
                taken: vec![0; n as usize],
                takes: 0,
            }
        }
    }

    /// Every member decides on the same view; releases apply first, then takes in member
    /// order, the first to try a free shard getting it (its lock). The shards that changed
    /// owner.
    fn cycle(members: &[String], group: &mut Group, leaving: &[String]) -> usize {
        let before = group.owners.clone();
        let mut everyone: Vec<String> = members.to_vec();
        everyone.extend(leaving.iter().cloned());
        let taken = group.taken.clone();
        let moves: Vec<(String, Moves)> = everyone
            .iter()
            .map(|m| {
                (
                    m.clone(),
                    decide(m, members, &before, |s| taken[s as usize]),
                )
            })
            .collect();
        let owners = &mut group.owners;
        for (member, m) in &moves {
            for &s in &m.release {
                assert_eq!(owners[s as usize].as_deref(), Some(member.as_str()));
                owners[s as usize] = None;
            }
        }
        for (member, m) in &moves {
            for &s in &m.take {
                // Only shards free in the view it read are tried; one still free is won.
                assert!(before[s as usize].is_none());
                if owners[s as usize].is_none() {
                    owners[s as usize] = Some(member.clone());
                    group.takes += 1;
                    group.taken[s as usize] = group.takes;
                }
            }
        }
        before
            .iter()
            .zip(owners.iter())
            .filter(|(a, b)| a.is_some() && a != b)
            .count()
    }

    /// Runs cycles until nothing changes (at most `limit`); the cycles it took.
    fn settle(members: &[String], group: &mut Group, limit: usize) -> usize {
        for n in 1..=limit {
            let before = group.owners.clone();
            cycle(members, group, &[]);
            if group.owners == before {
                return n;
            }
        }
        panic!("not settled in {limit} cycles: {:?}", group.owners);
    }

    fn counts(members: &[String], owners: &[Option<String>]) -> Vec<usize> {
        members
            .iter()
            .map(|m| {
                owners
                    .iter()
                    .filter(|o| o.as_deref() == Some(m.as_str()))
                    .count()
            })
            .collect()
    }

    fn assert_balanced(members: &[String], owners: &[Option<String>]) {
        assert!(
            owners.iter().all(Option::is_some),
            "every shard owned: {owners:?}"
        );
        let c = counts(members, owners);
        let (lo, hi) = (c.iter().min().unwrap(), c.iter().max().unwrap());
        assert!(hi - lo <= 1, "balanced within one: {c:?}");
    }

    #[test]
    fn shares_split_the_shards_within_one_and_keep_ceilings_where_they_are() {
        let members = ids(&["a", "b", "c"]);
        let none = vec![None; 10];
        let s = shares(10, &members, &none);
        assert_eq!(s.values().sum::<u32>(), 10);
        assert_eq!(s["a"], 4, "ties: the lower id");
        // c owns the most: the ceiling share stays with it.
        let mut owners = vec![None; 10];
        for o in owners.iter_mut().take(4) {
            *o = Some("c".to_owned());
        }
        let s = shares(10, &members, &owners);
        assert_eq!((s["a"], s["b"], s["c"]), (3, 3, 4));
        assert!(shares(10, &[], &none).is_empty());
        assert_eq!(shares(2, &members, &none).values().sum::<u32>(), 2);
    }

    #[test]
    fn a_member_over_its_share_gives_up_only_the_excess_and_one_under_takes_free_shards() {
        let members = ids(&["a", "b"]);
        let mut owners: Vec<Option<String>> = vec![Some("a".to_owned()); 6];
        owners.extend(vec![None; 2]);
        // a took shard s at stamp s: it gives up the two it took last.
        let a = decide("a", &members, &owners, u64::from);
        assert_eq!(a.release, [5, 4]);
        assert!(a.take.is_empty());
        let b = decide("b", &members, &owners, u64::from);
        assert_eq!(b.take.len(), 2, "the free ones, up to its share");
        assert!(b.release.is_empty());
        // Not a member: everything goes.
        let gone = decide("a", &ids(&["b"]), &owners, u64::from);
        assert_eq!(gone.release.len(), 6);
        assert!(gone.take.is_empty());
    }

    #[test]
    fn members_rank_shards_differently() {
        let a: Vec<u64> = (0..64).map(|s| score("a", s)).collect();
        let b: Vec<u64> = (0..64).map(|s| score("b", s)).collect();
        let top = |v: &[u64]| {
            v.iter()
                .enumerate()
                .max_by_key(|(_, x)| **x)
                .map(|(i, _)| i)
        };
        assert_ne!(top(&a), top(&b));
    }

    /// Joins, leaves and crashes in a pseudo-random order (xorshift, fixed seeds), each
    /// followed by cycles on one shared view: every settled state is balanced within one; a
    /// join moves at most ⌈n/(k+1)⌉ shards and takes none from a member at or under its new
    /// share; a leave moves only the leaver's shards.
    #[test]
    fn joins_and_leaves_keep_the_bounds() {
        for (seed, n) in [(7u64, 64u32), (11, 100), (13, 7), (17, 1024), (19, 1)] {
            let mut rng = seed;
            let mut next = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            let mut group = Group::new(n);
            let mut members = ids(&["m0"]);
            settle(&members, &mut group, 4);
            assert_balanced(&members, &group.owners);
            let mut born = 1;
            for _ in 0..40 {
                if members.len() < 2 || next() % 2 == 0 {
                    // A join.
                    let joiner = format!("m{born}");
                    born += 1;
                    let before = group.owners.clone();
                    let mut after = members.clone();
                    after.push(joiner.clone());
                    after.sort();
                    let share = shares(n, &after, &before);
                    settle(&after, &mut group, 6);
                    let owners = &group.owners;
                    let moved: Vec<usize> = (0..n as usize)
                        .filter(|&s| before[s] != owners[s])
                        .collect();
                    let k = after.len() as u32;
                    assert!(moved.len() as u32 <= n.div_ceil(k), "join moved {moved:?}");
                    for &s in &moved {
                        let from = before[s].as_ref().expect("every shard was owned");
                        let had = before.iter().filter(|o| o.as_ref() == Some(from)).count();
                        assert!(had as u32 > share[from], "taken from {from} at its share");
                        assert_eq!(owners[s].as_deref(), Some(joiner.as_str()));
                    }
                    members = after;
                } else {
                    // A leave (a SIGTERM's hand-over: releases at once, then the others take).
                    let leaver = members.remove((next() % members.len() as u64) as usize);
                    let before = group.owners.clone();
                    cycle(&members, &mut group, std::slice::from_ref(&leaver));
                    settle(&members, &mut group, 6);
                    let owners = &group.owners;
                    for s in 0..n as usize {
                        if before[s] != owners[s] {
                            assert_eq!(before[s].as_ref(), Some(&leaver), "shard {s} moved");
                        }
                    }
                }
                assert_balanced(&members, &group.owners);
            }
        }
    }

    /// A rolling update with one surge member: a new member joins and the group settles, then
    /// an old one leaves and the group settles, until every old member is gone. Over group
    /// sizes and counts (some not multiples of each other): no shard moves more than twice,
    /// and every settled state is balanced.
    #[test]
    fn a_rolling_update_moves_each_shard_at_most_twice() {
        for (n, k) in [
            (12u32, 3usize),
            (7, 3),
            (10, 4),
            (33, 5),
            (64, 4),
            (100, 5),
            (1024, 16),
        ] {
            let mut group = Group::new(n);
            let mut members: Vec<String> = (0..k).map(|i| format!("old{i:02}")).collect();
            settle(&members, &mut group, 8);
            let mut last = group.owners.clone();
            let mut moves = vec![0u32; n as usize];
            let mut count = |group: &Group| {
                for (s, owner) in group.owners.iter().enumerate() {
                    if owner.is_some() && *owner != last[s] {
                        moves[s] += 1;
                        last[s].clone_from(owner);
                    }
                }
            };
            for i in 0..k {
                members.push(format!("new{i:02}"));
                members.sort();
                for _ in 0..6 {
                    cycle(&members, &mut group, &[]);
                    count(&group);
                }
                assert_balanced(&members, &group.owners);
                let leaver = format!("old{i:02}");
                members.retain(|m| *m != leaver);
                cycle(&members, &mut group, std::slice::from_ref(&leaver));
                count(&group);
                for _ in 0..6 {
                    cycle(&members, &mut group, &[]);
                    count(&group);
                }
                assert_balanced(&members, &group.owners);
            }
            let most = moves.iter().max().copied().unwrap_or(0);
            assert!(most <= 2, "n = {n}, k = {k}: a shard moved {most} times");
            assert!(
                moves.iter().all(|m| *m >= 1),
                "every shard ends on a new member"
            );
        }
    }
}

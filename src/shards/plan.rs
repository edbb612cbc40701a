//! Who the planner splits the shards among, as one member sees the group: the members that
//! share the group's shard count, ready ones only while any is (the rule of leadership).

use super::view::{Member, Owner, View};

/// The owner the planner reads for a shard that is neither free nor a member's: it counts for
/// nobody's share, and nobody tries it.
const UNSETTLED: &str = "~unsettled";

/// The members to split among, by identity, or why `me` takes no part. `me` (with `mine`, its
/// entry as of now) counts even if no node showed it yet.
///
/// The group's count is its oldest member's (earliest start, then lowest identity): during a
/// rolling update that changes the count, the new members hold nothing until the last member
/// started with the old count is gone, so no two counts split the work at once.
pub fn members(view: &View, me: &str, mine: &Member) -> Result<Vec<String>, String> {
    let mut all = view.members.clone();
    all.insert(me.to_owned(), mine.clone());
    let oldest = all
        .iter()
        .min_by_key(|(identity, member)| (member.born_ms, (*identity).clone()))
        .map(|(_, member)| member.shards)
        .unwrap_or(mine.shards);
    if oldest != mine.shards {
        return Err(format!(
            "the group splits {oldest} shards (the count of its oldest member); this member was \
             started with --shards {}: it takes no shard until every member of the other count \
             is gone",
            mine.shards
        ));
    }
    let alike: Vec<(&String, &Member)> = all.iter().filter(|(_, m)| m.shards == oldest).collect();
    let any_ready = alike.iter().any(|(_, m)| m.ready);
    Ok(alike
        .into_iter()
        .filter(|(_, m)| m.ready || !any_ready)
        .map(|(identity, _)| identity.clone())
        .collect())
}

/// The owners the planner reads: the view's, except that the shards `me` holds are its own
/// and a shard the view gives `me` that it does not hold (an old key of a lost lease) is
/// nobody's until it expires.
pub fn owners(view: &View, me: &str, held: impl Fn(u32) -> bool) -> Vec<Option<String>> {
    view.owners
        .iter()
        .enumerate()
        .map(|(shard, owner)| {
            let shard = u32::try_from(shard).unwrap_or(u32::MAX);
            if held(shard) {
                return Some(me.to_owned());
            }
            match owner {
                Owner::Free => None,
                Owner::Held(identity) if identity == me => Some(UNSETTLED.to_owned()),
                Owner::Held(identity) => Some(identity.clone()),
                // Counts for nobody, and is not free: taken by nobody until it settles.
                Owner::Unsettled => Some(UNSETTLED.to_owned()),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn member(ready: bool, shards: u32, born_ms: u64) -> Member {
        Member {
            ready,
            shards,
            born_ms,
        }
    }

    fn view(members: &[(&str, Member)]) -> View {
        View {
            members: members
                .iter()
                .map(|(id, m)| ((*id).to_owned(), m.clone()))
                .collect::<BTreeMap<_, _>>(),
            owners: Vec::new(),
        }
    }

    #[test]
    fn ready_members_only_while_any_is_ready() {
        let v = view(&[("a", member(true, 8, 1)), ("b", member(false, 8, 2))]);
        assert_eq!(
            members(&v, "c", &member(true, 8, 3)),
            Ok(vec!["a".into(), "c".into()])
        );
        assert_eq!(members(&v, "b", &member(false, 8, 2)), Ok(vec!["a".into()]));
        let none_ready = view(&[("a", member(false, 8, 1))]);
        assert_eq!(
            members(&none_ready, "b", &member(false, 8, 2)),
            Ok(vec!["a".into(), "b".into()])
        );
    }

    #[test]
    fn a_member_of_another_count_than_the_oldest_takes_no_part_and_is_not_counted() {
        let v = view(&[("old", member(true, 8, 1)), ("new", member(true, 12, 5))]);
        let refused = members(&v, "new", &member(true, 12, 5)).unwrap_err();
        assert!(refused.contains("splits 8 shards"), "{refused}");
        assert_eq!(
            members(&v, "old", &member(true, 8, 1)),
            Ok(vec!["old".into()])
        );
    }

    #[test]
    fn held_shards_are_mine_and_a_stale_key_of_mine_is_nobodys() {
        let v = View {
            members: BTreeMap::new(),
            owners: vec![
                Owner::Free,
                Owner::Held("me".into()),
                Owner::Held("b".into()),
                Owner::Unsettled,
            ],
        };
        let read = owners(&v, "me", |s| s == 0);
        assert_eq!(read[0].as_deref(), Some("me"));
        assert_eq!(read[1].as_deref(), Some(UNSETTLED));
        assert_eq!(read[2].as_deref(), Some("b"));
        assert_eq!(read[3].as_deref(), Some(UNSETTLED));
    }
}

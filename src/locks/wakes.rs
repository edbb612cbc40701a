//! When each lease is next looked at: one ordered table of wake-ups for every lease of the
//! sidecar, a pure structure over [`Deadline`]s.
//!
//! A lease needs its task only while it acts (a renewal, its release); between actions it is
//! an entry here. One task sleeps until the earliest entry (on the boot clock), takes the due
//! ones ([`Wakes::due`]) and hands each lease a turn; a lease that has nothing to do yet sets
//! its next wake-up again. So a held lease costs an entry, not a task and a timer.
//!
//! ## Behaviour
//! - A key has at most one wake-up: [`Wakes::set`] replaces the one it had.
//! - [`Wakes::due`] takes every wake-up at or before `now`, earliest first.
//! - [`Wakes::next`] is the earliest wake-up left.

use std::collections::{BTreeSet, HashMap};
use std::hash::Hash;

use crate::clock::Deadline;

/// One wake-up per key, ordered by time.
#[derive(Debug)]
pub struct Wakes<K> {
    by_time: BTreeSet<(Deadline, K)>,
    of: HashMap<K, Deadline>,
}

impl<K> Default for Wakes<K> {
    fn default() -> Wakes<K> {
        Wakes {
            by_time: BTreeSet::new(),
            of: HashMap::new(),
        }
    }
}

impl<K: Copy + Ord + Hash> Wakes<K> {
    /// No wake-ups.
    pub fn new() -> Wakes<K> {
        Wakes::default()
    }

    /// Wakes `key` at `at`, instead of when it was to wake.
    pub fn set(&mut self, key: K, at: Deadline) {
        if let Some(old) = self.of.insert(key, at) {
            self.by_time.remove(&(old, key));
        }
        self.by_time.insert((at, key));
    }

    /// `key` no longer wakes.
    pub fn remove(&mut self, key: K) {
        if let Some(old) = self.of.remove(&key) {
            self.by_time.remove(&(old, key));
        }
    }

    /// The keys due at `now`, earliest first, removed.
    pub fn due(&mut self, now: Deadline) -> Vec<K> {
        let mut due = Vec::new();
        while let Some(&(at, key)) = self.by_time.first() {
            if at > now {
                break;
            }
            self.by_time.pop_first();
            self.of.remove(&key);
            due.push(key);
        }
        due
    }

    /// The earliest wake-up; `None` when no key waits.
    pub fn next(&self) -> Option<Deadline> {
        self.by_time.first().map(|&(at, _)| at)
    }

    /// When `key` wakes, if it does.
    pub fn of(&self, key: K) -> Option<Deadline> {
        self.of.get(&key).copied()
    }

    /// How many keys wait.
    pub fn len(&self) -> usize {
        self.of.len()
    }

    /// Whether no key waits.
    pub fn is_empty(&self) -> bool {
        self.of.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn at(ms: u64) -> Deadline {
        Deadline::from_boottime(Duration::from_secs(100) + Duration::from_millis(ms))
    }

    #[test]
    fn keys_wake_in_time_order_and_only_once_due() {
        let mut wakes = Wakes::new();
        wakes.set(3, at(30));
        wakes.set(1, at(10));
        wakes.set(2, at(20));
        assert_eq!(wakes.next(), Some(at(10)));
        assert!(wakes.due(at(9)).is_empty());
        assert_eq!(wakes.due(at(20)), vec![1, 2]);
        assert_eq!(wakes.next(), Some(at(30)));
        assert_eq!(wakes.len(), 1);
        assert_eq!(wakes.due(at(1_000)), vec![3]);
        assert!(wakes.is_empty());
        assert_eq!(wakes.next(), None);
    }

    #[test]
    fn a_key_has_one_wake_up_and_setting_it_again_moves_it() {
        let mut wakes = Wakes::new();
        wakes.set(1, at(10));
        wakes.set(1, at(50));
        assert_eq!(wakes.len(), 1);
        assert_eq!(wakes.of(1), Some(at(50)));
        assert!(wakes.due(at(40)).is_empty(), "the earlier one is gone");
        wakes.set(1, at(5));
        assert_eq!(wakes.due(at(5)), vec![1]);
        assert!(wakes.due(at(1_000)).is_empty(), "woken once");
    }

    #[test]
    fn a_removed_key_never_wakes() {
        let mut wakes = Wakes::new();
        wakes.set(1, at(10));
        wakes.set(2, at(10));
        wakes.remove(1);
        wakes.remove(7);
        assert_eq!(wakes.due(at(10)), vec![2]);
    }

    #[test]
    fn keys_due_at_one_instant_all_wake() {
        let mut wakes = Wakes::new();
        for key in 0..1_000u32 {
            wakes.set(key, at(10));
        }
        assert_eq!(wakes.due(at(10)).len(), 1_000);
        assert!(wakes.is_empty());
    }
}

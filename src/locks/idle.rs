//! Which names nobody uses are kept, and for how long: a pure decision over (state, now).
//!
//! A name's engine lock costs something to open (its keys and per-node state, and once it has
//! waited, its subscriptions on every node), so a name that a request loop locks again and
//! again keeps its engine lock between cycles. Kept only a short while ([`IdleNames::keep`])
//! and only so many at once ([`IdleNames::max`]): the table never grows with the number of
//! distinct names, and a name nobody comes back to is dropped (its subscriptions end).
//!
//! ## Behaviour
//! - A name that goes idle joins the back of the queue; a name used again leaves it.
//! - Past `max` idle names, the one idle longest is dropped at once.
//! - A name idle for `keep` is due to be dropped ([`IdleNames::expired`]);
//!   [`IdleNames::poll_timeout`] says when the next one is due.

use std::collections::VecDeque;
use std::time::Duration;

use crate::clock::Deadline;

/// Names nobody uses, oldest first.
#[derive(Debug)]
pub struct IdleNames<K> {
    queue: VecDeque<(K, Deadline)>,
    keep: Duration,
    max: usize,
}

impl<K: PartialEq> IdleNames<K> {
    /// Keeps an idle name for `keep`, and at most `max` idle names at once.
    pub fn new(keep: Duration, max: usize) -> IdleNames<K> {
        IdleNames {
            queue: VecDeque::new(),
            keep,
            max,
        }
    }

    /// How long an idle name is kept.
    pub fn keep(&self) -> Duration {
        self.keep
    }

    /// The most idle names kept at once.
    pub fn max(&self) -> usize {
        self.max
    }

    /// `key` is no longer used at `now`; returns the name to drop now to stay within `max`
    /// (the one idle longest, possibly `key` itself when `max` is 0).
    pub fn went_idle(&mut self, key: K, now: Deadline) -> Option<K> {
        self.queue.push_back((key, now));
        if self.queue.len() > self.max {
            return self.queue.pop_front().map(|(key, _)| key);
        }
        None
    }

    /// `key` is used again: it is no longer idle. Whether it was.
    pub fn reused(&mut self, key: &K) -> bool {
        // Searched from the back: a name used again is most often the one idle the least.
        match self.queue.iter().rposition(|(k, _)| k == key) {
            Some(at) => {
                self.queue.remove(at);
                true
            }
            None => false,
        }
    }

    /// The names idle for `keep` at `now`, removed: drop them.
    pub fn expired(&mut self, now: Deadline) -> Vec<K> {
        let mut due = Vec::new();
        while self
            .queue
            .front()
            .is_some_and(|(_, since)| now.saturating_duration_since(*since) >= self.keep)
        {
            due.extend(self.queue.pop_front().map(|(key, _)| key));
        }
        due
    }

    /// When the next idle name is due to be dropped; `None` when no name is idle.
    pub fn poll_timeout(&self) -> Option<Deadline> {
        self.queue.front().map(|(_, since)| *since + self.keep)
    }

    /// Every idle name, removed (at shutdown).
    pub fn drain(&mut self) -> Vec<K> {
        self.queue.drain(..).map(|(key, _)| key).collect()
    }

    /// How many names are idle.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether no name is idle.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEEP: Duration = Duration::from_secs(5);
    const T0: Deadline = Deadline::from_boottime(Duration::from_secs(100));

    fn at(t0: Deadline, ms: u64) -> Deadline {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn a_name_used_again_within_keep_is_no_longer_idle_and_never_expires() {
        let t0 = T0;
        let mut idle = IdleNames::new(KEEP, 8);
        assert_eq!(idle.went_idle("hot", t0), None);
        assert!(idle.reused(&"hot"));
        assert!(idle.is_empty());
        assert_eq!(idle.poll_timeout(), None);
        assert!(idle.expired(at(t0, 60_000)).is_empty());
        assert!(!idle.reused(&"hot"), "not idle twice");
    }

    #[test]
    fn a_name_idle_for_keep_expires_then_and_not_before() {
        let t0 = T0;
        let mut idle = IdleNames::new(KEEP, 8);
        idle.went_idle("a", t0);
        idle.went_idle("b", at(t0, 1_000));
        assert_eq!(idle.poll_timeout(), Some(t0 + KEEP));
        assert!(idle.expired(at(t0, 4_999)).is_empty());
        assert_eq!(idle.expired(t0 + KEEP), vec!["a"]);
        assert_eq!(idle.poll_timeout(), Some(at(t0, 1_000) + KEEP));
        assert_eq!(idle.expired(at(t0, 60_000)), vec!["b"]);
        assert!(idle.is_empty());
    }

    #[test]
    fn past_max_the_name_idle_longest_goes_at_once() {
        let t0 = T0;
        let mut idle = IdleNames::new(KEEP, 2);
        assert_eq!(idle.went_idle(1, t0), None);
        assert_eq!(idle.went_idle(2, at(t0, 1)), None);
        assert_eq!(idle.went_idle(3, at(t0, 2)), Some(1));
        assert_eq!(idle.len(), 2);
        // A million distinct names leave at most `max` behind.
        for name in 4..1_000_000 {
            idle.went_idle(name, at(t0, 3));
        }
        assert_eq!(idle.len(), 2);
    }

    #[test]
    fn with_max_zero_nothing_is_kept() {
        let mut idle = IdleNames::new(KEEP, 0);
        assert_eq!(idle.went_idle("a", T0), Some("a"));
        assert!(idle.is_empty());
    }

    #[test]
    fn a_name_reused_from_the_middle_keeps_the_order_of_the_others() {
        let t0 = T0;
        let mut idle = IdleNames::new(KEEP, 8);
        idle.went_idle("a", t0);
        idle.went_idle("b", at(t0, 1));
        idle.went_idle("c", at(t0, 2));
        assert!(idle.reused(&"b"));
        assert_eq!(idle.drain(), vec!["a", "c"]);
    }
}

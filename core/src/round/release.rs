//! Release: the owner-checked delete on every node; nothing to decide but the count.

use crate::error::NodeError;

/// The release script's reply: 1 if it deleted our key there.
pub type RawReleaseReply = i64;

/// How many nodes deleted our key, and on how many it is gone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReleaseTally {
    deleted: usize,
    gone: usize,
}

impl ReleaseTally {
    /// One node's answer.
    pub fn handle(&mut self, answer: Result<RawReleaseReply, NodeError>) {
        self.deleted += usize::from(matches!(answer, Ok(1)));
        self.gone += usize::from(answer.is_ok());
    }

    /// Nodes that deleted our key.
    pub fn deleted(&self) -> usize {
        self.deleted
    }

    /// Nodes that answered, so hold our key no more (deleted, or expired before).
    pub fn gone(&self) -> usize {
        self.gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_deletes_count() {
        let mut tally = ReleaseTally::default();
        tally.handle(Ok(1));
        tally.handle(Ok(0));
        tally.handle(Err(NodeError::timeout(std::time::Duration::ZERO)));
        tally.handle(Ok(1));
        assert_eq!(tally.deleted(), 2);
        assert_eq!(
            tally.gone(),
            3,
            "a node without our key holds it no more either"
        );
    }
}

//! The rounds of the protocol as pure state machines: no Redis, no clock, no Tokio.
//!
//! Shaped like `quinn-proto`: what a node answered (its parsed script reply and the facts of
//! the connection it came on, or the error) goes in with [`AcquireRound::handle`] and its
//! kin; the next step comes out of `poll(now)`, and the next instant the caller must wake
//! for out of `poll_timeout()`. The async layer (`acquire`, the engine's `extend` and
//! `release`) only fans out, waits, feeds answers in and carries the steps out; the protocol
//! model (tests/model) drives these same machines, so what it checks is what runs.
//!
//! Where a rule lives:
//! - which answer counts as a vote (data age, lineage facts, one server one vote, the node
//!   set a grant came from): [`acquire::AcquireRound`] judging with [`crate::votes`];
//! - when an acquire round is decided, waits for young nodes, refuses a foreign node set,
//!   cleans up, and which fencing token it mints: [`acquire`];
//! - raising the fencing counter when the candidate token was not stored: [`fence`];
//! - renewing a lease (won, lost, superseded, expired, restores, the longest promise):
//!   [`extend`]; releasing: [`release`];
//! - how long a wait retries and how long it sleeps between rounds: [`retry`].

pub mod acquire;
mod answer;
pub mod extend;
pub mod fence;
mod outcome;
pub mod release;
pub mod retry;

use std::sync::Arc;
use std::time::Duration;

use crate::facts::NodeFacts;
use crate::timing;

pub use acquire::{
    AcquireParams, AcquireReply, AcquireRound, AcquireStep, Lost, RoundLost, StaleRecord,
    TokenPlan, Validity,
};
pub use extend::{ExtendReply, ExtendRound, ExtendStep};
pub use fence::{FenceRaise, RaiseStep};
pub use release::ReleaseTally;

/// The rules of the rounds, each of which can be switched off to see what it prevents.
///
/// The engine always runs with [`Rules::default`] (all on). The switches exist for the
/// protocol model, which turns one off at a time and checks that it then finds two holders:
/// proof that the model can see the failure each rule guards against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rules {
    /// `votes` rule 1: a grant counts only from a node whose data age covers the longest ttl
    /// plus drift.
    #[doc(hidden)]
    pub data_age: bool,
    /// `votes` rule 3: the longest ttl in use is learnt from the nodes' max-ttl registers.
    #[doc(hidden)]
    pub register: bool,
    /// `votes` rule 3: a grant from a node younger than `MAX_TTL` + drift is judged only once
    /// every node of the round has answered.
    #[doc(hidden)]
    pub wait_for_all: bool,
    /// `votes` rule 3: young grants that would win a round are judged only once the nodes
    /// that did not answer in time were asked for their register again (within the recheck
    /// window).
    #[doc(hidden)]
    pub recheck_silent: bool,
    /// Validity subtracts the drift (`ttl − elapsed − drift`).
    #[doc(hidden)]
    pub drift_margin: bool,
    /// `votes` rule 7: a round that saw another node set's live record refuses to lead.
    #[doc(hidden)]
    pub node_set_conflict: bool,
    /// `votes` rule 7: a grant counts only from the server the round's node set named.
    #[doc(hidden)]
    pub same_server: bool,
    /// A renewal never moves the end of validity earlier (`timing::renewed_until`).
    #[doc(hidden)]
    pub longest_promise: bool,
}

impl Rules {
    /// Every rule on: what the engine runs.
    pub const ALL: Rules = Rules {
        data_age: true,
        register: true,
        wait_for_all: true,
        recheck_silent: true,
        drift_margin: true,
        node_set_conflict: true,
        same_server: true,
        longest_promise: true,
    };

    /// What is left of `ttl` after `elapsed` (see [`timing::validity`]); without the drift
    /// margin, `ttl − elapsed`.
    pub fn validity(&self, ttl: Duration, elapsed: Duration) -> Option<Duration> {
        if self.drift_margin {
            timing::validity(ttl, elapsed)
        } else {
            ttl.checked_sub(elapsed).filter(|left| !left.is_zero())
        }
    }
}

impl Default for Rules {
    fn default() -> Rules {
        Rules::ALL
    }
}

/// What the connection an answer came on showed: what the vote rules judge besides the reply.
#[derive(Clone, Debug)]
pub struct Connection {
    /// The node's `INFO` facts (run id, eviction policy...).
    pub facts: Arc<NodeFacts>,
    /// The server the node-set fingerprint names this node by (`votes::server_identity`).
    pub server: Option<String>,
    /// A node listed before this one whose connection shows the same run id (its label): one
    /// server under two names (`votes` rule 5).
    pub same_server_as: Option<String>,
}

/// One node's answer to a script: the parsed reply and the connection it came on.
#[derive(Clone, Debug)]
pub struct NodeAnswer<R> {
    /// The script's reply, parsed.
    pub reply: R,
    /// What the connection showed.
    pub conn: Connection,
}

#[cfg(test)]
mod tests;

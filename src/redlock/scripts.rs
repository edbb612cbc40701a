//! The Lua scripts the engine runs on every node. Each is atomic on its node.
//!
//! Keys: `KEYS[1]` is the lock key, `KEYS[2]` the lock's fencing counter (kept for the
//! fence retention after its last use), `KEYS[3]` the lock's max-ttl register, `KEYS[4]` the
//! node's epoch marker (one per node and database, shared by all locks). The last argument of
//! every script is the run id of the connection it runs on.

/// Lua that proves how long the node has kept its data: the age (ms, on the node's own
/// clock) of the node's epoch marker, a key holding the server's run id that the first
/// contender to meet the node stamps with an expiry of [`EPOCH_LIFETIME_MS`], so that its
/// age is that lifetime minus its `PTTL`. Any data loss deletes it (`FLUSHALL`, `FLUSHDB`,
/// a restart without persistence); a run id that is not the connection's (a restart from a
/// snapshot or an append-only file, a failover to a replica) re-stamps it. Either way the
/// age starts again at 0. The connection's run id is always the last argument.
///
/// [`EPOCH_LIFETIME_MS`]: super::votes::EPOCH_LIFETIME_MS
macro_rules! epoch_age {
    () => {
        r#"
local run_id = ARGV[#ARGV]
local age = -1
if redis.call('GET', KEYS[4]) == run_id then
  age = 1000000000000 - redis.call('PTTL', KEYS[4])
end
if age < 0 or age > 1000000000000 then
  redis.call('SET', KEYS[4], run_id, 'PX', 1000000000000)
  age = 0
end
"#
    };
}

/// Lua that records our ttl in the lock's max-ttl register (ARGV[2]); the register lives
/// twice the longest ttl written, so it outlives every key written with that ttl. Renewals
/// refresh it; a grant writes it only when it is missing, lower, or has less than a ttl left
/// (one write less per grant in the common case).
macro_rules! record_ttl {
    ($when:literal) => {
        concat!(
            "local ttl = tonumber(ARGV[2])\nif ",
            $when,
            r#" then redis.call('SET', KEYS[3], ARGV[2], 'PX', 2 * ttl) end
"#
        )
    };
}

/// Lua that raises the fencing counter to `token` if lower, and keeps it for the retention
/// time (ARGV[4]) from now either way.
macro_rules! keep_fence {
    ($token:literal) => {
        concat!(
            "local want = tonumber(",
            $token,
            r#")
if (tonumber(redis.call('GET', KEYS[2]) or '0') or 0) < want then
  redis.call('SET', KEYS[2], string.format('%d', want), 'PX', ARGV[4])
else
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
"#
        )
    };
}

/// Try to take the lock, prove the node's data age, and on a grant store the candidate
/// fencing token if the counter is lower.
///
/// ARGV: value, ttl in ms, candidate token, fence retention in ms, run id. Returns
/// `{granted, fence, epoch_age_ms, max_ttl_ms, candidate_stored, holder_value, holder_pttl}`,
/// where `fence` is the counter and `max_ttl_ms` the register before this call.
pub const ACQUIRE: &str = concat!(
    epoch_age!(),
    r#"
local fence = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local max_ttl = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local stored = 0
  if fence < tonumber(ARGV[3]) then
    redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
    stored = 1
  end
"#,
    record_ttl!("max_ttl < ttl or (max_ttl == ttl and redis.call('PTTL', KEYS[3]) < ttl)"),
    r#"
  return {1, fence, age, max_ttl, stored, '', 0}
end
return {0, fence, age, max_ttl, 0, redis.call('GET', KEYS[1]) or '', redis.call('PTTL', KEYS[1])}
"#
);

/// Raise the fencing counter to ARGV[1] if it is lower (a max-register; never lowers it).
/// The slow path of minting a token, when the candidate was not stored on a quorum.
///
/// ARGV: token, (unused), (unused), fence retention in ms, run id. Returns the counter
/// before the call: the token is ours on this node only if that was lower.
pub const RAISE_FENCE: &str = concat!(
    "local before = redis.call('GET', KEYS[2]) or '0'\n",
    keep_fence!("ARGV[1]"),
    "return before\n"
);

/// Extend our own lock, keep the fencing counter at least at our token, record our ttl,
/// and prove the node's data age (so a leader's view of node health stays current).
///
/// ARGV: value, ttl in ms, token, fence retention in ms, run id. Returns
/// `{status, epoch_age_ms, max_ttl_ms}`: status 1 if extended, 0 if another holder has the
/// key, -1 if the key is gone (expired, or the node lost it).
pub const EXTEND: &str = concat!(
    epoch_age!(),
    r#"
local max_ttl = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
"#,
    keep_fence!("ARGV[3]"),
    record_ttl!("max_ttl <= ttl"),
    r#"
  return {1, age, max_ttl}
end
if cur then return {0, age, max_ttl} end
return {-1, age, max_ttl}
"#
);

/// Put our key back on a node that lost it, only if nobody else has it there.
///
/// Used only while a valid quorum is held elsewhere. ARGV: value, ttl in ms, token, fence
/// retention in ms, run id.
pub const RESTORE: &str = concat!(
    r#"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local max_ttl = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
"#,
    keep_fence!("ARGV[3]"),
    record_ttl!("max_ttl <= ttl"),
    r#"
  return 1
end
return 0
"#
);

/// Delete our own lock and announce it, so waiters retry at once.
///
/// ARGV: value, release channel. Returns 1 if deleted, 0 if it was not ours.
pub const RELEASE: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], ARGV[1])
  return 1
end
return 0
"#;

/// Delete our own key without announcing it: the clean-up after a lost round, which must
/// not wake the waiters (the lock is still held by someone else).
///
/// ARGV: value. Returns 1 if deleted, 0 if it was not ours.
pub const CLEANUP: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#;

/// Read who holds the lock. Returns `{holder_value, pttl, fence}`.
pub const READ: &str = r#"
return {redis.call('GET', KEYS[1]) or '', redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[2]) or '0'}
"#;

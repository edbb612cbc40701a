//! The Lua scripts the engine runs on every node. Each is atomic on its node.
//!
//! Keys: `KEYS[1]` is the lock key, `KEYS[2]` the lock's fencing counter.
//! The counter never expires: it is the memory of the highest token handed out.

/// Lua that reads the node's `run_id` and `uptime` (seconds) from `INFO server`. Plain
/// searches, then anchored matches: a pattern scan of the whole text costs more than INFO.
macro_rules! read_node_identity {
    () => {
        r#"
local info = redis.call('INFO', 'server')
local at = string.find(info, 'run_id:', 1, true)
local run_id = at and string.match(info, '^%w+', at + 7) or ''
at = string.find(info, 'uptime_in_seconds:', 1, true)
local uptime = at and tonumber(string.match(info, '^%d+', at + 18)) or 0
"#
    };
}

/// Try to take the lock; report the node's identity so restarts can be detected; on a
/// grant, store the candidate fencing token if the counter is lower.
///
/// ARGV: value, ttl in ms, candidate token. Returns
/// `{granted, fence, run_id, uptime_s, holder_value, holder_pttl, candidate_stored}`, where
/// `fence` is the counter before this call. `INFO server` is read in the same atomic step,
/// so a node that restarted between two of our requests can never grant a vote that is
/// counted.
pub const ACQUIRE: &str = concat!(
    read_node_identity!(),
    r#"
local fence = redis.call('GET', KEYS[2]) or '0'
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local stored = 0
  if (tonumber(fence) or 0) < tonumber(ARGV[3]) then
    redis.call('SET', KEYS[2], ARGV[3])
    stored = 1
  end
  return {1, fence, run_id, uptime, '', 0, stored}
end
return {0, fence, run_id, uptime, redis.call('GET', KEYS[1]) or '', redis.call('PTTL', KEYS[1]), 0}
"#
);

/// Raise the fencing counter to ARGV[1] if it is lower (a max-register; never lowers it).
/// The slow path of minting a token, when the candidate was not stored on a quorum.
///
/// Returns the counter after the call.
pub const RAISE_FENCE: &str = r#"
local cur = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local want = tonumber(ARGV[1])
if cur < want then
  redis.call('SET', KEYS[2], ARGV[1])
  return ARGV[1]
end
return tostring(cur)
"#;

/// Extend our own lock, and keep the fencing counter at least at our token.
///
/// ARGV: value, ttl in ms, token. Returns `{status, run_id, uptime_s}`: status 1 if
/// extended, 0 if another holder has the key, -1 if the key is gone (expired, or the node
/// lost it in a restart). The node's identity keeps a leader's view of restarts current.
pub const EXTEND: &str = concat!(
    read_node_identity!(),
    r#"
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  local fence = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
  if fence < tonumber(ARGV[3]) then redis.call('SET', KEYS[2], ARGV[3]) end
  return {1, run_id, uptime}
end
if cur then return {0, run_id, uptime} end
return {-1, run_id, uptime}
"#
);

/// Put our key back on a node that lost it, only if nobody else has it there.
///
/// Used only while a valid quorum is held elsewhere. ARGV: value, ttl in ms, token.
pub const RESTORE: &str = r#"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local fence = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
  if fence < tonumber(ARGV[3]) then redis.call('SET', KEYS[2], ARGV[3]) end
  return 1
end
return 0
"#;

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

//! The Lua scripts the engine runs on every node. Each is atomic on its node.
//!
//! Keys: `KEYS[1]` is the lock key, `KEYS[2]` the lock's fencing counter (kept for the
//! fence retention after its last use), `KEYS[3]` the lock's max-ttl register, `KEYS[4]` the
//! node's epoch marker (one per node and database, shared by all locks; in cluster mode one
//! per hash slot, see `cluster`), `KEYS[5]` the lock's
//! node-set record (the fingerprint of the servers of whoever holds or renewed the lock, see
//! `votes`, rule 7), `KEYS[6]` the lock's refresh marker (present while the register and the
//! record were refreshed recently enough, see [`EXTEND`]).
//!
//! Arguments, in this order wherever a script takes them: value, ttl in ms, fencing token,
//! fence retention in ms, node-set fingerprint, and (`EXTEND`) `1` when the renewal asks for the
//! data-age proof, or (`ACQUIRE`) a stale record that may be replaced and its least age. The node's database index is always appended
//! as the last argument (`ARGV[#ARGV]`) by the connection.

/// Lua that reads the lock's keys and the node's epoch marker in one `MGET`: `KEYS[i]` is
/// `keys[i]` (`false` when missing). `MGET` answers nil for a key of another type where `GET`
/// fails with `WRONGTYPE`, so each missing key from `KEYS[$first]` on is read again with `GET`
/// (only when missing, which is rare): such garbage still fails the call, as it always did.
macro_rules! read_keys {
    ($first:literal) => {
        concat!(
            r#"
local keys = redis.call('MGET', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
for i = "#,
            $first,
            r#", 5 do
  if not keys[i] then redis.call('GET', KEYS[i]) end
end
local fence = tonumber(keys[2] or '0') or 0
local max_ttl_before = tonumber(keys[3] or '0') or 0
"#
        )
    };
}

/// Lua that proves how long the node has kept its data: the age (ms, on the node's own
/// clock) of the node's epoch marker, a key holding the node's *lineage* that the first
/// contender to meet the node stamps with an expiry of [`EPOCH_LIFETIME_MS`], so that its
/// age is that lifetime minus its `PTTL`. Needs `keys` ([`read_keys`]): the marker is
/// `keys[4]`.
///
/// The lineage is read here, inside the script, on every call: the server's `run_id`, its
/// `master_replid` and the database index (the last argument). Any data loss deletes the marker
/// (`FLUSHALL`, `FLUSHDB`, a restart without persistence); any way of replacing the data of a
/// running or restarted server changes the lineage and so re-stamps it: a restart (new run
/// id), a failover or a promotion (new replication id), a full resync from another server and
/// back (new replication id), a proxy that re-dials another server under a kept connection
/// (that server's ids), `SWAPDB` (the other database's marker names the other index). Either
/// way the age starts again at 0. A server whose `INFO` has no run id or replication id
/// proves nothing: age −2. Sets `age`, which the caller declares.
///
/// [`EPOCH_LIFETIME_MS`]: super::votes::EPOCH_LIFETIME_MS
macro_rules! epoch_age {
    () => {
        concat!(read_lineage!(), lineage_age!())
    };
}

/// [`epoch_age!`] once the lineage has been read (`run_id`, `replid`): a script that proves
/// many locks' data age reads the lineage once.
macro_rules! lineage_age {
    () => {
        concat!(
            r#"age = -2
if run_id ~= '' and replid ~= '' then
  local lineage = run_id .. ':' .. replid .. ':' .. ARGV[#ARGV]
  age = -1
  if keys[4] == lineage then
    age = 1000000000000 - redis.call('PTTL', KEYS[4])
  end
  if age < 0 or age > 1000000000000 then
    redis.call('SET', KEYS[4], lineage, 'PX', 1000000000000)
    age = 0
  end
end
"#
        )
    };
}

/// Lua that reads the server's `run_id` and `master_replid` (empty when `INFO` lacks them).
/// One `INFO server replication` (Redis 7+) costs less Redis CPU than two `INFO` calls; a
/// server that refuses two sections (Redis 6) is asked twice.
macro_rules! read_lineage {
    () => {
        r#"
local info = redis.pcall('INFO', 'server', 'replication')
if type(info) ~= 'string' then
  info = redis.call('INFO', 'server') .. '\r\n' .. redis.call('INFO', 'replication')
end
local function field(name)
  local at = string.find(info, '\n' .. name .. ':', 1, true)
  if not at then return '' end
  return string.match(info, '^[^:]*:([%w]*)', at + 1) or ''
end
local run_id = field('run_id')
local replid = field('master_replid')
"#
    };
}

/// [`RECORD_LIFE`] as a Lua literal, for the scripts' `concat!` (a unit test keeps the two equal).
///
/// [`RECORD_LIFE`]: super::timing::RECORD_LIFE
macro_rules! record_life {
    () => {
        "4"
    };
}

/// `record_life!`'s text, for the test that keeps it equal to [`RECORD_LIFE`].
///
/// [`RECORD_LIFE`]: super::timing::RECORD_LIFE
#[cfg(test)]
pub const RECORD_LIFE_IN_SCRIPTS: &str = record_life!();

/// Lua that records our ttl in the lock's max-ttl register (ARGV[2]), which says the longest
/// ttl of any key of the lock that may still stand. A register below our ttl (or none) takes
/// it, for [`RECORD_LIFE`] times our ttl. A register at or above it that has less than our
/// ttl left is kept, at its value, for as long: a longer ttl's register about to expire must
/// not leave our key standing without one. So the register outlives every key written under
/// it; its value only rises and its expiry only moves later. Needs `max_ttl_before`, the
/// register as read before.
///
/// [`RECORD_LIFE`]: super::timing::RECORD_LIFE
macro_rules! record_ttl {
    () => {
        concat!(
            r#"
local ttl = tonumber(ARGV[2])
if max_ttl_before < ttl then
  redis.call('SET', KEYS[3], ARGV[2], 'PX', "#,
            record_life!(),
            r#" * ttl)
elseif redis.call('PTTL', KEYS[3]) < ttl then
  redis.call('PEXPIRE', KEYS[3], "#,
            record_life!(),
            r#" * ttl)
end
"#
        )
    };
}

/// Lua that raises the fencing counter to `$want` (its text `$text`) if lower, and keeps it for
/// at least the retention time (ARGV[4]) from now either way: it never shortens an expiry
/// another contender set (a longer fence retention wins). Needs `fence`, the counter as read
/// before; sets `stored` when it raised it.
macro_rules! keep_fence {
    ($want:literal, $text:literal) => {
        concat!(
            "local want = tonumber(",
            $want,
            r#")
local stored = 0
local short = redis.call('PTTL', KEYS[2]) < tonumber(ARGV[4])
if fence < want then
  if short then
    redis.call('SET', KEYS[2], "#,
            $text,
            r#", 'PX', ARGV[4])
  else
    redis.call('SET', KEYS[2], "#,
            $text,
            r#", 'KEEPTTL')
  end
  stored = 1
elseif short then
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
"#
        )
    };
}

/// Lua that records our node-set fingerprint (ARGV[5]) beside the lock, for [`RECORD_LIFE`]
/// times the longest ttl. Runs only where our key now stands: a grant (which `ACQUIRE` refuses under another
/// live record), a renewal or a restore. There the holder is the authority, and its record
/// replaces any other: a holder whose fingerprint changed (a node restarted) must not leave
/// its old record to stop its standbys. Needs `max_ttl_before`; runs after [`record_ttl`], so
/// the register now holds the larger of `max_ttl_before` and our ttl.
///
/// [`RECORD_LIFE`]: super::timing::RECORD_LIFE
macro_rules! record_node_set {
    () => {
        concat!(
            "local keep = ",
            record_life!(),
            r#" * math.max(tonumber(ARGV[2]), max_ttl_before)
redis.call('SET', KEYS[5], ARGV[5] .. '@' .. keep, 'PX', keep)
"#
        )
    };
}

/// Try to take the lock, prove the node's data age, and on a grant store the candidate
/// fencing token if the counter is lower.
///
/// A held key is answered with its holder and remaining ttl, and the node-set record, without
/// any proof (a standby's round costs no `INFO`). A free key whose node-set record belongs to
/// another node set is not granted (`granted` −1): contenders on different servers must not
/// both lead (see `votes`, rule 7), unless it is the record ARGV[6] names and is at least
/// ARGV[7] ms old: one the contender judged, in an earlier round, to predate a restart of its
/// servers (`votes::NodeSet::explains`); then it is replaced (the grant answers with the
/// record it replaced). A record is stored as
/// `fingerprint@life_ms`, so that its age (life − `PTTL`) can be told; it is answered with
/// that age (−1 when it is ours, or has no life).
///
/// The lock key is not re-read when missing: `SET NX` refuses a key of another type, and the
/// `GET` after it then fails as a read would have.
///
/// Returns `{granted, fence, epoch_age_ms, max_ttl_ms, candidate_stored, holder_value,
/// holder_pttl, node_set, node_set_age_ms}`, where `fence` is the counter and `max_ttl_ms` the register before
/// this call; `epoch_age_ms` is −1 when no proof was made, −2 when the node cannot give one.
pub const ACQUIRE: &str = concat!(
    read_keys!("2"),
    r#"
local record = keys[5] or ''
local record_set = string.match(record, '^[^@]*')
local foreign = record ~= '' and record_set ~= ARGV[5]
local record_age = -1
if foreign then
  local life = tonumber(string.match(record, '@(%d+)$') or '')
  if life then record_age = life - redis.call('PTTL', KEYS[5]) end
end
if keys[1] then
  return {0, fence, -1, max_ttl_before, 0, keys[1], redis.call('PTTL', KEYS[1]), record, record_age}
end
if foreign and not (ARGV[6] ~= '' and record_set == ARGV[6]
    and record_age >= tonumber(ARGV[7])) then
  return {-1, fence, -1, max_ttl_before, 0, '', 0, record, record_age}
end
local age
"#,
    epoch_age!(),
    r#"
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('GET', KEYS[1])
end
"#,
    keep_fence!("ARGV[3]", "ARGV[3]"),
    record_ttl!(),
    record_node_set!(),
    r#"
return {1, fence, age, max_ttl_before, stored, '', 0, record, record_age}
"#
);

/// Raise the fencing counter to ARGV[3] if it is lower (a max-register; never lowers it).
/// The slow path of minting a token, when the candidate was not stored on a quorum.
///
/// Returns the counter before the call: the token is ours on this node only if that was lower.
pub const RAISE_FENCE: &str = concat!(
    r#"
local before = redis.call('GET', KEYS[2]) or '0'
local fence = tonumber(before) or 0
"#,
    keep_fence!("ARGV[3]", "string.format('%d', want)"),
    "return before\n"
);

/// [`EXTEND`]'s usual case: our key stands and no proof is asked for (`ARGV[6]` is not `1`):
/// the owner-checked `PEXPIRE` with one `MGET` of two keys (ours and the refresh marker) in
/// place of the `GET`; the max-ttl register and the node-set record are refreshed only when
/// due. Answers an integer, not an array (cheaper for the node to build): the register when
/// it was read, else 0 (no news: while our key stands here only we write the register).
/// Returns from the script (or the function) in that case; falls through otherwise.
///
/// Due means the refresh marker does not hold our fingerprint (it is gone, or a node of our
/// set restarted: the holder's record must replace the old one at once, see `votes`, rule 7).
/// The refresh rewrites the register (where it is not longer than our ttl; a longer one with
/// less than our ttl left is kept, at its value, as [`record_ttl`] keeps it) and the record
/// (for `RECORD_LIFE` times the longest ttl), then writes the marker with our fingerprint, to
/// vanish at most `RECORD_LIFE − 1` ttls later and one ttl before the register does. So while
/// it stands, the register and the record outlive the key this renewal extends, and the record
/// holds our fingerprint. Every write of the register or the record only moves its expiry
/// later, and a record that changed hands means our key was granted again (which rewrote it),
/// so a marker left by an earlier holder is as good as our own. The marker saves reading the
/// register, the record and the register's `PTTL` on every renewal (0.3× the classic renewal).
macro_rules! extend_usual {
    () => {
        concat!(
            r#"
local ttl = tonumber(ARGV[2])
local held = redis.call('MGET', KEYS[1], KEYS[6])
local ours = held[1] == ARGV[1]
if ours and ARGV[6] ~= '1' then
  if held[2] == ARGV[5] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return 0
  end
  local register = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
  if register <= ttl then
    redis.call('SET', KEYS[3], ARGV[2], 'PX', "#,
            record_life!(),
            r#" * ttl)
  elseif redis.call('PTTL', KEYS[3]) < ttl then
    redis.call('PEXPIRE', KEYS[3], "#,
            record_life!(),
            r#" * ttl)
  end
  local keep = "#,
            record_life!(),
            r#" * math.max(register, ttl)
  redis.call('SET', KEYS[5], ARGV[5] .. '@' .. keep, 'PX', keep)
  local life = math.min(("#,
            record_life!(),
            r#" - 1) * ttl, redis.call('PTTL', KEYS[3]) - ttl)
  if life > 0 then
    redis.call('SET', KEYS[6], ARGV[5], 'PX', life)
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return register
end
"#
        )
    };
}

/// [`EXTEND`] once the data age is proven (`age`, `keys`): the register, our key, the fencing
/// counter and the node-set record, and the answer.
macro_rules! extend_proven {
    () => {
        concat!(
            record_ttl!(),
            r#"
if ours then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
"#,
            keep_fence!("ARGV[3]", "string.format('%d', want)"),
            record_node_set!(),
            r#"
  return {1, age, max_ttl_before}
end
if keys[1] then return {0, age, max_ttl_before} end
return {-1, age, max_ttl_before}
"#
        )
    };
}

/// Extend our own lock. Where our key stands, a renewal is the classic owner-checked one
/// (`if GET == value then PEXPIRE`) with one `MGET` of two keys in place of the `GET`, and
/// refreshes what outlives the key only when it is due:
/// - the max-ttl register and our node-set record, which live [`RECORD_LIFE`] times the
///   longest ttl, when the refresh marker does not hold our fingerprint (see `extend_usual!`):
///   about once in `3 × (RECORD_LIFE − 1)` renewals, and at once where a node of our set
///   restarted (the holder's record replaces the old one, see `votes`, rule 7);
/// - everything (the fencing counter kept at least at our token and for the fence retention,
///   the register, the record, and the proof of the node's data age from its `INFO`) when the
///   client asks for it (ARGV[6] = `1`: once in `PROOF_EVERY` renewals, see
///   `Redlock::extend`) and wherever our key does not stand.
///
/// Extend votes need no data-age proof (a node that lost our key says so): the proof only keeps
/// a leader's view of node health current and lets a node whose lineage changed under our key
/// start aging while the lock is held (the next acquire round would stamp it otherwise).
///
/// The ttl register is written whatever the key's state: a node that lost our key (and the
/// register with it) learns our ttl again from the live holder, so a contender with a shorter
/// ttl does not count that node too early.
///
/// Returns an integer in the usual case (see `extend_usual!`), else `{status, epoch_age_ms,
/// max_ttl_ms}` (see `round::extend::RawExtendReply`): status 1 if extended, 0 if another
/// holder has the key, -1 if the key is gone (expired, or the node lost it); `epoch_age_ms` −1 when no
/// proof was made; `max_ttl_ms` the register before this call.
///
/// [`RECORD_LIFE`]: super::timing::RECORD_LIFE
pub const EXTEND: &str = concat!(
    extend_usual!(),
    read_keys!("1"),
    "local age\n",
    epoch_age!(),
    extend_proven!()
);

/// Put our key back on a node that lost it, only if nobody else has it there, with our
/// node-set record (replacing another's, as a renewal does).
///
/// Used only while a valid quorum is held elsewhere.
pub const RESTORE: &str = concat!(
    r#"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
"#,
    read_keys!("2"),
    keep_fence!("ARGV[3]", "string.format('%d', want)"),
    record_ttl!(),
    record_node_set!(),
    r#"
  return 1
end
return 0
"#
);

/// Delete our own lock and announce it, so waiters retry at once. The node-set record goes
/// with the key: where our key stood, the record is ours (only a grant, a renewal or a restore
/// writes it, each beside our key), and a released lock has no holder for it to protect. Left
/// standing, a record that names a server as it was before a restart kept contenders that
/// reach the restarted server out for up to `RECORD_LIFE` ttls after a clean release.
///
/// ARGV: value, release channel. Returns 1 if deleted, 0 if it was not ours.
pub const RELEASE: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[5])
  redis.call('PUBLISH', ARGV[2], ARGV[1])
  return 1
end
return 0
"#;

/// Delete our own key without announcing it: the clean-up after a lost round, which must
/// not wake the waiters (the lock is still held by someone else). Where no lock key is left,
/// the round's node-set record goes too: a lost round leaves no record behind, so contenders
/// whose fingerprints differ cannot keep each other out by refreshing theirs (only a holder's
/// record outlives its round, for at most `RECORD_LIFE` times the ttl after its last renewal).
///
/// ARGV: value, node-set fingerprint. Returns 1 if the key was deleted, 0 if it was not ours.
pub const CLEANUP: &str = r#"
local deleted = 0
local value = redis.call('GET', KEYS[1])
if value == ARGV[1] then
  redis.call('DEL', KEYS[1])
  deleted = 1
end
if (deleted == 1 or not value)
    and string.match(redis.call('GET', KEYS[5]) or '', '^[^@]*') == ARGV[2] then
  redis.call('DEL', KEYS[5])
end
return deleted
"#;

/// Record that a schedule slot ran (`guard --slot`), only while we hold the lock here: the
/// record is written by the holder whose CMD exited 0, before it releases.
///
/// Keys of its own: `KEYS[1]` the lock key, `KEYS[2]` the slot's record (same hash tag).
/// ARGV: value, fencing token, retention in ms. Returns 1 if written, 0 if the lock here is
/// not ours.
pub const RECORD_SLOT: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"#;

/// Read who holds the lock. Returns `{holder_value, pttl, fence}`.
pub const READ: &str = r#"
return {redis.call('GET', KEYS[1]) or '', redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[2]) or '0'}
"#;

/// Which commands the engine needs may this connection's ACL user not run? Asked by `check` and
/// at startup; it writes nothing. `redis.acl_check_cmd` (Redis 7+, Valkey) checks each command
/// with the lock's own keys and release channel (ARGV[1]). Reached through `EVALSHA` and
/// `SCRIPT LOAD` like every script, so a user who may not run scripts gets `NOPERM` instead.
///
/// Returns `{essential, optional, checked}`: the denied commands that stop every vote (a
/// grant or renewal could not run), those that only slow hand-overs (the release announcement)
/// or keep candidates from ranking themselves (the presence hash),
/// and 0 when the server cannot tell (no `acl_check_cmd`).
pub const PROBE: &str = r#"
if not redis.acl_check_cmd then return {{}, {}, 0} end
local essential, optional = {}, {}
local function need(list, ...)
  local ok, allowed = pcall(redis.acl_check_cmd, ...)
  if not ok or not allowed then table.insert(list, table.concat({...}, ' ')) end
end
need(essential, 'info', 'server')
need(essential, 'info', 'replication')
need(essential, 'info', 'memory')
need(essential, 'evalsha', '0000000000000000000000000000000000000000', '0')
need(essential, 'script', 'load', 'return 1')
for i = 1, #KEYS do
  need(essential, 'get', KEYS[i])
  need(essential, 'set', KEYS[i], 'v', 'PX', '1')
  need(essential, 'pttl', KEYS[i])
  need(essential, 'pexpire', KEYS[i], '1')
end
need(essential, 'del', KEYS[1])
need(optional, 'publish', ARGV[1], 'v')
need(optional, 'subscribe', ARGV[1])
-- The candidates' presence (`candidacy::presence`), in a hash beside the lock.
need(optional, 'time')
need(optional, 'hset', KEYS[1], 'f', 'v')
need(optional, 'hgetall', KEYS[1])
need(optional, 'hdel', KEYS[1], 'f')
need(optional, 'multi')
need(optional, 'exec')
return {essential, optional, 1}
"#;

/// Cluster mode: stamps the epoch markers of many slots this master serves, named in
/// `ARGV[1..n-1]` (not declared as keys: they are in many slots, which only a script flagged
/// `allow-cross-slot-keys` may touch, Redis 7+), with the server's lineage, where a marker is
/// missing or names another lineage. A marker of the current lineage is left to age.
///
/// Returns how many markers it stamped, or −1 when `INFO` shows no lineage.
pub const STAMP_SLOTS: &str = concat!(
    "#!lua flags=allow-cross-slot-keys\n",
    read_lineage!(),
    r#"
if run_id == '' or replid == '' then return -1 end
local lineage = run_id .. ':' .. replid .. ':' .. ARGV[#ARGV]
local stamped = 0
for i = 1, #ARGV - 1 do
  if redis.call('GET', ARGV[i]) ~= lineage then
    redis.call('SET', ARGV[i], lineage, 'PX', 1000000000000)
    stamped = stamped + 1
  end
end
return stamped
"#
);

/// [`EXTEND`] for many locks in one call: the renewals of every lock a process holds on one
/// node go out together (see `batch`). Built from the same pieces as [`EXTEND`], run once per
/// lock over that lock's own six keys and six arguments, so each lock gets exactly the
/// answer [`EXTEND`] would give it: both are built from `extend_usual!` and `extend_proven!`.
///
/// The server's lineage (`INFO`) is read at most once for all of them, and only if a lock
/// needs the proof.
///
/// KEYS: six per lock, in [`EXTEND`]'s order. ARGV: six per lock, in [`EXTEND`]'s order,
/// then the database index. Returns one `{status, epoch_age_ms, max_ttl_ms}` per lock.
pub const EXTEND_MANY: &str = concat!(
    r#"
local run_id, replid
local function read_lineage_once()
"#,
    read_lineage!(),
    r#"
  return run_id, replid
end
local function extend_one(KEYS, ARGV)
"#,
    extend_usual!(),
    read_keys!("1"),
    r#"
local age
if run_id == nil then run_id, replid = read_lineage_once() end
"#,
    lineage_age!(),
    extend_proven!(),
    r#"
end
local db = ARGV[#ARGV]
local replies = {}
for i = 0, #KEYS / 6 - 1 do
  local k, a = {}, {}
  for j = 1, 6 do
    k[j] = KEYS[i * 6 + j]
  end
  for j = 1, 6 do
    a[j] = ARGV[i * 6 + j]
  end
  a[7] = db
  replies[i + 1] = extend_one(k, a)
end
return replies
"#
);

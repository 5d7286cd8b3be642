"""The Lua scripts Redis runs atomically for the gateway (docs/cluster.md §2-3).

Numbers are printed with `%d`: Lua 5.1 holds them as doubles and `tostring` would write 1e+15.
"""

from __future__ import annotations

#: The cluster-wide topic bound, shared by PUBLISH and TOUCH when they would create a topic (KEYS[3] the
#: topics' sorted set, `now` and `ttl` in seconds, `max` 0 for none): members whose meta expired (last
#: publish or creation older than the ttl) leave the set first, so it counts the topics Redis holds.
#: Returns true when there is room. On Redis Cluster there is no KEYS[3] (a script touches its topic's slot
#: only): the node checked the bound (topic_directory.py) and passes `max` 0 for room, -1 for none.
_ROOM = r"""
local function room(topics, now, ttl, max)
  if tonumber(max) == 0 then return true end
  if tonumber(max) < 0 then return false end
  redis.call('ZREMRANGEBYSCORE', topics, '-inf', tonumber(now) - tonumber(ttl))
  return redis.call('ZCARD', topics) < tonumber(max)
end
"""

#: KEYS: meta, stream, topics (not on Redis Cluster: `_ROOM`). ARGV: 1 epoch if new, 2 data (JSON), 3 kind,
#: 4 capacity, 5 settings (JSON),
#: 6 ttl seconds, 7 channel, 8 explicit seq or "", 9 now (score), 10 topic name, 11 "1" when the publisher
#: may create the topic, 12 the cluster-wide topic bound (broker.max_topics, 0: none).
#: Returns {status, epoch, seq, created}: status 0 published at seq (created 1 when this publish made the
#: topic); -1 the explicit seq is below the next one (it landed); -2 it is above the next one; -3 no such
#: topic and the publisher may create none; -4 no such topic and the cluster holds its bound. A new epoch
#: empties the stream left from an older one.
PUBLISH = (
    _ROOM
    + r"""
local epoch = redis.call('HGET', KEYS[1], 'e')
local created = 0
if not epoch then
  if ARGV[11] ~= '1' then return {-3, '', 0, 0} end
  if not room(KEYS[3], ARGV[9], ARGV[6], ARGV[12]) then return {-4, '', 0, 0} end
  created = 1
  epoch = ARGV[1]
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[1], 'e', epoch, 'n', 0, 'k', ARGV[3], 'cap', ARGV[4], 'c', ARGV[5])
end
local meta = redis.call('HMGET', KEYS[1], 'n', 'k', 'cap')
local seq = tonumber(meta[1])
if ARGV[8] ~= '' then
  local want = tonumber(ARGV[8])
  if want < seq then return {-1, epoch, seq, created} end
  if want > seq then return {-2, epoch, seq, created} end
end
redis.call('HSET', KEYS[1], 'n', seq + 1)
local s = string.format('%d', seq)
if meta[2] == 'snapshot' then
  redis.call('HSET', KEYS[1], 'v', ARGV[2])
else
  redis.call('XADD', KEYS[2], 'MAXLEN', meta[3], s .. '-1', 'd', ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[6])
end
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('PUBLISH', ARGV[7], epoch .. ' ' .. s .. ' ' .. ARGV[2])
if KEYS[3] then redis.call('ZADD', KEYS[3], ARGV[9], ARGV[10]) end
return {0, epoch, seq, created}
"""
)

#: KEYS: meta, stream, topics (not on Redis Cluster). ARGV: 1 epoch if new, 2 kind, 3 capacity, 4 settings (JSON), 5 ttl seconds,
#: 6 "1" to refuse an existing topic (admin create), 7 first stream id to read ("-" for all), 8 now,
#: 9 topic name, 10 "1" when the caller may create the topic, 11 the cluster-wide topic bound (0: none).
#: Returns {created, epoch, next seq, settings, last value or false, entries}: one consistent view of the
#: topic's meta and history (entries: {{id, {'d', data}}, ...} from ARGV[7] on; none for snapshots);
#: {-1, epoch} when it exists and ARGV[6] is "1"; {-2, ''} when it does not and the caller may create none;
#: {-3, ''} when it does not and the cluster holds its bound.
TOUCH = (
    _ROOM
    + r"""
local epoch = redis.call('HGET', KEYS[1], 'e')
local created = 0
if epoch then
  if ARGV[6] == '1' then return {-1, epoch} end
else
  if ARGV[10] ~= '1' then return {-2, ''} end
  if not room(KEYS[3], ARGV[8], ARGV[5], ARGV[11]) then return {-3, ''} end
  epoch = ARGV[1]
  created = 1
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[1], 'e', epoch, 'n', 0, 'k', ARGV[2], 'cap', ARGV[3], 'c', ARGV[4])
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  if KEYS[3] then redis.call('ZADD', KEYS[3], ARGV[8], ARGV[9]) end
end
local meta = redis.call('HMGET', KEYS[1], 'n', 'k', 'c', 'v')
local entries = {}
if meta[2] ~= 'snapshot' then
  entries = redis.call('XRANGE', KEYS[2], ARGV[7], '+')
end
return {created, epoch, tonumber(meta[1]), meta[3], meta[4], entries}
"""
)

#: A Redis that went back in time (restored from an older snapshot, failed over to a replica that lagged):
#: a node saw the topic at epoch ARGV[2] up to seq ARGV[3] - 1, and Redis's next seq is below that, so its
#: seqs would be given again to other messages. KEYS: meta, stream. ARGV: 1 the new epoch, 2 the node's epoch,
#: 3 the node's next seq, 4 channel. When Redis holds that epoch behind ARGV[3], the topic starts the new
#: epoch at ARGV[3] (the old epoch's stream goes: its seqs are ambiguous) and every node is told on the
#: channel (`! epoch`); returns 1. Otherwise (another epoch already, or not behind) 0.
REWIND = r"""
local meta = redis.call('HMGET', KEYS[1], 'e', 'n')
if meta[1] ~= ARGV[2] or tonumber(meta[2]) >= tonumber(ARGV[3]) then return 0 end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], 'e', ARGV[1], 'n', ARGV[3])
redis.call('HDEL', KEYS[1], 'v')
redis.call('PUBLISH', ARGV[4], '! epoch')
return 1
"""

#: KEYS: meta, stream, topics (not on Redis Cluster). ARGV: 1 channel, 2 topic name. Returns 1 when the topic existed.
DELETE = r"""
local existed = redis.call('DEL', KEYS[1], KEYS[2])
if KEYS[3] then redis.call('ZREM', KEYS[3], ARGV[2]) end
redis.call('PUBLISH', ARGV[1], '! deleted')
return existed > 0 and 1 or 0
"""

# -- private queues (docs/cluster.md §8): KEYS 1 the queue's hash (`e` epoch, `n` next seq, `b` bytes queued,
# `h` the node holding it), 2 its list (one element per queued message: its data, JSON; the head's seq is
# n - LLEN). Both get EXPIRE ttl at every use.

#: ARGV: 1 epoch if new, 2 ttl, 3 channel, 4 node id. Creates the queue when missing, records this node as
#: its holder and tells the previous holder (`t NODE` on the channel: it closes its handle, `taken_over`).
#: Returns {epoch, first seq queued, entries}.
QUEUE_ATTACH = r"""
local e = redis.call('HGET', KEYS[1], 'e')
if not e then
  e = ARGV[1]
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[1], 'e', e, 'n', 0, 'b', 0)
end
redis.call('HSET', KEYS[1], 'h', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
local n = tonumber(redis.call('HGET', KEYS[1], 'n'))
local len = redis.call('LLEN', KEYS[2])
redis.call('PUBLISH', ARGV[3], 't ' .. ARGV[4])
return {e, n - len, redis.call('LRANGE', KEYS[2], 0, -1)}
"""

#: ARGV: 1 max_count, 2 max_bytes, 3 ttl, 4 channel, then (explicit seq or "", data) pairs. Appends the
#: messages in order while there is room, each at the next seq, and stops at the first it cannot take.
#: Returns {status, appended, first seq given, next seq}: status 0 all appended; -1 the next one's explicit
#: seq is below the next seq (it landed); -2 above it; -3 the queue is full; -4 there is no queue.
#: Announces `n NEXT` on the channel when it appended (the holder pulls).
QUEUE_PUSH = r"""
local e = redis.call('HGET', KEYS[1], 'e')
if not e then return {-4, 0, 0, 0} end
local n = tonumber(redis.call('HGET', KEYS[1], 'n'))
local b = tonumber(redis.call('HGET', KEYS[1], 'b'))
local len = redis.call('LLEN', KEYS[2])
local maxc = tonumber(ARGV[1])
local maxb = tonumber(ARGV[2])
local first = n
local status = 0
local done = 0
for i = 5, #ARGV, 2 do
  local want = ARGV[i]
  local data = ARGV[i + 1]
  if want ~= '' and tonumber(want) < n then status = -1 break end
  if want ~= '' and tonumber(want) > n then status = -2 break end
  if len >= maxc or (len > 0 and b + #data > maxb) then status = -3 break end
  redis.call('RPUSH', KEYS[2], data)
  len = len + 1
  b = b + #data
  n = n + 1
  done = done + 1
end
if done > 0 then
  redis.call('HSET', KEYS[1], 'n', n, 'b', b)
  redis.call('PUBLISH', ARGV[4], 'n ' .. string.format('%d', n))
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return {status, done, first, n}
"""

#: ARGV: 1 first seq wanted, 2 at most this many. Returns {epoch, seq of the first entry returned, entries,
#: next seq} ({} when there is no queue).
QUEUE_READ = r"""
local e = redis.call('HGET', KEYS[1], 'e')
if not e then return {} end
local n = tonumber(redis.call('HGET', KEYS[1], 'n'))
local len = redis.call('LLEN', KEYS[2])
local first = n - len
local from = tonumber(ARGV[1])
if from < first then from = first end
local idx = from - first
return {e, from, redis.call('LRANGE', KEYS[2], idx, idx + tonumber(ARGV[2]) - 1), n}
"""

#: ARGV: 1 epoch, 2 next seq, 3 ttl, 4 node id. Makes a held queue again, empty, in its epoch at its holder's
#: local end, when Redis lost it (restarted empty); the holder keeps what it pulled. Returns 1 when made, 0
#: when the queue exists (made meanwhile).
QUEUE_RESTORE = r"""
if redis.call('HGET', KEYS[1], 'e') then return 0 end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], 'e', ARGV[1], 'n', ARGV[2], 'b', 0, 'h', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""

#: ARGV: 1 every seq below this was committed, 2 ttl, 3 epoch of the queue acknowledged. Removes those
#: entries and their bytes (idempotent). Returns how many left.
QUEUE_ACK = r"""
local meta = redis.call('HMGET', KEYS[1], 'e', 'n')
if meta[1] ~= ARGV[3] then return 0 end
local n = tonumber(meta[2])
local len = redis.call('LLEN', KEYS[2])
local k = tonumber(ARGV[1]) - (n - len)
if k <= 0 then return 0 end
if k > len then k = len end
local freed = 0
for _, v in ipairs(redis.call('LRANGE', KEYS[2], 0, k - 1)) do freed = freed + #v end
redis.call('LTRIM', KEYS[2], k, -1)
redis.call('HINCRBY', KEYS[1], 'b', -freed)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return k
"""

#: ARGV: 1 node id. Removes the queue if this node holds it (an explicit unsubscribe). Returns 1 if removed.
QUEUE_DELETE = r"""
if redis.call('HGET', KEYS[1], 'h') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""

#: ARGV: 1 epoch, 2 floor (the holder's local end, or the highest next seq announced to it), 3 ttl, 4 node
#: id. A Redis behind the holder (a promoted replica that lacked pushes, an older snapshot): the queue's next
#: seq in the same epoch is below the floor, so it would give seqs the holder has to other messages. The
#: queue goes on at the floor, empty (what it held below the floor, the holder pulled). Returns the next seq
#: Redis had when it was behind, else -1 (not behind, another epoch, or no queue).
QUEUE_REWIND = r"""
local meta = redis.call('HMGET', KEYS[1], 'e', 'n')
if meta[1] ~= ARGV[1] or tonumber(meta[2]) >= tonumber(ARGV[2]) then return -1 end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], 'n', ARGV[2], 'b', 0, 'h', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return tonumber(meta[2])
"""


#: The scripts every node loads at each connect.
NAMES = (
    "PUBLISH",
    "TOUCH",
    "DELETE",
    "REWIND",
    "QUEUE_ATTACH",
    "QUEUE_PUSH",
    "QUEUE_READ",
    "QUEUE_ACK",
    "QUEUE_DELETE",
    "QUEUE_RESTORE",
    "QUEUE_REWIND",
)


def source(name: str, sharded: bool) -> str:
    """The text of script `name`; `sharded` (Redis Cluster): its channel messages go by sharded pub/sub
    (SPUBLISH: to the subscribers of the channel's shard only, not relayed over every shard)."""
    text: str = globals()[name]
    return text.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',") if sharded else text

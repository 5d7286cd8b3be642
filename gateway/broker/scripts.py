"""The Lua scripts Redis runs atomically for the gateway (docs/cluster.md §2-3).

Numbers are printed with `%d`: Lua 5.1 holds them as doubles and `tostring` would write 1e+15.
"""

from __future__ import annotations

#: KEYS: meta, stream, topics. ARGV: 1 epoch if new, 2 data (JSON), 3 kind, 4 capacity, 5 settings (JSON),
#: 6 ttl seconds, 7 channel, 8 explicit seq or "", 9 now (score), 10 topic name.
#: Returns {status, epoch, seq}: status 0 published at seq; -1 the explicit seq is below the next one
#: (it landed); -2 it is above the next one. A new epoch empties the stream left from an older one.
PUBLISH = r"""
local epoch = redis.call('HGET', KEYS[1], 'e')
if not epoch then
  epoch = ARGV[1]
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[1], 'e', epoch, 'n', 0, 'k', ARGV[3], 'cap', ARGV[4], 'c', ARGV[5])
end
local meta = redis.call('HMGET', KEYS[1], 'n', 'k', 'cap')
local seq = tonumber(meta[1])
if ARGV[8] ~= '' then
  local want = tonumber(ARGV[8])
  if want < seq then return {-1, epoch, seq} end
  if want > seq then return {-2, epoch, seq} end
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
redis.call('ZADD', KEYS[3], ARGV[9], ARGV[10])
return {0, epoch, seq}
"""

#: KEYS: meta, stream, topics. ARGV: 1 epoch if new, 2 kind, 3 capacity, 4 settings (JSON), 5 ttl seconds,
#: 6 "1" to refuse an existing topic (admin create), 7 first stream id to read ("-" for all), 8 now,
#: 9 topic name.
#: Returns {created, epoch, next seq, settings, last value or false, entries}: one consistent view of the
#: topic's meta and history (entries: {{id, {'d', data}}, ...} from ARGV[7] on; none for snapshots).
TOUCH = r"""
local epoch = redis.call('HGET', KEYS[1], 'e')
local created = 0
if epoch then
  if ARGV[6] == '1' then return {-1, epoch} end
else
  epoch = ARGV[1]
  created = 1
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[1], 'e', epoch, 'n', 0, 'k', ARGV[2], 'cap', ARGV[3], 'c', ARGV[4])
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  redis.call('ZADD', KEYS[3], ARGV[8], ARGV[9])
end
local meta = redis.call('HMGET', KEYS[1], 'n', 'k', 'c', 'v')
local entries = {}
if meta[2] ~= 'snapshot' then
  entries = redis.call('XRANGE', KEYS[2], ARGV[7], '+')
end
return {created, epoch, tonumber(meta[1]), meta[3], meta[4], entries}
"""

#: KEYS: meta, stream, topics. ARGV: 1 channel, 2 topic name. Returns 1 when the topic existed.
DELETE = r"""
local existed = redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('PUBLISH', ARGV[1], '! deleted')
return existed > 0 and 1 or 0
"""

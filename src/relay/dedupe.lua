-- Idempotent publish of one stream's share of a batch (outbox.dedupe = on).
-- KEYS[1]  the stream
-- KEYS[2]  the stream's marker set: a sorted set of event ids, scored by when they were added
-- ARGV[1]  MAXLEN ~ bound, 0 for none
-- ARGV[2]  marker lifetime in milliseconds
-- ARGV[3]  the relay's clock, in milliseconds
-- ARGV[4..] four fields per event, in id order: id, topic, payload, created_at
-- Returns one {1, entry id} or {0, error} per event. An event already in the marker set was added
-- by an earlier attempt whose transaction never committed: it is not added again.
local maxlen = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local events = (#ARGV - 3) / 4
-- Commands take their arguments in slices, few enough for Lua's unpack.
local slice = 500

local seen = {}
for first = 1, events, slice do
  local ids = {}
  for e = first, math.min(first + slice - 1, events) do
    ids[#ids + 1] = ARGV[4 + (e - 1) * 4]
  end
  local scores = redis.call('ZMSCORE', KEYS[2], unpack(ids))
  for i = 1, #scores do
    seen[first + i - 1] = scores[i]
  end
end

local out = {}
local added = {}
for e = 1, events do
  local a = 4 + (e - 1) * 4
  if seen[e] then
    out[e] = {1, 'already published'}
  else
    local entry
    if maxlen > 0 then
      entry = redis.pcall('XADD', KEYS[1], 'MAXLEN', '~', maxlen, '*', 'id', ARGV[a],
        'topic', ARGV[a + 1], 'payload', ARGV[a + 2], 'created_at', ARGV[a + 3])
    else
      entry = redis.pcall('XADD', KEYS[1], '*', 'id', ARGV[a],
        'topic', ARGV[a + 1], 'payload', ARGV[a + 2], 'created_at', ARGV[a + 3])
    end
    if type(entry) == 'table' and entry.err then
      out[e] = {0, entry.err}
    else
      added[#added + 1] = now
      added[#added + 1] = ARGV[a]
      out[e] = {1, entry}
    end
  end
end

for first = 1, #added, 2 * slice do
  redis.call('ZADD', KEYS[2], unpack(added, first, math.min(first + 2 * slice - 1, #added)))
end
-- Markers left by a crash expire: old members are trimmed whenever the stream is published
-- to, and the whole set disappears once the stream has been quiet for the lifetime.
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
return out

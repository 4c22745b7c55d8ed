-- Idempotent publish of one stream's share of a batch (outbox.dedupe = on).
--
-- The events come in runs of consecutive ids that share a marker shard; each shard has a marker
-- hash (event id -> "<stream entry id>|<created_at>") per period, and the previous period's is
-- still consulted. An event is known by its id and its created_at together: ids can be used
-- again (TRUNCATE ... RESTART IDENTITY, setval, a restore), and a marker left by an earlier
-- event with the same id must not swallow a new one.
-- KEYS[1]             the stream
-- KEYS[2s], KEYS[2s+1] run s's marker hash of the current period, and of the period before
-- ARGV[1]             MAXLEN ~ bound, 0 for none
-- ARGV[2]             when the current period's hashes expire, in Unix milliseconds
-- ARGV[3 .. 2+r]      the number of events in each of the r runs
-- then                the n event ids, in order
-- then                five fields per event: topic, payload, created_at, key, headers; the last
--                     two empty when the event has none, else their value after a '='
-- Returns one reply per event, in order: its stream entry id, or the error XADD gave for it
-- after a '!' (a string, not an error reply: a cluster client would fail the whole reply). An
-- event with a marker was added by an earlier attempt whose transaction never committed: it is
-- not added again, and the entry id that attempt recorded is returned.
local maxlen = tonumber(ARGV[1])
local expires_at = ARGV[2]
local runs = (#KEYS - 1) / 2
local n = (#ARGV - 2 - runs) / 6
local stream = KEYS[1]
local xadd = redis.pcall

-- The entry id a marker records for the event created at `stamp`, or nil.
local function entry_of(marker, stamp)
  if not marker then return nil end
  local bar = string.find(marker, '|', 1, true)
  if bar and string.sub(marker, bar + 1) == stamp then
    return string.sub(marker, 1, bar - 1)
  end
  return nil
end

local out = {}
local e = 0                    -- events done
local id_at = 3 + runs         -- ARGV index of the next id
local field_at = id_at + n     -- ARGV index of the next event's topic
for r = 1, runs do
  local count = tonumber(ARGV[2 + r])
  local current, previous = KEYS[2 * r], KEYS[2 * r + 1]
  local last_id = id_at + count - 1
  local seen = redis.call('HMGET', current, unpack(ARGV, id_at, last_id))
  local older = {}
  if redis.call('EXISTS', previous) == 1 then
    older = redis.call('HMGET', previous, unpack(ARGV, id_at, last_id))
  end
  local added = {}
  local k = 0
  for i = 1, count do
    local id = ARGV[id_at + i - 1]
    local stamp = ARGV[field_at + 2]
    local known = entry_of(seen[i], stamp) or entry_of(older[i], stamp)
    e = e + 1
    if known then
      out[e] = known
    else
      local entry
      local key, headers = ARGV[field_at + 3], ARGV[field_at + 4]
      if key ~= '' or headers ~= '' then
        local args = {'XADD', stream}
        if maxlen > 0 then
          args[3], args[4], args[5] = 'MAXLEN', '~', maxlen
        end
        local a = #args
        args[a + 1], args[a + 2], args[a + 3], args[a + 4] = '*', 'id', id, 'topic'
        args[a + 5], args[a + 6] = ARGV[field_at], 'payload'
        args[a + 7], args[a + 8] = ARGV[field_at + 1], 'created_at'
        args[a + 9] = ARGV[field_at + 2]
        a = a + 9
        if key ~= '' then
          args[a + 1], args[a + 2] = 'key', string.sub(key, 2)
          a = a + 2
        end
        if headers ~= '' then
          args[a + 1], args[a + 2] = 'headers', string.sub(headers, 2)
        end
        entry = xadd(unpack(args))
      elseif maxlen > 0 then
        entry = xadd('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'id', id, 'topic',
          ARGV[field_at], 'payload', ARGV[field_at + 1], 'created_at', ARGV[field_at + 2])
      else
        entry = xadd('XADD', stream, '*', 'id', id, 'topic',
          ARGV[field_at], 'payload', ARGV[field_at + 1], 'created_at', ARGV[field_at + 2])
      end
      if type(entry) == 'table' and entry.err then
        out[e] = '!' .. entry.err
      else
        out[e] = entry
      end
      if type(entry) == 'string' then
        added[k + 1] = id
        added[k + 2] = entry .. '|' .. stamp
        k = k + 2
      end
    end
    field_at = field_at + 5
  end
  if k > 0 then
    redis.call('HSET', current, unpack(added))
    -- Markers left by a crash go with their period's hash.
    redis.call('PEXPIREAT', current, expires_at)
  end
  id_at = last_id + 1
end
return out

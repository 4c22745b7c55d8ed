-- Idempotent publish of one stream's share of a batch (outbox.dedupe = on).
--
-- The events come in runs of consecutive ids that share a marker shard; each shard has a marker
-- hash (event id -> "<stream entry id>|<created_at>") per period, and the previous period's is
-- still consulted. An event is known by its id and its created_at together: ids can be used
-- again (TRUNCATE ... RESTART IDENTITY, setval, a restore), and a marker left by an earlier
-- event with the same id must not swallow a new one.
--
-- The script runs for every event the relay publishes, so its arguments are lean: what all the
-- events share (their topic) comes once, and a key or headers only for the events that have
-- them.
-- KEYS[1]             the stream
-- KEYS[2s], KEYS[2s+1] run s's marker hash of the current period, and of the period before
-- ARGV[1]             MAXLEN ~ bound, 0 for none
-- ARGV[2]             when the current period's hashes expire, in Unix milliseconds
-- ARGV[3]             the events' topic
-- ARGV[4]             one character per event: '-' for neither key nor headers, 'k' for a
--                     key, 'h' for headers, 'b' for both
-- ARGV[5 .. 4+r]      the number of events in each of the r runs
-- then                the n event ids, in order
-- then                per event: its payload and created_at, then its key and its headers if
--                     it has them
-- Returns the events XADD refused: pairs of the event's position (from 1) and the error text
-- (a string, not an error reply: a cluster client would fail the whole reply); an empty array
-- when every event is in the stream. An event with a marker was added by an earlier attempt
-- whose transaction never committed: it is not added again.
local maxlen = tonumber(ARGV[1])
local expires_at = ARGV[2]
local topic = ARGV[3]
local shapes = ARGV[4]
local runs = (#KEYS - 1) / 2
local stream = KEYS[1]
local xadd = redis.pcall
local KEY, HEADERS, BOTH = string.byte('k'), string.byte('h'), string.byte('b')

-- Whether a marker stands for the event created at `stamp`.
local function marks(marker, stamp)
  if not marker then return false end
  local bar = string.find(marker, '|', 1, true)
  return bar ~= nil and string.sub(marker, bar + 1) == stamp
end

local n = 0
for r = 1, runs do
  n = n + tonumber(ARGV[4 + r])
end
local refused = {}
local f = 0                    -- refused entries written
local e = 0                    -- events done
local id_at = 5 + runs         -- ARGV index of the next id
local field_at = id_at + n     -- ARGV index of the next event's payload
for r = 1, runs do
  local count = tonumber(ARGV[4 + r])
  local current, previous = KEYS[2 * r], KEYS[2 * r + 1]
  local last_id = id_at + count - 1
  local seen = {}
  if redis.call('EXISTS', current) == 1 then
    seen = redis.call('HMGET', current, unpack(ARGV, id_at, last_id))
  end
  local older = {}
  if redis.call('EXISTS', previous) == 1 then
    older = redis.call('HMGET', previous, unpack(ARGV, id_at, last_id))
  end
  local added = {}
  local k = 0
  for i = 1, count do
    e = e + 1
    local id = ARGV[id_at + i - 1]
    local payload, stamp = ARGV[field_at], ARGV[field_at + 1]
    local shape = string.byte(shapes, e)
    field_at = field_at + 2
    local key, headers
    if shape == KEY or shape == BOTH then
      key = ARGV[field_at]
      field_at = field_at + 1
    end
    if shape == HEADERS or shape == BOTH then
      headers = ARGV[field_at]
      field_at = field_at + 1
    end
    if not (marks(seen[i], stamp) or marks(older[i], stamp)) then
      local entry
      if key or headers then
        local args = {'XADD', stream}
        if maxlen > 0 then
          args[3], args[4], args[5] = 'MAXLEN', '~', maxlen
        end
        local a = #args
        args[a + 1], args[a + 2], args[a + 3], args[a + 4] = '*', 'id', id, 'topic'
        args[a + 5], args[a + 6], args[a + 7] = topic, 'payload', payload
        args[a + 8], args[a + 9] = 'created_at', stamp
        a = a + 9
        if key then
          args[a + 1], args[a + 2] = 'key', key
          a = a + 2
        end
        if headers then
          args[a + 1], args[a + 2] = 'headers', headers
        end
        entry = xadd(unpack(args))
      elseif maxlen > 0 then
        entry = xadd('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'id', id, 'topic', topic,
          'payload', payload, 'created_at', stamp)
      else
        entry = xadd('XADD', stream, '*', 'id', id, 'topic', topic, 'payload', payload,
          'created_at', stamp)
      end
      if type(entry) == 'string' then
        added[k + 1], added[k + 2] = id, entry .. '|' .. stamp
        k = k + 2
      else
        refused[f + 1], refused[f + 2] = e, (type(entry) == 'table' and entry.err) or 'ERR XADD'
        f = f + 2
      end
    end
  end
  if k > 0 then
    redis.call('HSET', current, unpack(added))
    -- Markers left by a crash go with their period's hash.
    redis.call('PEXPIREAT', current, expires_at)
  end
  id_at = last_id + 1
end
return refused

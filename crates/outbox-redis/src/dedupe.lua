-- Idempotent publish of one stream's share of a batch (outbox.dedupe = on).
--
-- The events come in runs of consecutive ids that share a marker shard; each shard has a marker
-- hash per period, and the previous period's is still consulted. Each call leaves one field per
-- run in its shard's hash, named after the call, listing "<id>|<created_at>" of each event it
-- added, separated by ';'. An event is known by its id and its created_at together: ids can be
-- used again (TRUNCATE ... RESTART IDENTITY, setval, a restore), and a marker left by an earlier
-- event with the same id must not swallow a new one. The relay deletes a call's fields once the
-- transaction that published its events is durable; a field left by a call whose transaction
-- never committed absorbs the events' republication.
--
-- The script runs for every event the relay publishes, so its common path is lean: what all the
-- events share (their topic) comes once, a key or headers only for the events that have them,
-- and each run's marker comes ready-made, to be stored as it is when every event was added.
-- A marker hash holds anything to look through, in a steady stream, only at the edges of a
-- chunk, and after a crash.
-- KEYS[1]             the stream
-- KEYS[2s], KEYS[2s+1] run s's marker hash of the current period, and of the period before
-- ARGV[1]             MAXLEN ~ bound, 0 for none; followed by 'a' to trim with ACKED (Redis 8.2+:
--                     entries a consumer group has not acknowledged stay), then by 'c' to
--                     write CloudEvents (as add.lua does), then by 'i' where
--                     Redis has IDMP: each XADD then carries the event's IDMP identity too, so
--                     that IDMP knows an event the markers added (see below); after 'i',
--                     ':<seconds>:<ids>', the IDMP window a stream this call makes gets
-- ARGV[2]             when the current period's hashes expire, in Unix milliseconds
-- ARGV[3]             the events' topic
-- ARGV[4]             one character per event: '-' for neither key nor headers, 'k' for a
--                     key, 'h' for headers, 'b' for both
-- ARGV[5]             the field this call's markers go to, unique to the call
-- ARGV[4+2s], ARGV[5+2s] the number of events in run s, and its marker if every one is added
-- then                the n event ids, in order
-- then                per event: its payload and created_at, with 'i' its IDMP producer and
--                     identity, then its key and its headers if it has them: with 'c', its
--                     headers are the number n of its extension attributes and n pairs of
--                     field name (ce_...) and value
-- last                with 'c', the CloudEvents source
-- Once XADD refuses an event, the call adds nothing more: every later event is refused with the
-- same error, untried. Redis refuses a script's writes for memory only until the script has
-- written, and taking found events' markers over (HDEL) is a write that memory does not refuse:
-- a call that went on would add a key's events of the next run before the refused one.
-- Returns the events XADD refused: pairs of the event's position (from 1) and the error text
-- (a string, not an error reply: a cluster client would fail the whole reply); an empty array
-- when every event is in the stream. An event with a marker was added by an earlier call whose
-- transaction never committed: it is not added again. With 'i', an event that IDMP has seen
-- (sent with IDMP by a relay process that died before its commit, the setting switched since)
-- is not added again either: XADD answers the entry it added then.
local bound, acked, ce, idmp, window = string.match(ARGV[1], '^(%d+)(a?)(c?)(i?)(.*)$')
idmp = idmp == 'i'
ce = ce == 'c'
local source = ce and ARGV[#ARGV]
local maxlen = tonumber(bound)
local trim = acked == 'a' and 'ACKED' or nil
local expires_at = ARGV[2]
local topic = ARGV[3]
local shapes = ARGV[4]
local field = ARGV[5]
local runs = (#KEYS - 1) / 2
local stream = KEYS[1]
local xadd = redis.pcall
local KEY, HEADERS, BOTH = string.byte('k'), string.byte('h'), string.byte('b')
local DIGIT_0, DIGIT_9, MINUS = string.byte('0'), string.byte('9'), string.byte('-')

-- Writes an event's fields as a CloudEvent (see add.lua) into args after position a: its key
-- unless empty as the subject, and the extension attributes at ARGV[attributes] (their number,
-- then pairs), if any.
local function cloudevent(args, a, id, payload, stamp, key, attributes)
  args[a + 1], args[a + 2], args[a + 3], args[a + 4] = 'ce_specversion', '1.0', 'ce_id', id .. '@' .. stamp
  args[a + 5], args[a + 6], args[a + 7], args[a + 8] = 'ce_source', source, 'ce_type', topic
  args[a + 9], args[a + 10] = 'ce_time', stamp
  a = a + 10
  if key and key ~= '' then
    args[a + 1], args[a + 2] = 'ce_subject', key
    a = a + 2
  end
  args[a + 1], args[a + 2], args[a + 3], args[a + 4] = 'content-type', 'application/json', 'data', payload
  a = a + 4
  if attributes then
    for j = 1, 2 * tonumber(ARGV[attributes]) do args[a + j] = ARGV[attributes + j] end
  end
end

-- Adds the markers a hash holds to `known`: "<id>|<created_at>" -> where it is, the field
-- that holds it (a table shared by that field's markers). A
-- field named by a number is one event's marker, as an earlier version of the relay wrote
-- them ("<entry id>|<created_at>").
local function read_markers(hash, known)
  local flat = redis.call('HGETALL', hash)
  for j = 1, #flat, 2 do
    local name, value = flat[j], flat[j + 1]
    local first = string.byte(name, 1)
    local holder = {hash = hash, name = name, value = value, taken = {}}
    if first == MINUS or (first >= DIGIT_0 and first <= DIGIT_9) then
      local bar = string.find(value, '|', 1, true)
      if bar then
        holder.single = true
        known[name .. string.sub(value, bar)] = holder
      end
    else
      for marker in string.gmatch(value, '[^;]+') do known[marker] = holder end
    end
  end
end

-- Takes the markers of events this call found already added out of the fields that held
-- them: this call's field now holds them, and goes once this call's transaction is durable.
local function release(holders)
  for _, holder in pairs(holders) do
    local left = {}
    if not holder.single then
      for marker in string.gmatch(holder.value, '[^;]+') do
        if not holder.taken[marker] then left[#left + 1] = marker end
      end
    end
    if #left == 0 then
      redis.call('HDEL', holder.hash, holder.name)
    else
      redis.call('HSET', holder.hash, holder.name, table.concat(left, ';'))
    end
  end
end

-- With IDMP identities, a stream that does not exist (deleted since the relay's connection gave
-- it its window) is made with its window before the first XADD records an identity in it: a
-- window set later (XCFGSET) forgets the identities the stream holds, and an event in doubt sent
-- again with IDMP would go in twice.
if idmp and redis.call('EXISTS', stream) == 0 then
  local duration, size = string.match(window, '^:(%d+):(%d+)$')
  if duration then
    redis.call('XADD', stream, 'MAXLEN', '0', '*', 'outbox', 'window')
    redis.call('XCFGSET', stream, 'IDMP-DURATION', duration, 'IDMP-MAXSIZE', size)
  end
end

local n = 0
for r = 1, runs do
  n = n + tonumber(ARGV[4 + 2 * r])
end
local refused = {}
local stopped                  -- the error of the first refused event
local f = 0                    -- refused entries written
local e = 0                    -- events done
local id_at = 6 + 2 * runs     -- ARGV index of the next id
local field_at = id_at + n     -- ARGV index of the next event's payload
for r = 1, runs do
  local count = tonumber(ARGV[4 + 2 * r])
  local marker = ARGV[5 + 2 * r]
  local current, previous = KEYS[2 * r], KEYS[2 * r + 1]
  local known = {}
  if not stopped then
    read_markers(current, known)
    read_markers(previous, known)
  end
  local any_known = next(known) ~= nil
  -- The events in the stream (added now, or found added), by the ARGV indexes of their id and
  -- created_at: their marker is built here only when it is not the one the relay sent.
  local added, added_stamps, k = {}, {}, 0
  local holders = {}
  local all = true
  for i = 1, count do
    e = e + 1
    local at = id_at + i - 1
    local id = ARGV[at]
    local stamp_at = field_at + 1
    local payload, stamp = ARGV[field_at], ARGV[stamp_at]
    local shape = string.byte(shapes, e)
    field_at = field_at + 2
    local producer, identity
    if idmp then
      producer, identity = ARGV[field_at], ARGV[field_at + 1]
      field_at = field_at + 2
    end
    local key, headers, attributes
    if shape == KEY or shape == BOTH then
      key = ARGV[field_at]
      field_at = field_at + 1
    end
    if ce and (shape == HEADERS or shape == BOTH) then
      attributes = field_at
      field_at = field_at + 1 + 2 * tonumber(ARGV[field_at])
    elseif shape == HEADERS or shape == BOTH then
      headers = ARGV[field_at]
      field_at = field_at + 1
    end
    local mark = any_known and id .. '|' .. stamp
    local holder = mark and known[mark]
    if stopped then
      all = false
      refused[f + 1], refused[f + 2] = e, stopped
      f = f + 2
    elseif holder then
      -- Added by an earlier call whose transaction never committed: not again.
      all = false
      holder.taken[mark] = true
      holders[holder] = holder
      k = k + 1
      added[k], added_stamps[k] = at, stamp_at
    else
      local entry
      if ce or key or headers or idmp then
        local args = {'XADD', stream}
        if trim and maxlen > 0 then
          args[3], args[4], args[5], args[6] = trim, 'MAXLEN', '~', maxlen
        elseif maxlen > 0 then
          args[3], args[4], args[5] = 'MAXLEN', '~', maxlen
        end
        local a = #args
        if idmp then
          args[a + 1], args[a + 2], args[a + 3] = 'IDMP', producer, identity
          a = a + 3
        end
        args[a + 1] = '*'
        if ce then
          cloudevent(args, a + 1, id, payload, stamp, key, attributes)
        else
          args[a + 2], args[a + 3], args[a + 4] = 'id', id, 'topic'
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
        end
        entry = xadd(unpack(args))
      elseif trim and maxlen > 0 then
        entry = xadd('XADD', stream, trim, 'MAXLEN', '~', maxlen, '*', 'id', id, 'topic', topic,
          'payload', payload, 'created_at', stamp)
      elseif maxlen > 0 then
        entry = xadd('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'id', id, 'topic', topic,
          'payload', payload, 'created_at', stamp)
      else
        entry = xadd('XADD', stream, '*', 'id', id, 'topic', topic, 'payload', payload,
          'created_at', stamp)
      end
      if type(entry) == 'string' then
        k = k + 1
        added[k], added_stamps[k] = at, stamp_at
      else
        all = false
        stopped = (type(entry) == 'table' and entry.err) or 'ERR XADD'
        refused[f + 1], refused[f + 2] = e, stopped
        f = f + 2
      end
    end
  end
  if k > 0 then
    if not all then
      local parts = {}
      for j = 1, k do
        parts[j] = ARGV[added[j]] .. '|' .. ARGV[added_stamps[j]]
      end
      marker = table.concat(parts, ';')
    end
    release(holders)
    redis.call('HSET', current, field, marker)
    -- Markers left by a crash go with their period's hash.
    redis.call('PEXPIREAT', current, expires_at)
  end
  id_at = id_at + count
end
return refused

-- Publishes one stream's share of a chunk with Redis's idempotent production (outbox.dedupe =
-- idmp, or auto where every node runs Redis 8.6.2 or later): XADD ... IDMP <producer> <identity>
-- adds an entry for an identity only once while the stream's window holds it, and answers a
-- repeat with the first entry's id. One call per stream and chunk, as for the markers, so that
-- Redis answers once per stream rather than once per event.
-- KEYS[1]  the stream
-- ARGV[1]  MAXLEN ~ bound, 0 for none; followed by 'a' to trim with ACKED (Redis 8.2+)
-- ARGV[2]  what every producer id starts with (the database's namespace and ':')
-- ARGV[3]  the events' topic
-- ARGV[4]  one character per event: '-' for neither key nor headers, 'k' for a key, 'h' for
--          headers, 'b' for both
-- then     per event: its lane group (its producer is ARGV[2] .. group), its identity, its id,
--          its payload and its created_at, then its key and its headers if it has them
-- Returns 'missing', adding nothing, when the stream does not exist: a stream created by XADD
-- would have Redis's default window, so the relay gives it its window first (idmp_config.lua)
-- and calls again. Else the events XADD refused: pairs of the event's position (from 1) and the
-- error text (a string, not an error reply: a cluster client would fail the whole reply); an
-- empty array when every event is in the stream.
local stream = KEYS[1]
if redis.call('EXISTS', stream) == 0 then
  return 'missing'
end
local bound, acked = string.match(ARGV[1], '^(%d+)(a?)$')
local maxlen = tonumber(bound)
local start, topic, shapes = ARGV[2], ARGV[3], ARGV[4]
local KEY, HEADERS, BOTH = string.byte('k'), string.byte('h'), string.byte('b')
local NEITHER = string.byte('-')
local xadd = redis.pcall
local trim = maxlen > 0 and acked == 'a' and 'ACKED' or nil
local producers = {}
local head = {'XADD', stream}
if trim then
  head[#head + 1] = trim
end
if maxlen > 0 then
  head[#head + 1], head[#head + 2], head[#head + 3] = 'MAXLEN', '~', maxlen
end
local h = #head
local refused = {}
local f = 0
local at = 5
for e = 1, #shapes do
  local group, identity, id = ARGV[at], ARGV[at + 1], ARGV[at + 2]
  local payload, stamp = ARGV[at + 3], ARGV[at + 4]
  at = at + 5
  local producer = producers[group]
  if not producer then
    producer = start .. group
    producers[group] = producer
  end
  local shape = string.byte(shapes, e)
  local entry
  -- The common event, without key or headers, is added with no table built for it.
  if shape == NEITHER and maxlen == 0 then
    entry = xadd('XADD', stream, 'IDMP', producer, identity, '*', 'id', id, 'topic', topic,
      'payload', payload, 'created_at', stamp)
  elseif shape == NEITHER and not trim then
    entry = xadd('XADD', stream, 'MAXLEN', '~', maxlen, 'IDMP', producer, identity, '*', 'id', id,
      'topic', topic, 'payload', payload, 'created_at', stamp)
  else
    local args = {unpack(head)}
    args[h + 1], args[h + 2], args[h + 3], args[h + 4] = 'IDMP', producer, identity, '*'
    args[h + 5], args[h + 6], args[h + 7], args[h + 8] = 'id', id, 'topic', topic
    args[h + 9], args[h + 10], args[h + 11], args[h + 12] = 'payload', payload, 'created_at', stamp
    local a = h + 12
    if shape == KEY or shape == BOTH then
      args[a + 1], args[a + 2] = 'key', ARGV[at]
      a = a + 2
      at = at + 1
    end
    if shape == HEADERS or shape == BOTH then
      args[a + 1], args[a + 2] = 'headers', ARGV[at]
      at = at + 1
    end
    entry = xadd(unpack(args))
  end
  if type(entry) ~= 'string' then
    refused[f + 1], refused[f + 2] = e, (type(entry) == 'table' and entry.err) or 'ERR XADD'
    f = f + 2
  end
end
return refused

-- Publishes one stream's share of a chunk with Redis's own deduplication (outbox.dedupe with
-- IDMP, Redis 8.6.2+) in one call, which Redis runs whole or not at all. Sent as one XADD per
-- event, a round trip whose first commands Redis refused (its memory full) and whose later ones
-- it ran (memory freed in between) would put a key's later events in the stream before its
-- earlier ones, which go again.
--
-- KEYS[1]   the stream
-- ARGV[1]   MAXLEN ~ bound, 0 for none; followed by 'a' to trim with ACKED (Redis 8.2+:
--           entries a consumer group has not acknowledged stay)
-- ARGV[2]   the events' topic
-- ARGV[3]   one character per event: '-' for neither key nor headers, 'k' for a key, 'h' for
--           headers, 'b' for both
-- then      per event: its producer (its lane group) and identity, as XADD's IDMP takes them,
--           its id, payload and created_at, then its key and its headers if it has them
-- Returns 0 when the stream does not exist: XADD with NOMKSTREAM adds nothing, since a stream
-- XADD made would lack its window. Else the events XADD refused, as pairs of the event's
-- position (from 1) and the error text (a string, not an error reply: a cluster client would
-- fail the whole reply); an empty array when every event is in the stream. Redis decides at a
-- script's start whether its memory refuses writes, so a refusal for memory is every event's.
local bound, acked = string.match(ARGV[1], '^(%d+)(a?)$')
local shapes = ARGV[3]
local xadd = {'XADD', KEYS[1], 'NOMKSTREAM'}
if tonumber(bound) > 0 then
  if acked == 'a' then xadd[#xadd + 1] = 'ACKED' end
  xadd[#xadd + 1] = 'MAXLEN'
  xadd[#xadd + 1] = '~'
  xadd[#xadd + 1] = bound
end
xadd[#xadd + 1] = 'IDMP'
-- The places each event fills: producer, identity, then after '*' and 'id' its id, after
-- 'topic' and the topic and 'payload' its payload, after 'created_at' its time.
local p = #xadd + 1
xadd[p + 2] = '*'
xadd[p + 3] = 'id'
xadd[p + 5] = 'topic'
xadd[p + 6] = ARGV[2]
xadd[p + 7] = 'payload'
xadd[p + 9] = 'created_at'
local fixed = p + 10
local KEY, HEADERS, BOTH = string.byte('k'), string.byte('h'), string.byte('b')
local refused = {}
local at = 4
for n = 1, #shapes do
  xadd[p] = ARGV[at]
  xadd[p + 1] = ARGV[at + 1]
  xadd[p + 4] = ARGV[at + 2]
  xadd[p + 8] = ARGV[at + 3]
  xadd[fixed] = ARGV[at + 4]
  at = at + 5
  local last = fixed
  local shape = string.byte(shapes, n)
  if shape == KEY or shape == BOTH then
    xadd[last + 1] = 'key'
    xadd[last + 2] = ARGV[at]
    last = last + 2
    at = at + 1
  end
  if shape == HEADERS or shape == BOTH then
    xadd[last + 1] = 'headers'
    xadd[last + 2] = ARGV[at]
    last = last + 2
    at = at + 1
  end
  local reply = redis.pcall(unpack(xadd, 1, last))
  if reply == false then return 0 end
  if type(reply) == 'table' and reply.err then
    refused[#refused + 1] = n
    refused[#refused + 1] = reply.err
  end
end
return refused

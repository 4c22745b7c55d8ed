-- Publishes one stream's share of a chunk in one call, without markers: with Redis's own
-- deduplication (outbox.dedupe with IDMP, Redis 8.6.2+), or with none (outbox.dedupe = off).
-- Sent as one XADD per event, a round trip whose first commands Redis refused (its memory full)
-- and whose later ones it ran (memory freed in between) would put a key's later events in the
-- stream before its earlier ones, which go again. Redis decides at a script's start whether its
-- memory refuses the script's first write; and once XADD refuses an event, the call adds nothing
-- more: every later event is refused with the same error, untried.
--
-- KEYS[1]   the stream
-- ARGV[1]   MAXLEN ~ bound, 0 for none; followed by 'a' to trim with ACKED (Redis 8.2+:
--           entries a consumer group has not acknowledged stay), then by 'i' with IDMP
-- ARGV[2]   the events' topic
-- ARGV[3]   one character per event: '-' for neither key nor headers, 'k' for a key, 'h' for
--           headers, 'b' for both
-- then      per event: with 'i' its producer (its lane group) and identity, as XADD's IDMP
--           takes them; its id, payload and created_at; then its key and its headers if it has
--           them
-- With 'i', returns 0 when the stream does not exist: XADD with NOMKSTREAM adds nothing, since
-- a stream XADD made would lack its window. Else the events XADD refused, as pairs of the
-- event's position (from 1) and the error text (a string, not an error reply: a cluster client
-- would fail the whole reply); an empty array when every event is in the stream.
local bound, acked, idmp = string.match(ARGV[1], '^(%d+)(a?)(i?)$')
idmp = idmp == 'i'
local shapes = ARGV[3]
local xadd = {'XADD', KEYS[1]}
if idmp then xadd[#xadd + 1] = 'NOMKSTREAM' end
if tonumber(bound) > 0 then
  if acked == 'a' then xadd[#xadd + 1] = 'ACKED' end
  xadd[#xadd + 1] = 'MAXLEN'
  xadd[#xadd + 1] = '~'
  xadd[#xadd + 1] = bound
end
-- With IDMP, the producer and identity go after 'IDMP'. Then, from p on: 'id' and the event's
-- id, 'topic' and the topic, 'payload' and its payload, 'created_at' and its time.
local p
if idmp then
  local i = #xadd
  xadd[i + 1] = 'IDMP'
  xadd[i + 4] = '*'
  p = i + 5
else
  xadd[#xadd + 1] = '*'
  p = #xadd + 1
end
xadd[p] = 'id'
xadd[p + 2] = 'topic'
xadd[p + 3] = ARGV[2]
xadd[p + 4] = 'payload'
xadd[p + 6] = 'created_at'
local fixed = p + 7
local KEY, HEADERS, BOTH = string.byte('k'), string.byte('h'), string.byte('b')
local refused = {}
local stopped
local at = 4
for n = 1, #shapes do
  if stopped then
    refused[#refused + 1] = n
    refused[#refused + 1] = stopped
  else
    if idmp then
      xadd[p - 3] = ARGV[at]
      xadd[p - 2] = ARGV[at + 1]
      at = at + 2
    end
    xadd[p + 1] = ARGV[at]
    xadd[p + 5] = ARGV[at + 1]
    xadd[fixed] = ARGV[at + 2]
    at = at + 3
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
      stopped = reply.err
      refused[#refused + 1] = n
      refused[#refused + 1] = stopped
    end
  end
end
return refused

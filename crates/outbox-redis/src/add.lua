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
--           entries a consumer group has not acknowledged stay), then by 'c' to write
--           CloudEvents (see below), then by 'i' with IDMP
-- ARGV[2]   the events' topic
-- ARGV[3]   one character per event: '-' for neither key nor headers, 'k' for a key, 'h' for
--           headers, 'b' for both
-- then      per event: with 'i' its producer (its lane group) and identity, as XADD's IDMP
--           takes them; its id, payload and created_at; then its key and its headers if it has
--           them: with 'c', its headers are the number n of its extension attributes and n
--           pairs of field name (ce_...) and value
-- last      with 'c', the CloudEvents source
-- With 'c' the entry is a CloudEvent in binary content mode (the relay's cloudevents.rs): its
-- fields ce_specversion, ce_id (id@created_at), ce_source, ce_type (the topic), ce_time
-- (created_at), ce_subject (the key, unless empty), content-type, data (the payload), and the
-- extension attributes.
-- With 'i', returns 0 when the stream does not exist: XADD with NOMKSTREAM adds nothing, since
-- a stream XADD made would lack its window. Else the events XADD refused, as pairs of the
-- event's position (from 1) and the error text (a string, not an error reply: a cluster client
-- would fail the whole reply); an empty array when every event is in the stream.
local bound, acked, ce, idmp = string.match(ARGV[1], '^(%d+)(a?)(c?)(i?)$')
idmp = idmp == 'i'
ce = ce == 'c'
local source = ce and ARGV[#ARGV]
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
if ce then
  -- The attributes every event of the call shares; its id at p + 3, its time at p + 9, the
  -- rest of its own from p + 10.
  xadd[p], xadd[p + 1] = 'ce_specversion', '1.0'
  xadd[p + 2], xadd[p + 4], xadd[p + 5] = 'ce_id', 'ce_source', source
  xadd[p + 6], xadd[p + 7], xadd[p + 8] = 'ce_type', ARGV[2], 'ce_time'
else
  xadd[p] = 'id'
  xadd[p + 2] = 'topic'
  xadd[p + 3] = ARGV[2]
  xadd[p + 4] = 'payload'
  xadd[p + 6] = 'created_at'
end
local fixed = p + 7
local KEY, HEADERS, BOTH = string.byte('k'), string.byte('h'), string.byte('b')
-- An event's own CloudEvents fields, from its arguments at ARGV[at]: returns the last of xadd
-- to send and where the next event's arguments start.
local function cloudevent(at, shape)
  local id, payload, stamp = ARGV[at], ARGV[at + 1], ARGV[at + 2]
  at = at + 3
  xadd[p + 3], xadd[p + 9] = id .. '@' .. stamp, stamp
  local last = p + 9
  if shape == KEY or shape == BOTH then
    if ARGV[at] ~= '' then
      xadd[last + 1], xadd[last + 2] = 'ce_subject', ARGV[at]
      last = last + 2
    end
    at = at + 1
  end
  xadd[last + 1], xadd[last + 2] = 'content-type', 'application/json'
  xadd[last + 3], xadd[last + 4] = 'data', payload
  last = last + 4
  if shape == HEADERS or shape == BOTH then
    local count = tonumber(ARGV[at])
    for j = 1, 2 * count do xadd[last + j] = ARGV[at + j] end
    last = last + 2 * count
    at = at + 1 + 2 * count
  end
  return last, at
end
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
    local last
    local shape = string.byte(shapes, n)
    if ce then
      last, at = cloudevent(at, shape)
    else
      xadd[p + 1] = ARGV[at]
      xadd[p + 5] = ARGV[at + 1]
      xadd[fixed] = ARGV[at + 2]
      at = at + 3
      last = fixed
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

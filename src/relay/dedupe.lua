-- Idempotent publish of one stream's share of a batch (outbox.dedupe = on).
-- KEYS[1]     the stream
-- KEYS[2..n]  one marker per event, in id order
-- ARGV[1]     MAXLEN ~ bound, 0 for none
-- ARGV[2]     marker lifetime in seconds
-- ARGV[3..]   four fields per event: id, topic, payload, created_at
-- Returns one {1, entry id} or {0, error} per event. An event whose marker exists was added by
-- an earlier attempt whose transaction never committed: it is reported with that entry's id and
-- not added again.
local maxlen = tonumber(ARGV[1])
local ttl = ARGV[2]
local out = {}
for i = 2, #KEYS do
  local existing = redis.call('GET', KEYS[i])
  if existing then
    out[#out + 1] = {1, existing}
  else
    local a = 3 + (i - 2) * 4
    local entry
    if maxlen > 0 then
      entry = redis.pcall('XADD', KEYS[1], 'MAXLEN', '~', maxlen, '*', 'id', ARGV[a],
        'topic', ARGV[a + 1], 'payload', ARGV[a + 2], 'created_at', ARGV[a + 3])
    else
      entry = redis.pcall('XADD', KEYS[1], '*', 'id', ARGV[a],
        'topic', ARGV[a + 1], 'payload', ARGV[a + 2], 'created_at', ARGV[a + 3])
    end
    if type(entry) == 'table' and entry.err then
      out[#out + 1] = {0, entry.err}
    else
      redis.call('SET', KEYS[i], entry, 'EX', ttl)
      out[#out + 1] = {1, entry}
    end
  end
end
return out

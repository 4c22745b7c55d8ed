-- Gives a stream the IDMP window the relay needs (outbox.dedupe = idmp, or auto on Redis 8.6.2+),
-- once per stream and connection, before the relay's first XADD ... IDMP to it.
--
-- Setting a stream's window (XCFGSET) forgets the ids it holds, so it is set only where it is
-- smaller than needed, and only ever made larger: relays of several databases that share a
-- stream, with different settings, settle on the largest instead of clearing each other's. A
-- stream that does not exist yet is created empty first, so that its window is set before it
-- holds anything (an XADD with MAXLEN 0 leaves no entry; no consumer can see it in between).
-- KEYS[1]  the stream
-- ARGV[1]  the window's duration, in seconds
-- ARGV[2]  the ids it keeps per producer
-- Returns 0 when the window was large enough, 1 when the stream was created, 2 when the window
-- was made larger; a key that is not a stream is left to the XADDs, which fail their events.
local stream = KEYS[1]
local duration, size = tonumber(ARGV[1]), tonumber(ARGV[2])
if redis.call('EXISTS', stream) == 0 then
  redis.call('XADD', stream, 'MAXLEN', '0', '*', 'outbox', 'window')
  redis.call('XCFGSET', stream, 'IDMP-DURATION', duration, 'IDMP-MAXSIZE', size)
  return 1
end
local info = redis.pcall('XINFO', 'STREAM', stream)
if type(info) ~= 'table' or info.err then
  return 0
end
local have_duration, have_size = 0, 0
for i = 1, #info, 2 do
  if info[i] == 'idmp-duration' then
    have_duration = info[i + 1]
  elseif info[i] == 'idmp-maxsize' then
    have_size = info[i + 1]
  end
end
if have_duration >= duration and have_size >= size then
  return 0
end
redis.call('XCFGSET', stream, 'IDMP-DURATION', math.max(have_duration, duration),
  'IDMP-MAXSIZE', math.max(have_size, size))
return 2

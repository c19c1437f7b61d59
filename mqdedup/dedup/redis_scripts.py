"""The Lua scripts of the Redis claim store, in one place (each one round trip).

Values of a claim key: ``P|<worker>`` (claimed, leased) or ``D|<json result>`` (done).
The attempts hash of a message id holds ``n`` (attempts) and ``e`` (the last error).
"""

# KEYS: claim keys. ARGV[1] worker, ARGV[2] lease ms.
# Per key: 'N' (new: claimed by us), 'D|<json>' (done), 'B|<ms left on the lease>'.
CLAIM = """
local mine = 'P|' .. ARGV[1]
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('SET', key, mine, 'NX', 'PX', ARGV[2]) then
    out[i] = 'N'
  else
    local value = redis.call('GET', key)
    if (not value) or value == mine then
      redis.call('SET', key, mine, 'PX', ARGV[2])
      out[i] = 'N'
    elseif string.sub(value, 1, 2) == 'D|' then
      out[i] = value
    else
      out[i] = 'B|' .. redis.call('PTTL', key)
    end
  end
end
return out
"""

# KEYS: claim keys. ARGV[1] worker, ARGV[2] retention ms, ARGV[2 + i] result of key i.
# Per key: 'ok' (our claim became done), 'lost' (our lease had run out; marked done
# anyway), 'dup' (another worker had completed it already; left as it was).
COMPLETE = """
local mine = 'P|' .. ARGV[1]
local out = {}
for i, key in ipairs(KEYS) do
  local value = redis.call('GET', key)
  if value and string.sub(value, 1, 2) == 'D|' then
    out[i] = 'dup'
  else
    redis.call('SET', key, 'D|' .. ARGV[i + 2], 'PX', ARGV[2])
    if value == mine then out[i] = 'ok' else out[i] = 'lost' end
  end
end
return out
"""

# KEYS: claim keys. ARGV[1] worker. Deletes the claims that are still ours.
RELEASE = """
local mine = 'P|' .. ARGV[1]
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == mine then
    redis.call('DEL', key)
    n = n + 1
  end
end
return n
"""

# KEYS: claim keys. ARGV[1] worker, ARGV[2] lease ms. Extends the claims still ours.
RENEW = """
local mine = 'P|' .. ARGV[1]
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == mine then
    redis.call('PEXPIRE', key, ARGV[2])
    n = n + 1
  end
end
return n
"""


# KEYS[1] the attempts hash. ARGV[1] marker, ARGV[2] max attempts, ARGV[3] retention ms.
# Counts an attempt before it runs unless max attempts are reached: {attempts, error, 1|0}.
START_ATTEMPT = """
local n = tonumber(redis.call('HGET', KEYS[1], 'n') or '0')
if n >= tonumber(ARGV[2]) then
  return {n, redis.call('HGET', KEYS[1], 'e') or false, 0}
end
n = redis.call('HINCRBY', KEYS[1], 'n', 1)
redis.call('HSET', KEYS[1], 'e', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {n, ARGV[1], 1}
"""

# KEYS[1] the attempts hash. Takes back one counted attempt (never below zero).
UNDO_ATTEMPT = """
if tonumber(redis.call('HGET', KEYS[1], 'n') or '0') > 0 then
  redis.call('HINCRBY', KEYS[1], 'n', -1)
end
return 0
"""

"""One-time tokens in Redis (the ``redis`` extra): same outcomes as the database backend.

Each token is one key, ``<namespace><sha256 of the token>``, holding
``L|<expires at, ms>|<owner>`` while live and ``U|<expires at, ms>|<owner>`` once used.

* ``issue`` sets the key with ``SET … NX PX (ttl + retention)`` (``NX``: a token can never
  overwrite another) from a Lua script that reads the server's clock (``TIME``), so all
  workers agree on expiry whatever their own clocks say.
* ``consume`` is one Lua script, atomic on the server: missing key or another owner →
  ``unknown``; ``U`` → ``already used``; past its expiry → ``expired``; otherwise it
  rewrites the value to ``U|…`` (``KEEPTTL``) and answers ``consumed``.

The key outlives the token by ``retention`` (default one day): that *tombstone* is what
lets a late repeat read ``already used`` and a late use read ``expired`` rather than
``unknown``. After that the key is gone and every answer is ``unknown``.

Trade-off: unlike :class:`~mqdedup.dedup.tokens.DatabaseTokenStore`, a Redis consume can
never share the business transaction, and a Redis that loses data (no persistence, a
failover before replication) forgets tokens: their consumes then answer ``unknown``.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from mqdedup.dedup.redis_client import redis_client
from mqdedup.dedup.tokens import (
    TokenOutcome,
    check_owner,
    new_token,
    plausible_token,
    token_hash,
    ttl_seconds,
)
from mqdedup.extras import missing_extra

try:
    import redis
except ImportError as _missing:  # the redis extra
    raise missing_extra("the Redis one-time tokens", "redis", _missing) from None

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "mqdedup:token:"
_ISSUE_ATTEMPTS = 3

# KEYS[1] token key; ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] retention ms.
# Returns the expiry (ms since the epoch, server clock) or false if the key existed.
_ISSUE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expires = now + tonumber(ARGV[2])
local value = 'L|' .. string.format('%.0f', expires) .. '|' .. ARGV[1]
local px = tonumber(ARGV[2]) + tonumber(ARGV[3])
if redis.call('SET', KEYS[1], value, 'NX', 'PX', px) then
  return string.format('%.0f', expires)
end
return false
"""

# KEYS[1] token key; ARGV[1] owner.
_CONSUME = """
local value = redis.call('GET', KEYS[1])
if not value then return 'unknown' end
local state, expires, owner = string.match(value, '^(%a)|(%d+)|(.*)$')
if state == nil or owner ~= ARGV[1] then return 'unknown' end
if state == 'U' then return 'already used' end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if now >= tonumber(expires) then return 'expired' end
redis.call('SET', KEYS[1], 'U|' .. expires .. '|' .. owner, 'KEEPTTL')
return 'consumed'
"""


class RedisTokenStore:
    """One-time tokens in Redis; see the module docstring for the layout and trade-offs.

    ``client`` is a ``redis.Redis`` or a ``redis://`` URL.
    """

    def __init__(
        self,
        client: redis.Redis | str,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        retention: timedelta = timedelta(days=1),
    ) -> None:
        self.redis: redis.Redis = redis_client(client)
        self.namespace = namespace
        self.retention_ms = int(retention.total_seconds() * 1000)
        if self.retention_ms < 0:
            raise ValueError("RedisTokenStore retention must not be negative")
        self._issue: Any = self.redis.register_script(_ISSUE)
        self._consume: Any = self.redis.register_script(_CONSUME)

    def key(self, token: str) -> str:
        """The Redis key of ``token`` (holds its hash, never the token)."""
        return self.namespace + token_hash(token)

    def issue(self, owner: str, ttl: timedelta | float) -> str:
        """A new token for ``owner``, valid for ``ttl`` by the Redis server's clock."""
        check_owner(owner)
        ttl_ms = max(1, int(ttl_seconds(ttl) * 1000))
        for _ in range(_ISSUE_ATTEMPTS):
            token = new_token()
            if self._issue(keys=[self.key(token)], args=[owner, ttl_ms, self.retention_ms]):
                return token
        raise RuntimeError("could not issue a unique token")  # pragma: no cover

    def consume(self, owner: str, token: str) -> TokenOutcome:
        """Use ``token`` once for ``owner`` (one atomic Lua script)."""
        check_owner(owner)
        if not plausible_token(token):
            return TokenOutcome.UNKNOWN
        answer = self._consume(keys=[self.key(token)], args=[owner])
        if isinstance(answer, bytes):
            answer = answer.decode()
        return TokenOutcome(answer)

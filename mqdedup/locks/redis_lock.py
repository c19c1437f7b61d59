"""A lease lock with a fencing token on Redis.

Keys (the lock's name with ``%``, ``{`` and ``}`` percent-escaped, as the Redis claim
store escapes consumer names, so that no two names share a key and both keys of a lock
have one Redis Cluster hash tag)::

    <namespace>:lock:{<name>}   = <owner>:<token>   (held; expires with the lease)
    <namespace>:fence:{<name>}  = <last token>      (the fence counter; never expires)

* **acquire** (one Lua script, atomic): ``SET <lock> <owner> NX PX <ttl>``; if that
  succeeded, ``INCR <fence>`` gives the token and the value becomes ``<owner>:<token>``
  (``XX PX``: same lease). The fence counter has no expiry, so the tokens of a lock
  only grow (as long as Redis keeps its data: on a Redis without persistence a restart
  starts the counter again; use the PostgreSQL lock where that matters, or persistence
  with ``appendonly yes``).
* **extend** / **release** (Lua): only if the value is still ``<owner>:<token>``;
  otherwise the script tells an expired lease (the key is gone) from a lost one
  (another holder's value).

Earlier versions (0.1.0 and before) used the keys ``<namespace>:lock:<name>`` and
``<namespace>:lock:<name>:fence``, where the lock ``X:fence`` and the fence counter of
``X`` were one key. The first acquisition of a :class:`RedisLock` raises the new
counter to the old one's value if there is one, so tokens keep growing across the
upgrade; processes of the old and the new version do not exclude each other (upgrade
every holder of a lock together).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from mqdedup.dedup.redis_claims import scope_tag
from mqdedup.dedup.redis_client import mask_redis_url, redis_client
from mqdedup.extras import missing_extra
from mqdedup.locks.base import (
    Lease,
    LeaseLock,
    LockExpiredError,
    LockLostError,
    LockUnavailableError,
    check_lease,
    check_name,
    check_seconds,
    check_ttl,
)

try:
    import redis
except ImportError as _missing:  # the redis extra
    raise missing_extra("the Redis lock", "redis", _missing) from None
from redis import exceptions as redis_errors

log = logging.getLogger(__name__)

# KEYS[1] lock, KEYS[2] fence counter; ARGV[1] owner, ARGV[2] ttl ms.
_ACQUIRE = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return false end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. token, 'XX', 'PX', ARGV[2])
return token
"""
# KEYS[1] lock; ARGV[1] owner:token, ARGV[2] ttl ms (extend) -> 1 done, 0 expired, -1 lost.
_EXTEND = """
local value = redis.call('GET', KEYS[1])
if value == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if not value then return 0 end
return -1
"""
# KEYS[1] fence counter; ARGV[1] a token it must reach (the old key layout's counter).
_RAISE_FENCE = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""
_RELEASE = """
local value = redis.call('GET', KEYS[1])
if value == ARGV[1] then redis.call('DEL', KEYS[1]) return 1 end
if not value then return 0 end
return -1
"""


#: (server, old counter key) pairs this process has carried over: once per lock name,
#: not once per RedisLock object (one is often made per request).
_LEGACY_CHECKED: set[tuple[str, str]] = set()


class RedisLock(LeaseLock):
    """A named lease lock on Redis; the same API as
    :class:`~mqdedup.locks.postgres.PostgresLock`.

    ``client`` is a ``redis.Redis`` or a ``redis://`` URL (default ``MQDEDUP_REDIS_URL``).
    Keys: ``<namespace>:lock:{<name>}`` and ``<namespace>:fence:{<name>}`` (``%``, ``{``
    and ``}`` of the name percent-escaped): every name has keys of its own.
    """

    def __init__(
        self,
        name: str,
        client: redis.Redis | str | None = None,
        *,
        ttl: float = 10.0,
        namespace: str = "mqdedup",
        poll_interval: float = 0.05,
    ) -> None:
        self.name = check_name(name)
        if client is not None and not isinstance(client, redis.Redis | str):
            raise TypeError(
                "RedisLock client must be a redis.Redis, a redis:// URL or None "
                f"(MQDEDUP_REDIS_URL), got {type(client).__name__}"
            )
        if not isinstance(namespace, str):
            raise TypeError(f"RedisLock namespace must be a string, got {type(namespace).__name__}")
        if not namespace:
            raise ValueError("RedisLock namespace must not be empty")
        self.client = redis_client(client)
        self.ttl = check_ttl(ttl)
        self.poll_interval = check_seconds(poll_interval, "poll_interval")
        tag = scope_tag(name)
        self.key = f"{namespace}:lock:{{{tag}}}"
        self.fence_key = f"{namespace}:fence:{{{tag}}}"
        #: The fence counter of the old key layout (read once, see the module docstring).
        self.legacy_fence_key = f"{namespace}:lock:{name}:fence"
        self._acquire = self.client.register_script(_ACQUIRE)
        self._extend = self.client.register_script(_EXTEND)
        self._release = self.client.register_script(_RELEASE)
        self._raise_fence = self.client.register_script(_RAISE_FENCE)

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl * 1000))

    def try_acquire(self) -> Lease | None:
        """The lease if the lock is free (or its last lease ran out), else None."""
        if (_url_of(self.client), self.legacy_fence_key) not in _LEGACY_CHECKED:
            self._carry_legacy_tokens()
        owner = uuid.uuid4().hex
        started = time.monotonic()
        token = self._call(self._acquire, [self.key, self.fence_key], [owner, self._ttl_ms])
        if token is None:
            return None
        log.debug("lock acquired", extra={"lock": self.name, "token": int(token)})
        return Lease(self.name, owner, int(token), self.ttl, started + self.ttl)

    def extend(self, lease: Lease) -> Lease:
        """Give ``lease`` another ``ttl`` from now; raise if it expired or was lost."""
        check_lease(lease, self)
        started = time.monotonic()
        code = self._call(self._extend, [self.key], [_value(lease), self._ttl_ms])
        self._check(code, lease, "extended")
        return Lease(self.name, lease.owner, lease.token, self.ttl, started + self.ttl)

    def release(self, lease: Lease) -> None:
        """Free the lock; raise :class:`LockExpiredError` / :class:`LockLostError` if
        the lease had run out / another holder has the lock."""
        check_lease(lease, self)
        code = self._call(self._release, [self.key], [_value(lease)])
        self._check(code, lease, "released")

    def _carry_legacy_tokens(self) -> None:
        """Raise the fence counter to the old key layout's counter, if that holds one
        (a value that is not a number there is another lock's of the old layout)."""
        old = self._call(self.client.get, [self.legacy_fence_key], [], plain=True)
        text = old.decode() if isinstance(old, bytes) else old
        if isinstance(text, str) and text.isdigit():
            self._call(self._raise_fence, [self.fence_key], [int(text)])
        _LEGACY_CHECKED.add((_url_of(self.client), self.legacy_fence_key))

    def _check(self, code: Any, lease: Lease, what: str) -> None:
        if int(code) == 1:
            return
        if int(code) == 0:
            raise LockExpiredError(
                f"lock {self.name!r} (token {lease.token}) could not be {what}: its lease "
                f"of {lease.ttl:g} s ran out"
            )
        raise LockLostError(
            f"lock {self.name!r} (token {lease.token}) could not be {what}: its lease ran "
            "out and another holder took the lock"
        )

    def _call(self, script: Any, keys: list[str], args: list[Any], *, plain: bool = False) -> Any:
        try:
            return script(*keys) if plain else script(keys=keys, args=args)
        except (redis_errors.ConnectionError, redis_errors.TimeoutError) as exc:
            where = mask_redis_url(_url_of(self.client))
            raise LockUnavailableError(
                f"lock {self.name!r}: cannot reach Redis at {where}: {type(exc).__name__}"
            ) from exc


def _value(lease: Lease) -> str:
    return f"{lease.owner}:{lease.token}"


def _url_of(client: redis.Redis) -> str:
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    return f"redis://{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"

"""A lease lock with a fencing token on Redis.

* **acquire** (one Lua script, atomic): ``SET <lock> <owner> NX PX <ttl>``; if that
  succeeded, ``INCR <lock>:fence`` gives the token and the value becomes
  ``<owner>:<token>`` (``XX PX``: same lease). The fence counter has no expiry, so the
  tokens of a lock only grow (as long as Redis keeps its data: on a Redis without
  persistence a restart starts the counter again; use the PostgreSQL lock where that
  matters, or persistence with ``appendonly yes``).
* **extend** / **release** (Lua): only if the value is still ``<owner>:<token>``;
  otherwise the script tells an expired lease (the key is gone) from a lost one
  (another holder's value).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import redis
from redis import exceptions as redis_errors

from mqdedup.dedup.redis_client import mask_redis_url, redis_client
from mqdedup.locks.base import (
    Lease,
    LeaseLock,
    LockExpiredError,
    LockLostError,
    LockUnavailableError,
    check_ttl,
)

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
_RELEASE = """
local value = redis.call('GET', KEYS[1])
if value == ARGV[1] then redis.call('DEL', KEYS[1]) return 1 end
if not value then return 0 end
return -1
"""


class RedisLock(LeaseLock):
    """A named lease lock on Redis; the same API as
    :class:`~mqdedup.locks.postgres.PostgresLock`.

    ``client`` is a ``redis.Redis`` or a ``redis://`` URL (default ``MQDEDUP_REDIS_URL``).
    Keys: ``<namespace>:lock:<name>`` and ``<namespace>:lock:<name>:fence``.
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
        if not isinstance(name, str) or not name:
            raise ValueError(f"a lock name must be a non-empty string, got {name!r:.80}")
        self.client = redis_client(client)
        self.name = name
        self.ttl = check_ttl(ttl)
        self.poll_interval = poll_interval
        self.key = f"{namespace}:lock:{name}"
        self.fence_key = f"{self.key}:fence"
        self._acquire = self.client.register_script(_ACQUIRE)
        self._extend = self.client.register_script(_EXTEND)
        self._release = self.client.register_script(_RELEASE)

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl * 1000))

    def try_acquire(self) -> Lease | None:
        """The lease if the lock is free (or its last lease ran out), else None."""
        owner = uuid.uuid4().hex
        started = time.monotonic()
        token = self._call(self._acquire, [self.key, self.fence_key], [owner, self._ttl_ms])
        if token is None:
            return None
        log.debug("lock acquired", extra={"lock": self.name, "token": int(token)})
        return Lease(self.name, owner, int(token), self.ttl, started + self.ttl)

    def extend(self, lease: Lease) -> Lease:
        """Give ``lease`` another ``ttl`` from now; raise if it expired or was lost."""
        started = time.monotonic()
        code = self._call(self._extend, [self.key], [_value(lease), self._ttl_ms])
        self._check(code, lease, "extended")
        return Lease(self.name, lease.owner, lease.token, self.ttl, started + self.ttl)

    def release(self, lease: Lease) -> None:
        """Free the lock; raise :class:`LockExpiredError` / :class:`LockLostError` if
        the lease had run out / another holder has the lock."""
        code = self._call(self._release, [self.key], [_value(lease)])
        self._check(code, lease, "released")

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

    def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            return script(keys=keys, args=args)
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

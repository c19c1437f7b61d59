"""Lease locks with fencing tokens, on PostgreSQL and Redis.

A lock alone is unsafe: a holder paused past its lease writes after the next holder
took the lock. Every acquisition gets a fencing token, strictly greater than the
lock's tokens before it, and a write guarded by :func:`fenced_update` refuses a token
older than the last one that wrote the row::

    from mqdedup.locks import PostgresLock, RedisLock, fenced_update

    lock = PostgresLock(engine, "stock:sku-42", ttl=5)     # or RedisLock("stock:sku-42")
    with lock.hold(timeout=2) as lease:
        with Session(engine) as session, session.begin():
            fenced_update(session, stock, stock.c.sku == "sku-42", {"count": n}, lease.token)

Errors: :class:`LockTimeoutError` (not acquired in time), :class:`LockExpiredError`
(the lease ran out), :class:`LockLostError` (another holder has it),
:class:`LockUnavailableError` (the store is unreachable), :class:`StaleTokenError`
(a fenced write refused). See ``docs/techniques.md``.
"""

from mqdedup.locks.base import (
    Lease,
    LeaseLock,
    LockError,
    LockExpiredError,
    LockLostError,
    LockTimeoutError,
    LockUnavailableError,
    StaleTokenError,
    fenced_update,
)
from mqdedup.locks.postgres import PostgresLock


def __getattr__(name: str) -> object:
    if name == "RedisLock":  # the redis extra, imported when asked for
        from mqdedup.locks.redis_lock import RedisLock

        return RedisLock
    raise AttributeError(name)


__all__ = [
    "Lease",
    "LeaseLock",
    "LockError",
    "LockExpiredError",
    "LockLostError",
    "LockTimeoutError",
    "LockUnavailableError",
    "PostgresLock",
    "RedisLock",
    "StaleTokenError",
    "fenced_update",
]

"""A lease lock with a fencing token on PostgreSQL: one row per lock in ``<prefix>locks``.

* **acquire**: one statement, ``INSERT ... ON CONFLICT (name) DO UPDATE ... WHERE the
  lock is free or its lease ran out ... RETURNING token``: the row's ``token`` goes up
  by one with every acquisition (the row is never deleted, so the token never goes
  back), ``owner`` is a random id of this acquisition, ``expires_at`` the database's
  ``clock_timestamp()`` plus the ttl (one clock for every holder).
* **extend** / **release**: an UPDATE conditioned on the owner and the token; when it
  matches nothing, a read says why (:class:`LockExpiredError` or
  :class:`LockLostError`).

Each call is its own short transaction (autocommit statements): a lock is never held by
an open transaction, so a holder that dies only keeps it until its lease runs out.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy import exc as sa_exc

from mqdedup.db.schema import DEFAULT_PREFIX, schema
from mqdedup.errors import ConfigurationError
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
from mqdedup.masking import mask_url

log = logging.getLogger(__name__)

_ACQUIRE = """
INSERT INTO {t} (name, owner, token, expires_at)
VALUES (:name, :owner, 1, clock_timestamp() + make_interval(secs => :ttl))
ON CONFLICT (name) DO UPDATE
   SET owner = excluded.owner, token = {t}.token + 1, expires_at = excluded.expires_at
 WHERE {t}.owner IS NULL OR {t}.expires_at <= clock_timestamp()
RETURNING token
"""
_EXTEND = """
UPDATE {t} SET expires_at = clock_timestamp() + make_interval(secs => :ttl)
 WHERE name = :name AND owner = :owner AND token = :token AND expires_at > clock_timestamp()
RETURNING token
"""
_RELEASE = """
UPDATE {t} SET owner = NULL
 WHERE name = :name AND owner = :owner AND token = :token
RETURNING expires_at > clock_timestamp() AS in_time
"""
_STATE = "SELECT owner, token, expires_at > clock_timestamp() AS held FROM {t} WHERE name = :name"


class PostgresLock(LeaseLock):
    """A named lease lock on PostgreSQL (``engine``'s database, table ``<prefix>locks``,
    created by ``mqdedup db init``).

    ``ttl``: seconds a lease lasts unless extended. ``acquire(timeout)`` returns a
    :class:`~mqdedup.locks.base.Lease` whose ``token`` fences the holder's writes
    (:func:`~mqdedup.locks.base.fenced_update`)::

        lock = PostgresLock(engine, "stock:sku-42", ttl=5)
        with lock.hold(timeout=2) as lease:
            with Session(engine) as session, session.begin():
                fenced_update(session, stock, stock.c.sku == "sku-42", {"count": n}, lease.token)
    """

    def __init__(
        self,
        engine: Engine,
        name: str,
        *,
        ttl: float = 10.0,
        prefix: str = DEFAULT_PREFIX,
        poll_interval: float = 0.05,
    ) -> None:
        if not isinstance(engine, Engine):
            raise TypeError(
                "PostgresLock engine must be a SQLAlchemy Engine (mqdedup.create_engine(url)), "
                f"got {type(engine).__name__}"
            )
        if engine.dialect.name != "postgresql":
            raise ConfigurationError(
                f"PostgresLock needs PostgreSQL, not {engine.dialect.name} "
                "(RedisLock is the other store)"
            )
        self.engine = engine
        self.name = check_name(name, 255)
        self.ttl = check_ttl(ttl)
        self.poll_interval = check_seconds(poll_interval, "poll_interval")
        if not isinstance(prefix, str):
            raise TypeError(f"PostgresLock prefix must be a string, got {type(prefix).__name__}")
        self._table = schema(prefix).locks.name

    def try_acquire(self) -> Lease | None:
        """The lease if the lock is free (or its last lease ran out), else None."""
        owner = uuid.uuid4().hex
        started = time.monotonic()
        row = self._execute(_ACQUIRE, name=self.name, owner=owner, ttl=self.ttl)
        if row is None:
            return None
        lease = Lease(self.name, owner, int(row.token), self.ttl, started + self.ttl)
        log.debug("lock acquired", extra={"lock": self.name, "token": lease.token})
        return lease

    def extend(self, lease: Lease) -> Lease:
        """Give ``lease`` another ``ttl`` from now; raise if it expired or was lost."""
        check_lease(lease, self)
        started = time.monotonic()
        row = self._execute(
            _EXTEND, name=self.name, owner=lease.owner, token=lease.token, ttl=self.ttl
        )
        if row is None:
            raise self._why_not(lease, "extended")
        return Lease(self.name, lease.owner, lease.token, self.ttl, started + self.ttl)

    def release(self, lease: Lease) -> None:
        """Free the lock. Raises :class:`LockExpiredError` if the lease had run out
        (freed all the same) and :class:`LockLostError` if another holder has it."""
        check_lease(lease, self)
        row = self._execute(_RELEASE, name=self.name, owner=lease.owner, token=lease.token)
        if row is None:
            raise self._why_not(lease, "released")
        if not row.in_time:
            raise LockExpiredError(
                f"lock {self.name!r} (token {lease.token}) was released after its lease "
                f"of {lease.ttl:g} s ran out: the holder was unprotected since"
            )

    def _why_not(self, lease: Lease, what: str) -> Exception:
        row = self._execute(_STATE, name=self.name)
        if row is not None and row.token == lease.token and row.owner == lease.owner:
            return LockExpiredError(
                f"lock {self.name!r} (token {lease.token}) could not be {what}: its lease "
                f"of {lease.ttl:g} s ran out"
            )
        taken = f"token {row.token}" if row is not None and row.owner else "nobody now"
        return LockLostError(
            f"lock {self.name!r} (token {lease.token}) could not be {what}: its lease ran "
            f"out and another holder took the lock ({taken})"
        )

    def _execute(self, sql: str, **params: Any) -> Any:
        try:
            with self.engine.begin() as connection:
                return connection.execute(text(sql.format(t=self._table)), params).first()
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as exc:
            raise LockUnavailableError(
                f"lock {self.name!r}: cannot reach PostgreSQL at {mask_url(self.engine.url)}: "
                f"{type(exc.orig).__name__ if exc.orig else type(exc).__name__}"
            ) from exc

"""What the lease locks share: the lease, the errors, and the fenced write.

A lease lock alone is not safe: a holder paused past its lease (a GC pause, swap, a
slow network) still believes it holds the lock and writes after another holder took
it. Each acquisition therefore gets a *fencing token*, a number strictly greater than
every token of that lock before it. The guarded resource keeps the highest token that
wrote it, and :func:`fenced_update` refuses a write carrying a smaller one: the paused
holder's late write is refused with :class:`StaleTokenError` instead of overwriting
the newer holder's work. It is the conditional UPDATE of the state transitions
(:mod:`mqdedup.dedup.transitions`) with the token as the condition.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Connection, Table, or_, select, update
from sqlalchemy.orm import Session, scoped_session

from mqdedup.errors import MqdedupError


class LockError(MqdedupError):
    """Base class of the lock errors."""


class LockTimeoutError(LockError, TimeoutError):
    """The lock was not acquired within the timeout: another holder kept it."""


class LockExpiredError(LockError):
    """The lease ran out before it was extended or released: the holder was not
    protected since then (writes through :func:`fenced_update` were still checked)."""


class LockLostError(LockError):
    """Another holder has the lock now (with a greater token): this lease is over."""


class LockUnavailableError(LockError):
    """The lock's store (PostgreSQL, Redis) could not be reached; nothing was changed
    that the caller can rely on."""


class StaleTokenError(LockError):
    """A fenced write carried a token smaller than one that already wrote the row: a
    newer lock holder has been here, the write was refused."""


@dataclass(frozen=True)
class Lease:
    """One acquisition of a lock: its fencing token and until when it is held.

    ``expires_at`` is on this process's ``time.monotonic()`` clock, taken before the
    acquisition was sent, so it never overstates the lease.
    """

    name: str
    owner: str
    token: int
    ttl: float
    expires_at: float

    @property
    def remaining(self) -> float:
        """Seconds left on the lease (as far as this process can tell; <= 0: expired)."""
        return self.expires_at - time.monotonic()


class LeaseLock(ABC):
    """What both stores share: waiting for the lock and holding it in a ``with``."""

    name: str
    poll_interval: float

    @abstractmethod
    def try_acquire(self) -> Lease | None:
        """The lease if the lock is free (or its last lease ran out), else None."""

    @abstractmethod
    def extend(self, lease: Lease) -> Lease:
        """Give ``lease`` another ``ttl`` from now; raise if it expired or was lost."""

    @abstractmethod
    def release(self, lease: Lease) -> None:
        """Free the lock; raise :class:`LockExpiredError` / :class:`LockLostError` if
        the lease had run out / another holder has the lock."""

    def acquire(self, timeout: float = 10.0) -> Lease:
        """Wait up to ``timeout`` seconds for the lock; :class:`LockTimeoutError` after."""
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
        if not timeout >= 0:
            raise ValueError(f"timeout must be 0 seconds or more, got {timeout!r}")
        deadline = time.monotonic() + timeout
        while True:
            lease = self.try_acquire()
            if lease is not None:
                return lease
            if time.monotonic() >= deadline:
                raise LockTimeoutError(
                    f"lock {self.name!r} not acquired within {timeout:g} s: another holder has it"
                )
            time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))

    @contextlib.contextmanager
    def hold(self, timeout: float = 10.0) -> Iterator[Lease]:
        """Acquire, yield the lease, release (the release's errors are raised)."""
        lease = self.acquire(timeout)
        try:
            yield lease
        finally:
            self.release(lease)


def check_ttl(ttl: float) -> float:
    """``ttl`` if it is a usable lease length in seconds (1 ms to 1 day)."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise TypeError(f"a lock ttl must be a number of seconds, got {type(ttl).__name__}")
    if not 0.001 <= ttl <= 86400:
        raise ValueError(f"a lock ttl must be 0.001 to 86400 seconds, got {ttl!r}")
    return float(ttl)


def check_seconds(value: object, what: str) -> float:
    """``value`` as seconds if it is a positive number (``what`` names the argument)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__}")
    if not value > 0:  # also refuses NaN
        raise ValueError(f"{what} must be more than 0 seconds, got {value!r}")
    return float(value)


def check_name(name: object, limit: int | None = None) -> str:
    """``name`` if it is a usable lock name: a non-empty string (of at most ``limit``)."""
    if not isinstance(name, str):
        raise TypeError(f"a lock name must be a string, got {type(name).__name__}")
    if not name or (limit is not None and len(name) > limit):
        size = f"1 to {limit} characters" if limit is not None else "a non-empty string"
        raise ValueError(f"a lock name must be {size}, got {name!r:.80}")
    return name


def check_lease(lease: object, lock: LeaseLock) -> Lease:
    """``lease`` if it is a :class:`Lease` of ``lock``."""
    if not isinstance(lease, Lease):
        raise TypeError(
            f"lease must be the Lease that acquire() returned, got {type(lease).__name__}"
        )
    if lease.name != lock.name:
        raise ValueError(f"lease is of lock {lease.name!r}, not of lock {lock.name!r}")
    return lease


def fenced_update(
    session: Session | Connection | scoped_session[Session],
    table: Table,
    where: ColumnElement[bool],
    values: Mapping[str, Any],
    token: int,
    fence_column: str = "fence_token",
) -> int:
    """UPDATE the rows of ``table`` matching ``where`` with ``values`` only if ``token``
    is at least the one that last wrote each of them; record ``token`` on them.

    All or nothing: ``fence_column`` (an integer column, NULL or 0 before the first
    fenced write) keeps the highest token that wrote the row. First a locking read
    (``SELECT fence_token ... WHERE <where> FOR UPDATE``, row locks where the database
    has them) of the matching rows: if one of them carries a greater token, nothing is
    written and :class:`StaleTokenError` is raised. Then ``UPDATE ... SET ...,
    fence_token = :token WHERE <where> AND (fence_token IS NULL OR fence_token <=
    :token)`` over the rows the read locked, so no other holder writes between the
    check and the write. Returns the rows updated (no match at all returns 0).
    """
    _check_fenced_arguments(session, table, where, values, token, fence_column)
    fence = table.c[fence_column]
    # In primary-key order: two holders stamping overlapping rows lock them in one order.
    locking = select(fence).where(where).order_by(*table.primary_key.columns).with_for_update()
    fences = session.execute(locking).scalars().all()
    newer = max((value for value in fences if value is not None and value > token), default=None)
    if newer is not None:
        raise StaleTokenError(
            f"write to {table.name} refused: fencing token {token} is stale, token "
            f"{newer} of a later lock holder already wrote the row (no row was updated)"
        )
    if not fences:
        return 0
    statement = (
        update(table)
        .where(where, or_(fence.is_(None), fence <= token))
        .values({**values, fence_column: token})
    )
    return int(session.execute(statement).rowcount)  # type: ignore[attr-defined]


def _check_fenced_arguments(
    session: object,
    table: object,
    where: object,
    values: object,
    token: object,
    fence_column: object,
) -> None:
    """Clear errors for arguments of the wrong kind, before any statement runs."""
    if not isinstance(session, Session | Connection | scoped_session):
        raise TypeError(
            "fenced_update session must be a SQLAlchemy Session or Connection, got "
            f"{type(session).__name__}"
        )
    if not isinstance(table, Table):
        raise TypeError(
            f"fenced_update table must be a SQLAlchemy Table, got {type(table).__name__}"
        )
    if not isinstance(where, ColumnElement):
        raise TypeError(
            "fenced_update where must be a SQLAlchemy condition such as table.c.id == 42, "
            f"got {type(where).__name__}"
        )
    if not isinstance(values, Mapping):
        raise TypeError(
            f"fenced_update values must be a mapping of column names to values, got "
            f"{type(values).__name__}"
        )
    if isinstance(token, bool) or not isinstance(token, int):
        raise TypeError(
            f"fenced_update token must be an int (lease.token), got {type(token).__name__}"
        )
    if not isinstance(fence_column, str):
        raise TypeError(
            f"fenced_update fence_column must be a column name, got {type(fence_column).__name__}"
        )
    if fence_column not in table.c:
        raise ValueError(
            f"fenced_update: table {table.name} has no column {fence_column!r} "
            "(add an integer fence_token column, or name yours with fence_column=)"
        )
    unknown = sorted(key for key in values if isinstance(key, str) and key not in table.c)
    if unknown:
        raise ValueError(f"fenced_update: table {table.name} has no column {unknown[0]!r}")

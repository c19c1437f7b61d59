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
from sqlalchemy.orm import Session

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
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0.001 <= ttl <= 86400:
        raise ValueError(f"a lock ttl must be 0.001 to 86400 seconds, got {ttl!r}")
    return float(ttl)


def fenced_update(
    session: Session | Connection,
    table: Table,
    where: ColumnElement[bool],
    values: Mapping[str, Any],
    token: int,
    fence_column: str = "fence_token",
) -> int:
    """UPDATE the rows of ``table`` matching ``where`` with ``values`` only if ``token``
    is at least the one that last wrote them; record ``token`` on them.

    ``fence_column`` (an integer column, NULL or 0 before the first fenced write) keeps
    the highest token that wrote the row. One statement: ``UPDATE ... SET ...,
    fence_token = :token WHERE <where> AND (fence_token IS NULL OR fence_token <=
    :token)``, so the check and the write cannot be separated by another holder. Returns
    the rows updated; raises :class:`StaleTokenError` if a matching row was refused
    because a greater token wrote it (no match at all returns 0).
    """
    fence = table.c[fence_column]
    statement = (
        update(table)
        .where(where, or_(fence.is_(None), fence <= token))
        .values({**values, fence_column: token})
    )
    updated = int(session.execute(statement).rowcount)  # type: ignore[attr-defined]
    if updated:
        return updated
    newer = session.execute(select(fence).where(where, fence > token).limit(1)).first()
    if newer is not None:
        raise StaleTokenError(
            f"write to {table.name} refused: fencing token {token} is stale, token "
            f"{newer[0]} of a later lock holder already wrote the row"
        )
    return 0

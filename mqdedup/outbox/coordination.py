"""Shard coordination: how several relays share one outbox table, behind one protocol.

Rows are spread over ``shards`` shards by the hash of their key; each shard is owned by
at most one relay at a time through a lock held on the relay's dedicated *control
connection*, so a key's rows are published by one relay, in id order. When a relay dies
the database drops its connection and with it every lock; the others take its shards
(its leased rows come back when their lease expires, and a shard just taken over waits
for them, see ``Relay._taken_over``).

The relay uses only :class:`ShardCoordinator`:

* ``open()`` connects, joins as a member and refuses to run beside relays with other
  settings; ``close()`` releases everything (the connection goes);
* ``rebalance()`` acquires or releases shards until this relay holds its fair share
  (``ceil(shards / members)``), see :class:`FairShareCoordinator`;
* ``shard_filter()`` restricts a claim to the owned shards and makes the claim check,
  in its own transaction, that the locks are *still held*: a relay whose control
  connection was lost claims nothing;
* ``wait(timeout)`` sleeps until a commit notification (``notifies``) or the timeout.

Two implementations, chosen by the database's ``shard_locks`` trait
(:func:`mqdedup.db.dialects.traits`) in
:func:`mqdedup.outbox.shard_coordinators.create_coordinator`: PostgreSQL advisory locks
with ``LISTEN`` (:mod:`mqdedup.outbox.postgresql_coordination`) and MySQL/MariaDB named
locks, polled (:mod:`mqdedup.outbox.mysql_coordination`). SQLite has none: one relay,
which polls.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Protocol

from mqdedup.errors import ConfigurationError
from mqdedup.outbox.store import ShardFilter

log = logging.getLogger(__name__)

MAX_SHARDS = 4096


class ShardCoordinator(Protocol):
    """What the relay needs to share an outbox table with other relays."""

    #: The number of shards rows are spread over (the same for every relay of a table).
    shards: int
    #: The shards this relay holds now.
    owned: set[int]
    #: ``wait`` returns early when outbox rows commit (PostgreSQL ``LISTEN``).
    notifies: bool

    @property
    def connected(self) -> bool:
        """True while the control connection is open (it may still turn out broken)."""
        ...

    def open(self) -> None:
        """Connect, join as a member; ConfigurationError if other relays differ."""
        ...

    def rebalance(self) -> set[int]:
        """Acquire or release shards to this relay's fair share; return the owned ones."""
        ...

    def shard_filter(self, shards: set[int] | None = None) -> ShardFilter:
        """The claim filter for ``shards`` (default: all owned), with the still-held check."""
        ...

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a commit notification; True if one came."""
        ...

    def close(self) -> None:
        """Close the control connection: every lock it held is released."""
        ...


class FairShareCoordinator(ABC):
    """The rebalancing both implementations share; they provide the lock primitives.

    Each relay keeps ``ceil(shards / members)`` shards: it releases extra ones between
    batches and takes free ones, starting at a position that depends on its connection
    id so that relays try different shards first.
    """

    notifies = False

    def __init__(self, *, table_name: str, shards: int) -> None:
        if not 1 <= shards <= MAX_SHARDS:
            raise ConfigurationError(
                f"relay shards must be between 1 and {MAX_SHARDS}, got {shards}"
            )
        self.table_name = table_name
        self.shards = shards
        self.owned: set[int] = set()

    # -- what an implementation provides ---------------------------------------------------

    @property
    @abstractmethod
    def backend_pid(self) -> int:
        """The server's id of the control connection (the lock owner it reports)."""

    @abstractmethod
    def _holders(self) -> dict[int, set[int]]:
        """Connection id → the shards it holds, for every held shard lock."""

    @abstractmethod
    def _members(self) -> int:
        """How many relays of this table are members now."""

    @abstractmethod
    def _take(self, shard: int) -> bool:
        """Try to lock ``shard`` without waiting; True if this connection holds it now."""

    @abstractmethod
    def _release(self, shard: int) -> None:
        """Unlock ``shard``."""

    # -- shared ------------------------------------------------------------------------------

    def rebalance(self) -> set[int]:
        """Keep this relay's fair share of shards; return the shards it owns now."""
        holders = self._holders()
        members = max(1, self._members())
        fair = math.ceil(self.shards / members)
        mine = holders.get(self.backend_pid, set())
        if mine != self.owned:  # cannot happen while connected; resync to the server's view
            log.warning("shard locks differ from what the relay believed; resyncing")
            self.owned = set(mine)
        if len(self.owned) > fair:
            for shard in sorted(self.owned, reverse=True)[: len(self.owned) - fair]:
                self._release(shard)
                self.owned.discard(shard)
            log.info("released shards", extra={"owned": len(self.owned), "members": members})
        elif len(self.owned) < fair:
            taken = set().union(*holders.values()) if holders else set()
            free = [shard for shard in range(self.shards) if shard not in taken]
            start = len(self.owned)
            for shard in _rotate(free, self.backend_pid):
                if len(self.owned) >= fair:
                    break
                if self._take(shard):
                    self.owned.add(shard)
            if len(self.owned) != start:
                log.info("took shards", extra={"owned": len(self.owned), "members": members})
        return set(self.owned)


def _rotate(items: list[int], seed: int) -> Iterable[int]:
    """``items`` starting at a seed-dependent position (relays try different shards first)."""
    if not items:
        return []
    start = seed % len(items)
    return items[start:] + items[:start]

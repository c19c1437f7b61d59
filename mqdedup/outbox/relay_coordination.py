"""How one relay shares its outbox table, one class per coordination mode, chosen once
when the relay is built (:func:`relay_coordination`); the relay asks its
:class:`RelayCoordination` and never tests the mode itself.

* :class:`SharedShards` (``coordination = "session"`` on PostgreSQL and MySQL/MariaDB):
  shards owned through locks on a control connection (a
  :class:`~mqdedup.outbox.coordination.ShardCoordinator`), one lease row per relay
  covering its shards, rebalanced between bursts, woken by ``LISTEN`` where there is one;
* :class:`TakingTurns` (``coordination = "transaction"``, PostgreSQL behind a
  transaction pooler): every claim takes a transaction-level advisory lock and a lease
  on every shard (``"*"``), and claims nothing while a session relay is present;
* :class:`SingleRelay` (no shard locks: SQLite): one relay, polling, still waiting for
  the lease of a relay that died before it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from sqlalchemy import Engine

from mqdedup.db.dialects import is_transient
from mqdedup.errors import ConfigurationError
from mqdedup.outbox.coordination import (
    LeaseTakeover,
    ShardCoordinator,
    check_coordination,
    create_coordinator,
)
from mqdedup.outbox.publishers import OutboxRecord
from mqdedup.outbox.store import OutboxStore
from mqdedup.stopping import StopToken

log = logging.getLogger(__name__)
T = TypeVar("T")

#: How relays of one table take turns (``RelayConfig.coordination``).
COORDINATIONS = ("session", "transaction")


def check_coordination_mode(coordination: str) -> None:
    """ConfigurationError (one line) for a coordination mode that does not exist."""
    if coordination not in COORDINATIONS:
        raise ConfigurationError(
            f"relay coordination must be one of {', '.join(COORDINATIONS)}, not {coordination!r}"
        )


class StatementRunner(Protocol):
    """Runs a store statement on the relay's claim connection (``Relay._on("claim", …)``)."""

    def __call__(self, statement: Callable[..., T], *arguments: Any, **options: Any) -> T: ...


class RelayCoordination(Protocol):
    """What a relay asks about sharing its table; one implementation per mode."""

    #: The relay's claim and mark statements run on dedicated connections (several
    #: relays may share the table) rather than on the engine's pool.
    dedicated_connections: bool

    def claim(
        self, run: StatementRunner, brokers: list[str], in_flight: Sequence[int]
    ) -> list[OutboxRecord]:
        """Claim the next batch for ``brokers`` (empty: nothing this relay may claim now)."""
        ...

    def next_maintenance(self) -> float:
        """When (``time.monotonic()``) a burst must end for :meth:`maintain` (inf: never)."""
        ...

    def maintain(self, now: float, retry: Callable[[Callable[[], None]], None]) -> None:
        """Between bursts: rebalance shards when due (``retry`` rides out outages)."""
        ...

    def idle(
        self,
        timeout: float,
        *,
        pause: Callable[[float], bool],
        keepalive: Callable[[], None],
        stop: StopToken,
    ) -> None:
        """Wait up to ``timeout`` s for new rows (a notification) or sleep (``pause``)."""
        ...

    def close(self) -> None:
        """Release whatever the coordination holds (locks, the control connection)."""
        ...


class _Claims:
    """What every mode's claim needs: the store, the relay and its batch settings."""

    def __init__(self, store: OutboxStore, relay_id: str, batch_size: int, lease: float) -> None:
        self.store = store
        self.relay_id = relay_id
        self.batch_size = batch_size
        self.lease = timedelta(seconds=lease)

    def next_maintenance(self) -> float:
        return math.inf

    def maintain(self, now: float, retry: Callable[[Callable[[], None]], None]) -> None:
        return None

    def idle(
        self,
        timeout: float,
        *,
        pause: Callable[[float], bool],
        keepalive: Callable[[], None],
        stop: StopToken,
    ) -> None:
        pause(timeout)

    def close(self) -> None:
        return None


class SingleRelay(_Claims):
    """No shard locks (SQLite): one relay, which polls; all rows are shard 0."""

    dedicated_connections = False

    def __init__(self, engine: Engine, store: OutboxStore, relay_id: str, **batch: Any) -> None:
        super().__init__(store, relay_id, **batch)
        self.takeover = LeaseTakeover(engine, store, relay_id)

    def claim(
        self, run: StatementRunner, brokers: list[str], in_flight: Sequence[int]
    ) -> list[OutboxRecord]:
        """Claim once the lease of a relay that ran before has ended."""
        if not self.takeover.claimable({0}):
            return []
        return run(
            self.store.claim,
            self.relay_id,
            self.batch_size,
            self.lease,
            brokers=brokers,
            shard_filter=None,
            in_flight=in_flight,
        )


class SharedShards(_Claims):
    """``session``: shards owned through the locks of a :class:`ShardCoordinator`."""

    dedicated_connections = True

    def __init__(
        self,
        engine: Engine,
        coordinator: ShardCoordinator,
        store: OutboxStore,
        relay_id: str,
        *,
        rebalance_interval: float,
        **batch: Any,
    ) -> None:
        super().__init__(store, relay_id, **batch)
        self.coordinator = coordinator
        self.takeover = LeaseTakeover(engine, store, relay_id)
        self.rebalance_interval = rebalance_interval
        self._next_rebalance = 0.0

    def claim(
        self, run: StatementRunner, brokers: list[str], in_flight: Sequence[int]
    ) -> list[OutboxRecord]:
        """Claim from the owned shards whose previous owner's lease has ended."""
        control = self.coordinator
        if not control.connected or not control.owned:
            return []
        claimable = self.takeover.claimable(set(control.owned))
        if not claimable:
            return []
        return run(
            self.store.claim,
            self.relay_id,
            self.batch_size,
            self.lease,
            brokers=brokers,
            shard_filter=control.shard_filter(claimable),
            in_flight=in_flight,
        )

    def next_maintenance(self) -> float:
        return self._next_rebalance

    def maintain(self, now: float, retry: Callable[[Callable[[], None]], None]) -> None:
        """Rebalance when due, or at once while the relay owns nothing or is disconnected."""
        control = self.coordinator
        if not control.connected or not control.owned or now >= self._next_rebalance:
            retry(self._rebalance)
            self._next_rebalance = now + self.rebalance_interval

    def _rebalance(self) -> None:
        control = self.coordinator
        try:
            if not control.connected:
                self.takeover.reset()
                control.open()
            control.rebalance()
        except Exception:
            control.close()
            raise

    def idle(
        self,
        timeout: float,
        *,
        pause: Callable[[float], bool],
        keepalive: Callable[[], None],
        stop: StopToken,
    ) -> None:
        """Listen for commit notifications where the coordinator has them, else sleep."""
        control = self.coordinator
        if not (control.notifies and control.connected and control.owned):
            pause(timeout)
            return
        deadline = time.monotonic() + timeout
        # Short slices: heartbeats and stop requests are served while listening.
        while (remaining := deadline - time.monotonic()) > 0 and not stop.requested:
            try:
                if control.wait(min(remaining, 0.5)):
                    break
            except Exception as error:
                if not is_transient(error):
                    raise
                log.warning("relay control connection lost", extra={"error": str(error)})
                control.close()
                break
            keepalive()

    def close(self) -> None:
        self.coordinator.close()


class TakingTurns(_Claims):
    """``transaction``: one relay at a time, each claim under a transaction-level lock."""

    dedicated_connections = False

    def __init__(self, turns_lock: int, store: OutboxStore, relay_id: str, **batch: Any) -> None:
        super().__init__(store, relay_id, **batch)
        self.turns_lock = turns_lock
        #: Relays with session coordination own the table now.
        self.yielding = False

    def claim(
        self, run: StatementRunner, brokers: list[str], in_flight: Sequence[int]
    ) -> list[OutboxRecord]:
        """Claim in turn; nothing while a session relay is present."""
        records = run(
            self.store.claim_in_turn,
            self.relay_id,
            self.batch_size,
            self.lease,
            brokers=brokers,
            lock_class=self.turns_lock,
            in_flight=in_flight,
        )
        self._note_session_relays(records is None)
        return records or []

    def _note_session_relays(self, present: bool) -> None:
        """Say once when relays with session coordination own the table (and when they
        are gone): this relay, taking turns, publishes nothing meanwhile."""
        if present == self.yielding:
            return
        self.yielding = present
        context = {"relay": self.relay_id, "table": self.store.table.name}
        if present:
            log.warning(
                "relays with coordination 'session' run on this outbox table; this relay "
                "(coordination 'transaction') publishes nothing while they do",
                extra=context,
            )
        else:
            log.info(
                "no relay with coordination 'session' left on this outbox table; taking turns",
                extra=context,
            )


def relay_coordination(
    engine: Engine,
    control_engine: Engine | None,
    *,
    coordination: str,
    store: OutboxStore,
    relay_id: str,
    brokers: Sequence[str],
    shards: int,
    listen: bool,
    rebalance_interval: float,
    batch_size: int,
    lease: float,
) -> RelayCoordination:
    """The coordination of a relay in mode ``coordination`` on ``engine``'s database.

    ``transaction``: :class:`TakingTurns`; ``session``: :class:`SharedShards` where the
    database has shard locks (:func:`~mqdedup.outbox.coordination.create_coordinator`),
    else :class:`SingleRelay`. ConfigurationError for settings that cannot work
    (:func:`~mqdedup.outbox.coordination.check_coordination`).
    """
    batch: dict[str, Any] = {"batch_size": batch_size, "lease": lease}
    turns_lock = check_coordination(
        engine, control_engine, coordination, table_name=store.table.name
    )
    if turns_lock is not None:
        return TakingTurns(turns_lock, store, relay_id, **batch)
    coordinator = create_coordinator(
        control_engine or engine,
        table_name=store.table.name,
        channel=store.channel,
        shards=shards,
        fingerprint=",".join(sorted(brokers)),
        listen=listen,
    )
    if coordinator is None:
        return SingleRelay(engine, store, relay_id, **batch)
    return SharedShards(
        engine,
        coordinator,
        store,
        relay_id,
        rebalance_interval=rebalance_interval,
        **batch,
    )

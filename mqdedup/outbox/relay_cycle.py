"""The steps of one relay cycle and the relay's state (:class:`RelayCycle`).

Claim due rows (on the shards this relay owns, once taken over), publish them, settle
them (mark, count refusals, release the rest), each database step through outages; the
loops that drive these steps are in :mod:`mqdedup.outbox.relay`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import Engine

from mqdedup.db.dialects import is_transient, traits
from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.dedup.store import utcnow
from mqdedup.errors import ConfigurationError
from mqdedup.outages import Outages
from mqdedup.outbox.broker_pauses import BrokerPauses
from mqdedup.outbox.coordination import ShardCoordinator
from mqdedup.outbox.lease_takeover import LeaseTakeover
from mqdedup.outbox.publishers import OutboxRecord, Publisher, PublishResult
from mqdedup.outbox.relay_config import RelayConfig
from mqdedup.outbox.relay_connections import RelayConnections
from mqdedup.outbox.relay_metrics import CycleReport, RelayMetrics
from mqdedup.outbox.relay_publishing import publish_records
from mqdedup.outbox.shard_coordinators import create_coordinator
from mqdedup.outbox.store import OutboxStore, ShardFilter
from mqdedup.stopping import StopToken

log = logging.getLogger(__name__)
T = TypeVar("T")


class RelayStoppedError(Exception):
    """A stop was requested while the relay waited for the database."""


class RelayCycle:
    """A relay's state and the steps of its claim → publish → settle cycle.

    The base of :class:`~mqdedup.outbox.relay.Relay` (see there for the arguments).
    """

    def __init__(
        self,
        engine: Engine,
        publishers: Mapping[str, Publisher],
        *,
        prefix: str = DEFAULT_PREFIX,
        config: RelayConfig | None = None,
        relay_id: str | None = None,
    ) -> None:
        if not publishers:
            raise ConfigurationError("a relay needs at least one publisher (kafka or rabbitmq)")
        traits(engine)  # ConfigurationError for a database mqdedup does not support
        self.engine = engine
        self.publishers = dict(publishers)
        self.config = config or RelayConfig()
        self.store = OutboxStore(prefix)
        self.relay_id = relay_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.metrics = RelayMetrics()
        self.stop = StopToken()
        self._brokers = BrokerPauses(publishers, self.config.broker_backoff_max)
        self._control: ShardCoordinator | None = create_coordinator(
            engine,
            table_name=self.store.table.name,
            channel=self.store.channel,
            shards=self.config.shards,
            fingerprint=",".join(sorted(publishers)),
            listen=self.config.listen,
        )
        self._next_rebalance = 0.0
        self._next_purge = 0.0
        self._takeover = LeaseTakeover(engine, self.store, self.relay_id)
        self._connections = RelayConnections(engine, dedicated=self._control is not None)
        self._metrics_lock = threading.Lock()

    def _on(self, name: str, statement: Callable[..., T], *arguments: Any, **options: Any) -> T:
        """Run a store statement on the relay's ``name`` connection (claim / mark)."""
        return self._connections.on(name, statement, *arguments, **options)

    def _claim(self, in_flight: Sequence[int] = ()) -> list[OutboxRecord]:
        """Claim the next batch, skipping ``in_flight`` (this relay's unsettled rows)."""
        brokers = [name for name in self.publishers if name not in self._paused_brokers()]
        if not brokers:
            return []
        shard_filter: ShardFilter | None = None
        control = self._control
        if control is not None:
            if not control.connected or not control.owned:
                return []
            claimable = self._takeover.claimable(set(control.owned))
            if not claimable:
                return []
            shard_filter = control.shard_filter(claimable)
        elif not self._takeover.claimable({0}):
            return []
        return self._on(
            "claim",
            self.store.claim,
            self.relay_id,
            self.config.batch_size,
            timedelta(seconds=self.config.lease),
            brokers=brokers,
            shard_filter=shard_filter,
            in_flight=in_flight,
        )

    def _end_lease(self) -> None:
        """Remove this relay's lease once its batches are settled (shards may move)."""
        self._with_database_retry(lambda: self._on("mark", self.store.end_lease, self.relay_id))

    def _publish_batch(self, records: Sequence[OutboxRecord]) -> CycleReport:
        """Send each broker's records through its publisher (id order per broker)."""
        started = time.monotonic()
        report = publish_records(self.publishers, records, self._broker_result)
        now = utcnow()
        with self._metrics_lock:
            for record in report.published:
                delay = (now - record.created_at).total_seconds()
                self.metrics.histograms.observe("publish_delay_seconds", max(0.0, delay))
            self.metrics.batches += 1
            self.metrics.claimed += len(records)
            self.metrics.seconds_publishing += time.monotonic() - started
        return report

    def _before_mark(self, report: CycleReport) -> None:
        """Hook between publishing and marking (fault-injection tests override it)."""

    def _settle(self, report: CycleReport, background: bool = False) -> None:
        """Mark published rows, count refused ones; the others stay pending."""
        config = self.config
        if report.published:
            published = report.published
            self._with_database_retry(
                lambda: self._on(
                    "mark",
                    self.store.mark_published,
                    published,
                    delete_rows=config.delete_published,
                ),
                background=background,
            )
            with self._metrics_lock:
                self.metrics.published += len(published)
        if report.rejected:
            for record, error in report.rejected:
                log.warning(
                    "broker refused an outbox row; it will be retried",
                    extra={
                        "message_id": record.message_id,
                        "broker": record.broker,
                        "destination": record.destination,
                        "attempt": record.attempts + 1,
                        "error": error,
                    },
                )
            report.failed = self._with_database_retry(
                lambda: self.store.record_failures(
                    self.engine, report.rejected, config.max_attempts, config.row_backoff
                )
            )
            with self._metrics_lock:
                self.metrics.rejected += len(report.rejected)
                self.metrics.failed += len(report.failed)
            for record in report.failed:
                log.error(
                    "outbox row failed after its last attempt; kept as failed",
                    extra={
                        "message_id": record.message_id,
                        "broker": record.broker,
                        "destination": record.destination,
                        "attempts": record.attempts + 1,
                    },
                )
        if report.unavailable:  # left pending as they are: the next claim finds them
            with self._metrics_lock:
                self.metrics.unavailable += len(report.unavailable)

    def _broker_result(self, broker: str, results: Sequence[PublishResult]) -> None:
        if self._brokers.record(broker, results):
            self.metrics.broker_outages += 1

    def _paused_brokers(self) -> set[str]:
        return self._brokers.paused()

    def _keepalive(self) -> None:
        for name, publisher in self.publishers.items():
            try:
                publisher.keepalive()
            except Exception:
                log.warning("publisher keepalive failed", extra={"broker": name}, exc_info=True)

    def _with_database_retry(self, work: Callable[[], T], *, background: bool = False) -> T:
        """Run ``work`` through database outages (:class:`~mqdedup.outages.Outages`).

        ``background``: called from a helper thread, which must not touch the publishers
        (their connections belong to the relay's thread).
        """
        outages = Outages(
            stop=self.stop,
            is_transient=is_transient,
            backoff_max=self.config.database_backoff_max,
            keepalive=self._keepalive,
            on_retry=self._count_database_retry,
            on_change=self._set_outage,
            stopped=RelayStoppedError,
            context={"relay": self.relay_id},
            slice_seconds=0.5,
        )
        return outages.run(work, background=background)

    def _count_database_retry(self) -> None:
        with self._metrics_lock:
            self.metrics.database_retries += 1

    def _set_outage(self, cause: str | None) -> None:
        self.metrics.outage = cause

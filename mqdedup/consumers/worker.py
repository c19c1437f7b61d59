"""The worker loop: fetch a batch, process it, repeat until asked to stop.

This is the only fetch -> process loop: every consumer, whatever its broker, runs
through it (``Consumer.run``). What a batch left unsettled (a dead-letter publish that
failed) is given back to the transport (``Transport.give_back``) to be fetched again;
while batches make no progress but give deliveries back, the worker backs off (longer
each time), so a broken dead-letter target does not become a busy loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.backoff import Backoff
from mqdedup.bridge import in_bridge, run_blocking
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.processor import BatchAbandonedError, BatchReport, Processor
from mqdedup.db.async_engine import sync_engine_of
from mqdedup.db.engine import session_factory
from mqdedup.stopping import StopToken, StopWhileWaiting, run_stoppable

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from mqdedup.consumers.spec import ConsumerSpec
    from mqdedup.consumers.transport import Delivery, Transport

log = logging.getLogger(__name__)


class BatchProcessor(Protocol):
    """What the Worker hands each fetched batch to: the :class:`Processor` (claim ->
    handle -> commit -> settle), or a replay's dry run that only counts."""

    def process(self, deliveries: Sequence[Delivery[Any]]) -> BatchReport:
        """Process and settle one batch; say where each delivery ended."""
        ...


class Worker:
    """Runs one consumer over one transport: the only fetch -> process loop.

    ``run()`` returns when a stop is requested (after finishing and settling the batch
    in flight), or with ``until_idle=True`` when a fetch comes back empty. The
    transport is closed on the way out, which returns unsettled deliveries (also when
    :class:`~mqdedup.stopping.ImmediateStop` or an error ends the run).

    An async consumer (:class:`~mqdedup.consumers.async_consumer.AsyncConsumer`) runs
    the same loop on an event loop, inside the bridge: ``await worker.run_async()``, or
    ``run()``, which starts an event loop of its own when called outside one.
    ``database`` may be an ``AsyncEngine`` (its ``sync_engine`` backs the sessions,
    awaiting the asyncio driver), for synchronous consumers too: the loop then runs
    bridged the same way.
    """

    def __init__(
        self,
        consumer: ConsumerSpec,
        transport: Transport[Any],
        database: Engine | AsyncEngine | sessionmaker[Session] | None,
        *,
        stop: StopToken | None = None,
        metrics: Metrics | None = None,
        log_interval: float | None = None,
        processor: BatchProcessor | None = None,
    ) -> None:
        self.consumer = consumer
        self.transport = transport
        self.stop = stop or StopToken()
        self.metrics = metrics or Metrics()
        #: Runs inside the bridge: an async consumer, or any consumer on an AsyncEngine.
        behind_async = sync_engine_of(database)  # used inside the bridge: awaits its driver
        self.bridged = consumer.asynchronous or behind_async is not None
        engine = behind_async or (database if isinstance(database, Engine) else None)
        sessions = (
            session_factory(engine)
            if engine is not None
            else cast("sessionmaker[Session] | None", database)  # not an engine of any kind
        )
        self.processor: BatchProcessor = processor or Processor(
            consumer, sessions, transport, metrics=self.metrics, stop=self.stop
        )
        self._log_interval = consumer.metrics_interval if log_interval is None else log_interval
        self._last_log = time.monotonic()
        self._unsettled_rounds = 0

    def run(self, *, until_idle: bool = False, max_batches: int | None = None) -> Metrics:
        """Process batches until stopped (or idle); return the counters.

        Deliveries a batch left unsettled are given back to the transport (fetched
        again after a back-off); in an ``until_idle`` run they are kept out until the
        end (closing the transport returns them), so one message that cannot be settled
        does not keep the run from ever becoming idle.
        """
        if self.bridged and not in_bridge():
            return run_blocking(self.run, until_idle=until_idle, max_batches=max_batches)
        batches = 0
        log.info("worker started", extra={"consumer": self.consumer.consumer_name})
        try:
            while not self.stop.requested:
                deliveries = self.transport.fetch(
                    self.consumer.batch_size, self.consumer.poll_timeout
                )
                if not deliveries:
                    if until_idle:
                        break
                    self._log_metrics()
                    continue
                try:
                    report = self.processor.process(deliveries)
                except BatchAbandonedError:
                    log.warning(
                        "batch abandoned on stop (database unavailable); only what had "
                        "committed was settled",
                        extra={"consumer": self.consumer.consumer_name, "size": len(deliveries)},
                    )
                    break
                except StopWhileWaiting as stopped:
                    log.warning(
                        "batch abandoned on stop: %s; it goes back unsettled",
                        stopped,
                        extra={"consumer": self.consumer.consumer_name, "size": len(deliveries)},
                    )
                    break
                batches += 1
                self._log_metrics()
                if max_batches is not None and batches >= max_batches:
                    break
                if not until_idle:
                    self._give_back(report)
        finally:
            self.transport.close()
        log.info(
            "worker stopped",
            extra={
                "consumer": self.consumer.consumer_name,
                **self.metrics.snapshot(histograms=False),
            },
        )
        return self.metrics

    async def run_async(
        self, *, until_idle: bool = False, max_batches: int | None = None
    ) -> Metrics:
        """:meth:`run` on the running event loop (inside the bridge); awaitable.

        Cancelling the task awaiting it is a graceful stop: the batch in flight is
        finished and settled, the transport closed, then ``CancelledError`` propagates.
        A second cancel stops at once (nothing more is settled; the transport is closed).
        """
        return await run_stoppable(
            self.stop, self.run, until_idle=until_idle, max_batches=max_batches
        )

    def _give_back(self, report: BatchReport) -> None:
        """Return what the batch left unsettled to the transport: it is fetched again.

        Not when stopping: closing the transport returns it anyway (to the next owner).
        A batch that settled nothing new (only duplicates and given-back deliveries,
        e.g. a dead-letter target that keeps failing) backs off before the next fetch,
        longer each time, so fetching the same deliveries again is not a busy loop.
        """
        if not report.unsettled or self.stop.requested:
            self._unsettled_rounds = 0
            return
        self.transport.give_back(report.unsettled)
        if report.processed or report.dead_lettered:
            self._unsettled_rounds = 0
            return
        self._unsettled_rounds += 1
        seconds = Backoff(0.5, self.consumer.retry_policy.infrastructure_backoff_max).delay(
            self._unsettled_rounds
        )
        log.warning(
            "messages left unsettled were given back; fetching them again after a back-off",
            extra={
                "consumer": self.consumer.consumer_name,
                "count": len(report.unsettled),
                "seconds": seconds,
            },
        )
        self.stop.wait(seconds)

    def _log_metrics(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= self._log_interval:
            self._last_log = now
            log.info(
                "consumer metrics",
                extra={
                    "consumer": self.consumer.consumer_name,
                    **self.metrics.snapshot(histograms=False),
                },
            )


def run_until_idle(
    consumer: ConsumerSpec, transport: Transport[Any], database: Engine | sessionmaker[Session]
) -> Metrics:
    """Process everything the transport has, then close it (handy in tests)."""
    return Worker(consumer, transport, database).run(until_idle=True)

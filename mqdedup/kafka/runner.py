"""The production loop of a Kafka consumer: one thread polls, another processes.

* The **consumer thread** (the caller of :meth:`KafkaRunner.run`, normally the main
  thread of a worker process) owns the kafka-python consumer: it polls records into a
  bounded buffer, commits settled offsets, seeks rewound partitions, follows rebalances
  and, when the buffer is full (a long batch, a database outage), keeps polling with
  every partition paused so ``max_poll_interval_ms`` never expires.
* The **processing thread** takes up to ``batch_size`` deliveries at a time from the
  buffer, drops those of partitions that were revoked or rewound meanwhile, and runs
  them through the shared :class:`~mqdedup.consumers.processor.Processor`
  (dedup → handle → commit → settle). Deliveries left unsettled (a dead-letter publish
  that failed) rewind their partition so they are fetched and tried again.

Graceful stop: no more fetching; the batch in flight is finished and settled; settled
offsets are committed; the consumer leaves the group. :class:`ImmediateStop` (a second
signal) closes without waiting: unsettled work goes to the next owner, deduplicated.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.processor import BatchAbandonedError, Processor
from mqdedup.consumers.transport import Delivery
from mqdedup.db.engine import session_factory
from mqdedup.kafka.transport import KafkaTransport
from mqdedup.stopping import ImmediateStop, StopToken

if TYPE_CHECKING:
    from mqdedup.kafka.consumer import KafkaConsumer
    from mqdedup.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)

#: Longest a poll blocks, so commits, stops and rebalances are handled promptly.
POLL_SLICE = 0.1
#: How often the consumer thread polls (with paused partitions) while the buffer is full.
KEEPALIVE_INTERVAL = 0.5
#: How often the per-partition lag is refreshed.
LAG_INTERVAL = 1.0


class _Buffer:
    """Deliveries fetched and not yet taken by the processing thread (FIFO)."""

    def __init__(self) -> None:
        self._items: deque[Delivery] = deque()
        self._changed = threading.Condition()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, deliveries: Sequence[Delivery]) -> None:
        with self._changed:
            self._items.extend(deliveries)
            self._changed.notify_all()

    def take(self, max_items: int, timeout: float) -> list[Delivery]:
        """Up to ``max_items`` deliveries, waiting up to ``timeout`` for the first one."""
        with self._changed:
            if not self._items:
                self._changed.wait(timeout)
            taken = [self._items.popleft() for _ in range(min(max_items, len(self._items)))]
            if taken:
                self._changed.notify_all()
            return taken

    def wait(self, timeout: float) -> None:
        """Sleep up to ``timeout`` or until something changes."""
        with self._changed:
            self._changed.wait(timeout)

    def wait_for_room(self, limit: int, timeout: float) -> bool:
        """Wait up to ``timeout`` until fewer than ``limit`` deliveries are buffered."""
        with self._changed:
            return self._changed.wait_for(lambda: len(self._items) < limit, timeout)

    def notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def clear(self) -> int:
        with self._changed:
            dropped = len(self._items)
            self._items.clear()
            return dropped


class KafkaRunner:
    """Runs one :class:`~mqdedup.kafka.consumer.KafkaConsumer` until stopped."""

    def __init__(
        self,
        consumer: KafkaConsumer,
        database: Engine | sessionmaker[Session],
        *,
        stop: StopToken | None = None,
        metrics: Metrics | None = None,
        settings: KafkaSettings | None = None,
    ) -> None:
        self.consumer = consumer
        self.settings = settings or consumer.kafka_settings()
        self.stop = stop or StopToken()
        self.metrics = metrics or Metrics()
        sessions = session_factory(database) if isinstance(database, Engine) else database
        self.transport = KafkaTransport(self.settings, metrics=self.metrics)
        self.processor = Processor(
            consumer, sessions, self.transport, metrics=self.metrics, stop=self.stop
        )
        self._buffer = _Buffer()
        self._closing = threading.Event()
        self._processing_done = threading.Event()
        self._failure: BaseException | None = None
        self._abandoned = False

    # -- the consumer thread ---------------------------------------------------------------

    def run(self) -> Metrics:
        """Consume until a stop is requested; return the counters.

        Raises what made the processing thread fail (e.g. a non-transient database
        error) after committing what was settled and leaving the group.
        """
        name = self.settings.consumer_name
        self.transport.open()
        worker = threading.Thread(
            target=self._process_loop, name=f"mqdedup-kafka-{name}", daemon=True
        )
        immediate = False
        log.info("kafka worker started", extra={"consumer": name})
        try:
            worker.start()
            self._consume_loop()
            self._finish_in_flight(worker)
        except ImmediateStop:
            immediate = True
            log.warning("stopping at once; unsettled messages go to the next owner")
            raise
        finally:
            self._closing.set()
            self._buffer.clear()
            self._buffer.notify()
            if not immediate:
                self.transport.update_lag()
            self.transport.close(commit=not immediate, timeout=2.0 if immediate else 10.0)
            log.info("kafka worker stopped", extra={"consumer": name, **self.metrics.snapshot()})
        if self._failure is not None:
            raise self._failure
        return self.metrics

    def _consume_loop(self) -> None:
        transport = self.transport
        max_buffered = self.settings.max_buffered
        next_lag = time.monotonic()
        next_log = next_lag + self.settings.metrics_interval
        while not (self.stop.requested or self._processing_done.is_set()):
            transport.commit_pending()
            transport.apply_rewinds()
            deliveries: list[Delivery] = []
            room = max_buffered - len(self._buffer)
            if room > 0:
                transport.resume_all()
                deliveries = transport.poll(room, POLL_SLICE)
            elif not self._buffer.wait_for_room(max_buffered, KEEPALIVE_INTERVAL):
                # Still full (a long batch, a database outage): poll with every partition
                # paused, so the group keeps us and rebalances are followed.
                transport.pause_all()
                deliveries = transport.poll(1, 0.0)
            if deliveries:
                self._buffer.put(deliveries)
            now = time.monotonic()
            if now >= next_lag:
                transport.update_lag()
                next_lag = now + LAG_INTERVAL
            if now >= next_log:
                if self.metrics.batches:
                    log.info(
                        "consumer metrics",
                        extra={"consumer": self.settings.consumer_name, **self.metrics.snapshot()},
                    )
                next_log = now + self.settings.metrics_interval

    def _finish_in_flight(self, worker: threading.Thread) -> None:
        """Stopping: stay in the group until the batch in flight is settled, then commit."""
        self.transport.pause_all()
        self._closing.set()
        self._buffer.notify()
        while worker.is_alive():
            self.transport.commit_pending()
            self.transport.poll(1, 0.0)  # keeps max_poll_interval_ms from expiring
            worker.join(POLL_SLICE)
        self.transport.commit_pending(force=True)

    # -- the processing thread -------------------------------------------------------------

    def _process_loop(self) -> None:
        transport = self.transport
        batch_size = self.consumer.batch_size
        failed_rounds = 0
        try:
            while not (self.stop.requested or self._closing.is_set()):
                batch = transport.current(self._buffer.take(batch_size, POLL_SLICE))
                if not batch:
                    continue
                report = self.processor.process(batch)
                self._buffer.notify()
                if not report.unsettled:
                    failed_rounds = 0
                elif not self.stop.requested:
                    # Not settled (a dead-letter publish failed): fetch it again, after a
                    # back-off so a broken dead-letter topic does not become a busy loop.
                    transport.rewind(report.unsettled)
                    failed_rounds += 1
                    self._back_off(failed_rounds)
        except BatchAbandonedError:
            self._abandoned = True
            log.warning(
                "batch abandoned on stop (database unavailable); only what had committed "
                "was settled",
                extra={"consumer": self.settings.consumer_name},
            )
        except BaseException as error:
            self._failure = error
            log.exception(
                "processing failed; the worker stops",
                extra={"consumer": self.settings.consumer_name},
            )
        finally:
            self._processing_done.set()
            self._buffer.notify()

    def _back_off(self, rounds: int) -> None:
        limit = self.consumer.retry_policy.infrastructure_backoff_max
        seconds = min(limit, 0.5 * 2 ** (rounds - 1))
        log.warning(
            "messages left unsettled; retrying them after a back-off",
            extra={"consumer": self.settings.consumer_name, "seconds": seconds},
        )
        self.stop.wait(seconds)

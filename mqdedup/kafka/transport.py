"""The Kafka transport: a consumer-group member that owns its poll thread.

kafka-python's consumer is not thread-safe, and the group drops a member that does not
poll within ``max_poll_interval_ms``. So the transport runs a **poll thread** of its own
(started by :meth:`KafkaTransport.start`), the only thread that touches the
kafka-python consumer (:class:`~mqdedup.kafka.client.KafkaClient`). It

* polls records into a bounded buffer (``max_buffered``: the batch being processed plus
  ``prefetch_batches``); when the buffer is full (a long batch, a database outage) it
  keeps polling with every partition paused, so the group keeps the worker and
  rebalances are followed;
* commits settled offsets (at most every ``commit_interval``), seeks partitions whose
  deliveries were given back, follows rebalances and refreshes the per-partition lag;
* on a stop request hands out nothing more and drops its buffer (not handed out, those
  records come again to the next owner), while still committing what the batch in
  flight settles; on :meth:`~KafkaTransport.close` it commits the settled offsets and
  leaves the group;
* notices a broker outage kafka-python rides out inside its poll (no open connection
  for 2 s, :mod:`mqdedup.kafka.outage`): one WARNING when it starts, one INFO with its
  duration when it ends.

The :class:`~mqdedup.consumers.worker.Worker` thread calls ``fetch`` (takes from the
buffer), ``settle`` and ``give_back`` (recorded in the thread-safe offset tracker; the
poll thread commits / seeks on its next turn) and ``dead_letter`` (the dead-letter
producer, never the consumer). A failure of the poll thread (a non-retriable Kafka
error) is raised by the next ``fetch``: the worker stops with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.errors import BrokerUnavailableError
from mqdedup.kafka.client import KafkaClient
from mqdedup.kafka.outage import OutageWatch, kafka_python_probe
from mqdedup.kafka.records import KafkaToken
from mqdedup.outages import OutageLog
from mqdedup.stopping import StopToken

if TYPE_CHECKING:
    from mqdedup.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)

#: Longest a poll blocks, so commits, seeks, stops and rebalances are handled promptly.
POLL_SLICE = 0.1
#: How often the poll thread polls (with paused partitions) while the buffer is full.
KEEPALIVE_INTERVAL = 0.5
#: How often the per-partition lag is refreshed.
LAG_INTERVAL = 1.0
#: Seconds the poll thread gets to commit and leave the group on close (per step).
CLOSE_TIMEOUT = 10.0
#: Seconds each step of closing (commit, leaving the group, the dead-letter producer)
#: may take once the worker stopped: a stop ends within the Transport contract's 2 s
#: even while Kafka is down. A commit that takes longer is given up: its records come
#: again to the next owner and are deduplicated.
STOP_STEP = 0.5


class _Buffer:
    """Deliveries polled and not yet fetched by the worker (FIFO), with a condition that
    wakes the poll thread (room, a settle) and the worker (new deliveries)."""

    def __init__(self) -> None:
        self._items: deque[Delivery[KafkaToken]] = deque()
        self._changed = threading.Condition()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, deliveries: Sequence[Delivery[KafkaToken]]) -> None:
        with self._changed:
            self._items.extend(deliveries)
            self._changed.notify_all()

    def take(self, max_items: int, timeout: float) -> list[Delivery[KafkaToken]]:
        """Up to ``max_items`` deliveries, waiting up to ``timeout`` for the first one."""
        with self._changed:
            if not self._items and timeout > 0:
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
            self._changed.notify_all()
            return dropped


class KafkaTransport:
    """A :class:`~mqdedup.consumers.transport.Transport` of one consumer-group member.

    Create it with :meth:`~mqdedup.kafka.consumer.KafkaConsumer.create_transport` (or
    construct it and call :meth:`start`); see the module docs for the threads.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        stop: StopToken | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else Metrics()
        self._stop = stop or StopToken()
        #: The kafka-python side; only the poll thread calls its consumer methods.
        self.client = KafkaClient(settings, metrics=self.metrics)
        #: The offsets stored in the database (``offsets_in_database``), written by the
        #: Processor in each batch's transaction; None: the broker's offsets only.
        self.positions = self.client.offset_rows
        self._buffer = _Buffer()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._closing = threading.Event()
        self._failure: BaseException | None = None
        self._closed = False
        #: Stopped during start-up: the poll thread closes the client once it connected.
        self._abandoned = False

    # -- life cycle ----------------------------------------------------------------------

    def start(self) -> KafkaTransport:
        """Start the poll thread: connect and subscribe; return ``self``.

        Raises :class:`~mqdedup.errors.BrokerUnavailableError` when no bootstrap server
        answers within ``connect_timeout`` and :class:`~mqdedup.errors.ConfigurationError`
        for settings kafka-python rejects.
        """
        if self._thread is not None:
            return self
        self._thread = threading.Thread(
            target=self._run,
            name=f"mqdedup-kafka-poll[{self.settings.consumer_name}]",
            daemon=True,
        )
        self._thread.start()
        connect = float(self.settings.consumer_config.get("bootstrap_timeout_ms", 30_000)) / 1000
        deadline = time.monotonic() + connect + CLOSE_TIMEOUT
        while not self._ready.wait(POLL_SLICE):
            if self._stop.requested:
                # A stop during start-up (Kafka unreachable): kafka-python's bootstrap
                # cannot be interrupted, so the poll thread is left to finish it and
                # close the client; this transport hands out nothing.
                log.info(
                    "stop requested while connecting to Kafka; not consuming",
                    extra={"consumer": self.settings.consumer_name},
                )
                self._abandoned = True
                self._closed = True
                self._closing.set()
                return self
            if time.monotonic() >= deadline:
                break
        if not self._ready.is_set():
            self.close()
            raise BrokerUnavailableError(
                f"Kafka at {','.join(self.settings.bootstrap_servers)} did not answer "
                f"within {connect:.0f}s"
            )
        if self._failure is not None:
            self._thread.join(timeout=CLOSE_TIMEOUT)
            self._closed = True
            raise self._failure
        return self

    def close(self) -> None:
        """Commit what is settled, leave the group, disconnect (waits for the poll thread).

        Deliveries not settled are not committed: the next owner of their partition
        gets them again (deduplicated).
        """
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._buffer.notify()
        thread = self._thread
        if thread is None:
            self.client.close(commit=False)  # never started: only the producer to release
            return
        if thread is not threading.current_thread():
            thread.join(timeout=3 * CLOSE_TIMEOUT + 5)
            if thread.is_alive():
                log.warning(
                    "Kafka poll thread did not stop in time; abandoning it",
                    extra={"consumer": self.settings.consumer_name},
                )

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    # -- the Transport protocol ----------------------------------------------------------

    def fetch(self, max_messages: int, timeout: float) -> list[Delivery[KafkaToken]]:
        """Up to ``max_messages`` polled deliveries, waiting at most ``timeout`` seconds.

        Returns nothing once a stop is requested. Raises what stopped the poll thread.
        """
        deadline = time.monotonic() + timeout
        while True:
            self._raise_if_failed()
            if self._stop.requested or self._closed:
                return []
            remaining = deadline - time.monotonic()
            taken = self._buffer.take(max_messages, min(max(remaining, 0.0), POLL_SLICE))
            # Deliveries of partitions revoked or given back meanwhile are dropped.
            batch = self.client.current(taken)
            if batch:
                return batch
            if remaining <= 0:
                return []

    def settle(self, deliveries: Sequence[Delivery[KafkaToken]]) -> None:
        """Mark deliveries settled; the poll thread commits their offsets contiguously.

        Deliveries of revoked partitions (or given back meanwhile) are ignored: they are
        fetched again, by this or another worker, and deduplicated.
        """
        self.client.settle(deliveries)
        self._buffer.notify()  # wake the poll thread to commit

    def give_back(self, deliveries: Sequence[Delivery[KafkaToken]]) -> None:
        """Fetch these unsettled deliveries again: their partition seeks back to the first.

        Later deliveries of the same partition already polled are dropped and come
        again after it (in order, marked redelivered). Ignored for partitions that were
        revoked meanwhile (the next owner gets them anyway).
        """
        self.client.give_back(deliveries)
        self._buffer.notify()  # wake the poll thread to seek

    def dead_letter(self, delivery: Delivery[KafkaToken], record: DeadLetter) -> None:
        """Publish the original record with ``record``'s headers; wait for the broker's ack.

        See :meth:`KafkaClient.dead_letter` for the errors it raises.
        """
        self.client.dead_letter(delivery, record)

    def keepalive(self) -> None:
        """Nothing to do: the poll thread keeps the group membership all the time."""

    # -- the poll thread -----------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _run(self) -> None:
        try:
            self.client.open()
        except BaseException as error:
            self._failure = error
            self._ready.set()
            self.client.close(commit=False)
            return
        self._ready.set()
        if self._abandoned:
            # Stopped during start-up (see start): nothing consumed, nothing to commit.
            self.client.close(commit=False)
            return
        failed = False
        try:
            self._poll_loop()
        except BaseException as error:
            failed = True
            self._failure = error
            log.exception(
                "Kafka poll thread failed; the worker stops",
                extra={"consumer": self.settings.consumer_name},
            )
        finally:
            self._buffer.clear()
            if not failed:
                self.client.update_lag()
            self.client.close(commit=True, timeout=STOP_STEP)

    def _poll_loop(self) -> None:
        client = self.client
        limit = self.settings.max_buffered
        next_lag = time.monotonic()
        outage = OutageWatch(
            OutageLog("kafka", logger=log, context={"consumer": self.settings.consumer_name}),
            kafka_python_probe(client.client),
        )
        while not self._closing.is_set():
            # A commit in flight holds this thread: bounded by STOP_STEP (not the consumer's
            # commit_timeout alone, 10 s), so a stop while the broker is down ends within
            # its bound. A commit that times out is retried on a later turn; an offset not
            # committed yet only means redeliveries, deduplicated.
            client.commit_due(STOP_STEP)
            client.apply_rewinds()
            if self._stop.requested:
                # Stopping: hand out nothing more, stay in the group until close.
                self._buffer.clear()
                client.pause_all()
                client.poll(1, 0.0)  # polled records stay unsettled: the next owner's
                self._buffer.wait(POLL_SLICE)
            elif len(self._buffer) < limit:
                client.resume_all()
                deliveries = client.poll(limit - len(self._buffer), POLL_SLICE)
                if deliveries:
                    self._buffer.put(deliveries)
                    outage.working()
                else:
                    outage.idle()
            elif not self._buffer.wait_for_room(limit, KEEPALIVE_INTERVAL):
                # Still full (a long batch, a database outage): poll with every partition
                # paused, so the group keeps us and rebalances are followed.
                client.pause_all()
                deliveries = client.poll(1, 0.0)
                if deliveries:  # a rebalance assigned fresh, unpaused partitions
                    self._buffer.put(deliveries)
            now = time.monotonic()
            if now >= next_lag:
                client.update_lag()
                next_lag = now + LAG_INTERVAL

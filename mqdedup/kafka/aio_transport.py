"""The aiokafka transport: a consumer-group member on the event loop, for async consumers.

It implements the same synchronous :class:`~mqdedup.consumers.transport.Transport` as
the kafka-python transport, but only inside the greenlet bridge
(:mod:`mqdedup.bridge`): each method awaits the aiokafka coroutine with
:func:`~mqdedup.bridge.wait_for`, so the one Worker and Processor run unchanged on the
event loop while aiokafka's own tasks (heartbeats, fetcher, coordinator) keep running
on it. Called outside the bridge, a method raises a clear error.

A **poll task** on the loop plays the part of the kafka-python transport's poll thread:

* it polls records into a bounded buffer (``max_buffered``: the batch being processed
  plus ``prefetch_batches``); when the buffer is full (a long batch, a database outage)
  it keeps a ``getmany`` open with every partition paused, so aiokafka never counts the
  member as idle (``max_poll_interval_ms``) and the group keeps it;
* it commits settled offsets (at most every ``commit_interval``; ``settle`` commits at
  once when the interval has passed) and seeks partitions whose deliveries were given
  back (:mod:`mqdedup.kafka.rewinds`);
* on a stop request it hands out nothing more and drops its buffer.

Offsets are committed only for settled deliveries and only contiguously
(:class:`~mqdedup.kafka.offsets.OffsetTracker`, shared with the kafka-python transport).
The rebalance listener commits what is settled before partitions are revoked (awaited:
aiokafka waits for the listener) and drops their buffered and in-flight deliveries;
their settles are then ignored and the next owner gets them again, deduplicated. A
graceful close commits with the clean-stop marker (:mod:`mqdedup.kafka.clean_stop`), so
the next owner need not treat the first records as possibly redelivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Collection, Mapping, Sequence
from typing import Any, TypeVar

import aiokafka  # type: ignore[import-untyped]
import aiokafka.errors as aio_errors  # type: ignore[import-untyped]
from aiokafka.abc import ConsumerRebalanceListener  # type: ignore[import-untyped]
from aiokafka.structs import TopicPartition  # type: ignore[import-untyped]

from mqdedup.bridge import in_bridge, wait_for
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.kafka.aio_dead_letters import AioKafkaDeadLetters
from mqdedup.kafka.aio_settings import AioKafkaSettings
from mqdedup.kafka.clean_stop import CLEAN_STOP_METADATA
from mqdedup.kafka.offsets import OffsetTracker, PartitionKey
from mqdedup.kafka.records import KafkaToken, describe_error, partition_key, to_message
from mqdedup.kafka.rewinds import request_rewinds, seek_rewinds
from mqdedup.stopping import StopToken

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest a ``getmany`` waits, so commits, seeks, stops and rebalances are handled promptly.
POLL_SLICE = 0.1
#: How often the per-partition lag is refreshed.
LAG_INTERVAL = 1.0
#: Seconds to commit and to leave the group on close (per step).
CLOSE_TIMEOUT = 10.0
#: Pause of the poll task after a retriable error.
RETRY_PAUSE = 0.5

_REBALANCE_ERRORS: tuple[type[BaseException], ...] = (
    aio_errors.CommitFailedError,
    aio_errors.RebalanceInProgressError,
    aio_errors.IllegalGenerationError,
    aio_errors.UnknownMemberIdError,
    aio_errors.IllegalStateError,
)


def require_bridge(operation: str) -> None:
    """Raise when an aio transport method is called outside the greenlet bridge."""
    if not in_bridge():
        raise RuntimeError(
            f"{operation} is an asyncio transport method: call it inside the greenlet "
            "bridge on the event loop (mqdedup.bridge.run_bridged; AsyncKafkaConsumer "
            "does that in run / run_async), not from plain synchronous code"
        )


class AioKafkaTransport:
    """A :class:`~mqdedup.consumers.transport.Transport` over aiokafka (see the module docs).

    Create it with :meth:`~mqdedup.kafka.aio_consumer.AsyncKafkaConsumer.create_transport`
    inside the bridge (or construct it and call :meth:`start` there).
    """

    def __init__(
        self,
        settings: AioKafkaSettings,
        *,
        stop: StopToken | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else Metrics()
        self._stop = stop or StopToken()
        base = settings.base
        # Possibly redelivered after an assignment: the batch a dead previous owner was
        # handling plus the batches it settled since its last commit.
        self.tracker = OffsetTracker(redelivery_window=base.max_buffered)
        self.dead_letters = AioKafkaDeadLetters(settings)
        self._consumer: Any = None
        self._buffer: deque[Delivery[KafkaToken]] = deque()
        self._arrived: asyncio.Event | None = None
        self._poll_task: asyncio.Task[None] | None = None
        self._commit_lock: asyncio.Lock | None = None
        self._next_commit = 0.0
        #: Freshly assigned partitions whose previous owner's stop is not checked yet.
        self._unchecked: set[PartitionKey] = set()
        self._failure: BaseException | None = None
        self._closing = False
        self._closed = False

    # -- life cycle ----------------------------------------------------------------------

    def start(self) -> AioKafkaTransport:
        """Connect and subscribe (inside the bridge); return ``self``.

        Raises :class:`~mqdedup.errors.BrokerUnavailableError` when no bootstrap server
        answers within ``connect_timeout`` and :class:`~mqdedup.errors.ConfigurationError`
        for settings aiokafka rejects.
        """
        require_bridge("AioKafkaTransport.start")
        if self._consumer is None:
            wait_for(self._start())
        return self

    def close(self) -> None:
        """Commit what is settled (clean-stop marker), leave the group, disconnect.

        Deliveries not settled are not committed: the next owner of their partition gets
        them again (deduplicated).
        """
        if self._closed:
            return
        require_bridge("AioKafkaTransport.close")
        self._closed = True
        wait_for(self._close())

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    # -- the Transport protocol ----------------------------------------------------------

    def fetch(self, max_messages: int, timeout: float) -> list[Delivery[KafkaToken]]:
        """Up to ``max_messages`` polled deliveries, waiting at most ``timeout`` seconds.

        Returns nothing once a stop is requested. Raises what stopped the poll task.
        """
        require_bridge("AioKafkaTransport.fetch")
        return wait_for(self._fetch(max_messages, timeout))

    def settle(self, deliveries: Sequence[Delivery[KafkaToken]]) -> None:
        """Mark deliveries settled and commit their offsets contiguously.

        The commit is awaited here when ``commit_interval`` has passed since the last
        one (else the poll task makes it in time). Deliveries of revoked partitions (or
        given back meanwhile) are ignored: they are fetched again and deduplicated.
        """
        require_bridge("AioKafkaTransport.settle")
        settled = 0
        for delivery in deliveries:
            token = delivery.token
            if self.tracker.settle(token.partition, token.offset, token.epoch):
                settled += 1
        if settled and time.monotonic() >= self._next_commit:
            wait_for(self._commit_pending())

    def give_back(self, deliveries: Sequence[Delivery[KafkaToken]]) -> None:
        """Fetch these unsettled deliveries again: their partition seeks back to the first.

        Later deliveries of the same partition already polled are dropped and come again
        after it. Ignored for partitions revoked meanwhile.
        """
        require_bridge("AioKafkaTransport.give_back")
        request_rewinds(self.tracker, deliveries, self.settings.consumer_name)
        self._wake()

    def dead_letter(self, delivery: Delivery[KafkaToken], record: DeadLetter) -> None:
        """Publish the original record with ``record``'s headers; wait for the broker's ack.

        See :meth:`AioKafkaDeadLetters.publish` for the errors it raises.
        """
        require_bridge("AioKafkaTransport.dead_letter")
        if self._closed:
            raise BrokerUnavailableError("the Kafka transport is closed")
        wait_for(self.dead_letters.publish(delivery.token, record))

    def keepalive(self) -> None:
        """Nothing to do: the poll task keeps the group membership while the loop runs."""

    # -- coroutines --------------------------------------------------------------------------

    async def _start(self) -> None:
        settings = self.settings
        self._arrived = asyncio.Event()
        self._commit_lock = asyncio.Lock()
        try:
            consumer = aiokafka.AIOKafkaConsumer(**settings.consumer)
        except (TypeError, ValueError, aio_errors.KafkaError) as error:
            raise ConfigurationError(f"invalid aiokafka settings: {error}") from error
        listener = _RebalanceListener(self)
        if settings.base.pattern is not None:
            consumer.subscribe(pattern=settings.base.pattern, listener=listener)
        else:
            consumer.subscribe(topics=list(settings.base.topics), listener=listener)
        try:
            await asyncio.wait_for(consumer.start(), settings.connect_timeout)
        except (aio_errors.KafkaError, TimeoutError, OSError) as error:
            await _quietly(consumer.stop())
            raise BrokerUnavailableError(
                f"cannot reach Kafka at {','.join(settings.base.bootstrap_servers)}: "
                f"{describe_error(error)}"
            ) from error
        self._consumer = consumer
        self._poll_task = asyncio.get_running_loop().create_task(
            self._poll_loop(), name=f"mqdedup-aiokafka-poll[{settings.consumer_name}]"
        )
        log.info(
            "kafka consumer connected (aiokafka)",
            extra={
                "consumer": settings.consumer_name,
                "group_id": settings.base.group_id,
                "topics": list(settings.base.topics) or settings.base.pattern,
                "bootstrap": ",".join(settings.base.bootstrap_servers),
            },
        )

    async def _close(self) -> None:
        self._closing = True
        self._wake()
        task, self._poll_task = self._poll_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        consumer = self._consumer
        if consumer is not None:
            if self._failure is None:
                assigned = self._assigned()
                offsets = {k: v for k, v in self.tracker.to_commit().items() if k in assigned}
                clean = {k: v for k, v in self.tracker.clean_offsets().items() if k in assigned}
                await self._commit({**clean, **offsets}, CLOSE_TIMEOUT, clean=set(clean))
            self._buffer.clear()
            await _quietly(consumer.stop())
        await self.dead_letters.close()

    async def _fetch(self, max_messages: int, timeout: float) -> list[Delivery[KafkaToken]]:
        assert self._arrived is not None
        deadline = time.monotonic() + timeout
        while True:
            if self._failure is not None:
                raise self._failure
            if self._stop.requested or self._closed:
                return []
            if self._buffer:
                taken = [
                    self._buffer.popleft() for _ in range(min(max_messages, len(self._buffer)))
                ]
                # Deliveries of partitions revoked or given back meanwhile are dropped.
                batch = [
                    d for d in taken if self.tracker.is_current(d.token.partition, d.token.epoch)
                ]
                if batch:
                    return batch
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            self._arrived.clear()
            # Bounded slices: a stop request (a thread-safe flag) is seen promptly.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), min(remaining, POLL_SLICE * 5))

    async def _poll_loop(self) -> None:
        consumer = self._consumer
        limit = self.settings.base.max_buffered
        next_lag = time.monotonic()
        while not self._closing:
            try:
                if time.monotonic() >= self._next_commit:
                    await self._commit_pending()
                seek_rewinds(consumer, self.tracker)
                if self._stop.requested:
                    # Stopping: hand out nothing more, stay in the group until close.
                    self._buffer.clear()
                    self._pause_all()
                    await consumer.getmany(timeout_ms=int(POLL_SLICE * 1000), max_records=1)
                elif len(self._buffer) < limit:
                    self._resume_all()
                    batches = await consumer.getmany(
                        timeout_ms=int(POLL_SLICE * 1000), max_records=limit - len(self._buffer)
                    )
                    await self._take_in(batches)
                else:
                    # Full (a long batch, a database outage): a getmany with every
                    # partition paused keeps the member active in the group.
                    self._pause_all()
                    batches = await consumer.getmany(timeout_ms=int(POLL_SLICE * 1000))
                    await self._take_in(batches)  # a rebalance assigned unpaused partitions
                if time.monotonic() >= next_lag:
                    self._update_lag()
                    next_lag = time.monotonic() + LAG_INTERVAL
            except asyncio.CancelledError:
                raise
            except aio_errors.KafkaError as error:
                if not _retriable(error):
                    self._fail(error)
                    return
                log.warning(
                    "kafka poll failed; retrying",
                    extra={"consumer": self.settings.consumer_name, "error": describe_error(error)},
                )
                await asyncio.sleep(RETRY_PAUSE)
            except Exception as error:
                self._fail(error)
                return

    def _fail(self, error: BaseException) -> None:
        self._failure = error
        log.error(
            "aiokafka poll task failed; the worker stops",
            extra={"consumer": self.settings.consumer_name, "error": describe_error(error)},
        )
        self._wake()

    async def _take_in(self, batches: Mapping[Any, Sequence[Any]]) -> None:
        """Track polled records as deliveries and buffer them."""
        added = 0
        for topic_partition, records in batches.items():
            key = partition_key(topic_partition)
            if key in self._unchecked and records:
                await self._check_previous_owner(key, topic_partition, records[0].offset)
            for record in records:
                tracked = self.tracker.track_redelivered(key, record.offset)
                if tracked is None:
                    continue  # its partition is being rewound; it will come again
                epoch, redelivered = tracked
                self._buffer.append(
                    Delivery(
                        to_message(record, redelivered),
                        KafkaToken(key, record.offset, epoch, record),
                    )
                )
                added += 1
        if added:
            self._wake()

    async def _check_previous_owner(
        self, key: PartitionKey, topic_partition: Any, start: int
    ) -> None:
        """Before the first records of a fresh assignment: is the careful window needed?

        Not when the previous owner stopped gracefully (its last commit carries the
        clean-stop marker) nor when nobody ever committed. Either way the start offset is
        first committed without the marker, so a death from now on leaves a trace.
        """
        self._unchecked.discard(key)
        try:
            # aiokafka's public committed() drops the metadata; its coordinator has it.
            answer = await asyncio.wait_for(
                self._consumer._coordinator.fetch_committed_offsets([topic_partition]),
                self.settings.base.commit_timeout,
            )
        except Exception:
            return  # unknown: keep the careful window
        committed = answer.get(topic_partition)
        clean = (
            committed is None or committed.offset < 0 or committed.metadata == CLEAN_STOP_METADATA
        )
        if clean and await self._commit({key: start}, self.settings.base.commit_timeout):
            self.tracker.expect_clean(key)

    async def _commit_pending(self) -> bool:
        """Commit settled offsets not committed yet; True when nothing is left to commit."""
        assigned = self._assigned()
        offsets = {k: v for k, v in self.tracker.to_commit().items() if k in assigned}
        if not offsets:
            return True
        ok = await self._commit(offsets, self.settings.base.commit_timeout)
        interval = self.settings.base.commit_interval
        self._next_commit = time.monotonic() + (interval if ok else max(1.0, interval))
        return ok

    async def _commit(
        self,
        offsets: Mapping[PartitionKey, int],
        timeout: float,
        *,
        clean: Collection[PartitionKey] = (),
    ) -> bool:
        """Commit ``offsets`` (``clean``: with the clean-stop marker); True when committed.

        A failed commit is logged, never fatal: its messages may come again, deduplicated.
        """
        if not offsets or self._consumer is None:
            return True
        assert self._commit_lock is not None
        request = {
            TopicPartition(*key): (offset, CLEAN_STOP_METADATA if key in clean else "")
            for key, offset in offsets.items()
        }
        async with self._commit_lock:
            try:
                await asyncio.wait_for(self._consumer.commit(request), timeout)
            except _REBALANCE_ERRORS as error:
                log.warning(
                    "offset commit failed because of a rebalance; redeliveries will be "
                    "deduplicated",
                    extra={"consumer": self.settings.consumer_name, "error": describe_error(error)},
                )
                return False
            except (aio_errors.KafkaError, TimeoutError, OSError) as error:
                log.warning(
                    "offset commit failed; will retry",
                    extra={"consumer": self.settings.consumer_name, "error": describe_error(error)},
                )
                return False
        self.tracker.committed(dict(offsets))
        return True

    # -- rebalances (called by the listener, awaited by aiokafka) --------------------------

    async def _revoked(self, keys: list[PartitionKey]) -> None:
        """Commit what is settled of ``keys``, then drop their buffered and in-flight work.

        aiokafka rebalances eagerly and starts every (re)assigned partition at its
        committed offset, so nothing of a revoked partition may carry on.
        """
        wanted = set(keys)
        uncommitted = {k: v for k, v in self.tracker.to_commit().items() if k in wanted}
        clean = {k: v for k, v in self.tracker.clean_offsets().items() if k in wanted}
        if self._failure is None and not self._closed:
            await self._commit(
                {**clean, **uncommitted}, self.settings.base.commit_timeout, clean=set(clean)
            )
        self.tracker.revoke(keys)
        self._unchecked.difference_update(keys)
        self._buffer = deque(d for d in self._buffer if d.token.partition not in wanted)
        for key in keys:
            self.metrics.lag.pop(f"{key[0]}/{key[1]}", None)
        log.info(
            "partitions revoked",
            extra={
                "consumer": self.settings.consumer_name,
                "partitions": _names(keys),
                "committing": {f"{k[0]}/{k[1]}": v for k, v in uncommitted.items()},
            },
        )

    def _assigned(self) -> set[PartitionKey]:
        if self._consumer is None:
            return set()
        return {partition_key(tp) for tp in self._consumer.assignment() or ()}

    def _partitions_assigned(self, keys: list[PartitionKey]) -> None:
        self.tracker.assign(keys)
        self._unchecked.update(keys)
        log.info(
            "partitions assigned",
            extra={"consumer": self.settings.consumer_name, "partitions": _names(keys)},
        )

    # -- helpers -----------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._arrived is not None:
            self._arrived.set()

    def _pause_all(self) -> None:
        consumer = self._consumer
        unpaused = set(consumer.assignment() or ()) - set(consumer.paused() or ())
        if unpaused:
            consumer.pause(*unpaused)

    def _resume_all(self) -> None:
        paused = set(self._consumer.paused() or ())
        if paused:
            self._consumer.resume(*paused)

    def _update_lag(self) -> None:
        """``topic/partition -> lag``: high-water mark minus the committed / next offset."""
        lag: dict[str, int] = {}
        for topic_partition in self._consumer.assignment() or ():
            key = partition_key(topic_partition)
            high_water = self._consumer.highwater(topic_partition)
            position = self.tracker.committed_offset(key)
            if position is None:
                position = self.tracker.next_offset(key)
            if high_water is None or position is None:
                continue
            lag[f"{key[0]}/{key[1]}"] = max(0, int(high_water) - position)
        self.metrics.lag = lag


class _RebalanceListener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Keeps the transport's offset tracker in step with aiokafka's assignment."""

    def __init__(self, transport: AioKafkaTransport) -> None:
        self.transport = transport

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.transport._revoked([partition_key(tp) for tp in revoked])

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.transport._partitions_assigned([partition_key(tp) for tp in assigned])


def _retriable(error: BaseException) -> bool:
    return bool(getattr(error, "retriable", False)) or isinstance(
        error,
        aio_errors.KafkaConnectionError
        | aio_errors.KafkaTimeoutError
        | aio_errors.NodeNotReadyError,
    )


def _names(keys: Collection[PartitionKey]) -> list[str]:
    return [f"{topic}/{partition}" for topic, partition in sorted(keys)]


async def _quietly(awaitable: Awaitable[T]) -> None:
    try:
        await asyncio.wait_for(awaitable, CLOSE_TIMEOUT)
    except Exception as error:
        log.warning(
            "kafka consumer did not stop cleanly (aiokafka)", extra={"error": describe_error(error)}
        )

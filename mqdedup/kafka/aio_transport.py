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
* on a stop request it hands out nothing more and drops its buffer;
* it notices a broker outage aiokafka rides out inside ``getmany`` (no fetch response
  for a few seconds, :mod:`mqdedup.kafka.outage`): one WARNING when it starts, one INFO
  with its duration when it ends.

Offsets are committed only for settled deliveries and only contiguously
(:class:`~mqdedup.kafka.offsets.OffsetTracker`, shared with the kafka-python transport).
The rebalance listener commits what is settled before partitions are revoked (awaited:
aiokafka waits for the listener) and drops their buffered and in-flight deliveries;
their settles are then ignored and the next owner gets them again, deduplicated. A
graceful close commits with the clean-stop marker (:mod:`mqdedup.kafka.clean_stop`), so
the next owner need not treat the first records as possibly redelivered.

**Start-up** waits ``connect_timeout`` for an unreachable cluster, as the kafka-python
transport does: aiokafka gives up a bootstrap after one round of its servers (1–2 s),
so the start is attempted again (with a fresh client, ``START_RETRY`` apart) until the
deadline. A stop request (or cancelling the task of ``run_async``) during start-up ends
it within ``START_SLICE``: the transport is then unconnected and hands out nothing.
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

from mqdedup.bridge import in_bridge, wait_for
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.kafka.aio_commits import AioOffsetCommits
from mqdedup.kafka.aio_dead_letters import AioKafkaDeadLetters
from mqdedup.kafka.aio_settings import AioKafkaSettings
from mqdedup.kafka.offsets import OffsetTracker, PartitionKey
from mqdedup.kafka.outage import OutageWatch, aiokafka_probe
from mqdedup.kafka.records import KafkaToken, describe_error, partition_key, to_message
from mqdedup.kafka.rewinds import request_rewinds, seek_rewinds
from mqdedup.outages import OutageLog
from mqdedup.stopping import StopToken

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest a ``getmany`` waits, so commits, seeks, stops and rebalances are handled promptly.
POLL_SLICE = 0.1
#: How often the per-partition lag is refreshed.
LAG_INTERVAL = 1.0
#: Seconds to commit and to leave the group on close (per step), so that a stop ends
#: within the Transport contract's 2 s even while Kafka is down. A commit that takes
#: longer is given up: its records come again to the next owner, deduplicated.
CLOSE_TIMEOUT = 0.5
#: Pause of the poll task after a retriable error.
RETRY_PAUSE = 0.5
#: Seconds between two start attempts while no bootstrap server answers.
START_RETRY = 1.0
#: Longest wait of a start attempt between two looks at the stop token.
START_SLICE = 0.1


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
        self.commits = AioOffsetCommits(settings, self.tracker)
        #: Freshly assigned partitions whose previous owner's stop is not checked yet.
        self._unchecked: set[PartitionKey] = set()
        self._failure: BaseException | None = None
        self._closing = False
        self._closed = False
        #: Steps of closing that outlived their timeout (kept referenced until done).
        self._left_running: set[asyncio.Future[Any]] = set()

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
        if settled and self.commits.due and not self._stop.requested:
            # (Stopping: close commits them, within CLOSE_TIMEOUT even if Kafka is down.)
            wait_for(self.commits.commit_pending())

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
        deadline = time.monotonic() + settings.connect_timeout
        attempt = 0
        while True:
            attempt += 1
            consumer = self._new_consumer()
            try:
                started = await self._unless_stopped(consumer.start(), deadline)
            except (aio_errors.KafkaError, TimeoutError, OSError) as error:
                await _quietly(consumer.stop(), START_RETRY)
                if time.monotonic() >= deadline - START_SLICE or not _retriable_start(error):
                    raise BrokerUnavailableError(
                        f"cannot reach Kafka at {','.join(settings.base.bootstrap_servers)} "
                        f"within {settings.connect_timeout:g}s: {describe_error(error)}"
                    ) from error
                log.log(
                    logging.WARNING if attempt == 1 else logging.DEBUG,
                    "cannot reach Kafka; retrying until connect_timeout",
                    extra={
                        "consumer": settings.consumer_name,
                        "error": describe_error(error),
                        "connect_timeout": settings.connect_timeout,
                    },
                )
                pause = min(START_RETRY, deadline - time.monotonic())
                if await self._unless_stopped(asyncio.sleep(pause), deadline + 1):
                    continue
                started = False
            if not started:  # a stop request
                await _quietly(consumer.stop(), START_RETRY)
                log.info(
                    "stop requested while connecting to Kafka; not consuming",
                    extra={"consumer": settings.consumer_name},
                )
                return
            break
        self._consumer = consumer
        self.commits.consumer = consumer
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

    def _new_consumer(self) -> Any:
        try:
            consumer = aiokafka.AIOKafkaConsumer(**self.settings.consumer)
        except (TypeError, ValueError, aio_errors.KafkaError) as error:
            raise ConfigurationError(f"invalid aiokafka settings: {error}") from error
        listener = _RebalanceListener(self)
        if self.settings.base.pattern is not None:
            consumer.subscribe(pattern=self.settings.base.pattern, listener=listener)
        else:
            consumer.subscribe(topics=list(self.settings.base.topics), listener=listener)
        return consumer

    async def _unless_stopped(self, awaitable: Awaitable[Any], deadline: float) -> bool:
        """Await ``awaitable`` until the monotonic ``deadline`` (then TimeoutError); True
        once it is done, False at once when a stop is requested (it is cancelled)."""
        task = asyncio.ensure_future(awaitable)
        try:
            while not task.done():
                if self._stop.requested:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("connect_timeout passed")
                await asyncio.wait({task}, timeout=min(left, START_SLICE))
        except BaseException:
            task.cancel()
            raise
        task.result()  # raises what it raised
        return True

    async def _close(self) -> None:
        self._closing = True
        self._wake()
        task, self._poll_task = self._poll_task, None
        if task is not None:
            task.cancel()
            await self._within(task, CLOSE_TIMEOUT)
        consumer = self._consumer
        if consumer is not None:
            if self._failure is None:
                await self._within(self.commits.commit_on_stop(CLOSE_TIMEOUT), CLOSE_TIMEOUT)
            self._buffer.clear()
            await self._within(consumer.stop(), CLOSE_TIMEOUT)
        await self._within(self.dead_letters.close(), CLOSE_TIMEOUT)

    async def _within(self, awaitable: Awaitable[Any], timeout: float) -> None:
        """Await ``awaitable`` for at most ``timeout`` seconds, then leave it running on
        the loop (cancelling aiokafka's stop or commit while Kafka is down can take as
        long as the request: ``asyncio.wait_for`` would wait for that)."""
        task = asyncio.ensure_future(awaitable)
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            self._left_running.add(task)
            task.add_done_callback(self._left_running.discard)
            log.info(
                "a step of closing the Kafka consumer did not finish in time; left running",
                extra={"consumer": self.settings.consumer_name, "timeout": timeout},
            )
            return
        if not task.cancelled() and task.exception() is not None:
            log.warning(
                "kafka consumer did not stop cleanly (aiokafka)",
                extra={"error": describe_error(task.exception())},  # type: ignore[arg-type]
            )

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
        fetch_max_wait = float(self.settings.consumer.get("fetch_max_wait_ms", 500)) / 1000
        outage = OutageWatch(
            OutageLog("kafka", logger=log, context={"consumer": self.settings.consumer_name}),
            aiokafka_probe(consumer, fetch_max_wait),
        )
        while not self._closing:
            try:
                if self.commits.due:
                    await self.commits.commit_pending()
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
                    if any(batches.values()):
                        outage.working()
                    else:
                        outage.idle()
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
        assigned = self.commits.assigned() if batches else set()
        for topic_partition, records in batches.items():
            key = partition_key(topic_partition)
            if key not in assigned:
                continue  # revoked while this poll was answered: the next owner's
            if key in self._unchecked and records:
                self._unchecked.discard(key)
                await self.commits.check_previous_owner(key, topic_partition, records[0].offset)
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
            await self.commits.commit(
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


def _retriable_start(error: BaseException) -> bool:
    """A failed start worth another attempt: no broker answered (not a refused setting)."""
    return isinstance(error, TimeoutError | OSError) or _retriable(error)


def _retriable(error: BaseException) -> bool:
    return bool(getattr(error, "retriable", False)) or isinstance(
        error,
        aio_errors.KafkaConnectionError
        | aio_errors.KafkaTimeoutError
        | aio_errors.NodeNotReadyError,
    )


def _names(keys: Collection[PartitionKey]) -> list[str]:
    return [f"{topic}/{partition}" for topic, partition in sorted(keys)]


async def _quietly(awaitable: Awaitable[T], timeout: float = CLOSE_TIMEOUT) -> None:
    try:
        await asyncio.wait_for(awaitable, timeout)
    except Exception as error:
        log.warning(
            "kafka consumer did not stop cleanly (aiokafka)", extra={"error": describe_error(error)}
        )

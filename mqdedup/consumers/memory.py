"""An in-memory broker with at-least-once semantics, for tests and the demo.

It is also the public test harness for users' consumers::

    broker = InMemoryBroker()
    broker.publish("orders", b'{"id": 1}', message_id="order-1")
    broker.inject_duplicates("orders", rate=0.3)
    run_until_idle(MyConsumer(), broker.transport("orders"), engine)

Unsettled deliveries return to the front of the queue (marked redelivered) when they are
given back, or when the transport is closed or ``crash()``-ed, exactly as a broker hands
them to the next consumer.

A handler that kills its process (``os._exit``, an OOM kill, a segfault) is simulated
by raising :class:`~mqdedup.errors.SimulatedCrash`; :func:`run_until_idle_restarting`
then plays the supervisor, starting a fresh worker after each crash::

    crashes = run_until_idle_restarting(MyConsumer(), broker, "orders", engine).crashes
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mqdedup.bridge import in_bridge, wait_for
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.consumers.worker import Worker
from mqdedup.errors import SimulatedCrash
from mqdedup.message import HeaderValue, Message

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session, sessionmaker

    from mqdedup.consumers.metrics import Metrics
    from mqdedup.consumers.spec import ConsumerSpec


@dataclass(frozen=True)
class DeadLetteredMessage:
    """A message in the broker's dead-letter list, with the reason it got there."""

    message: Message
    record: DeadLetter


class InMemoryBroker:
    """Named queues of messages; thread-safe.

    Async consumers use it too: inside the bridge a fetch waiting for messages awaits
    on the event loop (other tasks keep running) instead of blocking its thread.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._lock = threading.Condition()
        #: Event loops' futures waiting for a message (fetches inside the bridge).
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._queues: dict[str, deque[Message]] = {}
        self._offsets: dict[str, itertools.count[int]] = {}
        self._random = random.Random(seed)
        self.dead_letters: dict[str, list[DeadLetteredMessage]] = {}
        self.settled_count: dict[str, int] = {}

    def publish(
        self,
        queue: str,
        body: bytes | str,
        *,
        message_id: str | None = None,
        key: bytes | None = None,
        headers: Mapping[str, HeaderValue] | None = None,
        properties: Mapping[str, Any] | None = None,
    ) -> Message:
        """Append a message; ``message_id`` becomes the ``message-id`` header and property."""
        all_headers = dict(headers or {})
        all_properties = dict(properties or {})
        if message_id is not None:
            all_headers.setdefault("message-id", message_id)
            all_properties.setdefault("message_id", message_id)
        with self._lock:
            offset = next(self._offsets.setdefault(queue, itertools.count()))
            message = Message(
                body=body.encode() if isinstance(body, str) else body,
                key=key,
                headers=all_headers,
                properties=all_properties,
                source=queue,
                partition=0,
                offset=offset,
            )
            self._queues.setdefault(queue, deque()).append(message)
            self._wake()
        return message

    def inject_duplicates(self, queue: str, rate: float) -> int:
        """Re-publish about ``rate`` of the queued messages at random later positions.

        A copy is the same message again (same id, body and headers) with a new offset,
        as a retrying producer would send it. Returns how many copies were added.
        """
        with self._lock:
            items = list(self._queues.get(queue, deque()))
            counter = self._offsets.setdefault(queue, itertools.count())
            copies = 0
            for index, message in enumerate(list(items)):
                if self._random.random() < rate:
                    position = self._random.randint(index + 1, len(items))
                    items.insert(position, replace(message, offset=next(counter)))
                    copies += 1
            self._queues[queue] = deque(items)
        return copies

    def transport(self, queue: str) -> MemoryTransport:
        """A consumer-side connection to ``queue``."""
        with self._lock:
            self._queues.setdefault(queue, deque())
        return MemoryTransport(self, queue)

    def pending(self, queue: str) -> int:
        """Messages waiting in ``queue`` (not handed out)."""
        with self._lock:
            return len(self._queues.get(queue, ()))

    # -- used by MemoryTransport ---------------------------------------------------------

    def _wake(self) -> None:
        """Wake every waiting fetch (called with the lock held)."""
        self._lock.notify_all()
        for loop, waiter in self._waiters:
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits there
                loop.call_soon_threadsafe(_resolve, waiter)
        self._waiters.clear()

    def _take(self, queue: str, max_messages: int, timeout: float) -> list[Message]:
        deadline = time.monotonic() + timeout
        if in_bridge():
            return self._take_on_loop(queue, max_messages, deadline)
        with self._lock:
            waiting = self._queues[queue]
            while not waiting:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._lock.wait(remaining)
            return [waiting.popleft() for _ in range(min(max_messages, len(waiting)))]

    def _take_on_loop(self, queue: str, max_messages: int, deadline: float) -> list[Message]:
        """:meth:`_take` inside the bridge: wait on the event loop, not on the lock."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                waiting = self._queues[queue]
                if waiting:
                    return [waiting.popleft() for _ in range(min(max_messages, len(waiting)))]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                waiter: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, waiter))
            try:
                wait_for(asyncio.wait([waiter], timeout=remaining))
            finally:
                with self._lock:
                    if (loop, waiter) in self._waiters:  # timed out (or cancelled)
                        self._waiters.remove((loop, waiter))

    def _return(self, queue: str, messages: Sequence[Message]) -> None:
        with self._lock:
            waiting = self._queues[queue]
            for message in reversed(messages):
                waiting.appendleft(replace(message, redelivered=True, attempt=message.attempt + 1))
            self._wake()

    def _settled(self, queue: str, count: int) -> None:
        with self._lock:
            self.settled_count[queue] = self.settled_count.get(queue, 0) + count

    def _dead_letter(self, queue: str, message: Message, record: DeadLetter) -> None:
        with self._lock:
            self.dead_letters.setdefault(queue, []).append(DeadLetteredMessage(message, record))


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class MemoryTransport:
    """A :class:`~mqdedup.consumers.transport.Transport` over one in-memory queue."""

    def __init__(self, broker: InMemoryBroker, queue: str) -> None:
        self.broker = broker
        self.queue = queue
        self._tags = itertools.count(1)
        self._in_flight: dict[int, Message] = {}
        self.closed = False

    def fetch(self, max_messages: int, timeout: float) -> list[Delivery[int]]:
        """Hand out up to ``max_messages``; they stay in flight until settled."""
        deliveries: list[Delivery[int]] = []
        for message in self.broker._take(self.queue, max_messages, timeout):
            tag = next(self._tags)
            self._in_flight[tag] = message
            deliveries.append(Delivery(message, tag))
        return deliveries

    def settle(self, deliveries: Sequence[Delivery[int]]) -> None:
        """Acknowledge: the deliveries leave the broker for good."""
        settled = sum(1 for d in deliveries if self._in_flight.pop(d.token, None) is not None)
        self.broker._settled(self.queue, settled)

    def give_back(self, deliveries: Sequence[Delivery[int]]) -> None:
        """Put unsettled deliveries back at the front of the queue, marked redelivered.

        They keep their order; deliveries not in flight here (settled, or given back
        already) are ignored.
        """
        tags = sorted(d.token for d in deliveries if d.token in self._in_flight)
        self.broker._return(self.queue, [self._in_flight.pop(tag) for tag in tags])

    def dead_letter(self, delivery: Delivery[int], record: DeadLetter) -> None:
        """Keep the original message (no id attached) and the reason in the broker's list."""
        original = self._in_flight.get(delivery.token, delivery.message)
        self.broker._dead_letter(self.queue, original, record)

    def keepalive(self) -> None:
        """Nothing to keep alive in memory."""

    @property
    def in_flight(self) -> int:
        """Deliveries handed out and not yet settled."""
        return len(self._in_flight)

    def crash(self) -> None:
        """Lose the connection: every unsettled delivery goes back to the queue."""
        in_flight = [self._in_flight[tag] for tag in sorted(self._in_flight)]
        self._in_flight.clear()
        self.broker._return(self.queue, in_flight)

    def close(self) -> None:
        """Close; like a broker, return unsettled deliveries to the queue."""
        self.crash()
        self.closed = True


@dataclass(frozen=True)
class RestartedRun:
    """What :func:`run_until_idle_restarting` saw: crashes, and the last run's counters."""

    crashes: int
    metrics: Metrics


def run_until_idle_restarting(
    consumer: ConsumerSpec,
    broker: InMemoryBroker,
    queue: str,
    database: Engine | sessionmaker[Session],
    *,
    max_restarts: int = 20,
) -> RestartedRun:
    """Run ``consumer`` over ``queue`` until idle, restarting it after each crash.

    A :class:`~mqdedup.errors.SimulatedCrash` out of a worker is a process death: its
    unsettled deliveries return to the queue marked redelivered, and a fresh worker
    (new transport) starts, as ``mqdedup worker``'s supervisor would. Raises
    ``RuntimeError`` when the worker still crashes after ``max_restarts`` restarts (a
    crash loop).
    """
    crashes = 0
    while True:
        try:
            metrics = Worker(consumer, broker.transport(queue), database).run(until_idle=True)
        except SimulatedCrash:
            crashes += 1
            if crashes > max_restarts:
                raise RuntimeError(
                    f"crash loop: the worker of {queue!r} crashed {crashes} times"
                ) from None
            continue
        return RestartedRun(crashes=crashes, metrics=metrics)

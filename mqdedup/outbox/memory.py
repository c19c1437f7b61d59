"""An in-memory publisher for tests and the demo, with fault injection.

Records can go into an :class:`~mqdedup.consumers.memory.InMemoryBroker` (any
:class:`MessageSink`) so a test can run a whole chain (consumer → outbox → relay →
consumer) without a real broker::

    broker = InMemoryBroker()
    relay = Relay(engine, {"kafka": MemoryPublisher(broker), "rabbitmq": MemoryPublisher(broker)})
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from mqdedup.message import HeaderValue
from mqdedup.outbox.publishers import PUBLISHED, OutboxRecord, PublishResult, header_text


class MessageSink(Protocol):
    """Where published records go: :class:`~mqdedup.consumers.memory.InMemoryBroker`."""

    def publish(
        self,
        queue: str,
        body: bytes | str,
        *,
        message_id: str | None = None,
        key: bytes | None = None,
        headers: Mapping[str, HeaderValue] | None = None,
        properties: Mapping[str, Any] | None = None,
    ) -> object:
        """Append a message to ``queue``."""


def queue_name(record: OutboxRecord) -> str:
    """The in-memory queue a record goes to: the topic, the queue of the default
    exchange, or ``exchange/routing_key``."""
    if record.routing_key is None:
        return record.destination
    if record.destination == "":
        return record.routing_key
    return f"{record.destination}/{record.routing_key}"


class MemoryPublisher:
    """Keeps published records in ``published`` (and in ``broker`` when given).

    ``available = False`` makes every record ``UNAVAILABLE`` (a broker outage);
    ``reject`` returns an error text for records the broker should refuse.
    """

    def __init__(
        self,
        broker: MessageSink | None = None,
        *,
        reject: Callable[[OutboxRecord], str | None] | None = None,
    ) -> None:
        self.broker = broker
        self.reject = reject
        self.available = True
        self.published: list[OutboxRecord] = []
        self.batches = 0
        self.closed = False
        self._lock = threading.Lock()

    def publish_batch(self, records: Sequence[OutboxRecord]) -> list[PublishResult]:
        """Publish in order; see the class docstring for injected failures."""
        results: list[PublishResult] = []
        with self._lock:
            self.batches += 1
            for record in records:
                if not self.available:
                    results.append(PublishResult.unavailable("memory broker is down"))
                    continue
                error = self.reject(record) if self.reject else None
                if error is not None:
                    results.append(PublishResult.rejected(error))
                    continue
                self.published.append(record)
                if self.broker is not None:
                    self.broker.publish(
                        queue_name(record),
                        record.payload,
                        message_id=record.message_id,
                        key=record.key,
                        headers={k: header_text(v) for k, v in record.headers.items()},
                        properties=dict(record.properties or {}),
                    )
                results.append(PUBLISHED)
        return results

    def published_ids(self) -> list[str]:
        """Message ids in publication order (repeats included)."""
        with self._lock:
            return [record.message_id for record in self.published]

    def keepalive(self) -> None:
        """Nothing to keep alive."""

    def close(self) -> None:
        """Mark closed."""
        self.closed = True

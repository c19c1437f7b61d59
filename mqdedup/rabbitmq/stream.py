"""Replay a RabbitMQ *stream* queue through a consumer, by offset or timestamp.

A stream keeps its messages after they are read; each reader chooses where to start
with the ``x-stream-offset`` consumer argument. A replay is a transport over a range
(:class:`StreamRangeTransport`: from a start — ``first``, an offset or a time — to an
end — an offset or a time, exclusive, and at most the stream's end when the replay
starts) run by the same Worker and Processor as live traffic
(:class:`~mqdedup.consumers.replay.ReplayRun`): already processed message ids are
duplicates, the rest are processed, failures are dead-lettered with their reason;
``dry_run`` only counts. It opens its own connections and touches no other consumer of
the stream.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pika
import pika.exceptions
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.consumers.replay import RangeLedger, ReplayReport, ReplayRun
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.db.engine import session_factory
from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.rabbitmq.codec import dead_letter_properties, to_message
from mqdedup.rabbitmq.consumer import RabbitMQConsumer
from mqdedup.rabbitmq.dead_letters import DeadLetterPublisher
from mqdedup.rabbitmq.topology import (
    BrokerNodes,
    declare_dead_letter_topology,
    queue_depth,
)
from mqdedup.stopping import StopToken

log = logging.getLogger(__name__)
STREAM_OFFSET_HEADER = "x-stream-offset"
#: How long the end probe waits for more of the stream's last chunk, and at most in all.
_PROBE_QUIET = 0.3
_PROBE_MAX = 3.0
_PUMP = 0.2


@dataclass(frozen=True)
class StreamToken:
    """A stream delivery: its channel delivery tag, stream offset and AMQP properties."""

    tag: int
    offset: int
    properties: Any


class StreamRangeTransport:
    """The :class:`~mqdedup.consumers.replay.RangeTransport` over one stream queue.

    ``fetch`` blocks until it has deliveries of the range and returns ``[]`` once the
    last message of the range was handed out (or no message came for ``idle_timeout``
    seconds: a time range after the stream's last message). Acks on a stream only
    grant credit; ``give_back`` hands deliveries out again, first, marked redelivered
    (a stream never redelivers by itself). Everything runs on the Worker's thread.
    """

    def __init__(
        self,
        consumer: RabbitMQConsumer,
        *,
        stream: str | None = None,
        start: int | datetime | None = None,
        end: int | datetime | None = None,
        stop: StopToken | None = None,
        idle_timeout: float = 3.0,
    ) -> None:
        for bound in (start, end):
            if isinstance(bound, datetime) and bound.tzinfo is None:
                raise ConfigurationError("stream replay times must be timezone-aware")
        self.consumer = consumer
        self.stream = stream or consumer.queue
        self.start, self.end = start, end
        self.stop = stop or StopToken()
        self.idle_timeout = idle_timeout
        self.ledger = RangeLedger()
        #: The stream's end (exclusive) when the range was opened.
        self.end_offset = 0
        self._connection: Any = None
        self._channel: Any = None
        self._consumer_tag: str | None = None
        self._arrived: deque[tuple[Any, Any, bytes]] = deque()
        self._again: list[Delivery[Any]] = []
        self._acked_up_to = 0
        self._done = False
        self._closed = False
        self._dead_letters: DeadLetterPublisher | None = None

    # -- life cycle ----------------------------------------------------------------------

    def open(self) -> None:
        """Connect, capture the stream's end, declare the dead-letter topology, consume."""
        if self._connection is not None:
            return
        name = f"mqdedup-stream-replay-{self.consumer.consumer_name}"
        self._connection = BrokerNodes(self.consumer.broker_url, name).open()
        self._check_stream()
        self.end_offset = self._probe_end()
        if isinstance(self.end, int):
            self.end_offset = min(self.end_offset, self.end)
        topology = self.consumer.topology()
        channel = self._connection.channel()
        declare_dead_letter_topology(channel, topology)
        channel.basic_qos(prefetch_count=max(self.consumer.batch_size, 1))
        self._channel = channel
        self._dead_letters = DeadLetterPublisher(
            self.consumer.broker_url, topology, connection_name=f"{name}:dead-letters"
        )
        if self.end_offset == 0 or (isinstance(self.start, int) and self.start >= self.end_offset):
            self._done = True
            return
        self._consumer_tag = channel.basic_consume(
            self.stream,
            self._on_message,
            arguments={STREAM_OFFSET_HEADER: "first" if self.start is None else self.start},
        )

    def close(self) -> None:
        """Stop consuming and disconnect (a stream keeps everything; nothing is lost)."""
        if self._closed:
            return
        self._closed = True
        connection, self._connection = self._connection, None
        if connection is not None and connection.is_open:
            try:
                if self._consumer_tag is not None and self._channel.is_open:
                    self._channel.basic_cancel(self._consumer_tag)
                connection.close()
            except (pika.exceptions.AMQPError, OSError) as error:
                log.info(
                    "stream replay connection did not close cleanly",
                    extra={"stream": self.stream, "error": type(error).__name__},
                )
        if self._dead_letters is not None:
            self._dead_letters.close()

    # -- the Transport protocol ----------------------------------------------------------

    def fetch(self, max_messages: int, timeout: float) -> list[Delivery[Any]]:
        """Up to ``max_messages`` deliveries of the range; ``[]`` once it is all read."""
        if self._again:
            batch, self._again = self._again[:max_messages], self._again[max_messages:]
            for delivery in batch:
                self.ledger.handed_out(_token(delivery).offset)
            return batch
        self._opened()
        quiet_since = time.monotonic()
        while not self._done and not self.stop.requested:
            batch = self._take(max_messages)
            if batch:
                return batch
            if self._done:
                break
            self._connection.process_data_events(time_limit=min(_PUMP, max(timeout, 0.01)))
            if self._arrived:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > self.idle_timeout:
                self._done = True  # the range holds nothing more (a time after the last)
        return []

    def settle(self, deliveries: Sequence[Delivery[Any]]) -> None:
        """Count deliveries as done and ack them (on a stream, acks grant credit)."""
        for delivery in deliveries:
            self.ledger.settle(_token(delivery).offset)
        self._ack([_token(d).tag for d in deliveries])

    def give_back(self, deliveries: Sequence[Delivery[Any]]) -> None:
        """Hand these unsettled deliveries out again, before the rest of the range."""
        again = [
            Delivery(dataclasses.replace(d.message, redelivered=True), d.token) for d in deliveries
        ]
        self._again = again + self._again

    def dead_letter(self, delivery: Delivery[Any], record: DeadLetter) -> None:
        """Publish to the consumer's dead-letter queue with confirms, as the live
        transport does (on a publishing connection of its own)."""
        token = _token(delivery)
        if self._dead_letters is None or self._closed:
            raise BrokerUnavailableError("the stream range transport is not open")
        self.ledger.dead_lettering(token.offset, record.reason)
        properties = dead_letter_properties(
            token.properties, record, source_queue=self.stream, message_id=delivery.message.id
        )
        self._dead_letters.publish(delivery.message.body, properties)

    def keepalive(self) -> None:
        """Answer heartbeats on both connections while the processor waits."""
        if self._connection is not None and self._connection.is_open:
            self._connection.process_data_events(time_limit=0)
        if self._dead_letters is not None:
            self._dead_letters.service()

    # -- internals -----------------------------------------------------------------------

    def _opened(self) -> None:
        if self._connection is None:
            if self._closed:
                raise BrokerUnavailableError("the stream range transport is closed")
            self.open()

    def _on_message(self, _channel: Any, method: Any, properties: Any, body: bytes) -> None:
        self._arrived.append((method, properties, body))

    def _take(self, max_messages: int) -> list[Delivery[Any]]:
        """Deliveries of the range from what arrived; notes the end when it is reached."""
        batch: list[Delivery[Any]] = []
        while self._arrived and len(batch) < max_messages and not self._done:
            method, properties, body = self._arrived.popleft()
            offset = int((properties.headers or {}).get(STREAM_OFFSET_HEADER, -1))
            message = to_message(self.stream, method, properties, body)
            if self._beyond_end(offset, message.timestamp):
                self._ack([method.delivery_tag])
                self._done = True
                break
            self.ledger.note_offset(self.stream, offset)
            self.ledger.handed_out(offset)
            batch.append(Delivery(message, StreamToken(method.delivery_tag, offset, properties)))
            if offset + 1 >= self.end_offset:
                self._done = True  # the last message of the range
        return batch

    def _beyond_end(self, offset: int, timestamp: datetime | None) -> bool:
        if offset >= self.end_offset:
            return True
        if isinstance(self.end, datetime):
            return timestamp is not None and timestamp >= self.end
        return False

    def _ack(self, tags: Sequence[int]) -> None:
        """Ack up to the highest tag (``multiple``), never a tag twice."""
        highest = max(tags, default=0)
        if highest > self._acked_up_to and self._channel is not None and self._channel.is_open:
            self._channel.basic_ack(highest, multiple=True)
            self._acked_up_to = highest

    def _check_stream(self) -> None:
        if queue_depth(self._connection, self.stream) is None:
            raise ConfigurationError(f"RabbitMQ stream {self.stream!r} does not exist")

    def _probe_end(self) -> int:
        """The offset after the stream's last message now (0: empty).

        AMQP has no "last offset" query; reading from ``last`` delivers the stream's
        last chunk, whose highest offset is the last message's.
        """
        probe = self._connection.channel()
        probe.basic_qos(prefetch_count=1000)
        seen: list[int] = []

        def on_message(channel: Any, method: Any, properties: Any, _body: bytes) -> None:
            seen.append(int((properties.headers or {}).get(STREAM_OFFSET_HEADER, -1)))
            channel.basic_ack(method.delivery_tag)

        tag = probe.basic_consume(self.stream, on_message, arguments={STREAM_OFFSET_HEADER: "last"})
        started = quiet_since = time.monotonic()
        while time.monotonic() - started < _PROBE_MAX:
            count = len(seen)
            self._connection.process_data_events(time_limit=0.05)
            now = time.monotonic()
            if len(seen) > count:
                quiet_since = now
            elif now - quiet_since > _PROBE_QUIET:
                break
        probe.basic_cancel(tag)
        probe.close()
        return max(seen, default=-1) + 1


def _token(delivery: Delivery[Any]) -> StreamToken:
    token = delivery.token
    assert isinstance(token, StreamToken)
    return token


class StreamReplay:
    """One replay of ``stream`` (default: the consumer's queue) through ``consumer``."""

    def __init__(
        self,
        consumer: RabbitMQConsumer,
        database: Engine | sessionmaker[Session],
        *,
        start: int | datetime | None = None,
        end: int | datetime | None = None,
        dry_run: bool = False,
        stop: StopToken | None = None,
        stream: str | None = None,
        idle_timeout: float = 3.0,
    ) -> None:
        self.transport = StreamRangeTransport(
            consumer, stream=stream, start=start, end=end, stop=stop, idle_timeout=idle_timeout
        )
        sessions = session_factory(database) if isinstance(database, Engine) else database
        self._run = ReplayRun(consumer, sessions, self.transport, dry_run=dry_run, stop=stop)

    @property
    def report(self) -> ReplayReport:
        """The counts so far (final once :meth:`run` returned)."""
        return self._run.report

    def run(self) -> ReplayReport:
        """Read the range and return the counts."""
        try:
            self.transport.open()
        except BaseException:
            self.transport.close()
            raise
        return self._run.run()

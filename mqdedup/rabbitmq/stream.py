"""Replay a RabbitMQ *stream* queue through a consumer, by offset or timestamp.

A stream keeps its messages after they are read; each reader chooses where to start
with the ``x-stream-offset`` consumer argument. :class:`StreamReplay` reads from a
start (``first``, an offset or a time) until an end (an offset or a time, exclusive)
or until the stream stays quiet for ``idle_timeout`` seconds, and runs every message
through the shared processor: already processed message ids are duplicates, the rest
are processed; ``dry_run`` only counts. It opens its own connection and touches no
other consumer of the stream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pika
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.consumers.processor import Processor
from mqdedup.consumers.replay import ReplayReport, ReplayTally
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.db.engine import session_factory
from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.rabbitmq.codec import dead_letter_properties, to_message
from mqdedup.rabbitmq.consumer import RabbitMQConsumer
from mqdedup.rabbitmq.topology import connection_parameters, declare_dead_letter_topology
from mqdedup.stopping import StopToken

log = logging.getLogger(__name__)
STREAM_OFFSET_HEADER = "x-stream-offset"


@dataclass(frozen=True)
class _Token:
    tag: int
    offset: int
    properties: Any


class _StreamTransport:
    """The Transport seam over one stream channel (acks only grant credit on streams)."""

    def __init__(self, channel: Any, stream: str, dead_letter_queue: str) -> None:
        self.channel = channel
        self.stream = stream
        self.dead_letter_queue = dead_letter_queue

    def fetch(
        self, max_messages: int, timeout: float
    ) -> Sequence[Delivery[Any]]:  # pragma: no cover
        raise NotImplementedError("StreamReplay feeds batches itself")

    def settle(self, deliveries: Sequence[Delivery[Any]]) -> None:
        if deliveries:
            self.channel.basic_ack(max(d.token.tag for d in deliveries), multiple=True)

    def dead_letter(self, delivery: Delivery[Any], record: DeadLetter) -> None:
        token: _Token = delivery.token
        properties = dead_letter_properties(
            token.properties, record, source_queue=self.stream, message_id=delivery.message.id
        )
        self.channel.basic_publish(
            exchange="",
            routing_key=self.dead_letter_queue,
            body=delivery.message.body,
            properties=properties,
            mandatory=True,
        )

    def give_back(self, deliveries: Sequence[Delivery[Any]]) -> None:
        """Nothing to return: a replay moves on (acks only grant credit on streams)."""

    def keepalive(self) -> None:
        self.channel.connection.process_data_events(time_limit=0)

    def close(self) -> None:
        return


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
        for bound in (start, end):
            if isinstance(bound, datetime) and bound.tzinfo is None:
                raise ConfigurationError("stream replay times must be timezone-aware")
        self.consumer = consumer
        self.sessions = session_factory(database) if isinstance(database, Engine) else database
        self.stream = stream or consumer.queue
        self.start, self.end = start, end
        self.dry_run = dry_run
        self.stop = stop or StopToken()
        self.idle_timeout = idle_timeout
        self.report = ReplayReport(dry_run=dry_run)
        self.tally = ReplayTally(consumer, self.sessions, self.report)
        self._channel: Any = None

    def run(self) -> ReplayReport:
        """Read the range and return the counts."""
        parameters = connection_parameters(
            self.consumer.broker_url, f"mqdedup-stream-replay-{self.consumer.consumer_name}"
        )
        try:
            connection = pika.BlockingConnection(parameters)
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnavailableError(
                f"cannot connect to RabbitMQ: {type(exc).__name__}"
            ) from exc
        try:
            channel = connection.channel()
            self._channel = channel
            self._check_stream(connection)
            topology = self.consumer.topology()
            declare_dead_letter_topology(channel, topology)
            channel.confirm_delivery()
            channel.basic_qos(prefetch_count=max(self.consumer.batch_size, 1))
            transport = _StreamTransport(channel, self.stream, topology.dead_letter_queue)
            processor = (
                None
                if self.dry_run
                else Processor(self.consumer, self.sessions, transport, stop=self.stop)
            )
            self._consume(channel, processor)
            channel.cancel()
        finally:
            if connection.is_open:
                connection.close()
        return self.report

    def _check_stream(self, connection: Any) -> None:
        probe = connection.channel()
        try:
            probe.queue_declare(self.stream, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            raise ConfigurationError(f"RabbitMQ stream {self.stream!r} does not exist") from exc
        if probe.is_open:
            probe.close()

    def _offset_argument(self) -> Any:
        if self.start is None:
            return "first"
        return self.start  # an int offset, or a datetime (sent as an AMQP timestamp)

    def _consume(self, channel: Any, processor: Processor | None) -> None:
        batch: list[Delivery[Any]] = []
        last_message = time.monotonic()
        for method, properties, body in channel.consume(
            self.stream,
            arguments={STREAM_OFFSET_HEADER: self._offset_argument()},
            inactivity_timeout=0.2,
        ):
            if method is not None:
                offset = int((properties.headers or {}).get(STREAM_OFFSET_HEADER, -1))
                message = to_message(self.stream, method, properties, body)
                if self._beyond_end(offset, message.timestamp):
                    channel.basic_ack(method.delivery_tag)
                    self._flush(batch, processor)
                    return
                self._note_offset(offset)
                batch.append(Delivery(message, _Token(method.delivery_tag, offset, properties)))
                last_message = time.monotonic()
            full = len(batch) >= self.consumer.batch_size
            quiet = method is None
            if batch and (full or quiet):
                self._flush(batch, processor)
                batch = []
            if self.stop.requested or (
                quiet and time.monotonic() - last_message > self.idle_timeout
            ):
                self._flush(batch, processor)
                return

    def _beyond_end(self, offset: int, timestamp: datetime | None) -> bool:
        if self.end is None:
            return False
        if isinstance(self.end, datetime):
            return timestamp is not None and timestamp >= self.end
        return offset >= self.end

    def _note_offset(self, offset: int) -> None:
        first, last = self.report.ranges.get(self.stream, (offset, offset))
        self.report.ranges[self.stream] = (min(first, offset), max(last, offset + 1))

    def _flush(self, batch: list[Delivery[Any]], processor: Processor | None) -> None:
        if not batch:
            return
        if processor is None:
            self.tally.dry(batch)
            # Nothing is processed, but a stream needs acks to keep granting credit.
            self._channel.basic_ack(max(d.token.tag for d in batch), multiple=True)
            return
        self.tally.processed(processor.process(batch))

"""RabbitMQ publisher of the relay (pika): persistent, ``mandatory``, confirms in a window.

Messages are published on a confirm-mode channel of a ``SelectConnection`` driven from
the relay's thread: up to ``window`` messages are unconfirmed at a time and the
broker's (multiple) acks release the next ones, instead of one synchronous round trip
per message. A record counts as published when its ack arrived; a message the broker
returned as unroutable (``mandatory``) is ``REJECTED`` with the reply text, as is a
record whose exchange does not exist (checked once per connection with a passive
declare). Nacks, lost connections and missing acks after ``confirm_timeout`` are
``UNAVAILABLE``: the relay publishes those rows again later.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions
import pika.spec

from mqdedup.consumers.rabbitmq_topology import connection_parameters, mask_amqp_url
from mqdedup.errors import ConfigurationError
from mqdedup.outbox.publishers import PUBLISHED, OutboxRecord, PublishResult

log = logging.getLogger(__name__)


class _UnavailableError(Exception):
    """The broker cannot be used right now (connect failed, channel lost)."""


@dataclass
class _Batch:
    records: Sequence[OutboxRecord]
    results: list[PublishResult | None]
    order: list[int]
    position: int = 0
    inflight: dict[int, int] = field(default_factory=dict)  # delivery tag -> record index
    returned: dict[int, PublishResult] = field(default_factory=dict)
    by_message_id: dict[str, int] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.position >= len(self.order) and not self.inflight


class RabbitMQPublisher:
    """Publishes outbox records to RabbitMQ with asynchronous publisher confirms.

    ``url``: ``amqp://user:password@host:port/vhost``. ``window``: most unconfirmed
    messages at a time. ``confirm_timeout``: how long a batch waits for its acks.
    """

    def __init__(
        self,
        url: str,
        *,
        window: int = 1000,
        confirm_timeout: float = 30.0,
        connect_timeout: float = 10.0,
    ) -> None:
        if window < 1:
            raise ConfigurationError("RabbitMQ confirm window must be at least 1")
        self.parameters = connection_parameters(
            url, f"mqdedup-relay:{socket.gethostname()}:{os.getpid()}"
        )
        self.parameters.socket_timeout = connect_timeout
        self.parameters.stack_timeout = connect_timeout
        self.parameters.blocked_connection_timeout = confirm_timeout
        self.safe_url = mask_amqp_url(url)
        self.window = window
        self.confirm_timeout = confirm_timeout
        self.connect_timeout = connect_timeout
        self._connection: Any = None
        self._loop: Any = None
        self._channel: Any = None
        self._opening: Any = None
        self._next_tag = 1
        self._known_exchanges: set[str] = set()
        self._batch: _Batch | None = None
        self._last_error: str | None = None
        self._channel_close_code: int | None = None
        self._done: Callable[[], bool] | None = None

    # -- Publisher -------------------------------------------------------------------------

    def publish_batch(self, records: Sequence[OutboxRecord]) -> list[PublishResult]:
        """Publish in order within the confirm window; one result per record."""
        if not records:
            return []
        results: list[PublishResult | None] = [None] * len(records)
        try:
            self._ensure_channel()
            missing = self._check_exchanges({record.destination for record in records})
        except _UnavailableError as error:
            self._reset()
            return [PublishResult.unavailable(str(error))] * len(records)
        order: list[int] = []
        for index, record in enumerate(records):
            if record.destination in missing:
                results[index] = PublishResult.rejected(missing[record.destination])
            else:
                order.append(index)
        batch = _Batch(records, results, order)
        self._batch = batch
        try:
            self._pump()
            self._run_until(lambda: batch.done or self._channel is None, self.confirm_timeout)
        finally:
            self._batch = None
        reason = self._last_error or f"no publisher confirm within {self.confirm_timeout} s"
        if not batch.done:
            log.warning(
                "RabbitMQ batch incomplete",
                extra={
                    "unconfirmed": len(batch.inflight) + len(order) - batch.position,
                    "reason": reason,
                    "url": self.safe_url,
                },
            )
            self._reset()
        return [r if r is not None else PublishResult.unavailable(reason) for r in results]

    def keepalive(self) -> None:
        """Serve heartbeats and pending frames without blocking."""
        if self._connection is not None:
            self._run_until(lambda: False, 0.0)

    def close(self) -> None:
        """Close the connection (waits briefly for the close handshake)."""
        self._reset()

    # -- connection ------------------------------------------------------------------------

    def _ensure_channel(self) -> None:
        if self._channel is not None and self._channel.is_open:
            return
        if self._connection is None or not self._connection.is_open:
            self._reset()
            self._last_error = None
            self._connection = pika.SelectConnection(
                self.parameters,
                on_open_callback=self._on_connection_open,
                on_open_error_callback=self._on_connection_error,
                on_close_callback=self._on_connection_closed,
            )
            self._loop = self._connection.ioloop
        else:
            self._open_channel()
        self._run_until(
            lambda: self._channel is not None or self._connection is None, self.connect_timeout
        )
        if self._channel is None:
            error = self._last_error or f"no channel within {self.connect_timeout} s"
            raise _UnavailableError(f"cannot connect to RabbitMQ at {self.safe_url}: {error}")

    def _on_connection_open(self, connection: Any) -> None:
        self._open_channel()

    def _on_connection_error(self, _connection: Any, error: BaseException) -> None:
        self._last_error = f"{type(error).__name__}: {error}"
        self._connection = None
        self._channel = None
        self._stop_loop()

    def _on_connection_closed(self, _connection: Any, reason: BaseException) -> None:
        self._last_error = f"connection closed: {type(reason).__name__}: {reason}"
        self._connection = None
        self._channel = None
        self._known_exchanges.clear()
        self._stop_loop()

    def _open_channel(self) -> None:
        self._channel = None
        self._opening = self._connection.channel(on_open_callback=self._on_channel_open)

    def _on_channel_open(self, channel: Any) -> None:
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(
            ack_nack_callback=self._on_confirm,
            callback=lambda _frame: self._on_confirm_mode(channel),
        )

    def _on_confirm_mode(self, channel: Any) -> None:
        self._channel = channel
        self._next_tag = 1
        self._channel_close_code = None
        self._check_done()

    def _on_channel_closed(self, channel: Any, reason: BaseException) -> None:
        if channel is self._channel or channel is self._opening:
            self._channel = None
            self._channel_close_code = getattr(reason, "reply_code", None)
            self._last_error = f"channel closed: {type(reason).__name__}: {reason}"
            self._known_exchanges.clear()
        self._stop_loop()

    def _reset(self) -> None:
        connection, self._connection = self._connection, None
        self._channel = None
        self._known_exchanges.clear()
        if connection is not None and connection.is_open:
            try:
                connection.close()
                self._connection = connection  # let the close handshake run
                self._run_until(lambda: not connection.is_open, 2.0)
            except Exception:
                log.debug("closing the RabbitMQ connection failed", exc_info=True)
            finally:
                self._connection = None

    # -- exchanges -------------------------------------------------------------------------

    def _check_exchanges(self, exchanges: set[str]) -> dict[str, str]:
        """Passively declare exchanges not seen on this connection; return missing ones."""
        missing: dict[str, str] = {}
        for exchange in sorted(exchanges - self._known_exchanges - {""}):
            if self._exchange_exists(exchange):
                self._known_exchanges.add(exchange)
                continue
            if self._channel_close_code == 404:
                missing[exchange] = f"RabbitMQ exchange {exchange!r} does not exist"
                self._ensure_channel()
                continue
            raise _UnavailableError(
                f"cannot check exchange {exchange!r}: {self._last_error or 'no answer'}"
            )
        return missing

    def _exchange_exists(self, exchange: str) -> bool:
        """Passive declare; False when the broker closed the channel instead of answering."""
        confirmed: list[bool] = []
        self._channel.exchange_declare(
            exchange=exchange, passive=True, callback=lambda _frame: confirmed.append(True)
        )
        self._run_until(lambda: bool(confirmed) or self._channel is None, self.connect_timeout)
        return bool(confirmed)

    # -- publishing ------------------------------------------------------------------------

    def _pump(self) -> None:
        batch, channel = self._batch, self._channel
        if batch is None or channel is None:
            return
        while batch.position < len(batch.order) and len(batch.inflight) < self.window:
            index = batch.order[batch.position]
            record = batch.records[index]
            properties = pika.BasicProperties(
                delivery_mode=pika.DeliveryMode.Persistent,
                headers=dict(record.headers),
                **(record.properties or {}),
            )
            try:
                channel.basic_publish(
                    exchange=record.destination,
                    routing_key=record.routing_key or "",
                    body=record.payload,
                    properties=properties,
                    mandatory=True,
                )
            except (pika.exceptions.AMQPError, ValueError, TypeError) as error:
                if not channel.is_open:
                    return  # the rest stays unconfirmed: unavailable
                batch.results[index] = PublishResult.rejected(f"{type(error).__name__}: {error}")
                batch.position += 1
                continue
            batch.inflight[self._next_tag] = index
            batch.by_message_id[record.message_id] = index
            self._next_tag += 1
            batch.position += 1

    def _on_confirm(self, frame: Any) -> None:
        batch = self._batch
        if batch is None:
            return
        method = frame.method
        acked = isinstance(method, pika.spec.Basic.Ack)
        if method.multiple:
            tags = [tag for tag in batch.inflight if tag <= method.delivery_tag]
        else:
            tags = [method.delivery_tag] if method.delivery_tag in batch.inflight else []
        for tag in tags:
            index = batch.inflight.pop(tag)
            if not acked:
                batch.results[index] = PublishResult.unavailable("nacked by the broker")
            else:
                batch.results[index] = batch.returned.get(index, PUBLISHED)
        self._pump()
        self._check_done()

    def _on_return(self, _channel: Any, method: Any, properties: Any, _body: bytes) -> None:
        batch = self._batch
        if batch is None:
            return
        index = batch.by_message_id.get(properties.message_id)
        if index is not None:
            batch.returned[index] = PublishResult.rejected(
                f"unroutable: {method.reply_code} {method.reply_text} "
                f"(exchange {method.exchange!r}, routing key {method.routing_key!r})"
            )

    # -- the I/O loop ----------------------------------------------------------------------

    def _run_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Run the connection's I/O loop until ``done()`` or ``timeout`` seconds (at least
        one pass, so ``timeout=0`` serves what is pending)."""
        deadline = time.monotonic() + timeout
        first = True
        while not done() and self._connection is not None and self._loop is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and not first:
                break
            first = False
            loop = self._loop
            self._done = done
            timer = loop.call_later(max(0.0, remaining), loop.stop)
            try:
                loop.start()
            finally:
                self._done = None
                loop.remove_timeout(timer)
        return done()

    def _check_done(self) -> None:
        if self._done is not None and self._done():
            self._stop_loop()

    def _stop_loop(self) -> None:
        if self._loop is not None:
            self._loop.stop()

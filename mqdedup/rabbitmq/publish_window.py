"""The relay publisher's state and its confirm window: publishing records on the
confirm-mode channel up to ``window`` unconfirmed at a time, and settling them from the
broker's acks, nacks and returns (pika callbacks run in the I/O loop).

A record that may be refused (its exchange, body size or ``user_id`` not accepted yet on
this connection) is published *alone*; confirms of records whose batch has ended are
remembered, so the records count as published when the relay offers them again.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from itertools import takewhile
from typing import Any

import pika
import pika.exceptions
import pika.spec

from mqdedup.errors import ConfigurationError
from mqdedup.outbox.publishers import PUBLISHED, OutboxRecord, PublishResult
from mqdedup.rabbitmq.publish_batch import Batch
from mqdedup.rabbitmq.publish_frames import CannotEncodeError, PublishFrames
from mqdedup.rabbitmq.publish_refusals import Refusals, user_id_of
from mqdedup.rabbitmq.topology import connection_parameters, mask_amqp_url

#: Late confirms remembered (message ids), at most.
_LATE_CONFIRMS_MAX = 100_000


class ConfirmWindow:
    """The publisher's state and its confirm-window callbacks.

    The base of :class:`~mqdedup.rabbitmq.publisher.RabbitMQPublisher`, which documents
    the arguments; not used alone.
    """

    def __init__(
        self,
        url: str,
        *,
        window: int = 1000,
        confirm_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        refusal_ttl: float = 30.0,
    ) -> None:
        if window < 1:
            raise ConfigurationError("RabbitMQ confirm window must be at least 1")
        self.parameters = connection_parameters(
            url, f"mqdedup-relay:{socket.gethostname()}:{os.getpid()}"
        )
        self.parameters.socket_timeout = connect_timeout
        self.parameters.stack_timeout = connect_timeout
        # A blocked connection is kept while the alarm lasts (its records may still be
        # confirmed); pika tears it down only after a long block.
        self.parameters.blocked_connection_timeout = max(600.0, 10 * confirm_timeout)
        self.safe_url = mask_amqp_url(url)
        self.window = window
        self.confirm_timeout = confirm_timeout
        self.connect_timeout = connect_timeout
        self._connection: Any = None
        self._loop: Any = None
        self._channel: Any = None
        self._opening: Any = None
        self._next_tag = 1
        self._blocked = False
        self._batch: Batch | None = None
        self._last_error: str | None = None
        self._channel_close: tuple[int | None, str] | None = None
        self._done: Callable[[], bool] | None = None
        # Per connection: exchanges that exist; what the broker accepted already.
        self._known_exchanges: set[str] = set()
        self._proven_exchanges: set[str] = set()
        self._proven_user_ids: set[str] = set()
        self._largest_confirmed = -1
        # Across connections, for refusal_ttl seconds.
        self._missing: dict[str, tuple[str, float]] = {}
        self._refusals = Refusals(refusal_ttl)
        # Records of ended batches still unconfirmed on the channel (tag -> message id),
        # and message ids the broker confirmed after their batch had ended.
        self._orphans: dict[int, str] = {}
        self._late_confirmed: set[str] = set()

    # -- publishing ------------------------------------------------------------------------

    def _risky(self, record: OutboxRecord) -> bool:
        """Whether the broker may close the channel for this record (nothing proven yet)."""
        if (record.destination != "" and record.destination not in self._proven_exchanges) or len(
            record.payload
        ) > self._largest_confirmed:
            return True
        properties = record.properties
        if not properties or "user_id" not in properties:
            return False
        user_id = user_id_of(record)
        return user_id is not None and user_id not in self._proven_user_ids

    def _pump(self) -> None:
        batch, channel = self._batch, self._channel
        if batch is None or channel is None or self._blocked or batch.alone is not None:
            return
        if not channel.is_open:
            return  # closing: what is not sent stays unconfirmed
        frames = PublishFrames.open(self._connection, channel)
        try:
            self._pump_batch(batch, channel, frames)
        finally:
            if frames is not None:
                frames.flush()

    def _pump_batch(self, batch: Batch, channel: Any, frames: PublishFrames | None) -> None:
        """Publish up to the window; ``frames`` (if any) buffers them for one write."""
        while batch.position < len(batch.order) and len(batch.inflight) < self.window:
            index = batch.order[batch.position]
            record = batch.records[index]
            alone = index in batch.suspects or self._risky(record)
            if alone and batch.inflight:
                return  # wait for the records before it to be confirmed
            if not self._encode(frames, record):
                if frames is not None:
                    frames.flush()  # what is buffered goes first: the broker keeps order
                try:
                    channel.basic_publish(
                        exchange=record.destination,
                        routing_key=record.routing_key or "",
                        body=record.payload,
                        properties=pika.BasicProperties(
                            delivery_mode=pika.DeliveryMode.Persistent,
                            headers=dict(record.headers),
                            **(record.properties or {}),
                        ),
                        mandatory=True,
                    )
                except (pika.exceptions.AMQPError, ValueError, TypeError) as error:
                    if not channel.is_open:
                        return  # the rest stays unconfirmed: unavailable
                    batch.results[index] = PublishResult.rejected(
                        f"{type(error).__name__}: {error}"
                    )
                    batch.position += 1
                    continue
            batch.inflight[self._next_tag] = index
            batch.by_message_id[record.message_id] = index
            self._next_tag += 1
            batch.position += 1
            if alone:
                batch.alone = index
                return  # nothing after it until it is confirmed

    @staticmethod
    def _encode(frames: PublishFrames | None, record: OutboxRecord) -> bool:
        """Buffer ``record``'s frames; ``False``: it takes pika's ``basic_publish``."""
        if frames is None:
            return False
        extra = record.properties
        if extra and ("headers" in extra or "delivery_mode" in extra):
            return False  # pika's path refuses the clash with the reason
        properties = {"delivery_mode": 2, "headers": dict(record.headers)}
        if extra:
            properties.update(extra)
        try:
            frames.add(record.destination, record.routing_key or "", properties, record.payload)
        except CannotEncodeError:
            return False
        return True

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        acked = isinstance(method, pika.spec.Basic.Ack)
        self._late_confirms(method.delivery_tag, method.multiple, acked)
        batch = self._batch
        if batch is None:
            return
        if method.multiple:
            # Tags enter ``inflight`` in increasing order: stop at the first one above.
            tags = list(takewhile(method.delivery_tag.__ge__, batch.inflight))
        else:
            tags = [method.delivery_tag] if method.delivery_tag in batch.inflight else []
        for tag in tags:
            index = batch.inflight.pop(tag)
            if index == batch.alone:
                batch.alone = None
            if not acked:
                batch.results[index] = PublishResult.unavailable("nacked by the broker")
                continue
            batch.results[index] = batch.returned.get(index, PUBLISHED)
            if index not in batch.returned:
                self._prove(batch.records[index])
        self._pump()
        self._check_done()

    def _late_confirms(self, tag: int, multiple: bool, acked: bool) -> None:
        """Confirms of records whose batch has ended: published, if offered again."""
        if not self._orphans:
            return
        tags = [t for t in self._orphans if t <= tag] if multiple else [tag]
        for orphan in tags:
            message_id = self._orphans.pop(orphan, None)
            if message_id is not None and acked and len(self._late_confirmed) < _LATE_CONFIRMS_MAX:
                self._late_confirmed.add(message_id)

    def _prove(self, record: OutboxRecord) -> None:
        self._proven_exchanges.add(record.destination)
        size = len(record.payload)
        self._largest_confirmed = max(self._largest_confirmed, size)
        if record.properties and "user_id" in record.properties:
            user_id = user_id_of(record)
            if user_id is not None:
                self._proven_user_ids.add(user_id)

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

    # -- stopping the I/O loop -------------------------------------------------------------

    def _check_done(self) -> None:
        if self._done is not None and self._done():
            self._stop_loop()

    def _stop_loop(self) -> None:
        if self._loop is not None:
            self._loop.stop()

"""RabbitMQ publisher of the relay (pika): persistent, ``mandatory``, confirms in a window.

Messages are published on a confirm-mode channel of a ``SelectConnection`` driven from
the relay's thread: up to ``window`` messages are unconfirmed at a time and the
broker's (multiple) acks release the next ones, instead of one synchronous round trip
per message. A record counts as published when its ack arrived.

What belongs to one record is that record's failure (``REJECTED`` with the broker's
reason; the relay counts an attempt and marks the row failed after its attempts):

* returned as unroutable (``mandatory`` + ``basic.return``);
* its exchange does not exist (a passive declare, answered in milliseconds; the answer
  is remembered for ``refusal_ttl`` seconds);
* the broker closes the channel because of it: a ``user_id`` other than the login
  (406), a body above ``max_message_size`` (406), an internal or forbidden exchange
  (403), a missing exchange (404).

To tell which record made the broker close the channel, and so that no good record is
sent twice, a record that may be refused is published *alone*: after the records
before it are confirmed, and before the ones after it are sent. Such a record is one
whose exchange, body size or ``user_id`` has not been accepted yet on this connection;
in steady state that is none. The broker's refusal is remembered for ``refusal_ttl``
seconds (the exchange, the ``user_id``, the size limit), so the other records it
applies to are rejected with the same reason without closing the channel again. The
rest of the batch goes on a fresh channel of the same connection.

Only real outages are ``UNAVAILABLE`` (the relay puts the rows back without counting an
attempt): the connection cannot be opened or is lost, nacks, no confirm within
``confirm_timeout``, and a broker that blocks publishers (a resource alarm,
``connection.blocked``). A blocked connection is kept, not replaced: while it is blocked
no new record is sent, and records it carried that the broker confirms once the alarm
is over count as published when the relay offers them again (they are not sent
twice). A connection that cannot be closed cleanly is torn down, never left behind.

The frames of a publish are encoded by :mod:`mqdedup.rabbitmq.publish_frames`; what the
broker refused is remembered by :mod:`mqdedup.rabbitmq.publish_refusals`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Any

import pika
import pika.exceptions
import pika.spec

from mqdedup.errors import ConfigurationError
from mqdedup.outbox.publishers import PUBLISHED, OutboxRecord, PublishResult
from mqdedup.rabbitmq.publish_frames import CannotEncodeError, PublishFrames
from mqdedup.rabbitmq.publish_refusals import (
    RECORD_REPLY_CODES,
    Refusals,
    match_culprit,
    user_id_of,
)
from mqdedup.rabbitmq.topology import BrokerNodes, mask_amqp_url

log = logging.getLogger(__name__)

#: Late confirms remembered (message ids), at most.
_LATE_CONFIRMS_MAX = 100_000


class UnavailableError(Exception):
    """The broker cannot be used right now (connect failed, channel lost)."""


@dataclass
class Batch:
    """The records of one publishing round and their state on the channel."""

    records: Sequence[OutboxRecord]
    results: list[PublishResult | None]
    order: list[int]
    suspects: set[int] = field(default_factory=set)
    position: int = 0
    inflight: dict[int, int] = field(default_factory=dict)  # delivery tag -> record index
    returned: dict[int, PublishResult] = field(default_factory=dict)
    by_message_id: dict[str, int] = field(default_factory=dict)
    alone: int | None = None  # index of the record published alone, until confirmed

    @property
    def done(self) -> bool:
        """Every record was sent and confirmed (or settled without sending)."""
        return self.position >= len(self.order) and not self.inflight

    def unconfirmed(self) -> list[int]:
        """Indices in flight or not sent yet, in the batch's order."""
        return sorted(self.inflight.values()) + self.order[self.position :]


class RabbitMQPublisher:
    """Publishes outbox records to RabbitMQ with asynchronous publisher confirms.

    ``url``: ``amqp://user:password@host:port/vhost``. ``window``: most unconfirmed
    messages at a time. ``confirm_timeout``: how long a batch waits for its acks.
    ``refusal_ttl``: seconds a broker refusal (missing or refusing exchange, ``user_id``,
    size limit) is applied to other records without asking the broker again.

    Its methods, in this order: the ``Publisher`` seam and the publishing rounds, the
    confirm window (pika callbacks, run in the I/O loop), the connection and its channel,
    the passive exchange check, and the I/O loop driven from the relay's thread.
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
        # One URL, or a cluster's node URLs: tried in turn, the next node first after a
        # lost connection. Records unconfirmed when a node dies are never taken as
        # published: they are "unavailable" and the relay sends them again.
        self._nodes = BrokerNodes(url, f"mqdedup-relay:{socket.gethostname()}:{os.getpid()}")
        for parameters in self._nodes.parameters:
            parameters.socket_timeout = connect_timeout
            parameters.stack_timeout = connect_timeout
            # A blocked connection is kept while the alarm lasts (its records may still
            # be confirmed); pika tears it down only after a long block.
            parameters.blocked_connection_timeout = max(600.0, 10 * confirm_timeout)
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

    @property
    def parameters(self) -> pika.URLParameters:
        """The connection parameters of the first node (all of them: ``nodes.parameters``)."""
        return self._nodes.parameters[0]

    @property
    def nodes(self) -> BrokerNodes:
        """The broker's nodes this publisher connects to, in turn."""
        return self._nodes

    # -- Publisher -------------------------------------------------------------------------

    def publish_batch(self, records: Sequence[OutboxRecord]) -> list[PublishResult]:
        """Publish in order within the confirm window; one result per record."""
        if not records:
            return []
        results: list[PublishResult | None] = [None] * len(records)
        if self._connection is not None:
            self._run_until(lambda: False, 0.0)  # late confirms, unblock notices
        late = self._late_confirmed
        if late:
            for index, record in enumerate(records):
                if record.message_id in late:
                    late.discard(record.message_id)
                    results[index] = PUBLISHED
        if self._blocked:
            reason = "RabbitMQ blocks publishing (a resource alarm); waiting"
            return [r if r is not None else PublishResult.unavailable(reason) for r in results]
        todo = [index for index, result in enumerate(results) if result is None]
        suspects: set[int] = set()
        for _ in range(len(records) + 2):  # each round settles at least one record
            if not todo:
                break
            todo, suspects = self._publish_round(records, results, todo, suspects)
        reason = self._last_error or "the broker kept closing the channel"
        return [r if r is not None else PublishResult.unavailable(reason) for r in results]

    def keepalive(self) -> None:
        """Serve heartbeats and pending frames without blocking."""
        if self._connection is not None:
            self._run_until(lambda: False, 0.0)

    def close(self) -> None:
        """Close the connection (waits briefly for the close handshake)."""
        self._reset()

    # -- one round: a channel's worth of the batch -----------------------------------------

    def _publish_round(
        self,
        records: Sequence[OutboxRecord],
        results: list[PublishResult | None],
        todo: list[int],
        suspects: set[int],
    ) -> tuple[list[int], set[int]]:
        """Publish ``todo`` on one channel; return what is left for a fresh channel."""
        try:
            self._ensure_channel()
            self._check_exchanges({records[index].destination for index in todo})
        except UnavailableError as error:
            self._reset()
            for index in todo:
                results[index] = PublishResult.unavailable(str(error))
            return [], set()
        order: list[int] = []
        for index in todo:
            reason = self._refusal(records[index])
            if reason is not None:
                results[index] = PublishResult.rejected(reason)
            else:
                order.append(index)
        batch = Batch(records, results, order, suspects=suspects)
        channel = self._channel
        self._batch = batch
        try:
            self._pump()
            self._run_until(
                lambda: batch.done or self._channel is not channel or self._blocked,
                self.confirm_timeout,
            )
        finally:
            self._batch = None
        if batch.done:
            return [], set()
        left = batch.unconfirmed()
        if self._connection is not None and self._channel is None and self._channel_close:
            return self._after_channel_closed(batch, left)
        # The connection is lost, blocked, or the confirms are late: the broker's failure.
        reason = self._last_error or f"no publisher confirm within {self.confirm_timeout} s"
        if self._blocked:
            reason = "RabbitMQ blocks publishing (a resource alarm); waiting"
            for tag, index in batch.inflight.items():
                self._orphans[tag] = records[index].message_id
        log.warning(
            "RabbitMQ batch incomplete",
            extra={"unconfirmed": len(left), "reason": reason, "url": self.safe_url},
        )
        if not self._blocked:
            self._reset()
        for index in left:
            results[index] = PublishResult.unavailable(reason)
        return [], set()

    def _after_channel_closed(self, batch: Batch, left: list[int]) -> tuple[list[int], set[int]]:
        """The broker closed the channel because of one record: find it, reject it."""
        assert self._channel_close is not None
        code, text = self._channel_close
        reason = f"RabbitMQ refused the message: {code} {text}"
        culprit = (
            batch.alone
            if batch.alone in left
            else match_culprit(batch.records, batch.inflight.values(), code, text)
        )
        if culprit is None:
            if code not in RECORD_REPLY_CODES:
                log.warning(
                    "RabbitMQ closed the relay's channel", extra={"code": code, "text": text}
                )
            # Unknown culprit: send the unconfirmed records one by one to find it.
            return left, set(left)
        record = batch.records[culprit]
        batch.results[culprit] = PublishResult.rejected(reason)
        self._refusals.learn(record, code, text, reason)
        log.warning(
            "RabbitMQ refused an outbox record",
            extra={"outbox_id": record.id, "message_id": record.message_id, "reason": reason},
        )
        # Records published before the culprit on the closed channel may have arrived:
        # sent again alone (a duplicate at worst); those after it were dropped.
        rest = [index for index in left if index != culprit]
        earlier = {index for index in batch.inflight.values() if index != culprit}
        return rest, (batch.suspects | earlier) - {culprit}

    def _refusal(self, record: OutboxRecord) -> str | None:
        if not self._missing and not self._refusals:
            return None  # nothing refused lately (the steady state)
        missing = self._missing.get(record.destination)
        if missing is not None and missing[1] > time.monotonic():
            return missing[0]
        return self._refusals.reason(record)

    # -- the confirm window (pika callbacks run in the I/O loop) ---------------------------

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

    # -- connection ------------------------------------------------------------------------

    def _ensure_channel(self) -> None:
        if self._channel is not None and self._channel.is_open:
            return
        if self._connection is None or not self._connection.is_open:
            for index in self._nodes.order():
                self._reset()
                self._last_error = None
                self._connection = pika.SelectConnection(
                    self._nodes.parameters[index],
                    on_open_callback=self._on_connection_open,
                    on_open_error_callback=self._on_connection_error,
                    on_close_callback=self._on_connection_closed,
                )
                self._loop = self._connection.ioloop
                self._run_until(
                    lambda: self._channel is not None or self._connection is None,
                    self.connect_timeout,
                )
                if self._channel is not None:
                    self._nodes.current = index
                    break
        else:
            self._open_channel()
            self._run_until(
                lambda: self._channel is not None or self._connection is None,
                self.connect_timeout,
            )
        if self._channel is None:
            error = self._last_error or f"no channel within {self.connect_timeout} s"
            raise UnavailableError(f"cannot connect to RabbitMQ at {self.safe_url}: {error}")

    def _on_connection_open(self, connection: Any) -> None:
        connection.add_on_connection_blocked_callback(self._on_blocked)
        connection.add_on_connection_unblocked_callback(self._on_unblocked)
        self._open_channel()

    def _on_connection_error(self, _connection: Any, error: BaseException) -> None:
        self._last_error = f"{type(error).__name__}: {error}"
        self._connection = None
        self._channel = None
        self._stop_loop()

    def _on_connection_closed(self, connection: Any, reason: BaseException) -> None:
        if connection is not self._connection:
            return
        self._nodes.lost()  # a cluster's other nodes are tried first
        self._last_error = f"connection closed: {type(reason).__name__}: {reason}"
        self._connection = None
        self._channel = None
        self._forget_connection_facts()
        self._stop_loop()

    def _on_blocked(self, _connection: Any, _frame: Any) -> None:
        self._blocked = True
        log.warning("RabbitMQ blocks publishing (resource alarm); the relay waits")
        self._stop_loop()

    def _on_unblocked(self, _connection: Any, _frame: Any) -> None:
        self._blocked = False
        log.info("RabbitMQ unblocked publishing")

    def _open_channel(self) -> None:
        self._channel = None
        self._orphans.clear()  # their confirms would have come on the closed channel
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
        self._channel_close = None
        self._check_done()

    def _on_channel_closed(self, channel: Any, reason: BaseException) -> None:
        if channel is self._channel or channel is self._opening:
            self._channel = None
            self._channel_close = (
                getattr(reason, "reply_code", None),
                str(getattr(reason, "reply_text", reason)),
            )
            self._last_error = f"channel closed: {type(reason).__name__}: {reason}"
        self._stop_loop()

    def _forget_connection_facts(self) -> None:
        self._known_exchanges.clear()
        self._proven_exchanges.clear()
        self._proven_user_ids.clear()
        self._largest_confirmed = -1
        self._orphans.clear()
        self._blocked = False

    def _reset(self) -> None:
        connection, self._connection = self._connection, None
        self._channel = None
        self._forget_connection_facts()
        if connection is None:
            return
        try:
            if connection.is_open:
                connection.close()
                self._connection = connection  # let the close handshake run
                self._run_until(lambda: connection.is_closed, 2.0)
        except Exception:
            log.debug("closing the RabbitMQ connection failed", exc_info=True)
        finally:
            self._connection = None
        if not connection.is_closed:
            # No close handshake (e.g. a connection blocked by a memory alarm): pika has
            # no public abort, so the connection is dropped here and the broker closes
            # it when its heartbeats stop (measured: 181 s after the alarm, with the
            # broker's 60 s heartbeat). A rare path: not worth pika's _terminate_stream.
            log.warning(
                "RabbitMQ connection did not close; dropped (the broker closes it after "
                "its heartbeat timeout)",
                extra={"url": self.safe_url},
            )

    # -- exchanges -------------------------------------------------------------------------

    def _check_exchanges(self, exchanges: set[str]) -> None:
        """Passively declare exchanges not checked yet; remember missing ones for a while."""
        now = time.monotonic()
        for exchange in sorted(exchanges - self._known_exchanges - {""}):
            missing = self._missing.get(exchange)
            if missing is not None and missing[1] > now:
                continue
            if self._exchange_exists(exchange):
                self._known_exchanges.add(exchange)
                self._missing.pop(exchange, None)
                continue
            if self._channel_close is not None and self._channel_close[0] == 404:
                reason = f"RabbitMQ exchange {exchange!r} does not exist"
                self._missing[exchange] = (reason, now + self._refusals.ttl)
                self._ensure_channel()
                continue
            raise UnavailableError(
                f"cannot check exchange {exchange!r}: {self._last_error or 'no answer'}"
            )

    def _exchange_exists(self, exchange: str) -> bool:
        """Passive declare; False when the broker closed the channel instead of answering."""
        confirmed: list[bool] = []
        channel = self._channel

        def on_ok(_frame: Any) -> None:
            confirmed.append(True)
            self._stop_loop()

        channel.exchange_declare(exchange=exchange, passive=True, callback=on_ok)
        self._run_until(
            lambda: bool(confirmed) or self._channel is not channel, self.connect_timeout
        )
        return bool(confirmed)

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

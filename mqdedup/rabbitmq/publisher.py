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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from mqdedup.outbox.publishers import PUBLISHED, OutboxRecord, PublishResult
from mqdedup.rabbitmq.publish_batch import Batch, match_culprit
from mqdedup.rabbitmq.publish_connection import PublisherConnection, UnavailableError
from mqdedup.rabbitmq.publish_refusals import RECORD_REPLY_CODES

log = logging.getLogger(__name__)


class RabbitMQPublisher(PublisherConnection):
    """Publishes outbox records to RabbitMQ with asynchronous publisher confirms.

    ``url``: ``amqp://user:password@host:port/vhost``. ``window``: most unconfirmed
    messages at a time. ``confirm_timeout``: how long a batch waits for its acks.
    ``refusal_ttl``: seconds a broker refusal (missing or refusing exchange, ``user_id``,
    size limit) is applied to other records without asking the broker again.
    """

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
        culprit = batch.alone if batch.alone in left else match_culprit(batch, code, text)
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

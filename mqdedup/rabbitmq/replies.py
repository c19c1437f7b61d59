"""Request/reply over RabbitMQ with identical replies for duplicate requests.

::

    class PriceQuotes(RequestReplyConsumer):
        queue = "quotes"

        def respond(self, message, ctx):
            quote = Quote(**message.json())
            ctx.session.add(quote)                    # effects commit once, as usual
            return {"quote": quote.number, "price": quote.price}

A client publishes a request with the AMQP ``reply_to`` (its reply queue) and
``correlation_id`` properties, and a ``message_id`` (the dedup key). ``respond`` runs once
per message id; its return value is the reply. It is stored with the dedup claim, in the
same transaction as the handler's writes. After the commit, and before the request is
acknowledged, the reply is published to the default exchange with routing key
``reply_to`` and the request's ``correlation_id``.

When the same request arrives again (a client retry, a redelivery, a replay, also
several copies in one batch), ``respond`` does not run: the stored reply is re-sent.
Every reply to one request has the same body (canonical JSON: sorted keys, no spaces,
UTF-8), the same ``correlation_id`` and the same ``message_id`` (derived from the
consumer name and the request id), so clients can deduplicate replies too.

Delivery guarantees: a reply is published (with a broker confirm) before the request
is acknowledged. If the process dies in between, the request comes back and its stored
reply is sent again: replies are at-least-once, always identical. A reply whose queue is
gone (the client left) is dropped with a warning; it never blocks the consumer. While
the broker cannot take replies, publishing is retried for ``reply_retry_seconds``;
then the batch is left unacknowledged (it is redelivered later, and replied to then).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar

import pika
import pika.exceptions

from mqdedup.backoff import Backoff
from mqdedup.consumers.context import Context
from mqdedup.consumers.metrics import Metrics
from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.message import Message
from mqdedup.rabbitmq.consumer import RabbitMQConsumer
from mqdedup.rabbitmq.topology import BrokerNodes, mask_amqp_url
from mqdedup.stopping import StopToken

log = logging.getLogger(__name__)

#: Header naming the request a reply answers.
REQUEST_ID_HEADER = "x-mqdedup-request-id"
_REPLY_NAMESPACE = uuid.UUID("0d6b7f1e-3a51-5b8c-9f0e-7265706c7921")
_MAX_PENDING_REPLIES = 100_000
_RETRYABLE = (pika.exceptions.AMQPError, OSError)


def reply_body(result: Any) -> bytes:
    """The canonical JSON bytes of a reply: equal values give equal bytes."""
    return json.dumps(result, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def reply_message_id(consumer_name: str, request_id: str) -> str:
    """The message id every reply to ``request_id`` carries."""
    return str(uuid.uuid5(_REPLY_NAMESPACE, f"{consumer_name}\x1f{request_id}"))


class ReplyPublisher:
    """A publishing connection for replies, with confirms; used from one thread.

    Opened lazily and reopened after a failure. ``publish`` retries connection losses
    with backoff for ``retry_seconds``, then raises :class:`BrokerUnavailableError`.
    """

    def __init__(self, url: str, connection_name: str, *, retry_seconds: float = 30.0) -> None:
        self.url = url
        self.connection_name = connection_name
        self.retry_seconds = retry_seconds
        self._connection: Any = None
        self._channel: Any = None

    def publish(self, routing_key: str, body: bytes, properties: pika.BasicProperties) -> bool:
        """Publish to the default exchange; False if no queue took it (reply queue gone)."""
        deadline = time.monotonic() + self.retry_seconds
        backoff = 0.1
        while True:
            try:
                channel = self._open()
                channel.basic_publish(
                    exchange="",
                    routing_key=routing_key,
                    body=body,
                    properties=properties,
                    mandatory=True,
                )
                return True
            except pika.exceptions.UnroutableError:
                return False
            except _RETRYABLE as error:
                self.close()
                if time.monotonic() + backoff > deadline:
                    raise BrokerUnavailableError(
                        f"cannot publish replies to RabbitMQ at {mask_amqp_url(self.url)}: "
                        f"{type(error).__name__}"
                    ) from error
                log.warning(
                    "reply publish failed; reconnecting",
                    extra={"error": type(error).__name__, "backoff": backoff},
                )
                time.sleep(backoff)
                backoff = Backoff(0.1, 5.0).after(backoff)

    def _open(self) -> Any:
        if self._channel is not None and self._channel.is_open:
            return self._channel
        self.close()
        nodes = BrokerNodes(self.url, self.connection_name)
        self._connection, self._channel = nodes.confirm_channel()
        return self._channel

    def close(self) -> None:
        """Close the connection (quietly: it may be broken already)."""
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except _RETRYABLE:
                log.debug("closing the reply connection failed", exc_info=True)


class RequestReplyConsumer(RabbitMQConsumer):
    """A RabbitMQ consumer answering requests; implement :meth:`respond`, not ``handle``.

    See the module docstring for the protocol and the guarantees.
    """

    #: ``content_type`` of the replies.
    reply_content_type: ClassVar[str] = "application/json"
    #: Seconds to keep retrying a reply while the broker is unreachable.
    reply_retry_seconds: ClassVar[float] = 30.0

    def __init__(self) -> None:
        super().__init__()
        self._fresh_replies: dict[str, Any] = {}
        self._publisher: ReplyPublisher | None = None
        #: Replies published (first answers and re-sent stored ones).
        self.replies_sent = 0
        #: Replies dropped because their reply queue was gone.
        self.replies_dropped = 0

    def respond(self, message: Message, ctx: Context) -> Any:
        """Apply the request's effects through ``ctx``; return the JSON-serialisable reply."""
        raise NotImplementedError(f"{type(self).__name__} must implement respond()")

    # -- the consumer hooks ------------------------------------------------------------

    def handle(self, message: Message, ctx: Context) -> Any:
        """Run :meth:`respond`; its reply is stored with the claim (do not override)."""
        reply = self.respond(message, ctx)
        if len(self._fresh_replies) >= _MAX_PENDING_REPLIES:
            self._fresh_replies.clear()  # only replies of failed runs can pile up here
        self._fresh_replies[str(message.id)] = reply
        return reply

    def after_commit(self, messages: Sequence[Message]) -> None:
        """Publish the replies of the requests whose transaction just committed."""
        for message in messages:
            reply = self._fresh_replies.pop(str(message.id), None)
            # Round-trip through JSON, as the stored copy does, so that the first reply
            # and every re-sent one are built from equal values.
            self._reply(message, json.loads(json.dumps(reply)), duplicate=False)

    def on_duplicate(self, message: Message, stored_result: Any) -> None:
        """Re-send the stored reply to a repeated request (the handler does not run)."""
        self._reply(message, stored_result, duplicate=True)

    # -- running -----------------------------------------------------------------------

    def run(
        self,
        database: Any,
        *,
        stop: StopToken | None = None,
        metrics: Metrics | None = None,
    ) -> Metrics:
        """Consume until ``stop`` is requested (see :meth:`RabbitMQConsumer.run`)."""
        try:
            return super().run(database, stop=stop, metrics=metrics)
        finally:
            self.close_replies()

    def close_replies(self) -> None:
        """Close the reply connection (reopened when the next reply is sent)."""
        if self._publisher is not None:
            self._publisher.close()

    def validate(self) -> None:
        """Also refuse subclasses that override ``handle``/``handle_batch``."""
        owner = type(self).__name__
        if type(self).handle is not RequestReplyConsumer.handle or self.has_batch_handler:
            raise ConfigurationError(
                f"{owner} implements handle()/handle_batch(); a RequestReplyConsumer "
                "implements respond() instead"
            )
        if type(self).respond is RequestReplyConsumer.respond:
            raise ConfigurationError(f"{owner} does not implement respond()")
        if self.reply_retry_seconds < 0:
            raise ConfigurationError(f"{owner}.reply_retry_seconds must not be negative")
        super().validate()

    # -- publishing --------------------------------------------------------------------

    def _reply(self, message: Message, result: Any, *, duplicate: bool) -> None:
        reply_to = message.properties.get("reply_to")
        if not reply_to:
            return  # not a request: nobody is waiting for an answer
        request_id = str(message.id)
        properties = pika.BasicProperties(
            content_type=self.reply_content_type,
            correlation_id=message.properties.get("correlation_id"),
            message_id=reply_message_id(self.consumer_name, request_id),
            headers={REQUEST_ID_HEADER: request_id},
            delivery_mode=2,
        )
        if self._publisher is None:
            self._publisher = ReplyPublisher(
                self.broker_url,
                f"{self.connection_name or self.consumer_name}:replies",
                retry_seconds=self.reply_retry_seconds,
            )
        if self._publisher.publish(str(reply_to), reply_body(result), properties):
            self.replies_sent += 1
            log.debug(
                "reply sent",
                extra={"request_id": request_id, "duplicate": duplicate, "reply_to": reply_to},
            )
        else:
            self.replies_dropped += 1
            log.warning(
                "reply dropped: its reply queue is gone",
                extra={"request_id": request_id, "reply_to": reply_to},
            )

"""Publishing from your own pika channel what a mqdedup consumer needs.

::

    import pika
    from mqdedup.rabbitmq.producing import publish_message

    channel = pika.BlockingConnection(pika.URLParameters(url)).channel()
    channel.confirm_delivery()  # basic_publish then raises if the broker refuses
    message_id = publish_message(channel, {"order": 1}, routing_key="orders")

:func:`publish_message` sets the AMQP ``message_id`` property (what
``RabbitMQConsumer`` reads by default) and the ``message-id`` header to the same id (a
new time-ordered UUIDv7 unless you pass ``message_id=``: keep the id of a message you
publish again, so the resend is a duplicate), ``content_type``, persistent delivery, and
the trace context headers. See :mod:`mqdedup.stamping` and ``docs/producers.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pika

from mqdedup.rabbitmq.topology import BrokerNodes
from mqdedup.stamping import stamp

__all__ = ["open_channel", "publish_message"]


def publish_message(
    channel: Any,
    body: Any,
    *,
    exchange: str = "",
    routing_key: str,
    message_id: str | None = None,
    headers: Mapping[str, str | bytes] | None = None,
    content_type: str | None = None,
    properties: Mapping[str, Any] | None = None,
    mandatory: bool = True,
) -> str:
    """Publish ``body`` on a pika ``BlockingChannel``; return its message id.

    ``exchange`` ``""`` with ``routing_key=<queue>`` sends straight to a queue.
    ``properties``: other AMQP basic properties (``correlation_id``, ``reply_to``,
    ``expiration``, ...). With ``channel.confirm_delivery()`` the call returns once the
    broker has the message, and raises when it refuses it or (``mandatory``) when no
    queue is bound to take it.
    """
    stamped = stamp(body, message_id=message_id, content_type=content_type, headers=headers)
    application_headers = dict(stamped.headers)
    application_headers.pop("content-type")  # an AMQP property of its own
    extra = dict(properties or {})
    for name in ("message_id", "content_type", "headers"):
        if name in extra:
            raise ValueError(f"property {name!r} is stamped by mqdedup: pass it as an argument")
    channel.basic_publish(
        exchange=exchange,
        routing_key=routing_key,
        body=stamped.body,
        properties=pika.BasicProperties(
            message_id=stamped.message_id,
            content_type=stamped.content_type,
            delivery_mode=pika.DeliveryMode.Persistent,
            headers=application_headers,
            **extra,
        ),
        mandatory=mandatory,
    )
    return stamped.message_id


def open_channel(url: str, *, timeout: float = 10.0) -> Any:
    """A pika ``BlockingChannel`` on ``url`` in confirm mode (the caller closes
    ``channel.connection``). Raises :class:`~mqdedup.errors.BrokerUnavailableError`
    when the broker does not answer."""
    nodes = BrokerNodes(url, "mqdedup-publish")  # (one TCP attempt per node)
    for parameters in nodes.parameters:
        parameters.socket_timeout = timeout
        parameters.blocked_connection_timeout = timeout
    channel = nodes.open().channel()
    channel.confirm_delivery()
    return channel

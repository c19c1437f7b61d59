"""Move dead-lettered messages back to the queue they came from, losing none.

Each message is taken from the dead-letter queue unacknowledged, published to its
target queue with a publisher confirm, and only then acknowledged on the dead-letter
queue. A crash in between leaves a copy in both queues, never in neither; the consumer's
dedup makes the extra copy harmless.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pika
import pika.exceptions
from sqlalchemy import delete

from mqdedup.db.schema import DEFAULT_PREFIX, schema
from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.rabbitmq.codec import (
    MESSAGE_ID_HEADER,
    SOURCE_QUEUE_HEADER,
    header_text,
    requeue_properties,
)
from mqdedup.rabbitmq.topology import (
    BrokerNodes,
    mask_amqp_url,
    rabbitmq_url_from_env,
)

if TYPE_CHECKING:
    from sqlalchemy import Engine

log = logging.getLogger(__name__)

_CONSUMER_HEADER = "x-mqdedup-consumer"


@dataclass(frozen=True)
class RequeueResult:
    """What a requeue did.

    ``moved``: messages now in their target queue. ``skipped``: messages left in the
    dead-letter queue because they name no source queue and no target was given.
    ``remaining``: messages in the dead-letter queue afterwards.
    """

    moved: int
    skipped: int
    remaining: int


def requeue_dead_letters(
    url: str | None = None,
    *,
    dead_letter_queue: str,
    target_queue: str | None = None,
    limit: int | None = None,
    database: Engine | None = None,
    table_prefix: str = DEFAULT_PREFIX,
    consumer_name: str | None = None,
    connection_name: str | None = None,
) -> RequeueResult:
    """Move messages from ``dead_letter_queue`` back (all of them, or up to ``limit``).

    The target is ``target_queue``, else each message's ``x-mqdedup-source-queue``
    header. At most the number of messages present at the start are moved, so a
    message that fails again and returns to the dead-letter queue is not looped.
    The ``x-mqdedup-*`` reason headers are removed and ``x-mqdedup-requeued`` counts
    the moves. With ``database``, each moved message's attempt counter
    (``<prefix>message_attempts``, keyed by the ``x-mqdedup-consumer`` header or
    ``consumer_name`` and the ``x-mqdedup-message-id`` header) is deleted first, so it
    gets a full set of retries again.
    """
    if limit is not None and limit < 0:
        raise ConfigurationError("requeue limit must be zero or more")
    if not dead_letter_queue:
        raise ConfigurationError("requeue needs the dead-letter queue name")
    broker_url = url or rabbitmq_url_from_env()
    masked = mask_amqp_url(broker_url)
    nodes = BrokerNodes(
        broker_url,
        connection_name
        or f"mqdedup-requeue:{dead_letter_queue}:{socket.gethostname()}:{os.getpid()}",
    )
    try:
        connection = nodes.connect()
    except (pika.exceptions.AMQPError, OSError) as error:
        raise BrokerUnavailableError(
            f"cannot connect to RabbitMQ at {masked}: {type(error).__name__}"
        ) from error
    try:
        return _requeue(
            connection,
            dead_letter_queue=dead_letter_queue,
            target_queue=target_queue,
            limit=limit,
            database=database,
            table_prefix=table_prefix,
            consumer_name=consumer_name,
        )
    finally:
        # Closing returns anything taken and not acknowledged (skipped, or a failed move).
        if connection.is_open:
            connection.close()


def _requeue(
    connection: Any,
    *,
    dead_letter_queue: str,
    target_queue: str | None,
    limit: int | None,
    database: Engine | None,
    table_prefix: str,
    consumer_name: str | None,
) -> RequeueResult:
    channel = connection.channel()
    channel.confirm_delivery()
    depth = _queue_depth(connection, dead_letter_queue)
    if target_queue is not None:
        _queue_depth(connection, target_queue)  # must exist: fail before moving anything
    budget = depth if limit is None else min(limit, depth)
    moved = skipped = 0
    attempts_table = schema(table_prefix).attempts if database is not None else None
    while moved + skipped < budget:
        method, properties, body = channel.basic_get(dead_letter_queue, auto_ack=False)
        if method is None:
            break
        headers = properties.headers or {}
        target = target_queue or header_text(headers, SOURCE_QUEUE_HEADER)
        if not target:
            skipped += 1  # stays unacked until we close: back in the dead-letter queue
            log.warning(
                "dead letter names no source queue; left in place",
                extra={"dead_letter_queue": dead_letter_queue, "message_id": properties.message_id},
            )
            continue
        message_id = header_text(headers, MESSAGE_ID_HEADER)
        if attempts_table is not None and database is not None and message_id is not None:
            scope = header_text(headers, _CONSUMER_HEADER) or consumer_name
            if scope is not None:
                with database.begin() as db:
                    db.execute(
                        delete(attempts_table).where(
                            attempts_table.c.consumer_name == scope,
                            attempts_table.c.message_id == message_id,
                        )
                    )
        try:
            channel.basic_publish(
                exchange="",
                routing_key=target,
                body=body or b"",
                properties=requeue_properties(properties),
                mandatory=True,
            )
        except pika.exceptions.UnroutableError as error:
            raise ConfigurationError(
                f"cannot requeue to {target!r}: no such queue (the message stays in "
                f"{dead_letter_queue!r})"
            ) from error
        channel.basic_ack(method.delivery_tag)
        moved += 1
    remaining = _queue_depth(connection, dead_letter_queue) + skipped
    log.info(
        "requeued dead letters",
        extra={
            "dead_letter_queue": dead_letter_queue,
            "moved": moved,
            "skipped": skipped,
            "remaining": remaining,
        },
    )
    return RequeueResult(moved=moved, skipped=skipped, remaining=remaining)


def _queue_depth(connection: Any, queue: str) -> int:
    """Ready messages in ``queue`` (passive declare on a throw-away channel)."""
    channel = connection.channel()
    try:
        frame = channel.queue_declare(queue=queue, passive=True)
    except pika.exceptions.ChannelClosedByBroker as error:
        if error.reply_code == 404:
            raise ConfigurationError(f"queue {queue!r} does not exist") from error
        raise
    count = int(frame.method.message_count)
    if channel.is_open:
        channel.close()
    return count

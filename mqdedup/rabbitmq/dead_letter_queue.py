"""The ``rabbitmq`` place: dead letters in RabbitMQ dead-letter queues (``<queue>.dlq``).

:class:`~mqdedup.rabbitmq.dead_letters.DeadLetterPublisher` writes each dead letter as
the original message plus ``x-mqdedup-*`` headers (reason, consumer, attempts, error,
source queue, message id, when). :class:`RabbitDeadLetterQueues` reads them without
losing any: every read takes messages with ``basic.get`` *unacknowledged* and gives
back all it did not choose by closing its channel, so they return to the queue (in
their place, where RabbitMQ can; marked redelivered). Only :meth:`delete`, a replay's
settle and :meth:`requeue` acknowledge, and only the messages they were asked for; a
requeue acknowledges a message only after the broker confirmed its copy in the source
queue (a crash in between leaves a copy in both; the consumer's claims skip the second).

A key is ``queue:message id`` (``x-mqdedup-message-id``, else the AMQP ``message_id``;
a message with neither is ``queue:sha256:<16 hex of its body's hash>``). Two dead letters
of the same message share a key and are acted on together.

Concurrent readers: while one reader holds messages (for the moment of its scan), a
second reader does not see them, so a list may show fewer and an action may find fewer
than the queue holds (it then returns a smaller count; run it again). Nothing is lost or
acknowledged twice: the broker hands each message to one reader at a time. A queue's
readers are bounded to the messages present when the scan began.

:func:`requeue_dead_letters` (``RabbitMQConsumer.requeue_dead_letters``) is the same
confirmed move for a whole queue, or its first ``limit`` messages, to the source queue
or a named one.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Final

import pika
import pika.exceptions
from sqlalchemy import Engine

from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.deadletters.attempts import forget_attempts
from mqdedup.deadletters.records import (
    DeadLetterKeyError,
    DeadLetterRecord,
    Place,
    broker_record,
    text_headers,
)
from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.rabbitmq.codec import (
    DEAD_LETTERED_AT_HEADER,
    MESSAGE_ID_HEADER,
    SOURCE_QUEUE_HEADER,
    delivery_message,
    requeue_properties,
)
from mqdedup.rabbitmq.reconnecting import describe
from mqdedup.rabbitmq.topology import (
    BrokerNodes,
    queue_depth,
    rabbitmq_url_from_env,
)

log = logging.getLogger(__name__)

PLACE: Final[Place] = "rabbitmq"

_Records = list[DeadLetterRecord]  # (``list`` is a method's name in the class)


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


@dataclass
class _Scan:
    """Which messages a scan of one queue matches (by key, by consumer) and what it does
    with them: collect them into ``found``, acknowledge them (``ack``), after a copy to
    their source queue, or ``target`` (``republish``); ``limit``: stop once ``found``
    holds that many. A requeue counts what it ``skipped`` and what is ``remaining``."""

    keys: frozenset[str] | None = None
    consumer: str | None = None
    found: _Records = field(default_factory=list)
    limit: int | None = None
    ack: bool = False
    republish: bool = False
    target: str | None = None
    #: Whose attempt counts a requeue forgets when a dead letter names no consumer.
    default_consumer: str | None = None
    skipped: int = 0
    remaining: int = 0

    def matches(self, record: DeadLetterRecord) -> bool:
        if self.keys is not None and record.key not in self.keys:
            return False
        return self.consumer is None or record.consumer == self.consumer


class RabbitDeadLetterQueues:
    """Dead letters in RabbitMQ dead-letter queues (a :class:`DeadLetterPlace`).

    ``queues``: the dead-letter queues to read. ``engine`` (optional) holds the attempt
    counts a requeue forgets, so a requeued message gets its full retries again.
    ``connection_name``: how the connection shows in ``rabbitmqctl list_connections``.
    """

    place: Place = PLACE

    def __init__(
        self,
        url: str | Sequence[str] | None,
        queues: Sequence[str],
        *,
        engine: Engine | None = None,
        prefix: str = DEFAULT_PREFIX,
        connection_name: str | None = None,
    ) -> None:
        if not queues:
            raise ConfigurationError("name the dead-letter queue(s) to read (e.g. orders.dlq)")
        self.url = url or rabbitmq_url_from_env()
        self.queues = list(dict.fromkeys(queues))
        self.engine = engine
        self.prefix = prefix
        self._nodes = BrokerNodes(
            self.url,
            connection_name or f"mqdedup-dead-letters:{socket.gethostname()}:{os.getpid()}",
        )

    @classmethod
    def for_consumer(cls, consumer: Any, engine: Engine | None = None) -> RabbitDeadLetterQueues:
        """The dead-letter queue of a :class:`~mqdedup.rabbitmq.consumer.RabbitConsumer`."""
        return cls(
            consumer.broker_url,
            [consumer.topology().dead_letter_queue],
            engine=engine,
            prefix=consumer.table_prefix,
        )

    # -- the protocol ---------------------------------------------------------------------

    def list(self, *, consumer: str | None = None, limit: int = 100) -> _Records:
        """Up to ``limit`` dead letters in queue order; the queues are left as they were."""
        found: _Records = []
        for queue in self.queues:
            if len(found) >= limit:
                break
            self._scan(queue, _Scan(consumer=consumer, found=found, limit=limit))
        return found[:limit]

    def get(self, key: str) -> DeadLetterRecord | None:
        """The first dead letter with ``key`` (None: not there, or held by another reader)."""
        queue, _ = parse_key(key, self.queues)
        found: _Records = []
        self._scan(queue, _Scan(keys=frozenset({key.strip()}), found=found, limit=1))
        return found[0] if found else None

    def depth(self) -> int:
        """Ready messages in every dead-letter queue."""
        return sum(self.depths().values())

    def depths(self) -> dict[str, int]:
        """Ready messages per dead-letter queue (0 for a queue not declared yet)."""
        with self._connection() as connection:
            return {queue: _queue_depth(connection, queue) for queue in self.queues}

    def delete(self, keys: Sequence[str]) -> int:
        """Acknowledge (drop) every dead letter with one of ``keys``."""
        return sum(
            self._scan(queue, _Scan(keys=frozenset(names), ack=True))
            for queue, names in self._by_queue(keys).items()
        )

    def requeue(self, keys: Sequence[str]) -> int:
        """Publish each to its source queue (confirmed), then acknowledge it here."""
        return sum(
            self._scan(queue, _Scan(keys=frozenset(names), ack=True, republish=True))
            for queue, names in self._by_queue(keys).items()
        )

    def requeue_queue(
        self,
        queue: str,
        *,
        target: str | None = None,
        limit: int | None = None,
        default_consumer: str | None = None,
    ) -> RequeueResult:
        """Move the messages of ``queue`` (all present now, or the first ``limit``) to
        ``target``, else each one's source queue; a target must exist."""
        with self._connection() as connection:
            _queue_depth(connection, queue, missing_ok=False)
            if target is not None:  # must exist: fail before moving anything
                _queue_depth(connection, target, missing_ok=False)
        scan = _Scan(
            limit=limit,
            ack=True,
            republish=True,
            target=target,
            default_consumer=default_consumer,
        )
        moved = self._scan(queue, scan)
        log.info(
            "requeued dead letters",
            extra={
                "dead_letter_queue": queue,
                "moved": moved,
                "skipped": scan.skipped,
                "remaining": scan.remaining,
            },
        )
        return RequeueResult(moved=moved, skipped=scan.skipped, remaining=scan.remaining)

    # -- internals ------------------------------------------------------------------------

    def _by_queue(self, keys: Sequence[str]) -> dict[str, set[str]]:
        wanted: dict[str, set[str]] = {}
        for key in keys:
            queue, _ = parse_key(key, self.queues)
            wanted.setdefault(queue, set()).add(key.strip())
        return wanted

    def _scan(self, queue: str, scan: _Scan) -> int:
        """Take the messages present in ``queue`` one by one, unacknowledged; collect
        and (``scan.ack``) acknowledge those ``scan`` matches, after a confirmed copy to
        their source with ``scan.republish``; closing the channel gives the rest back.
        Returns how many were acknowledged."""
        acked = 0
        with self._connection() as connection:
            depth = _queue_depth(connection, queue)
            channel = connection.channel()
            if scan.republish:
                channel.confirm_delivery()
            try:
                for _ in range(depth):
                    if scan.limit is not None and len(scan.found) >= scan.limit:
                        break
                    method, properties, body = channel.basic_get(queue, auto_ack=False)
                    if method is None:
                        break
                    record = record_of(queue, properties, body or b"")
                    if not scan.matches(record):
                        continue
                    scan.found.append(record)
                    if not scan.ack:
                        continue
                    if scan.republish and not self._republish(
                        channel, scan, record, properties, body
                    ):
                        scan.skipped += 1  # held until the channel closes: back in the queue
                        continue
                    channel.basic_ack(method.delivery_tag)
                    acked += 1
                if scan.republish:  # the skipped ones are still held: the depth misses them
                    scan.remaining = _queue_depth(connection, queue) + scan.skipped
            except pika.exceptions.AMQPError as error:
                raise BrokerUnavailableError(
                    f"reading dead-letter queue {queue!r} failed: {describe(error)} "
                    f"({acked} acknowledged before; the rest went back to the queue)"
                ) from error
            finally:
                # Closing the channel returns every message taken and not acknowledged.
                # RabbitMQ 4 counts nacks, not such returns, toward a quorum queue's
                # delivery limit; 3.x counts both in x-delivery-count (seen on 3.10).
                if channel.is_open:
                    channel.close()
        return acked

    def _republish(
        self,
        channel: Any,
        scan: _Scan,
        record: DeadLetterRecord,
        properties: Any,
        body: bytes | None,
    ) -> bool:
        """Copy ``record`` to its target with a confirm (False: it names no target)."""
        target = scan.target or record.headers.get(SOURCE_QUEUE_HEADER)
        if not target:
            log.warning(
                "dead letter names no source queue; left in place",
                extra={"dead_letter": record.key},
            )
            return False
        if self.engine is not None:  # its full retries again: forget its attempts first
            if record.consumer is None:
                record = replace(record, consumer=scan.default_consumer)
            forget_attempts(self.engine, [record], self.prefix)
        try:
            channel.basic_publish(
                exchange="",
                routing_key=target,
                body=body or b"",
                properties=requeue_properties(properties),
                mandatory=True,
            )
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as error:
            raise ConfigurationError(
                f"cannot requeue {record.key} to {target!r}: {type(error).__name__} "
                "(no such queue, or it refused the message); it stays in the dead-letter queue"
            ) from error
        return True

    @contextlib.contextmanager
    def _connection(self) -> Iterator[Any]:
        connection = self._nodes.open()
        try:
            yield connection
        finally:
            with contextlib.suppress(pika.exceptions.AMQPError, OSError):
                if connection.is_open:
                    connection.close()


def parse_key(key: str, queues: Sequence[str]) -> tuple[str, str]:
    """``queue:message id`` as its parts (the queue must be one of ``queues``)."""
    text = key.strip()
    for queue in sorted(queues, key=len, reverse=True):
        if text.startswith(f"{queue}:") and len(text) > len(queue) + 1:
            return queue, text[len(queue) + 1 :]
    raise DeadLetterKeyError(
        f"{key!r} is not a key of the rabbitmq place (queue:message id, one of the queues "
        f"{', '.join(queues)})"
    )


def record_of(queue: str, properties: Any, body: bytes) -> DeadLetterRecord:
    """The :class:`DeadLetterRecord` of one message of a dead-letter queue.

    ``message`` is the original message as its consumer receives it after a requeue:
    from its source queue, without the ``x-mqdedup-*`` headers, same ``message_id``.
    """
    shown = text_headers(delivery_message(queue, False, "", queue, properties, body).headers)
    source = shown.get(SOURCE_QUEUE_HEADER) or queue
    message = delivery_message(source, False, "", source, requeue_properties(properties), body)
    message_id = shown.get(MESSAGE_ID_HEADER) or properties.message_id
    name = message_id or "sha256:" + hashlib.sha256(body).hexdigest()[:16]
    when = shown.get(DEAD_LETTERED_AT_HEADER)
    try:
        dead_lettered_at = datetime.fromisoformat(when) if when else None
    except ValueError:
        dead_lettered_at = None
    return broker_record(
        PLACE,
        f"{queue}:{name}",
        shown,
        source=source,
        message_id=message_id,
        body=body,
        dead_lettered_at=dead_lettered_at,
        message=message,
    )


def _queue_depth(connection: Any, queue: str, *, missing_ok: bool = True) -> int:
    """Ready messages in ``queue`` (0 when it is not declared yet, if ``missing_ok``)."""
    try:
        depth = queue_depth(connection, queue)
    except pika.exceptions.ChannelClosedByBroker as error:
        raise BrokerUnavailableError(f"cannot read queue {queue!r}: {describe(error)}") from error
    if depth is None and not missing_ok:
        raise ConfigurationError(f"queue {queue!r} does not exist")
    return depth or 0


def requeue_dead_letters(
    url: str | Sequence[str] | None = None,
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
    ``consumer_name`` and its message id) is deleted first, so it gets a full set of
    retries again.
    """
    if limit is not None and limit < 0:
        raise ConfigurationError("requeue limit must be zero or more")
    if not dead_letter_queue:
        raise ConfigurationError("requeue needs the dead-letter queue name")
    place = RabbitDeadLetterQueues(
        url,
        [dead_letter_queue],
        engine=database,
        prefix=table_prefix,
        connection_name=connection_name
        or f"mqdedup-requeue:{dead_letter_queue}:{socket.gethostname()}:{os.getpid()}",
    )
    return place.requeue_queue(
        dead_letter_queue, target=target_queue, limit=limit, default_consumer=consumer_name
    )

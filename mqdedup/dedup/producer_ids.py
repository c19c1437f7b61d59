"""Message-id strategies for producers that send no ``message-id``.

The default strategies (:func:`~mqdedup.dedup.ids.from_header`,
:func:`~mqdedup.dedup.ids.from_amqp_message_id`) need the producer to stamp an id (see
``docs/producers.md``). When an existing producer cannot be changed, one of these takes
the dedup key from what it does send; :func:`~mqdedup.dedup.ids.from_coordinates` and
:func:`~mqdedup.dedup.ids.from_content_hash` are the other two. Each says what it
protects against and what it does not: pick the one whose "not" you can live with, or
chain them with :func:`~mqdedup.dedup.ids.first_of`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from mqdedup.dedup.ids import (
    InvalidMessageIdError,
    MessageIdStrategy,
    _returns_checked_ids,
    check_message_id,
)
from mqdedup.errors import MissingMessageIdError
from mqdedup.message import Message

__all__ = ["from_body_key", "from_correlation_id"]

#: FastStream's Kafka header (its RabbitMQ publisher uses the AMQP property).
CORRELATION_HEADER = "correlation_id"


def from_correlation_id(header: str = CORRELATION_HEADER) -> MessageIdStrategy:
    """The id FastStream (and many RPC-style producers) already send: the AMQP
    ``correlation_id`` property, else the ``correlation_id`` Kafka header.

    Protects against: redeliveries (a crash between commit and ack, a rebalance), a
    replay of the topic or queue, the client library's own retries of a send (the record
    goes again with its headers and properties), and an application retry that passes
    the same ``correlation_id=`` again.

    Does not protect against: a producer that publishes the same business event twice
    with two calls, since each call draws a new random ``correlation_id`` (a retry after
    a timeout that does not pass the first call's id, a user's double click): those are
    two messages.
    And a producer that reuses one ``correlation_id`` for several distinct messages (a
    request id passed along a whole conversation) makes them one message: the later
    ones are skipped as duplicates.
    """
    where = f"AMQP correlation_id property or {header!r} header"

    def strategy(message: Message) -> str:
        value = message.properties.get("correlation_id") if message.properties else None
        if value is None:
            value = message.header(header)
        elif type(value) is not str:
            value = str(value)
        return check_message_id(value, where)

    strategy.__name__ = f"from_correlation_id({header!r})"
    return _returns_checked_ids(strategy)


_PATH_PART = re.compile(r"\.?([^.\[\]]+)|\[(\d+)\]")


def _parse_path(path: str) -> list[str | int]:
    """``order.id`` / ``$.order.id`` / ``items[0].sku`` as keys and indexes."""
    text = path[1:] if path.startswith("$") else path
    parts: list[str | int] = []
    position = 0
    while position < len(text):
        match = _PATH_PART.match(text, position)
        if match is None or match.end() == position:
            raise ValueError(f"cannot read the JSON path {path!r} at {text[position:]!r}")
        parts.append(match.group(1) if match.group(1) is not None else int(match.group(2)))
        position = match.end()
    if not parts:
        raise ValueError(f"the JSON path {path!r} names no field")
    return parts


def from_body_key(key: str | Callable[[Any], Any], *, prefix: str = "") -> MessageIdStrategy:
    """A business key from the JSON body: a path (``"order_id"``, ``"$.order.id"``,
    ``"lines[0].sku"``) or a function of the parsed body (``lambda b: b["order"]["id"]``).

    Protects against: everything that repeats the same business fact: redeliveries,
    replays, producer retries, and a second publish of the same order by another
    process or after a restart, as long as the key identifies the fact (an order id for
    an "order placed" event; an idempotency key the client sent).

    Does not protect against: nothing it should, if the key is right; but a key that is
    not unique per message merges distinct messages (an ``order_id`` on "order placed"
    *and* "order updated" events: the update is skipped). Put the event type into the
    key (``lambda b: f"{b['type']}:{b['order_id']}"``) or use ``prefix`` for a topic
    that carries one kind only. A body that is not JSON or lacks the key has no id
    (dead-lettered, or the next strategy of :func:`~mqdedup.dedup.ids.first_of`).
    Strings and integers are used as they are; other values are refused.
    """
    if callable(key):
        read: Callable[[Any], Any] = key
        where = f"body key from {getattr(key, '__name__', 'callable')}"
    else:
        parts = _parse_path(key)
        where = f"body key {key!r}"

        def read(body: Any) -> Any:
            value = body
            for part in parts:
                try:
                    value = value[part]
                except (KeyError, IndexError, TypeError):
                    return None
            return value

    def strategy(message: Message) -> str:
        try:
            body = json.loads(message.body)
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise MissingMessageIdError(f"no {where}: the body is not JSON") from None
        value = read(body)
        if value is None:
            raise MissingMessageIdError(f"no {where}")
        if type(value) is int:
            value = str(value)
        elif type(value) is not str:
            raise InvalidMessageIdError(
                f"the {where} is a {type(value).__name__}, not a string or an integer"
            )
        return check_message_id(prefix + value if value else value, where)

    strategy.__name__ = f"from_body_key({key if isinstance(key, str) else where!r})"
    return _returns_checked_ids(strategy)

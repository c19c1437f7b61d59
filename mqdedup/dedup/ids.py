"""Message-id strategies: how a consumer finds the dedup key of a message.

A strategy is any callable ``(Message) -> str``; it raises
:class:`~mqdedup.errors.MissingMessageIdError` when the message carries no id. What each
protects against:

* :func:`from_header` / :func:`from_amqp_message_id` (the defaults): ids chosen by the
  producer. They catch redeliveries *and* producer retries and replays of the same
  business message, as long as producers set the id.
* :func:`from_coordinates`: ``topic/partition/offset``. Needs nothing from producers and
  catches redeliveries and replays of the same record, but not a producer that sent the
  same message twice (the copies have different offsets).
* :func:`from_content_hash`: sha256 of the body. Catches identical resends, but also
  merges two distinct messages that happen to have the same bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from mqdedup.errors import MissingMessageIdError
from mqdedup.message import Message

MessageIdStrategy = Callable[[Message], str]

DEFAULT_HEADER = "message-id"
MAX_ID_LENGTH = 255


def _checked(message_id: str | None, where: str) -> str:
    if message_id is None or not message_id.strip():
        raise MissingMessageIdError(f"no {where}")
    if len(message_id) > MAX_ID_LENGTH:
        raise MissingMessageIdError(f"{where} longer than {MAX_ID_LENGTH} characters")
    return message_id


def from_header(name: str = DEFAULT_HEADER) -> MessageIdStrategy:
    """Take the id from a header (Kafka record header or AMQP application header)."""

    def strategy(message: Message) -> str:
        return _checked(message.header(name), f"{name!r} header")

    strategy.__name__ = f"from_header({name!r})"
    return strategy


def from_amqp_message_id(message: Message) -> str:
    """Take the id from the AMQP ``message_id`` basic property."""
    value = message.properties.get("message_id")
    return _checked(None if value is None else str(value), "AMQP message_id property")


def from_coordinates(message: Message) -> str:
    """Use the broker coordinates ``topic/partition/offset`` as the id (Kafka)."""
    if message.partition is None or message.offset is None:
        raise MissingMessageIdError("message has no topic/partition/offset coordinates")
    return message.coordinates


def from_content_hash(message: Message) -> str:
    """Use the sha256 of the body as the id."""
    return "sha256:" + hashlib.sha256(message.body).hexdigest()


def from_callable(function: Callable[[Message], str | None]) -> MessageIdStrategy:
    """Wrap a user function; ``None`` or an empty string means *no id*."""

    def strategy(message: Message) -> str:
        return _checked(function(message), f"id from {getattr(function, '__name__', 'callable')}")

    return strategy


def first_of(*strategies: MessageIdStrategy) -> MessageIdStrategy:
    """Try strategies in order; useful as a fallback, e.g. header, then content hash."""

    def strategy(message: Message) -> str:
        last: MissingMessageIdError | None = None
        for candidate in strategies:
            try:
                return candidate(message)
            except MissingMessageIdError as exc:
                last = exc
        raise last or MissingMessageIdError()

    return strategy

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

Every strategy returns a *valid* id or raises: a message id is a non-empty string of at
most :data:`MAX_ID_LENGTH` characters (the key column's length), without NUL bytes and
encodable as UTF-8 (no lone surrogates), so every database accepts it the same way
(:func:`check_message_id`). A message whose id breaks a rule is dead-lettered at once
with the rule it broke; :func:`first_of` moves on to its next strategy instead.

Users import these from :mod:`mqdedup.ids` (``from mqdedup import ids``), which also
names the id *generators* of :mod:`mqdedup.id_generators` (``ids.new_message_id()``,
``ids.Snowflake(node_id)``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from mqdedup.errors import MessageError, MissingMessageIdError
from mqdedup.message import Message

MessageIdStrategy = Callable[[Message], str]

DEFAULT_HEADER = "message-id"
MAX_ID_LENGTH = 255


#: Longer Kafka topics are replaced by their hash in :func:`from_coordinates` ids.
_HASHED_TOPIC_PREFIX = "topic-sha256:"


class InvalidMessageIdError(MissingMessageIdError):
    """A message id is there but cannot be a dedup key (NUL byte, too long, not Unicode).

    Its ``reason`` names the rule the id broke; the message is dead-lettered at once.
    """

    def __init__(self, reason: str) -> None:
        MessageError.__init__(self, reason)


#: Set on the strategies of this module: what they return passed :func:`check_message_id`.
_CHECKED = "_mqdedup_returns_checked_ids"


def _returns_checked_ids(strategy: MessageIdStrategy) -> MessageIdStrategy:
    setattr(strategy, _CHECKED, True)
    return strategy


def returns_checked_ids(strategy: object) -> bool:
    """True for a strategy of this module whose ids are checked already (every one,
    except :func:`first_of` over a strategy of the user's): the processor then does not
    check each id a second time."""
    return getattr(strategy, _CHECKED, False) is True


def check_message_id(message_id: object, where: str = "message id") -> str:
    """Return ``message_id`` if every database can store it as a key, else raise.

    ``where`` says where the id came from (``"'message-id' header"``); it ends up in
    the dead-letter reason. Raises :class:`~mqdedup.errors.MissingMessageIdError` for
    ``None`` or an empty / blank id and :class:`InvalidMessageIdError` for the others.
    """
    if (
        type(message_id) is str
        and message_id.isascii()  # no lone surrogate, so UTF-8 encodes it
        and 0 < len(message_id) <= MAX_ID_LENGTH
        and "\x00" not in message_id
        and not message_id.isspace()
    ):
        return message_id  # the common id, checked in one pass (hot path)
    if message_id is None:
        raise MissingMessageIdError(f"no {where}")
    if not isinstance(message_id, str):
        raise InvalidMessageIdError(
            f"message id is a {type(message_id).__name__}, not a string ({where})"
        )
    if not message_id.strip():
        raise MissingMessageIdError(f"empty {where}")
    if len(message_id) > MAX_ID_LENGTH:
        raise InvalidMessageIdError(
            f"message id is longer than {MAX_ID_LENGTH} characters ({len(message_id)}, {where})"
        )
    if "\x00" in message_id:
        raise InvalidMessageIdError(f"message id contains a NUL byte ({where})")
    try:
        message_id.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidMessageIdError(
            f"message id is not valid Unicode: a lone surrogate at position {error.start} ({where})"
        ) from None
    return message_id


def from_header(name: str = DEFAULT_HEADER) -> MessageIdStrategy:
    """Take the id from a header (Kafka record header or AMQP application header)."""

    where = f"{name!r} header"

    def strategy(message: Message) -> str:
        return check_message_id(message.header(name), where)

    strategy.__name__ = f"from_header({name!r})"
    return _returns_checked_ids(strategy)


@_returns_checked_ids
def from_amqp_message_id(message: Message) -> str:
    """Take the id from the AMQP ``message_id`` basic property."""
    value = message.properties.get("message_id")
    if value is not None and type(value) is not str:
        value = str(value)
    return check_message_id(value, "AMQP message_id property")


@_returns_checked_ids
def from_coordinates(message: Message) -> str:
    """Use the broker coordinates ``topic/partition/offset`` as the id (Kafka).

    Protects against: redeliveries of the same record (a crash between commit and
    offset commit, a rebalance) and replays of the topic. Needs nothing from producers.
    Does not protect against: a producer that sends the same message twice (a retry
    after a timeout, a second publish): the copies have different offsets. And on
    RabbitMQ there are no stable coordinates (a redelivery comes back with no offset).

    When that would be longer than :data:`MAX_ID_LENGTH` (Kafka allows 249-character
    topic names), the topic is replaced by ``topic-sha256:<sha256 of the topic>``:
    still deterministic and unique per topic, and no real Kafka topic contains ``:``.
    """
    if message.partition is None or message.offset is None:
        raise MissingMessageIdError("message has no topic/partition/offset coordinates")
    coordinates = message.coordinates
    if len(coordinates) > MAX_ID_LENGTH:
        digest = hashlib.sha256(message.source.encode("utf-8", "surrogatepass")).hexdigest()
        topic = _HASHED_TOPIC_PREFIX + digest
        coordinates = f"{topic}/{message.partition}/{message.offset}"
    return check_message_id(coordinates, "topic/partition/offset coordinates")


@_returns_checked_ids
def from_content_hash(message: Message) -> str:
    """Use the sha256 of the body as the id: identical bodies are one message.

    Protects against: every copy of the same bytes: redeliveries, replays, producer
    retries, a message published twice. Does not protect against: a resend whose body
    differs (a timestamp or a random id inside it); and it merges two distinct messages
    that happen to have identical bodies ("+1" twice is one increment): use it only
    when the body names the fact completely (an order id, a version).
    """
    return "sha256:" + hashlib.sha256(message.body).hexdigest()


def from_callable(function: Callable[[Message], str | None]) -> MessageIdStrategy:
    """Wrap a user function; ``None`` or an empty string means *no id*.

    What it returns is checked like any id (a string, short enough, no NUL byte).
    """

    where = f"id from {getattr(function, '__name__', 'callable')}"

    def strategy(message: Message) -> str:
        return check_message_id(function(message), where)

    return _returns_checked_ids(strategy)


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

    if all(returns_checked_ids(candidate) for candidate in strategies):
        return _returns_checked_ids(strategy)
    return strategy

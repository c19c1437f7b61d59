"""One dead letter, wherever it is kept, and the protocol every place implements.

A dead letter lives in one of three *places*: the database table of dead letters the
broker refused (``database``, :mod:`mqdedup.deadletters.database`), a Kafka dead-letter
topic (``kafka``, :mod:`mqdedup.kafka.dead_letter_topic`) or a RabbitMQ dead-letter
queue (``rabbitmq``, :mod:`mqdedup.rabbitmq.dead_letter_queue`). Each place reads its
dead letters as :class:`DeadLetterRecord` and acts on them by ``key``, a text stable
within the place (see :class:`DeadLetterPlace`). :func:`group` groups records by consumer
and error, as an operator looks at failures; :func:`body_preview` is a body cut to a
size a screen can show.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final, Literal, Protocol, runtime_checkable

from mqdedup.errors import ConfigurationError
from mqdedup.message import HeaderValue, Message

#: The places a dead letter can be kept.
Place = Literal["database", "kafka", "rabbitmq"]
PLACES: Final[tuple[Place, ...]] = ("database", "kafka", "rabbitmq")

#: The body bytes :func:`body_preview` shows by default (``show``, the console).
BODY_LIMIT: Final = 4096
#: The longest ``error`` (the group key) kept on a record.
ERROR_LIMIT: Final = 120


@dataclass(frozen=True)
class DeadLetterRecord:
    """One dead letter as found in its place: the original message and why it is there.

    ``key`` names it within its place: the row id (``database``),
    ``topic:partition:offset`` (``kafka``), ``queue:message id`` (``rabbitmq``; a
    message without an id is named by ``queue:sha256:<first 16 hex of its body's hash>``).
    ``error`` is the group key (:func:`error_key`): the error class and the reason's
    first line, short. ``headers`` are the message's headers as text (bytes decoded
    leniently), dead-letter headers included; ``message`` is the original message as a
    consumer receives it (what a replay hands to the handler).
    """

    place: Place
    key: str
    consumer: str | None
    #: The topic or queue the message was consumed from (``topic/partition/offset`` for Kafka).
    source: str
    message_id: str | None
    error: str
    reason: str
    attempts: int | None
    headers: Mapping[str, str]
    body: bytes
    dead_lettered_at: datetime | None
    message: Message = field(repr=False, compare=False)
    #: Why the broker refused the dead letter (``database`` place only).
    refusal: str | None = None

    @property
    def size(self) -> int:
        """The body's length in bytes."""
        return len(self.body)


@runtime_checkable
class DeadLetterPlace(Protocol):
    """Where dead letters are kept: read them, count them, act on them by key.

    Every action takes keys from :meth:`list` / :meth:`get` and returns how many dead
    letters it acted on (keys that name nothing, or something already gone, are not
    counted). None of them loses a message: a dead letter leaves its place only once
    it was deleted on purpose, replayed (its effects committed or found a duplicate), or
    requeued (the broker confirmed the copy in its source).
    """

    #: ``database``, ``kafka`` or ``rabbitmq``.
    place: Place

    def list(self, *, consumer: str | None = None, limit: int = 100) -> list[DeadLetterRecord]:
        """Up to ``limit`` dead letters, oldest first (only ``consumer``'s, when given)."""
        ...

    def get(self, key: str) -> DeadLetterRecord | None:
        """The dead letter ``key`` (None: no such dead letter, or it was handled)."""
        ...

    def depth(self) -> int:
        """How many dead letters the place holds now."""
        ...

    def delete(self, keys: Sequence[str]) -> int:
        """Drop these dead letters for good."""
        ...

    def requeue(self, keys: Sequence[str]) -> int:
        """Send these back to their source topic / queue (same message id, so the
        consumer's claims skip one already processed) and drop them here."""
        ...


class DeadLetterKeyError(ConfigurationError):
    """A key that cannot name a dead letter of this place (malformed, or another
    place's). Exit code 3 in the CLI, like every other bad value."""


def error_key(error_class: str | None, reason: str, error_message: str | None = None) -> str:
    """The group key of a dead letter: ``ErrorClass: first line of the error`` (short).

    ``builtins.`` is dropped from the class; without an error message the reason's first
    line stands in; without a class, the reason alone (``missing message id``).
    """
    text = _first_line(error_message if error_message else reason)
    if error_class:
        name = error_class.removeprefix("builtins.")
        if not text.startswith(name):
            text = f"{name}: {text}" if text else name
    text = text or "(no reason)"
    return text if len(text) <= ERROR_LIMIT else text[: ERROR_LIMIT - 1] + "…"


def _first_line(text: str) -> str:
    return " ".join((text.strip().splitlines() or [""])[0].split())


GroupKey = tuple[str | None, str]


def group(records: Iterable[DeadLetterRecord]) -> dict[GroupKey, list[DeadLetterRecord]]:
    """Records by ``(consumer, error)``; groups and their records in first-seen order."""
    groups: dict[GroupKey, list[DeadLetterRecord]] = {}
    for record in records:
        groups.setdefault((record.consumer, record.error), []).append(record)
    return groups


@dataclass(frozen=True)
class BodyPreview:
    """A body cut to a limit: ``text`` (undecodable bytes escaped), whether it was cut."""

    text: str
    size: int
    truncated: bool


def body_preview(body: bytes, limit: int = BODY_LIMIT) -> BodyPreview:
    """``body`` as text, at most ``limit`` bytes of it (never markup: callers escape it
    for HTML; the CLI prints it as it is)."""
    if limit < 0:
        raise ValueError("limit must be zero or more")
    cut = body[:limit]
    return BodyPreview(
        text=cut.decode("utf-8", errors="backslashreplace"),
        size=len(body),
        truncated=len(body) > limit,
    )


#: What :meth:`~mqdedup.consumers.transport.DeadLetter.headers` writes on a broker's
#: dead-letter copy; the ``kafka`` and ``rabbitmq`` places read it back.
CONSUMER_HEADER: Final = "x-mqdedup-consumer"
REASON_HEADER: Final = "x-mqdedup-reason"
ATTEMPTS_HEADER: Final = "x-mqdedup-attempts"
ERROR_CLASS_HEADER: Final = "x-mqdedup-error-class"
ERROR_MESSAGE_HEADER: Final = "x-mqdedup-error-message"


def broker_record(
    place: Place,
    key: str,
    headers: Mapping[str, str],
    *,
    source: str,
    message_id: str | None,
    body: bytes,
    dead_lettered_at: datetime | None,
    message: Message,
) -> DeadLetterRecord:
    """The record of a dead-letter copy on a broker, ``headers`` as text: its consumer,
    reason, error and attempts are those its ``x-mqdedup-*`` headers name."""
    reason = headers.get(REASON_HEADER, "")
    return DeadLetterRecord(
        place=place,
        key=key,
        consumer=headers.get(CONSUMER_HEADER),
        source=source,
        message_id=message_id,
        error=error_key(headers.get(ERROR_CLASS_HEADER), reason, headers.get(ERROR_MESSAGE_HEADER)),
        reason=reason,
        attempts=header_int(headers, ATTEMPTS_HEADER),
        headers=headers,
        body=body,
        dead_lettered_at=dead_lettered_at,
        message=message,
    )


def text_headers(headers: Mapping[str, HeaderValue]) -> dict[str, str]:
    """Headers as text for display: bytes decoded leniently, a header without a value ''."""
    shown: dict[str, str] = {}
    for name, value in headers.items():
        if value is None:
            shown[str(name)] = ""
        elif isinstance(value, bytes):
            shown[str(name)] = value.decode("utf-8", errors="backslashreplace")
        else:
            shown[str(name)] = str(value)
    return shown


def header_int(headers: Mapping[str, str], name: str) -> int | None:
    """A header holding a whole number (None when absent or not a number)."""
    value = headers.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None

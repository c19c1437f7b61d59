"""The immutable message a handler receives."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from mqdedup.errors import UndecodableMessageError

HeaderValue = bytes | str | None


@dataclass(frozen=True, slots=True)
class Message:
    """One delivered message, as the broker handed it over.

    ``id`` is the *message id* (the dedup key) chosen by the consumer's message-id
    strategy; it is ``None`` until the processor has taken it. ``headers`` are Kafka
    record headers or AMQP application headers; ``properties`` holds AMQP basic
    properties (``message_id``, ``correlation_id``, ``reply_to``, ...).
    """

    body: bytes
    id: str | None = None
    key: bytes | None = None
    headers: Mapping[str, HeaderValue] = field(default_factory=dict)
    properties: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""
    partition: int | None = None
    offset: int | None = None
    timestamp: datetime | None = None
    redelivered: bool = False
    attempt: int = 1

    @property
    def coordinates(self) -> str:
        """Where the broker keeps this message: ``topic/partition/offset`` or the queue."""
        if self.partition is not None and self.offset is not None:
            return f"{self.source}/{self.partition}/{self.offset}"
        return self.source

    def header(self, name: str) -> str | None:
        """A header as text (bytes are decoded as UTF-8), or ``None`` when absent."""
        value = self.headers.get(name)
        if value is None:
            return None
        if isinstance(value, bytes):
            try:
                return value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UndecodableMessageError(f"header {name!r} is not UTF-8: {exc}") from exc
        return str(value)

    def text(self, encoding: str = "utf-8") -> str:
        """The body as text; an undecodable body raises :class:`UndecodableMessageError`."""
        try:
            return self.body.decode(encoding)
        except UnicodeDecodeError as exc:
            raise UndecodableMessageError(f"undecodable body: not {encoding}: {exc}") from exc

    def json(self) -> Any:
        """The body parsed as JSON; malformed JSON raises :class:`UndecodableMessageError`."""
        try:
            return json.loads(self.body)
        except (UnicodeDecodeError, ValueError) as exc:
            raise UndecodableMessageError(f"undecodable body: invalid JSON: {exc}") from exc
        except RecursionError:
            # A producer's body, not a handler bug: dead-letter it at once, never retry.
            raise UndecodableMessageError(
                "undecodable body: JSON nested too deeply for Python's parser "
                f"(recursion limit {sys.getrecursionlimit()})"
            ) from None

    def identified(self, message_id: str) -> Message:
        """This message carrying ``message_id``: itself when its id is unset or already
        ``message_id``, else a copy (:meth:`with_id`).

        The processor calls it once per delivery before any handler sees the message:
        transports build a fresh message per delivery, so filling in the id that was
        ``None`` until then saves copying every message of a batch.
        """
        current = self.id
        if current is None:
            _set_id(self, message_id)  # the slot itself: no frozen-dataclass __setattr__
            return self
        return self if current == message_id else self.with_id(message_id)

    def with_id(self, message_id: str) -> Message:
        """A copy carrying ``message_id``."""
        # Slot by slot: ``dataclasses.replace`` re-runs ``__init__`` (~3x slower).
        copy = _new(Message)
        for name, slot in _SLOTS.items():
            slot.__set__(copy, message_id if name == "id" else slot.__get__(self, Message))
        return copy


#: The slot descriptors of :class:`Message`, by field name (their ``__set__`` writes a
#: slot without the frozen dataclass's ``__setattr__`` check).
_SLOTS: dict[str, Any] = {f.name: Message.__dict__[f.name] for f in fields(Message)}
_new = object.__new__
_set_body, _set_id, _set_key, _set_headers, _set_properties = (
    _SLOTS[name].__set__ for name in ("body", "id", "key", "headers", "properties")
)
_set_source, _set_partition, _set_offset, _set_timestamp, _set_redelivered, _set_attempt = (
    _SLOTS[name].__set__
    for name in ("source", "partition", "offset", "timestamp", "redelivered", "attempt")
)


def delivered_message(
    body: bytes,
    key: bytes | None,
    headers: Mapping[str, HeaderValue],
    properties: Mapping[str, Any],
    source: str,
    partition: int | None,
    offset: int | None,
    timestamp: datetime | None,
    redelivered: bool,
    attempt: int = 1,
) -> Message:
    """``Message(...)`` of a fresh delivery (no id yet), ~3x cheaper.

    For transports, which build one message per record on their poll thread: a frozen
    dataclass's ``__init__`` sets each of its fields through ``object.__setattr__``.
    """
    message = _new(Message)
    _set_body(message, body)
    _set_id(message, None)
    _set_key(message, key)
    _set_headers(message, headers)
    _set_properties(message, properties)
    _set_source(message, source)
    _set_partition(message, partition)
    _set_offset(message, offset)
    _set_timestamp(message, timestamp)
    _set_redelivered(message, redelivered)
    _set_attempt(message, attempt)
    return message

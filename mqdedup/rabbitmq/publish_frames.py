"""The relay's ``basic.publish`` frames, encoded in one pass and written per pump round.

pika builds a Method, a Header and a Body frame object for every message and hands
each frame to the socket on its own: three ``send()`` calls per message, each a small
TCP segment the broker reads on its own. The relay publishes thousands of messages per
batch, so :class:`PublishFrames` encodes them here, byte for byte as pika does (a
property test holds it to pika's own encoding), and writes a whole pump round to
pika's transport at once. What it cannot encode (a property pika would refuse or that
is missing here) goes through ``channel.basic_publish`` as before, after the frames
buffered ahead of it, so the broker sees the messages in order.

It uses two pika internals, the connection's ``_adapter_emit_data`` (buffer bytes for
the socket) and ``_body_max_length`` (set from the negotiated ``frame_max``); if pika
has neither, :meth:`PublishFrames.open` returns ``None`` and every message takes
pika's path.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any

from pika import data, exceptions

from mqdedup.rabbitmq.codec import OCTET, PROPERTY_FIELDS, SHORT_STRING, TABLE

_FRAME = struct.Struct(">BHI")
_HEADER_START = struct.Struct(">HxxQ")  # class 60 (basic), weight 0, body size
_FLAGS = struct.Struct(">H")
_TIMESTAMP = struct.Struct(">Q")
_FRAME_END = b"\xce"
_METHOD, _HEADER, _BODY = 1, 2, 3
_BASIC_PUBLISH = struct.pack(">HHH", 60, 40, 0)  # class, method, reserved ticket

_KNOWN = frozenset(name for _, name, _ in PROPERTY_FIELDS)


class CannotEncodeError(Exception):
    """The message is left to pika's ``basic_publish`` (which names what is wrong)."""


def _short(value: Any) -> bytes:
    encoded = value.encode() if isinstance(value, str) else value
    if not isinstance(encoded, bytes) or len(encoded) > 255:
        raise CannotEncodeError
    return bytes((len(encoded),)) + encoded


def encode_properties(properties: Mapping[str, Any]) -> bytes:
    """Property flags and list of a content header, as pika's ``BasicProperties.encode``."""
    if not _KNOWN.issuperset(properties):
        raise CannotEncodeError
    flags = 0
    pieces: list[bytes] = []
    for flag, name, kind in PROPERTY_FIELDS:
        value = properties.get(name)
        if value is None:
            continue
        flags |= flag
        if kind is SHORT_STRING:
            pieces.append(_short(value))
        elif kind is TABLE:
            if not isinstance(value, dict):
                raise CannotEncodeError
            data.encode_table(pieces, value)
        elif kind is OCTET:
            if type(value) is not int or not 0 <= value <= 255:
                raise CannotEncodeError
            pieces.append(bytes((value,)))
        else:
            if type(value) is not int or not 0 <= value < 1 << 64:
                raise CannotEncodeError
            pieces.append(_TIMESTAMP.pack(value))
    return _FLAGS.pack(flags) + b"".join(pieces)


def encode_publish(
    channel_number: int,
    body_max: int,
    exchange: str,
    routing_key: str,
    properties: Mapping[str, Any],
    body: bytes,
) -> bytes:
    """The method, header and body frames of one mandatory ``basic.publish``.

    Raises :class:`CannotEncodeError` for anything it does not encode as pika would.
    """
    if not isinstance(body, bytes):
        raise CannotEncodeError
    try:
        method = _BASIC_PUBLISH + _short(exchange) + _short(routing_key) + b"\x01"
        header = _HEADER_START.pack(60, len(body)) + encode_properties(properties)
    except (exceptions.AMQPError, ValueError, TypeError, struct.error) as error:
        raise CannotEncodeError from error
    pieces = [
        _FRAME.pack(_METHOD, channel_number, len(method)),
        method,
        _FRAME_END,
        _FRAME.pack(_HEADER, channel_number, len(header)),
        header,
        _FRAME_END,
    ]
    for start in range(0, len(body), body_max):
        chunk = body[start : start + body_max]
        pieces += (_FRAME.pack(_BODY, channel_number, len(chunk)), chunk, _FRAME_END)
    return b"".join(pieces)


class PublishFrames:
    """Buffers encoded ``basic.publish`` frames of one channel and writes them at once."""

    def __init__(self, connection: Any, channel_number: int, body_max: int) -> None:
        self._connection = connection
        self._emit: Callable[[bytes], None] = connection._adapter_emit_data
        self._channel_number = channel_number
        self._body_max = body_max
        self._pending: list[bytes] = []
        self._frames = 0

    @classmethod
    def open(cls, connection: Any, channel: Any) -> PublishFrames | None:
        """A writer for ``channel``, or ``None`` if this pika lacks what it needs."""
        body_max = getattr(connection, "_body_max_length", None)
        if not callable(getattr(connection, "_adapter_emit_data", None)):
            return None
        if type(body_max) is not int or body_max < 1:
            return None
        return cls(connection, channel.channel_number, body_max)

    def add(
        self, exchange: str, routing_key: str, properties: Mapping[str, Any], body: bytes
    ) -> None:
        """Encode one message (raises :class:`CannotEncodeError`; nothing is buffered then)."""
        frames = encode_publish(
            self._channel_number, self._body_max, exchange, routing_key, properties, body
        )
        self._pending.append(frames)
        self._frames += 2 + -(-len(body) // self._body_max)

    def flush(self) -> None:
        """Hand what is buffered to pika's transport as one write."""
        if not self._pending:
            return
        chunk = b"".join(self._pending)
        self._pending.clear()
        connection = self._connection
        connection.bytes_sent += len(chunk)
        connection.frames_sent += self._frames
        self._frames = 0
        self._emit(chunk)

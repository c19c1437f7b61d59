"""A fast path for the consuming channel's deliveries through pika's frame decoding.

pika decodes each incoming frame into objects, routes it through its connection,
channel, content assembler and callback layers, and ``BlockingChannel`` queues every
delivery as an event before dispatching it: about 25 µs of Python per message on the
I/O thread, the largest share of a RabbitMQ consumer's CPU. This module takes over
pika's ``_on_data_available`` (where the socket's bytes come in) and decodes the one
thing that makes up nearly all the traffic itself: a ``basic.deliver`` on the
consuming channel for our consumer tag, with its header and body frames. Every other
frame (heartbeats, replies, channel and connection methods, anything unexpected or
malformed) is handed to pika's own code, one frame at a time, in arrival order.

Deliveries reach ``on_delivery`` synchronously, in frame order, whichever path decoded
them: the consumer's pika callback is replaced by a direct call, because a delivery
queued as a ``BlockingChannel`` event would reach the buffer after later deliveries
decoded here, and a ``multiple=True`` ack could then cover it before it was processed.

Received bytes count for pika's heartbeat checker as they arrive (a large delivery that
is still incomplete keeps the connection alive). :func:`install` returns None when this
pika lacks an internal it relies on; pika's own path then does everything, as before.
"""

from __future__ import annotations

import functools
import logging
import struct
import uuid
from collections.abc import Callable
from typing import Any

from pika import exceptions, spec
from pika.frame import decode_frame

from mqdedup.rabbitmq.codec import OCTET, PROPERTY_FIELDS, SHORT_STRING

log = logging.getLogger("mqdedup.rabbitmq.transport")

#: (delivery_tag, redelivered, exchange, routing_key, properties, body)
OnDelivery = Callable[[int, bool, Any, Any, Any, bytes], None]

_FRAME_HEAD = struct.Struct(">BHL")  # type, channel, payload size
#: A content header frame's head: type, channel, size, class id, weight, body size.
_HEADER_HEAD = struct.Struct(">BHLHHQ")
#: After basic.deliver's consumer tag: delivery tag, redelivered bit, exchange length.
_TAG_BITS_LENGTH = struct.Struct(">QBB")
_FRAME_END = 0xCE
_METHOD, _HEADER, _BODY = 1, 2, 3
_BASIC_DELIVER = struct.pack(">HH", 60, 60)  # class basic, method deliver
_BASIC_CLASS = 60
_NAMES_KEPT = 1000
_TIMESTAMP = struct.Struct(">Q")
#: Flag bits that leave the properties to pika: headers (a table), a second flag word.
_PIKA_DECODES = spec.BasicProperties.FLAG_HEADERS | 1
#: Every attribute pika's decoder sets, unset, in pika's order (headers third).
_NO_PROPERTIES: dict[str, Any] = dict.fromkeys(name for _, name, _ in PROPERTY_FIELDS)
_NOT_OURS = -1
_new_properties = object.__new__
_BasicProperties = spec.BasicProperties


def new_consumer_tag(channel_number: int) -> str:
    """A consumer tag chosen by the client (the fast path must know it before consuming)."""
    return f"mqdedup.{channel_number}.{uuid.uuid4().hex}"


class DeliveryFastPath:
    """Decodes our deliveries from the socket's bytes; pika decodes everything else."""

    def __init__(
        self, impl: Any, channel_number: int, consumer_tag: str, on_delivery: OnDelivery
    ) -> None:
        self._impl = impl
        self._channel = channel_number
        self._tag = consumer_tag.encode("utf-8")
        self._on_delivery = on_delivery
        #: False after our basic.cancel: pika's own path then rejects late deliveries.
        self.active = True
        #: Why the broker closed the consuming channel (its ``channel.close``), if it did.
        self.closed_by_broker: exceptions.ChannelClosedByBroker | None = None
        # Bytes held back until an incomplete frame of ours is complete (no quadratic
        # re-concatenation while a large body arrives in many small reads).
        self._held: list[bytes] = []
        self._held_size = 0
        self._needed = 0
        self._names: dict[bytes, Any] = {}
        self._layouts: dict[int, tuple[tuple[str, str], ...]] = {}

    # pika calls this with each chunk read from the socket (I/O thread).
    def data_available(self, data_in: bytes) -> None:
        impl = self._impl
        impl.bytes_received += len(data_in)  # liveness for the heartbeat checker
        if self._held_size + len(data_in) < self._needed:
            self._held.append(data_in)
            self._held_size += len(data_in)
            return
        if self._held:
            self._held.append(data_in)
            data_in = b"".join(self._held)
            self._held.clear()
            self._held_size = 0
        self._needed = 0
        buffer = impl._frame_buffer + data_in if impl._frame_buffer else data_in
        position = 0
        end = len(buffer)
        while position < end:
            result = self._delivery(buffer, position, end) if self.active else _NOT_OURS
            if result > 0:
                position = result
                continue
            if result == 0:
                break  # ours, incomplete: wait for more bytes
            consumed, frame_value = decode_frame(buffer[position:] if position else buffer)
            if frame_value is None:
                break
            position += consumed
            if getattr(frame_value, "channel_number", None) == self._channel:
                self._note_close(frame_value)
            # pika's state, then its own handling of this one frame (which may close the
            # connection and reset the buffer: read it back afterwards).
            impl._frame_buffer = buffer[position:]
            impl._process_frame(frame_value)
            buffer = impl._frame_buffer
            position = 0
            end = len(buffer)
        rest = buffer[position:] if position else buffer
        if self._needed:
            # Hold the incomplete frame here instead of in pika's buffer.
            impl._frame_buffer = b""
            self._held.append(rest)
            self._held_size = len(rest)
            self._needed -= position
        else:
            self._needed = 0
            impl._frame_buffer = rest

    def _note_close(self, frame_value: Any) -> None:
        """Keep the reason of a ``channel.close`` the broker sends on our channel (pika
        keeps it in no public place): the consumer's log line names it."""
        method = getattr(frame_value, "method", None)
        if isinstance(method, spec.Channel.Close):
            self.closed_by_broker = exceptions.ChannelClosedByBroker(
                method.reply_code, method.reply_text
            )

    def _need(self, size: int) -> int:
        self._needed = size
        return 0

    def _delivery(self, data: bytes, at: int, end: int) -> int:
        """Decode a complete delivery of ours at ``at``; the offset after it.

        0: ours (or maybe ours) but incomplete; -1: not a delivery of ours (pika's).
        """
        if end - at < 7:
            return self._need(at + 7)
        kind, channel, size = _FRAME_HEAD.unpack_from(data, at)
        if kind != _METHOD or channel != self._channel or size < 4:
            return _NOT_OURS  # e.g. a heartbeat: pika's
        method_end = at + 8 + size
        if method_end > end:
            return self._need(method_end)
        if data[method_end - 1] != _FRAME_END or data[at + 7 : at + 11] != _BASIC_DELIVER:
            return _NOT_OURS
        tag_end = at + 12 + data[at + 11]
        if data[at + 12 : tag_end] != self._tag:
            return _NOT_OURS
        delivery_tag, bits, length = _TAG_BITS_LENGTH.unpack_from(data, tag_end)
        offset = tag_end + 10
        exchange = self._name(data[offset : offset + length])
        offset += length
        routing_key = self._name(data[offset + 1 : offset + 1 + data[offset]])
        # The content header frame.
        header = method_end
        if end - header < 19:
            return self._need(header + 19)
        kind, channel, size, class_id, _weight, remaining = _HEADER_HEAD.unpack_from(data, header)
        if kind != _HEADER or channel != self._channel or size < 14 or class_id != _BASIC_CLASS:
            return _NOT_OURS
        header_end = header + 8 + size
        if header_end > end:
            return self._need(header_end)
        if data[header_end - 1] != _FRAME_END:
            return _NOT_OURS
        # The body frames (none for an empty body).
        position: int = header_end
        parts: list[bytes] = []
        while remaining > 0:
            # Incomplete: wait at least for the whole rest of the body (a large body is
            # joined and parsed a few times, not once per read).
            if end - position < 7:
                return self._need(position + 8 + remaining)
            kind, channel, size = _FRAME_HEAD.unpack_from(data, position)
            if kind != _BODY or channel != self._channel or size > remaining:
                return _NOT_OURS
            frame_end = position + 8 + size
            if frame_end > end:
                return self._need(max(frame_end, position + 8 + remaining))
            if data[frame_end - 1] != _FRAME_END:
                return _NOT_OURS
            parts.append(data[position + 7 : frame_end - 1])
            remaining -= size
            position = frame_end
        properties = self._properties(data, header + 19)
        if len(parts) == 1:
            body = parts[0]
            self._impl.frames_received += 3
        else:
            body = b"".join(parts)
            self._impl.frames_received += 2 + len(parts)
        self._on_delivery(delivery_tag, bool(bits & 1), exchange, routing_key, properties, body)
        return position

    def _properties(self, data: bytes, at: int) -> Any:
        """The basic properties at ``at``, as pika's ``BasicProperties``.

        Decoded here when they hold no headers (a table) and one flag word, which
        covers most messages; otherwise by pika. Every property is set (None when
        absent), as pika's decoder sets them.
        """
        properties = _new_properties(_BasicProperties)
        flags = data[at] << 8 | data[at + 1]
        if flags & _PIKA_DECODES:
            properties.decode(data, at)
            return properties
        layout = self._layouts.get(flags)
        if layout is None:
            layout = self._layouts[flags] = tuple(
                (name, kind) for flag, name, kind in PROPERTY_FIELDS if flags & flag
            )
        values = dict(_NO_PROPERTIES)
        at += 2
        for name, kind in layout:
            if kind is SHORT_STRING:
                end = at + 1 + data[at]
                raw = data[at + 1 : end]
                try:
                    values[name] = raw.decode("utf-8")
                except UnicodeDecodeError:
                    values[name] = raw  # as pika decodes short strings
                at = end
            elif kind is OCTET:
                values[name] = data[at]
                at += 1
            else:
                values[name] = _TIMESTAMP.unpack_from(data, at)[0]
                at += 8
        properties.__dict__ = values
        return properties

    def _name(self, raw: bytes) -> Any:
        """An exchange or routing key: text, or bytes when not UTF-8 (as pika decodes
        short strings). Most deliveries repeat a few names: they are decoded once."""
        names = self._names
        name = names.get(raw)
        if name is None:
            if len(names) >= _NAMES_KEPT:
                names.clear()
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                name = raw
            names[raw] = name
        return name


def from_pika(
    on_delivery: OnDelivery, _channel: Any, method: Any, properties: Any, body: bytes
) -> None:
    """Hand a delivery pika decoded (a consumer callback's arguments) to ``on_delivery``."""
    on_delivery(
        method.delivery_tag,
        bool(method.redelivered),
        method.exchange,
        method.routing_key,
        properties,
        body,
    )


def install(
    connection: Any, channel: Any, consumer_tag: str, on_delivery: OnDelivery
) -> DeliveryFastPath | None:
    """Route ``channel``'s deliveries for ``consumer_tag`` straight to ``on_delivery``.

    Call it after ``basic_consume(..., consumer_tag=consumer_tag)``, once the deliveries
    pika has queued as ``BlockingChannel`` events are dispatched (``process_data_events``),
    so none of them is overtaken. ``connection`` / ``channel`` are pika's blocking ones.
    Returns None (pika's own path stays, unchanged) when this pika lacks an internal it
    relies on.
    """
    impl = getattr(connection, "_impl", None)
    channel_impl = getattr(channel, "_impl", None)
    consumers = getattr(channel_impl, "_consumers", None)
    if (
        impl is None
        or not isinstance(getattr(impl, "_frame_buffer", None), bytes)
        or not callable(getattr(impl, "_process_frame", None))
        or not isinstance(getattr(impl, "bytes_received", None), int)
        or not isinstance(getattr(impl, "frames_received", None), int)
        or not isinstance(consumers, dict)
        or consumer_tag not in consumers
    ):
        log.info("pika's internals differ from what the delivery fast path expects; not used")
        return None

    # pika's own path, synchronous too (frame order)
    consumers[consumer_tag] = functools.partial(from_pika, on_delivery)
    fast = DeliveryFastPath(impl, channel.channel_number, consumer_tag, on_delivery)
    impl._on_data_available = fast.data_available
    return fast

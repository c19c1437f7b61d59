"""What a producer stamps on a message so a mqdedup consumer can deduplicate it.

A message id (the dedup key: time-ordered, a UUIDv7 from
:func:`mqdedup.id_generators.new_message_id` unless the caller has a better one, such as
an order's id plus the event type), the body's content type, and the current trace
context (W3C ``traceparent`` / ``tracestate`` of the active OpenTelemetry span, when
there is one). The broker helpers put them where the consumers look:
:func:`mqdedup.kafka.producing.send_message` (Kafka record headers) and
:func:`mqdedup.rabbitmq.producing.publish_message` (AMQP properties and headers).

Reusing one message id for every send of the same message is what makes a producer's
retry a duplicate: generate it once, before the first attempt.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from mqdedup import tracing
from mqdedup.id_generators import new_message_id

__all__ = ["JSON", "MESSAGE_ID_HEADER", "Stamp", "encode_body", "stamp"]

#: The header the default strategy reads (``mqdedup.ids.from_header()``).
MESSAGE_ID_HEADER = "message-id"
JSON = "application/json"
_TEXT = "text/plain; charset=utf-8"
_BYTES = "application/octet-stream"


@dataclasses.dataclass(frozen=True)
class Stamp:
    """A message ready to send: its id, encoded body, content type and headers
    (``message-id``, ``content-type``, the trace context, then the caller's own)."""

    message_id: str
    body: bytes
    content_type: str
    headers: dict[str, str]


def encode_body(body: Any) -> tuple[bytes, str]:
    """``body`` as bytes with its content type.

    ``bytes`` are sent as they are (``application/octet-stream``), ``str`` as UTF-8
    text; anything else as JSON: a pydantic model (``model_dump_json``), a msgspec
    Struct, a dataclass, or a JSON value (``dict``, ``list``, numbers; NaN refused).
    """
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body), _BYTES
    if isinstance(body, str):
        return body.encode("utf-8"), _TEXT
    dump = getattr(body, "model_dump_json", None)
    if callable(dump):  # pydantic v2
        return str(dump()).encode("utf-8"), JSON
    if type(body).__module__ != "builtins" and hasattr(type(body), "__struct_fields__"):
        import msgspec  # a Struct: msgspec is installed

        return msgspec.json.encode(body), JSON
    if dataclasses.is_dataclass(body) and not isinstance(body, type):
        body = dataclasses.asdict(body)
    try:
        text = json.dumps(body, allow_nan=False, separators=(",", ":"), default=_jsonable)
    except (TypeError, ValueError) as error:
        raise TypeError(f"cannot send the body as JSON: {error}") from None
    return text.encode("utf-8"), JSON


def _jsonable(value: Any) -> Any:
    """datetimes, UUIDs and Decimals as their ISO / text forms."""
    isoformat = getattr(value, "isoformat", None)
    if callable(isoformat):
        return isoformat()
    if type(value).__name__ in ("UUID", "Decimal"):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def stamp(
    body: Any,
    *,
    message_id: str | None = None,
    content_type: str | None = None,
    headers: Mapping[str, str | bytes] | None = None,
) -> Stamp:
    """Encode ``body`` and stamp it: ``message_id`` (default: a new UUIDv7), the content
    type (default: from the body's kind), and the current trace context.

    ``headers`` are the caller's own; they may not set ``message-id`` (pass
    ``message_id``) or ``content-type`` (pass ``content_type``).
    """
    encoded, kind = encode_body(body)
    chosen = new_message_id() if message_id is None else message_id
    if not isinstance(chosen, str) or not chosen.strip():
        raise ValueError(f"message_id must be a non-empty string, not {chosen!r}")
    stamped: dict[str, str] = {MESSAGE_ID_HEADER: chosen, "content-type": content_type or kind}
    stamped.update(tracing.trace_headers())
    for name, value in (headers or {}).items():
        if name.lower() in (MESSAGE_ID_HEADER, "content-type"):
            raise ValueError(
                f"header {name!r} is stamped by mqdedup: pass message_id= or content_type="
            )
        stamped[name] = value.decode("utf-8") if isinstance(value, bytes) else str(value)
    return Stamp(chosen, encoded, content_type or kind, stamped)

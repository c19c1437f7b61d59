"""OpenTelemetry spans for consuming, outbox writes and relay publishes (optional).

With ``opentelemetry-api`` installed (``pip install 'mqdedup[otel]'``) and a tracer
provider configured by the application, mqdedup adds:

* a ``process <source>`` span (kind CONSUMER) per new message, continuing the trace of
  the ``traceparent`` / ``tracestate`` headers the producer sent, with the
  ``mqdedup transaction`` span (the handler's work in the database transaction) as its
  child;
* the current span's context on each outbox row written in that handler
  (:func:`trace_headers`), so the trace carries on through the relay;
* a ``publish <destination>`` span (kind PRODUCER) per relayed row, continuing the row's
  trace; the published message carries that span's context to the next consumer.

Without the package, or without a configured provider, every function here is a cheap
no-op and nothing else changes: headers are passed on as they came.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from mqdedup.message import HeaderValue, Message

try:
    from opentelemetry import propagate, trace
    from opentelemetry.propagators.textmap import Getter
    from opentelemetry.trace import SpanKind
except ImportError:  # pragma: no cover - exercised by installs without the extra
    trace = None  # type: ignore[assignment]

    class Getter:  # type: ignore[no-redef]
        """Stand-in base class when OpenTelemetry is not installed."""

        def __class_getitem__(cls, item: Any) -> Any:
            return cls


TRACE_HEADERS = ("traceparent", "tracestate")
_INSTRUMENTATION = "mqdedup"


def enabled() -> bool:
    """True when OpenTelemetry is installed and the application set a tracer provider.

    Checked per use and cheap (an isinstance test): without a provider, spans would be
    no-ops anyway, and skipping them keeps the per-message path as fast as without the
    package.
    """
    return trace is not None and not isinstance(
        trace.get_tracer_provider(), trace.ProxyTracerProvider
    )


class _HeaderGetter(Getter[Mapping[str, HeaderValue]]):
    """Reads W3C trace headers from a message's headers (bytes or text values)."""

    def get(self, carrier: Mapping[str, HeaderValue], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            return None
        if isinstance(value, bytes):
            try:
                return [value.decode("utf-8")]
            except UnicodeDecodeError:
                return None  # an undecodable trace header is dropped, never fatal
        return [str(value)]

    def keys(self, carrier: Mapping[str, HeaderValue]) -> list[str]:
        return list(carrier.keys())


_GETTER = _HeaderGetter()


@contextlib.contextmanager
def consume_span(consumer: str, message: Message) -> Iterator[None]:
    """The consumer span of one message, and its transaction child, around its handler."""
    if not enabled():
        yield
        return
    parent = propagate.extract(message.headers, getter=_GETTER)
    tracer = trace.get_tracer(_INSTRUMENTATION)
    attributes = _attributes(consumer, message)
    with (
        tracer.start_as_current_span(
            f"process {message.source}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attributes,
        ),
        tracer.start_as_current_span("mqdedup transaction", kind=SpanKind.INTERNAL),
    ):
        yield


@contextlib.contextmanager
def batch_span(consumer: str, messages: Sequence[Message]) -> Iterator[None]:
    """``handle_batch``: a consumer span per message, ended together, and one transaction
    span (child of the first message's span, linked to the others) as the current span."""
    if not messages or not enabled():
        yield
        return
    tracer = trace.get_tracer(_INSTRUMENTATION)
    spans = [
        tracer.start_span(
            f"process {message.source}",
            context=propagate.extract(message.headers, getter=_GETTER),
            kind=SpanKind.CONSUMER,
            attributes=_attributes(consumer, message),
        )
        for message in messages
    ]
    links = [trace.Link(span.get_span_context()) for span in spans[1:]]
    try:
        with tracer.start_as_current_span(
            "mqdedup transaction",
            context=trace.set_span_in_context(spans[0]),
            kind=SpanKind.INTERNAL,
            links=links,
            attributes={"mqdedup.batch_size": len(messages)},
        ):
            yield
    finally:
        for span in spans:
            span.end()


def _attributes(consumer: str, message: Message) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "messaging.operation.type": "process",
        "messaging.destination.name": message.source,
        "messaging.consumer.group.name": consumer,
    }
    if message.id is not None:
        attributes["messaging.message.id"] = message.id
    if message.partition is not None:
        attributes["messaging.destination.partition.id"] = str(message.partition)
    if message.offset is not None:
        attributes["messaging.kafka.offset"] = message.offset
    return attributes


def trace_headers() -> dict[str, str]:
    """The current span's ``traceparent`` / ``tracestate`` (empty without an active span)."""
    if not enabled() or not trace.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return {name: carrier[name] for name in TRACE_HEADERS if name in carrier}


class PublishTrace:
    """The producer span of one relayed row (a no-op without OpenTelemetry).

    ``headers`` are the trace headers to send: the new span's context, so the next
    consumer continues from the publish; without OpenTelemetry the row's own ones.
    """

    def __init__(self, destination: str, message_id: str, headers: Mapping[str, Any]) -> None:
        carried = {name: str(headers[name]) for name in TRACE_HEADERS if headers.get(name)}
        self.headers = carried
        self._span: Any = None
        if not enabled():
            return
        tracer = trace.get_tracer(_INSTRUMENTATION)
        self._span = tracer.start_span(
            f"publish {destination}",
            context=propagate.extract(carried),
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.operation.type": "publish",
                "messaging.destination.name": destination,
                "messaging.message.id": message_id,
            },
        )
        if self._span.get_span_context().is_valid:
            carrier: dict[str, str] = {}
            propagate.inject(carrier, context=trace.set_span_in_context(self._span))
            self.headers = {name: carrier[name] for name in TRACE_HEADERS if name in carrier}

    def end(self, error: str | None = None) -> None:
        """End the span once the broker confirmed (or refused: ``error``)."""
        if self._span is None:
            return
        if error is not None:
            self._span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        self._span.end()

"""Calling the consumer's handlers and checking what they return."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from mqdedup import tracing
from mqdedup.bridge import resolve, wait_for
from mqdedup.consumers.bodies import InvalidBodiesError, InvalidBodyError, body_decoder
from mqdedup.consumers.context import (
    AsyncBatchContext,
    AsyncContext,
    BatchContext,
    Context,
    InvalidResultError,
)

if TYPE_CHECKING:
    from mqdedup.consumers.metrics import Metrics
    from mqdedup.consumers.spec import ConsumerSpec
    from mqdedup.consumers.transport import Delivery

#: Built once: ``json.dumps(..., allow_nan=False)`` would build an encoder per call.
_STRICT_JSON = json.JSONEncoder(allow_nan=False)


class Handlers:
    """Runs ``handle`` / ``handle_batch`` of one consumer: span, timing, result checks.

    ``session`` is the transaction's session, or None for a consumer whose claim store
    has no transaction (its ``ctx.session`` then says why it is missing).
    """

    def __init__(self, consumer: ConsumerSpec, metrics: Metrics) -> None:
        self.consumer = consumer
        self.metrics = metrics
        self.name = consumer.consumer_name
        # Async consumers: AsyncSession contexts; their coroutines are awaited (bridge).
        self._context, self._batch_context = _context_types(consumer)
        self._awaits = consumer.asynchronous
        # Typed bodies (mqdedup.consumers.bodies): None for handlers taking the Message.
        self._decode = (
            body_decoder(type(consumer), "handle") if consumer.has_single_handler else None
        )
        self._decode_batch = (
            body_decoder(type(consumer), "handle_batch") if consumer.has_batch_handler else None
        )

    def call(self, session: Session | None, delivery: Delivery[Any]) -> Any:
        """One message's handler; its (checked) result."""
        if not self.consumer.has_single_handler:
            return self.call_batch(session, [delivery]).get(str(delivery.message.id))
        message = delivery.message
        decode = self._decode
        # A typed body is decoded and validated before the handler runs (InvalidBodyError:
        # dead-lettered at once); ctx.message stays the raw message.
        body = message if decode is None else decode(message)
        context = self._context(session, self.consumer, message)
        started = time.monotonic()
        if tracing.enabled():
            with tracing.consume_span(self.name, message):
                result = self.consumer.handle(body, context)
                if self._awaits:
                    result = wait_for(result)
        else:  # no span to open: spare the per-message context manager
            result = self.consumer.handle(body, context)
            if self._awaits:
                result = wait_for(result)
        self.metrics.histograms.observe("handler_seconds", time.monotonic() - started)
        ensure_json(result)
        return result

    def call_batch(self, session: Session | None, new: list[Delivery[Any]]) -> dict[str, Any]:
        """The batch handler over ``new``; its checked results by message id."""
        messages = [d.message for d in new]
        bodies: list[Any] = messages
        if self._decode_batch is not None:
            bodies = self._decoded(new)
        started = time.monotonic()
        with tracing.batch_span(self.name, messages):
            results = self.consumer.handle_batch(
                bodies, self._batch_context(session, self.consumer, messages)
            )
            if self._awaits:
                results = resolve(results)
        self.metrics.histograms.observe("handler_seconds", time.monotonic() - started)
        if not results:
            return {}
        # Only results of this batch's messages: another key would overwrite the stored
        # result of an earlier message (or reach the database as an invalid id).
        ids = {d.message.id for d in new}
        clean = {key: value for key, value in results.items() if value is not None and key in ids}
        for value in clean.values():
            ensure_json(value)
        return clean

    def _decoded(self, new: list[Delivery[Any]]) -> list[Any]:
        """The batch's typed bodies; raises when one or more do not validate: the batch
        runs again without them (:class:`InvalidBodiesError`), each dead-lettered alone."""
        decode = self._decode_batch
        assert decode is not None
        bodies: list[Any] = []
        failed: list[tuple[Delivery[Any], InvalidBodyError]] = []
        for delivery in new:
            try:
                bodies.append(decode(delivery.message))
            except InvalidBodyError as error:
                failed.append((delivery, error))
        if failed:
            if len(new) == 1:
                raise failed[0][1]  # the message's own failure (MessageError)
            raise InvalidBodiesError(failed)
        return bodies


def _context_types(consumer: ConsumerSpec) -> tuple[type[Any], type[Any]]:
    """The (per-message, batch) context classes the handlers of ``consumer`` get."""
    if consumer.asynchronous:
        return AsyncContext, AsyncBatchContext
    return Context, BatchContext


def ensure_json(result: Any) -> None:
    """A handler's result must be strict JSON every database stores the same way.

    Refused, as :class:`InvalidResultError` (the message is dead-lettered at once):
    types JSON does not have, NaN and infinities (PostgreSQL's JSONB rejects them),
    strings with a NUL character or a lone surrogate (JSONB and UTF-8 reject them),
    nesting too deep to serialise.
    """
    if result is None:
        return
    try:
        # ASCII output (the C encoder's fastest path): NUL shows as \u0000 and a
        # surrogate as \udXXX, so two substring searches clear the common result.
        text = _STRICT_JSON.encode(result)
    except TypeError as error:
        raise InvalidResultError(f"handler result is not JSON-serialisable: {error}") from None
    except ValueError as error:  # NaN, Infinity, a circular reference
        raise InvalidResultError(f"handler result is not strict JSON: {error}") from None
    except RecursionError:
        raise InvalidResultError("handler result is nested too deeply to store") from None
    if "\\u0000" in text:
        try:
            has_nul = _has_nul(result)
        except RecursionError:
            has_nul = True  # too deep to look through: refuse rather than guess
        if has_nul:
            raise InvalidResultError("handler result contains a NUL character (\\u0000)")
    if "\\ud" in text or "\\uD" in text:  # surrogates: a valid pair or a lone one
        try:
            json.dumps(result, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidResultError(
                "handler result is not valid Unicode: a string with a lone surrogate"
            ) from None


def _has_nul(value: Any) -> bool:
    """True when a string anywhere in ``value`` (keys included) contains a NUL character."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(key) or _has_nul(item) for key, item in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(item) for item in value)
    return False

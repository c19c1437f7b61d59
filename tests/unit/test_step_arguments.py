"""Bad arguments to ``ctx.step`` / ``ctx.idempotency_key``: a clear error naming the
argument, raised before any external call (SQLite and the in-memory broker; the check
runs before the database is asked anything)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from sqlalchemy import Engine

from mqdedup import Consumer, Context, InMemoryBroker, Message, RetryPolicy, run_until_idle
from mqdedup.consumers.context import BatchContext
from mqdedup.dedup.steps import InvalidStepError, check_step_name

QUEUE = "arguments"

#: A bad call, and what the error must say. ``called`` counts the external calls.
BAD_STEPS: dict[str, tuple[Callable[[Context, Callable[[str], Any]], Any], type, str]] = {
    "name not a str": (
        lambda ctx, call: ctx.step(42, call),  # type: ignore[arg-type]
        TypeError,
        "name of a step or idempotency key must be a str, got int",
    ),
    "arguments swapped": (
        lambda ctx, call: ctx.step(call, "charge"),  # type: ignore[arg-type]
        TypeError,
        "must be a str, got builtin_function_or_method",
    ),
    "fn not callable": (
        lambda ctx, _call: ctx.step("charge", {"amount": 1}),  # type: ignore[arg-type]
        TypeError,
        "fn must be a callable taking the idempotency key, got dict",
    ),
    "empty name": (lambda ctx, call: ctx.step("  ", call), InvalidStepError, "1 to 200"),
    "long name": (lambda ctx, call: ctx.step("n" * 201, call), InvalidStepError, "1 to 200"),
    "NUL in the name": (lambda ctx, call: ctx.step("a\x00b", call), InvalidStepError, "NUL"),
    "lone surrogate in the name": (
        lambda ctx, call: ctx.step("a\ud800", call),
        InvalidStepError,
        "lone surrogate",
    ),
    "message not a Message": (
        lambda ctx, call: ctx.step("charge", call, "m-1"),  # type: ignore[arg-type]
        TypeError,
        "message must be a mqdedup Message, got str",
    ),
    "key name not a str": (
        lambda ctx, _call: ctx.idempotency_key(b"charge"),  # type: ignore[arg-type]
        TypeError,
        "must be a str, got bytes",
    ),
    "key message not a Message": (
        lambda ctx, _call: ctx.idempotency_key("charge", {"id": 1}),  # type: ignore[arg-type]
        TypeError,
        "ctx.idempotency_key(name, ..., message=m): message must be a mqdedup Message",
    ),
}


def test_bad_arguments_get_a_clear_error_before_any_call(sqlite_engine: Engine) -> None:
    raised: dict[str, BaseException] = {}
    calls: list[str] = []

    class Careless(Consumer):
        name = "careless"
        batch_size = 20
        retry_policy = RetryPolicy(max_attempts=1)

        def handle(self, message: Message, ctx: Context) -> Any:
            bad, _error, _text = BAD_STEPS[message.text()]
            try:
                bad(ctx, calls.append)
            except Exception as error:
                raised[message.text()] = error
                raise

    broker = InMemoryBroker()
    for n, case in enumerate(BAD_STEPS):
        broker.publish(QUEUE, case, message_id=f"m-{n}")
    run_until_idle(Careless(), broker.transport(QUEUE), sqlite_engine)

    assert calls == []  # nothing was called
    assert len(broker.dead_letters[QUEUE]) == len(BAD_STEPS)  # each failed, alone
    for case, (_bad, error_type, text) in BAD_STEPS.items():
        assert type(raised[case]) is error_type, (case, raised[case])
        assert re.search(re.escape(text), str(raised[case])), (case, raised[case])


def test_handle_batch_checks_the_message_it_names(sqlite_engine: Engine) -> None:
    raised: list[BaseException] = []

    class Batch(Consumer):
        name = "batch-careless"
        batch_size = 4
        retry_policy = RetryPolicy(max_attempts=1)

        def handle_batch(self, messages: Sequence[Message], ctx: BatchContext) -> Any:
            with pytest.raises(TypeError, match="message must be a mqdedup Message") as info:
                ctx.step("call", lambda key: key, messages[0].id)  # type: ignore[arg-type]
            raised.append(info.value)
            return None

    broker = InMemoryBroker()
    for n in range(3):
        broker.publish(QUEUE, b"{}", message_id=f"b-{n}")
    run_until_idle(Batch(), broker.transport(QUEUE), sqlite_engine)
    assert len(raised) == 1


def test_a_valid_name_is_returned_as_it_is() -> None:
    for name in ("charge", "n" * 200, "caf\u00e9 \u2603", " padded "):
        assert check_step_name(name) == name

"""``ctx.idempotency_key`` and ``ctx.step`` on SQLite and the in-memory broker.

The key is deterministic per consumer, message id and name; ``handle_batch`` names the
message. On SQLite the step's record is written in the message's transaction (one
writer per file): a handler failing after its step calls again, with the same key, on
its retry. Bad names and results that are not JSON get clear errors.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.exc import DataError

from mqdedup import Consumer, Context, InMemoryBroker, Message, RetryPolicy, run_until_idle
from mqdedup.consumers.context import BatchContext
from mqdedup.db.schema import schema
from mqdedup.dedup.steps import (
    InvalidStepError,
    StepResultError,
    StepStore,
    idempotency_key,
    loaded,
)

QUEUE = "calls"


def test_the_key_is_deterministic_per_consumer_message_and_name() -> None:
    key = idempotency_key("payments", "m-1", "charge")
    assert key == idempotency_key("payments", "m-1", "charge")
    assert len(key) == 32 and int(key, 16) >= 0  # 32 hex characters
    others = {
        idempotency_key("refunds", "m-1", "charge"),
        idempotency_key("payments", "m-2", "charge"),
        idempotency_key("payments", "m-1", "email"),
        idempotency_key("payments\x1fm", "1", "charge"),  # no ambiguity of the separator
    }
    assert key not in others and len(others) == 4
    with pytest.raises(InvalidStepError, match="1 to 200 characters"):
        idempotency_key("payments", "m-1", "")


def publish(broker: InMemoryBroker, count: int) -> list[str]:
    ids = [f"m-{n}" for n in range(count)]
    for message_id in ids:
        broker.publish(QUEUE, json.dumps({}), message_id=message_id)
    return ids


def steps(engine: Engine) -> dict[str, tuple[str, Any]]:
    table = schema().steps
    with engine.connect() as connection:
        rows = connection.execute(select(table.c.message_id, table.c.state, table.c.result))
        return {row.message_id: (row.state, loaded(row.result)) for row in rows}


def test_on_sqlite_the_record_shares_the_message_transaction(sqlite_engine: Engine) -> None:
    calls: Counter[tuple[str, str]] = Counter()
    failed: set[str] = set()

    class Calling(Consumer):
        name = "calling"
        batch_size = 5
        retry_policy = RetryPolicy(max_attempts=3, initial_backoff=0.0, max_backoff=0.0)

        def handle(self, message: Message, ctx: Context) -> Any:
            def call(key: str) -> dict[str, Any]:
                calls[(str(message.id), key)] += 1
                return {"ok": (1, 2)}

            result = ctx.step("call", call)
            assert result == {"ok": [1, 2]}  # the JSON round trip, also the first time
            assert ctx.step("call", call) == result  # done: not called again
            if message.id == "m-2" and message.id not in failed:
                failed.add(message.id)
                raise RuntimeError("fails after its step")
            return result

    broker = InMemoryBroker()
    ids = publish(broker, 6)
    run_until_idle(Calling(), broker.transport(QUEUE), sqlite_engine)

    # The record rolled back with the message's transaction (and, when the batch reran,
    # with its batch-mates'): called again, always with the message's one key.
    assert {message_id for message_id, _ in calls} == set(ids)
    assert all(key == idempotency_key("calling", i, "call") for i, key in calls)
    assert calls[("m-2", idempotency_key("calling", "m-2", "call"))] >= 2
    assert steps(sqlite_engine) == {i: ("done", {"ok": [1, 2]}) for i in ids}


def test_handle_batch_names_the_message_of_each_step(sqlite_engine: Engine) -> None:
    seen: list[str] = []

    class Batch(Consumer):
        name = "batch-calling"
        batch_size = 4

        def handle_batch(self, messages: Sequence[Message], ctx: BatchContext) -> Any:
            if len(messages) > 1:
                with pytest.raises(TypeError, match="needs the message"):
                    ctx.idempotency_key("call")
            for message in messages:
                key = ctx.idempotency_key("call", message)
                assert key == idempotency_key("batch-calling", str(message.id), "call")
                seen.append(ctx.step("call", lambda k: k, message))
            return None

    broker = InMemoryBroker()
    ids = publish(broker, 8)
    run_until_idle(Batch(), broker.transport(QUEUE), sqlite_engine)
    assert seen == [idempotency_key("batch-calling", i, "call") for i in ids]


def test_a_result_that_is_not_json_fails_the_message_with_a_clear_reason(
    sqlite_engine: Engine,
) -> None:
    class Bad(Consumer):
        name = "bad-result"
        retry_policy = RetryPolicy(max_attempts=1)

        def handle(self, message: Message, ctx: Context) -> Any:
            return ctx.step("call", lambda _key: {1, 2})

    broker = InMemoryBroker()
    publish(broker, 1)
    run_until_idle(Bad(), broker.transport(QUEUE), sqlite_engine)
    [letter] = broker.dead_letters[QUEUE]
    assert (letter.record.error_class or "").endswith(StepResultError.__name__)
    assert "cannot be recorded as JSON" in letter.record.reason


def test_a_record_the_database_refuses_fails_the_message_after_one_call(
    sqlite_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal that is not an outage (a value too long, a packet too large) belongs to
    the result: the message is dead-lettered at once, its retries do not call again."""
    calls: list[str] = []

    def refuse(*_args: Any) -> None:
        raise DataError("UPDATE steps", {}, ValueError("value too long for the column"))

    monkeypatch.setattr(StepStore, "record", refuse)

    class Refused(Consumer):
        name = "refused-record"
        retry_policy = RetryPolicy(max_attempts=3, initial_backoff=0.0, max_backoff=0.0)

        def handle(self, message: Message, ctx: Context) -> Any:
            return ctx.step("call", lambda key: calls.append(key) or "x")

    broker = InMemoryBroker()
    publish(broker, 1)
    run_until_idle(Refused(), broker.transport(QUEUE), sqlite_engine)
    assert len(calls) == 1
    [letter] = broker.dead_letters[QUEUE]
    assert "the database refused to record" in letter.record.reason
    assert "value too long for the column" in letter.record.reason
    assert letter.record.attempts == 1

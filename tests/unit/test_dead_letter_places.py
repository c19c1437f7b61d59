"""The dead-letter places library: keys, grouping, body limits, and the database place
(on SQLite here; the same place against PostgreSQL is in tests/integration/tools)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from mqdedup import RetryPolicy
from mqdedup.deadletters import (
    DatabaseDeadLetters,
    DeadLetterKeyError,
    DeadLetterPlace,
    DeadLetterRecord,
    body_preview,
    error_key,
    group,
    replay,
)
from mqdedup.dedup.dead_letters import DeadLetterCause, DeadLetterTable
from mqdedup.errors import ConfigurationError
from mqdedup.message import Message
from tests.support import OrderConsumer, orders

FAST = RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.01)


def _record(consumer: str | None, error: str, key: str = "1") -> DeadLetterRecord:
    message = Message(b"{}", id=key)
    return DeadLetterRecord(
        place="kafka",
        key=key,
        consumer=consumer,
        source="orders",
        message_id=key,
        error=error,
        reason=error,
        attempts=3,
        headers={},
        body=b"{}",
        dead_lettered_at=datetime.now(UTC),
        message=message,
    )


def test_error_key_is_the_class_and_the_errors_first_line_cut_short() -> None:
    assert error_key("ValueError", "bad amount\ntraceback...") == "ValueError: bad amount"
    assert error_key("ValueError", "ValueError: bad amount") == "ValueError: bad amount"
    assert error_key(None, "  missing   message id ") == "missing message id"
    assert (
        error_key("builtins.ValueError", "handler failed after 3 attempts: x", "cannot handle m1")
        == "ValueError: cannot handle m1"
    )
    assert error_key("app.BadOrder", "r", "app.BadOrder: no amount") == "app.BadOrder: no amount"
    assert error_key(None, "") == "(no reason)"
    long = error_key("E", "x" * 500)
    assert len(long) == 120 and long.endswith("…")


def test_group_by_consumer_and_error_keeps_first_seen_order() -> None:
    records = [
        _record("orders", "ValueError: a", "1"),
        _record("billing", "ValueError: a", "2"),
        _record("orders", "KeyError: b", "3"),
        _record("orders", "ValueError: a", "4"),
    ]
    groups = group(records)
    assert list(groups) == [
        ("orders", "ValueError: a"),
        ("billing", "ValueError: a"),
        ("orders", "KeyError: b"),
    ]
    assert [r.key for r in groups[("orders", "ValueError: a")]] == ["1", "4"]


def test_body_preview_cuts_at_the_limit_and_says_so() -> None:
    whole = body_preview(b"<script>alert(1)</script>", limit=100)
    assert whole.text == "<script>alert(1)</script>" and not whole.truncated
    cut = body_preview(b"a" * 5000, limit=10)
    assert cut.text == "a" * 10 and cut.truncated and cut.size == 5000
    binary = body_preview(b"\xff\x00ok", limit=100)
    assert binary.text == "\\xff\x00ok" and not binary.truncated
    with pytest.raises(ValueError):
        body_preview(b"", limit=-1)


class Orders(OrderConsumer):
    retry_policy = FAST


def _park(engine: Engine, consumer: str, number: int, reason: str = "ValueError: no") -> None:
    body = json.dumps({"order": number, "amount": number}).encode()
    message = Message(body, id=f"m{number}", headers={"message-id": f"m{number}"}, source="orders")
    cause = DeadLetterCause(
        reason=reason, attempts=2, refusal="MessageSizeTooLargeError", error_class="ValueError"
    )
    with Session(engine) as session, session.begin():
        DeadLetterTable().park(session, consumer, message, cause)


def _order_rows(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(orders)).scalar_one())


def test_the_database_place_lists_gets_counts_and_deletes_by_row_id(sqlite_engine: Engine) -> None:
    for number in range(3):
        _park(sqlite_engine, "orders", number)
    _park(sqlite_engine, "billing", 9, reason="KeyError: x")
    place = DatabaseDeadLetters(sqlite_engine)
    assert isinstance(place, DeadLetterPlace)

    listed = place.list()
    assert [r.message_id for r in listed] == ["m0", "m1", "m2", "m9"]
    assert place.depth() == 4
    assert [r.key for r in place.list(consumer="billing")] == [listed[3].key]
    first = place.get(listed[0].key)
    assert first is not None and first.place == "database" and first.consumer == "orders"
    assert first.error == "ValueError: no" and first.attempts == 2
    assert first.refusal == "MessageSizeTooLargeError" and first.body == listed[0].body
    assert place.get("999999") is None
    with pytest.raises(DeadLetterKeyError):
        place.get("orders.DLT:0:1")

    assert place.delete([listed[0].key, listed[0].key, "424242"]) == 1
    assert place.depth() == 3 and place.get(listed[0].key) is None
    with pytest.raises(ConfigurationError, match="replay"):
        place.requeue([listed[1].key])


def test_replaying_database_dead_letters_twice_runs_effects_once(sqlite_engine: Engine) -> None:
    for number in range(3):
        _park(sqlite_engine, "orders", number)
    place = DatabaseDeadLetters(sqlite_engine)
    chosen = place.list()[:2]

    outcome = replay(chosen, Orders(), sqlite_engine, place)
    assert (outcome.processed, outcome.duplicates, outcome.removed) == (2, 0, 2)
    assert _order_rows(sqlite_engine) == 2 and place.depth() == 1

    again = replay(chosen, Orders(), sqlite_engine, place)  # rows gone: nothing to hand out
    assert again.handed_out == 0 and _order_rows(sqlite_engine) == 2

    _park(sqlite_engine, "orders", 0)  # kept again (as if the drop after the commit was lost)
    third = replay(place.list(), Orders(), sqlite_engine, place)
    assert (third.processed, third.duplicates, third.removed) == (1, 1, 2)  # m2 new, m0 dup
    assert _order_rows(sqlite_engine) == 3 and place.depth() == 0


def test_a_replay_refuses_another_consumers_dead_letters(sqlite_engine: Engine) -> None:
    _park(sqlite_engine, "billing", 1)
    place = DatabaseDeadLetters(sqlite_engine)
    with pytest.raises(ConfigurationError, match="billing"):
        replay(place.list(), Orders(), sqlite_engine, place)
    assert place.depth() == 1


def test_show_escapes_control_characters_and_cuts_the_body() -> None:
    from mqdedup.cli.dead_letters import record_data, record_text

    message = Message(b"\x1b[31mred\x1b[0m\nline two" + b"x" * 100, id="m1")
    record = DeadLetterRecord(
        place="rabbitmq",
        key="orders.dlq:m1",
        consumer="orders",
        source="orders",
        message_id="m1",
        error="ValueError: \x1b[2J",
        reason="r",
        attempts=None,
        headers={"trace": "\x07bell"},
        body=message.body,
        dead_lettered_at=None,
        message=message,
    )
    text = record_text(record, body_limit=21)
    assert "\x1b" not in text and "\x07" not in text
    assert "\\x1b[31mred\\x1b[0m\nline two" in text and "trace: \\x07bell" in text
    assert "truncated: 21 of 121 bytes shown" in text
    data = record_data(record, body_limit=5)
    assert data["body"] == "\x1b[31m" and data["body_truncated"] and data["size"] == 121


class ListPlace:
    """A place in memory: what RecordTransport drops, and when."""

    place = "kafka"

    def __init__(self, records: list[DeadLetterRecord]) -> None:
        self.records = {r.key: r for r in records}
        self.delete_calls: list[list[str]] = []

    def list(self, *, consumer: str | None = None, limit: int = 100) -> list[DeadLetterRecord]:
        return list(self.records.values())[:limit]

    def get(self, key: str) -> DeadLetterRecord | None:
        return self.records.get(key)

    def depth(self) -> int:
        return len(self.records)

    def delete(self, keys: Sequence[str]) -> int:
        self.delete_calls.append(list(keys))
        return sum(self.records.pop(key, None) is not None for key in keys)

    def requeue(self, keys: Sequence[str]) -> int:
        raise NotImplementedError


def test_a_broker_replay_drops_what_committed_once_and_keeps_what_failed_again(
    sqlite_engine: Engine,
) -> None:
    def record(number: int) -> DeadLetterRecord:
        body = json.dumps({"order": number, "amount": number}).encode()
        message = Message(body, headers={"message-id": f"m{number}"}, source="orders")
        return DeadLetterRecord(
            place="kafka", key=f"orders.DLT:0:{number}", consumer="orders", source="orders",
            message_id=f"m{number}", error="E", reason="r", attempts=1, headers={},
            body=body, dead_lettered_at=None, message=message,
        )  # fmt: skip

    class StillBroken(Orders):
        fail_ids = frozenset({"m2"})

    place = ListPlace([record(n) for n in range(5)])
    assert isinstance(place, DeadLetterPlace)
    outcome = replay(place.list(), StillBroken(), sqlite_engine, place)
    assert (outcome.processed, outcome.dead_lettered_again, outcome.removed) == (4, 1, 4)
    assert list(place.records) == ["orders.DLT:0:2"] and _order_rows(sqlite_engine) == 4
    assert len(place.delete_calls) == 1  # one drop for the run, after the commits

    again = replay([record(n) for n in range(5)], Orders(), sqlite_engine, place)
    assert (again.processed, again.duplicates, again.removed) == (1, 4, 1)
    assert _order_rows(sqlite_engine) == 5 and place.depth() == 0


def test_handled_marks_read_once_per_mark_and_count_only_new_keys(sqlite_engine: Engine) -> None:
    from sqlalchemy import event

    from mqdedup.deadletters.handled import HandledMarks

    marks = HandledMarks(sqlite_engine, "kafka")
    statements: list[str] = []
    event.listen(sqlite_engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    keys = [f"orders.DLT:0:{n}" for n in range(300)]
    assert marks.mark(keys, "deleted") == 300
    selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert len(selects) <= 2, len(selects)  # one read of what is marked (not one per key)
    assert marks.mark([*keys[:10], "orders.DLT:1:0"], "replayed") == 1
    assert marks.marked(["orders.DLT:0:5", "orders.DLT:0:999"]) == {"orders.DLT:0:5"}
    assert len(marks.marked_with_prefix("orders.DLT:")) == 301
    assert marks.marked_with_prefix("other.DLT:") == set()
    with pytest.raises(ValueError):
        marks.mark(["x:0:0"], "eaten")

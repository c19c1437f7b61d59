"""The "handler failed" line stays readable for an error carrying a huge statement;
the dead letter keeps its own reason."""

from __future__ import annotations

import logging

import pytest
from sqlalchemy import Engine, text

from mqdedup import Consumer, Context, InMemoryBroker, Message, RetryPolicy
from mqdedup.consumers.report import LOGGED_ERROR_CHARS, logged_error
from mqdedup.consumers.worker import Worker


def test_a_short_error_is_logged_whole() -> None:
    assert logged_error(ValueError("bad amount")) == "ValueError: bad amount"


def test_a_huge_error_is_cut_and_says_how_much_was_left_out() -> None:
    line = logged_error(ValueError("x" * 300_000))
    assert len(line) < LOGGED_ERROR_CHARS + 60
    assert line.startswith("ValueError: xxx")
    assert line.endswith(
        f"… ({len('ValueError: ') + 300_000 - LOGGED_ERROR_CHARS:,} more characters)"
    )


def test_a_failing_statement_of_300_kb_logs_a_short_line(
    sqlite_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    with sqlite_engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE negatives (n INTEGER CHECK (n < 0))")
    values = ", ".join(f"({n})" for n in range(50_000))  # ~340 KB of SQL, refused

    class Huge(Consumer):
        name = "huge"
        poll_timeout = 0.01
        retry_policy = RetryPolicy(max_attempts=1)

        def handle(self, message: Message, ctx: Context) -> None:
            ctx.session.execute(text(f"INSERT INTO negatives (n) VALUES {values}"))

    broker = InMemoryBroker()
    broker.publish("q", "{}", message_id="m-1")
    with caplog.at_level(logging.INFO, logger="mqdedup"):
        Worker(Huge(), broker.transport("q"), sqlite_engine).run(until_idle=True)
    failed = [r for r in caplog.records if r.getMessage() == "handler failed"]
    assert failed
    for record in failed:
        error: str = record.__dict__["error"]
        assert error.startswith("IntegrityError: (sqlite3.IntegrityError) CHECK constraint failed")
        assert len(error) < LOGGED_ERROR_CHARS + 60
    letters = broker.dead_letters["q"]
    assert [str(d.message.id) for d in letters] == ["m-1"]
    assert "CHECK constraint failed" in letters[0].record.reason

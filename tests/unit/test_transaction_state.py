"""The transaction check of issue 39 on SQLite: a handler that ends the transaction fails
alone; the guard refuses the Connection's ``commit()`` / ``rollback()``; the watch reads
the driver's state without a statement of its own.

The real-database versions (PostgreSQL's aborted transactions, MariaDB's implicit
commits) are in ``tests/integration/test_broken_transactions.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, event, insert, select, text
from sqlalchemy.orm import Session

from mqdedup import Consumer, InMemoryBroker, Message, RetryPolicy, run_until_idle
from mqdedup.consumers.context import (
    Context,
    HandlerEndedTransactionError,
    guard_session,
    unguard_session,
)
from mqdedup.db.schema import DEFAULT_PREFIX, schema
from mqdedup.db.transaction_state import (
    Breakage,
    HandlerBrokeTransactionError,
    TransactionWatch,
    watch_engine,
)
from tests.support import order_counts, orders

RETRY = RetryPolicy(max_attempts=2, initial_backoff=0.0, max_backoff=0.0, jitter=0.0)

Culprit = Callable[[Context], None]


def _commit_statement(ctx: Context) -> None:
    ctx.session.execute(text("COMMIT"))


def _rollback_statement(ctx: Context) -> None:
    ctx.session.execute(text("ROLLBACK"))


def _root_commit(ctx: Context) -> None:
    transaction = ctx.session.connection().get_transaction()
    assert transaction is not None
    transaction.commit()


def _session_transaction_rollback(ctx: Context) -> None:
    transaction = ctx.session.get_transaction()
    assert transaction is not None
    transaction.rollback()


def _connection_commit(ctx: Context) -> None:
    ctx.session.connection().commit()


ROUTES: dict[str, Culprit] = {
    "text(COMMIT)": _commit_statement,
    "text(ROLLBACK)": _rollback_statement,
    "connection.get_transaction().commit": _root_commit,
    "session.get_transaction().rollback": _session_transaction_rollback,
    "connection.commit (refused)": _connection_commit,
}


class Orders(Consumer):
    """One order row per message; ``culprit`` first does ``route``, then writes."""

    name = "broken"
    batch_size = 10
    poll_timeout = 0.01
    retry_policy = RETRY

    def __init__(self, route: Culprit) -> None:
        self.route = route
        self.calls: dict[str, int] = {}

    def handle(self, message: Message, ctx: Context) -> Any:
        message_id = str(message.id)
        self.calls[message_id] = self.calls.get(message_id, 0) + 1
        if message_id == "culprit":
            self.route(ctx)
        ctx.session.execute(insert(orders), {"message_id": message_id, "amount": 1})
        return {"ok": message_id}


def claims(engine: Engine) -> dict[str, Any]:
    processed = schema(DEFAULT_PREFIX).processed
    with engine.connect() as connection:
        rows = connection.execute(
            select(processed.c.message_id, processed.c.result).where(
                processed.c.consumer_name == "broken"
            )
        ).all()
    return {row[0]: row[1] for row in rows}


@pytest.mark.parametrize("isolation", ["auto", "rerun", "savepoint", "transaction"])
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_handler_that_ends_the_transaction_fails_alone(
    sqlite_engine: Engine, route: str, isolation: str
) -> None:
    consumer = type("Configured", (Orders,), {"failure_isolation": isolation})(ROUTES[route])
    broker = InMemoryBroker()
    for message_id in ("good-a", "culprit", "good-b"):
        broker.publish("q", json.dumps({}), message_id=message_id)
    metrics = run_until_idle(consumer, broker.transport("q"), sqlite_engine)
    assert order_counts(sqlite_engine) == {"good-a": 1, "good-b": 1}
    assert claims(sqlite_engine) == {"good-a": {"ok": "good-a"}, "good-b": {"ok": "good-b"}}
    [letter] = broker.dead_letters["q"]
    assert letter.message.id == "culprit"
    assert letter.record.attempts == RETRY.max_attempts
    assert "must not" in letter.record.reason
    assert consumer.calls["culprit"] == RETRY.max_attempts
    assert metrics.processed == 2
    assert broker.pending("q") == 0


def test_the_guard_refuses_the_connection_route_and_leaves_it_usable(
    sqlite_engine: Engine,
) -> None:
    with Session(sqlite_engine) as session, session.begin():
        connection = session.connection()
        guard_session(session, connection)
        for method in ("commit", "rollback", "close", "detach"):
            with pytest.raises(HandlerEndedTransactionError, match="must not end"):
                getattr(connection, method)()
        unguard_session(session)
        assert connection.in_transaction()
        assert "commit" not in connection.__dict__


def test_the_watch_runs_no_statement_and_stops_a_commit_statement(
    sqlite_engine: Engine,
) -> None:
    watch_engine(sqlite_engine)
    watch_engine(sqlite_engine)  # once per engine
    statements: list[str] = []
    event.listen(sqlite_engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    with Session(sqlite_engine) as session:
        session.begin()
        session.execute(insert(orders), {"message_id": "x", "amount": 1})
        watch = TransactionWatch(session, begun=True)
        before = len(statements)
        assert watch.check() is None
        assert len(statements) == before  # the check reads state, it runs nothing
        session.execute(text("COMMIT"))
        with pytest.raises(HandlerBrokeTransactionError, match="`COMMIT` ended"):
            # refused: it would run outside the transaction (here: autocommit)
            session.execute(insert(orders), {"message_id": "y", "amount": 1})
        broken = watch.check()
        assert broken is not None and broken.kind is Breakage.ENDED
        assert "`COMMIT`" in broken.reason and "must not" in broken.reason
        watch.close()
        session.rollback()

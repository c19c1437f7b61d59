"""The claim as a library call (``mqdedup.claim`` / ``mqdedup.async_claim``, issue 43).

Against the real PostgreSQL: a claim commits and rolls back with the caller's writes,
a duplicate carries the stored result, a concurrent copy waits for the first
transaction and then sees it, the async form does the same, bad input gets one clear
error. The crash tests of the examples built on it are in
``tests/acceptance/test_example_claim_crash.py``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from sqlalchemy import func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from mqdedup import (
    ClaimError,
    ConfigurationError,
    InvalidMessageIdError,
    InvalidResultError,
    MissingMessageIdError,
    async_claim,
    claim,
)
from mqdedup.db.async_engine import create_async_engine
from tests.services import TestDatabase, wait_for
from tests.support import orders_table

pytestmark = pytest.mark.integration


def _rows(db: TestDatabase) -> dict[str, int]:
    table = orders_table(db.prefix)
    with db.engine.connect() as connection:
        found = connection.execute(
            select(table.c.message_id, func.count()).group_by(table.c.message_id)
        ).all()
    return {row[0]: int(row[1]) for row in found}


def _handle(db: TestDatabase, session: Session, message_id: str) -> Any:
    """What an existing consumer does per message: claim, write, store, (commit)."""
    claimed = claim(session, message_id, consumer="billing", prefix=db.prefix)
    if claimed.is_duplicate:
        return claimed.stored_result
    session.execute(insert(orders_table(db.prefix)).values(message_id=message_id))
    claimed.store_result({"invoice": message_id.upper()})
    return "new"


def test_a_claim_commits_with_the_writes_and_a_duplicate_gets_the_stored_result(
    db: TestDatabase,
) -> None:
    with Session(db.engine) as session, session.begin():
        assert _handle(db, session, "m-1") == "new"
    with Session(db.engine) as session, session.begin():
        assert _handle(db, session, "m-1") == {"invoice": "M-1"}
    # Another consumer name is another scope: the same id is new there.
    with Session(db.engine) as session, session.begin():
        assert claim(session, "m-1", consumer="shipping", prefix=db.prefix).is_new
    assert _rows(db) == {"m-1": 1}


def test_a_rolled_back_claim_is_gone_with_the_writes(db: TestDatabase) -> None:
    with Session(db.engine) as session:
        assert _handle(db, session, "m-2") == "new"
        session.rollback()  # the handler failed, or the process died before the commit
    assert _rows(db) == {}
    with Session(db.engine) as session, session.begin():
        assert _handle(db, session, "m-2") == "new"  # the redelivery runs again
    assert _rows(db) == {"m-2": 1}


def test_a_connection_works_like_a_session_and_stays_the_callers(db: TestDatabase) -> None:
    table = orders_table(db.prefix)
    with db.engine.connect() as connection:
        claimed = claim(connection, "m-3", consumer="billing", prefix=db.prefix)
        assert claimed.is_new and connection.in_transaction()
        connection.execute(insert(table).values(message_id="m-3"))
        claimed.store_result(7)
        connection.rollback()
        assert claim(connection, "m-3", consumer="billing", prefix=db.prefix).is_new
        connection.execute(insert(table).values(message_id="m-3"))
        claim(connection, "m-3", consumer="other", prefix=db.prefix).store_result([1, 2])
        connection.commit()
    with db.engine.connect() as connection:
        again = claim(connection, "m-3", consumer="other", prefix=db.prefix)
        assert again.is_duplicate and again.stored_result == [1, 2]
        connection.rollback()
    assert _rows(db) == {"m-3": 1}


def test_a_concurrent_copy_waits_for_the_first_transaction_then_is_a_duplicate(
    db: TestDatabase,
) -> None:
    first = Session(db.engine)
    first.begin()
    assert _handle(db, first, "m-4") == "new"  # holds the claim, not committed yet
    answers: list[Any] = []

    def second_worker() -> None:
        with Session(db.engine) as session, session.begin():
            answers.append(_handle(db, session, "m-4"))

    thread = threading.Thread(target=second_worker)
    thread.start()
    wait_for(lambda: _waiting_on_a_lock(db), 30, "the second claim to wait on the first")
    assert answers == []
    first.commit()
    first.close()
    thread.join(30)
    assert answers == [{"invoice": "M-4"}]
    assert _rows(db) == {"m-4": 1}


def _waiting_on_a_lock(db: TestDatabase) -> bool:
    """A statement on this test's claim table waits for a lock (the unique index)."""
    with db.engine.connect() as connection:
        return bool(
            connection.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE :table"
                ),
                {"table": f"%{db.prefix}processed_messages%"},
            ).scalar_one()
        )


def test_async_claim_on_an_async_session(db: TestDatabase) -> None:
    table = orders_table(db.prefix)

    async def handle(session: AsyncSession, message_id: str) -> Any:
        claimed = await async_claim(session, message_id, consumer="billing", prefix=db.prefix)
        if claimed.is_duplicate:
            return claimed.stored_result
        await session.execute(insert(table).values(message_id=message_id))
        await claimed.store_result({"n": 1})
        return "new"

    async def scenario() -> list[Any]:
        engine = create_async_engine(db.url)
        try:
            answers = []
            for _ in range(2):
                async with AsyncSession(engine) as session, session.begin():
                    answers.append(await handle(session, "a-1"))
            async with AsyncSession(engine) as session:
                answers.append(await handle(session, "a-2"))
                await session.rollback()
            async with engine.begin() as connection:  # an AsyncConnection
                claimed = await async_claim(connection, "a-2", consumer="billing", prefix=db.prefix)
                answers.append(claimed.is_new)
            return answers
        finally:
            await engine.dispose()

    assert asyncio.run(scenario()) == ["new", {"n": 1}, "new", True]
    assert _rows(db) == {"a-1": 1}


def test_bad_input_gets_one_clear_error(db: TestDatabase) -> None:
    with Session(db.engine) as session:
        with pytest.raises(MissingMessageIdError, match="empty message id"):
            claim(session, "  ", consumer="billing", prefix=db.prefix)
        with pytest.raises(InvalidMessageIdError, match="longer than 255"):
            claim(session, "x" * 256, consumer="billing", prefix=db.prefix)
        with pytest.raises(ConfigurationError, match="consumer must be a name"):
            claim(session, "m", consumer="", prefix=db.prefix)
        with pytest.raises(ConfigurationError, match="needs a SQLAlchemy Session or Connection"):
            claim(db.engine, "m", consumer="billing", prefix=db.prefix)  # type: ignore[arg-type]
        claimed = claim(session, "m-5", consumer="billing", prefix=db.prefix)
        with pytest.raises(InvalidResultError, match="not JSON-serialisable"):
            claimed.store_result({"when": object()})
        session.commit()
    with Session(db.engine) as session:
        duplicate = claim(session, "m-5", consumer="billing", prefix=db.prefix)
        with pytest.raises(ClaimError, match="is a duplicate"):
            duplicate.store_result(1)

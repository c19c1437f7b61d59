"""Batches larger than a database's bound-parameter limit (issue #39).

SQLite allows 32,766 bound parameters per statement by default (set on the test's
connections: Debian's build allows 250,000), PostgreSQL's and MySQL's protocols
65,535. A claim of more ids than that (70,000 on PostgreSQL, 33,000 on SQLite and
MariaDB, whose claims bind 3 parameters per row), and the reads and deletes with one
parameter per id (stored results, careful mode's processed filter, forgetting failed
claims and attempt counts, settling a dead-letter replay's rows) all work on every
database: the statements are split under the limit, in the batch's transaction.
(SQLite claims cost ~140 us per id here, hence the smaller batch there.)
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, func, select

from mqdedup.db.engine import session_factory
from mqdedup.db.schema import schema
from mqdedup.dedup.dead_letters import DeadLetterTable
from mqdedup.dedup.store import DedupStore
from tests.services import TestDatabase, prefixed_database

pytestmark = pytest.mark.integration

#: More ids than the database's parameter limit allows in one statement.
IDS = {"postgresql": 70_000, "sqlite": 33_000, "mysql": 33_000, "mariadb": 33_000}
CONSUMER = "large-batches"


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestDatabase]:
    if request.param == "postgresql":
        url, service = request.getfixturevalue("pg_url"), "PostgreSQL"
    elif request.param == "mariadb":
        url, service = request.getfixturevalue("mariadb_url"), "MariaDB"
    else:
        url, service = f"sqlite:///{tmp_path / 'large.db'}", "SQLite"
    with prefixed_database(url, service) as database:
        if request.param == "sqlite":  # SQLite's default limit (Debian's build: 250,000)
            event.listen(database.engine, "connect", default_parameter_limit)
            database.engine.dispose()  # the connections from now on have it
        yield database


def default_parameter_limit(connection: Any, _record: Any) -> None:
    connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 32_766)


@pytest.fixture
def ids(db: TestDatabase) -> list[str]:
    return [f"m-{number:06d}" for number in range(IDS[db.engine.dialect.name])]


def count(db: TestDatabase, table_name: str) -> int:
    table = getattr(schema(db.prefix), table_name)
    with db.engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(table)).scalar_one())


def test_a_batch_over_the_parameter_limit_is_claimed_read_and_forgotten(
    db: TestDatabase, ids: list[str]
) -> None:
    store = DedupStore(db.prefix, session_factory(db.engine))
    sessions = store.sessions

    with sessions() as session, session.begin():
        assert store.claim(session, CONSUMER, ids).new == set(ids)
        store.save_results(session, CONSUMER, {i: {"n": i} for i in ids[::1000]})
    assert count(db, "processed") == len(ids)

    with sessions() as session, session.begin():
        results = store.results(session, CONSUMER, ids)
    assert results == {i: {"n": i} for i in ids[::1000]}
    processed = store.processed(CONSUMER, ids)
    assert set(processed) == set(ids) and processed[ids[1000]] == {"n": ids[1000]}

    for message_id in ids[:3]:
        store.record_failure(CONSUMER, message_id, "RuntimeError: no")
    store.forget_attempts(CONSUMER, ids)
    assert count(db, "attempts") == 0

    with sessions() as session, session.begin():
        store.forget(session, CONSUMER, ids)
        # A dead-letter replay settles its batch by row ids: as many as the batch.
        assert DeadLetterTable(db.prefix).delete(session, range(1, len(ids) + 1)) == 0
    assert count(db, "processed") == 0

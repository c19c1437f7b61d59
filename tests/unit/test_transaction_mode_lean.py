"""Transaction mode's lean path: which consumers take it, which writes it binds itself.

The path itself runs on PostgreSQL only (tests/integration/test_transaction_mode_lean.py);
here: the choice of path, and that a write SQLAlchemy must prepare (a JSON value, a
client-side default, an unknown key, a statement that is not a plain ``insert(table)``)
is left to SQLAlchemy.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import (
    JSON,
    Column,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    event,
    insert,
)
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg
from sqlalchemy.orm import Session, sessionmaker

from mqdedup import Consumer, Message
from mqdedup.consumers.context import Context
from mqdedup.consumers.deferral import open_deferral
from mqdedup.consumers.lean_transactions import LeanTransactions, _values_sql
from mqdedup.dedup.sql_claims import SqlClaimStore

metadata = MetaData()
rows = Table(
    "lean_rows",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("message_id", String(255), nullable=False),
    Column("amount", Integer),
    Column("doc", JSON),
    Column("kind", String(16), default="plain"),
)
DIALECT = pg_psycopg.dialect()  # type: ignore[no-untyped-call]


def test_a_plain_row_is_bound_by_the_path_and_anything_else_by_sqlalchemy() -> None:
    assert _values_sql(rows, ("message_id", "amount", "kind"), DIALECT) == (
        "INSERT INTO lean_rows (message_id, amount, kind) VALUES (%s, %s, %s)"
    )
    assert _values_sql(rows, ("message_id", "doc", "kind"), DIALECT) is None  # JSON
    assert _values_sql(rows, ("message_id", "amount"), DIALECT) is None  # kind's default
    assert _values_sql(rows, ("message_id", "nope", "kind"), DIALECT) is None


def test_only_a_queue_of_plain_inserts_is_handed_over() -> None:
    engine = create_engine("sqlite://")
    metadata.create_all(engine)
    with Session(engine) as session, session.begin():
        writes = open_deferral(session)
        writes.enter_handler()
        writes.execute(insert(rows), {"message_id": "a"})
        writes.execute(insert(rows), {"message_id": "b", "amount": 2})
        assert writes.take_plain_inserts() == [
            (rows, {"message_id": "a"}),
            (rows, {"message_id": "b", "amount": 2}),
        ]
        assert len(writes) == 0
        writes.execute(insert(rows), {"message_id": "c"})
        writes.execute(insert(rows).values(amount=3), {"message_id": "d"})
        assert writes.take_plain_inserts() is None and len(writes) == 2  # kept


class _Handler(Consumer):
    name = "lean"
    failure_isolation = "transaction"

    def handle(self, message: Message, ctx: Context) -> Any:
        return None


PG = "postgresql+psycopg://u@localhost/db"


@pytest.mark.parametrize(
    ("url", "attributes", "session_options", "opted_out", "expected"),
    [
        (PG, {}, {}, False, True),
        (PG, {"failure_isolation": "auto"}, {}, False, False),
        (PG, {}, {}, True, False),  # Django's sessions
        (PG, {}, {"join_transaction_mode": "control_fully"}, False, False),  # would COMMIT
        ("sqlite://", {}, {}, False, False),
    ],
)
def test_the_path_is_taken_by_sync_transaction_mode_on_postgresql_with_psycopg(
    url: str,
    attributes: dict[str, Any],
    session_options: dict[str, Any],
    opted_out: bool,
    expected: bool,
) -> None:
    engine = create_engine(url)  # never connects
    sessions = sessionmaker(engine, **session_options)
    consumer = type("C", (_Handler,), attributes)()
    processor: Any = SimpleNamespace(consumer=consumer, store=SqlClaimStore(sessions))
    assert LeanTransactions.applies(processor, sessions, opted_out) is expected


def test_an_engine_that_listens_to_transactions_keeps_the_session_path() -> None:
    engine = create_engine(PG)
    sessions = sessionmaker(engine)
    processor: Any = SimpleNamespace(consumer=_Handler(), store=SqlClaimStore(sessions))
    assert LeanTransactions.applies(processor, sessions, False)
    event.listen(engine, "begin", lambda connection: None)  # e.g. SET LOCAL per transaction
    assert not LeanTransactions.applies(processor, sessions, False)

"""State transitions on SQLite: outcomes, graph checks before SQL, versions, ORM entities."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, event, insert, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from mqdedup.db import create_engine
from mqdedup.dedup.transitions import (
    IllegalTransitionError,
    StateMachine,
    TransitionOutcome,
)
from mqdedup.errors import ConfigurationError

EDGES = {"CREATED": {"PAID", "CLOSED"}, "PAID": {"REFUNDED"}}

metadata = MetaData()
orders = Table(
    "unit_orders",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("state", String(20), nullable=False),
    Column("version", Integer, nullable=False, default=0),
    Column("note", String(50), nullable=True),
)


class Base(DeclarativeBase):
    pass


class Payment(Base):
    __tablename__ = "unit_payments"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20))


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = create_engine(f"sqlite:///{tmp_path / 'transitions.db'}")
    metadata.create_all(engine)
    Base.metadata.create_all(engine)
    with engine.begin() as connection:
        connection.execute(
            insert(orders),
            [
                {"id": 1, "state": "CREATED", "version": 0},
                {"id": 2, "state": "PAID", "version": 0},
                {"id": 3, "state": "REFUNDED", "version": 0},
            ],
        )
    yield engine
    engine.dispose()


@pytest.fixture
def statements(engine: Engine) -> list[str]:
    """Every SQL statement sent on ``engine``."""
    sent: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def _record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        sent.append(statement.split(maxsplit=1)[0].upper())

    return sent


def state_of(engine: Engine, row_id: int) -> tuple[str, int]:
    with engine.connect() as connection:
        row = connection.execute(
            select(orders.c.state, orders.c.version).where(orders.c.id == row_id)
        ).one()
    return row[0], row[1]


machine = StateMachine(orders, EDGES, version_column="version")


def test_applied_then_repeat_is_already_in_target(engine: Engine, statements: list[str]) -> None:
    with Session(engine) as session, session.begin():
        first = machine.transition(session, 1, to="PAID")
    assert first.applied and str(first) == "applied"
    assert statements.count("UPDATE") == 1 and statements.count("SELECT") == 0
    assert state_of(engine, 1) == ("PAID", 1)

    statements.clear()
    with Session(engine) as session, session.begin():
        again = machine.transition(session, 1, to="PAID")
    assert again.outcome is TransitionOutcome.ALREADY_IN_TARGET
    assert str(again) == "already in target state"
    assert again.ok and not again.applied
    assert statements.count("UPDATE") == 1 and statements.count("SELECT") == 1
    assert state_of(engine, 1) == ("PAID", 1)  # the repeat did not bump the version


def test_illegal_from_current_state_is_rejected_with_that_state(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        result = machine.transition(session, 3, to="PAID")
    assert result.rejected
    assert result.current_state == "REFUNDED"
    assert str(result) == "rejected: illegal from REFUNDED"
    assert state_of(engine, 3) == ("REFUNDED", 0)


def test_edges_not_on_the_graph_are_refused_before_any_sql(
    engine: Engine, statements: list[str]
) -> None:
    with Session(engine) as session:
        with pytest.raises(IllegalTransitionError, match="unknown target state 'SHIPPED'"):
            machine.transition(session, 1, to="SHIPPED")
        with pytest.raises(IllegalTransitionError, match="no transition leads to 'CREATED'"):
            machine.transition(session, 1, to="CREATED")
        with pytest.raises(IllegalTransitionError, match="illegal transition PAID -> CLOSED"):
            machine.transition(session, 1, to="CLOSED", from_="PAID")
    assert statements == []


def test_from_narrows_the_sources(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        result = machine.transition(session, 2, to="REFUNDED", from_="PAID")
    assert result.applied
    assert state_of(engine, 2) == ("REFUNDED", 1)


def test_expected_version_mismatch_is_stale(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        stale = machine.transition(session, 1, to="PAID", expected_version=7)
    assert stale.outcome is TransitionOutcome.STALE
    assert stale.version == 0 and stale.current_state == "CREATED"
    with Session(engine) as session, session.begin():
        fresh = machine.transition(session, 1, to="PAID", expected_version=0)
    assert fresh.applied and fresh.version == 1
    assert state_of(engine, 1) == ("PAID", 1)


def test_missing_row_is_not_found(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        result = machine.transition(session, 404, to="PAID")
    assert result.outcome is TransitionOutcome.NOT_FOUND
    assert result.current_state is None


def test_extra_values_are_set_with_the_state(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        machine.transition(session, 1, to="CLOSED", values={"note": "customer cancelled"})
    with engine.connect() as connection:
        note = connection.execute(select(orders.c.note).where(orders.c.id == 1)).scalar_one()
    assert note == "customer cancelled"
    with Session(engine) as session, pytest.raises(ConfigurationError, match="no column"):
        machine.transition(session, 2, to="REFUNDED", values={"nope": 1})


def test_rolled_back_transaction_leaves_the_state(engine: Engine) -> None:
    with Session(engine) as session:
        session.begin()
        assert machine.transition(session, 1, to="PAID").applied
        session.rollback()
    assert state_of(engine, 1) == ("CREATED", 0)


def test_mapped_entity_and_identity_map_refresh(engine: Engine) -> None:
    flow = StateMachine(Payment, EDGES, state_column="status")
    with Session(engine) as session, session.begin():
        session.add(Payment(id=10, status="CREATED"))
    with Session(engine) as session, session.begin():
        payment = session.get(Payment, 10)
        assert payment is not None
        result = flow.transition(session, payment, to="PAID")
        assert result.applied
        assert payment.status == "PAID"  # the loaded instance sees the new state
        assert flow.transition(session, 10, to="PAID").already_in_target


def test_bad_declarations_name_the_problem() -> None:
    with pytest.raises(ConfigurationError, match="no column 'status'"):
        StateMachine(orders, EDGES, state_column="status")
    with pytest.raises(ConfigurationError, match="self-loop"):
        StateMachine(orders, {"A": {"A"}})
    with pytest.raises(ConfigurationError, match="collection of states"):
        StateMachine(orders, {"A": "B"})
    with pytest.raises(ConfigurationError, match="mapped class or a Table"):
        StateMachine(object(), EDGES)
    with pytest.raises(ConfigurationError, match="at least one edge"):
        StateMachine(orders, {})
    plain = StateMachine(orders, EDGES)
    with (
        pytest.raises(ConfigurationError, match="no version_column"),
        Session() as session,
    ):
        plain.transition(session, 1, to="PAID", expected_version=1)


def test_run_transaction_reruns_transient_errors_only(engine: Engine) -> None:
    import sqlite3

    from sqlalchemy.exc import OperationalError

    from mqdedup.dedup.transitions import run_transaction

    def busy() -> OperationalError:
        cause = sqlite3.OperationalError("database is locked")
        cause.sqlite_errorcode = 5  # type: ignore[attr-defined]  # SQLITE_BUSY: transient
        return OperationalError("UPDATE", {}, cause)

    calls: list[int] = []

    def pay(session: Session) -> Any:
        calls.append(1)
        result = machine.transition(session, 1, to="PAID")
        if len(calls) < 3:
            raise busy()  # rolls the transition back; the rerun applies it
        return result

    result = run_transaction(engine, pay, backoff=0.001)
    assert result.applied and len(calls) == 3
    assert state_of(engine, 1) == ("PAID", 1)

    def broken(session: Session) -> Any:
        calls.append(1)
        raise ValueError("a bug, not an outage")

    calls.clear()
    with pytest.raises(ValueError, match="a bug"):
        run_transaction(engine, broken, backoff=0.001)
    assert len(calls) == 1

    def always_busy(session: Session) -> Any:
        calls.append(1)
        raise busy()

    calls.clear()
    with pytest.raises(OperationalError):
        run_transaction(engine, always_busy, attempts=2, backoff=0.001)
    assert len(calls) == 2  # gave up after its attempts, with the last error

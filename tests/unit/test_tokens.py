"""One-time tokens on SQLite: the four outcomes, owner binding, shared transactions, purge."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, func, select
from sqlalchemy.orm import Session

from mqdedup.db import create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.dedup.tokens import DatabaseTokenStore, TokenOutcome, TokenStore, token_hash
from mqdedup.errors import ConfigurationError


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = create_engine(f"sqlite:///{tmp_path / 'tokens.db'}")
    init_schema(engine)
    yield engine
    engine.dispose()


class Clock:
    """A settable clock for expiry tests."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def token_rows(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(
            connection.execute(select(func.count()).select_from(schema().tokens)).scalar_one()
        )


def test_consume_outcomes(engine: Engine) -> None:
    store = DatabaseTokenStore(engine)
    assert isinstance(store, TokenStore)
    token = store.issue("alice", timedelta(minutes=5))
    assert store.consume("bob", token) is TokenOutcome.UNKNOWN  # another owner
    assert store.consume("alice", token) is TokenOutcome.CONSUMED
    assert store.consume("alice", token) is TokenOutcome.ALREADY_USED
    assert store.consume("alice", "never-issued") is TokenOutcome.UNKNOWN
    assert store.consume("bob", token) is TokenOutcome.UNKNOWN  # still hidden from bob


def test_expired_and_used_stay_distinct_after_expiry(engine: Engine) -> None:
    clock = Clock()
    store = DatabaseTokenStore(engine, clock=clock)
    used = store.issue("alice", 60)
    unused = store.issue("alice", 60)
    assert store.consume("alice", used) is TokenOutcome.CONSUMED
    clock.now += timedelta(seconds=61)
    assert store.consume("alice", unused) is TokenOutcome.EXPIRED
    assert store.consume("alice", used) is TokenOutcome.ALREADY_USED


def test_only_a_hash_is_stored(engine: Engine) -> None:
    store = DatabaseTokenStore(engine)
    token = store.issue("alice", 60)
    with engine.connect() as connection:
        stored = connection.execute(select(schema().tokens.c.token_hash)).scalar_one()
    assert stored == token_hash(token) and token not in stored


def test_consume_in_the_callers_transaction_rolls_back_with_it(engine: Engine) -> None:
    store = DatabaseTokenStore(engine)
    token = store.issue("alice", 60)
    with Session(engine) as session:
        session.begin()
        assert store.consume("alice", token, session=session) is TokenOutcome.CONSUMED
        session.rollback()  # the guarded action failed: the token is usable again
    assert store.consume("alice", token) is TokenOutcome.CONSUMED


def test_issue_in_the_callers_transaction(engine: Engine) -> None:
    store = DatabaseTokenStore()  # no engine of its own: only session= calls work
    with Session(engine) as session, session.begin():
        token = store.issue("alice", 60, session=session)
    with Session(engine) as session, session.begin():
        assert store.consume("alice", token, session=session) is TokenOutcome.CONSUMED
    with pytest.raises(ConfigurationError, match="has no database"):
        store.issue("alice", 60)


def test_malformed_tokens_are_unknown_without_a_query(engine: Engine) -> None:
    store = DatabaseTokenStore(engine)
    sent: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def _record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        sent.append(statement)

    assert store.consume("alice", "") is TokenOutcome.UNKNOWN
    assert store.consume("alice", "x" * 10_000) is TokenOutcome.UNKNOWN
    assert store.consume("alice", None) is TokenOutcome.UNKNOWN  # type: ignore[arg-type]
    assert sent == []


def test_bad_arguments_name_the_problem(engine: Engine) -> None:
    store = DatabaseTokenStore(engine)
    with pytest.raises(ValueError, match="ttl must be positive"):
        store.issue("alice", 0)
    with pytest.raises(ValueError, match="non-empty"):
        store.issue("", 60)
    with pytest.raises(ValueError, match="longer than 255"):
        store.consume("o" * 256, "token")


def test_purge_drops_long_expired_tokens_only(engine: Engine) -> None:
    clock = Clock()
    store = DatabaseTokenStore(engine, clock=clock)
    old = store.issue("alice", 60)
    clock.now += timedelta(days=10)
    fresh = store.issue("alice", 60)
    assert store.purge(older_than=timedelta(days=7), chunk_size=1) == 1
    assert token_rows(engine) == 1
    assert store.consume("alice", old) is TokenOutcome.UNKNOWN
    assert store.consume("alice", fresh) is TokenOutcome.CONSUMED


def test_a_colliding_token_is_retried(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DatabaseTokenStore(engine)
    taken = store.issue("alice", 60)
    fresh = iter([taken, "fresh"])
    monkeypatch.setattr("mqdedup.dedup.tokens.new_token", lambda: next(fresh))
    assert store.issue("bob", 60) == "fresh"
    assert token_rows(engine) == 2

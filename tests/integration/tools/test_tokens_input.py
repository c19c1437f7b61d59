"""Bad token input gets the same clear answer from every backend, before it reaches one.

A NUL in an owner was a raw ``DataError`` on PostgreSQL and ``unknown`` on SQLite; an
infinite or huge ttl was an ``OverflowError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from mqdedup.db import create_engine, init_schema
from mqdedup.dedup.tokens import DatabaseTokenStore, TokenOutcome, TokenStore

pytestmark = pytest.mark.integration


@pytest.fixture(params=["sqlite", "postgresql", "mariadb", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TokenStore]:
    if request.param == "redis":
        from mqdedup.dedup.redis_tokens import RedisTokenStore

        client = request.getfixturevalue("redis_conn")
        namespace = request.getfixturevalue("namespace")
        yield RedisTokenStore(client, namespace=namespace)
        return
    if request.param == "sqlite":
        engine = create_engine(f"sqlite:///{tmp_path / 'tokens.db'}")
        init_schema(engine)
        yield DatabaseTokenStore(engine)
        engine.dispose()
        return
    database = request.getfixturevalue("pg" if request.param == "postgresql" else "mariadb")
    yield DatabaseTokenStore(database.engine, prefix=database.prefix)


@pytest.mark.parametrize(
    ("owner", "message"),
    [
        ("user\x00admin", "must not contain NUL"),
        ("a\ud800b", "not valid Unicode"),
        ("", "non-empty"),
    ],
)
def test_a_bad_owner_is_refused_the_same_way_everywhere(
    store: TokenStore, owner: str, message: str
) -> None:
    token = store.issue("alice", 60)
    with pytest.raises(ValueError, match=message):
        store.issue(owner, 60)
    with pytest.raises(ValueError, match=message):
        store.consume(owner, token)
    assert store.consume("alice", token) is TokenOutcome.CONSUMED  # nothing was spent


@pytest.mark.parametrize("token", ["tok\x00en", "a\ud800b", "ünïcode", "x" * 600])
def test_a_token_we_never_issued_is_unknown_everywhere(store: TokenStore, token: str) -> None:
    assert store.consume("alice", token) is TokenOutcome.UNKNOWN


@pytest.mark.parametrize(
    "ttl", [float("inf"), 1e12, -1, 0, float("nan"), timedelta(days=10_000), "soon"]
)
def test_an_unusable_ttl_is_a_clear_value_error(store: TokenStore, ttl: object) -> None:
    with pytest.raises(ValueError, match="token ttl must be"):
        store.issue("alice", ttl)  # type: ignore[arg-type]

"""Clear answers for hostile input: deep JSON, unusable token ttls and owners."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from mqdedup import InMemoryBroker, Message, RetryPolicy, run_until_idle
from mqdedup.db import create_engine, init_schema
from mqdedup.dedup.tokens import DatabaseTokenStore, TokenOutcome
from mqdedup.errors import UndecodableMessageError
from tests.support import OrderConsumer, order_counts

DEEP = b"[" * 100_000 + b"]" * 100_000


class FastOrders(OrderConsumer):
    retry_policy = RetryPolicy(max_attempts=3, initial_backoff=0.001, max_backoff=0.01)


def test_deeply_nested_json_is_undecodable_not_a_recursion_error() -> None:
    with pytest.raises(UndecodableMessageError, match="nested too deeply"):
        Message(DEEP, id="deep").json()


def test_deeply_nested_json_is_dead_lettered_at_once_among_good_messages(
    sqlite_engine: Engine,
) -> None:
    broker = InMemoryBroker()
    broker.publish("orders", json.dumps({"order": 1, "amount": 1}), message_id="m1")
    broker.publish("orders", DEEP, message_id="deep")
    broker.publish("orders", json.dumps({"order": 2, "amount": 2}), message_id="m2")
    metrics = run_until_idle(FastOrders(), broker.transport("orders"), sqlite_engine)

    [dead] = broker.dead_letters["orders"]
    assert dead.message.body == DEEP
    assert dead.record.reason.startswith("undecodable body: JSON nested too deeply")
    assert dead.record.attempts == 1
    assert metrics.retries == 0  # a property of the message, not a handler failure
    assert (metrics.processed, metrics.dead_lettered) == (2, 1)
    assert sorted(order_counts(sqlite_engine)) == ["m1", "m2"]


@pytest.fixture
def tokens(tmp_path: Path) -> Iterator[DatabaseTokenStore]:
    engine = create_engine(f"sqlite:///{tmp_path / 'tokens.db'}")
    init_schema(engine)
    yield DatabaseTokenStore(engine)
    engine.dispose()


@pytest.mark.parametrize("ttl", [float("inf"), 1e12, float("nan"), -5])
def test_token_ttl_outside_its_limits_names_the_limit(
    tokens: DatabaseTokenStore, ttl: float
) -> None:
    with pytest.raises(ValueError, match=r"positive and at most 315360000 seconds"):
        tokens.issue("alice", ttl)


def test_token_owner_with_nul_is_refused_before_the_database(tokens: DatabaseTokenStore) -> None:
    token = tokens.issue("alice", 60)
    with pytest.raises(ValueError, match="must not contain NUL"):
        tokens.consume("alice\x00", token)
    assert tokens.consume("alice", token) is TokenOutcome.CONSUMED

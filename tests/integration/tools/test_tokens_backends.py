"""One-time tokens against real PostgreSQL, MariaDB and Redis: 50 concurrent consumes."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
import redis
from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from mqdedup.db.schema import schema
from mqdedup.dedup.redis_tokens import RedisTokenStore
from mqdedup.dedup.tokens import DatabaseTokenStore, TokenOutcome
from mqdedup.dedup.transitions import run_transaction
from tests.integration.tools.conftest import Database
from tests.services import wait_for

pytestmark = pytest.mark.integration
THREADS = 50


def consume_concurrently(consume: Callable[[], TokenOutcome]) -> Counter[TokenOutcome]:
    """Release ``THREADS`` threads at once on ``consume``; count their answers."""
    barrier = threading.Barrier(THREADS)
    outcomes: Counter[TokenOutcome] = Counter()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        try:
            barrier.wait(timeout=30)
            outcome = consume()
            with lock:
                outcomes[outcome] += 1
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    return outcomes


def test_database_50_threads_consuming_one_token(database: Database) -> None:
    store = DatabaseTokenStore(database.engine, prefix=database.prefix)
    token = store.issue("alice", timedelta(minutes=5))

    # Each consume runs in its own transaction and connection; a transient error
    # (an InnoDB deadlock report under this much contention) reruns it, as a consumer would.
    outcomes = consume_concurrently(
        lambda: run_transaction(
            database.engine, lambda session: store.consume("alice", token, session=session)
        )
    )

    assert outcomes == {TokenOutcome.CONSUMED: 1, TokenOutcome.ALREADY_USED: 49}
    tokens = schema(database.prefix).tokens
    with database.engine.connect() as connection:
        used = connection.execute(
            select(func.count()).select_from(tokens).where(tokens.c.used_at.is_not(None))
        ).scalar_one()
    assert used == 1


def test_database_expired_unknown_and_other_owner(database: Database) -> None:
    issuer = DatabaseTokenStore(database.engine, prefix=database.prefix)
    token = issuer.issue("alice", timedelta(seconds=30))
    later = DatabaseTokenStore(
        database.engine,
        prefix=database.prefix,
        clock=lambda: datetime.now(UTC) + timedelta(seconds=31),
    )
    assert issuer.consume("mallory", token) is TokenOutcome.UNKNOWN
    assert later.consume("alice", token) is TokenOutcome.EXPIRED
    assert issuer.consume("alice", "not-a-token-we-issued") is TokenOutcome.UNKNOWN
    # The expired token stays unusable; the other owner still learns nothing.
    assert later.consume("alice", token) is TokenOutcome.EXPIRED
    assert later.consume("mallory", token) is TokenOutcome.UNKNOWN


def test_database_consume_shares_the_business_transaction(database: Database) -> None:
    """A failed action rolls its consume back; a committed one keeps it used."""
    store = DatabaseTokenStore(database.engine, prefix=database.prefix)
    orders = database.business.orders
    token = store.issue("alice", 60)

    def place_order(session: Session, fail: bool) -> TokenOutcome:
        outcome = store.consume("alice", token, session=session)
        if outcome is TokenOutcome.CONSUMED:
            session.execute(insert(orders).values(message_id="order-1", order_id="1"))
            if fail:
                raise RuntimeError("payment provider refused")
        return outcome

    with pytest.raises(RuntimeError):
        run_transaction(database.engine, lambda s: place_order(s, fail=True))
    assert database.business.order_counts(database.engine) == {}
    assert run_transaction(database.engine, lambda s: place_order(s, fail=False)) == "consumed"
    assert run_transaction(database.engine, lambda s: place_order(s, fail=False)) == "already used"
    assert database.business.order_counts(database.engine) == {"order-1": 1}


def test_redis_50_threads_consuming_one_token(redis_conn: redis.Redis, namespace: str) -> None:
    store = RedisTokenStore(redis_conn, namespace=namespace)
    token = store.issue("alice", timedelta(minutes=5))

    outcomes = consume_concurrently(lambda: store.consume("alice", token))

    assert outcomes == {TokenOutcome.CONSUMED: 1, TokenOutcome.ALREADY_USED: 49}
    stored = redis_conn.get(store.key(token))
    assert stored is not None and stored.startswith(b"U|")  # the tombstone of a used token
    assert token.encode() not in b"".join(redis_conn.keys(f"{namespace}*"))  # hashes only


def test_redis_expired_unknown_and_other_owner(redis_conn: redis.Redis, namespace: str) -> None:
    store = RedisTokenStore(redis_conn, namespace=namespace, retention=timedelta(minutes=5))
    short = store.issue("alice", timedelta(milliseconds=300))
    used = store.issue("alice", timedelta(milliseconds=300))
    assert store.consume("alice", used) is TokenOutcome.CONSUMED
    assert store.consume("mallory", short) is TokenOutcome.UNKNOWN

    # Expiry is decided by the Redis server's clock: wait until it passes the expiry
    # stored with the token (the key itself lives on for the retention period).
    stored = redis_conn.get(store.key(short))
    assert stored is not None
    expires_ms = int(stored.split(b"|")[1])

    def lifetime_over() -> bool:
        seconds, micros = redis_conn.time()
        return seconds * 1000 + micros // 1000 >= expires_ms

    wait_for(lifetime_over, 10, "the token's lifetime to pass on the server's clock")
    assert store.consume("alice", short) is TokenOutcome.EXPIRED
    assert store.consume("alice", used) is TokenOutcome.ALREADY_USED  # used stays used
    assert store.consume("alice", "never-issued") is TokenOutcome.UNKNOWN
    assert store.consume("mallory", used) is TokenOutcome.UNKNOWN


def test_redis_tombstones_go_after_retention(redis_conn: redis.Redis, namespace: str) -> None:
    store = RedisTokenStore(redis_conn, namespace=namespace, retention=timedelta(seconds=5))
    token = store.issue("alice", timedelta(seconds=10))
    ttl_ms = redis_conn.pttl(store.key(token))
    assert 14_000 < ttl_ms <= 15_000  # lifetime + retention
    assert store.consume("alice", token) is TokenOutcome.CONSUMED
    assert 13_000 < redis_conn.pttl(store.key(token)) <= 15_000  # KEEPTTL kept it


def test_a_colliding_token_is_recognised_by_its_duplicate_key_code(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issuing retries with a fresh token when the random one already exists: the
    duplicate key is recognised by its code (SQLSTATE 23505 / MySQL error 1062)."""
    store = DatabaseTokenStore(database.engine, prefix=database.prefix)
    taken = store.issue("alice", 60)
    fresh = iter([taken, taken, "a-fresh-token"])
    monkeypatch.setattr("mqdedup.dedup.tokens.new_token", lambda: next(fresh))

    assert store.issue("bob", 60) == "a-fresh-token"  # in its own transaction
    fresh = iter([taken, "another-fresh-token"])
    with Session(database.engine) as session, session.begin():
        session.execute(insert(database.business.orders).values(message_id="kept"))
        assert store.issue("bob", 60, session=session) == "another-fresh-token"
    # The collision rolled back only its savepoint: the caller's write survived.
    assert database.business.order_counts(database.engine) == {"kept": 1}
    assert store.consume("alice", taken) is TokenOutcome.CONSUMED  # still alice's

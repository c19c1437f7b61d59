"""The claim-store contract: one suite, run against PostgreSQL, MariaDB, SQLite and Redis.

Every :class:`~mqdedup.dedup.claims.ClaimStore` the Processor drives must pass it (after
watermill's universal Pub/Sub suite: one set of tests plus the features each
implementation declares). A unit of work is what the store's ``unit`` argument means:
a database transaction for SQL stores (committed when the block ends), the worker id
holding the leases for Redis.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from mqdedup.db import check_connection, create_engine, init_schema
from mqdedup.db.engine import session_factory
from mqdedup.db.schema import schema
from mqdedup.dedup.claims import AttemptLog, ClaimStore
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import DatabaseUnavailableError
from tests.services import require_module, require_service, wait_for

pytestmark = pytest.mark.integration

CONSUMER = "orders"


@dataclass
class Harness:
    """One claim store under test, and how to open units of work on it."""

    kind: str
    store: ClaimStore
    unit: Callable[[], Any]  # a context manager yielding the store's unit of work
    #: Forget everything older than ``older_than`` (the retention purge).
    purge: Callable[[], None]
    #: Claims are leased (Redis): a claim held by a crashed worker frees itself.
    leases: bool = False
    #: Build another store of the same kind with a short lease / retention (seconds).
    short_lived: Callable[[float], ClaimStore] | None = None
    #: Careful mode's unit of work (a context manager), held for a run of messages.
    attempt_unit: Callable[[], Any] | None = None


def _sql_harness(kind: str, engine: Engine) -> Iterator[Harness]:
    try:
        check_connection(engine)
    except DatabaseUnavailableError as exc:
        require_service(kind, str(exc))
    prefix = f"c_{uuid.uuid4().hex[:8]}_"
    init_schema(engine, prefix)
    sessions = session_factory(engine)
    store = DedupStore(prefix, sessions)

    @contextmanager
    def unit() -> Iterator[Any]:
        with sessions() as session, session.begin():
            yield session

    @contextmanager
    def lease() -> Iterator[Any]:  # careful mode's session: it begins its own transactions
        with sessions() as session:
            yield session

    def purge() -> None:
        store.purge(engine, older_than=timedelta(0))

    try:
        yield Harness(kind, store, unit, purge, attempt_unit=lease)
    finally:
        schema(prefix).metadata.drop_all(engine)
        engine.dispose()


def _redis_harness() -> Iterator[Harness]:
    redis = require_module("redis")
    from mqdedup.dedup.redis_claims import RedisClaimStore

    url = os.environ.get("MQDEDUP_REDIS_URL")
    if not url:
        require_service("Redis", "MQDEDUP_REDIS_URL is not set")
    client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        require_service("Redis", str(exc))
    namespace = f"contract:{uuid.uuid4().hex[:8]}:"
    store = RedisClaimStore(client, namespace=namespace)

    @contextmanager
    def unit() -> Iterator[Any]:
        yield uuid.uuid4().hex  # a worker of its own

    def purge() -> None:  # retention: keys expire; this drops what a short one would
        for key in client.scan_iter(match=f"{namespace}*"):
            client.delete(key)

    def short_lived(seconds: float) -> ClaimStore:
        return RedisClaimStore(client, namespace=namespace, lease=seconds, retention=seconds)

    try:
        yield Harness(
            "redis", store, unit, purge, leases=True, short_lived=short_lived, attempt_unit=unit
        )
    finally:
        purge()
        client.close()


@pytest.fixture(params=["postgresql", "mariadb", "sqlite", "redis"])
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """Each claim store in turn."""
    kind = request.param
    if kind == "redis":
        yield from _redis_harness()
        return
    if kind == "sqlite":
        yield from _sql_harness(kind, create_engine(f"sqlite:///{tmp_path / 'claims.db'}"))
        return
    variable = "MQDEDUP_TEST_DATABASE_URL" if kind == "postgresql" else "MQDEDUP_TEST_MARIADB_URL"
    url = os.environ.get(variable)
    if not url:
        require_service(kind, f"{variable} is not set")
    assert url is not None
    yield from _sql_harness(kind, create_engine(url))


def claim(harness: Harness, ids: list[str], results: dict[str, Any] | None = None) -> set[str]:
    """Claim ``ids`` in one unit of work, completing the new ones (with ``results``)."""
    with harness.unit() as unit:
        new = harness.store.claim(unit, CONSUMER, ids).new
        done = {i: (results or {}).get(i) for i in ids if i in new}
        harness.store.save_results(unit, CONSUMER, done)
    return new


def test_new_ids_are_claimed_once_and_then_are_duplicates(harness: Harness) -> None:
    assert claim(harness, ["m-1", "m-2"]) == {"m-1", "m-2"}
    assert claim(harness, ["m-1", "m-2", "m-3"]) == {"m-3"}
    with harness.unit() as unit:
        claims = harness.store.claim(unit, CONSUMER, ["m-1", "m-3"])
    assert claims.new == set() and claims.busy == {}
    with harness.unit() as unit:  # another consumer name is another scope
        assert harness.store.claim(unit, "billing", ["m-1"]).new == {"m-1"}


def test_duplicates_get_the_stored_results(harness: Harness) -> None:
    claim(harness, ["r-1", "r-2"], {"r-1": {"order": 7, "text": "ü"}})
    with harness.unit() as unit:
        claims = harness.store.claim(unit, CONSUMER, ["r-1", "r-2"])
        stored = harness.store.results(unit, CONSUMER, ["r-1", "r-2"])
    assert claims.new == set()
    assert stored == {"r-1": {"order": 7, "text": "ü"}}  # r-2 has no result
    assert all(claims.done.get(i) == stored.get(i) for i in claims.done)


def test_a_forgotten_claim_is_new_again(harness: Harness) -> None:
    """A failed handler's claim is forgotten in its unit of work: the retry claims it."""
    with harness.unit() as unit:
        assert harness.store.claim(unit, CONSUMER, ["f-1", "f-2"]).new == {"f-1", "f-2"}
        harness.store.forget(unit, CONSUMER, ["f-1"])
        harness.store.save_results(unit, CONSUMER, {"f-2": None})
    assert claim(harness, ["f-1", "f-2"]) == {"f-1"}


def test_two_workers_claiming_one_id_at_once_one_wins(harness: Harness) -> None:
    """Promise 3: whatever the timing, exactly one of two concurrent claims is new.

    The first claimer holds its claim for a moment before completing it; a SQL rival
    waits on the unique index, then finds the claim committed; a Redis rival finds it
    held (busy).
    """
    start = threading.Barrier(2)
    won: list[bool] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with harness.unit() as unit:
                start.wait(timeout=10)
                new = harness.store.claim(unit, CONSUMER, ["race"]).new
                if new:
                    time.sleep(0.2)  # the handler: the rival's claim must wait or see it held
                    harness.store.save_results(unit, CONSUMER, {"race": {"by": "winner"}})
            won.append(bool(new))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    assert sorted(won) == [False, True]
    with harness.unit() as unit:
        assert harness.store.results(unit, CONSUMER, ["race"]) == {"race": {"by": "winner"}}


def test_failed_attempts_are_counted_until_forgotten(harness: Harness) -> None:
    counts = [harness.store.record_failure(CONSUMER, "a-1", "RuntimeError: no") for _ in range(3)]
    assert counts == [1, 2, 3]
    assert harness.store.record_failure(CONSUMER, "a-2", "ValueError: \x00 bad") == 1
    harness.store.forget_attempts(CONSUMER, ["a-1"])
    assert harness.store.record_failure(CONSUMER, "a-1", "RuntimeError: again") == 1


def test_retention_forgets_processed_ids(harness: Harness) -> None:
    claim(harness, ["old-1"])
    harness.purge()
    assert claim(harness, ["old-1"]) == {"old-1"}


@pytest.mark.parametrize("harness", ["redis"], indirect=True)  # SQL claims end with
def test_a_crashed_workers_lease_runs_out(harness: Harness) -> None:  # their transaction
    """Leasing stores: a claim nobody completes or releases frees itself after the lease;
    completed ids expire after their retention."""
    assert harness.leases and harness.short_lived is not None
    store = harness.short_lived(0.5)
    with harness.unit() as crashed:
        assert store.claim(crashed, CONSUMER, ["l-1"]).new == {"l-1"}  # never completed
    with harness.unit() as rival:
        claims = store.claim(rival, CONSUMER, ["l-1"])
        assert claims.new == set() and 0 < claims.busy["l-1"] <= 0.5
        wait_for(lambda: store.claim(rival, CONSUMER, ["l-1"]).new == {"l-1"}, 5, "the lease")
        store.save_results(rival, CONSUMER, {"l-1": 1})
        assert store.claim(rival, CONSUMER, ["l-1"]).done == {"l-1": 1}
        wait_for(lambda: store.claim(rival, CONSUMER, ["l-1"]).new == {"l-1"}, 5, "retention")


def test_careful_mode_counts_an_attempt_before_it_runs(harness: Harness) -> None:
    """The attempt log (``AttemptLog``): count first, refuse past the limit, finish or
    take back an attempt; ``processed`` finds completed ids in one read."""
    store = harness.store
    assert isinstance(store, AttemptLog) and harness.attempt_unit is not None
    marker = "the worker died while handling it"
    with harness.attempt_unit() as unit:  # the count commits on its own, before any handler
        assert store.start_attempt(unit, CONSUMER, "k-1", marker, 2) == (1, marker, True)
    store.finish_attempt(CONSUMER, "k-1", "RuntimeError: boom")
    with harness.attempt_unit() as unit:
        assert store.start_attempt(unit, CONSUMER, "k-1", marker, 2) == (2, marker, True)
    with harness.attempt_unit() as unit:  # the limit: nothing written, the stored state returned
        assert store.start_attempt(unit, CONSUMER, "k-1", marker, 2) == (2, marker, False)
    store.undo_attempt(CONSUMER, "k-1")  # the last one never ran (a duplicate meanwhile)
    with harness.attempt_unit() as unit:
        assert store.start_attempt(unit, CONSUMER, "k-1", marker, 2) == (2, marker, True)
    store.finish_attempt(CONSUMER, "k-1", "ValueError: bad \x00 amount")
    with harness.attempt_unit() as unit:  # the stored error comes back at the limit
        count, error, started = store.start_attempt(unit, CONSUMER, "k-1", marker, 2)
    assert (count, started) == (2, False) and error and error.startswith("ValueError: bad")
    claim(harness, ["k-2", "k-3"], {"k-2": {"ok": True}})
    assert store.processed(CONSUMER, ["k-1", "k-2", "k-3"]) == {"k-2": {"ok": True}, "k-3": None}

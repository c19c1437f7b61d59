"""Relays in different coordination modes on one outbox table agree (issue 40, part 1).

Every pair of the three modes (``session`` direct, ``control``: PgBouncer plus a direct
``--control-database``, ``transaction``: PgBouncer only) runs at once on one table while
two writers add 1,000 keyed rows, and each pair is also switched from one mode to the
other under load (the second relay starts at a third of the rows, the first stops at two
thirds). The broker must get every row once, each key in order. Before the fix a
``transaction`` relay claimed whenever no lease was live (between a session relay's
bursts) and both relays published the same rows (``bench/relay_modes_bench.py``:
6,000 rows, see docs/operations.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy.orm import Session

from mqdedup.db import create_engine
from mqdedup.outbox import OutboxWriter
from mqdedup.outbox.coordination import LeaseTakeover, create_coordinator, lock_class
from mqdedup.outbox.store import OutboxStore
from tests.integration.outbox.helpers import OutboxDb, events_table
from tests.integration.postgres_ha.mixed_modes import MODES, run_pair
from tests.services import RabbitAdmin, prefixed_database, table_prefix

pytestmark = [pytest.mark.integration, pytest.mark.slow]
KEYS, PER_KEY = 40, 25  # 1,000 rows

PAIRS = list(itertools.combinations(MODES, 2))


@pytest.fixture
def outbox(direct_url: str, pgbouncer_url: str) -> Iterator[tuple[OutboxDb, OutboxDb]]:
    """This test's tables, seen directly and through PgBouncer (transaction mode)."""
    prefix = table_prefix()
    events = events_table(prefix)
    with prefixed_database(direct_url, "PostgreSQL", events.metadata, prefix=prefix) as shared:
        pooled = create_engine(pgbouncer_url)
        try:
            yield (
                OutboxDb(url=direct_url, engine=shared.engine, prefix=prefix, events=events),
                OutboxDb(url=pgbouncer_url, engine=pooled, prefix=prefix, events=events),
            )
        finally:
            pooled.dispose()


@pytest.mark.parametrize("modes", PAIRS, ids=["+".join(pair) for pair in PAIRS])
def test_two_relays_of_different_modes_publish_each_row_once_in_key_order(
    modes: tuple[str, str], outbox: Any, rabbit: RabbitAdmin, rabbitmq_url: str
) -> None:
    direct, pooled = outbox
    result = run_pair(
        modes,
        direct=direct,
        pooled=pooled,
        rabbit=rabbit,
        rabbitmq_url=rabbitmq_url,
        keys=KEYS,
        per_key=PER_KEY,
        log=print,
    )
    assert result.published == result.rows
    assert result.doubled == 0, result.line()
    assert result.order_problems == 0, result.line()


ROLLING = [*PAIRS, *((b, a) for a, b in PAIRS)]


@pytest.mark.parametrize("modes", ROLLING, ids=["->".join(pair) for pair in ROLLING])
def test_a_rolling_switch_between_modes_under_load_publishes_each_row_once_in_key_order(
    modes: tuple[str, str], outbox: Any, rabbit: RabbitAdmin, rabbitmq_url: str
) -> None:
    direct, pooled = outbox
    result = run_pair(
        modes,
        direct=direct,
        pooled=pooled,
        rabbit=rabbit,
        rabbitmq_url=rabbitmq_url,
        keys=KEYS,
        per_key=PER_KEY,
        rolling=True,
        log=print,
    )
    assert result.published == result.rows
    assert result.doubled == 0, result.line()
    assert result.order_problems == 0, result.line()


def test_the_turn_taking_claim_yields_to_a_session_relay_and_leases_every_shard(
    outbox: Any,
) -> None:
    """The protocol itself, statement by statement, on the real database."""
    direct, pooled = outbox
    with Session(pooled.engine) as session, session.begin():
        writer = OutboxWriter(session, prefix=direct.prefix)
        for n in range(10):
            writer.publish({"n": n}, topic="t", key=f"k{n}")
    store = OutboxStore(direct.prefix)
    turns = lock_class(store.table.name, "turns")

    def claim(relay_id: str) -> list[Any] | None:
        return store.claim_in_turn(
            pooled.engine,
            relay_id,
            100,
            timedelta(seconds=30),
            brokers=["kafka"],
            lock_class=turns,
        )

    session_relay = create_coordinator(
        direct.engine,
        table_name=store.table.name,
        channel=store.channel,
        shards=4,
        fingerprint="kafka",
    )
    assert session_relay is not None
    session_relay.open()
    try:
        assert claim("taking-turns") is None, "claimed beside a session relay"
    finally:
        session_relay.close()
    claimed = claim("taking-turns")
    assert claimed is not None and len(claimed) == 10
    # A session relay arriving now waits for that lease on every one of its shards.
    takeover = LeaseTakeover(direct.engine, store, "session")
    assert takeover.claimable({0, 1, 2, 3}) == set()
    store.end_lease(pooled.engine, "taking-turns")
    assert takeover.claimable({0, 1, 2, 3}) == {0, 1, 2, 3}
    # Nothing held after close: the next turn-taking claim is free again.
    assert claim("taking-turns") == claimed

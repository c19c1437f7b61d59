"""A SQLite consumer with a batch larger than SQLite's parameter limit (issue #39).

SQLite allows 32,766 bound parameters per statement by default (Debian's build raises
it to 250,000: the test sets the default on its connections) and a claim row binds 3,
so a batch of more than 10,922 messages crashed the worker ("too many SQL variables")
before the claim was split. With ``batch_size = 100_000``, 12,000 messages and a copy of
each come as one batch: every message is processed once, every copy is a duplicate.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event

from mqdedup import InMemoryBroker, run_until_idle
from mqdedup.db.engine import create_engine
from tests.support import BulkOrderConsumer, order_counts, reset_database

MESSAGES = 12_000
SQLITE_DEFAULT_LIMIT = 32_766


def default_parameter_limit(engine: Engine) -> Engine:
    """``engine`` whose connections allow SQLite's default number of parameters."""

    def limit(connection: Any, _record: Any) -> None:
        connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, SQLITE_DEFAULT_LIMIT)

    event.listen(engine, "connect", limit)
    return engine


@pytest.fixture
def limited_sqlite(tmp_path: Path) -> Iterator[Engine]:
    engine = default_parameter_limit(create_engine(f"sqlite:///{tmp_path / 'large.db'}"))
    reset_database(engine)
    yield engine
    engine.dispose()


class HugeBatches(BulkOrderConsumer):
    batch_size = 100_000


def test_a_sqlite_batch_over_the_parameter_limit_is_processed(limited_sqlite: Engine) -> None:
    broker = InMemoryBroker()
    for _ in range(2):  # the second copy of each message: a duplicate
        for number in range(MESSAGES):
            broker.publish("orders", json.dumps({"order": number}), message_id=f"m{number}")

    metrics = run_until_idle(HugeBatches(), broker.transport("orders"), limited_sqlite)

    counts = order_counts(limited_sqlite)
    assert len(counts) == MESSAGES and set(counts.values()) == {1}
    assert (metrics.processed, metrics.duplicates) == (MESSAGES, MESSAGES)
    assert broker.pending("orders") == 0 and broker.settled_count["orders"] == 2 * MESSAGES

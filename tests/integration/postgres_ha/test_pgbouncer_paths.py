"""Everything else of a worker's and an operator's path through PgBouncer in transaction
pooling mode (issue 30, item 1).

* The differential suite (``tests/differential.py``) through PgBouncer: generated handler
  programs in every ``failure_isolation`` (savepoints, reruns, one transaction per
  message), with ``handle`` and ``handle_batch``, ``ctx.stage``, retries and dead letters
  in the dead-letter table, must end exactly as the same statements run by hand. Every
  statement shape runs far more than psycopg's 5 times before it would prepare it.
* ``mqdedup replay`` and the admin commands with a PgBouncer URL: no error, no
  traceback, the replay's effects once.
"""

from __future__ import annotations

import os
import random
import subprocess
from collections.abc import Iterator

import pytest
from hypothesis import given
from sqlalchemy import Engine

from mqdedup.cli.main import main
from tests import differential
from tests.differential import Scenario, Tables
from tests.integration.postgres_ha.support import MQDEDUP, order_counts, with_duplicates
from tests.services import (
    REPO,
    KafkaHelper,
    Outgoing,
    TestDatabase,
    checked_engine,
    prefixed_database,
    table_prefix,
)
from tests.support import orders_table

pytestmark = pytest.mark.integration
EXAMPLES = 6


@pytest.fixture(scope="module")
def pooled_differential(pgbouncer_url: str) -> Iterator[tuple[Engine, Tables]]:
    """This module's framework and business tables, reached through PgBouncer."""
    engine = checked_engine(pgbouncer_url, "PgBouncer")
    prefix = table_prefix()
    tables = differential.create_tables(engine, prefix)
    try:
        yield engine, tables
    finally:
        differential.drop_tables(engine, prefix)
        engine.dispose()


@pytest.mark.parametrize("isolation", differential.ISOLATIONS)
@differential.hypothesis_settings(EXAMPLES)
@given(scenario=differential.SCENARIOS)
def test_handler_programs_end_as_the_reference_through_pgbouncer(
    pooled_differential: tuple[Engine, Tables], isolation: str, scenario: Scenario
) -> None:
    engine, tables = pooled_differential
    differential.assert_matches(engine, tables, scenario, isolation)


@pytest.fixture
def orders_db(direct_url: str) -> Iterator[TestDatabase]:
    prefix = table_prefix()
    orders = orders_table(prefix)
    with prefixed_database(direct_url, "PostgreSQL", orders.metadata, prefix=prefix) as db:
        yield db


def mqdedup(*arguments: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [MQDEDUP, *arguments],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        timeout=120,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, (arguments, output)
    assert "Traceback" not in output and "prepared statement" not in output, output
    return output


def test_replay_and_admin_commands_through_pgbouncer(
    pgbouncer_url: str,
    orders_db: TestDatabase,
    kafka_helper: KafkaHelper,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = kafka_helper.create_topic(partitions=2, kind="pgbouncer-replay")
    ids = with_duplicates(random.Random(303), 600, 0.3, "p")
    kafka_helper.produce(topic, [Outgoing(message_id, b"{}") for message_id in ids])
    env = {
        **os.environ,
        "MQDEDUP_DATABASE_URL": pgbouncer_url,
        "MQDEDUP_TABLE_PREFIX": orders_db.prefix,
        "MQDEDUP_KAFKA_BOOTSTRAP": kafka_helper.bootstrap,
        "HA_PREFIX": orders_db.prefix,
        "HA_TOPIC": topic,
        "HA_GROUP": f"group-{topic}",
    }
    consumer = "tests.integration.postgres_ha.consumers:KafkaOrders"
    mqdedup("replay", consumer, env=env)
    counts = order_counts(orders_db.engine, orders_db.prefix)
    assert set(counts) == set(ids) and set(counts.values()) == {1}
    # The admin commands in this process (the same ``main`` as the console script).
    options = ["--database", pgbouncer_url, "--table-prefix", orders_db.prefix]
    for command in (
        ["db", "upgrade"],
        ["db", "check"],
        ["dedup", "stats"],
        ["dedup", "purge", "--older-than", "30d", "--yes"],
        ["outbox", "status"],
        ["outbox", "retry-failed"],
        ["outbox", "purge", "--older-than", "7d"],
        ["dead-letters", "list"],
    ):
        assert main([*command, *options]) == 0, command
    output = capsys.readouterr()
    assert "prepared statement" not in output.out + output.err

"""The relay and workers through PgBouncer in SESSION pooling mode, and a pooler declared
wrongly (issue 40, part 2).

* ``mqdedup relay`` and ``mqdedup worker`` with a session-mode PgBouncer's URL (the
  pooler found, or declared ``?pooler=session``): 3,000 outbox rows written through it
  by three writers go out through a fanout exchange to the worker's queue and to an
  audit queue. Every row must be published once, in key order, and applied once.
  Before the fix the relay took a found pooler for a transaction pooler and refused to
  start; declared, it compared the pid PgBouncer announced at login with ``pg_locks``
  and published nothing (0 of 3,000).
* ``?pooler=session`` on the transaction-mode PgBouncer: the relay is refused at start in
  one line, and no session setting or advisory lock reaches the pool's other clients.
  Before the fix it ran, published nothing, and left ``synchronous_commit = off`` (and
  the planner settings) and its advisory locks on pooled server connections.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from mqdedup.db import create_engine
from mqdedup.errors import ConfigurationError
from mqdedup.outbox import Relay, RelayConfig
from mqdedup.outbox.coordination import lock_class
from mqdedup.outbox.store import OutboxStore
from mqdedup.rabbitmq import RabbitMQPublisher
from tests.integration.outbox.helpers import (
    OutboxDb,
    events_table,
    order_problems,
    poll_until,
    write_keyed_rows,
)
from tests.integration.postgres_ha.support import MQDEDUP, MqdedupWorker, order_counts
from tests.integration.rabbitmq.support import make_consumer
from tests.services import (
    REPO,
    RabbitAdmin,
    TestDatabase,
    prefixed_database,
    table_prefix,
    unique_name,
)
from tests.support import orders_table

pytestmark = [pytest.mark.integration, pytest.mark.slow]
KEYS, PER_KEY = 60, 50  # 3,000 rows
CLIENTS = 6
SETTINGS = ("synchronous_commit", "enable_sort", "jit")


@pytest.fixture
def database(direct_url: str) -> Iterator[TestDatabase]:
    """This test's tables in the shared PostgreSQL, made directly."""
    prefix = table_prefix()
    with prefixed_database(
        direct_url, "PostgreSQL", orders_table(prefix).metadata, prefix=prefix
    ) as made:
        yield made


@pytest.mark.parametrize("declared", ["", "?pooler=session"], ids=["found", "declared"])
def test_relay_and_worker_through_a_session_pooler_publish_and_apply_each_row_once(
    declared: str,
    pgbouncer_session_url: str,
    direct_url: str,
    database: TestDatabase,
    rabbit: RabbitAdmin,
    rabbitmq_url: str,
    tmp_path: Path,
) -> None:
    prefix = database.prefix
    queue, exchange = unique_name("session-pooler"), unique_name("session-fanout")
    rabbit.declare(make_consumer(queue, prefix, rabbitmq_url)())
    audit = rabbit.queue("audit")
    channel = rabbit.channel()
    channel.exchange_declare(exchange, exchange_type="fanout", durable=True)
    channel.queue_bind(queue, exchange)
    channel.queue_bind(audit, exchange)
    env = {
        **os.environ,
        "MQDEDUP_DATABASE_URL": pgbouncer_session_url + declared,
        "MQDEDUP_TABLE_PREFIX": prefix,
        "MQDEDUP_RABBITMQ_URL": rabbitmq_url,
        "HA_PREFIX": prefix,
        "HA_QUEUE": queue,
    }
    pooled = create_engine(pgbouncer_session_url)
    relay = MqdedupWorker(None, env, tmp_path / "relay.log")
    worker = MqdedupWorker(
        "tests.integration.postgres_ha.consumers:RabbitOrders", env, tmp_path / "worker.log"
    )
    written: dict[str, list[str]] = {}
    try:
        writer = threading.Thread(
            target=lambda: written.update(
                write_keyed_rows(
                    OutboxDb(
                        url=pgbouncer_session_url,
                        engine=pooled,
                        prefix=prefix,
                        events=events_table(prefix),
                    ),
                    {"exchange": exchange, "routing_key": ""},
                    keys=KEYS,
                    per_key=PER_KEY,
                    threads=3,
                )
            )
        )
        writer.start()
        writer.join(timeout=300)
        every = {message_id for ids in written.values() for message_id in ids}
        assert len(every) == KEYS * PER_KEY

        def done() -> bool:
            relay.ensure_alive()
            worker.ensure_alive()
            return (
                OutboxStore(prefix).status(database.engine).pending == 0
                and len(order_counts(database.engine, prefix)) >= len(every)
                and rabbit.depth(queue) == 0
            )

        poll_until(done, 180, "every row published and applied")
    finally:
        codes = (relay.stop(), worker.stop())
        pooled.dispose()
    assert codes == (0, 0), relay.tail() + worker.tail()
    assert _held_locks(direct_url, prefix) == 0, "the stopped relay left advisory locks"
    messages = rabbit.drain(audit, len(every))
    copies = Counter(str(properties.message_id) for properties, _ in messages)
    sequence = [(body["key"], body["seq"]) for body in (json.loads(b) for _, b in messages)]
    effects = order_counts(database.engine, prefix)
    lost = every - set(copies)
    doubled = [message_id for message_id, count in copies.items() if count > 1]
    print(  # the figure the closing note quotes (pytest -s)
        f"\n[session-mode PgBouncer{declared}] {len(every)} rows: "
        f"{len(set(copies) & every)} published, "
        f"{len(lost)} lost, {len(doubled)} doubled; {len(effects)} applied, "
        f"{sum(1 for n in effects.values() if n > 1)} applied twice"
    )
    assert not lost and not doubled
    assert order_problems(sequence) == []
    assert set(effects) == every and set(effects.values()) == {1}
    rabbit.delete(exchange)


def _leaks(pooled_url: str, direct_url: str, prefix: str) -> tuple[list[str], int]:
    """What ``CLIENTS`` other clients of the pool read (settings that are not the server's
    defaults), and the advisory locks of the table's relay lock classes still held."""
    engine = create_engine(pooled_url, pool_size=CLIENTS)
    odd: list[str] = []
    try:
        connections = [engine.connect() for _ in range(CLIENTS)]
        try:
            for connection in connections:
                for setting in SETTINGS:
                    value = connection.execute(text(f"SHOW {setting}")).scalar_one()
                    if value == "off":
                        odd.append(f"{setting}={value}")
        finally:  # each kept its transaction (its server connection) open until here
            for connection in connections:
                connection.close()
    finally:
        engine.dispose()
    return odd, _held_locks(direct_url, prefix)


def _held_locks(direct_url: str, prefix: str) -> int:
    """Advisory locks of the table's relay lock classes held by any server connection."""
    table = OutboxStore(prefix).table.name
    classes = [lock_class(table, purpose) for purpose in ("shards", "members", "config", "turns")]
    direct = create_engine(direct_url)
    try:
        with direct.connect() as connection:
            held = connection.execute(
                text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                    "AND classid::bigint = ANY(:classes)"
                ),
                {"classes": classes},
            ).scalar_one()
    finally:
        direct.dispose()
    return int(held)


def test_a_session_pooler_declared_on_a_transaction_pooler_is_refused_and_leaks_nothing(
    pgbouncer_url: str, direct_url: str, database: TestDatabase, rabbitmq_url: str
) -> None:
    misdeclared = f"{pgbouncer_url}?pooler=session"
    prefix = database.prefix
    # The shared pool as found (another test's leak would show here, not be ours).
    odd_before, _ = _leaks(pgbouncer_url, direct_url, prefix)
    process = subprocess.Popen(
        [
            MQDEDUP,
            "relay",
            "--database",
            misdeclared,
            "--table-prefix",
            prefix,
            "--rabbitmq-url",
            rabbitmq_url,
            "--health-port",
            "0",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, stderr = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # it runs: what does it leave to the others?
        odd, held = _leaks(pgbouncer_url, direct_url, prefix)
        process.terminate()
        process.communicate(timeout=60)
        raise AssertionError(
            f"relay not refused; {len(odd)} odd settings seen by {CLIENTS} other clients "
            f"({odd[:6]}), {held} advisory locks held"
        ) from None
    assert process.returncode != 0
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "pooler=session" in lines[0] and "mqdedup:mqdedup@" not in lines[0]

    # The library refuses too, and leaves nothing behind.
    relay = Relay(
        create_engine(misdeclared),
        {"rabbitmq": RabbitMQPublisher(rabbitmq_url)},
        prefix=prefix,
        config=RelayConfig(poll_interval=0.1),
    )
    with pytest.raises(ConfigurationError, match="pooler=session"):
        relay.run(until_idle=True)
    relay.engine.dispose()
    odd, held = _leaks(pgbouncer_url, direct_url, prefix)
    assert held == 0, "advisory locks left behind"
    assert len(odd) <= len(odd_before), f"session settings reached other clients: {odd}"

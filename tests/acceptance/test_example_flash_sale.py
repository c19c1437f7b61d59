"""``examples/flash_sale`` runs as its README says, against PostgreSQL and RabbitMQ.

In process: 30 buyers for 10 units, every fifth submitting its form twice, with each
stock strategy (the conditional decrement and the fenced lock): 20 orders, nothing
oversold, each second submit answered "already submitted". End to end: the README's
setup, rush, ``mqdedup relay`` and ``mqdedup worker``, with the fake payment API in the
test's process: every placed order is charged once (the gateway's ledger), paid, and
has its ``order paid`` event; the report finds nothing done twice.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pika
import pytest
from sqlalchemy import MetaData, func, select

from examples.flash_sale import config
from examples.flash_sale.gateway import PaymentServer
from examples.flash_sale.shop import Answer, Placed, Shop
from mqdedup.db import create_engine
from mqdedup.db.schema import schema
from mqdedup.locks import PostgresLock
from tests.acceptance.test_examples import run, scalar, start, stop
from tests.services import REPO, wait_for

pytestmark = [pytest.mark.integration]
STOCK = 10
BUYERS = 30


@pytest.fixture
def sale_env(pg_url: str, rabbitmq_url: str) -> Iterator[dict[str, str]]:
    tag = uuid.uuid4().hex[:8]
    env = {
        "PYTHONPATH": str(REPO),
        "MQDEDUP_DATABASE_URL": pg_url,
        "MQDEDUP_RABBITMQ_URL": rabbitmq_url,
        "MQDEDUP_TABLE_PREFIX": f"fs_{tag}_",
        "EXAMPLE_TABLE_PREFIX": f"fs_{tag}_",
        "FLASH_SALE_QUEUE": f"fs-orders-{tag}",
        "FLASH_SALE_EVENTS_QUEUE": f"fs-events-{tag}",
    }
    yield {**os.environ, **env}
    engine = create_engine(pg_url)
    metadata = MetaData()
    metadata.reflect(engine, only=lambda name, _: name.startswith(env["EXAMPLE_TABLE_PREFIX"]))
    metadata.drop_all(engine)
    engine.dispose()
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    try:
        channel = connection.channel()
        for queue in (env["FLASH_SALE_QUEUE"], f"{env['FLASH_SALE_QUEUE']}.dlq"):
            channel.queue_delete(queue)
        channel.queue_delete(env["FLASH_SALE_EVENTS_QUEUE"])
    finally:
        connection.close()


@pytest.fixture
def in_process(sale_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The example's settings read from ``sale_env`` in this process too."""
    for name in ("MQDEDUP_TABLE_PREFIX", "EXAMPLE_TABLE_PREFIX", "FLASH_SALE_QUEUE"):
        monkeypatch.setenv(name, sale_env[name])
    config.tables.cache_clear()
    config.order_flow.cache_clear()
    yield
    config.tables.cache_clear()
    config.order_flow.cache_clear()


@pytest.mark.parametrize("strategy", ["conditional", "lock"])
@pytest.mark.usefixtures("in_process")
def test_thirty_buyers_for_ten_units_with_each_strategy(
    sale_env: dict[str, str], strategy: str
) -> None:
    run("-m", "examples.flash_sale.setup", "--stock", str(STOCK), env=sale_env)
    engine = create_engine(sale_env["MQDEDUP_DATABASE_URL"])
    shop = Shop(engine, strategy=strategy)
    prefix = sale_env["MQDEDUP_TABLE_PREFIX"]

    def buy(number: int) -> list[Answer]:
        user, lock = f"user-{number}", None
        if strategy == "lock":
            lock = PostgresLock(engine, "stock:tee", ttl=10, prefix=prefix, poll_interval=0.01)
        form = shop.open_form(user)
        return [
            shop.place_order(user, form, "tee", 1, lock) for _ in range(2 if number % 5 == 0 else 1)
        ]

    with ThreadPoolExecutor(8) as pool:
        answers = [a for answers in pool.map(buy, range(BUYERS)) for a in answers]

    told = Counter(answer.outcome for answer in answers)
    assert told == {
        Placed.PLACED: STOCK,
        Placed.SOLD_OUT: BUYERS - STOCK,
        Placed.RESUBMITTED: BUYERS // 5,
    }
    stock, orders = config.tables()
    assert scalar(engine, f"SELECT available FROM {stock.name}") == 0
    assert scalar(engine, f"SELECT count(*) FROM {orders.name}") == STOCK
    with engine.connect() as connection:
        outbox = schema(prefix).outbox
        placed = connection.execute(select(func.count()).select_from(outbox)).scalar_one()
    assert placed == STOCK  # one "order placed" message per order
    engine.dispose()


def test_the_sale_runs_end_to_end_and_each_order_is_charged_once(
    sale_env: dict[str, str], tmp_path: Path
) -> None:
    units, buyers = 20, 50
    with PaymentServer() as gateway:
        env = {**sale_env, "FLASH_SALE_GATEWAY": gateway.url}
        run("-m", "examples.flash_sale.setup", "--stock", str(units), env=env)
        rush = run("-m", "examples.flash_sale.rush", "--buyers", str(buyers), env=env)
        assert f"'placed': {units}" in rush and f"'sold out': {buyers - units}" in rush
        logs = {name: tmp_path / f"{name}.log" for name in ("relay", "worker")}
        processes = {
            "relay": start("relay", env=env, log=logs["relay"]),
            "worker": start(
                "worker", "examples.flash_sale.consumer:SalePayments", env=env, log=logs["worker"]
            ),
        }
        orders = f"{env['EXAMPLE_TABLE_PREFIX']}sale_orders"
        outbox = schema(env["MQDEDUP_TABLE_PREFIX"]).outbox.name
        engine = create_engine(env["MQDEDUP_DATABASE_URL"])
        try:
            wait_for(
                functools.partial(
                    lambda: (
                        scalar(engine, f"SELECT count(*) FROM {orders} WHERE status = 'PAID'")
                        == units
                        and scalar(engine, f"SELECT count(*) FROM {outbox} WHERE state = 'pending'")
                        == 0
                    )
                ),
                timeout=60,
                what="every order paid and every event published",
                interval=0.5,
            )
        finally:
            for name, process in processes.items():
                stop(process, logs[name])
        engine.dispose()
        charged = gateway.ledger.charges_per_order()
    assert len(charged) == units and set(charged.values()) == {1}
    report = run("-m", "examples.flash_sale.report", env=env)
    assert f"{units} sold" in report and "(0 charged twice)" in report
    assert f"order paid events   {units} on" in report and "units sold twice    0" in report

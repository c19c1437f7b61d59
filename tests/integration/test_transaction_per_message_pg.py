"""``failure_isolation = "transaction"`` on real PostgreSQL and a real RabbitMQ.

One transaction per message, one settle per batch: a worker process killed with
``kill -9`` in the middle of a batch leaves that batch's first messages committed and
unacked. The broker redelivers them; the next worker skips them as duplicates, so every
message's effect exists exactly once.

The module doubles as the worker process: ``python -m
tests.integration.test_transaction_per_message_pg '<json config>'``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, Table, insert

from mqdedup import Message, create_engine
from mqdedup.consumers.context import Context
from mqdedup.stopping import StopToken
from tests.integration.rabbitmq.support import claims, make_consumer, order_counts
from tests.services import REPO, RabbitAdmin, prefixed_database, table_prefix, wait_for
from tests.support import orders_table

pytestmark = pytest.mark.integration

UNIQUE = 600
COPIES = 200
BATCH = 100
#: The handler of this message holds (as if working) until the process is killed.
HOLD_ID = "t000150"


def consumer_class(config: dict[str, Any]) -> Any:
    """The test consumer: one row per message, one transaction per message."""
    hold = config.get("hold_id")
    marker = Path(config["marker"]) if config.get("marker") else None

    def before_write(message: Message) -> None:
        if message.id == hold and marker is not None:
            marker.write_text(str(os.getpid()))
            time.sleep(120)  # the test kills this process long before

    base = make_consumer(
        config["queue"],
        config["prefix"],
        config["url"],
        batch_size=BATCH,
        prefetch=BATCH,
        failure_isolation="transaction",
        before_write=before_write if hold else None,
    )

    class BothStyles(base):  # type: ignore[valid-type,misc]
        """Even ids: the row as parameters of a plain ``insert(orders)``, sent with the
        commit and the next message's claim (consumers/lean_transactions.py); odd ids:
        ``insert(orders).values(...)``, written through SQLAlchemy before that query."""

        def handle(self, message: Message, ctx: Context) -> Any:
            assert message.id is not None
            self.calls[message.id] += 1
            if self.before_write is not None:
                self.before_write(message)
            row = {"message_id": message.id, "body": message.text()[:2000]}
            if int(message.id[1:]) % 2:
                ctx.session.execute(insert(self.orders).values(**row))
            else:
                ctx.session.execute(insert(self.orders), row)

    return BothStyles


def worker_main() -> None:
    """The worker process: consume until killed."""
    config: dict[str, Any] = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    consumer = consumer_class(config)()
    consumer.run(create_engine(config["database_url"]), stop=StopToken())


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture
def tables(pg_url: str) -> Iterator[tuple[Engine, str, Table]]:
    prefix = table_prefix()
    orders = orders_table(prefix)
    with prefixed_database(pg_url, "PostgreSQL", orders.metadata, prefix=prefix) as db:
        yield db.engine, prefix, orders


# -- the test ------------------------------------------------------------------------------


def test_kill_9_mid_batch_then_redelivery_leaves_each_effect_once(
    rabbitmq_url: str, pg_url: str, tables: tuple[Engine, str, Table], tmp_path: Path
) -> None:
    engine, prefix, orders = tables
    queue = f"mqdedup-tpm-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "holding"
    config = {
        "queue": queue,
        "prefix": prefix,
        "url": rabbitmq_url,
        "database_url": pg_url,
        "hold_id": HOLD_ID,
        "marker": str(marker),
    }
    admin = RabbitAdmin(rabbitmq_url)
    admin.declare(consumer_class(config)())
    # 600 unique ids, then 200 copies of earlier ones (published after the kill point,
    # so every delivery before the kill is a first copy).
    ids = [f"t{number:06d}" for number in range(UNIQUE)]
    copies = [ids[(number * 7) % UNIQUE] for number in range(COPIES)]
    admin.publish(queue, ids + copies)
    worker = "tests.integration.test_transaction_per_message_pg"
    process = subprocess.Popen(
        [sys.executable, "-m", worker, json.dumps(config)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(marker.exists, 120, "the worker to reach the held message")
        committed_at_kill = set(order_counts(engine, orders))
        process.kill()  # kill -9 with the batch half done
        process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    # Settled: whole batches only. Committed: those plus the held batch's first messages.
    wait_for(
        lambda: admin.depth(queue) + len(committed_at_kill) > UNIQUE + COPIES - 1,
        60,
        "the broker to requeue the killed worker's unacked deliveries",
    )
    redelivered = admin.depth(queue)
    acked = UNIQUE + COPIES - redelivered
    assert acked < len(committed_at_kill)  # settled only after all of a batch's commits
    assert set(ids[:acked]) <= committed_at_kill  # and never before its own commit
    assert HOLD_ID not in committed_at_kill  # its transaction died with the process
    committed_unacked = len(committed_at_kill) - acked

    # A second worker finishes the queue: the committed-but-unacked ones are duplicates.
    consumer = consumer_class({**config, "hold_id": None})()
    stop = StopToken()
    result: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: result.update(metrics=consumer.run(engine, stop=stop)), daemon=True
    )
    thread.start()
    try:
        wait_for(
            lambda: sum(consumer.calls.values()) + len(consumer.duplicate_ids) >= redelivered,
            180,
            "the second worker to go through every redelivered message",
        )
    finally:
        stop.request()
        thread.join(60)
    assert not thread.is_alive()
    metrics = result["metrics"]

    counts = order_counts(engine, orders)
    assert set(counts) == set(ids) and set(counts.values()) == {1}
    assert claims(engine, prefix, consumer.consumer_name) == set(ids)
    assert metrics.processed == UNIQUE - len(committed_at_kill)
    assert metrics.duplicates == COPIES + committed_unacked
    assert committed_at_kill - set(ids[:acked]) <= set(consumer.duplicate_ids)
    assert admin.depth(queue) == 0 and admin.depth(f"{queue}.dlq") == 0
    admin.delete(queue, f"{queue}.dlq")
    admin.close()


if __name__ == "__main__":
    worker_main()

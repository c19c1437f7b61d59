"""``mqdedup worker`` through PgBouncer in transaction pooling mode, killed with ``kill -9``
twice, on the shared Kafka and RabbitMQ side by side (issue 30, item 1).

3,000 messages per broker, 30% of them duplicates (the same message id again, later).
Each broker has one real ``mqdedup worker`` whose database URL is PgBouncer's (Kafka: the
pooler found by the worker itself; RabbitMQ: declared with ``?pooler=transaction``); its
worker process is killed with ``kill -9`` at a third and at two thirds of the run, and
its supervisor starts a new one each time, as a pod's restart would. Every transaction
may land on another server connection, so psycopg's prepared statements must be off
(else ``_pg3_0 already exists``); messages redelivered after a kill run in careful mode,
through PgBouncer too. Every message's
effect must be there exactly once, with the Kafka offsets at the end of the topic and the
RabbitMQ queue empty.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from mqdedup.db.schema import schema
from tests.integration.postgres_ha.support import (
    MqdedupWorker,
    order_counts,
    total_orders,
    with_duplicates,
)
from tests.integration.rabbitmq.support import make_consumer
from tests.services import (
    KAFKA_SESSION_TIMEOUT_ENV,
    KafkaHelper,
    Outgoing,
    RabbitAdmin,
    TestDatabase,
    kill_session_timeout_ms,
    prefixed_database,
    table_prefix,
    unique_name,
    wait_for,
)
from tests.support import orders_table

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MESSAGES = 3_000
KILLS = 2


class Run:
    """One broker's messages, tables and the ``mqdedup worker`` of the moment."""

    consumer = ""

    def __init__(self, name: str, database: TestDatabase, env: dict[str, str], logs: Path):
        self.name, self.database, self.env, self.logs = name, database, env, logs
        self.ids: list[str] = []
        self.kills_at: list[int] = []
        self.killed: list[int] = []
        self.worker: MqdedupWorker | None = None

    @property
    def unique(self) -> set[str]:
        return set(self.ids)

    def start(self) -> None:
        log = self.logs / f"{self.name}.log"
        self.worker = MqdedupWorker(self.consumer, self.env, log)

    def rows(self) -> int:
        return total_orders(self.database.engine, self.database.prefix)

    def step(self) -> None:
        """``kill -9`` of the worker process at the next third of the run (its supervisor
        starts a new one, as a pod's restart would)."""
        assert self.worker is not None
        self.worker.ensure_alive()
        if len(self.kills_at) < KILLS:
            rows = self.rows()
            if rows >= len(self.unique) * (len(self.kills_at) + 1) // (KILLS + 1):
                self.killed.append(self.worker.kill_9_child())
                self.kills_at.append(rows)

    def drained(self) -> bool:
        raise NotImplementedError

    def done(self) -> bool:
        """Both kills made, everything processed and settled, the last worker ready."""
        self.step()
        assert self.worker is not None
        return (
            len(self.kills_at) == KILLS
            and self.drained()
            and self.worker.restarted(self.killed[-1])
        )

    def stop(self) -> int:
        return 0 if self.worker is None else self.worker.stop()

    def claims(self) -> int:
        table = schema(self.database.prefix).processed
        with self.database.engine.connect() as connection:
            return int(connection.execute(select(func.count()).select_from(table)).scalar_one())


class KafkaRun(Run):
    consumer = "tests.integration.postgres_ha.consumers:KafkaOrders"

    def __init__(self, kafka: KafkaHelper, *args: Any) -> None:
        super().__init__("kafka", *args)
        self.kafka = kafka
        self.topic = kafka.create_topic(partitions=3, kind="pgbouncer")
        self.group = f"group-{self.topic}"
        rng = random.Random(301)
        self.ids = with_duplicates(rng, MESSAGES, 0.3, "k")
        kafka.produce(
            self.topic, [Outgoing(i, b"{}", partition=rng.randrange(3)) for i in self.ids]
        )
        self.env.update(
            HA_TOPIC=self.topic,
            HA_GROUP=self.group,
            MQDEDUP_KAFKA_BOOTSTRAP=kafka.bootstrap,
            **{KAFKA_SESSION_TIMEOUT_ENV: str(kill_session_timeout_ms(kafka.bootstrap))},
        )

    def drained(self) -> bool:
        return self.rows() >= len(self.unique) and self.kafka.committed(
            self.group, self.topic
        ) == self.kafka.end_offsets(self.topic)


class RabbitRun(Run):
    consumer = "tests.integration.postgres_ha.consumers:RabbitOrders"

    def __init__(self, rabbitmq_url: str, *args: Any) -> None:
        super().__init__("rabbitmq", *args)
        self.queue = unique_name("pgbouncer")
        self.admin = RabbitAdmin(rabbitmq_url)
        self.admin.declare(make_consumer(self.queue, self.database.prefix, rabbitmq_url)())
        self.ids = with_duplicates(random.Random(302), MESSAGES, 0.3, "r")
        self.admin.publish(
            self.queue, self.ids, body=lambda message_id: json.dumps({"id": message_id}).encode()
        )
        self.env.update(HA_QUEUE=self.queue, MQDEDUP_RABBITMQ_URL=rabbitmq_url)
        self.env["MQDEDUP_DATABASE_URL"] += "?pooler=transaction"

    def drained(self) -> bool:
        return self.rows() >= len(self.unique) and self.admin.depth(self.queue) == 0

    def cleanup(self) -> None:
        self.admin.delete(self.queue, f"{self.queue}.dlq")
        self.admin.close()


@pytest.fixture
def database(direct_url: str) -> Iterator[Any]:
    """A fresh table set per call in the shared PostgreSQL (made directly, not pooled)."""
    with contextlib.ExitStack() as stack:

        def make() -> TestDatabase:
            prefix = table_prefix()
            orders = orders_table(prefix)
            return stack.enter_context(
                prefixed_database(direct_url, "PostgreSQL", orders.metadata, prefix=prefix)
            )

        yield make


def worker_env(pgbouncer_url: str, database: TestDatabase) -> dict[str, str]:
    return {
        **os.environ,
        "MQDEDUP_DATABASE_URL": pgbouncer_url,
        "HA_PREFIX": database.prefix,
        "HA_PAUSE": "0.05",
    }


def test_workers_through_pgbouncer_killed_twice_apply_every_message_once(
    pgbouncer_url: str,
    database: Any,
    kafka_helper: KafkaHelper,
    rabbitmq_url: str,
    tmp_path: Path,
) -> None:
    kafka_db, rabbit_db = database(), database()
    runs: list[Run] = [
        KafkaRun(kafka_helper, kafka_db, worker_env(pgbouncer_url, kafka_db), tmp_path),
        RabbitRun(rabbitmq_url, rabbit_db, worker_env(pgbouncer_url, rabbit_db), tmp_path),
    ]
    try:
        started = time.monotonic()
        for run in runs:
            run.start()
        wait_for(lambda: all([run.done() for run in runs]), 240, "both runs through two kills")
        print(f"\n[pgbouncer] both runs done after {time.monotonic() - started:.1f} s")
        codes = {run.name: run.stop() for run in runs}
    finally:
        for run in runs:
            run.stop()
        runs[1].cleanup()  # type: ignore[attr-defined]
    for run in runs:
        assert codes[run.name] == 0, (run.name, run.worker.tail() if run.worker else "")
        counts = order_counts(run.database.engine, run.database.prefix)
        unique = len(run.unique)
        assert len(run.ids) == MESSAGES and unique < MESSAGES * 0.75, run.name
        assert all(rows < unique for rows in run.kills_at), (run.name, run.kills_at, unique)
        assert set(counts) == run.unique, (run.name, len(counts), unique)
        assert set(counts.values()) == {1}, f"{run.name}: a message's effect twice"
        assert run.claims() == unique, run.name
        logs = "".join(path.read_text(errors="replace") for path in tmp_path.glob("*.log"))
        assert "prepared statement" not in logs
        print(  # the figure the closing note quotes (pytest -s)
            f"\n[pgbouncer {run.name}] {MESSAGES} messages ({unique} unique), kill -9 at "
            f"{run.kills_at} rows, {len(counts)} effects, each once"
        )

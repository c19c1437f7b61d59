"""Subscribing by ``topic_pattern`` with the cooperative-sticky assignor (KIP-429).

With cooperative rebalancing a member keeps the partitions it is not asked to give up:
``_partitions_assigned`` gets only the *added* partitions and kept ones must keep their
in-flight state. A worker joining and one leaving mid-run must still leave exactly one
row per unique message over every topic the pattern matches, and commit the ends.
"""

from __future__ import annotations

import random
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from mqdedup import Metrics, StopToken
from tests.integration.kafka.consumers import make_consumer
from tests.integration.kafka.helpers import WorkerProcess, row_counts, total_rows
from tests.services import KafkaHelper, Outgoing, TestDatabase, unique_name, wait_for
from tests.support import orders_table

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_cooperative_sticky_rebalances_over_a_topic_pattern(
    kafka_helper: KafkaHelper, db: TestDatabase, tmp_path: Path
) -> None:
    rng = random.Random(29)
    stem = f"pat-{uuid.uuid4().hex[:8]}"
    topics = [f"{stem}-a", f"{stem}-b"]
    for topic in topics:
        kafka_helper.create_topic(partitions=3, name=topic)
    expected: set[str] = set()
    for topic in topics:
        messages = [
            Outgoing(f"{topic}-{i}", b"x", partition=rng.randrange(3)) for i in range(1_500)
        ]
        expected.update(m.message_id for m in messages if m.message_id)
        kafka_helper.produce(topic, messages + rng.sample(messages, 375))
    group = unique_name("group")
    spec: dict[str, Any] = {
        "topic": topics[0],
        "topics": [],
        "topic_pattern": rf"^{stem}-[ab]$",
        "assignor": "cooperative-sticky",
        "group": group,
        "prefix": db.prefix,
        "bootstrap": kafka_helper.bootstrap,
        "batch_size": 50,
        "delay": 0.4,
    }

    def rows_by(worker: str) -> int:
        table = orders_table(db.prefix)
        with db.engine.connect() as connection:
            return int(
                connection.execute(
                    select(func.count()).where(table.c.worker == worker)
                ).scalar_one()
            )

    workers = {name: WorkerProcess(spec, db.url, tmp_path, name) for name in ("w1", "w2")}
    try:
        wait_for(lambda: rows_by("w1") > 0 and rows_by("w2") > 0, 90, "w1 and w2 to share")
        assert total_rows(db.engine, db.prefix) < 1_500, "too fast: the join would not be mid-run"
        workers["w3"] = WorkerProcess(spec, db.url, tmp_path, "w3")
        wait_for(lambda: rows_by("w3") > 0, 90, "w3 to get partitions")
        assert total_rows(db.engine, db.prefix) < 2_700, "too fast: w1 would not leave mid-run"
        assert workers["w1"].terminate() == 0, workers["w1"].log_tail()
        w1_rows = rows_by("w1")
        wait_for(lambda: total_rows(db.engine, db.prefix) >= 3_000, 180, "every unique message")
        for topic in topics:
            wait_for(
                lambda topic=topic: (
                    kafka_helper.committed(group, topic)  # type: ignore[misc]
                    == kafka_helper.end_offsets(topic)
                ),
                60,
                f"offsets at the end of {topic}",
            )
        assert rows_by("w1") == w1_rows  # nothing after it left
    finally:
        codes = {
            name: worker.terminate()
            for name, worker in workers.items()
            if worker.process.poll() is None
        }
    assert all(code == 0 for code in codes.values()), codes
    counts = row_counts(db.engine, db.prefix)
    assert set(counts) == expected
    assert set(counts.values()) == {1}


def test_lag_covers_assigned_partitions_that_have_nothing_new(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    """A worker that joins a caught-up group reports lag 0 for each of its partitions.

    Before any record of a partition was seen, the lag came only from the records the
    worker had tracked, so a caught-up partition was missing from ``/metrics`` (and a
    freshly restarted worker looked as if it had no partitions at all).
    """
    topic = kafka_helper.create_topic(partitions=3)
    kafka_helper.produce(topic, [Outgoing(f"l-{i}", b"x", partition=i % 3) for i in range(90)])
    consumer = make_consumer(
        topic=topic,
        group=unique_name("group"),
        prefix=db.prefix,
        bootstrap=kafka_helper.bootstrap,
        batch_size=50,
    )
    expected = {f"{topic}/{partition}": 0 for partition in range(3)}
    for round_ in ("catch up", "caught up"):
        stop, metrics = StopToken(), Metrics()
        worker = threading.Thread(
            target=lambda: consumer().run(db.engine, stop=stop, metrics=metrics),
            daemon=True,
        )
        worker.start()
        try:
            if round_ == "catch up":
                wait_for(lambda: metrics.processed == 90, 60, "the 90 messages")
            # Lag counts what was not fetched yet: 0 everywhere in both rounds.
            wait_for(lambda: metrics.lag == expected, 60, f"lag 0 on 3 partitions ({round_})")
            if round_ == "caught up":
                assert metrics.delivered == 0  # it never saw a record, yet knows its lag
        finally:
            stop.request()
            worker.join(60)
        assert not worker.is_alive()
    assert total_rows(db.engine, db.prefix) == 90

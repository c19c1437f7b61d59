"""Fault injection against the real broker: kill -9, rebalances, a broker outage.

Workers run as subprocesses (``tests/integration/kafka/worker.py``, the same
``consumer.run(engine, stop=...)`` the CLI runs) and are killed with SIGKILL at random
points and right after a database commit, before the offsets are committed.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.kafka.helpers import WorkerProcess, row_counts, total_rows
from tests.services import (
    KafkaHelper,
    Outgoing,
    TestDatabase,
    kill_session_timeout_ms,
    unique_name,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def with_duplicates(
    rng: random.Random, unique: int, copies: int, partitions: int, prefix: str
) -> list[Outgoing]:
    """``unique`` messages plus ``copies`` re-sends of random ones at later positions."""
    keyed = [
        (
            float(i),
            Outgoing(f"{prefix}-{i}", f"body-{i}".encode(), partition=rng.randrange(partitions)),
        )
        for i in range(unique)
    ]
    for index in rng.sample(range(unique), copies):
        original = keyed[index][1]
        keyed.append(
            (
                rng.uniform(index + 0.5, unique),
                Outgoing(original.message_id, original.body, partition=rng.randrange(partitions)),
            )
        )
    return [message for _, message in sorted(keyed, key=lambda pair: pair[0])]


def test_kill_9_three_times_during_4000_messages_loses_and_doubles_nothing(
    kafka_helper: KafkaHelper, db: TestDatabase, tmp_path: Path
) -> None:
    seed = random.randrange(1_000_000)
    rng = random.Random(seed)
    topic = kafka_helper.create_topic(partitions=3)
    positions = kafka_helper.produce_positions(topic, with_duplicates(rng, 3_200, 800, 3, "k"))
    assert sum(len(p) for p in positions.values()) == 4_000
    unique = set(positions)
    group = unique_name("group")
    spec: dict[str, Any] = {
        "topic": topic,
        "group": group,
        "prefix": db.prefix,
        "bootstrap": kafka_helper.bootstrap,
        "batch_size": 200,
        "delay": 0.02,
        # each new worker waits for the group to drop the killed one: sooner where allowed
        "kafka_config": {"session_timeout_ms": kill_session_timeout_ms(kafka_helper.bootstrap)},
    }

    def redelivery_pending() -> list[str]:
        """Ids whose rows are committed but whose offsets are not (yet)."""
        committed = kafka_helper.committed(group, topic)
        done = row_counts(db.engine, db.prefix)
        return [
            message_id
            for message_id in done
            if all(offset >= (committed.get(p) or 0) for p, offset in positions[message_id])
        ]

    for round_number in range(3):
        label = f"kill{round_number}"
        if round_number % 2 == 0:
            # The dangerous moment: the batch's transaction committed, its offsets not.
            hold_file = tmp_path / f"{label}.hold"
            worker = WorkerProcess(
                {
                    **spec,
                    "hold_file": str(hold_file),
                    "hold_at": rng.randint(1, 4),
                    "hold_for": 120.0,
                },
                db.url,
                tmp_path,
                label,
            )
            wait_for(
                lambda: hold_file.exists() or worker.process.poll() is not None,
                90,
                f"{label} to hold after a commit",
            )
            worker.ensure_alive()
            worker.kill()
            assert redelivery_pending(), f"seed {seed}: the kill did not hit the commit window"
        else:
            # A random point of the run.
            worker = WorkerProcess(spec, db.url, tmp_path, label)
            # At most 4 batches before each held kill and this many rows here: the run
            # cannot end before the last kill.
            target = total_rows(db.engine, db.prefix) + rng.randint(150, 1_250)
            wait_for(
                lambda: (
                    total_rows(db.engine, db.prefix) >= min(target, len(unique))
                    or worker.process.poll() is not None
                ),
                90,
                f"{label} to process more rows",
                interval=0.02,
            )
            worker.ensure_alive()
            worker.kill()

    assert total_rows(db.engine, db.prefix) < len(unique), (
        f"seed {seed}: the run ended before the last kill"
    )
    final = WorkerProcess(spec, db.url, tmp_path, "final")
    try:
        wait_for(
            lambda: total_rows(db.engine, db.prefix) >= len(unique), 120, "every unique message"
        )
        wait_for(
            lambda: kafka_helper.committed(group, topic) == kafka_helper.end_offsets(topic),
            60,
            "offsets at the end",
        )
    finally:
        code = final.terminate()
    assert code == 0, final.log_tail()
    counts = row_counts(db.engine, db.prefix)
    assert set(counts) == unique, f"seed {seed}: missing {len(unique - set(counts))}"
    doubled = {k: v for k, v in counts.items() if v != 1}
    assert not doubled, f"seed {seed}: applied more than once: {list(doubled.items())[:5]}"


def test_rebalance_third_worker_joins_and_one_leaves(
    kafka_helper: KafkaHelper, db: TestDatabase, tmp_path: Path
) -> None:
    rng = random.Random(11)
    topic = kafka_helper.create_topic(partitions=6)
    kafka_helper.produce(topic, with_duplicates(rng, 6_000, 1_500, 6, "r"))
    group = unique_name("group")
    spec: dict[str, Any] = {
        "topic": topic,
        "group": group,
        "prefix": db.prefix,
        "bootstrap": kafka_helper.bootstrap,
        "batch_size": 50,
        "delay": 0.1,
    }

    def rows_by(worker: str) -> int:
        with db.engine.connect() as connection:
            from sqlalchemy import func, select

            from tests.integration.kafka.consumers import orders_table

            table = orders_table(db.prefix)
            return int(
                connection.execute(
                    select(func.count()).where(table.c.worker == worker)
                ).scalar_one()
            )

    workers = {name: WorkerProcess(spec, db.url, tmp_path, name) for name in ("w1", "w2")}
    try:
        wait_for(lambda: rows_by("w1") > 0 and rows_by("w2") > 0, 60, "w1 and w2 to share the work")
        assert total_rows(db.engine, db.prefix) < 3_000, "too fast: the join would not be mid-run"
        workers["w3"] = WorkerProcess(spec, db.url, tmp_path, "w3")
        wait_for(lambda: rows_by("w3") > 0, 60, "w3 to get partitions")
        assert total_rows(db.engine, db.prefix) < 5_000, "too fast: w1 would not leave mid-run"
        assert workers["w1"].terminate() == 0, workers["w1"].log_tail()  # leaves the group
        w1_rows = rows_by("w1")
        wait_for(lambda: total_rows(db.engine, db.prefix) >= 6_000, 120, "every unique message")
        wait_for(
            lambda: kafka_helper.committed(group, topic) == kafka_helper.end_offsets(topic),
            60,
            "offsets at the end",
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
    assert set(counts) == {f"r-{i}" for i in range(6_000)}
    assert set(counts.values()) == {1}
    committed = kafka_helper.committed(group, topic)
    assert committed == kafka_helper.end_offsets(topic)
    assert all(offset and offset > 0 for offset in committed.values())


def test_sigterm_finishes_the_batch_in_flight_commits_it_and_exits(
    kafka_helper: KafkaHelper, db: TestDatabase, tmp_path: Path
) -> None:
    topic = kafka_helper.create_topic(partitions=3)
    outgoing = [Outgoing(f"g-{i}", b"x", partition=i % 3) for i in range(3_000)]
    positions = kafka_helper.produce_positions(topic, outgoing)
    group = unique_name("group")
    spec = {
        "topic": topic,
        "group": group,
        "prefix": db.prefix,
        "bootstrap": kafka_helper.bootstrap,
        "batch_size": 100,
        "delay": 0.3,
    }
    worker = WorkerProcess(spec, db.url, tmp_path, "graceful")
    wait_for(lambda: total_rows(db.engine, db.prefix) >= 300, 60, "the first batches")
    worker.ensure_alive()
    started = time.monotonic()
    assert worker.terminate(timeout=30) == 0, worker.log_tail()
    assert time.monotonic() - started < 15

    committed = kafka_helper.committed(group, topic)
    rows = row_counts(db.engine, db.prefix)
    below_commit = {
        message_id
        for message_id, [(partition, offset)] in positions.items()
        if offset < (committed[partition] or 0)
    }
    # Settled after commit, and everything settled was committed before leaving: the rows
    # are exactly the messages below the committed offsets.
    assert set(rows) == below_commit
    assert set(rows.values()) == {1}
    assert 300 <= len(rows) < 3_000
    assert worker.metrics()["processed"] == len(rows)


def test_second_signal_stops_at_once_and_the_next_worker_gets_the_rest(
    kafka_helper: KafkaHelper, db: TestDatabase, tmp_path: Path
) -> None:
    topic = kafka_helper.create_topic(partitions=2)
    kafka_helper.produce(topic, [Outgoing(f"s-{i}", b"x", partition=i % 2) for i in range(400)])
    group = unique_name("group")
    spec: dict[str, Any] = {
        "topic": topic,
        "group": group,
        "prefix": db.prefix,
        "bootstrap": kafka_helper.bootstrap,
        "batch_size": 100,
    }
    # The first batch's transaction commits, then the worker sits there before settling.
    hold_file = tmp_path / "slow.hold"
    slow = WorkerProcess(
        {**spec, "hold_file": str(hold_file), "hold_at": 1, "hold_for": 60.0},
        db.url,
        tmp_path,
        "slow",
    )
    wait_for(lambda: hold_file.exists() or slow.process.poll() is not None, 60, "the held batch")
    slow.ensure_alive()
    slow.process.send_signal(15)  # graceful: would wait for the batch in flight ...
    wait_for(lambda: "stop signal" in slow.log_tail(), 10, "the first signal to be handled")
    started = time.monotonic()
    assert slow.terminate(timeout=20) == 130, slow.log_tail()  # ... the second one does not
    assert time.monotonic() - started < 10
    assert total_rows(db.engine, db.prefix) == 100  # committed in the database, not settled

    rest = WorkerProcess(spec, db.url, tmp_path, "rest")
    try:
        wait_for(lambda: total_rows(db.engine, db.prefix) >= 400, 60, "the rest")
        wait_for(
            lambda: kafka_helper.committed(group, topic) == kafka_helper.end_offsets(topic),
            30,
            "offsets at the end",
        )
    finally:
        assert rest.terminate() == 0, rest.log_tail()
    assert row_counts(db.engine, db.prefix) == {f"s-{i}": 1 for i in range(400)}
    assert rest.metrics()["duplicates"] >= 100  # the held batch came again, deduplicated

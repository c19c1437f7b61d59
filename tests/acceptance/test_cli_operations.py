"""``mqdedup worker``, ``replay`` and ``relay`` as real subprocesses against real services."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, delete, func, select

from mqdedup.cli import exitcodes
from mqdedup.db import create_engine, init_schema
from mqdedup.db.schema import schema
from tests.integration.kafka.helpers import row_counts
from tests.services import (
    KAFKA_SESSION_TIMEOUT_ENV,
    REPO,
    KafkaHelper,
    Outgoing,
    free_port,
    kill_session_timeout_ms,
    wait_for,
)
from tests.support import orders_table

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MQDEDUP = str(Path(sys.executable).parent / "mqdedup")
CONSUMER = "tests.acceptance.cli_consumers:Orders"


@pytest.fixture
def setup(kafka: KafkaHelper, pg_url: str) -> Iterator[dict[str, Any]]:
    prefix = f"acc_{uuid.uuid4().hex[:8]}_"
    engine = create_engine(pg_url)
    init_schema(engine, prefix)
    orders_table(prefix).create(engine)
    topic = kafka.create_topic(partitions=6, kind="accept")
    env = {
        **os.environ,
        "ACCEPT_PREFIX": prefix,
        "ACCEPT_TOPIC": topic,
        "ACCEPT_GROUP": f"group-{topic}",
        "MQDEDUP_DATABASE_URL": pg_url,
        "MQDEDUP_TABLE_PREFIX": prefix,
        "PYTHONPATH": str(REPO),
    }
    yield {"prefix": prefix, "engine": engine, "topic": topic, "env": env}
    orders_table(prefix).drop(engine, checkfirst=True)
    schema(prefix).metadata.drop_all(engine)
    engine.dispose()


def produce(kafka: KafkaHelper, topic: str, unique: int, duplicates: int, start: int = 0) -> None:
    messages = [Outgoing(f"m-{n}", f'{{"n": {n}}}'.encode()) for n in range(start, start + unique)]
    messages += messages[:duplicates]
    kafka.produce(topic, messages)


def cli(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MQDEDUP, *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def healthz(port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as reply:
            return dict(json.load(reply))
    except OSError:
        return {}


def health_answer(port: int, timeout: float = 30.0) -> dict[str, Any]:
    """The health endpoint's answer: :func:`healthz` gives ``{}`` when a reply takes over
    2 s (a loaded machine), so a test that reads a field waits for an answer."""
    answer: dict[str, Any] = {}
    wait_for(lambda: bool(answer.update(healthz(port)) or answer), timeout, "a health answer")
    return answer


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


def test_worker_processes_restart_after_kill_and_drain_on_sigterm(
    kafka: KafkaHelper, setup: dict[str, Any]
) -> None:
    engine: Engine = setup["engine"]
    port = free_port()
    produce(kafka, setup["topic"], unique=3000, duplicates=900)
    supervisor = subprocess.Popen(
        [
            MQDEDUP,
            "--log-level",
            "INFO",
            "worker",
            CONSUMER,
            "--processes",
            "3",
            "--health-port",
            str(port),
            "--shutdown-timeout",
            "60",
        ],
        # the group drops the killed child sooner where the broker allows it
        env={
            **setup["env"],
            KAFKA_SESSION_TIMEOUT_ENV: str(kill_session_timeout_ms(kafka.bootstrap)),
        },
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: healthz(port).get("running") == 3, 60, "three worker processes")
        wait_for(lambda: len(row_counts(engine, setup["prefix"])) > 0, 90, "the first rows")
        children = health_answer(port)["pids"]
        os.kill(children[0], signal.SIGKILL)
        wait_for(
            lambda: healthz(port).get("restarts", 0) >= 1 and healthz(port).get("running") == 3,
            60,
            "the supervisor to restart the killed child",
        )
        assert children[0] not in health_answer(port)["pids"]
        produce(kafka, setup["topic"], unique=1000, duplicates=300, start=3000)
        wait_for(lambda: len(row_counts(engine, setup["prefix"])) == 4000, 180, "every message")

        def processed_counters() -> list[float]:
            return [
                float(line.rsplit(" ", 1)[1])
                for line in metrics_text(port).splitlines()
                if line.startswith("mqdedup_messages_processed_total{")
            ]

        # Children report every second: wait for the counters to catch up. The restarted
        # child's series appears once its new process reports its consumer's counters (the
        # killed process's last counts are no longer shown as if it were alive).
        wait_for(
            lambda: len(processed_counters()) == 3 and sum(processed_counters()) > 0,
            60,
            "processed counters of the three children on /metrics",
        )
        # A partition's lag is known once its first fetch after the restart's rebalance
        # answered (children report every second): wait for it, bounded.
        wait_for(
            lambda: 'mqdedup_consumer_lag{consumer="' in metrics_text(port),
            30,
            "consumer lag on /metrics",
        )
        assert "mqdedup_outbox_backlog 0.0" in metrics_text(port)
        supervisor.send_signal(signal.SIGTERM)
        _, err = supervisor.communicate(timeout=90)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert supervisor.returncode == exitcodes.OK, err[-3000:]
    assert err.count("child stopped") == 3 and "exit_code=0" in err
    counts = row_counts(engine, setup["prefix"])
    assert len(counts) == 4000 and set(counts.values()) == {1}


def _process_all(kafka: KafkaHelper, setup: dict[str, Any], unique: int) -> None:
    produce(kafka, setup["topic"], unique=unique, duplicates=0)
    worker = subprocess.Popen(
        [MQDEDUP, "worker", CONSUMER, "--processes", "1"],
        env=setup["env"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: len(row_counts(setup["engine"], setup["prefix"])) == unique, 180, "all rows"
        )
        # The live group's committed offsets reach the end before we stop it.
        ends = kafka.end_offsets(setup["topic"])
        wait_for(
            lambda: kafka.committed(setup["env"]["ACCEPT_GROUP"], setup["topic"]) == ends,
            60,
            "the group's offsets to reach the end",
        )
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()


#: Messages of the replay test (100 of them forgotten).
REPLAYED = 2_000


def test_replay_skips_processed_messages_and_reprocesses_only_forgotten_ids(
    kafka: KafkaHelper, setup: dict[str, Any]
) -> None:
    engine: Engine = setup["engine"]
    prefix, env = setup["prefix"], setup["env"]
    # 2,000 messages on 6 partitions: over one batch (200) per partition, for each run.
    _process_all(kafka, setup, REPLAYED)
    group_offsets = kafka.committed(env["ACCEPT_GROUP"], setup["topic"])

    replay = cli("replay", CONSUMER, "--from", "beginning", env=env, timeout=300)
    assert replay.returncode == 0, replay.stderr
    assert _count(replay.stdout, "duplicates (already processed)") == REPLAYED
    assert _count(replay.stdout, "new (processed now)") == 0
    assert sum(row_counts(engine, prefix).values()) == REPLAYED

    forgotten = [f"m-{n}" for n in range(0, REPLAYED, 20)]
    processed = schema(prefix).processed
    with engine.begin() as connection:
        connection.execute(delete(processed).where(processed.c.message_id.in_(forgotten)))

    dry = cli("replay", CONSUMER, "--from", "beginning", "--dry-run", env=env, timeout=300)
    assert dry.returncode == 0, dry.stderr
    assert _count(dry.stdout, "new (would be processed)") == len(forgotten)
    assert _count(dry.stdout, "duplicates (already processed)") == REPLAYED - len(forgotten)
    assert sum(row_counts(engine, prefix).values()) == REPLAYED  # the dry run changed nothing
    with engine.connect() as connection:
        claims = connection.execute(select(func.count()).select_from(processed)).scalar()
    assert claims == REPLAYED - len(forgotten)

    again = cli("replay", CONSUMER, "--from", "0", env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert _count(again.stdout, "new (processed now)") == len(forgotten)
    counts = row_counts(engine, prefix)
    assert {k for k, v in counts.items() if v == 2} == set(forgotten)
    assert all(v == 1 for k, v in counts.items() if k not in forgotten)
    assert kafka.committed(env["ACCEPT_GROUP"], setup["topic"]) == group_offsets  # untouched


def test_replay_before_the_retention_horizon_is_refused(
    kafka: KafkaHelper, setup: dict[str, Any]
) -> None:
    env = setup["env"]
    _process_all(kafka, setup, 200)
    status = cli("status", CONSUMER, env=env)
    assert status.returncode == 0, status.stderr
    lag_lines = [line for line in status.stdout.splitlines() if f"{setup['topic']}/" in line]
    assert len(lag_lines) == 6 and all(line.split()[-1] == "0" for line in lag_lines)
    assert "200 records" in status.stdout and "pending 0" in status.stdout
    purge = cli(
        "dedup", "purge", "--older-than", "0s", "--yes", "--table-prefix", setup["prefix"], env=env
    )
    assert purge.returncode == 0, purge.stderr
    refused = cli("replay", CONSUMER, "--from", "beginning", env=env)
    assert refused.returncode == exitcodes.CHECK_FAILED, refused.stderr
    assert "starts before the dedup retention horizon" in refused.stderr
    assert "--allow-reprocess" in refused.stderr and "Traceback" not in refused.stderr
    assert sum(row_counts(setup["engine"], setup["prefix"]).values()) == 200


def test_the_live_group_keeps_consuming_while_a_replay_runs(
    kafka: KafkaHelper, setup: dict[str, Any]
) -> None:
    engine, prefix, env = setup["engine"], setup["prefix"], setup["env"]
    produce(kafka, setup["topic"], unique=5000, duplicates=0)
    worker = subprocess.Popen(
        [MQDEDUP, "worker", CONSUMER],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    replay = None
    try:
        wait_for(lambda: len(row_counts(engine, prefix)) == 5000, 180, "the first 5000")
        replay = subprocess.Popen(
            [MQDEDUP, "replay", CONSUMER, "--from", "beginning"],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        produce(kafka, setup["topic"], unique=500, duplicates=0, start=5000)
        wait_for(
            lambda: len(row_counts(engine, prefix)) == 5500, 120, "new messages during the replay"
        )
        _, err = replay.communicate(timeout=300)
        assert replay.returncode == 0, err
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=60)
    finally:
        for process in (worker, replay):
            if process is not None and process.poll() is None:
                process.kill()
    counts = row_counts(engine, prefix)
    assert len(counts) == 5500 and set(counts.values()) == {1}


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (
            ["worker", "tests.acceptance.nope:Orders"],
            exitcodes.CONSUMER_IMPORT,
            "cannot import module",
        ),
        (
            ["worker", "tests.acceptance.cli_consumers:NotAConsumer"],
            exitcodes.CONSUMER_IMPORT,
            "is not a mqdedup Consumer",
        ),
        (
            ["replay", CONSUMER, "--from", "yesterday-ish"],
            exitcodes.USAGE,  # the command line (was 3, as a setting: issue 42)
            "cannot read 'yesterday-ish' as a position",
        ),
        (
            ["worker", CONSUMER, "--database", "postgresql://x:pw@127.0.0.1:1/db"],
            exitcodes.DATABASE_UNAVAILABLE,
            "cannot connect to database",
        ),
        # A worker's unreachable Kafka (exit 6 after its wait, one line): test_cli_edges.py
        # test_workers_wait_for_an_unreachable_broker_the_same_way, with a 2 s wait.
        (
            # Exit 6 only when no configured broker answers (one is enough to relay).
            [
                "relay",
                "--rabbitmq-url",
                "amqp://g:pw@127.0.0.1:1/%2F",
                "--kafka-bootstrap",
                "127.0.0.1:1",
            ],
            exitcodes.BROKER_UNAVAILABLE,
            "cannot reach RabbitMQ at 127.0.0.1:1",
        ),
    ],
)
def test_bad_input_is_one_clear_line_with_a_documented_exit_code(
    setup: dict[str, Any], args: list[str], code: int, message: str
) -> None:
    env = {**setup["env"], "MQDEDUP_TABLE_PREFIX": setup["prefix"]}
    result = cli(*args, env=env, timeout=90)
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr and "pw@" not in result.stderr


def _count(output: str, label: str) -> int:
    for line in output.splitlines():
        if line.strip().startswith(label):
            return int(line.split()[-1].replace(",", ""))
    raise AssertionError(f"no {label!r} line in:\n{output}")


def test_relay_sigterm_mid_stream_marks_its_batch_and_exits_0(
    kafka: KafkaHelper, setup: dict[str, Any]
) -> None:
    from sqlalchemy.orm import Session

    from mqdedup.outbox.store import OutboxStore
    from mqdedup.outbox.writer import OutboxWriter, OutgoingMessage

    engine, prefix, env = setup["engine"], setup["prefix"], setup["env"]
    topic = kafka.create_topic(partitions=3, kind="relayed")
    total = 30_000
    with Session(engine) as session, session.begin():
        OutboxWriter(session, prefix=prefix).publish_many(
            OutgoingMessage({"n": n}, topic=topic, key=f"k{n % 50}") for n in range(total)
        )

    def published() -> int:  # rows marked, or deleted and counted (the default)
        return OutboxStore(prefix).status(engine).published

    relay = subprocess.Popen(
        [MQDEDUP, "--log-level", "INFO", "relay", "--table-prefix", prefix, "--batch-size", "200"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: published() >= 1000, 120, "the relay to publish")
        relay.send_signal(signal.SIGTERM)
        _, err = relay.communicate(timeout=90)
    finally:
        if relay.poll() is None:
            relay.kill()
    assert relay.returncode == exitcodes.OK, err[-3000:]
    marked = published()
    assert 1000 <= marked < total, "SIGTERM should stop the relay mid-stream"
    with engine.connect() as connection:
        leases = connection.execute(
            select(func.count()).select_from(schema(prefix).outbox_leases)
        ).scalar_one()
    assert leases == 0  # the relay's lease went with its settled batches
    # Every row it published was marked: the topic holds exactly the marked rows.
    assert len(kafka.read_all(topic, marked, timeout=60)) == marked

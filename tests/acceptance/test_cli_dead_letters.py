"""``mqdedup dead-letters`` over all three places, ``dedup show | forget`` and the
dead-letter depth in ``status``, as real subprocesses against PostgreSQL, Kafka and
RabbitMQ with real dead letters (a handler raising MessageError)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from mqdedup.cli import exitcodes
from mqdedup.db import create_engine, init_schema
from mqdedup.db.schema import schema
from tests.integration.kafka.helpers import row_counts
from tests.services import REPO, KafkaHelper, Outgoing, RabbitAdmin, unique_name, wait_for
from tests.support import orders_table

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MQDEDUP = str(Path(sys.executable).parent / "mqdedup")
CONSUMER = "tests.acceptance.cli_consumers:DeadLetterOrders"


@pytest.fixture
def setup(kafka: KafkaHelper, pg_url: str) -> Iterator[dict[str, Any]]:
    prefix = f"acc_{uuid.uuid4().hex[:8]}_"
    engine = create_engine(pg_url)
    init_schema(engine, prefix)
    orders_table(prefix).create(engine)
    topic = kafka.create_topic(partitions=1, kind="dlcli")
    env = {
        **os.environ,
        "ACCEPT_PREFIX": prefix,
        "ACCEPT_TOPIC": topic,
        "ACCEPT_GROUP": f"group-{topic}",
        "ACCEPT_FAIL": "",
        "MQDEDUP_DATABASE_URL": pg_url,
        "MQDEDUP_TABLE_PREFIX": prefix,
        "MQDEDUP_KAFKA_BOOTSTRAP": kafka.bootstrap,
        "PYTHONPATH": str(REPO),
    }
    yield {"prefix": prefix, "engine": engine, "topic": topic, "env": env}
    orders_table(prefix).drop(engine, checkfirst=True)
    schema(prefix).metadata.drop_all(engine)
    engine.dispose()


def cli(
    *args: str, env: dict[str, str], fail: str | None = None
) -> subprocess.CompletedProcess[str]:
    environment = env if fail is None else {**env, "ACCEPT_FAIL": fail}
    result = subprocess.run(
        [MQDEDUP, *args], env=environment, cwd=REPO, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert "Traceback" not in result.stderr, result.stderr
    return result


def _rows(engine: Engine, prefix: str) -> dict[str, int]:
    return row_counts(engine, prefix)


def test_kafka_dead_letters_from_the_cli(kafka: KafkaHelper, setup: dict[str, Any]) -> None:
    env, topic, engine, prefix = setup["env"], setup["topic"], setup["engine"], setup["prefix"]
    dlt, group = f"{topic}.DLT", f"group-{topic}"
    kafka.produce(topic, [Outgoing(f"m-{n}", f'{{"n": {n}}}'.encode()) for n in range(6)])
    run = cli("replay", CONSUMER, env=env, fail="m-1,m-2")  # two dead letters in the DLT
    assert run.returncode in (exitcodes.OK, 8), run.stderr
    assert _rows(engine, prefix) == {f"m-{n}": 1 for n in (0, 3, 4, 5)}

    status = cli("status", CONSUMER, "--json", env=env)
    assert status.returncode == exitcodes.OK, status.stderr
    depths = json.loads(status.stdout)["dead_letter_depths"]
    assert depths == [
        {"consumer": group, "place": "kafka", "where": dlt, "depth": 2, "error": None}
    ]
    screen = cli("status", CONSUMER, env=env).stdout
    assert "Dead-letter topics and queues" in screen and dlt in screen

    listed = cli("dead-letters", "list", "--topic", dlt, "--json", env=env)
    assert listed.returncode == exitcodes.OK, listed.stderr
    records = json.loads(listed.stdout)
    assert [(r["key"], r["message_id"]) for r in records] == [
        (f"{dlt}:0:0", "m-1"), (f"{dlt}:0:1", "m-2")
    ]  # fmt: skip
    assert records[0]["consumer"] == group and records[0]["source"] == f"{topic}/0/1"
    assert records[0]["error"].endswith("MessageError: bad order m-1")
    groups = cli("dead-letters", "list", "--topic", dlt, "--groups", env=env).stdout
    assert groups.count("bad order m-") == 2

    shown = cli("dead-letters", "show", f"{dlt}:0:0", "--topic", dlt, "--body-limit", "3", env=env)
    assert shown.returncode == exitcodes.OK, shown.stderr
    assert "x-mqdedup-reason" in shown.stdout and '\n{"n\n' in shown.stdout
    assert "truncated: 3 of 8 bytes shown" in shown.stdout
    missing = cli("dead-letters", "show", f"{dlt}:0:99", "--topic", dlt, env=env)
    assert missing.returncode == exitcodes.CHECK_FAILED and "no dead letter" in missing.stderr
    malformed = cli("dead-letters", "show", "orders", "--place", "kafka", env=env)
    assert malformed.returncode == exitcodes.USAGE and "topic:partition:offset" in malformed.stderr
    clash = cli("dead-letters", "list", "--topic", dlt, "--queue", "x.dlq", env=env)
    assert clash.returncode == exitcodes.USAGE

    replayed = cli(
        "dead-letters", "replay", CONSUMER, "--place", "kafka", "--key", f"{dlt}:0:0", env=env
    )
    assert replayed.returncode == exitcodes.OK, replayed.stderr
    assert "1 processed" in replayed.stdout
    again = cli(
        "dead-letters", "replay", CONSUMER, "--place", "kafka", "--key", f"{dlt}:0:0", env=env
    )
    assert again.returncode == exitcodes.OK and "no dead letters" in again.stdout
    assert _rows(engine, prefix)["m-1"] == 1

    still = cli("dead-letters", "replay", CONSUMER, "--place", "kafka", env=env, fail="m-2")
    assert still.returncode != exitcodes.OK and "1 failed again" in still.stdout
    assert "m-2" not in _rows(engine, prefix)

    requeued = cli("dead-letters", "requeue", "--topic", dlt, "--key", f"{dlt}:0:1", env=env)
    assert requeued.returncode == exitcodes.OK and "requeued 1 of 1" in requeued.stdout
    copies = [
        r for r in kafka.read_all(topic, expected=7) if dict(r.headers).get("message-id") == b"m-2"
    ]
    assert len(copies) == 2
    assert (
        json.loads(cli("status", CONSUMER, "--json", env=env).stdout)["dead_letter_depths"][0][
            "depth"
        ]
        == 0
    )

    cli("replay", CONSUMER, env=env, fail="m-4,m-5")  # m-4, m-5 processed already: duplicates
    kafka.produce(topic, [Outgoing("m-6", b'{"n": 6}')])
    cli("replay", CONSUMER, env=env, fail="m-6")
    refused = cli("dead-letters", "delete", "--topic", dlt, "--all", env=env)
    assert refused.returncode == exitcodes.USAGE and "--consumer" in refused.stderr
    deleted = cli("dead-letters", "delete", "--topic", dlt, "--all", "--consumer", group, env=env)
    assert deleted.returncode == exitcodes.OK and "deleted 1" in deleted.stdout, deleted.stdout
    assert json.loads(cli("dead-letters", "list", "--topic", dlt, "--json", env=env).stdout) == []


def test_dedup_show_and_forget(kafka: KafkaHelper, setup: dict[str, Any]) -> None:
    env, topic = setup["env"], setup["topic"]
    group = f"group-{topic}"
    kafka.produce(topic, [Outgoing("m-0", b'{"n": 0}')])
    assert cli("replay", CONSUMER, env=env).returncode == exitcodes.OK

    shown = cli("dedup", "show", "m-0", "--json", env=env)
    assert shown.returncode == exitcodes.OK, shown.stderr
    [claim] = json.loads(shown.stdout)
    assert claim["consumer"] == group and claim["processed_at"] and claim["steps"] == []
    assert "processed at:" in cli("dedup", "show", "m-0", env=env).stdout

    refused = cli("dedup", "forget", "m-0", "--consumer", group, env=env)  # not a terminal
    assert refused.returncode == exitcodes.CHECK_FAILED and "--yes" in refused.stderr
    assert cli("dedup", "show", "m-0", env=env).returncode == exitcodes.OK
    forgot = cli("dedup", "forget", "m-0", "--consumer", group, "--yes", env=env)
    assert forgot.returncode == exitcodes.OK and "1 claim" in forgot.stdout
    gone = cli("dedup", "show", "m-0", env=env)
    assert gone.returncode == exitcodes.CHECK_FAILED and "not claimed" in gone.stdout
    assert cli("replay", CONSUMER, env=env).returncode == exitcodes.OK  # forgotten: runs again
    assert _rows(setup["engine"], setup["prefix"])["m-0"] == 2


def test_rabbitmq_dead_letters_from_the_cli(rabbitmq_url: str, setup: dict[str, Any]) -> None:
    from mqdedup import RetryPolicy
    from tests.integration.rabbitmq.support import ThreadedWorker, make_consumer

    env, engine, prefix = setup["env"], setup["engine"], setup["prefix"]
    queue = unique_name("dlcli")
    dlq = f"{queue}.dlq"

    def refuse(message: Any) -> None:
        from mqdedup.errors import MessageError

        if message.id in {"r-1", "r-2"}:
            raise MessageError(f"bad order {message.id}")

    consumer = make_consumer(
        queue, prefix, rabbitmq_url, retry_policy=RetryPolicy(max_attempts=2),
        before_write=refuse,
    )()  # fmt: skip
    admin = RabbitAdmin(rabbitmq_url)
    try:
        admin.declare(consumer)
        admin.created += [queue, dlq]
        admin.publish(queue, [f"r-{n}" for n in range(4)])
        with ThreadedWorker(consumer, engine) as worker:
            wait_for(lambda: admin.depth(dlq) == 2, 60, "two dead letters")
            worker.finish()
        rabbit = {**env, "MQDEDUP_RABBITMQ_URL": rabbitmq_url}

        listed = cli("dead-letters", "list", "--queue", dlq, env=rabbit)
        assert listed.returncode == exitcodes.OK, listed.stderr
        assert f"{dlq}:r-1" in listed.stdout and f"{dlq}:r-2" in listed.stdout
        assert admin.depth(dlq) == 2, "a list leaves the queue as it was"
        shown = cli("dead-letters", "show", f"{dlq}:r-2", "--queue", dlq, env=rabbit)
        assert shown.returncode == exitcodes.OK and "bad order r-2" in shown.stdout
        assert admin.depth(dlq) == 2, "so does show"
        no_queue = cli("dead-letters", "list", "--place", "rabbitmq", env=rabbit)
        assert no_queue.returncode == exitcodes.USAGE and "--queue" in no_queue.stderr

        deleted = cli("dead-letters", "delete", "--queue", dlq, "--key", f"{dlq}:r-1", env=rabbit)
        assert deleted.returncode == exitcodes.OK and "deleted 1" in deleted.stdout
        requeued = cli("dead-letters", "requeue", "--queue", dlq, "--key", f"{dlq}:r-2", env=rabbit)
        assert requeued.returncode == exitcodes.OK and "requeued 1 of 1" in requeued.stdout
        assert admin.depth(dlq) == 0 and admin.depth(queue) == 1
    finally:
        admin.close()

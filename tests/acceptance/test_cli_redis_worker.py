"""``mqdedup worker`` running consumers with ``dedup = RedisDedup(...)`` (no database)
against real RabbitMQ / Kafka + Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from mqdedup.cli import exitcodes
from tests.acceptance.redis_consumers import SendSms
from tests.acceptance.test_cli_operations import (
    MQDEDUP,
    cli,
    health_answer,
    healthz,
    metrics_text,
)
from tests.integration.rabbitmq.support import rabbitmqctl, rabbitmqctl_command
from tests.services import (
    REPO,
    KafkaHelper,
    Outgoing,
    RabbitAdmin,
    free_port,
    require_service,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CONSUMER = "tests.acceptance.redis_consumers:SendSms"


@pytest.fixture
def setup() -> Iterator[dict[str, Any]]:
    redis_url = os.environ.get("MQDEDUP_REDIS_URL")
    rabbitmq_url = os.environ.get("MQDEDUP_RABBITMQ_URL")
    if not redis_url or not rabbitmq_url:
        require_service("Redis/RabbitMQ", "MQDEDUP_REDIS_URL / MQDEDUP_RABBITMQ_URL not set")
    assert redis_url is not None and rabbitmq_url is not None
    client = redis.Redis.from_url(redis_url)
    try:
        client.ping()
    except redis.RedisError as exc:
        require_service("Redis", str(exc))
    admin = RabbitAdmin(rabbitmq_url)
    tag = uuid.uuid4().hex[:8]
    queue = f"accept-sms-{tag}"
    namespace = f"accept:{tag}:"
    admin.declare(type("Requests", (SendSms,), {"queue": queue})())
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("MQDEDUP_DATABASE_URL", "MQDEDUP_CONFIG")
    }
    env.update(
        {
            "ACCEPT_QUEUE": queue,
            "ACCEPT_NAMESPACE": namespace,
            "PYTHONPATH": str(REPO),
            "ACCEPT_DELAY": "0.002",
            # No database anywhere: the default SQLite URL points at a directory that does
            # not exist, so any attempt to use it would fail the test.
            "MQDEDUP_DATABASE_URL": "sqlite:////nonexistent/dir/mqdedup.db",
        }
    )
    yield {"admin": admin, "queue": queue, "redis": client, "namespace": namespace, "env": env}
    admin.delete(queue, f"{queue}.dlq")
    admin.close()
    for key in client.scan_iter(f"{namespace}*"):
        client.delete(key)
    client.close()


def in_queue(admin: RabbitAdmin, queue: str) -> int:
    """Messages ready or unacknowledged in ``queue`` (only ready ones without rabbitmqctl)."""
    ctl = rabbitmqctl_command()
    if not ctl:
        return admin.depth(queue)
    listed = rabbitmqctl(
        ctl, "list_queues", "name", "messages_ready", "messages_unacknowledged", "-q"
    )
    for line in listed.splitlines():
        name, *counts = line.split()
        if name == queue:
            return sum(int(count) for count in counts)
    return 0


def effects(setup: dict[str, Any]) -> list[str]:
    return [e.decode() for e in setup["redis"].lrange(f"{setup['namespace']}effects", 0, -1)]


def test_worker_runs_a_redis_consumer_through_a_kill_and_drains_on_sigterm(
    setup: dict[str, Any],
) -> None:
    """2,000 requests + 600 duplicates, two processes, one killed with -9 mid-run.

    Every request gets its effect; broker duplicates never repeat it; the kill can repeat
    at most the one effect that was done but not yet recorded (the documented window of
    the Redis store). Then SIGTERM drains both processes, exit 0, queue empty.
    """
    admin: RabbitAdmin = setup["admin"]
    ids = [f"sms-{n}" for n in range(2000)]
    admin.publish(setup["queue"], ids + ids[:600])
    port = free_port()
    supervisor = subprocess.Popen(
        [
            *(MQDEDUP, "--log-level", "INFO", "worker", CONSUMER, "--processes", "2"),
            *("--health-port", str(port), "--shutdown-timeout", "60"),
        ],
        env=setup["env"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: healthz(port).get("running") == 2, 60, "two worker processes")
        wait_for(lambda: len(effects(setup)) >= 200, 90, "the first effects")
        victim = health_answer(port)["pids"][0]
        assert len(set(effects(setup))) < len(ids), "the kill must land mid-run"
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: healthz(port).get("restarts", 0) >= 1 and healthz(port).get("running") == 2,
            60,
            "the supervisor to restart the killed child",
        )
        wait_for(lambda: set(effects(setup)) == set(ids), 180, "every request's effect")
        # Drained: nothing ready and, where rabbitmqctl is there to tell, nothing unacked
        # either (deliveries a worker still holds would go back to the queue on SIGTERM;
        # given-back ones of the kill window come and go while the ready count is 0).
        wait_for(lambda: in_queue(admin, setup["queue"]) == 0, 60, "the queue to drain")

        def processed() -> float:
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in metrics_text(port).splitlines()
                if line.startswith("mqdedup_messages_processed_total{")
            )

        wait_for(lambda: processed() > 0, 30, "processed counters on /metrics")
        assert "mqdedup_outbox_backlog" not in metrics_text(port)  # no database here
        supervisor.send_signal(signal.SIGTERM)
        _, err = supervisor.communicate(timeout=90)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert supervisor.returncode == exitcodes.OK, err[-3000:]
    done = effects(setup)
    repeated = {key: n for key, n in Counter(done).items() if n > 1}
    assert set(done) == set(ids)
    assert len(repeated) <= 1, f"effects repeated beyond the kill window: {repeated}"
    assert admin.depth(setup["queue"]) == 0
    assert admin.depth(f"{setup['queue']}.dlq") == 0


def test_redis_worker_bad_input_is_one_line_with_a_documented_code(setup: dict[str, Any]) -> None:
    env = setup["env"]
    down = f"redis://127.0.0.1:{free_port()}/0"
    unreachable = cli("worker", CONSUMER, "--redis-url", down, env=env)
    assert unreachable.returncode == exitcodes.DATABASE_UNAVAILABLE, unreachable.stderr
    bad_url = cli("worker", "tests.acceptance.redis_consumers:BadRedisUrl", env=env)
    assert bad_url.returncode == exitcodes.CONFIGURATION, bad_url.stderr
    for result, words in ((unreachable, "Redis"), (bad_url, "must start with redis://")):
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], result.stderr
        assert "Traceback" not in result.stderr


def test_worker_runs_a_redis_claimed_kafka_consumer(
    setup: dict[str, Any],
) -> None:
    """500 requests + 150 duplicates on Kafka: each effect once, offsets committed."""
    bootstrap = os.environ.get("MQDEDUP_KAFKA_BOOTSTRAP")
    if not bootstrap:
        require_service("Kafka", "MQDEDUP_KAFKA_BOOTSTRAP is not set")
    assert bootstrap is not None
    kafka = KafkaHelper(bootstrap)
    try:
        topic = kafka.create_topic(partitions=2, kind="sms")
        group = f"group-{topic}"
        ids = [f"k-{n}" for n in range(500)]
        kafka.produce(topic, [Outgoing(i, b"{}") for i in ids + ids[:150]])
        env = {**setup["env"], "ACCEPT_TOPIC": topic, "ACCEPT_GROUP": group, "ACCEPT_DELAY": "0"}
        worker = subprocess.Popen(
            [MQDEDUP, "worker", "tests.acceptance.redis_consumers:SendSmsFromKafka"],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(lambda: len(effects(setup)) >= 500, 120, "every request's effect")
            ends = kafka.end_offsets(topic)
            wait_for(lambda: kafka.committed(group, topic) == ends, 60, "offsets committed")
            worker.send_signal(signal.SIGTERM)
            _, err = worker.communicate(timeout=60)
        finally:
            if worker.poll() is None:
                worker.kill()
        assert worker.returncode == exitcodes.OK, err[-3000:]
        assert Counter(effects(setup)) == Counter(ids)
    finally:
        kafka.close()

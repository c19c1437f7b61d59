"""No child of ``mqdedup worker`` / ``mqdedup relay`` outlives its supervisor, and no second
supervisor runs beside them (issue #40): real processes, ``kill -9`` and SIGHUP, for a
Kafka worker, a RabbitMQ worker and the relay.

Each scenario: a supervisor with two children runs; a second one for the same slots is
refused in one line. Its children are frozen (SIGSTOP), the supervisor is killed with
``kill -9``, and a new supervisor is refused while the orphans live (they hold the slot
lock). Thawed (SIGCONT), the orphans notice their supervisor is gone and stop cleanly
within 2 s: none is alive, the relay's shard locks are released (``pg_locks``). A new
supervisor then runs alone and finishes the work; SIGHUP stops it cleanly (exit 0, a
log line, no child left). A last one is killed with a plain ``kill -9``: its children are
gone within 2 s. Every message's effects happened once (rows in PostgreSQL), and
every outbox row reached the topic.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from mqdedup.cli import exitcodes
from mqdedup.outbox.coordination import lock_class
from mqdedup.outbox.store import OutboxStore
from tests.integration.kafka.helpers import row_counts
from tests.integration.rabbitmq.support import make_consumer
from tests.services import (
    KAFKA_SESSION_TIMEOUT_ENV,
    REPO,
    TERMINAL_SIGNALS,
    KafkaHelper,
    Outgoing,
    RabbitAdmin,
    TestDatabase,
    free_port,
    kafka_headers,
    kill_session_timeout_ms,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MQDEDUP = str(Path(sys.executable).parent / "mqdedup")
RABBIT_CONSUMER = "tests.integration.rabbitmq.cli_consumer:CliOrders"
#: The issue's bound: no child alive this long after its supervisor died.
ORPHAN_BOUND = 2.0


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def healthz(port: int) -> dict[str, Any]:
    """``/healthz`` as JSON (its body on 503 too); {} while nobody answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as reply:
            return dict(json.load(reply))
    except urllib.error.HTTPError as answer:
        return {**json.load(answer), "status": answer.code}
    except OSError:
        return {}


@dataclass
class Daemon:
    """How to run one supervisor kind and judge its effects."""

    command: list[str]
    env: dict[str, str]
    #: Effects so far (rows written / rows published), and the total expected.
    done: Callable[[], int]
    total: int
    #: Whether every effect happened exactly once (at least once for the relay).
    check: Callable[[], None]
    #: Shard locks still held (the relay), else None.
    locks: Callable[[], int] | None = None


class Supervisor:
    def __init__(self, daemon: Daemon, tmp: Path, name: str, processes: int = 2) -> None:
        self.processes = processes
        self.port = free_port()
        self.log = tmp / f"{name}.log"
        self._out = self.log.open("wb")
        self.process = subprocess.Popen(
            [
                *TERMINAL_SIGNALS,
                MQDEDUP,
                "--log-level",
                "INFO",
                *daemon.command,
                "--processes",
                str(processes),
                "--health-port",
                str(self.port),
                "--health-host",
                "127.0.0.1",
                "--shutdown-timeout",
                "20",
            ],
            env=daemon.env,
            cwd=REPO,
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def children(self) -> list[int]:
        wait_for(
            lambda: (
                self.process.poll() is not None
                or healthz(self.port).get("running") == self.processes
            ),
            90,
            "the children running",
        )
        assert self.process.poll() is None, self.output()[-3000:]
        return [int(pid) for pid in healthz(self.port)["pids"]]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)
        self._out.close()


def refused(daemon: Daemon) -> str:
    """A supervisor for the same slots: refused with one line and exit code 1."""
    second = subprocess.run(
        [MQDEDUP, *daemon.command, "--processes", "2"],
        env=daemon.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert second.returncode == exitcodes.CHECK_FAILED, second.stderr[-3000:]
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
    assert "another `mqdedup" in lines[0], lines[0]
    return lines[0]


def run_scenario(daemon: Daemon, tmp: Path) -> dict[str, float]:
    figures: dict[str, float] = {}
    first = Supervisor(daemon, tmp, "first")
    supervisors = [first]
    try:
        children = first.children()
        wait_for(lambda: daemon.done() > 0, 120, "the first effects")
        print(refused(daemon))

        # kill -9 of the supervisor while its children are frozen: they outlive it.
        for pid in children:
            os.kill(pid, signal.SIGSTOP)
        first.process.kill()
        first.process.wait(30)
        print(refused(daemon))
        thawed = time.monotonic()
        for pid in children:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: not any(alive(pid) for pid in children), 60, "the orphans to stop")
        figures["orphans_gone_s"] = time.monotonic() - thawed
        assert figures["orphans_gone_s"] <= ORPHAN_BOUND, figures
        assert "the supervisor is gone; stopping cleanly" in first.output()
        if daemon.locks is not None:
            assert daemon.locks() == 0, "the orphans' shard locks are still held"

        # A new supervisor runs alone and finishes; SIGHUP stops it cleanly.
        last = Supervisor(daemon, tmp, "restarted")
        supervisors.append(last)
        survivors = last.children()
        wait_for(lambda: daemon.done() >= daemon.total, 240, "every effect")
        last.process.send_signal(signal.SIGHUP)
        asked = time.monotonic()
        code = last.process.wait(60)
        figures["sighup_stop_s"] = time.monotonic() - asked
        assert code == exitcodes.OK, last.output()[-3000:]
        assert "SIGHUP" in last.output() and "stopping cleanly" in last.output()
        assert not any(alive(pid) for pid in survivors), "a child outlived SIGHUP"

        # A plain kill -9 of a running supervisor: its children are gone within 2 s.
        third = Supervisor(daemon, tmp, "killed")
        supervisors.append(third)
        orphans = third.children()
        wait_for(
            lambda: len(re.findall(r"(worker|relay) started", third.output())) == 2,
            90,
            "both children to have started",
        )
        killed = time.monotonic()
        third.process.kill()
        wait_for(lambda: not any(alive(pid) for pid in orphans), 60, "the orphans to stop")
        figures["kill_9_orphans_gone_s"] = time.monotonic() - killed
        assert figures["kill_9_orphans_gone_s"] <= ORPHAN_BOUND, figures
        outputs = "".join(supervisor.output() for supervisor in supervisors)
        assert "Traceback" not in outputs
    finally:
        for supervisor in supervisors:
            supervisor.close()
    daemon.check()
    if daemon.locks is not None:
        assert daemon.locks() == 0
    return figures


@pytest.fixture
def base_env(tmp_path: Path, db: TestDatabase) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MQDEDUP_DATABASE_URL": db.url,
        "MQDEDUP_TABLE_PREFIX": db.prefix,
        "MQDEDUP_RUNTIME_DIR": str(tmp_path / "run"),
    }


def once(counts: Callable[[], dict[str, int]], expected: set[str]) -> Callable[[], None]:
    def check() -> None:
        got = counts()
        assert set(got) == expected, f"{len(expected - set(got))} missing"
        assert set(got.values()) == {1}, "an effect happened twice"

    return check


def test_kafka_worker_supervisor_never_orphans_its_children(
    kafka: KafkaHelper, db: TestDatabase, base_env: dict[str, str], tmp_path: Path
) -> None:
    topic = kafka.create_topic(partitions=4, kind="orphans")
    ids = [f"m-{n}" for n in range(3000)]
    kafka.produce(topic, [Outgoing(i, b"{}") for i in ids + ids[:600]])
    env = {
        **base_env,
        "ACCEPT_PREFIX": db.prefix,
        "ACCEPT_TOPIC": topic,
        "ACCEPT_GROUP": f"group-{topic}",
        KAFKA_SESSION_TIMEOUT_ENV: str(kill_session_timeout_ms(kafka.bootstrap)),
    }
    daemon = Daemon(
        ["worker", "tests.acceptance.cli_consumers:Orders"],
        env,
        done=lambda: len(row_counts(db.engine, db.prefix)),
        total=len(ids),
        check=once(lambda: row_counts(db.engine, db.prefix), set(ids)),
    )
    print(run_scenario(daemon, tmp_path))


def test_rabbitmq_worker_supervisor_never_orphans_its_children(
    rabbit: RabbitAdmin, db: TestDatabase, base_env: dict[str, str], tmp_path: Path
) -> None:
    queue = rabbit.queue("orphans")
    rabbit.declare(make_consumer(queue, db.prefix, rabbit.url)())
    ids = [f"r-{n}" for n in range(3000)]
    rabbit.publish(queue, ids + ids[:600])
    env = {
        **base_env,
        "MQDEDUP_TEST_RABBIT_QUEUE": queue,
        "MQDEDUP_TEST_RABBIT_PREFIX": db.prefix,
        "MQDEDUP_RABBITMQ_URL": rabbit.url,
    }
    daemon = Daemon(
        ["worker", RABBIT_CONSUMER],
        env,
        done=lambda: len(row_counts(db.engine, db.prefix)),
        total=len(ids),
        check=once(lambda: row_counts(db.engine, db.prefix), set(ids)),
    )
    print(run_scenario(daemon, tmp_path))


def test_relay_supervisor_never_orphans_its_children(
    kafka: KafkaHelper, db: TestDatabase, base_env: dict[str, str], tmp_path: Path
) -> None:
    from sqlalchemy.orm import Session

    from mqdedup.outbox.writer import OutboxWriter, OutgoingMessage

    topic = kafka.create_topic(partitions=3, kind="relayed")
    total = 20_000
    with Session(db.engine) as session, session.begin():
        OutboxWriter(session, prefix=db.prefix).publish_many(
            OutgoingMessage({"n": n}, topic=topic, key=f"k{n % 50}") for n in range(total)
        )
    store = OutboxStore(db.prefix)
    shards = lock_class(store.table.name, "shards")

    def shard_locks() -> int:
        query = text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = :c")
        with db.engine.connect() as connection:
            return int(connection.execute(query, {"c": shards}).scalar_one())

    def published_once() -> None:
        assert store.status(db.engine).pending == 0
        records = kafka.read_all(topic, total, timeout=60)
        # Every row at least once (each has its own id; a kill -9 may repeat a batch).
        assert len({kafka_headers(record)["message-id"] for record in records}) == total

    daemon = Daemon(
        ["relay", "--batch-size", "200", "--kafka-bootstrap", kafka.bootstrap],
        base_env,
        done=lambda: store.status(db.engine).published,
        total=total,
        check=published_once,
        locks=shard_locks,
    )
    print(run_scenario(daemon, tmp_path))


def test_a_fenced_kafka_member_goes_not_ready_and_says_why(
    kafka: KafkaHelper, db: TestDatabase, base_env: dict[str, str], tmp_path: Path
) -> None:
    """Two supervisors on two "hosts" (runtime directories) share MQDEDUP_INSTANCE_HOST: the
    second one's member takes the static id, the broker fences the first. The first goes
    not ready (503 naming the cause), says so in one ERROR line and stops consuming; the
    second stays ready and consumes; every message's effects happen once."""
    topic = kafka.create_topic(partitions=2, kind="fenced")
    env = {
        **base_env,
        "ACCEPT_PREFIX": db.prefix,
        "ACCEPT_TOPIC": topic,
        "ACCEPT_GROUP": f"group-{topic}",
        "MQDEDUP_INSTANCE_HOST": "same-name",
    }
    ids = [f"f-{n}" for n in range(1000)]
    kafka.produce(topic, [Outgoing(i, b"{}") for i in ids[:500]])
    daemon = Daemon(
        ["worker", "tests.acceptance.cli_consumers:Orders"],
        env,
        done=lambda: len(row_counts(db.engine, db.prefix)),
        total=len(ids),
        check=once(lambda: row_counts(db.engine, db.prefix), set(ids)),
    )
    first = Supervisor(daemon, tmp_path, "first", processes=1)
    daemon.env = {**env, "MQDEDUP_RUNTIME_DIR": str(tmp_path / "other-host")}
    supervisors = [first]
    try:
        first.children()
        wait_for(lambda: daemon.done() == 500, 120, "the first 500 messages")
        assert healthz(first.port).get("ready") is not False
        second = Supervisor(daemon, tmp_path, "second", processes=1)
        supervisors.append(second)
        second.children()
        # Its member joined (the broker fenced the first's) once it reports its lag.
        wait_for(lambda: "mqdedup_consumer_lag{" in metrics(second.port), 120, "the join")
        # The fenced member notices at its next offset commit: with the next messages.
        kafka.produce(topic, [Outgoing(i, b"{}") for i in ids[500:]])
        wait_for(
            lambda: "MQDEDUP_INSTANCE_HOST=same-name" in str(healthz(first.port).get("reasons")),
            120,
            "the fenced member to go not ready and say why",
        )
        assert healthz(first.port)["status"] == 503 and not healthz(first.port)["ready"]
        assert healthz(second.port).get("ready") is True
        wait_for(lambda: daemon.done() == len(ids), 120, "every message")
        assert "fenced: another member of group" in first.output()
        assert 'mqdedup_consumer_attached{consumer="' in metrics(first.port)
        for supervisor in supervisors:
            supervisor.process.send_signal(signal.SIGTERM)
            assert supervisor.process.wait(60) == exitcodes.OK, supervisor.output()[-3000:]
    finally:
        for supervisor in supervisors:
            supervisor.close()
    daemon.check()


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


def test_sighup_ignored_by_nohup_stays_ignored(
    rabbit: RabbitAdmin, db: TestDatabase, base_env: dict[str, str], tmp_path: Path
) -> None:
    """Under ``nohup`` (SIGHUP ignored when the command starts) a hangup changes nothing:
    the supervisor and its children keep consuming; SIGTERM still stops them (exit 0)."""
    queue = rabbit.queue("nohup")
    rabbit.declare(make_consumer(queue, db.prefix, rabbit.url)())
    env = {
        **base_env,
        "MQDEDUP_TEST_RABBIT_QUEUE": queue,
        "MQDEDUP_TEST_RABBIT_PREFIX": db.prefix,
        "MQDEDUP_RABBITMQ_URL": rabbit.url,
    }
    log = (tmp_path / "nohup.log").open("wb")
    worker = subprocess.Popen(
        ["nohup", MQDEDUP, "--log-level", "INFO", "worker", RABBIT_CONSUMER],
        env=env,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        rabbit.publish(queue, ["n-1"], wait=False)
        wait_for(lambda: len(row_counts(db.engine, db.prefix)) == 1, 90, "the first message")
        worker.send_signal(signal.SIGHUP)
        rabbit.publish(queue, ["n-2"], wait=False)
        wait_for(lambda: len(row_counts(db.engine, db.prefix)) == 2, 90, "a message after SIGHUP")
        assert worker.poll() is None
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == exitcodes.OK
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(30)
        log.close()
    output = (tmp_path / "nohup.log").read_text()
    assert "SIGHUP" not in output and "Traceback" not in output

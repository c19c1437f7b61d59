"""The ``mqdedup`` command as scripts and operators meet it (issue 42, part 4), as real
subprocesses against real PostgreSQL, Kafka and RabbitMQ: ``relay --drain``, the start and
stop lines of ``worker`` and ``relay``, progress lines on a terminal only, ``replay``'s exit
code after dead letters, one exit code per kind of mistake, and a closed pipe."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, insert
from sqlalchemy.orm import Session

from mqdedup.cli import exitcodes
from mqdedup.db import create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.dedup.store import utcnow
from mqdedup.outbox.store import OutboxStore
from mqdedup.outbox.writer import OutboxWriter, OutgoingMessage
from tests.integration.kafka.helpers import row_counts
from tests.services import REPO, KafkaHelper, Outgoing, RabbitAdmin, wait_for
from tests.support import orders_table

pytestmark = [pytest.mark.integration]
MQDEDUP = str(Path(sys.executable).parent / "mqdedup")
CONSUMER = "tests.acceptance.cli_consumers:Orders"


@pytest.fixture
def setup(kafka: KafkaHelper, pg_url: str) -> Iterator[dict[str, Any]]:
    prefix = f"scr_{uuid.uuid4().hex[:8]}_"
    engine = create_engine(pg_url)
    init_schema(engine, prefix)
    orders_table(prefix).create(engine)
    topic = kafka.create_topic(partitions=2, kind="scripts")
    env = {
        **os.environ,
        "ACCEPT_PREFIX": prefix,
        "ACCEPT_TOPIC": topic,
        "ACCEPT_GROUP": f"group-{topic}",
        "MQDEDUP_DATABASE_URL": pg_url,
        "MQDEDUP_TABLE_PREFIX": prefix,
        "PYTHONPATH": str(REPO),
    }
    env.pop("MQDEDUP_LOG_LEVEL", None)  # the default level: what a user sees
    yield {"prefix": prefix, "engine": engine, "topic": topic, "env": env, "url": pg_url}
    orders_table(prefix).drop(engine, checkfirst=True)
    schema(prefix).metadata.drop_all(engine)
    engine.dispose()


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


def on_a_terminal(*args: str, env: dict[str, str], timeout: float = 120) -> tuple[int, str]:
    """Run ``mqdedup`` with stdout and stderr on a pseudo-terminal; (exit code, output)."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [MQDEDUP, *args], env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=follower,
        stderr=follower,
    )  # fmt: skip
    os.close(follower)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if not ready:
                if process.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the follower side closed: the process is gone
                break
            if not chunk:
                break
            chunks.append(chunk)
        code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(leader)
        if process.poll() is None:
            process.kill()
    return code, b"".join(chunks).decode(errors="replace")


def assert_masked(url: str, output: str) -> None:
    """The database URL's password never shows (``user:***@`` where it is named)."""
    from sqlalchemy.engine import make_url

    password = make_url(url).password
    assert password and f":{password}@" not in output, output


def _outbox_rows(engine: Engine, prefix: str, messages: list[OutgoingMessage]) -> None:
    with Session(engine) as session, session.begin():
        OutboxWriter(session, prefix=prefix).publish_many(messages)


# -- relay --drain -------------------------------------------------------------------------


def test_relay_drain_publishes_the_backlog_then_exits_0(
    kafka: KafkaHelper, rabbit: RabbitAdmin, setup: dict[str, Any]
) -> None:
    engine, prefix, env = setup["engine"], setup["prefix"], setup["env"]
    topic = kafka.create_topic(partitions=3, kind="drained")
    queue = rabbit.queue("drained")
    _outbox_rows(
        engine,
        prefix,
        [OutgoingMessage({"n": n}, topic=topic, key=f"k{n % 7}") for n in range(300)]
        + [OutgoingMessage({"n": n}, exchange="", routing_key=queue) for n in range(40)],
    )
    result = cli("relay", "--drain", "--batch-size", "100", env=env, timeout=180)
    assert result.returncode == exitcodes.OK, result.stderr
    # Every row is on its broker, and the outbox holds nothing pending.
    assert len(kafka.read_all(topic, 300, timeout=60)) == 300
    assert len(rabbit.drain(queue, 40, timeout=60)) == 40
    status = OutboxStore(prefix).status(engine)
    assert (status.pending, status.failed, status.published) == (0, 0, 340)
    # One start line (where from, where to, the password masked) and one stop line.
    lines = result.stderr.splitlines()
    started = [line for line in lines if line.startswith("mqdedup relay: draining")]
    assert len(started) == 1, result.stderr
    assert f"outbox table {prefix}outbox" in started[0] and "Kafka 127.0.0.1:9092" in started[0]
    stopped = [line for line in lines if line.startswith("mqdedup relay --drain: stopped")]
    assert len(stopped) == 1 and "340 published" in stopped[0], result.stderr
    assert "(exit 0)" in stopped[0] and "nothing due left" in stopped[0]
    assert_masked(setup["url"], result.stderr + result.stdout)
    assert ":***@127.0.0.1:5432" in started[0]


def test_relay_drain_exits_9_when_the_broker_refuses_rows(
    rabbit: RabbitAdmin, setup: dict[str, Any]
) -> None:
    engine, prefix, env = setup["engine"], setup["prefix"], setup["env"]
    queue = rabbit.queue("drained")
    nowhere = f"no-such-queue-{uuid.uuid4().hex[:8]}"  # unroutable: returned by the broker
    _outbox_rows(
        engine,
        prefix,
        [OutgoingMessage({"n": n}, exchange="", routing_key=queue) for n in range(5)]
        + [OutgoingMessage({"n": 99}, exchange="", routing_key=nowhere)],
    )
    result = cli("relay", "--drain", "--quiet", env=env, timeout=180)
    assert result.returncode == exitcodes.NOT_DRAINED, result.stderr
    assert "the broker refused 1 row(s)" in result.stderr
    assert "mqdedup relay: draining" not in result.stderr  # --quiet: only the failure
    assert len(rabbit.drain(queue, 5, timeout=60)) == 5  # the routable rows went out
    status = OutboxStore(prefix).status(engine)
    assert status.pending == 1  # the refused row waits for its retry


# -- start and stop lines --------------------------------------------------------------------


def test_worker_says_what_it_consumes_when_it_starts_and_what_it_did_when_it_stops(
    kafka: KafkaHelper, setup: dict[str, Any]
) -> None:
    engine, prefix, env, topic = setup["engine"], setup["prefix"], setup["env"], setup["topic"]
    messages = [Outgoing(f"m-{n}", f'{{"n": {n}}}'.encode()) for n in range(60)]
    kafka.produce(topic, messages + messages[:15])  # 15 duplicates
    worker = subprocess.Popen(
        [MQDEDUP, "worker", CONSUMER, "--shutdown-timeout", "60"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: len(row_counts(engine, prefix)) == 60, 120, "the worker to process")
        # The duplicates come after the originals in each partition: wait for the offsets.
        wait_for(
            lambda: sum(v or 0 for v in kafka.committed(env["ACCEPT_GROUP"], topic).values()) == 75,
            60,
            "the duplicates to be settled",
        )
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=90)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == exitcodes.OK, err
    lines = err.splitlines()
    started = [line for line in lines if line.startswith("mqdedup worker: started")]
    stopped = [line for line in lines if line.startswith("mqdedup worker: stopped")]
    assert len(started) == 1 and len(stopped) == 1, err
    assert f"topics {topic}" in started[0] and f"group group-{topic}" in started[0]
    assert "1 process" in started[0] and "database postgresql+psycopg://" in started[0]
    assert_masked(setup["url"], err + out)
    assert "(exit 0)" in stopped[0]
    assert "60 processed" in stopped[0] and "15 duplicates" in stopped[0], stopped[0]
    assert "0 dead-lettered" in stopped[0]


def test_relay_daemon_start_and_stop_lines_and_quiet(
    rabbit: RabbitAdmin, setup: dict[str, Any]
) -> None:
    engine, prefix, env = setup["engine"], setup["prefix"], setup["env"]
    queue = rabbit.queue("relayed")
    _outbox_rows(
        engine,
        prefix,
        [OutgoingMessage({"n": n}, exchange="", routing_key=queue) for n in range(3)],
    )
    relay = subprocess.Popen(
        [MQDEDUP, "relay", "--processes", "2"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert len(rabbit.drain(queue, 3, timeout=60)) == 3  # the children run
        relay.send_signal(signal.SIGTERM)
        _, err = relay.communicate(timeout=90)
    finally:
        if relay.poll() is None:
            relay.kill()
    assert relay.returncode == exitcodes.OK, err
    lines = err.splitlines()
    assert lines[0].startswith("mqdedup relay: started 2 processes publishing outbox table"), err
    assert "RabbitMQ amqp://guest:***@" in lines[0]  # the broker's password masked
    stopped = [line for line in lines if line.startswith("mqdedup relay: stopped (exit 0)")]
    assert len(stopped) == 1, err
    assert "3 published" in stopped[0]  # the children's counts, added up
    quiet = cli("relay", "--drain", "-q", env=env)
    assert quiet.returncode == exitcodes.OK and quiet.stderr == "" and quiet.stdout == ""


# -- replay: dead letters and progress -----------------------------------------------------------


def test_replay_exits_8_when_every_message_was_dead_lettered(
    kafka: KafkaHelper, setup: dict[str, Any]
) -> None:
    env, topic = setup["env"], setup["topic"]
    kafka.produce(topic, [Outgoing(None, b'{"n": 1}') for _ in range(40)])  # no message id
    result = cli("replay", CONSUMER, env=env, timeout=180)
    assert result.returncode == exitcodes.DEAD_LETTERED, result.stdout + result.stderr
    assert "40 of 40 message(s) dead-lettered" in result.stderr
    assert "dead-lettered in total" in result.stdout
    assert "replay: [" not in result.stderr  # not a terminal: no progress line
    assert len(kafka.read_all(f"{topic}.DLT", 40, timeout=60)) == 40


def test_replay_shows_progress_on_a_terminal_only(
    kafka: KafkaHelper, setup: dict[str, Any]
) -> None:
    env, topic = setup["env"], setup["topic"]
    kafka.produce(topic, [Outgoing(f"p-{n}", b'{"n": 1}') for n in range(500)])
    code, output = on_a_terminal("replay", CONSUMER, env=env, timeout=180)
    assert code == exitcodes.OK, output
    assert "\rreplay: [" in output and "500/500 messages" in output, output
    piped = cli("replay", CONSUMER, env=env, timeout=180)  # now all duplicates
    assert piped.returncode == exitcodes.OK, piped.stderr
    assert "replay:" not in piped.stderr and "\r" not in piped.stderr + piped.stdout
    quiet_code, quiet = on_a_terminal("replay", CONSUMER, "--quiet", env=env, timeout=180)
    assert quiet_code == exitcodes.OK and "\rreplay:" not in quiet


def test_dedup_purge_shows_progress_on_a_terminal_only(setup: dict[str, Any]) -> None:
    engine, prefix, env = setup["engine"], setup["prefix"], setup["env"]
    processed = schema(prefix).processed
    old = utcnow() - timedelta(days=30)

    def old_claims(count: int, tag: str) -> None:
        with engine.begin() as connection:
            connection.execute(
                insert(processed),
                [
                    {"consumer_name": "purged", "message_id": f"{tag}-{n}", "processed_at": old}
                    for n in range(count)
                ],
            )

    old_claims(2500, "a")
    code, output = on_a_terminal(
        "dedup", "purge", "--older-than", "7d", "--chunk-size", "500", env=env
    )
    assert code == exitcodes.OK, output
    assert "\rdedup purge: " in output, output
    assert "dedup purge: 2,500 deleted" in output and "deleted 2500 dedup records" in output
    old_claims(1000, "b")
    piped = cli("dedup", "purge", "--older-than", "7d", "--chunk-size", "500", env=env)
    assert piped.returncode == exitcodes.OK, piped.stderr
    assert piped.stderr == "" and piped.stdout.strip() == (
        "deleted 1000 dedup records older than 7d"
    )


# -- exit codes, ranges and pipes --------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "extra_env", "code", "message"),
    [
        # 2: the command line (argparse's own errors and the commands' checks alike)
        (["replay", CONSUMER, "--from", "5", "--to", "2"], {}, exitcodes.USAGE, "--to 2 is not after --from 5"),  # noqa: E501
        (
            ["replay", CONSUMER, "--from", "2026-12-02T00:00", "--to", "2026-12-01T00:00"],
            {},
            exitcodes.USAGE,
            "the range is empty",
        ),
        (["replay", CONSUMER, "--from", "yesterday-ish"], {}, exitcodes.USAGE, "cannot read 'yesterday-ish' as a position"),  # noqa: E501
        (["dedup", "purge", "--older-than", "7x"], {}, exitcodes.USAGE, "invalid duration '7x'"),
        (["dedup", "purge", "--older-than", "7d", "--chunk-size", "0"], {}, exitcodes.USAGE, "must be at least 1"),  # noqa: E501
        (["status", "--no-such-flag"], {}, exitcodes.USAGE, "unrecognized arguments"),
        (["demo", "--duplicates", "2"], {}, exitcodes.USAGE, "--duplicates must be in [0, 1]"),
        # 3: a setting, wherever it came from
        (["worker", CONSUMER], {"MQDEDUP_PROCESSES": "0"}, exitcodes.CONFIGURATION, "--processes must be at least 1"),  # noqa: E501
        (["status"], {"MQDEDUP_DATABASE_URL": "foo://x"}, exitcodes.CONFIGURATION, "unknown database kind 'foo'"),  # noqa: E501
        (["status"], {"MQDEDUP_LOG_LEVEL": "LOUD"}, exitcodes.CONFIGURATION, "unknown log level"),
        # 4: the consumer reference
        (["replay", "tests.acceptance.nope:Orders"], {}, exitcodes.CONSUMER_IMPORT, "cannot import module"),  # noqa: E501
        # 5: the database out of reach
        (["status"], {"MQDEDUP_DATABASE_URL": "postgresql://u:pw@127.0.0.1:1/db"}, exitcodes.DATABASE_UNAVAILABLE, "cannot connect to database"),  # noqa: E501
        # 6: the broker out of reach
        (["relay", "--drain", "--kafka-bootstrap", "127.0.0.1:1"], {"MQDEDUP_RABBITMQ_URL": ""}, exitcodes.BROKER_UNAVAILABLE, "cannot reach Kafka"),  # noqa: E501
    ],
)  # fmt: skip
def test_one_exit_code_per_kind_of_mistake(
    setup: dict[str, Any], args: list[str], extra_env: dict[str, str], code: int, message: str
) -> None:
    env = {**setup["env"], **extra_env}
    result = cli(*args, env=env, timeout=90)
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # one line
    assert "Traceback" not in result.stderr and "pw@" not in result.stderr


def test_a_reader_that_goes_away_ends_the_output_quietly(setup: dict[str, Any]) -> None:
    engine, prefix, env = setup["engine"], setup["prefix"], setup["env"]
    with engine.begin() as connection:  # a status screen far longer than a pipe's buffer
        connection.execute(
            insert(schema(prefix).processed),
            [
                {"consumer_name": f"consumer-{n:05d}", "message_id": "m", "processed_at": utcnow()}
                for n in range(4000)
            ],
        )
    shell = subprocess.run(
        ["bash", "-c", f'set -o pipefail; "{MQDEDUP}" status | head -n 2; echo "rc=$?"'],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert shell.stdout.splitlines()[0] == "Dedup table", shell.stdout
    assert shell.stdout.splitlines()[-1] == f"rc={exitcodes.BROKEN_PIPE}", shell.stdout
    assert shell.stderr == "", shell.stderr  # no traceback, no "Exception ignored"
    # The same with a pipe this test closes after the first line.
    status = subprocess.Popen(
        [MQDEDUP, "status"], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert status.stdout is not None and status.stderr is not None
    assert status.stdout.readline() == b"Dedup table\n"
    status.stdout.close()
    assert status.wait(timeout=120) == exitcodes.BROKEN_PIPE
    assert status.stderr.read() == b""

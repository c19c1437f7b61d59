"""One table prefix for every command: flag, environment variable or TOML, never ignored.

``db init --table-prefix P`` then ``worker`` / ``relay`` / ``status`` / ``dedup`` /
``outbox`` / ``replay`` / ``db check`` with the same prefix (given as a flag, as
``MQDEDUP_TABLE_PREFIX`` or in the config file) all work on P's tables; a consumer class
that pins another prefix, or a prefix the tables cannot hold, is refused in one line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, inspect, select

from mqdedup.cli import exitcodes
from mqdedup.db import create_engine
from mqdedup.db.schema import schema
from mqdedup.outbox.store import OutboxStore
from tests.services import REPO, KafkaHelper, Outgoing, wait_for

MQDEDUP = str(Path(sys.executable).parent / "mqdedup")
CONSUMER = "tests.acceptance.prefix_consumers:PrefixOrders"
PINNED = "tests.acceptance.prefix_consumers:PinnedOrders"
MESSAGES = 20


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


def _base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MQDEDUP_TABLE_PREFIX"}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def _count(engine: Engine, table: Any, *where: Any) -> int:
    with engine.connect() as connection:
        return int(
            connection.execute(select(func.count()).select_from(table).where(*where)).scalar_one()
        )


@pytest.fixture
def prefix(pg_url: str) -> Iterator[str]:
    name = f"p{uuid.uuid4().hex[:8]}_"
    yield name
    engine = create_engine(pg_url)
    schema(name).metadata.drop_all(engine)
    engine.dispose()


@pytest.mark.integration
@pytest.mark.slow
def test_every_command_uses_the_configured_prefix(
    kafka: KafkaHelper, pg_url: str, prefix: str, tmp_path: Path
) -> None:
    topic = kafka.create_topic(partitions=1, kind="prefix")
    out_topic = kafka.create_topic(partitions=1, kind="prefix-out")
    env = _base_env(
        MQDEDUP_DATABASE_URL=pg_url,
        PREFIX_TOPIC=topic,
        PREFIX_GROUP=f"group-{topic}",
        PREFIX_OUT_TOPIC=out_topic,
    )
    tables = schema(prefix)
    engine = create_engine(pg_url)
    try:
        init = cli("db", "init", "--table-prefix", prefix, env=env)
        assert init.returncode == exitcodes.OK, init.stderr
        assert f"{prefix}processed_messages" in inspect(engine).get_table_names()

        kafka.produce(topic, [Outgoing(f"m-{n}", b"{}") for n in range(MESSAGES)])
        worker = subprocess.Popen(
            [MQDEDUP, "worker", CONSUMER, "--table-prefix", prefix],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(
                lambda: worker.poll() is not None or _count(engine, tables.outbox) == MESSAGES,
                90,
                "the worker to write claims and outbox rows under the prefix",
            )
            assert worker.poll() is None, worker.communicate()[1][-2000:]
            worker.send_signal(signal.SIGTERM)
            worker.communicate(timeout=60)
        finally:
            if worker.poll() is None:
                worker.kill()
        assert _count(engine, tables.processed) == MESSAGES

        relay = subprocess.Popen(
            [MQDEDUP, "relay", "--table-prefix", prefix, "--poll-interval", "0.2"],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            store = OutboxStore(prefix)  # rows deleted and counted (the default)
            wait_for(
                lambda: relay.poll() is not None or store.status(engine).published == MESSAGES,
                60,
                "the relay to publish the prefix's outbox",
            )
            assert relay.poll() is None, relay.communicate()[1][-2000:]
            relay.send_signal(signal.SIGTERM)
            relay.communicate(timeout=60)
        finally:
            if relay.poll() is None:
                relay.kill()
        assert len(kafka.read_all(out_topic, MESSAGES)) == MESSAGES

        with_env = {**env, "MQDEDUP_TABLE_PREFIX": prefix}
        config = tmp_path / "mqdedup.toml"
        config.write_text(f'[mqdedup]\ntable_prefix = "{prefix}"\n')

        status = cli("status", CONSUMER, env=with_env)
        assert status.returncode == exitcodes.OK, status.stderr
        assert f"{MESSAGES} records" in status.stdout and f"published {MESSAGES}" in status.stdout

        stats = cli("dedup", "stats", "--config", str(config), env=env)
        assert stats.returncode == exitcodes.OK, stats.stderr
        assert f"{MESSAGES} records" in stats.stdout

        outbox = cli("outbox", "status", "--table-prefix", prefix, env=env)
        assert outbox.returncode == exitcodes.OK, outbox.stderr
        assert f"published {MESSAGES}" in outbox.stdout

        check = cli("db", "check", "--config", str(config), env=env)
        assert check.returncode == exitcodes.OK, check.stdout + check.stderr

        replay = cli("replay", CONSUMER, "--from", "beginning", "--dry-run", env=with_env)
        assert replay.returncode == exitcodes.OK, replay.stderr
        duplicates = [line for line in replay.stdout.splitlines() if "duplicates" in line]
        assert duplicates and duplicates[0].split()[-1] == str(MESSAGES), replay.stdout
    finally:
        engine.dispose()


@pytest.mark.integration
@pytest.mark.parametrize("command", ["worker", "replay", "status"])
def test_a_class_prefix_that_contradicts_the_configured_one_is_refused(
    pg_url: str, command: str
) -> None:
    env = _base_env(MQDEDUP_DATABASE_URL=pg_url, MQDEDUP_TABLE_PREFIX="other_")
    result = cli(command, PINNED, env=env)
    assert result.returncode == exitcodes.CONFIGURATION, result.stderr
    assert (
        f"{PINNED} sets table_prefix = 'pinned_' but environment variable "
        "MQDEDUP_TABLE_PREFIX says 'other_'" in result.stderr
    )
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["db", "init", "--table-prefix", "P_mq_"], "must be lower-case letters"),
        (["db", "check", "--table-prefix", "x" * 50], "is too long"),
        (["relay", "--table-prefix", "x" * 41], "use at most 40 characters"),
        (["worker", CONSUMER, "--table-prefix", "bad-prefix"], "must be lower-case letters"),
        (["dedup", "stats", "--table-prefix", "1abc_"], "not starting with a digit"),
    ],
)
def test_a_prefix_the_tables_cannot_hold_is_refused_before_connecting(
    args: list[str], message: str
) -> None:
    # The database URL points nowhere: the prefix must be refused before any connection.
    env = _base_env(MQDEDUP_DATABASE_URL="postgresql://u:pw@127.0.0.1:1/db")
    result = cli(*args, env=env)
    assert result.returncode == exitcodes.CONFIGURATION, result.stderr
    assert message in result.stderr and "--table-prefix: table prefix" in result.stderr
    assert "Traceback" not in result.stderr

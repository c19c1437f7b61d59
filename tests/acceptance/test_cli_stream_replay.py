"""``mqdedup replay`` over a RabbitMQ stream queue, by offset and by time."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from mqdedup.cli import exitcodes
from tests.integration.kafka.helpers import row_counts
from tests.services import REPO, RabbitAdmin, prefixed_database, table_prefix
from tests.support import orders_table

pytestmark = pytest.mark.integration
MQDEDUP = str(Path(sys.executable).parent / "mqdedup")
CONSUMER = "tests.acceptance.cli_consumers:StreamOrders"


@pytest.fixture
def stream(pg_url: str, rabbit: RabbitAdmin) -> Iterator[dict[str, Any]]:
    import pika

    name = rabbit.queue("stream", **{"x-queue-type": "stream"})
    rabbit.created.append(f"{name}.dlq")
    channel = rabbit.channel()
    channel.confirm_delivery()
    prefix = table_prefix()
    orders = orders_table(prefix)
    env = {
        **os.environ,
        "ACCEPT_PREFIX": prefix,
        "ACCEPT_STREAM": name,
        "MQDEDUP_DATABASE_URL": pg_url,
        "PYTHONPATH": str(REPO),
    }

    def publish(numbers: range, duplicates: int = 0) -> None:
        ids = [f"s-{n}" for n in numbers] + [f"s-{n}" for n in list(numbers)[:duplicates]]
        for message_id in ids:
            channel.basic_publish(
                "",
                name,
                f'{{"id": "{message_id}"}}'.encode(),
                pika.BasicProperties(message_id=message_id, delivery_mode=2),
            )

    with prefixed_database(pg_url, "PostgreSQL", orders.metadata, prefix=prefix) as db:
        yield {"engine": db.engine, "prefix": prefix, "env": env, "publish": publish}


def replay(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MQDEDUP, "replay", CONSUMER, *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def count(output: str, label: str) -> int:
    line = next(line for line in output.splitlines() if line.strip().startswith(label))
    return int(line.split()[-1].replace(",", ""))


def test_stream_replay_processes_once_then_only_duplicates(stream: dict[str, Any]) -> None:
    stream["publish"](range(300), duplicates=60)
    first = replay(stream["env"])
    assert first.returncode == 0, first.stderr
    assert count(first.stdout, "new (processed now)") == 300
    assert count(first.stdout, "duplicates") == 60
    again = replay(stream["env"], "--from", "0")
    assert again.returncode == 0, again.stderr
    assert (count(again.stdout, "new (processed now)"), count(again.stdout, "duplicates")) == (
        0,
        360,
    )

    middle = datetime.now(UTC)
    stream["publish"](range(300, 350))
    dry = replay(stream["env"], "--from", middle.isoformat(), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert count(dry.stdout, "new (would be processed)") == 50
    late = replay(stream["env"], "--from", middle.isoformat())
    assert count(late.stdout, "new (processed now)") == 50
    counts = row_counts(stream["engine"], stream["prefix"])
    assert len(counts) == 350 and set(counts.values()) == {1}


def test_stream_replay_after_a_purge_needs_a_later_start(stream: dict[str, Any]) -> None:
    stream["publish"](range(20))
    assert replay(stream["env"]).returncode == 0
    purge = subprocess.run(
        [
            MQDEDUP,
            "dedup",
            "purge",
            "--older-than",
            "0s",
            "--yes",
            "--table-prefix",
            stream["prefix"],
        ],
        env=stream["env"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert purge.returncode == 0, purge.stderr
    refused = replay(stream["env"])
    assert refused.returncode == exitcodes.CHECK_FAILED
    assert "retention horizon" in refused.stderr and "Traceback" not in refused.stderr
    assert len(row_counts(stream["engine"], stream["prefix"])) == 20

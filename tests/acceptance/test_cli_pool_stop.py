"""SIGTERM drains a worker whose step waits for a connection (issue 40).

``mqdedup worker --shutdown-timeout 10`` behind a private PgBouncer whose one server
connection (``default_pool_size = 1``) the message's own transaction holds: the
message's ``ctx.step`` waits in PgBouncer's queue, whose ``query_wait_timeout`` (120 s)
outlasts the shutdown timeout. Before: the child kept waiting, the supervisor killed it
(exit code 7). Now the stop signal abandons the step's wait: the process exits 0, the
message is neither acked nor dead-lettered, the step was never called; a worker started
afterwards on the database directly processes it once, calling the step once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from mqdedup.cli import exitcodes
from tests.acceptance.test_cli_process_killer import MQDEDUP
from tests.integration.kafka.helpers import row_counts as order_counts
from tests.integration.postgres_ha.test_pgbouncer_steps import private_pgbouncer
from tests.integration.rabbitmq.support import make_consumer
from tests.services import REPO, RabbitAdmin, prefixed_database, table_prefix, wait_for
from tests.support import orders_table

pytestmark = pytest.mark.integration

CONSUMER = "tests.acceptance.pool_consumers:ChargeBehindSmallPool"
SHUTDOWN_TIMEOUT = 10


def _clients_waiting(pooler_url: str) -> int:
    """``cl_waiting`` of the private PgBouncer's pools (its console, as a stats user)."""
    from sqlalchemy.engine import make_url

    url = make_url(pooler_url)
    shown = subprocess.run(
        [
            "psql",
            "-h",
            str(url.host),
            "-p",
            str(url.port),
            "-U",
            str(url.username),
            "-d",
            "pgbouncer",
            "-At",
            "-F",
            "|",
            "-c",
            "SHOW POOLS",
        ],
        env={**os.environ, "PGPASSWORD": str(url.password)},
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    waiting = 0
    for line in shown.stdout.splitlines():
        fields = line.split("|")
        if len(fields) > 3 and fields[0] != "pgbouncer":
            waiting += int(fields[3])  # database|user|cl_active|cl_waiting|…
    return waiting


def _worker(url: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """``mqdedup worker <consumer> --processes 1 --shutdown-timeout 10`` on ``url``."""
    return subprocess.Popen(
        [
            MQDEDUP,
            "worker",
            CONSUMER,
            "--processes",
            "1",
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT),
        ],
        env={**env, "MQDEDUP_DATABASE_URL": url},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stop(process: subprocess.Popen[str]) -> str:
    """SIGTERM, then what the process wrote on stderr (killed after 60 s)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        _, errors = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return errors


def test_sigterm_ends_a_step_waiting_in_the_poolers_queue_within_the_shutdown_timeout(
    pg_url: str, rabbitmq_url: str, tmp_path: Path
) -> None:
    prefix = table_prefix()
    orders = orders_table(prefix)
    queue = f"pool-stop-{uuid.uuid4().hex[:8]}"
    markers = tmp_path / "markers"
    markers.mkdir()
    with (
        private_pgbouncer(pg_url, pool_size=1, query_wait_timeout=120) as pooler,
        prefixed_database(pg_url, "PostgreSQL", orders.metadata, prefix=prefix) as db,
        contextlib.closing(RabbitAdmin(rabbitmq_url)) as admin,
    ):
        admin.declare(make_consumer(queue, prefix, rabbitmq_url)())
        admin.publish(queue, ["m-1"], body=lambda i: json.dumps({"order": i}).encode())
        env = {
            **os.environ,
            "POOL_PREFIX": prefix,
            "POOL_QUEUE": queue,
            "POOL_MARKERS": str(markers),
            "MQDEDUP_TABLE_PREFIX": prefix,
            "MQDEDUP_RABBITMQ_URL": rabbitmq_url,
            "PYTHONPATH": str(REPO),
        }
        try:
            worker = _worker(pooler, env)
            try:
                wait_for(
                    lambda: (
                        worker.poll() is not None
                        or ((markers / "m-1-waiting").exists() and _clients_waiting(pooler) >= 1)
                    ),
                    60,
                    "the step waiting in PgBouncer's queue",
                )
                assert worker.poll() is None, _stop(worker)[-3000:]
                stopped_at = time.monotonic()
                errors = _stop(worker)
                took = time.monotonic() - stopped_at
            finally:
                _stop(worker)
            assert worker.returncode == exitcodes.OK, (took, errors[-3000:])
            print(f"\n[SIGTERM while a step waits in PgBouncer's queue] exit in {took:.1f}s")
            assert took < SHUTDOWN_TIMEOUT + 20, took  # the supervisor's own limit + margin
            assert "batch abandoned on stop: stop requested while step 'charge'" in errors
            assert not (markers / "calls").exists()  # the step was never called
            assert order_counts(db.engine, prefix) == {}  # the transaction rolled back
            assert admin.depth(f"{queue}.dlq") == 0
            wait_for(lambda: admin.depth(queue) == 1, 30, "the message given back to its queue")

            again = _worker(pg_url, env)  # on the database directly: two connections
            try:
                wait_for(
                    lambda: (
                        again.poll() is not None
                        or (
                            order_counts(db.engine, prefix) == {"m-1": 1}
                            and admin.depth(queue) == 0
                        )
                    ),
                    60,
                    "the message processed after its redelivery",
                )
            finally:
                errors = _stop(again)
            assert again.returncode == exitcodes.OK, errors[-3000:]
            assert order_counts(db.engine, prefix) == {"m-1": 1}
            assert (markers / "calls").read_text().count("\n") == 1  # called once
            assert admin.depth(f"{queue}.dlq") == 0
        finally:
            admin.delete(queue, f"{queue}.dlq")

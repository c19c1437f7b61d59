"""Steps sized for their pool, through a PRIVATE PgBouncer (issue 40).

A ``ctx.step`` runs in a short transaction of its own while the message's transaction
holds its server connection: through a transaction pooler each worker process needs TWO
server connections (``docs/operations.md``). Before: with ``default_pool_size`` equal to
the worker processes, the steps waited for each other until PgBouncer's
``query_wait_timeout``, which was then waited out for ever as "database unavailable".

* the documented size (2 per worker, 2 workers, pool 4): 600 messages with a step each
  are processed, each step called once;
* the pool too small by one (1 worker, pool 1): the step's wait ends in PgBouncer's
  ``query_wait_timeout``; it is not logged as the database being down, the worker is
  not ready (``/healthz``'s check of the snapshot) and counts it, and the message ends
  in the dead-letter queue with one clear line naming the pooler's pool.

Each test starts its own PgBouncer (``default_pool_size``, ``query_wait_timeout`` of its
own) in front of the shared PostgreSQL, on a free port, and stops it afterwards.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert

from mqdedup import Consumer, Context, InMemoryBroker, Message, RetryPolicy
from mqdedup.cli.health import snapshot_ready
from mqdedup.consumers.worker import Worker
from mqdedup.db import create_engine
from mqdedup.stopping import StopToken
from tests.integration.postgres_ha.support import order_counts
from tests.services import (
    TestDatabase,
    free_port,
    prefixed_database,
    require_service,
    table_prefix,
    wait_for,
)
from tests.support import orders_table

pytestmark = pytest.mark.integration

PGBOUNCER = "/usr/sbin/pgbouncer"
QUEUE = "charges"


@contextlib.contextmanager
def private_pgbouncer(direct_url: str, *, pool_size: int, query_wait_timeout: int) -> Iterator[str]:
    """A PgBouncer in transaction mode in front of the PostgreSQL of ``direct_url``,
    with its own ``default_pool_size`` and ``query_wait_timeout``; yields its URL. Its
    files are in a directory of its own under /tmp, which the postgres user can reach
    (pytest's tmp_path is private to root)."""
    if not os.path.exists(PGBOUNCER) or os.geteuid() != 0:
        require_service("PgBouncer", f"{PGBOUNCER} run as the postgres user (needs root)")
    from sqlalchemy.engine import make_url

    server = make_url(direct_url)
    port = free_port()
    state = Path(tempfile.mkdtemp(prefix="mqdedup-pgbouncer-"))
    (state / "userlist.txt").write_text(f'"{server.username}" "{server.password}"\n')
    ini = state / "pgbouncer.ini"
    ini.write_text(
        f"""[databases]
* = host={server.host} port={server.port}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
pool_mode = transaction
auth_type = scram-sha-256
auth_file = {state}/userlist.txt
max_client_conn = 200
default_pool_size = {pool_size}
query_wait_timeout = {query_wait_timeout}
stats_users = {server.username}
server_reset_query =
ignore_startup_parameters = extra_float_digits
logfile = {state}/pgbouncer.log
pidfile = {state}/pgbouncer.pid
"""
    )
    subprocess.run(["chown", "-R", "postgres:postgres", str(state)], check=True)
    os.chmod(state / "userlist.txt", 0o600)
    os.chmod(state, 0o755)
    subprocess.run(
        ["runuser", "-u", "postgres", "--", PGBOUNCER, "-d", "-q", str(ini)],
        check=True,
        timeout=30,
    )
    pidfile = state / "pgbouncer.pid"
    wait_for(pidfile.exists, 10, "the private PgBouncer's pid file")
    pid = int(pidfile.read_text().strip())
    url = f"postgresql+psycopg://{server.username}:{server.password}@127.0.0.1:{port}/{server.database}"
    try:
        probe = create_engine(url)
        try:
            wait_for(lambda: _answers(probe), 15, "the private PgBouncer answering")
        finally:
            probe.dispose()
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
        wait_for(lambda: not _alive(pid), 30, "the private PgBouncer stopped")
        shutil.rmtree(state, ignore_errors=True)


def business_database(direct_url: str) -> contextlib.AbstractContextManager[TestDatabase]:
    """mqdedup's tables and ``<prefix>orders`` under a fresh prefix, created directly."""
    prefix = table_prefix()
    return prefixed_database(direct_url, "PostgreSQL", orders_table(prefix).metadata, prefix=prefix)


def _answers(engine: Any) -> bool:
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql("SELECT 1")
        return True
    except Exception:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def charging(prefix: str, calls: Counter[str], lock: threading.Lock) -> type[Consumer]:
    orders = orders_table(prefix)

    class Charging(Consumer):
        name = "charging"
        table_prefix = prefix
        batch_size = 20
        poll_timeout = 0.02
        retry_policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.02)

        def handle(self, message: Message, ctx: Context) -> Any:
            def charge(key: str) -> dict[str, str]:
                with lock:
                    calls[str(message.id)] += 1
                return {"charge": key}

            charged = ctx.step("charge", charge)
            ctx.session.execute(insert(orders).values(message_id=message.id, body="x"))
            return charged

    return Charging


def test_steps_through_pgbouncer_with_the_documented_pool_size_process_600_messages(
    direct_url: str,
) -> None:
    """2 workers (each its own engine, as 2 processes), default_pool_size 4 = 2 x 2."""
    with (
        private_pgbouncer(direct_url, pool_size=4, query_wait_timeout=20) as url,
        business_database(direct_url) as database,
    ):
        if True:
            calls: Counter[str] = Counter()
            lock = threading.Lock()
            consumer = charging(database.prefix, calls, lock)
            broker = InMemoryBroker()
            ids = [f"m-{n}" for n in range(600)]
            for message_id in ids:
                broker.publish(QUEUE, json.dumps({}), message_id=message_id)
            engines = [create_engine(url) for _ in range(2)]
            stop = StopToken()
            workers = [
                Worker(consumer(), broker.transport(QUEUE), engine, stop=stop) for engine in engines
            ]
            threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
            started = time.monotonic()
            for thread in threads:
                thread.start()
            try:
                wait_for(
                    lambda: sum(order_counts(database.engine, database.prefix).values()) >= 600,
                    120,
                    "600 messages with a step processed through PgBouncer",
                    interval=0.2,
                )
                took = time.monotonic() - started
            finally:
                stop.request()
                for thread in threads:
                    thread.join(timeout=60)
                for engine in engines:
                    engine.dispose()
            assert order_counts(database.engine, database.prefix) == dict.fromkeys(ids, 1)
            assert calls == dict.fromkeys(ids, 1)
            assert not broker.dead_letters
            assert sum(w.metrics.pool_timeouts for w in workers) == 0
            print(f"\n[pgbouncer, pool 4, 2 workers] 600 messages with a step: {took:.1f}s")


def test_a_pgbouncer_pool_too_small_by_one_is_one_clear_line_and_not_ready(
    direct_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """1 worker, default_pool_size 1 (it needs 2): never "database unavailable"."""
    with (
        private_pgbouncer(direct_url, pool_size=1, query_wait_timeout=1) as url,
        business_database(direct_url) as database,
    ):
        engine = create_engine(url)
        try:
            calls: Counter[str] = Counter()
            consumer = charging(database.prefix, calls, threading.Lock())
            broker = InMemoryBroker()
            for message_id in ("m-0", "m-1"):
                broker.publish(QUEUE, json.dumps({}), message_id=message_id)
            stop = StopToken()
            transport = broker.transport(QUEUE)
            worker = Worker(consumer(), transport, engine, stop=stop)
            thread = threading.Thread(target=worker.run, daemon=True)
            readiness: list[bool] = []
            with caplog.at_level(logging.INFO, logger="mqdedup"):
                thread.start()
                try:
                    wait_for(
                        lambda: worker.metrics.pool_timeouts > 0, 60, "the pooler's queue timeout"
                    )
                    readiness.append(snapshot_ready(worker.metrics.snapshot(histograms=False)))
                    wait_for(
                        lambda: broker.pending(QUEUE) == 0 and transport.in_flight == 0,
                        90,
                        "both messages settled, not waited out as an outage",
                        interval=0.1,
                    )
                    readiness.append(snapshot_ready(worker.metrics.snapshot(histograms=False)))
                finally:
                    stop.request()
                    thread.join(timeout=60)
            assert not thread.is_alive()
        finally:
            engine.dispose()

    assert readiness == [False, False]  # /healthz: not ready while it gets no connection
    letters = {str(d.message.id): d.record.reason for d in broker.dead_letters[QUEUE]}
    assert set(letters) == {"m-0", "m-1"}
    assert all("query_wait_timeout" in r and "default_pool_size" in r for r in letters.values())
    lines = [r.getMessage() for r in caplog.records]
    assert not [line for line in lines if "unavailable" in line], lines  # not "database down"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and all("default_pool_size" in line for line in errors), errors

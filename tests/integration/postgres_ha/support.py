"""Parts of the PgBouncer and failover tests: ``mqdedup worker`` processes killed with
``kill -9``, messages with duplicates, and a PRIVATE primary with its streaming replica
(``scripts/services.sh`` with its own state dir and ports; never the shared PostgreSQL)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, func, select

from mqdedup.db import create_engine
from tests.services import REPO, SERVICES, free_port, wait_for
from tests.support import orders_table

MQDEDUP = str(Path(sys.executable).parent / "mqdedup")


def with_duplicates(rng: random.Random, total: int, share: float, label: str) -> list[str]:
    """``total`` message ids of which ``share`` repeat an earlier id (at a later position)."""
    copies = round(total * share)
    unique = [f"{label}-{n}" for n in range(total - copies)]
    placed = [(float(n), message_id) for n, message_id in enumerate(unique)]
    for index in rng.choices(range(len(unique)), k=copies):
        placed.append((rng.uniform(index + 0.5, len(unique)), unique[index]))
    return [message_id for _, message_id in sorted(placed)]


def order_counts(engine: Engine, prefix: str) -> dict[str, int]:
    """Business rows per message id."""
    table = orders_table(prefix)
    with engine.connect() as connection:
        rows = connection.execute(
            select(table.c.message_id, func.count()).group_by(table.c.message_id)
        ).all()
    return {row[0]: int(row[1]) for row in rows}


def total_orders(engine: Engine, prefix: str) -> int:
    table = orders_table(prefix)
    with engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(table)).scalar_one())


class MqdedupWorker:
    """``mqdedup worker <consumer> --processes 1`` (supervisor and child in their own
    process group, so that ``kill_9`` kills both at once, like a crashed pod); with
    ``consumer=None``, ``mqdedup relay``."""

    def __init__(self, consumer: str | None, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.log = log
        self._output = log.open("ab")
        command = ["worker", consumer] if consumer else ["relay"]
        self.process = subprocess.Popen(
            [
                MQDEDUP,
                *command,
                "--processes",
                "1",
                "--health-port",
                str(self.port),
                "--health-host",
                "127.0.0.1",
                "--shutdown-timeout",
                "30",
                "--log-level",
                "WARNING",
            ],
            env={**env, "PYTHONPATH": str(REPO)},
            cwd=REPO,
            stdout=self._output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def health(self) -> dict[str, Any]:
        """``/healthz`` as JSON (its body on 503 too); {} while nobody answers."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
                return dict(json.load(r))
        except urllib.error.HTTPError as error:
            return dict(json.loads(error.read() or b"{}"))
        except (OSError, ValueError):
            return {}

    def ensure_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise AssertionError(f"mqdedup worker exited with {code}:\n{self.tail()}")

    def kill_9_child(self) -> int:
        """SIGKILL to the process running the consumer (``/healthz``'s pid); the
        supervisor starts a new one. Returns the killed pid."""
        self.ensure_alive()
        pids: list[int] = []

        def known() -> bool:
            pids[:] = [int(pid) for pid in self.health().get("pids", []) if pid]
            return bool(pids)

        wait_for(known, 60, "the worker's child process")
        os.kill(pids[0], signal.SIGKILL)
        return pids[0]

    def restarted(self, killed: int) -> bool:
        """A child other than ``killed`` runs and the worker is ready."""
        state = self.health()
        pids = [int(pid) for pid in state.get("pids", []) if pid]
        return bool(pids) and killed not in pids and state.get("ready") is True

    def kill_9(self) -> None:
        """SIGKILL to the supervisor and its child: no batch finishes, nothing is settled."""
        self.ensure_alive()
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self._output.close()

    def stop(self) -> int:
        """SIGTERM (graceful) and the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
            self._output.close()

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class PrimaryWithReplica:
    """A PRIVATE PostgreSQL primary and its streaming replica, own state dir and ports.

    ``url`` names both hosts with ``target_session_attrs=read-write``: a client
    reconnecting after the failover finds the promoted replica.
    """

    def __init__(self, state_dir: Path, *, synchronous: bool) -> None:
        self.state_dir = state_dir
        self.synchronous = synchronous
        self._ports(free_port(), free_port())

    def _ports(self, primary: int, replica: int) -> None:
        self.primary_port, self.replica_port = primary, replica
        self.env = {
            **os.environ,
            "MQDEDUP_STATE_DIR": str(self.state_dir),
            "PG_PORT": str(self.primary_port),
            "PG_REPLICA_PORT": str(self.replica_port),
            "PG_SYNC_REPLICATION": "on" if self.synchronous else "off",
        }
        auth = "mqdedup:mqdedup@"
        self.primary_url = f"postgresql://{auth}127.0.0.1:{self.primary_port}/mqdedup"
        self.replica_url = f"postgresql://{auth}127.0.0.1:{self.replica_port}/mqdedup"
        self.url = (
            f"postgresql://{auth}127.0.0.1:{self.primary_port},127.0.0.1:{self.replica_port}"
            "/mqdedup?target_session_attrs=read-write"
        )

    def services(self, action: str, *names: str) -> str:
        result = subprocess.run(
            ["bash", str(SERVICES), action, *names],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"services.sh {action} {names} failed:\n{result.stderr}")
        return result.stdout + result.stderr

    def start(self) -> None:
        """Start both; once more on two other ports if that failed (a port taken between
        choosing it and binding it), saying why."""
        try:
            self.services("start", "postgres", "pg-replica")
        except RuntimeError as error:
            print(f"[primary with replica] starting again on other ports after: {error}")
            self.close()
            self._ports(free_port(), free_port())
            self.services("start", "postgres", "pg-replica")

    def cut_replication(self) -> None:
        """Disconnect the replica from the primary (its ``primary_conninfo`` emptied):
        it keeps the WAL it has and gets no more, as a standby that lags or lost its
        network. A synchronous primary's commits then wait; an asynchronous one goes on."""
        engine = create_engine(self.replica_url)
        try:
            with engine.connect() as plain:
                connection = plain.execution_options(isolation_level="AUTOCOMMIT")
                connection.exec_driver_sql("ALTER SYSTEM SET primary_conninfo = ''")
                connection.exec_driver_sql("SELECT pg_reload_conf()")

            def disconnected() -> bool:
                with engine.connect() as connection:
                    found = connection.exec_driver_sql("SELECT count(*) FROM pg_stat_wal_receiver")
                    return int(found.scalar_one()) == 0

            wait_for(disconnected, 30, "the replica's WAL receiver gone")
        finally:
            engine.dispose()

    def kill_primary(self) -> None:
        """``kill -9`` of the primary's postmaster and its children."""
        self.services("kill", "postgres")

    def promote(self) -> float:
        """Promote the replica; the monotonic time when it accepts writes."""
        self.services("start", "pg-promote")
        return time.monotonic()

    def close(self) -> None:
        for name in ("pg-replica", "postgres"):
            with contextlib.suppress(RuntimeError):  # cleanup: report the test's own failure
                self.services("kill", name)


def wait_rows(engine: Engine, prefix: str, at_least: int, timeout: float, what: str) -> None:
    wait_for(lambda: total_orders(engine, prefix) >= at_least, timeout, what, interval=0.05)

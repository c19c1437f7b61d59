"""The Django example project as the tests run it: a fresh database, manage.py, env.

Django is never set up in the suite's own process (pytest-django stays inactive there):
everything Django runs in subprocesses — ``manage.py``, worker processes, and the
scenario modules run by a pytest of their own (``scenarios.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url

from mqdedup.db import create_engine
from tests.integration.asyncio.proxy import CuttableProxy
from tests.services import REPO

EXAMPLE = REPO / "examples" / "django_orders"
PYTHON = sys.executable
MQDEDUP = str(Path(sys.executable).parent / "mqdedup")


@contextlib.contextmanager
def fresh_database(server_url: str) -> Iterator[str]:
    """A new, empty database on the shared PostgreSQL or MariaDB server; dropped after."""
    name = f"dj_{uuid.uuid4().hex[:10]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    force = " WITH (FORCE)" if admin.dialect.name == "postgresql" else ""
    try:
        with admin.connect() as connection:
            connection.execute(text(f"CREATE DATABASE {name}"))
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f"DROP DATABASE IF EXISTS {name}{force}"))
        admin.dispose()


def example_env(database_url: str, **extra: str) -> dict[str, str]:
    """The environment the example project reads (see its settings.py)."""
    tag = uuid.uuid4().hex[:8]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(EXAMPLE), str(REPO)]),
        "DJANGO_SETTINGS_MODULE": "orders_project.settings",
        "ORDERS_DATABASE_URL": database_url,
        "ORDERS_TABLE_PREFIX": f"dj_{tag}_",
        "ORDERS_TOPIC": f"dj-orders-{tag}",
        "ORDERS_QUEUE": f"dj-orders-{tag}",
        **extra,
    }


def run(
    *command: str, env: dict[str, str], timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in the example's folder (the caller checks the exit code)."""
    return subprocess.run(
        command, check=False, cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=timeout
    )


def manage(*arguments: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python manage.py <arguments>`` of the example project."""
    return run(PYTHON, "manage.py", *arguments, env=env)


def migrated(database_url: str, env: dict[str, str]) -> None:
    """``manage.py migrate``, which must succeed."""
    result = manage("migrate", "--no-input", env=env)
    assert result.returncode == 0, result.stdout + result.stderr


class ThreadedProxy:
    """:class:`CuttableProxy` on an event loop in a thread of its own, for sync tests.

    Point a worker's database URL at ``127.0.0.1:<listen_port>``; ``cut()`` is a database
    outage as a restart makes it (live connections die, new ones are refused),
    ``open()`` ends it on the same port. The shared server itself is never touched.
    """

    def __init__(self, host: str, port: int) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._proxy = CuttableProxy(host, port)
        self.open()
        self.listen_port = self._proxy.listen_port

    def _call(self, work: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout=30)

    def cut(self) -> None:
        """Abort every proxied connection and refuse new ones."""
        self._call(self._proxy.cut())

    def open(self) -> None:
        """Accept connections again (on the same port)."""
        self._call(self._proxy.open())

    def close(self) -> None:
        """Cut everything and stop the loop's thread."""
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()


@contextlib.contextmanager
def proxied(database_url: str) -> Iterator[tuple[str, ThreadedProxy]]:
    """``database_url`` through a :class:`ThreadedProxy` (the URL to use, the proxy)."""
    url = make_url(database_url)
    proxy = ThreadedProxy(url.host or "127.0.0.1", url.port or 5432)
    try:
        through = url.set(host="127.0.0.1", port=proxy.listen_port)
        yield through.render_as_string(hide_password=False), proxy
    finally:
        proxy.close()

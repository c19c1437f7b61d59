"""The relay's helper threads and their database connections (claim / mark)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine

from mqdedup.db.dialects import prepare_relay_connection

T = TypeVar("T")


class RelayConnections:
    """One helper thread and one database connection per name (``claim``, ``mark``).

    ``dedicated``: the relay shares its table with other relays (PostgreSQL,
    MySQL/MariaDB); otherwise (SQLite) statements run on the engine's pool.
    """

    def __init__(self, engine: Engine, *, dedicated: bool) -> None:
        self.engine = engine
        self.dedicated = dedicated
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._connections: dict[str, Connection] = {}

    def on(self, name: str, statement: Callable[..., T], *arguments: Any, **options: Any) -> T:
        """Run a store statement on the relay's ``name`` connection (claim / mark).

        On PostgreSQL each helper has its own connection, detached from the pool, in
        autocommit with the relay's session settings: a claim or a mark is one round
        trip. On MySQL/MariaDB likewise, at ``READ COMMITTED``, each statement group in
        its own transaction. A connection that failed is dropped; the retry opens a new
        one.
        """
        if not self.dedicated:
            return statement(self.engine, *arguments, **options)
        connection = self._connections.get(name)
        if connection is None or connection.closed or connection.invalidated:
            connection = prepare_relay_connection(self.engine.connect())
            connection.detach()  # the session settings must not reach the pool
            self._connections[name] = connection
        try:
            return statement(connection, *arguments, **options)
        except Exception:
            self._connections.pop(name, None)
            with contextlib.suppress(Exception):
                connection.close()
            raise

    def helper(self, name: str) -> ThreadPoolExecutor:
        """The ``name`` helper thread (one worker, started on first use)."""
        executor = self._executors.get(name)
        if executor is None:
            executor = ThreadPoolExecutor(1, thread_name_prefix=f"mqdedup-relay-{name}")
            self._executors[name] = executor
        return executor

    def close(self) -> None:
        """Wait for the helper threads, then close their connections."""
        for executor in self._executors.values():
            executor.shutdown(wait=True)
        self._executors.clear()
        for connection in self._connections.values():
            with contextlib.suppress(Exception):
                connection.close()
        self._connections.clear()

"""SQLAlchemy on Django's connection: one transaction for the claim and the ORM writes.

mqdedup's claim store, outbox writer and result storage speak SQLAlchemy. Here they get
an engine whose DB-API connection *is* Django's connection of one database alias:

* a SQLAlchemy transaction is a ``transaction.atomic(using=alias)`` block, opened when
  it begins and left when SQLAlchemy commits or rolls back. So ``Order.objects.create()``
  in a handler, the message's claim, its stored result and its outbox rows commit or roll
  back together; inside an atomic block that is already open (a view, a test case of
  pytest-django) it is a savepoint of it, as any nested ``atomic()`` is;
* SQLAlchemy's savepoints (``failure_isolation``) are plain SQL savepoints of that
  block; rolling one back also clears the rollback mark Django sets when an ORM
  statement fails inside it, so a failed handler fails alone;
* Django keeps owning the connection: ``CONN_MAX_AGE``, ``CONN_HEALTH_CHECKS`` and a
  connection lost in the middle of a transaction are handled as Django handles them for
  a request (each checkout of a connection, a batch, is one unit of work). Django's wrapped
  database errors are given back to SQLAlchemy as the driver's own, so mqdedup's
  transient-error handling (wait out outages, never dead-letter for them) applies.

Only what mqdedup writes goes through SQLAlchemy; the handler's business writes go
through the ORM or ``ctx.session``, both on the same connection.

A step's record (``ctx.step``) must survive a rollback of the message's transaction, so
it is written on a connection of its own (:func:`steps_engine`: a new Django connection
of the alias, committed on its own), not in a savepoint of the message's atomic block.
Inside an atomic block that was open before mqdedup's (a test case of pytest-django)
it is written in the message's transaction instead, as on SQLite: a connection of its
own would commit it outside the test's transaction, where it would outlive the test.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from django.db import Error as DjangoDatabaseError  # type: ignore[import-untyped]
from django.db import connections, transaction
from sqlalchemy import Connection, Engine, event
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy.orm import Session, SessionTransaction, sessionmaker
from sqlalchemy.pool import QueuePool

from mqdedup.consumers.steps import record_steps_with
from mqdedup.db.dialects import is_data_error
from mqdedup.django.conf import database_alias
from mqdedup.errors import ConfigurationError

log = logging.getLogger(__name__)

#: SQLAlchemy dialects for Django's database vendors.
_DIALECT_URLS = {
    "postgresql": "postgresql+psycopg://",
    "sqlite": "sqlite://",
    "mysql": "mysql+pymysql://",  # MySQL/MariaDB through PyMySQL (install_as_MySQLdb)
}
_ALIAS_KEY = "mqdedup.django.alias"


class TransactionBrokenError(RuntimeError):
    """Django marked the transaction for rollback: a database error was caught inside it.

    An ORM statement failed and the handler went on without a savepoint
    (``transaction.atomic()``); the database refuses every later statement of the
    transaction, and Django would roll it back silently at the end. The message fails
    instead (retried, then dead-lettered); its batch-mates are not affected.
    """


class _RollbackError(Exception):
    """Handed to ``Atomic.__exit__`` to make it roll back."""


@contextlib.contextmanager
def driver_errors() -> Iterator[None]:
    """Re-raise Django's wrapped database errors as the driver's own (their cause).

    SQLAlchemy and :mod:`mqdedup.db.dialects` recognise the driver's exceptions
    (disconnects, SQLSTATE classes); Django's wrappers would hide them.
    """
    try:
        yield
    except DjangoDatabaseError as error:
        cause = error.__cause__
        if cause is None:
            raise
        raise cause from None


class DjangoDBAPIConnection:
    """The DB-API connection SQLAlchemy sees: Django's connection of ``alias``.

    Every call resolves ``django.db.connections[alias]`` in the calling thread, so a
    reconnect by Django (``CONN_MAX_AGE``, a lost connection) is followed, and each
    thread uses its own Django connection. ``commit``/``rollback`` end the atomic
    block this object opened; ``close`` only rolls back what is still open (Django
    closes its connections itself).
    """

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self._atomic: Any = None
        #: The transaction began inside an atomic block opened before it (a test case's):
        #: it is a savepoint of that block.
        self.inside_atomic = False

    def checked_out(self) -> None:
        """A unit of work starts (a batch), as a request would: drop a connection that
        is past ``CONN_MAX_AGE`` or failed; Django connects again when it is used."""
        wrapper = connections[self.alias]
        if self._atomic is None and not wrapper.in_atomic_block:
            with driver_errors():
                wrapper.close_if_unusable_or_obsolete()

    def begin(self) -> None:
        """Open the transaction: ``transaction.atomic(using=alias)`` (idempotent)."""
        if self._atomic is not None:
            return
        self.inside_atomic = connections[self.alias].in_atomic_block
        atomic = transaction.atomic(using=self.alias)
        with driver_errors():
            atomic.__enter__()
        self._atomic = atomic

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        """A driver cursor on Django's connection, inside this connection's transaction."""
        self.begin()
        wrapper = connections[self.alias]
        with driver_errors():
            wrapper.ensure_connection()
        raw = wrapper.connection
        if wrapper.vendor != "postgresql" or args or kwargs:
            return raw.cursor(*args, **kwargs)
        return _sqlalchemy_cursor(raw)

    def commit(self) -> None:
        """Leave the atomic block: commit (or release its savepoint)."""
        atomic, self._atomic = self._atomic, None
        if atomic is None:
            return
        if connections[self.alias].needs_rollback:
            with driver_errors():
                atomic.__exit__(_RollbackError, _RollbackError(), None)
            raise TransactionBrokenError(
                "Django marked the transaction for rollback (a database error was caught "
                "inside it); it was rolled back"
            )
        with driver_errors():
            atomic.__exit__(None, None, None)

    def rollback(self) -> None:
        """Leave the atomic block rolling back (nothing when none is open)."""
        atomic, self._atomic = self._atomic, None
        if atomic is None:
            return
        with driver_errors():
            atomic.__exit__(_RollbackError, _RollbackError(), None)

    def close(self) -> None:
        """Roll back what is open; the connection itself stays Django's to close."""
        self.rollback()

    def add_notice_handler(self, _handler: Any) -> None:
        """Ignored: the server's notices on Django's connection are Django's business
        (SQLAlchemy would add one handler per pooled connection it creates)."""

    def __getattr__(self, name: str) -> Any:
        wrapper = connections[self.alias]
        with driver_errors():
            wrapper.ensure_connection()
        return getattr(wrapper.connection, name)


class OwnDBAPIConnection:
    """A DB-API connection of its own to the database of ``alias``: a new Django
    connection (``connections.create_connection``: the alias's settings, Django's
    connection set-up), not the thread's. Its transactions are SQLAlchemy's, independent
    of every atomic block of the thread; closing it closes the connection."""

    def __init__(self, alias: str) -> None:
        wrapper = connections.create_connection(alias)
        with driver_errors():
            wrapper.ensure_connection()
            wrapper.set_autocommit(False)  # SQLAlchemy's transactions (Django's default: on)
        self.vendor: str = wrapper.vendor
        self.raw = wrapper.connection

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        """A driver cursor (psycopg: with psycopg's loaders, as for Django's connection)."""
        if self.vendor != "postgresql" or args or kwargs:
            return self.raw.cursor(*args, **kwargs)
        return _sqlalchemy_cursor(self.raw)

    def add_notice_handler(self, _handler: Any) -> None:
        """Ignored, as on :class:`DjangoDBAPIConnection`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def _sqlalchemy_cursor(raw: Any) -> Any:
    """A psycopg cursor with psycopg's own loaders for ``jsonb`` and ``timestamptz``.

    Django's connections load ``jsonb`` as text (its JSONField parses it) and use
    client-side binding; SQLAlchemy expects psycopg's defaults, which a plain
    ``psycopg.Cursor`` with these two loaders restores for mqdedup's statements only.
    """
    import psycopg  # the postgresql extra (Django's postgresql backend has it loaded)
    from psycopg.types.datetime import TimestamptzLoader
    from psycopg.types.json import JsonbLoader

    cursor = psycopg.Cursor(raw)
    cursor.adapters.register_loader("jsonb", JsonbLoader)
    cursor.adapters.register_loader("timestamptz", TimestamptzLoader)
    return cursor


class DjangoSession(Session):
    """The processor's session on a Django alias: savepoints that cover ORM writes, and
    a broken transaction fails the handler.

    The processor's per-handler savepoints (``begin_nested``) are emitted before the
    handler runs, so rolling one back undoes the handler's ORM writes too.
    After each handler the processor flushes; if Django marked the transaction for
    rollback meanwhile (an ORM error caught without a savepoint), the flush raises
    :class:`TransactionBrokenError`, so that message fails alone instead of the whole
    transaction being rolled back silently at commit.
    """

    def begin_nested(self) -> SessionTransaction:
        """A savepoint, emitted at once (SQLAlchemy would wait for the session's next
        statement, which may come after the handler's ORM writes or never)."""
        savepoint = super().begin_nested()
        self.connection()
        return savepoint

    def flush(self, objects: Sequence[Any] | None = None) -> None:
        super().flush(objects)
        alias = self.info.get(_ALIAS_KEY)
        if alias is None:
            return
        wrapper = connections[alias]
        if wrapper.in_atomic_block and wrapper.needs_rollback:
            raise TransactionBrokenError(
                "a database error was caught inside the transaction, so Django marked it "
                "for rollback: put the statement that may fail in its own "
                "transaction.atomic() block (a savepoint), or let the error propagate"
            )


_engines: dict[str, Engine] = {}
_steps_engines: dict[str, Engine] = {}
_sessions: dict[str, sessionmaker[Session]] = {}
_lock = threading.Lock()


def engine(using: str | None = None) -> Engine:
    """The SQLAlchemy engine on Django's connection of ``using`` (default: the
    ``MQDEDUP["DATABASE"]`` alias, else ``"default"``); one per alias and process."""
    alias = database_alias(using)
    with _lock:
        found = _engines.get(alias)
        if found is None:
            found = _engines[alias] = _create_engine(alias)
    return found


def steps_engine(using: str | None = None) -> Engine:
    """The engine steps record on (``ctx.step``): connections of its own to the database
    of ``using``, each transaction committed on its own; one per alias and process."""
    alias = database_alias(using)
    with _lock:
        found = _steps_engines.get(alias)
        if found is None:
            found = _steps_engines[alias] = _create_steps_engine(alias)
    return found


def sessions(using: str | None = None) -> sessionmaker[Session]:
    """The session factory a consumer runs with: ``consumer.run(sessions())``."""
    alias = database_alias(using)
    bound = engine(alias)
    with _lock:
        found = _sessions.get(alias)
        if found is None:
            found = _sessions[alias] = sessionmaker(
                bound,
                class_=DjangoSession,
                expire_on_commit=False,
                info={_ALIAS_KEY: alias},
            )
    return found


def session(using: str | None = None) -> Session:
    """A new session on Django's connection of ``using``; each transaction of it is an
    atomic block (a savepoint inside one that is open)."""
    return sessions(using)()


def _create_engine(alias: str) -> Engine:
    vendor = connections[alias].vendor
    url = _DIALECT_URLS.get(vendor)
    if url is None:
        raise ConfigurationError(
            f"database {alias!r} uses Django's {vendor} backend; mqdedup.django supports "
            "the postgresql (psycopg 3), mysql (PyMySQL) and sqlite backends"
        )
    options: dict[str, Any] = {}
    if vendor == "postgresql":
        _require_psycopg3(alias)
        options["use_native_hstore"] = False  # its type lookup needs a real psycopg object
    if vendor == "mysql":
        _require_pymysql(alias)
    created = sa_create_engine(
        url,
        **options,
        creator=lambda: DjangoDBAPIConnection(alias),
        poolclass=QueuePool,
        pool_size=2,
        max_overflow=-1,  # each checkout is a small object: never wait for one
    )
    _install_events(created, alias)
    record_steps_with(created, functools.partial(_steps_recorder, alias))
    return created


def _create_steps_engine(alias: str) -> Engine:
    vendor = connections[alias].vendor
    options: dict[str, Any] = {"use_native_hstore": False} if vendor == "postgresql" else {}
    return sa_create_engine(
        _DIALECT_URLS[vendor],
        **options,
        creator=lambda: OwnDBAPIConnection(alias),
        poolclass=QueuePool,
        pool_size=2,
        max_overflow=-1,
        pool_pre_ping=True,  # idle between steps: Django's CONN_MAX_AGE does not apply
    )


def _steps_recorder(alias: str, connection: Connection) -> Engine | None:
    """Where a step of a message handled on ``connection`` records: on a connection of
    its own, or (inside a test case's atomic block) in the message's transaction."""
    dbapi_connection = connection.connection.dbapi_connection
    if isinstance(dbapi_connection, DjangoDBAPIConnection) and dbapi_connection.inside_atomic:
        return None
    return steps_engine(alias)


def _require_psycopg3(alias: str) -> None:
    from django.db.backends.postgresql.psycopg_any import (  # type: ignore[import-untyped]
        is_psycopg3,
    )

    if not is_psycopg3:
        raise ConfigurationError(
            f"database {alias!r} uses psycopg 2; mqdedup.django needs psycopg 3 "
            "(pip install 'mqdedup[postgresql]')"
        )


def _require_pymysql(alias: str) -> None:
    from django.db.backends.mysql.base import Database  # type: ignore[import-untyped]

    if not Database.__name__.startswith("pymysql"):
        raise ConfigurationError(
            f"database {alias!r} uses mysqlclient; mqdedup.django speaks MySQL/MariaDB "
            "through PyMySQL: call pymysql.install_as_MySQLdb() in your settings "
            "(pip install 'mqdedup[mysql]')"
        )


def _install_events(created: Engine, alias: str) -> None:
    @event.listens_for(created, "checkout")
    def _checkout(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        dbapi_connection.checked_out()

    @event.listens_for(created, "begin")
    def _begin(connection: Any) -> None:
        connection.connection.dbapi_connection.begin()

    @event.listens_for(created, "rollback_savepoint")
    def _rolled_back_to_savepoint(_connection: Any, _name: Any, _context: Any) -> None:
        # The savepoint undid the failed statement: the transaction is usable again.
        connections[alias].needs_rollback = False

    @event.listens_for(created, "handle_error")
    def _error(context: Any) -> None:
        error = context.original_exception
        if context.is_disconnect or not is_data_error(error):
            # As Django's own cursors do: the next unit of work checks the connection.
            connections[alias].errors_occurred = True

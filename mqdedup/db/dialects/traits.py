"""What each database can do (:func:`traits`: shard locks, ``LISTEN``/``NOTIFY``, a
one-statement claim, ``LIMIT`` in subqueries), its engine defaults and per-connection
setup, and the driver's client encoding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Connection,
    Dialect,
    Engine,
    event,
)

from mqdedup.errors import ConfigurationError

MYSQL_DIALECTS = ("mysql", "mariadb")


def client_encoding(connection: Connection) -> str | None:
    """The client encoding the driver uses on ``connection`` (psycopg), None where the
    driver does not say (SQLite, MySQL drivers).

    Read from the driver's own connection info (psycopg reads the server's
    ``ParameterStatus`` of ``client_encoding``): no round trip.
    """
    info = getattr(connection.connection.driver_connection, "info", None)
    encoding = getattr(info, "encoding", None)
    return encoding if isinstance(encoding, str) else None


@dataclass(frozen=True)
class Traits:
    """What one database can do, as far as the outbox, the relay and the tools care."""

    #: ``postgresql``, ``sqlite`` or ``mysql`` (MySQL and MariaDB alike).
    family: str
    #: How several relays share one outbox table: ``advisory`` locks (PostgreSQL),
    #: ``named`` locks (``GET_LOCK``, MySQL/MariaDB), or ``None`` (SQLite: one relay).
    shard_locks: str | None
    #: ``LISTEN``/``NOTIFY`` wakes the relay when outbox rows commit (else it polls).
    notifies: bool
    #: The claim and its batch lease are one statement (a data-modifying ``WITH``; else a
    #: short transaction of a few statements, :meth:`mqdedup.outbox.store.OutboxStore.claim`).
    claim_in_one_statement: bool
    #: ``LIMIT`` is allowed in an ``IN (…)`` subquery.
    limit_in_subquery: bool
    #: The key columns' collation can drift from the schema's (``db check`` looks).
    key_collation: bool


_POSTGRESQL = Traits(
    family="postgresql",
    shard_locks="advisory",
    notifies=True,
    claim_in_one_statement=True,
    limit_in_subquery=True,
    key_collation=False,
)
_SQLITE = Traits(
    family="sqlite",
    shard_locks=None,
    notifies=False,
    claim_in_one_statement=False,
    limit_in_subquery=True,
    key_collation=False,
)
_MYSQL = Traits(
    family="mysql",
    shard_locks="named",
    notifies=False,
    claim_in_one_statement=False,
    limit_in_subquery=False,
    key_collation=True,
)
_TRAITS = {"postgresql": _POSTGRESQL, "sqlite": _SQLITE, "mysql": _MYSQL, "mariadb": _MYSQL}
SUPPORTED = tuple(_TRAITS)


def traits(bind: Engine | Connection | Dialect) -> Traits:
    """The :class:`Traits` of the database behind ``bind``; ConfigurationError if unknown."""
    dialect = bind if isinstance(bind, Dialect) else bind.dialect
    found = _TRAITS.get(dialect.name)
    if found is None:
        supported = "PostgreSQL, MySQL/MariaDB and SQLite"
        raise ConfigurationError(f"mqdedup supports {supported}, not {dialect.name!r}")
    return found


def connect_defaults(backend: str, options: dict[str, Any]) -> None:
    """Fill in ``create_engine`` options of one database (the caller's own ones win).

    SQLite: a 30 s busy timeout, connections usable from other threads. PostgreSQL: a
    5 s connect timeout and ``application_name=mqdedup`` (visible in
    ``pg_stat_activity``).
    """
    if backend == "sqlite":
        options.setdefault("connect_args", {"timeout": 30, "check_same_thread": False})
    elif backend == "postgresql":
        connect_args = options.setdefault("connect_args", {})
        connect_args.setdefault("connect_timeout", 5)
        connect_args.setdefault("application_name", "mqdedup")


def configure_engine(engine: Engine) -> None:
    """Per-connection setup of one database; SQLite: WAL and ``BEGIN IMMEDIATE``.

    SQLAlchemy, not the sqlite3 module, decides where transactions begin, and they begin
    with ``BEGIN IMMEDIATE`` so that savepoints and concurrent writers work.
    """
    if traits(engine).family != "sqlite":
        return

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

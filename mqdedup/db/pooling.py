"""PostgreSQL behind a connection pooler (PgBouncer), and URLs with several hosts.

A pooler in *transaction* mode hands each transaction whichever server connection is
free, so nothing of a session survives a transaction: server-side prepared statements,
session ``SET``s, session advisory locks, ``LISTEN``. mqdedup's worker, claims, dead
letters, replays and HTTP keys use none of these except psycopg's automatic prepared
statements (``prepare_threshold``: after 5 runs of one query psycopg prepares it as
``_pg3_N``, which a transaction pooler without prepared-statement tracking answers
with ``prepared statement "_pg3_0" already exists`` or ``does not exist``).

The ``pooler`` query parameter of a PostgreSQL URL says what sits in front of the
database (mqdedup reads it and never passes it to the driver):

* ``auto`` (the default): each new connection compares the backend pid the server
  announced at login with ``pg_backend_pid()`` (one round trip per new connection); a
  pooler announces its own, random one. A pooler found this way is treated as
  ``transaction`` (no prepared statements); where a session is needed (the relay) it is
  checked whether the pooler keeps the connection's server (:func:`server_is_kept`).
* ``none``: a direct connection; where a session is needed, a pooler found is refused.
* ``session``: a pooler in session mode (PgBouncer ``pool_mode = session``, with
  ``server_reset_query = DISCARD ALL``): a connection keeps its server for its life,
  everything works as direct; where a session is needed it is checked, and a pooler
  that hands the server to other clients is refused.
* ``transaction``: a pooler in transaction mode without prepared-statement tracking
  (PgBouncer < 1.21, or ``max_prepared_statements = 0``): psycopg prepares nothing
  (``prepare_threshold = None``).
* ``transaction-prepared``: a transaction pooler that tracks protocol-level prepared
  statements (PgBouncer >= 1.21 with ``max_prepared_statements`` > 0): psycopg keeps
  preparing.

What still needs a session (the relay's shard locks, ``LISTEN`` and session settings)
is the relay's business: :func:`session_state_works` tells it whether it may rely on
one, verified rather than trusted.

Several hosts: ``postgresql://u:p@h1:5432,h2:5432/db?target_session_attrs=read-write``
(libpq's form) is rewritten to SQLAlchemy's ``?host=h1:5432&host=h2:5432``; libpq tries
the hosts in order and keeps the first that accepts writes, so a reconnect after a
failover finds the promoted replica.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine import URL
from sqlalchemy.pool import PoolProxiedConnection

from mqdedup.errors import ConfigurationError

log = logging.getLogger(__name__)

POOLER_PARAMETER = "pooler"
POOLERS = ("auto", "none", "session", "transaction", "transaction-prepared")

_MULTI_HOST = re.compile(
    r"^(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://(?:[^/?#]*@)?)(?P<hosts>[^@/?#]*,[^@/?#]*)(?P<tail>(?:[/?#].*)?)$"
)


def split_hosts(url: str) -> str:
    """``url`` with libpq's ``h1:p1,h2:p2`` authority as ``?host=h1:p1&host=h2:p2``."""
    match = _MULTI_HOST.match(url)
    if match is None or not match.group("head").lower().startswith("postgres"):
        return url
    hosts = [host.strip() for host in match.group("hosts").split(",") if host.strip()]
    tail = match.group("tail")
    path, question, query = tail.partition("?")
    extra = "&".join(f"host={host}" for host in hosts)
    query = f"{extra}&{query}" if question and query else extra
    return f"{match.group('head')}{path or '/'}?{query}"


def pooler_of(url: URL) -> str:
    """The ``pooler`` parameter of ``url`` (``auto`` when absent); ConfigurationError if bad."""
    value = url.query.get(POOLER_PARAMETER, "auto")
    if not isinstance(value, str) or value not in POOLERS:
        raise ConfigurationError(
            f"database URL parameter pooler={value!r} is not one of {', '.join(POOLERS)}"
        )
    return value


def behind_pooler(dbapi_connection: Any, driver_connection: Any | None = None) -> bool:
    """True when a psycopg connection talks to a pooler (its login pid is not the server's).

    ``dbapi_connection`` runs the query (SQLAlchemy's adapter on asyncio);
    ``driver_connection`` (default: the same) is psycopg's own, which knows the pid the
    server side announced at login. One round trip (``SELECT pg_backend_pid()``), rolled
    back.
    """
    driver = dbapi_connection if driver_connection is None else driver_connection
    announced = int(driver.info.backend_pid)
    return _server_pid(dbapi_connection, driver, end=True) != announced


def configure_pooling(engine: Engine) -> None:
    """PostgreSQL: drop ``pooler`` from the driver's arguments and, where a transaction
    pooler sits in front (declared or detected), turn psycopg's prepared statements off."""
    if engine.dialect.name != "postgresql":
        return
    pooler = pooler_of(engine.url)

    @event.listens_for(engine, "do_connect")
    def _drop_parameter(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        cparams.pop(POOLER_PARAMETER, None)

    if "psycopg" not in engine.dialect.driver or pooler in (
        "none",
        "session",
        "transaction-prepared",
    ):
        return

    @event.listens_for(engine, "connect")
    def _no_prepared_statements(dbapi_connection: Any, record: Any) -> None:
        driver = record.driver_connection
        pooled = pooler == "transaction" or behind_pooler(dbapi_connection, driver)
        record.info["mqdedup_pooled"] = pooled
        if pooled:
            driver.prepare_threshold = None  # psycopg's public setting, per connection


def session_state_works(connection: Connection) -> bool:
    """True when session state (``SET``, session advisory locks, ``LISTEN``) lasts on
    ``connection``: see :func:`keeps_session`."""
    return keeps_session(connection.engine, connection.connection)


def keeps_session(engine: Engine, pool_connection: PoolProxiedConnection) -> bool:
    """Whether a pool connection of ``engine`` keeps its server session, *verified*.

    No pooler (the login pid is the server's) or a pooler that keeps this connection's
    server to itself (:func:`server_is_kept`): True. A pooler that hands the server to
    other clients between transactions: False. ``pooler=transaction`` (or
    ``transaction-prepared``): False, unchecked. A declared ``none`` or ``session`` that
    the checks contradict is refused (ConfigurationError, one line): a session ``SET`` or
    lock there would reach other clients. The answer is kept on the connection.
    """
    if engine.dialect.name != "postgresql":
        return True
    pooler = pooler_of(engine.url)
    if pooler.startswith("transaction"):
        return False
    known = pool_connection.info.get(_SESSION_KEPT)
    if isinstance(known, bool):
        return known
    if "psycopg" not in engine.dialect.driver:
        return True  # no way to tell: trusted
    dbapi, driver = pool_connection.dbapi_connection, pool_connection.driver_connection
    pooled = pool_connection.info.get("mqdedup_pooled")  # set at connect (configure_pooling)
    if not isinstance(pooled, bool):
        pooled = behind_pooler(dbapi, driver)
    if pooled and pooler == "none":
        raise ConfigurationError(
            "database URL says pooler=none, but a connection pooler answers (the login's "
            "backend pid is not pg_backend_pid()): declare what sits in front of the database"
        )
    kept = not pooled or server_is_kept(engine, dbapi, driver)
    if not kept and pooler == "session":
        raise ConfigurationError(
            "database URL says pooler=session, but the pooler gave this connection's server "
            "to another client between two transactions (transaction pooling): use "
            "pooler=transaction, or a pooler in session mode"
        )
    pool_connection.info[_SESSION_KEPT] = kept
    return kept


_SESSION_KEPT = "mqdedup_session_kept"
_PROBES = 3


def server_is_kept(engine: Engine, dbapi_connection: Any, driver_connection: Any) -> bool:
    """True when a pooler keeps this psycopg connection's server to it across transactions
    (session pooling); False when it hands it to other clients (transaction pooling).

    A second client of the same pooler opens a transaction right after ours ended: with
    transaction pooling it gets our server (PgBouncer reuses the server released last),
    or ours, asked again, answers from another server. With session pooling neither can
    happen, so a session pooler is never taken for a transaction pooler. Tried
    ``_PROBES`` times (a transaction pooler is usually caught by the first): up to about
    fifteen round trips, once per connection that needs a session.
    """
    other = engine.raw_connection()
    try:
        other_dbapi = other.dbapi_connection
        assert other_dbapi is not None
        for _ in range(_PROBES):
            mine = _server_pid(dbapi_connection, driver_connection, end=True)
            theirs = _server_pid(other_dbapi, other.driver_connection, end=False)
            again = _server_pid(dbapi_connection, driver_connection, end=True)
            other_dbapi.rollback()
            if theirs == mine or again != mine:
                return False
        return True
    finally:
        other.close()


def _server_pid(dbapi_connection: Any, driver_connection: Any, *, end: bool) -> int:
    """``pg_backend_pid()`` on a connection; ``end``: close the transaction afterwards."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SELECT pg_backend_pid()")
        row = cursor.fetchone()
    finally:
        cursor.close()
    if end and not driver_connection.autocommit:
        dbapi_connection.rollback()
    return int(row[0]) if row is not None else -1


def declares_transaction_pooler(engine: Engine) -> bool:
    """True when ``engine``'s URL says a transaction pooler sits in front (no check made)."""
    return engine.dialect.name == "postgresql" and pooler_of(engine.url).startswith("transaction")

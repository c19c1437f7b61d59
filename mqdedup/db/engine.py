"""Engines and sessions from a database URL, and schema creation."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from sqlalchemy import Engine, inspect
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.db import dialects
from mqdedup.db.pooling import configure_pooling, pooler_of, split_hosts
from mqdedup.db.schema import DEFAULT_PREFIX, schema
from mqdedup.errors import ConfigurationError, DatabaseUnavailableError
from mqdedup.masking import mask_text, mask_url

log = logging.getLogger(__name__)

DATABASE_URL_ENV = "MQDEDUP_DATABASE_URL"
DEFAULT_DATABASE_URL = "sqlite:///mqdedup.db"
_DRIVER_ALIASES = {"postgresql": "postgresql+psycopg", "postgres": "postgresql+psycopg"}


def database_url_from_env(default: str = DEFAULT_DATABASE_URL) -> str:
    """``MQDEDUP_DATABASE_URL``, or the embedded SQLite default."""
    return os.environ.get(DATABASE_URL_ENV) or default


def parse_url(url: str | URL) -> URL:
    """Parse and normalise a database URL; a malformed one raises ConfigurationError.

    An unescaped ``@`` in the user name or password is read as part of it: the host
    starts after the last ``@`` (SQLAlchemy alone would take the password's tail for
    the host, and the driver's error would print it).
    """
    try:
        parsed = make_url(split_hosts(_escape_user_info(url)) if isinstance(url, str) else url)
    except (sa_exc.ArgumentError, ValueError) as exc:
        raise ConfigurationError(
            f"malformed database URL {mask_url(url)!r}: expected e.g. "
            "postgresql://user@host:5432/dbname (a password goes as user:password@) "
            "or sqlite:///path.db"
        ) from exc
    driver = _DRIVER_ALIASES.get(parsed.drivername, parsed.drivername)
    if parsed.get_backend_name() not in dialects.SUPPORTED:
        raise ConfigurationError(
            f"unknown database kind {parsed.get_backend_name()!r} in database URL "
            f"{mask_url(parsed)!r} (supported: postgresql, sqlite, mysql/mariadb)"
        )
    if parsed.get_backend_name() == "postgresql":
        pooler_of(parsed)  # ConfigurationError for a pooler mqdedup does not know
    return parsed.set(drivername=driver)


def _escape_user_info(url: str) -> str:
    """``url`` with each ``@`` before the last one of its authority percent-encoded."""
    scheme, separator, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not separator or not at or "@" not in userinfo or re.search(r"[/?#]", userinfo):
        return url
    return f"{scheme}://{userinfo.replace('@', '%40')}@{host}"


#: Database drivers that come with an extra of mqdedup.
_DRIVER_EXTRAS = {"psycopg": "postgresql", "pymysql": "mysql"}


def create_engine(url: str | URL | None = None, **options: Any) -> Engine:
    """An engine for ``url`` (default: ``MQDEDUP_DATABASE_URL`` or embedded SQLite).

    ``postgresql://`` URLs use psycopg 3; their ``pooler`` parameter says whether a
    connection pooler (PgBouncer) sits in front, and several hosts
    (``h1:5432,h2:5432`` with ``target_session_attrs=read-write``) are tried in order
    (:mod:`mqdedup.db.pooling`). SQLite gets WAL, a busy timeout and real
    ``BEGIN IMMEDIATE`` transactions so that savepoints and concurrent writers work.

    Pooled connections are not pinged on checkout (``pool_pre_ping``: one more round
    trip per transaction, a third of a one-message transaction's). A connection that
    died in the pool (the database restarted) fails its first statement with a
    disconnect error; SQLAlchemy then invalidates the pool, and the worker and relay
    retry the transaction on a fresh connection. Pass ``pool_pre_ping=True`` for code
    that does not retry transient errors itself.
    """
    parsed = parse_url(url if url is not None else database_url_from_env())
    dialects.connect_defaults(parsed.get_backend_name(), options)
    try:
        engine = sa_create_engine(parsed, **options)
    except ModuleNotFoundError as exc:
        extra = _DRIVER_EXTRAS.get(str(exc.name))
        if extra is None:
            raise ConfigurationError(
                f"cannot use database URL {mask_url(parsed)!r}: "
                f"{type(exc).__name__}: {mask_text(str(exc), parsed)}"
            ) from None
        raise ConfigurationError(
            f"database URL {mask_url(parsed)!r} needs the {exc.name} driver, which is not "
            f"installed: pip install 'mqdedup[{extra}]'"
        ) from None
    except (sa_exc.ArgumentError, sa_exc.NoSuchModuleError, ImportError) as exc:
        raise ConfigurationError(
            f"cannot use database URL {mask_url(parsed)!r}: "
            f"{type(exc).__name__}: {mask_text(str(exc), parsed)}"
        ) from None
    dialects.configure_engine(engine)
    configure_pooling(engine)
    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """The session factory the processor uses (objects stay usable after commit)."""
    return sessionmaker(engine, expire_on_commit=False)


def check_connection(engine: Engine) -> None:
    """Connect once; raise DatabaseUnavailableError with a one-line reason if that fails."""
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql("SELECT 1")
    except sa_exc.DBAPIError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
        # Drivers may echo the DSN (or a password's tail as a host name): scrub it.
        raise DatabaseUnavailableError(
            f"cannot connect to database {mask_url(engine.url)}: {mask_text(reason, engine.url)}"
        ) from None


def init_schema(engine: Engine, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Create the framework's missing tables (idempotent); return the names created."""
    tables = schema(prefix).metadata
    existing = set(inspect(engine).get_table_names())
    tables.create_all(engine, checkfirst=True)
    created = [name for name in tables.tables if name not in existing]
    for name in created:
        log.info("created table", extra={"table": name})
    return created


def check_schema(engine: Engine, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Differences between the live schema and this version's tables (empty: all good)."""
    inspector = inspect(engine)
    existing = set(inspector.get_table_names())
    problems: list[str] = []
    for name, table in schema(prefix).metadata.tables.items():
        if name not in existing:
            problems.append(f"table {name} is missing (run `mqdedup db upgrade`)")
            continue
        live = {column["name"] for column in inspector.get_columns(name)}
        problems.extend(
            f"table {name} lacks column {column.name} (run `mqdedup db upgrade`)"
            for column in table.columns
            if column.name not in live
        )
    return problems

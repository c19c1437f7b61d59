"""Async engines (``AsyncEngine``) from a database URL, for async consumers and endpoints.

The same URLs as :func:`mqdedup.db.engine.create_engine`: the driver is swapped for
its asyncio twin (``postgresql://`` stays psycopg 3, which SQLAlchemy runs in its async
mode; ``sqlite://`` becomes aiosqlite; ``mysql+pymysql://`` becomes aiomysql). The
per-connection setup is the synchronous engine's (SQLite: WAL, ``BEGIN IMMEDIATE``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL

from mqdedup.db import dialects
from mqdedup.db.engine import database_url_from_env, parse_url
from mqdedup.db.pooling import configure_pooling
from mqdedup.errors import ConfigurationError
from mqdedup.masking import mask_text, mask_url

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

#: Synchronous drivers and their asyncio twins (psycopg 3 is both).
_ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "sqlite+pysqlite": "sqlite+aiosqlite",
    "mysql": "mysql+aiomysql",
    "mysql+pymysql": "mysql+aiomysql",
    "mariadb": "mariadb+aiomysql",
    "mariadb+pymysql": "mariadb+aiomysql",
}
#: How to install each asyncio driver (aiomysql is not part of mqdedup's extras).
_DRIVER_INSTALLS = {"aiomysql": "pip install aiomysql"}


def async_url(url: str | URL | None = None) -> URL:
    """``url`` (default: ``MQDEDUP_DATABASE_URL`` or embedded SQLite) with an asyncio driver."""
    parsed = parse_url(url if url is not None else database_url_from_env())
    return parsed.set(drivername=_ASYNC_DRIVERS.get(parsed.drivername, parsed.drivername))


def create_async_engine(url: str | URL | Engine | None = None, **options: Any) -> AsyncEngine:
    """An ``AsyncEngine`` for ``url`` (or for the URL of a synchronous ``Engine``).

    Options are those of SQLAlchemy's ``create_async_engine``; mqdedup's defaults
    (timeouts, ``application_name``) are filled in as for :func:`create_engine`. A
    missing asyncio driver is a one-line :class:`~mqdedup.errors.ConfigurationError`.
    """
    parsed = async_url(url.url if isinstance(url, Engine) else url)
    dialects.connect_defaults(parsed.get_backend_name(), options)
    try:  # the asyncio extra (greenlet) is needed from here on only
        from sqlalchemy.ext.asyncio import create_async_engine as sa_create_async_engine
    except ImportError:
        raise ConfigurationError(
            "asyncio needs greenlet, which is not installed: pip install 'mqdedup[asyncio]'"
        ) from None
    try:
        engine = sa_create_async_engine(parsed, **options)
    except ModuleNotFoundError as exc:
        install = _DRIVER_INSTALLS.get(str(exc.name), "pip install 'mqdedup[asyncio]'")
        raise ConfigurationError(
            f"database URL {mask_url(parsed)!r} needs the {exc.name} driver for asyncio, "
            f"which is not installed: {install}"
        ) from None
    except (sa_exc.ArgumentError, sa_exc.NoSuchModuleError, sa_exc.InvalidRequestError) as exc:
        raise ConfigurationError(
            f"cannot use database URL {mask_url(parsed)!r} with asyncio: "
            f"{type(exc).__name__}: {mask_text(str(exc), parsed)}"
        ) from None
    dialects.configure_engine(engine.sync_engine)
    configure_pooling(engine.sync_engine)
    return engine


def sync_engine_of(database: object) -> Engine | None:
    """The synchronous engine behind an ``AsyncEngine``; None for anything else.

    Without the asyncio extension loaded no ``AsyncEngine`` exists, and none is imported.
    """
    if "sqlalchemy.ext.asyncio" not in sys.modules:
        return None
    from sqlalchemy.ext.asyncio import AsyncEngine  # loaded already (see above)

    return database.sync_engine if isinstance(database, AsyncEngine) else None

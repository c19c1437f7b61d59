"""Fixtures: SQLite for unit tests, the real PostgreSQL for integration tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from mqdedup.db import create_engine, init_schema
from mqdedup.db.schema import schema
from tests.support import business

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_service(name: str, reason: str) -> None:
    """Skip locally, fail in CI: a missing service must never pass silently there."""
    if IN_CI:
        pytest.fail(f"{name} is required in CI but unavailable: {reason}")
    pytest.skip(f"{name} unavailable: {reason}")


def reset_database(engine: Engine) -> None:
    """Drop and recreate the framework's and the tests' tables."""
    business.drop_all(engine)
    schema().metadata.drop_all(engine)
    init_schema(engine)
    business.create_all(engine)


@pytest.fixture
def sqlite_engine(tmp_path: Path) -> Iterator[Engine]:
    engine = create_engine(f"sqlite:///{tmp_path / 'test.db'}")
    reset_database(engine)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def pg_url() -> str:
    url = os.environ.get("MQDEDUP_TEST_DATABASE_URL")
    if not url:
        require_service("PostgreSQL", "MQDEDUP_TEST_DATABASE_URL is not set")
    assert url is not None
    return url


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    from mqdedup.db import check_connection
    from mqdedup.errors import DatabaseUnavailableError

    engine = create_engine(pg_url)
    try:
        check_connection(engine)
    except DatabaseUnavailableError as exc:
        require_service("PostgreSQL", str(exc))
    reset_database(engine)
    yield engine
    engine.dispose()

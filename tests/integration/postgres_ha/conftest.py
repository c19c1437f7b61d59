"""Fixtures of the PgBouncer and failover tests.

``pgbouncer_url``: the shared PgBouncer in transaction pooling mode in front of the
shared PostgreSQL (``scripts/services.sh start pgbouncer``, ``MQDEDUP_TEST_PGBOUNCER_URL``);
the failover tests start PRIVATE primaries and replicas themselves (``support.py``).
"""

from __future__ import annotations

import pytest

from tests.services import PG_URL_ENV, checked_engine, service_env

PGBOUNCER_URL_ENV = "MQDEDUP_TEST_PGBOUNCER_URL"


@pytest.fixture(scope="session")
def pgbouncer_url() -> str:
    """The shared PgBouncer (transaction mode), checked to answer."""
    url = service_env(PGBOUNCER_URL_ENV, "PgBouncer")
    checked_engine(url, "PgBouncer").dispose()
    return url


@pytest.fixture(scope="session")
def direct_url() -> str:
    """The shared PostgreSQL behind that PgBouncer, reached directly."""
    return service_env(PG_URL_ENV, "PostgreSQL")


PGBOUNCER_SESSION_URL_ENV = "MQDEDUP_TEST_PGBOUNCER_SESSION_URL"


@pytest.fixture(scope="session")
def pgbouncer_session_url() -> str:
    """A second PgBouncer in SESSION pooling mode (``server_reset_query = DISCARD ALL``)
    in front of the shared PostgreSQL (``scripts/services.sh start pgbouncer-session``)."""
    url = service_env(PGBOUNCER_SESSION_URL_ENV, "PgBouncer (session mode)")
    checked_engine(url, "PgBouncer (session mode)").dispose()
    return url

"""The Django integration on real PostgreSQL, Kafka and RabbitMQ, under faults.

The scenarios (``scenarios.py``) need Django set up, which this process never does:
they run in a pytest of their own, with the example project's settings, against a fresh
database migrated with ``manage.py migrate``:

* Kafka: 30% duplicates and ``kill -9`` after commit before the offset commit, three
  times: each ORM effect (a ``Shipment`` row) exactly once;
* RabbitMQ: 30% duplicates: each ORM effect once;
* ``CONN_MAX_AGE=None`` (persistent connections) and a database restart mid-run, as the
  worker sees one: its connection dies inside a batch's open transaction and new ones
  are refused for ~5 s (a TCP proxy between the worker and the shared server is cut;
  the server itself is never restarted): the worker waits, saying so, reconnects and
  finishes with one persistent connection again, nothing lost or dead-lettered;
* a handler that raises, or swallows an ORM error (Django marks the transaction for
  rollback): no model row, no claim, no outbox row; its batch-mates commit all three,
  one of them after catching the same ORM error in its own ``transaction.atomic()``;
* ``@idempotent``: a repeat while the first request holds its key gets 409 at once, a
  repeat after its commit the stored response.

On MariaDB (Django's mysql backend through PyMySQL) the migration, ``mqdedup db check``,
the RabbitMQ duplicates, the failed handlers and the Idempotency-Key run too, side by
side with the PostgreSQL run.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from tests.integration.django.support import (
    MQDEDUP,
    PYTHON,
    example_env,
    fresh_database,
    migrated,
    run,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SCENARIOS = Path(__file__).with_name("scenarios.py")


def run_scenarios(env: dict[str, str], passed: int, *options: str, timeout: float) -> None:
    """The example's scenarios module in a pytest process; ``passed`` of them must pass."""
    result = run(
        PYTHON,
        "-m",
        "pytest",
        str(SCENARIOS),
        "-p",
        "no:django",  # Django is set up by the module itself, on the real database
        "-p",
        "no:cacheprovider",
        "-q",
        "-x",
        *options,
        env=env,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert f"{passed} passed" in result.stdout, result.stdout[-3000:]


def scenarios_on_postgresql(database_url: str, kafka_bootstrap: str, rabbitmq_url: str) -> None:
    """Every scenario on PostgreSQL."""
    env = example_env(
        database_url, MQDEDUP_KAFKA_BOOTSTRAP=kafka_bootstrap, MQDEDUP_RABBITMQ_URL=rabbitmq_url
    )
    migrated(database_url, env)
    run_scenarios(env, 6, "--durations=0", timeout=280)


def scenarios_on_mariadb(database_url: str, rabbitmq_url: str) -> None:
    """``db check`` after the migration, then the RabbitMQ, failed-handler and
    Idempotency-Key scenarios on MariaDB."""
    env = example_env(database_url, MQDEDUP_RABBITMQ_URL=rabbitmq_url)
    migrated(database_url, env)
    prefix = env["ORDERS_TABLE_PREFIX"]
    check = run(
        MQDEDUP, "db", "check", "--database", database_url, "--table-prefix", prefix, env=env
    )
    assert check.returncode == 0, check.stdout + check.stderr
    run_scenarios(
        env, 4, "-k", "rabbitmq_duplicates or failed_handlers or idempotency", timeout=200
    )


def test_django_consumers_under_duplicates_kills_and_lost_connections_on_postgresql_and_mariadb(
    pg_url: str, mariadb_url: str, kafka_bootstrap: str, rabbitmq_url: str
) -> None:
    """The PostgreSQL and MariaDB runs side by side (a fresh database and a pytest
    process each); each asserts its own outcome."""
    with fresh_database(pg_url) as on_postgresql, fresh_database(mariadb_url) as on_mariadb:
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="django") as pool:
            runs = [
                pool.submit(scenarios_on_postgresql, on_postgresql, kafka_bootstrap, rabbitmq_url),
                pool.submit(scenarios_on_mariadb, on_mariadb, rabbitmq_url),
            ]
            wait(runs)
        for future in runs:
            future.result()

"""``mqdedup db check`` / ``db upgrade`` on tables left by an older version.

An outbox table created before the MySQL/MariaDB claim indexes existed, with its
``message_id`` in the PAD SPACE ``utf8mb4_bin`` collation (``'id'`` = ``'id '``), or a
PostgreSQL table missing an index, a PostgreSQL dedup table of schema 2 (a btree on
``processed_at`` where schema 3 has a BRIN index): ``db check`` names each difference
and exits 1, ``db upgrade`` fixes them, and the fixed tables behave as this version's
(byte-wise keys; the purge deletes exactly the old claims).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, insert, inspect, select, text
from sqlalchemy.exc import IntegrityError

from mqdedup.cli import exitcodes
from mqdedup.db import create_engine
from mqdedup.db.schema import schema
from mqdedup.dedup.store import DedupStore
from tests.services import REPO

pytestmark = pytest.mark.integration
MQDEDUP = str(Path(sys.executable).parent / "mqdedup")


@pytest.fixture(params=["postgresql", "mariadb"])
def old_install(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, str, str]]:
    url = request.getfixturevalue("pg_url" if request.param == "postgresql" else "mariadb_url")
    engine = create_engine(url)
    prefix = f"up_{uuid.uuid4().hex[:8]}_"
    metadata = schema(prefix).metadata
    metadata.create_all(engine)
    mysql = engine.dialect.name == "mysql"
    with engine.begin() as connection:  # what an older version left behind
        on = f" ON {prefix}outbox" if mysql else ""
        connection.execute(text(f"DROP INDEX {prefix}outbox_published_idx{on}"))
        # Schema 1 had no batch leases and no published counts.
        connection.execute(text(f"DROP TABLE {prefix}outbox_leases, {prefix}outbox_counts"))
        if not mysql:  # schema 2's retention index
            connection.execute(text(f"DROP INDEX {prefix}processed_at_brin"))
            connection.execute(
                text(
                    f"CREATE INDEX {prefix}processed_at_idx "
                    f"ON {prefix}processed_messages (processed_at)"
                )
            )
        if mysql:
            connection.execute(text(f"DROP INDEX {prefix}outbox_claim_idx{on}"))
            connection.execute(
                text(
                    f"ALTER TABLE {prefix}outbox MODIFY message_id VARCHAR(255) "
                    "CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
                )
            )
    yield engine, url, prefix
    metadata.drop_all(engine)
    engine.dispose()


def db(command: str, url: str, prefix: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MQDEDUP, "db", command, "--database", url],
        env={**os.environ, "MQDEDUP_TABLE_PREFIX": prefix},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def retention_indexes(engine: Engine, prefix: str) -> dict[str, str]:
    """The dedup table's indexes besides its key, with their access method."""
    return {
        str(index["name"]): index.get("dialect_options", {}).get("postgresql_using", "btree")
        for index in inspect(engine).get_indexes(f"{prefix}processed_messages")
    }


def assert_purge_deletes_exactly_the_old_claims(engine: Engine, prefix: str) -> None:
    """Claims of two consumers, old ones in between new ones; purges in small chunks."""
    table = schema(prefix).processed
    now = datetime.now(UTC)
    ages = [timedelta(days=10) if n % 3 else timedelta(minutes=5) for n in range(1200)]
    rows = [
        {"consumer_name": f"c{n % 2}", "message_id": f"m-{n}", "processed_at": now - age}
        for n, age in enumerate(ages)
    ]
    with engine.begin() as connection:
        connection.execute(insert(table), rows)
    new = {(r["consumer_name"], r["message_id"]) for r in rows[::3]}
    store = DedupStore(prefix)
    old_c0 = sum(1 for r in rows[1::3] + rows[2::3] if r["consumer_name"] == "c0")
    assert store.purge(engine, timedelta(days=1), consumer="c0", chunk_size=97) == old_c0
    assert store.purge(engine, timedelta(days=1), chunk_size=97) == 800 - old_c0
    with engine.connect() as connection:
        left = set(connection.execute(select(table.c.consumer_name, table.c.message_id)).all())
    assert left == new


def outbox_row(prefix: str, message_id: str) -> dict[str, object]:
    return {
        "message_id": message_id,
        "broker": "kafka",
        "destination": "t",
        "shard_hash": 0,
        "headers": {},
        "payload": b"x",
        "state": "pending",
        "attempts": 0,
        "created_at": text("CURRENT_TIMESTAMP"),
        "available_at": text("CURRENT_TIMESTAMP"),
    }


def test_db_check_names_the_drift_and_db_upgrade_fixes_it(
    old_install: tuple[Engine, str, str],
) -> None:
    engine, url, prefix = old_install
    mysql = engine.dialect.name == "mysql"
    check = db("check", url, prefix)
    assert check.returncode == exitcodes.CHECK_FAILED, check.stdout + check.stderr
    assert f"index {prefix}outbox_published_idx is missing" in check.stdout
    assert f"table {prefix}outbox_leases is missing" in check.stdout
    assert f"table {prefix}outbox_counts is missing" in check.stdout
    if mysql:
        assert f"index {prefix}outbox_claim_idx is missing" in check.stdout
        assert "column message_id has collation utf8mb4_bin" in check.stdout
    else:
        assert f"index {prefix}processed_at_brin is missing" in check.stdout
        assert f"index {prefix}processed_at_idx is not used on this database" in check.stdout

    upgrade = db("upgrade", url, prefix)
    assert upgrade.returncode == exitcodes.OK, upgrade.stderr
    assert f"created index {prefix}outbox_published_idx" in upgrade.stdout
    assert f"{prefix}outbox_leases" in upgrade.stdout and f"{prefix}outbox_counts" in upgrade.stdout
    if not mysql:
        assert f"created index {prefix}processed_at_brin" in upgrade.stdout
        assert f"dropped index {prefix}processed_at_idx" in upgrade.stdout
    assert db("check", url, prefix).stdout.strip() == "schema matches this version"
    assert db("upgrade", url, prefix).stdout.strip() == "schema is up to date"
    assert retention_indexes(engine, prefix) == (
        {f"{prefix}processed_at_idx": "btree"} if mysql else {f"{prefix}processed_at_brin": "brin"}
    )
    assert_purge_deletes_exactly_the_old_claims(engine, prefix)

    # The upgraded key column tells ids apart byte for byte, as a new table does.
    table = schema(prefix).outbox
    with engine.begin() as connection:
        connection.execute(insert(table).values(**outbox_row(prefix, "order-1")))
        connection.execute(insert(table).values(**outbox_row(prefix, "order-1 ")))
    with pytest.raises(IntegrityError), engine.begin() as connection:
        connection.execute(insert(table).values(**outbox_row(prefix, "order-1")))

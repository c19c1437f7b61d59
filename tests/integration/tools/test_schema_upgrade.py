"""``mqdedup db check`` / ``db upgrade`` on tables left by an older version.

An outbox table created before the MySQL/MariaDB claim indexes existed, with its
``message_id`` in the PAD SPACE ``utf8mb4_bin`` collation (``'id'`` = ``'id '``), or a
PostgreSQL table missing an index: ``db check`` names each difference and exits 1,
``db upgrade`` fixes them, and the fixed table behaves as this version's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, insert, text
from sqlalchemy.exc import IntegrityError

from mqdedup.cli import exitcodes
from mqdedup.db import create_engine
from mqdedup.db.schema import schema
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

    upgrade = db("upgrade", url, prefix)
    assert upgrade.returncode == exitcodes.OK, upgrade.stderr
    assert f"created index {prefix}outbox_published_idx" in upgrade.stdout
    assert f"{prefix}outbox_leases" in upgrade.stdout and f"{prefix}outbox_counts" in upgrade.stdout
    assert db("check", url, prefix).stdout.strip() == "schema matches this version"
    assert db("upgrade", url, prefix).stdout.strip() == "schema is up to date"

    # The upgraded key column tells ids apart byte for byte, as a new table does.
    table = schema(prefix).outbox
    with engine.begin() as connection:
        connection.execute(insert(table).values(**outbox_row(prefix, "order-1")))
        connection.execute(insert(table).values(**outbox_row(prefix, "order-1 ")))
    with pytest.raises(IntegrityError), engine.begin() as connection:
        connection.execute(insert(table).values(**outbox_row(prefix, "order-1")))

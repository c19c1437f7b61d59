"""Alembic autogenerate with mqdedup's hooks: the migration runs as written and
``mqdedup db check`` is clean afterwards, on SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, inspect

from mqdedup.db.engine import check_schema, create_engine
from mqdedup.db.migrations import schema_drift
from mqdedup.db.schema import schema
from tests.services import checked_engine, require_module

alembic_command = require_module("alembic.command")
alembic_config = require_module("alembic.config")

ENV_PY = """
from alembic import context

from mqdedup.db.alembic_support import include_object, render_item
from mqdedup.db.schema import schema

prefix = context.config.attributes["prefix"]
engine = context.config.attributes["engine"]


def include_name(name, type_, parent_names):
    # The shared test database holds other tests' tables: compare only this prefix's.
    return type_ != "table" or (name or "").startswith(prefix)


with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=schema(prefix).metadata,
        render_item=render_item,
        include_object=include_object,
        include_name=include_name,
        version_table=f"{prefix}alembic_version",
    )
    with context.begin_transaction():
        context.run_migrations()
"""


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'app.db'}"
    else:
        fixture = "pg_url" if request.param == "postgresql" else "mariadb_url"
        url = request.getfixturevalue(fixture)
    engine = checked_engine(url, request.param)
    yield engine
    engine.dispose()


def _config(tmp_path: Path, engine: Engine, prefix: str) -> object:
    scripts = tmp_path / "migrations"
    (scripts / "versions").mkdir(parents=True)
    (scripts / "env.py").write_text(ENV_PY)
    (scripts / "script.py.mako").write_text(
        (
            Path(alembic_command.__file__).parent / "templates" / "generic" / "script.py.mako"
        ).read_text()
    )
    config = alembic_config.Config()
    config.set_main_option("script_location", str(scripts))
    config.attributes["prefix"] = prefix
    config.attributes["engine"] = engine
    return config


def test_autogenerate_upgrade_then_db_check_is_clean(engine: Engine, tmp_path: Path) -> None:
    prefix = f"al_{uuid.uuid4().hex[:8]}_"
    config = _config(tmp_path, engine, prefix)
    try:
        alembic_command.revision(config, message="mqdedup tables", autogenerate=True)
        (migration,) = (tmp_path / "migrations" / "versions").glob("*.py")
        text = migration.read_text()
        assert "import mqdedup.db.schema" in text and "astext_type=Text()" not in text
        alembic_command.upgrade(config, "head")  # the generated file, run as written

        assert check_schema(engine, prefix) == []
        assert [str(item) for item in schema_drift(engine, prefix)] == []
        created = set(inspect(engine).get_table_names())
        assert set(schema(prefix).metadata.tables) <= created
        # Schema 3: the retention index is BRIN on PostgreSQL, a btree elsewhere.
        retention = {
            index["name"]: index.get("dialect_options", {}).get("postgresql_using", "btree")
            for index in inspect(engine).get_indexes(f"{prefix}processed_messages")
        }
        if engine.dialect.name == "postgresql":
            assert retention == {f"{prefix}processed_at_brin": "brin"}
        else:
            assert retention == {f"{prefix}processed_at_idx": "btree"}
        # A second autogenerate finds nothing left to do.
        alembic_command.check(config)
    finally:
        schema(prefix).metadata.drop_all(engine)
        with engine.begin() as connection:
            connection.exec_driver_sql(f"DROP TABLE IF EXISTS {prefix}alembic_version")


def test_db_check_names_indexes_made_for_another_database(tmp_path: Path) -> None:
    """Without the hook a SQLite migration would create the MySQL-only outbox indexes."""
    engine = create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    prefix = "mq_"
    tables = schema(prefix)
    tables.metadata.create_all(engine)
    foreign = next(i for i in tables.outbox.indexes if i.name == f"{prefix}outbox_claim_idx")
    with engine.begin() as connection:
        connection.exec_driver_sql(f"CREATE INDEX {foreign.name} ON {prefix}outbox (state, id)")
    drift = [str(item) for item in schema_drift(engine, prefix)]
    assert drift == [
        f"table {prefix}outbox: index {prefix}outbox_claim_idx is not used on this database "
        "(run `mqdedup db upgrade`)"
    ]
    from mqdedup.db.migrations import upgrade_schema

    assert upgrade_schema(engine, prefix) == [f"dropped index {foreign.name} on {prefix}outbox"]
    assert schema_drift(engine, prefix) == []
    engine.dispose()

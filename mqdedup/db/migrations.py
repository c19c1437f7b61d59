"""Bringing existing tables up to this version: what ``mqdedup db upgrade`` fixes.

``init_schema`` creates missing tables. Tables created by an earlier version can still
differ in ways that ``CREATE TABLE IF NOT EXISTS`` never touches:

* an **index** added since (e.g. the outbox's claim indexes on MySQL/MariaDB): without
  it queries are slower, not wrong; or one made for another database (a migration
  generated against another kind of database), which only costs writes;
* on MySQL/MariaDB, a **key column's collation** (:class:`~mqdedup.db.schema.KeyString`
  columns get the server's binary NO PAD collation; an older outbox table has
  ``utf8mb4_bin``, which treats ``'id'`` and ``'id '`` as the same key).

:func:`schema_drift` lists those differences (``mqdedup db check``) and
:func:`upgrade_schema` removes them (``mqdedup db upgrade``). Neither is needed for a
worker to start: the hard requirements (tables and columns) are
:func:`mqdedup.db.engine.check_schema`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, Index, Table, create_mock_engine, inspect, text
from sqlalchemy.schema import CreateIndex, DropIndex

from mqdedup.db.dialects import traits
from mqdedup.db.schema import DEFAULT_PREFIX, KeyString, schema

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Drift:
    """One difference between a live table and this version's definition."""

    table: str
    description: str
    #: The statement that removes it (run by :func:`upgrade_schema`): an index to
    #: create (or, with ``drop``, to drop), or SQL.
    fix: Index | str
    drop: bool = False

    def __str__(self) -> str:
        return f"table {self.table}: {self.description} (run `mqdedup db upgrade`)"


def schema_drift(engine: Engine, prefix: str = DEFAULT_PREFIX) -> list[Drift]:
    """Missing indexes and (MySQL/MariaDB) key columns with another collation.

    Tables that do not exist yet are not drift (``init_schema`` creates them whole).
    """
    inspector = inspect(engine)
    existing = set(inspector.get_table_names())
    expected_indexes = _indexes_for_dialect(engine, prefix)
    drift: list[Drift] = []
    for name, table in schema(prefix).metadata.tables.items():
        if name not in existing:
            continue
        live_indexes = {index["name"] for index in inspector.get_indexes(name)}
        drift.extend(
            Drift(name, f"index {index.name} is missing", index)
            for index in sorted(table.indexes, key=lambda index: str(index.name))
            if index.name in expected_indexes and index.name not in live_indexes
        )
        # Made for another database (e.g. a migration generated elsewhere): only costs.
        drift.extend(
            Drift(name, f"index {index.name} is not used on this database", index, drop=True)
            for index in sorted(table.indexes, key=lambda index: str(index.name))
            if index.name not in expected_indexes and index.name in live_indexes
        )
        if traits(engine).key_collation:
            drift.extend(_collation_drift(engine, inspector, table))
    return drift


def upgrade_schema(engine: Engine, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove every :func:`schema_drift` item; return what was done, one line each."""
    done: list[str] = []
    for item in schema_drift(engine, prefix):
        with engine.begin() as connection:
            if isinstance(item.fix, Index) and item.drop:
                # Executed directly: Index.drop() would honour ddl_if and skip it here.
                connection.execute(DropIndex(item.fix))
                action = f"dropped index {item.fix.name} on {item.table}"
            elif isinstance(item.fix, Index):
                item.fix.create(connection, checkfirst=True)
                action = f"created index {item.fix.name} on {item.table}"
            else:
                connection.execute(text(item.fix))
                action = f"{item.table}: {item.description} -> fixed"
        log.info("schema upgraded", extra={"table": item.table, "change": item.description})
        done.append(action)
    return done


def _indexes_for_dialect(engine: Engine, prefix: str) -> set[str]:
    """Names of the indexes ``create_all`` makes on this engine's dialect (``ddl_if``)."""
    created: set[str] = set()

    def capture(statement: Any, *_args: Any, **_kwargs: Any) -> None:
        if isinstance(statement, CreateIndex):
            created.add(str(statement.element.name))

    mock = create_mock_engine(engine.url, capture)
    schema(prefix).metadata.create_all(mock, checkfirst=False)
    return created


def _collation_drift(engine: Engine, inspector: Any, table: Table) -> list[Drift]:
    # information_schema, not the inspector: SHOW CREATE TABLE omits a column's
    # collation when it equals the table's default, so the inspector reports None.
    live = {column["name"] for column in inspector.get_columns(table.name)}
    with engine.connect() as connection:
        collations: dict[str, str | None] = dict(
            connection.execute(
                text(
                    "SELECT COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS "
                    "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :table"
                ),
                {"table": table.name},
            ).all()
        )
    drift: list[Drift] = []
    for column in table.columns:
        if not isinstance(column.type, KeyString) or column.name not in live:
            continue
        expected = getattr(column.type.load_dialect_impl(engine.dialect), "collation", None)
        actual = collations.get(column.name)
        if expected and actual and actual != expected:
            nullable = "NULL" if column.nullable else "NOT NULL"
            drift.append(
                Drift(
                    table.name,
                    f"column {column.name} has collation {actual}, not {expected}",
                    f"ALTER TABLE {table.name} MODIFY {column.name} "
                    f"VARCHAR({column.type.length}) CHARACTER SET utf8mb4 "
                    f"COLLATE {expected} {nullable}",
                )
            )
    return drift

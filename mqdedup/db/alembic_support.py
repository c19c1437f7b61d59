"""Alembic autogenerate for mqdedup's tables: two hooks for your ``env.py``.

mqdedup's tables are SQLAlchemy ``MetaData`` (:func:`mqdedup.db.schema.schema`), so Alembic
can manage them next to your own. Two things need help, and these hooks give it::

    from mqdedup.db.alembic_support import include_object, render_item
    from mqdedup.db.schema import schema

    target_metadata = [Base.metadata, schema().metadata]
    ...
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_item=render_item,
        include_object=include_object,
    )

* :func:`render_item` writes mqdedup's column types so the generated file runs as
  written: ``KeyString`` (an exact, byte-wise key column on every database) with its
  import, and the JSON/JSONB variant without Alembic's unimportable ``Text()``.
* :func:`include_object` keeps indexes meant for other databases out of the migration
  (the outbox has MySQL/MariaDB-only indexes and PostgreSQL/SQLite-only partial ones,
  created by ``ddl_if``, which autogenerate does not see; :func:`~mqdedup.db.schema.only_on`
  records them in each index's public ``info``).

Generate the migration against each kind of database you deploy to (the index set
differs). ``mqdedup db check`` then agrees with what was created.
"""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import JSON, Index
from sqlalchemy.dialects import postgresql

from mqdedup.db.schema import INDEX_DIALECTS, KeyString

__all__ = ["include_object", "render_item"]

_POSTGRESQL = postgresql.dialect()  # type: ignore[no-untyped-call]


def render_item(type_: str, obj: Any, autogen_context: Any) -> str | Literal[False]:
    """Alembic ``render_item`` hook: mqdedup's types, importable as written."""
    if type_ != "type":
        return False
    if isinstance(obj, KeyString):
        autogen_context.imports.add("import mqdedup.db.schema")
        return f"mqdedup.db.schema.KeyString(length={obj.length})"
    if isinstance(obj, JSON) and _jsonb_on_postgresql(obj):
        autogen_context.imports.add("from sqlalchemy.dialects import postgresql")
        return "sa.JSON().with_variant(postgresql.JSONB(), 'postgresql')"
    return False


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Alembic ``include_object`` hook: leave out indexes made for other databases."""
    if type_ != "index" or reflected or not isinstance(obj, Index):
        return True
    dialects = index_dialects(obj)
    if dialects is None:
        return True
    from alembic import context  # the migration context of the running env.py

    return str(context.get_context().dialect.name) in dialects


def index_dialects(index: Index) -> tuple[str, ...] | None:
    """The databases an index is created on, or None for all (recorded in the index's
    public ``info`` by :func:`mqdedup.db.schema.only_on`)."""
    dialects = index.info.get(INDEX_DIALECTS)
    return None if dialects is None else tuple(dialects)


def _jsonb_on_postgresql(json_type: JSON) -> bool:
    """True for a JSON type that is JSONB on PostgreSQL (``with_variant``), asked through
    the public ``TypeEngine.dialect_impl``."""
    return isinstance(json_type.dialect_impl(_POSTGRESQL), postgresql.JSONB)

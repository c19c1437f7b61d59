"""The core reaches SQLAlchemy through its public API (issue 41): the Alembic hooks read
which databases an index is made for from the index's public ``info`` and the JSONB
variant through ``TypeEngine.dialect_impl``; the one undocumented piece left, the
greenlet bridge (``sqlalchemy.util.concurrency``), has a fallback that is run here."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import JSON, Index, create_engine, inspect
from sqlalchemy.dialects import postgresql

from mqdedup import bridge
from mqdedup.db.alembic_support import index_dialects, render_item
from mqdedup.db.schema import JSONType, schema
from mqdedup.errors import ConfigurationError


def _indexes() -> list[Index]:
    tables = schema("t_").metadata.tables.values()
    return [index for table in tables for index in table.indexes]


def test_the_alembic_hook_knows_each_indexs_databases_as_the_ddl_does() -> None:
    """What ``include_object`` reads agrees with what ``ddl_if`` creates (SQLite here)."""
    limited = {index.name: index_dialects(index) for index in _indexes()}
    assert limited["t_outbox_claim_idx"] == ("mysql", "mariadb")
    assert limited["t_outbox_pending_idx"] == ("postgresql", "sqlite")
    assert limited["t_processed_at_brin"] == ("postgresql",)
    engine = create_engine("sqlite://")
    schema("t_").metadata.create_all(engine)
    created = {
        index["name"]
        for table in inspect(engine).get_table_names()
        for index in inspect(engine).get_indexes(table)
    }
    engine.dispose()
    for name, dialects in limited.items():
        assert (name in created) == (dialects is None or "sqlite" in dialects), name


def test_the_jsonb_variant_is_rendered_importable_and_plain_json_is_left_alone() -> None:
    context = SimpleNamespace(imports=set())
    rendered = render_item("type", JSONType, context)
    assert rendered == "sa.JSON().with_variant(postgresql.JSONB(), 'postgresql')"
    assert context.imports == {"from sqlalchemy.dialects import postgresql"}
    assert render_item("type", JSON(), SimpleNamespace(imports=set())) is False
    assert (
        render_item("type", JSON().with_variant(postgresql.JSON(), "postgresql"), context) is False
    )


def test_without_sqlalchemys_greenlet_bridge_async_consumers_refuse_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bridge, "SQLALCHEMY_BRIDGE", False)
    assert bridge.in_bridge() is False
    with pytest.raises(ConfigurationError, match=r"sqlalchemy\.util\.concurrency"):
        bridge.run_blocking(lambda: None)

    async def nothing() -> None:
        return None

    with pytest.raises(bridge.NotInBridgeError):
        bridge.wait_for(nothing())


def test_with_it_the_bridge_awaits_from_synchronous_code() -> None:
    def synchronous() -> Any:
        assert bridge.in_bridge()
        return bridge.wait_for(asyncio.sleep(0, result=42))

    assert bridge.run_blocking(synchronous) == 42

"""Claimed rows become records exactly as ``json.loads`` and the database would say."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from mqdedup.outbox.store import _array_literal, _records

HEADERS = [
    '{"message-id": "m-1"}',
    ' {"message-id": "m-2", "n": [1, 2.5, null, true]} ',  # whitespace around: json.loads
    '{"causation-id": "\\u00e9\\ud83d\\ude00", "nested": {"a": {}}}',
]


def _row(
    row_id: int, headers: str, properties: str | None, created: datetime
) -> tuple[object, ...]:
    return (row_id, f"m-{row_id}", "kafka", "t", None, b"k", headers, properties, b"{}", 0, created)


@pytest.mark.parametrize(
    "created", [datetime(2026, 1, 1, 12, tzinfo=UTC), datetime(2026, 1, 1, 12)]
)
def test_records_decode_json_like_json_loads_sorted_by_id_with_aware_timestamps(
    created: datetime,
) -> None:
    rows = [
        _row(10 - n, text, None if n else '{"message_id": "x"}', created)
        for n, text in enumerate(HEADERS)
    ]
    records = _records(rows)
    assert [record.id for record in records] == [8, 9, 10]
    assert [record.headers for record in records] == [json.loads(t) for t in reversed(HEADERS)]
    assert records[-1].properties == {"message_id": "x"} and records[0].properties is None
    assert all(record.created_at == created.replace(tzinfo=UTC) for record in records)
    assert records[0].key == b"k" and records[0].attempts == 0


@pytest.mark.parametrize("text", ['{"a": 1} x', "{", ""])
def test_invalid_json_raises_what_json_loads_raises(text: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        _records([_row(1, text, None, datetime.now(UTC))])


def test_array_literal() -> None:
    assert _array_literal([]) == "{}"
    assert _array_literal([3, 10, 9_000_000_000]) == "{3,10,9000000000}"


def test_postgresql_id_arrays_are_untyped_parameters_cast_once() -> None:
    """A text-typed parameter (``%(ids)s::VARCHAR``) made PostgreSQL parse the array
    again on every row the claim examined (250 ms claims); untyped, it is a constant."""
    from sqlalchemy.dialects.postgresql import psycopg

    from mqdedup.outbox.store import OutboxStore

    store, dialect = OutboxStore("t_"), psycopg.dialect()
    for sharded in (False, True):
        claim = str(store._claim_statement(sharded).compile(dialect=dialect))
        assert "CAST(%(in_flight)s AS BIGINT[])" in claim
    mark = str(store._mark_statement(dialect).compile(dialect=dialect))
    assert "= ANY (CAST(%(ids)s AS BIGINT[]))" in mark

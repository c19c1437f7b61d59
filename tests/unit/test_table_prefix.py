"""The table prefix's precedence and its limits (the CLI end to end: tests/acceptance)."""

from __future__ import annotations

import pytest

from mqdedup import Consumer
from mqdedup.cli.config import (
    consumer_table_prefix,
    declared_table_prefix,
    resolve_with_source,
    use_table_prefix,
)
from mqdedup.db.schema import DEFAULT_PREFIX, MAX_IDENTIFIER_BYTES, schema
from mqdedup.errors import ConfigurationError


class Plain(Consumer):
    """Sets no table_prefix."""


class Pinned(Consumer):
    table_prefix = "pinned_"


class PinnedChild(Pinned):
    """Inherits the pinned prefix from a user base class."""


def test_only_user_classes_declare_a_prefix() -> None:
    assert declared_table_prefix(Plain) is None
    assert declared_table_prefix(Pinned) == "pinned_"
    assert declared_table_prefix(PinnedChild) == "pinned_"


@pytest.mark.parametrize(
    ("cls", "configured", "source", "expected"),
    [
        (Plain, DEFAULT_PREFIX, None, DEFAULT_PREFIX),  # nothing anywhere: the default
        (Plain, "p_", "--table-prefix", "p_"),  # configured, class silent: configured
        (Pinned, DEFAULT_PREFIX, None, "pinned_"),  # class only: the class
        (Pinned, "pinned_", "environment variable MQDEDUP_TABLE_PREFIX", "pinned_"),  # agree
    ],
)
def test_precedence(cls: type, configured: str, source: str | None, expected: str) -> None:
    assert consumer_table_prefix(cls, configured, source, "m:C") == expected


def test_a_contradiction_is_refused_naming_both_sides() -> None:
    with pytest.raises(ConfigurationError) as caught:
        consumer_table_prefix(PinnedChild, "other_", "config [mqdedup] table_prefix", "m:C")
    assert str(caught.value).startswith(
        "m:C sets table_prefix = 'pinned_' but config [mqdedup] table_prefix says 'other_'"
    )


def test_the_source_of_a_setting_is_reported() -> None:
    file_data = {"mqdedup": {"table_prefix": "file_"}}
    env = {"MQDEDUP_TABLE_PREFIX": "env_"}
    assert resolve_with_source("table_prefix", "flag_", file_data, env) == (
        "flag_",
        "--table-prefix",
    )
    assert resolve_with_source("table_prefix", None, file_data, env)[1] == (
        "environment variable MQDEDUP_TABLE_PREFIX"
    )
    assert resolve_with_source("table_prefix", None, file_data, {})[1] == (
        "config [mqdedup] table_prefix"
    )
    assert resolve_with_source("table_prefix", None, {}, {}) == (DEFAULT_PREFIX, None)


def test_an_instance_can_be_given_its_prefix_without_touching_the_class() -> None:
    consumer = Plain()
    use_table_prefix(consumer, "p_")
    assert consumer.table_prefix == "p_" and Plain.table_prefix == DEFAULT_PREFIX


def test_every_name_built_from_the_longest_accepted_prefix_fits() -> None:
    longest = "x" * 40
    tables = schema(longest)
    names = [t.name for t in tables.metadata.tables.values()]
    names += [i.name for t in tables.metadata.tables.values() for i in t.indexes if i.name]
    assert max(len(str(n)) for n in names) <= MAX_IDENTIFIER_BYTES
    with pytest.raises(ConfigurationError, match="use at most 40 characters"):
        schema("x" * 41)

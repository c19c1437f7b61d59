"""Hypothesis strategies for AMQP 0-9-1 basic properties (shared by the codec tests)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

SHORT_STRINGS = ("content_type", "content_encoding", "correlation_id", "reply_to")
MORE_SHORT_STRINGS = ("message_id", "type", "user_id", "app_id", "cluster_id")


def basic_properties(
    short: st.SearchStrategy[Any], headers: st.SearchStrategy[dict[str, Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    """Any subset of the 14 basic properties, with ``short`` for the short strings."""
    optional: dict[str, st.SearchStrategy[Any]] = {name: short for name in SHORT_STRINGS}
    optional.update({name: short for name in MORE_SHORT_STRINGS})
    optional.update(
        headers=headers,
        delivery_mode=st.integers(1, 2),
        priority=st.integers(0, 255),
        expiration=st.integers(0, 10**9).map(str),
        timestamp=st.integers(0, 2**64 - 1),
    )
    return st.fixed_dictionaries({}, optional=optional)

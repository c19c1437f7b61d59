"""``mqdedup status``: consumers' lag, the dedup table and the outbox on one screen."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sqlalchemy import Engine

from mqdedup.commands.dead_letters import dead_letter_counts
from mqdedup.commands.operations import dedup_stats, format_dedup_stats, format_outbox_status
from mqdedup.commands.tables import render_table
from mqdedup.consumers.base import Consumer
from mqdedup.errors import MqdedupError

log = logging.getLogger(__name__)


def status_screen(engine: Engine, prefix: str, consumers: Sequence[Consumer]) -> str:
    """The whole screen as text."""
    sections = []
    if consumers:
        rows = []
        for consumer in consumers:
            lag_of = getattr(consumer, "lag", None)
            if lag_of is None:
                rows.append((consumer.consumer_name, "-", "lag not available for this consumer"))
                continue
            try:
                lags = lag_of()
            except MqdedupError as exc:
                rows.append((consumer.consumer_name, "-", str(exc)))
                continue
            rows.extend(
                (consumer.consumer_name, where, count) for where, count in sorted(lags.items())
            )
        sections.append(
            "Consumers\n" + render_table(["consumer", "partition / queue", "lag"], rows)
        )
    sections.append("Dedup table\n" + format_dedup_stats(*dedup_stats(engine, prefix)))
    sections.append("Outbox\n" + format_outbox_status(engine, prefix))
    sections.append("Dead letters kept in the database\n" + _kept_dead_letters(engine, prefix))
    return "\n\n".join(sections)


def _kept_dead_letters(engine: Engine, prefix: str) -> str:
    """Dead letters the broker refused, per consumer (``mqdedup dead-letters list``)."""
    counts = dead_letter_counts(engine, prefix)
    if not counts:
        return "none"
    return render_table(["consumer", "kept"], sorted(counts.items()))

"""``mqdedup status``: consumers' lag, the dedup table, the outbox, the kept dead letters
and the consumers' dead-letter topics / queues (their depth) on one screen (or as JSON).
A broker that cannot be reached does not stop the screen: its consumers' lag column names
it (``cannot reach RabbitMQ at host:5672: Connection refused``), the database sections
print as usual and the exit code says it."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine

from mqdedup.cli import exitcodes
from mqdedup.cli.admin import (
    connected_engine,
    dedup_stats,
    dedup_stats_data,
    format_dedup_stats_data,
    format_outbox_status_data,
    outbox_status_data,
    require_current_schema,
)
from mqdedup.cli.config import consumer_prefix, resolve_settings
from mqdedup.cli.dead_letters import dead_letter_counts
from mqdedup.cli.loading import create_consumer
from mqdedup.cli.output import print_json, render_table
from mqdedup.cli.reachability import check_consumer_broker
from mqdedup.cli.runners import _export_environment
from mqdedup.consumers.base import Consumer
from mqdedup.errors import BrokerUnavailableError, MqdedupError
from mqdedup.masking import mask_text

log = logging.getLogger(__name__)


def cmd_status(args: argparse.Namespace) -> int:
    settings = resolve_settings(
        args, "database_url", "table_prefix", "kafka_bootstrap", "rabbitmq_url"
    )
    _export_environment(settings)
    consumers = [create_consumer(reference) for reference in args.consumers]
    prefixes = {
        consumer_prefix(args, reference, consumer)
        for reference, consumer in zip(args.consumers, consumers, strict=True)
    }
    engine, prefix = connected_engine(args, require_schema=False)
    if len(prefixes) == 1:  # the consumers' own tables, when they all agree
        prefix = prefixes.pop()
    require_current_schema(engine, prefix)
    data = status_data(engine, prefix, consumers)
    if args.json:
        print_json(data)
    else:
        print(status_screen(data))
    unreachable = [e for e in data["consumers"] if e["unreachable"]]
    if unreachable:  # the screen is printed; the exit code and one line say what is missing
        names = ", ".join(sorted({e["consumer"] for e in unreachable}))
        print(f"mqdedup: error: {unreachable[0]['error']} (lag unknown: {names})", file=sys.stderr)
        return exitcodes.BROKER_UNAVAILABLE
    return exitcodes.OK


def consumer_lags(consumers: Sequence[Consumer]) -> list[dict[str, Any]]:
    """One entry per consumer and partition / queue: ``consumer``, ``where``, ``lag``,
    ``error``, ``unreachable`` (``lag`` is None and ``error`` says why when it cannot be
    read; ``unreachable``: because the broker cannot be reached)."""
    entries: list[dict[str, Any]] = []
    for consumer in consumers:
        name = consumer.consumer_name
        try:
            lags = _lag(consumer)
        except Exception as exc:  # one consumer's broker must not hide the rest
            log.debug("lag unavailable", extra={"consumer": name}, exc_info=True)
            entries.append(
                {
                    "consumer": name,
                    "where": None,
                    "lag": None,
                    "error": _reason(exc),
                    "unreachable": isinstance(exc, BrokerUnavailableError),
                }
            )
            continue
        if lags is None:
            entries.append(
                {
                    "consumer": name,
                    "where": None,
                    "lag": None,
                    "error": "lag not available for this consumer",
                    "unreachable": False,
                }
            )
            continue
        entries.extend(
            {"consumer": name, "where": where, "lag": count, "error": None, "unreachable": False}
            for where, count in sorted(lags.items())
        )
    return entries


def _lag(consumer: Consumer) -> dict[str, int] | None:
    lag_of = getattr(consumer, "lag", None)
    if lag_of is None:
        return None
    check_consumer_broker(consumer)  # a quick TCP check: an unreachable broker, named
    lags: dict[str, int] = lag_of()
    return lags


def _reason(error: Exception) -> str:
    if isinstance(error, MqdedupError):
        return mask_text(str(error))
    detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return mask_text(
        f"cannot read the lag: {type(error).__name__}" + (f": {detail}" if detail else "")
    )


def status_data(engine: Engine, prefix: str, consumers: Sequence[Consumer]) -> dict[str, Any]:
    """``status --json``: ``consumers`` (lags), ``dedup``, ``outbox``, ``dead_letters``,
    ``dead_letter_depths`` (the consumers' dead-letter topics and queues)."""
    lags = consumer_lags(consumers)
    unreachable = {entry["consumer"] for entry in lags if entry["unreachable"]}
    return {
        "consumers": lags,
        "dedup": dedup_stats_data(*dedup_stats(engine, prefix)),
        "outbox": outbox_status_data(engine, prefix),
        "dead_letters": dict(sorted(dead_letter_counts(engine, prefix).items())),
        # A broker found unreachable for the lag is not asked again (no second wait).
        "dead_letter_depths": dead_letter_depths(
            engine, [c for c in consumers if c.consumer_name not in unreachable]
        ),
    }


def dead_letter_depths(engine: Engine, consumers: Sequence[Consumer]) -> list[dict[str, Any]]:
    """Per consumer and dead-letter topic / queue: ``consumer``, ``place``, ``where``,
    ``depth`` (Kafka: records not yet deleted, replayed or requeued), ``error``."""
    from mqdedup.kafka.dead_letter_topic import KafkaDeadLetterTopics
    from mqdedup.rabbitmq.dead_letter_queue import RabbitDeadLetterQueues

    entries: list[dict[str, Any]] = []
    for consumer in consumers:
        name = consumer.consumer_name
        try:
            place: KafkaDeadLetterTopics | RabbitDeadLetterQueues
            if hasattr(consumer, "kafka_settings"):
                place = KafkaDeadLetterTopics.for_consumer(consumer, engine, timeout=10.0)
            elif hasattr(consumer, "topology"):
                place = RabbitDeadLetterQueues.for_consumer(consumer, engine)
            else:
                continue
            depths = place.depths()
        except Exception as exc:  # one broker must not hide the rest of the screen
            log.debug("dead-letter depth unavailable", extra={"consumer": name}, exc_info=True)
            entries.append(
                {
                    "consumer": name,
                    "place": None,
                    "where": None,
                    "depth": None,
                    "error": _reason(exc).replace("cannot read the lag", "cannot read the depth"),
                }
            )
            continue
        entries.extend(
            {"consumer": name, "place": place.place, "where": where, "depth": depth, "error": None}
            for where, depth in sorted(depths.items())
        )
    return entries


def status_screen(data: dict[str, Any]) -> str:
    """The whole screen as text, from :func:`status_data`."""
    sections = []
    if data["consumers"]:
        rows = [
            (e["consumer"], e["where"] or "-", e["lag"] if e["error"] is None else e["error"])
            for e in data["consumers"]
        ]
        sections.append(
            "Consumers\n" + render_table(["consumer", "partition / queue", "lag"], rows)
        )
    sections.append("Dedup table\n" + format_dedup_stats_data(data["dedup"]))
    sections.append("Outbox\n" + format_outbox_status_data(data["outbox"]))
    sections.append(
        "Dead letters kept in the database\n" + _kept_dead_letters(data["dead_letters"])
    )
    if data.get("dead_letter_depths"):
        rows = [
            (e["consumer"], e["where"] or "-", e["depth"] if e["error"] is None else e["error"])
            for e in data["dead_letter_depths"]
        ]
        sections.append(
            "Dead-letter topics and queues\n"
            + render_table(["consumer", "topic / queue", "dead letters"], rows)
        )
    return "\n\n".join(sections)


def _kept_dead_letters(counts: dict[str, int]) -> str:
    """Dead letters the broker refused, per consumer (``mqdedup dead-letters list``)."""
    if not counts:
        return "none"
    return render_table(["consumer", "kept"], sorted(counts.items()))

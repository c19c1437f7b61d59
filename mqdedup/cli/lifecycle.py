"""The start and stop lines of ``mqdedup worker`` and ``mqdedup relay``, printed by default
on stderr (with the logs; ``--quiet`` leaves them out): what runs and where when it
starts — consumers with their topics or queue and group, processes, the database and
brokers with secrets masked — and what it did when it stops (counts, exit code, time)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from mqdedup.cli.reachability import consumer_broker
from mqdedup.masking import mask_text, mask_url

#: The counters of the worker's stop line, in order, with their names in the line.
WORKER_COUNTS = (
    ("processed", "processed"),
    ("duplicates", "duplicates"),
    ("dead_lettered", "dead-lettered"),
    ("failures", "handler failures"),
)
#: The counters of the relay's stop line.
RELAY_COUNTS = (
    ("published", "published"),
    ("rejected", "refused by the broker"),
    ("failed", "failed"),
)


def say(line: str) -> None:
    """One line on stderr, secrets masked, flushed at once (it may be all a log shows)."""
    print(mask_text(line), file=sys.stderr, flush=True)


def describe_consumer(consumer: Any) -> str:
    """``orders (Kafka topics orders, group orders at kafka:9092)``: what it consumes."""
    parts: list[str] = []
    topics = getattr(consumer, "topics", None)
    pattern = getattr(consumer, "topic_pattern", None)
    if topics or pattern:
        parts.append(f"topics {', '.join(topics)}" if topics else f"topics matching {pattern}")
        group = getattr(consumer, "group_id", None)
        if group:
            parts.append(f"group {group}")
    queue = getattr(consumer, "queue", None)
    if isinstance(queue, str) and queue:
        parts.append(f"queue {queue}")
    try:
        broker = consumer_broker(consumer)
    except Exception:  # a consumer without its broker's settings: said at connect
        broker = None
    where = f"{broker[0]} " if broker else ""
    text = where + ", ".join(parts)
    if broker:
        text += f" at {mask_url(broker[1])}"
    if not consumer.dedup.needs_database:
        text += ", claims in Redis"
    return f"{consumer.consumer_name} ({text.strip() or 'no broker'})"


def worker_start_line(
    consumers: Sequence[Any], settings: Mapping[str, Any], *, database: bool
) -> str:
    """The worker's start line."""
    processes = int(settings["processes"])
    each = " each" if len(consumers) > 1 else ""
    text = (
        f"mqdedup worker: started {', '.join(describe_consumer(c) for c in consumers)}; "
        f"{processes} process{'es' if processes != 1 else ''}{each}"
    )
    if database:
        text += f"; database {mask_url(settings['database_url'])}"
    return text + _health(settings)


def relay_start_line(settings: Mapping[str, Any], table: str, *, drain: bool) -> str:
    """The relay's start line (``--drain``: one process, until nothing is due)."""
    brokers = []
    if settings.get("kafka_bootstrap"):
        brokers.append(f"Kafka {mask_url(settings['kafka_bootstrap'])}")
    if settings.get("rabbitmq_url"):
        brokers.append(f"RabbitMQ {mask_url(settings['rabbitmq_url'])}")
    processes = int(settings["relay_processes"])
    who = (
        "draining (one process, until nothing is due)"
        if drain
        else f"started {processes} process{'es' if processes != 1 else ''}"
    )
    text = (
        f"mqdedup relay: {who} publishing outbox table {table} of database "
        f"{mask_url(settings['database_url'])} to {' and '.join(brokers) or 'no broker'}; "
        f"coordination {settings.get('relay_coordination') or 'session'}"
    )
    return text + ("" if drain else _health(settings))


def stop_line(
    command: str,
    code: int,
    seconds: float,
    totals: Mapping[str, float],
    counts: Sequence[tuple[str, str]],
    extra: str = "",
) -> str:
    """``mqdedup worker: stopped (exit 0) after 12.3s: 3,000 processed, ...``."""
    figures = ", ".join(f"{int(totals.get(key, 0)):,} {label}" for key, label in counts)
    return f"mqdedup {command}: stopped (exit {code}) after {seconds:.1f}s: {figures}{extra}"


def sum_counters(snapshots: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The numeric counters of several children's metric snapshots, added up."""
    totals: dict[str, float] = {}
    for snapshot in snapshots:
        for key, value in snapshot.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                totals[key] = totals.get(key, 0) + value
    return totals


def _health(settings: Mapping[str, Any]) -> str:
    port = settings.get("health_port")
    if port is None:
        return ""
    host = settings.get("health_host") or "0.0.0.0"  # noqa: S104 - only shown
    return f"; health http://{host}:{port}/healthz"

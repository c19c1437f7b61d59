"""``mqdedup replay``: run a consumer again over a past range of its Kafka topic or RabbitMQ
stream, or move its RabbitMQ dead letters back to its queue, through its dedup (messages
already processed are skipped as duplicates), refusing a range that reaches before the
dedup retention horizon unless asked."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine

from mqdedup.cli import exitcodes
from mqdedup.cli.admin import connected_engine, require_current_schema
from mqdedup.cli.config import consumer_prefix, resolve_settings
from mqdedup.cli.exitcodes import RefusedError, UsageError
from mqdedup.cli.loading import create_consumer
from mqdedup.cli.output import render_table
from mqdedup.cli.progress import Progress, watching
from mqdedup.cli.reachability import connect_broker
from mqdedup.cli.runners import _export_environment
from mqdedup.consumers.base import Consumer
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import ConfigurationError
from mqdedup.gc_tuning import tune_gc
from mqdedup.stopping import ImmediateStop, StopToken, graceful_signals

BEGINNING = ("beginning", "earliest", "start")
END = ("end", "latest")


def cmd_replay(args: argparse.Namespace) -> int:
    settings = resolve_settings(
        args, "database_url", "table_prefix", "kafka_bootstrap", "rabbitmq_url"
    )
    _export_environment(settings)
    start = parse_position(args.start)
    end = parse_position(args.end, end=True)
    check_range(start, end)
    if args.from_dlq and (args.dry_run or args.partitions or args.start != "beginning"):
        raise UsageError("--from-dlq moves dead letters back: it takes no range or --dry-run")
    consumer = create_consumer(args.consumer)
    consumer_prefix(args, args.consumer, consumer)
    consumer.validate()
    engine, _ = connected_engine(args, require_schema=False)
    require_current_schema(engine, consumer.table_prefix)
    kind = consumer.broker
    if args.from_dlq:
        if kind != "rabbitmq":
            raise UsageError("--from-dlq is for RabbitMQ consumers")
        connect_broker(consumer)
        print(requeue_from_dlq(consumer, engine, args.limit))
        return exitcodes.OK
    if kind is None:
        raise ConfigurationError(
            f"{args.consumer} is neither a KafkaConsumer nor a RabbitMQConsumer: "
            "replay needs a broker to read from"
        )
    connect_broker(consumer)
    stop = StopToken()
    progress = Progress(sys.stderr, "replay", unit="messages", enabled=not args.quiet)
    try:
        with graceful_signals(stop):
            if kind == "kafka":
                report = replay_kafka(
                    consumer,
                    engine,
                    start=start,
                    end=end,
                    partitions=args.partitions,
                    dry_run=args.dry_run,
                    allow_reprocess=args.allow_reprocess,
                    stop=stop,
                    progress=progress,
                )
            else:
                report = replay_stream(
                    consumer,
                    engine,
                    start=start,
                    end=end,
                    stream=args.stream,
                    dry_run=args.dry_run,
                    allow_reprocess=args.allow_reprocess,
                    stop=stop,
                    progress=progress,
                )
    except ImmediateStop:
        return exitcodes.INTERRUPTED
    print(format_replay_report(report))
    dead = report.without_id + report.dead_lettered
    if dead and not report.dry_run:
        print(
            f"mqdedup: {dead} of {report.total} message(s) dead-lettered (exit code "
            f"{exitcodes.DEAD_LETTERED}): see the consumer's dead-letter topic / queue",
            file=sys.stderr,
        )
        return exitcodes.DEAD_LETTERED
    return exitcodes.OK


class ReplayRefusedError(RefusedError):
    """The range reaches before the retention horizon (ids there may have been purged)."""


def parse_position(text: str, *, end: bool = False) -> int | datetime | None:
    """An offset, an ISO-8601 time (UTC if no zone is given), or beginning / end (None)."""
    value = text.strip()
    if value.lower() in (END if end else BEGINNING):
        return None
    if value.isdigit():
        return int(value)
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        expected = "an offset, an ISO time" + (", or 'end'" if end else ", or 'beginning'")
        raise UsageError(
            f"cannot read {text!r} as a position ({'--to' if end else '--from'}): "
            f"expected {expected}"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def check_range(start: int | datetime | None, end: int | datetime | None) -> None:
    """UsageError for a range that ends where or before it starts (``--from 5 --to 2``,
    or two times the wrong way round): it would read nothing. An offset and a time are
    not compared (a time falls at a different offset on each partition)."""
    if start is None or end is None or isinstance(start, datetime) != isinstance(end, datetime):
        return
    if end <= start:  # type: ignore[operator]  # both offsets or both times
        what = "offset" if isinstance(start, int) else "time"
        raise UsageError(
            f"--to {_shown(end)} is not after --from {_shown(start)}: the range is empty "
            f"(--to is exclusive); give a later --to {what}, or swap them"
        )


def _shown(position: int | datetime) -> str:
    return position.isoformat() if isinstance(position, datetime) else str(position)


def replay_kafka(
    consumer: Consumer,
    engine: Engine,
    *,
    start: int | datetime | None,
    end: int | datetime | None,
    partitions: list[int] | None,
    dry_run: bool,
    allow_reprocess: bool,
    stop: StopToken,
    progress: Progress | None = None,
) -> Any:
    """Replay a Kafka consumer's topics over the range; return its ReplayReport."""
    from mqdedup.kafka.replay import KafkaReplay

    replay = KafkaReplay(
        consumer,  # type: ignore[arg-type]
        engine,
        start=start,
        end=end,
        partitions=partitions,
        dry_run=dry_run,
        stop=stop,
    )
    try:
        _check_kafka_horizon(replay, consumer, engine, allow_reprocess)
    except BaseException:
        replay.close()
        raise
    with watching(progress or Progress(None, "replay"), lambda: _done_and_total(replay)):
        tune_gc()
        return replay.run()


def _check_kafka_horizon(
    replay: Any, consumer: Consumer, engine: Engine, allow_reprocess: bool
) -> None:
    """Refuse a range starting before the dedup retention horizon (unless allowed)."""
    from mqdedup.kafka.horizon import partitions_before_horizon

    horizon = DedupStore(consumer.table_prefix).retention_horizon(engine, consumer.consumer_name)
    if horizon is None or allow_reprocess:
        return
    early = partitions_before_horizon(replay, horizon)
    if early:
        where = ", ".join(f"{k} from {s} (horizon at {h})" for k, (s, h) in sorted(early.items()))
        raise ReplayRefusedError(
            f"the range starts before the dedup retention horizon {horizon.isoformat()} "
            f"(dedup records older than that may have been purged, so those messages could "
            f"be applied twice): {where}; replay from after the horizon, or pass "
            "--allow-reprocess to accept it"
        )


def replay_stream(
    consumer: Consumer,
    engine: Engine,
    *,
    start: int | datetime | None,
    end: int | datetime | None,
    stream: str | None,
    dry_run: bool,
    allow_reprocess: bool,
    stop: StopToken,
    progress: Progress | None = None,
) -> Any:
    """Replay a RabbitMQ stream queue through the consumer; return its report.

    A stream keeps no per-message write time this side can compare cheaply, so a
    replay starting at ``first`` or an offset after a purge is refused unless the
    start is a time after the horizon, or ``allow_reprocess`` is given.
    """
    from mqdedup.rabbitmq.stream import StreamReplay

    horizon = DedupStore(consumer.table_prefix).retention_horizon(engine, consumer.consumer_name)
    starts_late = isinstance(start, datetime) and horizon is not None and start >= horizon
    if horizon is not None and not allow_reprocess and not starts_late:
        raise ReplayRefusedError(
            f"the range may start before the dedup retention horizon {horizon.isoformat()} "
            "(dedup records older than that may have been purged, so those messages could be "
            "applied twice); give --from a time after the horizon, or pass --allow-reprocess"
        )
    replay = StreamReplay(
        consumer,  # type: ignore[arg-type]
        engine,
        start=start,
        end=end,
        dry_run=dry_run,
        stop=stop,
        stream=stream,
    )
    with watching(progress or Progress(None, "replay"), lambda: _done_and_total(replay)):
        tune_gc()
        return replay.run()


def _done_and_total(replay: Any) -> tuple[int, int | None]:
    """Messages read so far, and the range's size when it is known (None: not yet)."""
    report = replay.report
    total = sum(max(0, b - a) for a, b in report.ranges.values())
    return report.total, total or None


def format_replay_report(report: Any) -> str:
    """The final summary table.

    Messages without a message id are dead-lettered (dedup cannot recognise them), and
    counted as such: a replay over the same range dead-letters them again each time.
    """
    title = "Replay (dry run: nothing written)" if report.dry_run else "Replay"
    would = " (would be)" if report.dry_run else ""
    rows = [
        ("messages read", report.total),
        ("new" + (" (would be processed)" if report.dry_run else " (processed now)"), report.new),
        ("duplicates (already processed)", report.duplicates),
        (f"dead-lettered{would}: without a message id", report.without_id),
        ("dead-lettered: handler kept failing", report.dead_lettered),
        ("dead-lettered in total" + would, report.without_id + report.dead_lettered),
        ("unsettled", report.unsettled),
    ]
    ranges = ", ".join(f"{k} [{a}, {b})" for k, (a, b) in sorted(report.ranges.items()))
    text = f"{title}\n{render_table(['', 'count'], rows)}\nranges: {ranges or '-'}"
    if report.without_id:
        text += (
            f"\nnote: {report.without_id} message(s) carry no message id, so dedup cannot "
            f"recognise them: {'a replay would dead-letter' if report.dry_run else 'dead-lettered'}"
            " them again (every replay over this range does); give the consumer a message-id "
            "fallback to process them instead (docs/message-ids.md)"
        )
    return text


def requeue_from_dlq(consumer: Consumer, engine: Engine, limit: int | None) -> str:
    """Move dead letters back to the consumer's queue (they are then processed by its
    workers, through dedup) and describe what happened."""
    result = consumer.requeue_dead_letters(limit, database=engine)  # type: ignore[attr-defined]
    return (
        f"moved {result.moved} message(s) from the dead-letter queue back to the queue "
        f"({result.remaining} left, {result.skipped} skipped)"
    )

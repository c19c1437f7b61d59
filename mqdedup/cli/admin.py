"""The commands on the framework's tables: ``db`` (create, upgrade and check the schema),
``dedup`` (purge and count claims) and ``outbox`` (status, retry of failed rows, purge),
with the connected engine every database command starts from (:func:`connected_engine`,
refusing tables of another version)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, func, select

from mqdedup.cli import exitcodes
from mqdedup.cli.config import resolve_settings
from mqdedup.cli.exitcodes import RefusedError
from mqdedup.cli.output import human_age, print_json, render_table
from mqdedup.cli.progress import Progress
from mqdedup.db.dialects import table_size
from mqdedup.db.engine import check_connection, check_schema, create_engine, init_schema
from mqdedup.db.migrations import schema_drift, upgrade_schema
from mqdedup.db.replication import replication_warning
from mqdedup.db.schema import schema
from mqdedup.dedup.store import DedupStore, utcnow
from mqdedup.errors import (
    ConfigurationError,
)
from mqdedup.outbox.store import OutboxStore
from mqdedup.outbox.writer import PUBLISHED

#: How ``outbox status`` shows RabbitMQ's default (nameless) exchange.
DEFAULT_EXCHANGE = "(default exchange)"
#: ``dedup purge`` asks for confirmation (or ``--yes``) below this horizon: redeliveries
#: after an outage and replays of recent history rely on the claims of the last day.
PURGE_CONFIRM_BELOW = timedelta(days=1)
PURGE_CONFIRM_TEXT = "1d"


def connected_engine(
    args: argparse.Namespace, *, require_schema: bool = True
) -> tuple[Engine, str]:
    """A connected engine for the command's database, and the table prefix."""
    settings = resolve_settings(args)
    engine = create_engine(settings["database_url"])
    check_connection(engine)
    if require_schema:
        require_current_schema(engine, settings["table_prefix"])
    return engine, settings["table_prefix"]


def require_current_schema(engine: Engine, prefix: str) -> None:
    """Raise ConfigurationError naming the first mismatch of the tables with this version."""
    problems = check_schema(engine, prefix)
    if problems:
        raise ConfigurationError(f"the database does not match this mqdedup version: {problems[0]}")


def cmd_db_init(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args, require_schema=False)
    created = init_schema(engine, prefix)
    changed = upgrade_schema(engine, prefix)
    if created:
        print(f"created: {', '.join(created)}")
    for change in changed:
        print(change)
    if not (created or changed):
        print("schema is up to date")
    return exitcodes.OK


def cmd_db_check(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args, require_schema=False)
    problems = check_schema(engine, prefix) + [str(d) for d in schema_drift(engine, prefix)]
    replication = replication_warning(engine)
    if replication is not None:  # a warning: the schema may well be right
        print(f"warning: {replication}")
    for problem in problems:
        print(problem)
    if not problems:
        print("schema matches this version")
    return exitcodes.CHECK_FAILED if problems else exitcodes.OK


def cmd_dedup_purge(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args)
    scope = f" of consumer {args.consumer!r}" if args.consumer else ""
    if args.dry_run:
        count = count_purgeable_claims(engine, prefix, args.older_than, args.consumer)
        print(f"would delete {count} dedup records{scope} older than {args.older_than} (dry run)")
        return exitcodes.OK
    if args.older_than < PURGE_CONFIRM_BELOW and not args.yes:
        _confirm_short_purge(args.older_than, scope)
    progress = Progress(sys.stderr, "dedup purge", unit="deleted", enabled=not args.quiet)
    so_far = 0

    def chunk_done(rows: int) -> None:
        nonlocal so_far
        so_far += rows
        progress.update(so_far)

    deleted = DedupStore(prefix).purge(
        engine,
        args.older_than,
        consumer=args.consumer,
        chunk_size=args.chunk_size,
        on_chunk=chunk_done,
    )
    progress.finish(deleted)
    print(f"deleted {deleted} dedup records{scope} older than {args.older_than}")
    return exitcodes.OK


def _confirm_short_purge(older_than: timedelta, scope: str) -> None:
    """Ask on a terminal, refuse otherwise: a short horizon removes recent claims that
    redeliveries and replays rely on (messages of that window could be applied twice)."""
    risk = (
        f"--older-than {older_than} is below {PURGE_CONFIRM_TEXT}: redeliveries and replays "
        f"of messages newer than {PURGE_CONFIRM_TEXT} rely on these claims{scope}"
    )
    if not sys.stdin.isatty():
        raise RefusedError(f"{risk}; nothing deleted (pass --yes to confirm, --dry-run to count)")
    answer = input(f"{risk}. Delete them? [y/N] ")
    if answer.strip().lower() not in ("y", "yes"):
        raise RefusedError("not confirmed; nothing deleted")


def cmd_dedup_stats(args: argparse.Namespace) -> int:
    stats = dedup_stats(*connected_engine(args))
    if args.json:
        print_json(dedup_stats_data(*stats))
    else:
        print(format_dedup_stats(*stats))
    return exitcodes.OK


@dataclass(frozen=True)
class ConsumerStats:
    """Dedup records of one consumer name."""

    consumer: str
    rows: int
    oldest: datetime | None
    newest: datetime | None


def dedup_stats(engine: Engine, prefix: str) -> tuple[list[ConsumerStats], int | None]:
    """Rows per consumer with oldest/newest claim, and the table size in bytes (PostgreSQL)."""
    # A full read of the table with any index: the retention index (BRIN on PostgreSQL,
    # a btree elsewhere) has no per-consumer order for min/max to use.
    table = schema(prefix).processed
    with engine.connect() as connection:
        rows = connection.execute(
            select(
                table.c.consumer_name,
                func.count(),
                func.min(table.c.processed_at),
                func.max(table.c.processed_at),
            )
            .group_by(table.c.consumer_name)
            .order_by(table.c.consumer_name)
        ).all()
        size = table_size(connection, table.name)
    return [ConsumerStats(r[0], int(r[1]), r[2], r[3]) for r in rows], size


def dedup_stats_data(stats: list[ConsumerStats], size: int | None) -> dict[str, Any]:
    """``dedup stats --json``: stable keys, times in ISO-8601 UTC, ages in seconds."""
    now = utcnow()
    return {
        "consumers": [
            {
                "consumer": s.consumer,
                "records": s.rows,
                "oldest": _iso(s.oldest),
                "newest": _iso(s.newest),
                "oldest_age_seconds": _age(now, s.oldest),
                "newest_age_seconds": _age(now, s.newest),
            }
            for s in stats
        ],
        "records": sum(s.rows for s in stats),
        "size_bytes": size,
    }


def format_dedup_stats(stats: list[ConsumerStats], size: int | None) -> str:
    """The ``dedup stats`` screen."""
    return format_dedup_stats_data(dedup_stats_data(stats, size))


def format_dedup_stats_data(data: dict[str, Any]) -> str:
    """The ``dedup stats`` screen, from :func:`dedup_stats_data`."""
    rows = [
        (
            c["consumer"],
            c["records"],
            human_age(c["oldest_age_seconds"]),
            human_age(c["newest_age_seconds"]),
        )
        for c in data["consumers"]
    ]
    size = data["size_bytes"]
    lines = [render_table(["consumer", "records", "oldest", "newest"], rows)]
    lines.append(
        f"\n{data['records']:,} records"
        + (f", {size / 1_048_576:,.1f} MiB on disk" if size else "")
    )
    return "\n".join(lines)


def count_purgeable_claims(
    engine: Engine, prefix: str, older_than: timedelta, consumer: str | None
) -> int:
    """How many claims ``dedup purge --older-than`` would delete (``--dry-run``)."""
    # On PostgreSQL a Bitmap Heap Scan of the block ranges the BRIN index on processed_at
    # leaves in (schema 3; a btree range scan before), as the purge's chunks read them.
    table = schema(prefix).processed
    query = select(func.count()).where(table.c.processed_at < utcnow() - older_than)
    if consumer is not None:
        query = query.where(table.c.consumer_name == consumer)
    with engine.connect() as connection:
        return int(connection.execute(query).scalar_one())


def cmd_outbox_status(args: argparse.Namespace) -> int:
    if args.json:
        print_json(outbox_status_data(*connected_engine(args)))
    else:
        print(format_outbox_status(*connected_engine(args)))
    return exitcodes.OK


def cmd_outbox_retry(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args)
    count = OutboxStore(prefix).retry_failed(engine, ids=args.ids, destination=args.destination)
    print(f"{count} failed outbox row(s) back to pending")
    return exitcodes.OK


def cmd_outbox_purge(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args)
    if args.dry_run:
        count = count_purgeable_outbox_rows(engine, prefix, args.older_than)
        print(
            f"would delete {count} published outbox row(s) older than {args.older_than} (dry run)"
        )
        return exitcodes.OK
    count = OutboxStore(prefix).purge(engine, args.older_than, chunk_size=args.chunk_size)
    print(f"deleted {count} published outbox row(s) older than {args.older_than}")
    return exitcodes.OK


def count_purgeable_outbox_rows(engine: Engine, prefix: str, older_than: timedelta) -> int:
    """How many published rows ``outbox purge --older-than`` would delete (``--dry-run``)."""

    table = schema(prefix).outbox
    query = select(func.count()).where(
        table.c.state == PUBLISHED, table.c.published_at < utcnow() - older_than
    )
    with engine.connect() as connection:
        return int(connection.execute(query).scalar_one())


def display_destination(broker: str, destination: str) -> str:
    """A destination as shown in tables: RabbitMQ's nameless exchange gets a name."""
    if not destination and broker == "rabbitmq":
        return DEFAULT_EXCHANGE
    return destination or "-"


def outbox_status_data(engine: Engine, prefix: str) -> dict[str, Any]:
    """``outbox status --json``: stable keys (a destination is ``""`` for the default exchange)."""

    status = OutboxStore(prefix).status(engine)
    return {
        "pending": status.pending,
        "failed": status.failed,
        "published": status.published,
        "oldest_pending_age_seconds": status.oldest_pending_age,
        "destinations": [
            {
                "broker": d.broker,
                "destination": d.destination,
                "pending": d.pending,
                "failed": d.failed,
                "published": d.published,
                "oldest_pending_age_seconds": d.oldest_pending_age,
            }
            for d in status.destinations
        ],
    }


def format_outbox_status(engine: Engine, prefix: str) -> str:
    """The ``outbox status`` screen: totals and per destination."""
    return format_outbox_status_data(outbox_status_data(engine, prefix))


def format_outbox_status_data(data: dict[str, Any]) -> str:
    """The ``outbox status`` screen, from :func:`outbox_status_data`."""
    rows = [
        (
            d["broker"],
            display_destination(d["broker"], d["destination"]),
            d["pending"],
            d["failed"],
            d["published"],
            human_age(d["oldest_pending_age_seconds"]),
        )
        for d in data["destinations"]
    ]
    table = render_table(
        ["broker", "destination", "pending", "failed", "published", "oldest pending"], rows
    )
    summary = (
        f"\npending {data['pending']:,}  failed {data['failed']:,}  "
        f"published {data['published']:,}"
        f"  oldest pending {human_age(data['oldest_pending_age_seconds'])}"
    )
    return table + summary


def _age(now: datetime, then: datetime | None) -> float | None:
    if then is None:
        return None
    if then.tzinfo is None:  # SQLite returns naive datetimes (stored as UTC)
        then = then.replace(tzinfo=now.tzinfo)
    return max(0.0, (now - then).total_seconds())


def _iso(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    if moment.tzinfo is None:  # SQLite returns naive datetimes (stored as UTC)
        moment = moment.replace(tzinfo=UTC)
    return moment.isoformat()

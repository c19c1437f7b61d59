"""What ``mqdedup <command> --help`` says above and below the options: a description and
an example for every command and sub-command, kept here (one table, not scattered through
the grammar in :mod:`mqdedup.cli.parser`) and attached by :func:`apply_help`. A command
added to the parser gets its entry here (``tests/unit/test_cli_help.py`` walks them all),
or sets ``description=`` and an ``epilog=`` with an "Example" itself."""

from __future__ import annotations

import argparse
import textwrap
from typing import NamedTuple

#: Columns of the description's lines.
WIDTH = 79


class Help(NamedTuple):
    """A command's description and its examples (shell lines, shown under "Example")."""

    description: str
    examples: tuple[str, ...]


#: The help of each command, by its path of sub-command names (``()``: ``mqdedup`` itself).
HELP: dict[tuple[str, ...], Help] = {
    (): Help(
        "Effectively-once Kafka and RabbitMQ consumers: run them (worker), publish their "
        "outbox (relay), replay past messages, inspect and clean up mqdedup's tables.\n"
        "Settings come from flags, MQDEDUP_* variables, then a TOML file (--config). Exit "
        'codes: docs/operations.md, "The command line".',
        ("mqdedup worker shop.consumers:Orders --processes 2", "mqdedup status --help"),
    ),
    ("demo",): Help(
        "Run the effectively-once demo: duplicated messages, crashes after commit, a check "
        "of every promise at the end (SQLite and an in-memory broker by default).",
        ("mqdedup demo --messages 1000 --duplicates 0.5",),
    ),
    ("db",): Help(
        "Create, migrate or check mqdedup's own tables (claims, outbox, dead letters, leases).",
        ("mqdedup db init --database postgresql://app@db/shop",),
    ),
    ("db", "init"): Help(
        "Create mqdedup's tables where they are missing (idempotent: run it at every deploy).",
        ("mqdedup db init --database postgresql://app@db/shop --table-prefix shop_",),
    ),
    ("db", "upgrade"): Help(
        "Bring the tables of an earlier mqdedup version to this one (missing tables, "
        "indexes, key collations); idempotent.",
        ("mqdedup db upgrade --database postgresql://app@db/shop",),
    ),
    ("db", "check"): Help(
        "Compare the live tables with this version; exit code 1 and one line per problem "
        "when they differ.",
        ("mqdedup db check --database postgresql://app@db/shop",),
    ),
    ("dedup",): Help(
        "The claims table: purge old claims (retention), count them per consumer.",
        ("mqdedup dedup stats", "mqdedup dedup purge --older-than 14d"),
    ),
    ("dedup", "purge"): Help(
        "Delete claims older than --older-than, in chunks of --chunk-size rows, each its "
        "own transaction. A message redelivered or replayed after its claim was purged is "
        "applied again, so keep claims longer than any redelivery or replay window; below "
        "1d it asks on a terminal and is refused elsewhere without --yes. On a terminal a "
        "progress line counts the deleted claims.",
        (
            "mqdedup dedup purge --older-than 14d --dry-run",
            "mqdedup dedup purge --older-than 14d --consumer orders",
        ),
    ),
    ("dedup", "stats"): Help(
        "Claims per consumer name with the oldest and newest, and the table's size.",
        ("mqdedup dedup stats --json",),
    ),
    ("dedup", "show"): Help(
        "A message id's claim: processed at, stored result, failed attempts, steps.",
        ("mqdedup dedup show order-17 --consumer orders",),
    ),
    ("dedup", "forget"): Help(
        "Delete a message id's claim (with its steps and attempt count): the next delivery "
        "or replay runs the handler again. Asks on a terminal; refused elsewhere without --yes.",
        ("mqdedup dedup forget order-17 --consumer orders --yes",),
    ),
    ("console",): Help(
        "A web console: overview, dead letters of all three places (replay, requeue, "
        "delete), claims, failed outbox rows. Binds 127.0.0.1 unless --host says otherwise; "
        "bound elsewhere it needs --token or --basic-auth. --read-only shows no action.",
        (
            "mqdedup console shop.consumers:Orders --database postgresql://app@db/shop",
            'mqdedup console --host 0.0.0.0 --token "$CONSOLE_TOKEN" --read-only',
        ),
    ),
    ("publish",): Help(
        "Send one message stamped with what dedup needs: a message-id (--id, else a new "
        "UUIDv7), its content type and the trace context; print its message id. For "
        "operators and tests; a message no queue takes is an error (exit 3).",
        (
            "mqdedup publish --topic orders --id order-17 --body '{\"id\": 17}'",
            "mqdedup publish --queue orders --file order.json",
        ),
    ),
    ("outbox",): Help(
        "The outbox: what waits to be published, rows the broker refused, retention.",
        ("mqdedup outbox status",),
    ),
    ("outbox", "status"): Help(
        "Pending, failed and published rows per broker and destination, with the age of the "
        "oldest pending row.",
        ("mqdedup outbox status --json",),
    ),
    ("outbox", "retry-failed"): Help(
        "Put rows that failed after their last attempt back to pending: the relay publishes "
        "them again (with the same message ids).",
        (
            "mqdedup outbox retry-failed --destination orders.events",
            "mqdedup outbox retry-failed --id 42",
        ),
    ),
    ("outbox", "purge"): Help(
        "Delete published rows kept by a relay run with --keep-published, older than "
        "--older-than, in chunks.",
        ("mqdedup outbox purge --older-than 7d --dry-run",),
    ),
    ("dead-letters",): Help(
        "Dead letters in all three places: the database (those the broker refused), Kafka "
        "dead-letter topics and RabbitMQ dead-letter queues. List, show, replay through the "
        "consumer's claims, requeue to the source, delete.",
        ("mqdedup dead-letters list --groups", "mqdedup dead-letters list --topic orders.DLT"),
    ),
    ("dead-letters", "list"): Help(
        "Dead letters of one place, oldest first (the database by default; --topic for Kafka, "
        "--queue for RabbitMQ); --groups: one line per consumer and error with its count.",
        (
            "mqdedup dead-letters list --consumer orders --limit 20",
            "mqdedup dead-letters list --queue orders.dlq --groups",
        ),
    ),
    ("dead-letters", "show"): Help(
        "One dead letter: reason, attempts, headers and its body (cut at --body-limit bytes, "
        "and says so).",
        ("mqdedup dead-letters show orders.DLT:0:5 --topic orders.DLT",),
    ),
    ("dead-letters", "replay"): Help(
        "Run the consumer over its dead letters again, after a fix: through its claims, so a "
        "message whose effects already happened is skipped. A dead letter leaves its place "
        "only after its message committed; exit 8 when some were dead-lettered again.",
        (
            "mqdedup dead-letters replay shop.consumers:Orders --id 7",
            "mqdedup dead-letters replay shop.consumers:Orders --place kafka --error ValueError",
        ),
    ),
    ("dead-letters", "requeue"): Help(
        "Send Kafka or RabbitMQ dead letters back to their source topic or queue, message id "
        "kept, for the live consumer (its claims make a message already processed a "
        "duplicate). Database dead letters are replayed instead.",
        ("mqdedup dead-letters requeue --queue orders.dlq --key orders.dlq:order-17",),
    ),
    ("dead-letters", "delete"): Help(
        "Drop dead letters for good: --key / --id, a group (--error) or --all of --consumer.",
        ("mqdedup dead-letters delete --consumer orders --id 7",),
    ),
    ("relay",): Help(
        "Publish committed outbox rows to Kafka / RabbitMQ: a supervisor with --processes "
        "relay processes that share the table, until SIGTERM / SIGINT (exit 0). With "
        "--drain: publish what is due now in this process, then exit (0 when every row was "
        "published; 9 when the broker refused rows or stayed unavailable until "
        "--drain-timeout). It prints one line when it starts (where it publishes from and "
        "to) and one when it stops (rows published, refused, failed) on stderr; --quiet "
        "leaves them out.",
        (
            "mqdedup relay --processes 2 --health-port 9101",
            "mqdedup relay --drain --kafka-bootstrap kafka:9092",
        ),
    ),
    ("replay",): Help(
        "Run a consumer again over a past range of its Kafka topics or RabbitMQ stream, or "
        "move its RabbitMQ dead letters back to its queue (--from-dlq). Already processed "
        "messages are skipped as duplicates; the live consumer group's offsets are not "
        "touched. A range starting before the dedup retention horizon is refused (exit 1) "
        "unless --allow-reprocess. On a terminal a progress line counts the messages read. "
        "Exit code 8 when messages were dead-lettered (the summary says how many).",
        (
            "mqdedup replay shop.consumers:Orders --from 2026-12-01T00:00 --to 2026-12-02T00:00",
            "mqdedup replay shop.consumers:Orders --partition 3 --from 1200 --to 1500 --dry-run",
        ),
    ),
    ("status",): Help(
        "One screen: the given consumers' lag, the claims table, the outbox backlog and the "
        "dead letters. A broker that cannot be reached is named in the lag column; the rest "
        "still prints and the exit code is 6.",
        ("mqdedup status shop.consumers:Orders shop.consumers:Payments", "mqdedup status --json"),
    ),
    ("worker",): Help(
        "Run consumers in supervised worker processes (--processes per consumer) until "
        "SIGTERM / SIGINT: each finishes, commits and settles its batch in flight, then the "
        "command exits 0. A child that dies is restarted with backoff. It prints one line "
        "when it starts (the consumers, their topics or queues, the database and brokers) "
        "and one when it stops (messages processed, duplicates, dead-lettered) on stderr; "
        "--quiet leaves them out.",
        (
            "mqdedup worker shop.consumers:Orders --processes 2 --health-port 9100",
            "MQDEDUP_DATABASE_URL=postgresql://app@db/shop mqdedup worker shop.consumers:Orders",
        ),
    ),
}


def apply_help(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> None:
    """Give ``parser`` and every sub-command below it their :data:`HELP` entry."""
    entry = HELP.get(path)
    if entry is not None:
        # RawDescriptionHelpFormatter keeps the examples' lines as they are: the
        # description is wrapped here, one paragraph per line of the entry.
        parser.description = "\n".join(
            textwrap.fill(paragraph, WIDTH) for paragraph in entry.description.split("\n")
        )
        parser.epilog = "Example:\n" + "\n".join(f"  {line}" for line in entry.examples)
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                apply_help(sub, (*path, name))

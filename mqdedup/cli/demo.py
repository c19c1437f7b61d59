"""``mqdedup demo``: the whole idea in one command, on SQLite and the in-memory broker: an
order stream with injected duplicates (producer retries) and a few malformed messages
runs through a consumer that writes orders, while worker "crashes" strike between commit
and settle, so the broker redelivers batches that were already committed; at the end the
database is checked: every unique order exactly once, nothing lost."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from sqlalchemy import (
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    func,
    insert,
    inspect,
    select,
)

from mqdedup.cli import exitcodes
from mqdedup.cli.exitcodes import RefusedError, UsageError
from mqdedup.consumers.base import Consumer
from mqdedup.consumers.context import Context
from mqdedup.consumers.memory import InMemoryBroker, MemoryTransport
from mqdedup.consumers.worker import Worker
from mqdedup.db.engine import check_connection, create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.errors import SimulatedCrash
from mqdedup.masking import mask_text
from mqdedup.message import Message

QUEUE = "orders"
_metadata = MetaData()
demo_orders = Table(
    "demo_orders",
    _metadata,
    Column("row_id", Integer, primary_key=True, autoincrement=True),
    Column("order_id", String(64), nullable=False),
    Column("message_id", String(255), nullable=False),
    Column("amount", Integer, nullable=False),
)


class DemoOrderConsumer(Consumer):
    """Writes one row per order; 'crashes' after some commits, before the ack."""

    name = "demo-orders"
    batch_size = 50
    poll_timeout = 0.01

    def __init__(
        self,
        crash_rate: float,
        rng: random.Random,
        on_batch: Callable[[], None] | None = None,
    ) -> None:
        self.crash_rate = crash_rate
        self.rng = rng
        self.crashes = 0
        self.on_batch = on_batch

    def handle(self, message: Message, ctx: Context) -> Any:
        order = message.json()
        ctx.session.execute(
            insert(demo_orders).values(
                order_id=str(order["order_id"]), message_id=message.id, amount=int(order["amount"])
            )
        )
        return {"order_id": order["order_id"], "status": "stored"}

    def after_commit(self, messages: Sequence[Message]) -> None:
        if self.on_batch is not None:
            self.on_batch()
        if self.rng.random() < self.crash_rate:
            self.crashes += 1
            raise SimulatedCrash("worker died after commit, before the ack")


def cmd_demo(args: argparse.Namespace) -> int:
    if args.messages < 1:
        raise UsageError("--messages must be at least 1")
    if not 0 <= args.duplicates <= 1 or not 0 <= args.crash_rate < 1:
        raise UsageError("--duplicates must be in [0, 1] and --crash-rate in [0, 1)")
    if args.database:
        engine = create_engine(args.database)
        check_connection(engine)
        rows = existing_demo_rows(engine)
        engine.dispose()
        if rows and not args.force:
            raise RefusedError(
                f"demo_orders in {mask_text(args.database)} holds {rows:,} row(s): the demo "
                "drops and recreates it; pass --force to go on, or use another database"
            )
    if args.log_level.upper() == "WARNING":  # dead letters are listed in the summary instead
        logging.getLogger("mqdedup").setLevel(logging.ERROR)
    result = run_demo(
        messages=args.messages,
        duplicate_rate=args.duplicates,
        database_url=args.database,
        crash_rate=args.crash_rate,
        seed=args.seed,
        progress=sys.stderr,
    )
    print(format_summary(result))
    return exitcodes.OK if result.exactly_once and result.nothing_lost else exitcodes.CHECK_FAILED


@dataclass
class DemoResult:
    """What the demo saw and checked.

    Two counts, two words: a *message* is one record put on the queue (the orders, the
    producers' resends, the malformed ones): ``sent`` of them, each settled once; a
    *delivery* is one hand-off of a message to a worker: ``delivered``, which is ``sent``
    plus the redeliveries of messages whose batch committed but was not acked.
    """

    sent: int
    delivered: int
    unique: int
    processed: int
    duplicates: int
    crashes: int
    dead_lettered: int
    expected_dead_letters: int
    rows_per_order: dict[str, int]
    dead_letter_reasons: list[str]
    left_on_broker: int
    seconds: float

    @property
    def exactly_once(self) -> bool:
        """Every unique valid order has exactly one row."""
        return len(self.rows_per_order) == self.unique and all(
            count == 1 for count in self.rows_per_order.values()
        )

    @property
    def nothing_lost(self) -> bool:
        """Every message ended processed, skipped as a duplicate or dead-lettered."""
        return (
            self.left_on_broker == 0
            and self.dead_lettered == self.expected_dead_letters
            and self.processed == self.unique
        )


def run_demo(
    messages: int = 5000,
    duplicate_rate: float = 0.3,
    database_url: str | None = None,
    crash_rate: float = 0.05,
    seed: int = 7,
    progress: TextIO | None = None,
) -> DemoResult:
    """Run the demo and return its figures (the CLI prints them)."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mqdedup-demo-") as folder:
        url = database_url or f"sqlite:///{Path(folder) / 'demo.db'}"
        engine = create_engine(url)
        try:
            return _run(engine, messages, duplicate_rate, crash_rate, seed, progress, started)
        finally:
            engine.dispose()


def _run(
    engine: Engine,
    messages: int,
    duplicate_rate: float,
    crash_rate: float,
    seed: int,
    progress: TextIO | None,
    started: float,
) -> DemoResult:
    _metadata.drop_all(engine)
    init_schema(engine)
    _metadata.create_all(engine)
    with engine.begin() as connection:  # a rerun on the same database starts clean
        connection.execute(
            schema().processed.delete().where(schema().processed.c.consumer_name == "demo-orders")
        )
    rng = random.Random(seed)
    broker = InMemoryBroker(seed=seed)
    for number in range(messages):
        body = json.dumps({"order_id": number, "amount": rng.randint(1, 500)})
        broker.publish(QUEUE, body, message_id=f"order-{number}")
    broker.inject_duplicates(QUEUE, duplicate_rate)
    # A few bad messages: they must end on the dead-letter list with a clear reason.
    broker.publish(QUEUE, b"{not json", message_id="malformed-1")
    broker.publish(QUEUE, b'{"order_id": "x"}')  # no message id at all
    expected_dead = 2
    sent = broker.pending(QUEUE)

    bar = _ProgressBar(sent, progress)
    # Moves once per committed batch (the count settled so far, this batch not yet acked).
    consumer = DemoOrderConsumer(
        crash_rate, rng, on_batch=lambda: bar.update(broker.settled_count.get(QUEUE, 0))
    )
    delivered = processed = duplicates = 0
    while broker.pending(QUEUE):
        transport: MemoryTransport = broker.transport(QUEUE)
        worker = Worker(consumer, transport, engine)
        # On a crash the transport is closed: its unsettled deliveries go back to the queue.
        with contextlib.suppress(SimulatedCrash):
            worker.run(until_idle=True)
        delivered += worker.metrics.delivered
        processed += worker.metrics.processed
        duplicates += worker.metrics.duplicates
        bar.update(broker.settled_count.get(QUEUE, 0))
    bar.done()

    with engine.connect() as connection:
        rows = connection.execute(
            select(demo_orders.c.order_id, func.count()).group_by(demo_orders.c.order_id)
        ).all()
    return DemoResult(
        sent=sent,
        delivered=delivered,
        unique=messages,
        processed=processed,
        duplicates=duplicates,
        crashes=consumer.crashes,
        dead_lettered=len(broker.dead_letters.get(QUEUE, [])),
        expected_dead_letters=expected_dead,
        rows_per_order={str(row[0]): int(row[1]) for row in rows},
        dead_letter_reasons=[d.record.reason for d in broker.dead_letters.get(QUEUE, [])],
        left_on_broker=broker.pending(QUEUE),
        seconds=time.monotonic() - started,
    )


def existing_demo_rows(engine: Engine) -> int:
    """Rows in ``demo_orders`` of that database (0 if the table does not exist)."""
    if not inspect(engine).has_table(demo_orders.name):
        return 0
    with engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(demo_orders)).scalar_one())


class _ProgressBar:
    """A bar redrawn per batch on a terminal; elsewhere a plain line every quarter.

    It counts messages settled out of the messages sent (the summary's first line), not
    deliveries: a redelivered message is settled once.
    """

    #: Without a terminal, one line each time this share of the messages is settled.
    LINE_STEP = 25

    def __init__(self, total: int, stream: TextIO | None) -> None:
        self.total = max(total, 1)
        self.stream = stream
        self.tty = stream is not None and stream.isatty()
        self._last = -1
        self._last_line = 0

    def update(self, done: int) -> None:
        if self.stream is None:
            return
        percent = min(100, done * 100 // self.total)
        if percent == self._last:
            return
        self._last = percent
        if self.tty:
            filled = percent * 30 // 100
            self.stream.write(
                f"\r[{'#' * filled}{'.' * (30 - filled)}] {percent:3d}%  {done}/{self.total}"
            )
        elif percent >= self._last_line + self.LINE_STEP:
            self._last_line = percent - percent % self.LINE_STEP
            self.stream.write(f"demo: {done}/{self.total} messages settled ({percent}%)\n")
        else:
            return
        self.stream.flush()

    def done(self) -> None:
        if self.stream is None:
            return
        if self.tty:
            self.stream.write("\n")
        elif self._last_line < 100:
            self.stream.write(f"demo: {self.total}/{self.total} messages settled (100%)\n")
        self.stream.flush()


def format_summary(result: DemoResult) -> str:
    """The summary table the CLI prints."""

    def mark(ok: bool) -> str:
        return "✓" if ok else "✗"

    lines = [
        "mqdedup demo: orders through the in-memory broker into the database",
        "",
        f"  {'messages sent (incl. resends)':<34}{result.sent:>10}",
        f"  {'deliveries (sent + redelivered)':<34}{result.delivered:>10}",
        f"  {'unique orders':<34}{result.unique:>10}",
        f"  {'processed (handler committed)':<34}{result.processed:>10}",
        f"  {'duplicates skipped':<34}{result.duplicates:>10}",
        f"  {'crashes survived (commit, no ack)':<34}{result.crashes:>10}",
        f"  {'dead-lettered (malformed / no id)':<34}{result.dead_lettered:>10}",
        f"  {'seconds':<34}{result.seconds:>10.1f}",
        "",
        *(f"  dead letter: {reason}" for reason in result.dead_letter_reasons),
        "",
        f"  {mark(result.exactly_once)} every unique order written exactly once",
        f"  {mark(result.nothing_lost)} nothing lost "
        "(each message processed, skipped as duplicate, or dead-lettered)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    outcome = run_demo(progress=sys.stderr)
    print(format_summary(outcome))

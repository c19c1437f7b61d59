"""Handler styles side by side: in-memory broker -> PostgreSQL, batch 500 (issue #11).

Every variant takes the same small JSON messages (``{"order": ..., "amount": ...}``
with a message id), claims each id once and writes one business row per message, all
on one PostgreSQL connection:

* raw psycopg, claim + one INSERT per message in one transaction per batch, and the
  same fully set-based (``unnest`` claim + ``unnest`` business insert): the ceilings;
* mqdedup, batch of 500: bulk ``handle_batch`` (one ``unnest`` insert), and a
  per-message ``handle`` written three ways: ``ctx.session.execute(insert(t), row)``
  (each statement executed when called), driver SQL through
  ``ctx.session.connection().exec_driver_sql``, and
  ``ctx.stage(t, row)`` (written set-based at the batch end);
* one transaction per message: mqdedup ``failure_isolation = "transaction"`` with the
  ``insert(t)`` handler and with driver SQL, and the hand-written consumer (``SELECT``
  the id, ``INSERT`` id and row, commit; raw psycopg, ``HandWritten`` of
  ``bench/suite_consumers.py``).

The mqdedup variants read from the in-memory broker through the real Worker and
Processor (fetch, claim, handle, commit, settle); the raw loops read a list. Runs are
interleaved, medians reported. Run alone::

    python -m bench --only handlers          # or: python -m bench.suite_handlers

``python -m bench.suite_handlers --count`` prints, instead of rates, what each variant
sends to PostgreSQL per message, read from libpq's protocol trace (psycopg's public
``PGconn.trace``): statements by kind (``BEGIN``, ``COMMIT``, the others) and round
trips (server answers ``ReadyForQuery``), so statements the framework runs on the driver
connection count as well as those through SQLAlchemy. ``--cpu`` prints the client CPU
per message of the per-message variants (``time.process_time``), which other processes'
load on the machine disturbs less than the rates.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

import psycopg
from psycopg import pq
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, event, insert

from bench.suite_common import QUICK, Row, Section, Settings, Sizes, interleave, progress
from bench.suite_consumers import HandWritten, psycopg_dsn
from mqdedup import Consumer, InMemoryBroker, create_engine, init_schema
from mqdedup.consumers.context import BatchContext, Context
from mqdedup.consumers.worker import Worker
from mqdedup.db.schema import schema
from mqdedup.message import Message

BATCH = 500
RAW_TX = "raw psycopg: claim + INSERT per message, 1 tx per batch"
RAW_SET = "raw psycopg: claim + business set-based (unnest)"
BULK = "mqdedup bulk handle_batch (unnest)"
PLAIN = "mqdedup handle: ctx.session.execute(insert(t), row)"
DRIVER = "mqdedup handle: driver SQL (exec_driver_sql)"
STAGED = "mqdedup handle: ctx.stage(t, row)"
TX_ORM = "mqdedup 1 tx/msg: ctx.session.execute(insert(t), row)"
TX_SQL = "mqdedup 1 tx/msg: driver SQL"
HAND = "hand-written SELECT then INSERT, 1 tx/msg"
ORDER = (RAW_TX, RAW_SET, BULK, PLAIN, DRIVER, STAGED, TX_ORM, TX_SQL, HAND)
#: One transaction per message: these read the smaller count.
PER_MESSAGE = (TX_ORM, TX_SQL, HAND)


class Tables:
    """The framework's tables and the business table under one fresh prefix."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.prefix = f"bench_h_{uuid.uuid4().hex[:8]}_"
        init_schema(engine, self.prefix)
        self.metadata = MetaData()
        self.orders = Table(
            f"{self.prefix}orders",
            self.metadata,
            Column("row_id", Integer, primary_key=True, autoincrement=True),
            Column("message_id", String(255), nullable=False),
            Column("order_id", String(64)),
            Column("amount", Integer),
        )
        self.metadata.create_all(engine)
        self.claims = f"{self.prefix}processed_messages"
        self.insert_sql = (
            f"INSERT INTO {self.orders.name} (message_id, order_id, amount) "
            "VALUES (%(message_id)s, %(order_id)s, %(amount)s)"
        )
        self.unnest_sql = (
            f"INSERT INTO {self.orders.name} (message_id, order_id, amount) "
            "SELECT * FROM unnest(%(ids)s::text[], %(orders)s::text[], %(amounts)s::int[])"
        )

    def reset(self) -> None:
        with self.engine.begin() as connection:
            connection.exec_driver_sql(f"TRUNCATE {self.orders.name}, {self.claims}")

    def rows(self) -> int:
        with self.engine.connect() as connection:
            return int(
                connection.exec_driver_sql(f"SELECT count(*) FROM {self.orders.name}").scalar_one()
            )

    def drop(self) -> None:
        self.metadata.drop_all(self.engine)
        schema(self.prefix).metadata.drop_all(self.engine)


def messages(count: int) -> list[tuple[str, bytes]]:
    return [
        (uuid.uuid4().hex, json.dumps({"order": f"o-{n}", "amount": n}).encode())
        for n in range(count)
    ]


# -- the mqdedup consumers -----------------------------------------------------------------


class _Bench(Consumer):
    name = "bench-handlers"
    batch_size = BATCH
    poll_timeout = 0.01
    metrics_interval = 3600.0
    tables: ClassVar[Tables]

    def row(self, message: Message) -> dict[str, Any]:
        payload = message.json()
        return {"message_id": message.id, "order_id": payload["order"], "amount": payload["amount"]}


class Plain(_Bench):
    def handle(self, message: Message, ctx: Context) -> Any:
        ctx.session.execute(insert(self.tables.orders), self.row(message))


class DriverSQL(_Bench):
    def handle(self, message: Message, ctx: Context) -> Any:
        ctx.session.connection().exec_driver_sql(self.tables.insert_sql, self.row(message))


class Staged(_Bench):
    def handle(self, message: Message, ctx: Context) -> Any:
        ctx.stage(self.tables.orders, self.row(message))


class Bulk(_Bench):
    def handle_batch(self, messages: Sequence[Message], ctx: BatchContext) -> Mapping[str, Any]:
        rows = [self.row(message) for message in messages]
        ctx.session.connection().exec_driver_sql(
            self.tables.unnest_sql,
            {
                "ids": [r["message_id"] for r in rows],
                "orders": [r["order_id"] for r in rows],
                "amounts": [r["amount"] for r in rows],
            },
        )
        return {}


def run_mqdedup(
    base: type[_Bench], tables: Tables, batch: list[tuple[str, bytes]], **attributes: Any
) -> float:
    tables.reset()
    broker = InMemoryBroker()
    for message_id, body in batch:
        broker.publish("q", body, message_id=message_id)
    consumer = type(
        base.__name__, (base,), {"tables": tables, "table_prefix": tables.prefix, **attributes}
    )()
    worker = Worker(consumer, broker.transport("q"), tables.engine)
    started = time.perf_counter()
    worker.run(until_idle=True)
    elapsed = time.perf_counter() - started
    if tables.rows() != len(batch):
        raise RuntimeError(f"{base.__name__} wrote {tables.rows()} rows, not {len(batch)}")
    return len(batch) / elapsed


# -- raw psycopg ---------------------------------------------------------------------------


def _claim_sql(tables: Tables) -> str:
    return (
        f"INSERT INTO {tables.claims} (consumer_name, message_id, processed_at) "
        "SELECT 'raw', i, now() FROM unnest(%s::text[]) AS i ORDER BY i "
        "ON CONFLICT (consumer_name, message_id) DO NOTHING RETURNING message_id"
    )


def run_raw(tables: Tables, dsn: str, batch: list[tuple[str, bytes]], set_based: bool) -> float:
    """Claim a batch's ids, write the new ones' rows (per message or with unnest), commit."""
    tables.reset()
    claim = _claim_sql(tables)
    with psycopg.connect(dsn) as connection:
        started = time.perf_counter()
        for start in range(0, len(batch), BATCH):
            chunk = batch[start : start + BATCH]
            with connection.transaction(), connection.cursor() as cursor:
                cursor.execute(claim, ([message_id for message_id, _ in chunk],))
                new = {row[0] for row in cursor.fetchall()}
                rows = []
                for message_id, body in chunk:
                    if message_id in new:
                        payload = json.loads(body)
                        rows.append((message_id, payload["order"], payload["amount"]))
                if set_based:
                    cursor.execute(
                        tables.unnest_sql,
                        {
                            "ids": [r[0] for r in rows],
                            "orders": [r[1] for r in rows],
                            "amounts": [r[2] for r in rows],
                        },
                    )
                else:
                    for message_id, order, amount in rows:
                        cursor.execute(
                            tables.insert_sql,
                            {"message_id": message_id, "order_id": order, "amount": amount},
                        )
        elapsed = time.perf_counter() - started
    if tables.rows() != len(batch):
        raise RuntimeError(f"raw psycopg wrote {tables.rows()} rows, not {len(batch)}")
    return len(batch) / elapsed


def run_hand(hand: HandWritten, batch: list[tuple[str, bytes]]) -> float:
    hand.reset()
    started = time.perf_counter()
    for message_id, body in batch:
        payload = json.loads(body)
        hand.process(message_id, payload["order"], payload["amount"])
    elapsed = time.perf_counter() - started
    if hand.rows() != len(batch):
        raise RuntimeError(f"hand-written wrote {hand.rows()} rows, not {len(batch)}")
    return len(batch) / elapsed


# -- the section ---------------------------------------------------------------------------


def handlers_suite(
    settings: Settings, sizes: Sizes, only: Collection[str] | None = None
) -> Section:
    """The handler styles, in-memory broker -> PostgreSQL, side by side."""
    n = max(BATCH, sizes.consumer_messages // 3)
    slow = sizes.consumer_slow_messages
    section = Section(
        "handlers",
        "Handler styles: in-memory broker → PostgreSQL, batch 500",
        f"{n:,} small JSON messages per run (one transaction per message: the first "
        f"{slow:,}); claim + one business row per message on one PostgreSQL connection. "
        "mqdedup reads from the in-memory broker through the real Worker and Processor; "
        "the raw psycopg loops read a list. `ctx.stage` rows are written set-based "
        "once per batch; transaction mode commits every message on its own.",
    )
    engine = create_engine(settings.database_url)
    dsn = psycopg_dsn(settings.database_url)
    tables = Tables(engine)
    hand = HandWritten(dsn)
    batch, first = messages(n), messages(slow)
    variants: dict[str, Callable[[], float]] = {
        RAW_TX: lambda: run_raw(tables, dsn, batch, set_based=False),
        RAW_SET: lambda: run_raw(tables, dsn, batch, set_based=True),
        BULK: lambda: run_mqdedup(Bulk, tables, batch),
        PLAIN: lambda: run_mqdedup(Plain, tables, batch),
        DRIVER: lambda: run_mqdedup(DriverSQL, tables, batch),
        STAGED: lambda: run_mqdedup(Staged, tables, batch),
        TX_ORM: lambda: run_mqdedup(Plain, tables, first, failure_isolation="transaction"),
        TX_SQL: lambda: run_mqdedup(DriverSQL, tables, first, failure_isolation="transaction"),
        HAND: lambda: run_hand(hand, first),
    }
    chosen = {name: run for name, run in variants.items() if only is None or name in only}
    try:
        values = interleave(sizes.runs, chosen, "handlers")
        for name in ORDER:
            if name in values:
                section.rows.append(Row(name, values[name], "msgs/s"))
        section.extra["goals"] = "; ".join(ratios(section))
    finally:
        hand.close()
        tables.drop()
        engine.dispose()
    return section


#: The issue's goals: (row, reference row, label).
GOALS = (
    (STAGED, BULK, "staged / bulk handle_batch (goal ≥ 60%)"),
    (TX_ORM, HAND, "transaction mode, insert(t) / hand-written (goal ≥ 70%)"),
    (TX_SQL, HAND, "transaction mode, driver SQL / hand-written (goal ≥ 70%)"),
    (PLAIN, RAW_TX, "plain handle / raw psycopg per-message INSERTs (goal ≥ 40%)"),
)


def ratios(section: Section) -> list[str]:
    """The issue's goals as ratios of this run's medians."""
    medians = {row.variant: row.median for row in section.rows}
    return [
        f"{label}: {medians[a] / medians[b]:.0%}"
        for a, b, label in GOALS
        if a in medians and b in medians
    ]


# -- statements per message ----------------------------------------------------------------

_TRACED = re.compile(r"^(?P<side>[FB])\t\d+\t(?P<kind>\w+)(?:\t \"(?P<text>[^\"]*))?", re.M)


def _trace(connection: psycopg.Connection[Any], path: str) -> Any:
    """Start libpq's protocol trace of ``connection`` into ``path`` (the open file)."""
    trace = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by _count)
    connection.pgconn.trace(trace.fileno())
    connection.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
    return trace


def _count(path: str, messages: int) -> dict[str, float]:
    """Statements by kind and round trips per message, from a protocol trace."""
    counts: dict[str, int] = {"BEGIN": 0, "COMMIT": 0, "other statements": 0, "round trips": 0}
    with open(path, encoding="utf-8") as trace:
        for match in _TRACED.finditer(trace.read()):
            side, kind, text = match["side"], match["kind"], (match["text"] or "").upper()
            if side == "B" and kind == "ReadyForQuery":
                counts["round trips"] += 1
            elif side == "F" and kind == "Query" and text in ("BEGIN", "COMMIT"):
                counts[text] += 1
            elif side == "F" and kind in ("Query", "Execute"):
                counts["other statements"] += 1
    return {name: count / messages for name, count in counts.items()}


def count_statements(database_url: str, count: int = 1_000) -> dict[str, dict[str, float]]:
    """What each per-message variant sends to PostgreSQL per message (``count`` new
    messages after a warm-up), read from libpq's protocol trace."""
    engine = create_engine(database_url)
    scratch = tempfile.mkdtemp(prefix="mqdedup-trace-")
    files: list[Any] = []
    path = os.path.join(scratch, "mqdedup.trace")

    @event.listens_for(engine, "connect")
    def traced(dbapi_connection: Any, _record: Any) -> None:
        if tracing:
            files.append(_trace(dbapi_connection, path))

    tracing = False
    tables = Tables(engine)
    hand = HandWritten(psycopg_dsn(database_url))
    found: dict[str, dict[str, float]] = {}
    runs: dict[str, Callable[[list[tuple[str, bytes]]], object]] = {
        PLAIN: lambda batch: run_mqdedup(Plain, tables, batch),
        DRIVER: lambda batch: run_mqdedup(DriverSQL, tables, batch),
        TX_ORM: lambda batch: run_mqdedup(Plain, tables, batch, failure_isolation="transaction"),
        TX_SQL: lambda batch: run_mqdedup(
            DriverSQL, tables, batch, failure_isolation="transaction"
        ),
    }
    try:
        for name, run in runs.items():
            engine.dispose()  # the next connection is a new, traced one
            open(path, "w").close()
            tracing = True
            run(messages(count))
            tracing = False
            found[name] = _count(path, count)
        open(path, "w").close()
        files.append(_trace(hand.connection, path))
        run_hand(hand, messages(count))
        found[HAND] = _count(path, count)
    finally:
        for file in files:
            file.close()
        hand.close()
        tables.drop()
        engine.dispose()
    return found


def client_cpu(database_url: str, count: int = 2_000, runs: int = 3) -> dict[str, float]:
    """Client CPU (``time.process_time``: the worker and the in-memory broker run in this
    process) per message of each per-message variant, median of ``runs``, in µs: less
    sensitive than a rate to other processes' load on the machine."""
    engine = create_engine(database_url)
    tables = Tables(engine)
    hand = HandWritten(psycopg_dsn(database_url))
    variants: dict[str, Callable[[list[tuple[str, bytes]]], object]] = {
        PLAIN: lambda batch: run_mqdedup(Plain, tables, batch),
        DRIVER: lambda batch: run_mqdedup(DriverSQL, tables, batch),
        TX_ORM: lambda batch: run_mqdedup(Plain, tables, batch, failure_isolation="transaction"),
        TX_SQL: lambda batch: run_mqdedup(
            DriverSQL, tables, batch, failure_isolation="transaction"
        ),
        HAND: lambda batch: run_hand(hand, batch),
    }
    spent: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for warm_up in variants.values():
            warm_up(messages(BATCH))
        for _ in range(runs):  # interleaved, as the rates
            for name, run in variants.items():
                batch = messages(count)
                started = time.process_time()
                run(batch)
                spent[name].append((time.process_time() - started) / count * 1e6)
    finally:
        hand.close()
        tables.drop()
        engine.dispose()
    return {name: sorted(values)[len(values) // 2] for name, values in spent.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """Print this section alone (``--quick`` sizes unless ``--runs`` / ``--messages``)."""
    import argparse
    import dataclasses
    import logging

    parser = argparse.ArgumentParser(description="mqdedup handler styles side by side")
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--slow-messages", type=int, default=2_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--count", action="store_true", help="statements and round trips per message instead"
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="client CPU µs per message instead (per-message variants)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.cpu:
        print("| variant | client CPU per message (µs, median) |\n|---|---:|")
        for name, micros in client_cpu(Settings.from_env().database_url, runs=args.runs).items():
            print(f"| {name} | {micros:,.0f} |")
        return 0
    if args.count:
        counted = count_statements(Settings.from_env().database_url)
        kinds = list(next(iter(counted.values())))
        print(f"| variant | {' | '.join(kinds)} |\n|---|{'---:|' * len(kinds)}")
        for name, counts in counted.items():
            print(f"| {name} | {' | '.join(f'{counts[k]:.2f}' for k in kinds)} |")
        return 0
    sizes = dataclasses.replace(
        QUICK,
        runs=args.runs,
        consumer_messages=3 * args.messages,
        consumer_slow_messages=args.slow_messages,
    )
    section = handlers_suite(Settings.from_env(), sizes)
    progress("done")
    print("| variant | msgs/s (median) | runs |\n|---|---:|---|")
    for row in section.rows:
        runs = ", ".join(f"{value:,.0f}" for value in row.values)
        print(f"| {row.variant} | {row.median:,.0f} | {runs} |")
    print(section.extra["goals"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Dedup against no dedup at all, Kafka -> PostgreSQL, side by side in one run (issue 44).

The same handler (one business row per message) runs in three ways, each as a bulk
``handle_batch`` (one ``unnest`` INSERT per batch) and as a per-message ``handle`` (one
``session.execute(insert(t), row)`` per message):

* **no dedup** (the reference, at-least-once): a plain kafka-python loop: ``poll`` up to
  ``--batch-size`` records, run the handler over them in one transaction (a SQLAlchemy
  ``Session`` on the same engine: the very handler code the mqdedup variants run),
  commit, then commit the offsets;
* **offsets in the database**: mqdedup's ``KafkaConsumer`` with
  ``offsets_in_database = True`` and coordinate identity (``from_coordinates``): no
  claims, one offset row per partition written in the batch's transaction;
* **claims**: mqdedup's ``KafkaConsumer`` as it ships: a claim per message on the
  ``message-id`` header.

``--with-psycopg`` adds the same SQL sent by raw psycopg in the no-dedup loop (for
reference: what SQLAlchemy itself costs). Each round produces ``--messages`` messages
(small JSON bodies, a UUIDv7 ``message-id`` header as the producer helper stamps) into a
fresh topic of ``--partitions`` partitions; every variant reads it from the beginning
with its own consumer group into fresh tables (a fresh prefix), batches of
``--batch-size``. The clock runs from the first record handed to the handler to the last
one committed (the group join is not measured). Runs are interleaved (round 1 of every
variant, then round 2, ...); medians are reported; every run checks that the business
table holds exactly ``--messages`` rows. After the last round the framework's tables
of each mqdedup variant are listed (rows, ``pg_total_relation_size``).

Usage::

    eval "$(bash scripts/services.sh env)"
    .venv/bin/python bench/kafka_offsets_bench.py --messages 30000 --runs 3

Needs ``MQDEDUP_KAFKA_BOOTSTRAP`` and ``MQDEDUP_TEST_DATABASE_URL`` (or the flags).
Prints a Markdown table: msgs/s per variant and its ratio to no dedup with the same
handler style, and the issue's goal (offsets in the database >= 0.9 of no dedup).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kafka
import psycopg
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, insert, text
from sqlalchemy.orm import Session

import mqdedup
from mqdedup import StopToken, create_engine, init_schema
from mqdedup.consumers.context import BatchContext, Context
from mqdedup.db.schema import schema
from mqdedup.id_generators import new_message_id
from mqdedup.ids import from_coordinates
from mqdedup.kafka import KafkaConsumer
from mqdedup.message import Message

BULK_SQL = (
    "INSERT INTO {table} (message_id, order_id, amount) "
    "SELECT * FROM unnest(CAST(:ids AS text[]), CAST(:orders AS text[]), "
    "CAST(:amounts AS integer[]))"
)
PSYCOPG_BULK_SQL = (
    "INSERT INTO {table} (message_id, order_id, amount) "
    "SELECT * FROM unnest(%s::text[], %s::text[], %s::integer[])"
)
PSYCOPG_ONE_SQL = "INSERT INTO {table} (message_id, order_id, amount) VALUES (%s, %s, %s)"
TIMEOUT = 600.0


# -- the handler, shared by every variant -------------------------------------------------


def business_table(prefix: str) -> Table:
    return Table(
        f"{prefix}orders",
        MetaData(),
        Column("row_id", Integer, primary_key=True, autoincrement=True),
        Column("message_id", String(255), nullable=False),
        Column("order_id", String(64)),
        Column("amount", Integer),
    )


def handle_one(session: Session, table: Table, message_id: str, body: bytes) -> None:
    """The per-message handler: one INSERT through the session, executed when called."""
    payload = json.loads(body)
    session.execute(
        insert(table),
        {"message_id": message_id, "order_id": payload["order"], "amount": payload["amount"]},
    )


def handle_many(session: Session, table: Table, items: Sequence[tuple[str, bytes]]) -> None:
    """The bulk handler: one set-based INSERT (``unnest``) for the whole batch."""
    ids, orders, amounts = [], [], []
    for message_id, body in items:
        payload = json.loads(body)
        ids.append(message_id)
        orders.append(payload["order"])
        amounts.append(payload["amount"])
    session.execute(
        text(BULK_SQL.format(table=table.name)), {"ids": ids, "orders": orders, "amounts": amounts}
    )


# -- mqdedup variants -----------------------------------------------------------------------


class _Clock:
    """First record handed to the handler -> the ``target``-th message committed."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.count = 0
        self.first: float | None = None
        self.last: float | None = None
        self.done = threading.Event()

    def start(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def committed(self, count: int) -> None:
        self.count += count
        if self.count >= self.target and not self.done.is_set():
            self.last = time.perf_counter()
            self.done.set()

    @property
    def rate(self) -> float:
        assert self.first is not None and self.last is not None
        return self.count / (self.last - self.first)


class PerMessage(KafkaConsumer):
    poll_timeout = 0.5
    metrics_interval = 3600.0
    table: ClassVar[Table]
    clock: ClassVar[_Clock]

    def handle(self, message: Message, ctx: Context) -> Any:
        self.clock.start()
        handle_one(ctx.session, self.table, message.id or "", message.body)

    def after_commit(self, messages: Sequence[Message]) -> None:
        self.clock.committed(len(messages))


class Bulk(PerMessage):
    def handle_batch(self, messages: Sequence[Message], ctx: BatchContext) -> Mapping[str, Any]:
        self.clock.start()
        handle_many(ctx.session, self.table, [(m.id or "", m.body) for m in messages])
        return {}


def offsets_supported() -> bool:
    """Whether this tree's ``KafkaConsumer`` has the ``offsets_in_database`` option."""
    return hasattr(KafkaConsumer, "offsets_in_database")


OFFSETS_ATTRIBUTES: dict[str, Any] = {
    "offsets_in_database": True,
    "message_id_strategy": staticmethod(from_coordinates),
}


# -- one run -------------------------------------------------------------------------------


@dataclass
class Run:
    """One variant's run: its rate and, for mqdedup, the framework tables it left."""

    rate: float
    state: list[tuple[str, int, int]]


def framework_state(engine: Engine, prefix: str) -> list[tuple[str, int, int]]:
    """(table, rows, pg_total_relation_size) of every framework table of ``prefix``."""
    with engine.connect() as connection:
        names = connection.execute(
            text(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
                "AND tablename LIKE :pattern ORDER BY tablename"
            ),
            {"pattern": prefix.replace("_", r"\_") + "%"},
        ).scalars()
        rows = []
        for name in list(names):
            if name == f"{prefix}orders":
                continue
            count = connection.execute(text(f'SELECT count(*) FROM "{name}"')).scalar_one()
            size = connection.execute(
                text("SELECT pg_total_relation_size(CAST(:n AS regclass))"), {"n": name}
            ).scalar_one()
            rows.append((name[len(prefix) :], int(count), int(size)))
    return rows


def check_rows(engine: Engine, table: Table, count: int, label: str) -> None:
    with engine.connect() as connection:
        rows = connection.execute(text(f"SELECT count(*) FROM {table.name}")).scalar_one()
    if rows != count:
        raise RuntimeError(f"{label}: the business table holds {rows} rows, not {count}")


def run_mqdedup(
    base: type[PerMessage],
    engine: Engine,
    bootstrap: str,
    topic: str,
    count: int,
    batch_size: int,
    attributes: Mapping[str, Any],
) -> Run:
    prefix = f"bench_{uuid.uuid4().hex[:8]}_"
    init_schema(engine, prefix)
    table = business_table(prefix)
    table.create(engine)
    clock = _Clock(count)
    consumer_class = type(
        base.__name__,
        (base,),
        {
            "topics": [topic],
            "group_id": f"bench-{uuid.uuid4().hex[:8]}",
            "bootstrap_servers": bootstrap,
            "table_prefix": prefix,
            "batch_size": batch_size,
            "table": table,
            "clock": clock,
            **attributes,
        },
    )
    stop = StopToken()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            consumer_class().run(engine, stop=stop)
        except BaseException as error:
            errors.append(error)
            clock.done.set()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        if not clock.done.wait(TIMEOUT):
            raise RuntimeError(f"{base.__name__}: only {clock.count} of {count} in {TIMEOUT} s")
        if errors:
            raise errors[0]
        rate = clock.rate
        stop.request()
        thread.join(60)
        check_rows(engine, table, count, base.__name__)
        state = framework_state(engine, prefix)
        rows = {name: number for name, number, _ in state}
        claims = rows.get("processed_messages", 0)
        if attributes.get("offsets_in_database"):
            # Coordinate identity: no claim; the offsets as rows of the framework's table.
            if claims or not rows.get("kafka_offsets"):
                raise RuntimeError(
                    f"offsets in the database not in effect: {claims} claims, "
                    f"{rows.get('kafka_offsets', 0)} offset rows"
                )
        elif claims != count:
            raise RuntimeError(f"{base.__name__}: {claims} claims for {count} messages")
        return Run(rate, state)
    finally:
        stop.request()
        thread.join(60)
        table.drop(engine)
        schema(prefix).metadata.drop_all(engine)
        # Tables a newer schema may add outside schema(prefix) (none expected).
        with engine.begin() as connection:
            for name, _, _ in framework_state(engine, prefix):
                connection.execute(text(f'DROP TABLE IF EXISTS "{prefix}{name}" CASCADE'))


# -- no dedup -------------------------------------------------------------------------------


def _reference_consumer(bootstrap: str, topic: str, batch_size: int) -> kafka.KafkaConsumer:
    return kafka.KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"bench-nodedup-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_poll_records=batch_size,
    )


def run_no_dedup(
    engine: Engine,
    bootstrap: str,
    topic: str,
    count: int,
    batch_size: int,
    bulk: bool,
    dsn: str | None = None,
) -> Run:
    """The plain loop: poll, the handler over the batch in one transaction, commit the
    transaction, then commit the offsets. ``dsn``: raw psycopg instead of the Session."""
    table = business_table(f"bench_{uuid.uuid4().hex[:8]}_")
    table.create(engine)
    connection = psycopg.connect(dsn) if dsn else None
    consumer = _reference_consumer(bootstrap, topic, batch_size)
    label = f"no dedup ({'bulk' if bulk else 'per-message'})"
    try:
        done = 0
        first: float | None = None
        deadline = time.monotonic() + TIMEOUT
        while done < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: {done} of {count} in {TIMEOUT} s")
            polled = consumer.poll(timeout_ms=500, max_records=batch_size)
            if not polled:
                continue
            if first is None:
                first = time.perf_counter()
            items = [
                (dict(record.headers)["message-id"].decode(), record.value)
                for records in polled.values()
                for record in records
            ]
            if connection is not None:
                write_psycopg(connection, table, items, bulk)
            else:
                with Session(engine) as session, session.begin():
                    if bulk:
                        handle_many(session, table, items)
                    else:
                        for message_id, body in items:
                            handle_one(session, table, message_id, body)
            consumer.commit()
            done += len(items)
        assert first is not None
        rate = done / (time.perf_counter() - first)
        check_rows(engine, table, count, label)
        return Run(rate, [])
    finally:
        consumer.close()
        if connection is not None:
            connection.close()
        table.drop(engine)


def write_psycopg(
    connection: psycopg.Connection[Any],
    table: Table,
    items: Sequence[tuple[str, bytes]],
    bulk: bool,
) -> None:
    """The same SQL as the handler, sent by raw psycopg in one transaction."""
    with connection.transaction(), connection.cursor() as cursor:
        if bulk:
            ids, orders, amounts = [], [], []
            for message_id, body in items:
                payload = json.loads(body)
                ids.append(message_id)
                orders.append(payload["order"])
                amounts.append(payload["amount"])
            cursor.execute(PSYCOPG_BULK_SQL.format(table=table.name), (ids, orders, amounts))
        else:
            statement = PSYCOPG_ONE_SQL.format(table=table.name)
            for message_id, body in items:
                payload = json.loads(body)
                cursor.execute(statement, (message_id, payload["order"], payload["amount"]))


# -- producing ------------------------------------------------------------------------------


def produce(bootstrap: str, topic: str, count: int, partitions: int) -> None:
    """``count`` small JSON messages with a UUIDv7 ``message-id`` header, round robin."""
    admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics({topic: {"num_partitions": partitions}}, wait_for_metadata=True)
    admin.close()
    producer = kafka.KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks=1)
    for i in range(count):
        body = f'{{"order": "o-{i}", "amount": {i % 1000}}}'.encode()
        producer.send(
            topic,
            value=body,
            partition=i % partitions,
            headers=[("message-id", new_message_id().encode())],
        )
    producer.flush(timeout=120)
    producer.close()


def delete_topics(bootstrap: str, topics: Sequence[str]) -> None:
    admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.delete_topics(list(topics))
    except Exception as error:  # a left-over topic is harmless; say so
        print(f"could not delete topics {topics}: {error}", file=sys.stderr)
    finally:
        admin.close()


# -- main -----------------------------------------------------------------------------------

NODEDUP, PSYCOPG, OFFSETS, CLAIMS = "no dedup", "no dedup, raw psycopg", "offsets in DB", "claims"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=30_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument(
        "--styles", default="bulk,handle", help="bulk,handle (handle_batch / per-message handle)"
    )
    parser.add_argument(
        "--with-psycopg", action="store_true", help="add the no-dedup loop on raw psycopg"
    )
    parser.add_argument(
        "--variants",
        default="nodedup,offsets,claims",
        help="which of nodedup,offsets,claims (e.g. only offsets, to profile it)",
    )
    parser.add_argument("--bootstrap", default=os.environ.get("MQDEDUP_KAFKA_BOOTSTRAP"))
    parser.add_argument("--database", default=os.environ.get("MQDEDUP_TEST_DATABASE_URL"))
    args = parser.parse_args(argv)
    if not args.bootstrap or not args.database:
        parser.error("set MQDEDUP_KAFKA_BOOTSTRAP and MQDEDUP_TEST_DATABASE_URL (or the flags)")
    styles = [s for s in args.styles.split(",") if s]
    chosen_variants = {v for v in args.variants.split(",") if v}
    if not chosen_variants or chosen_variants - {"nodedup", "offsets", "claims"}:
        parser.error("--variants takes a comma-separated subset of nodedup,offsets,claims")
    if not styles or set(styles) - {"bulk", "handle"}:
        parser.error("--styles takes bulk, handle or bulk,handle")
    if args.messages < 1 or args.runs < 1 or args.partitions < 1 or args.batch_size < 1:
        parser.error("--messages, --runs, --partitions and --batch-size must be positive")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kafka").setLevel(logging.ERROR)
    # "Metadata refresh: failed Cancelled" when a consumer closes mid-refresh: harmless.
    logging.getLogger("kafka.cluster").setLevel(logging.CRITICAL)
    mqdedup.tune_gc()  # the worker's GC settings, for every variant (as python -m bench)

    with_offsets = "offsets" in chosen_variants and offsets_supported()
    if "offsets" in chosen_variants and not with_offsets:
        print("offsets in the database: not in this tree (KafkaConsumer.offsets_in_database)")
    engine = create_engine(args.database)
    from sqlalchemy import make_url

    dsn = make_url(args.database).set(drivername="postgresql").render_as_string(hide_password=False)
    count, batch, bootstrap = args.messages, args.batch_size, args.bootstrap

    def variants(topic: str) -> dict[tuple[str, str], Callable[[], Run]]:
        chosen: dict[tuple[str, str], Callable[[], Run]] = {}
        for style in styles:
            bulk = style == "bulk"
            base: type[PerMessage] = Bulk if bulk else PerMessage
            if "nodedup" in chosen_variants:
                chosen[(style, NODEDUP)] = partial(
                    run_no_dedup, engine, bootstrap, topic, count, batch, bulk
                )
            if args.with_psycopg:
                chosen[(style, PSYCOPG)] = partial(
                    run_no_dedup, engine, bootstrap, topic, count, batch, bulk, dsn
                )
            if with_offsets:
                chosen[(style, OFFSETS)] = partial(
                    run_mqdedup, base, engine, bootstrap, topic, count, batch, OFFSETS_ATTRIBUTES
                )
            if "claims" in chosen_variants:
                chosen[(style, CLAIMS)] = partial(
                    run_mqdedup, base, engine, bootstrap, topic, count, batch, {}
                )
        return chosen

    rates: dict[tuple[str, str], list[float]] = {}
    states: dict[tuple[str, str], list[tuple[str, int, int]]] = {}
    topics: list[str] = []
    try:
        for round_ in range(1, args.runs + 1):
            topic = f"bench-offsets-{uuid.uuid4().hex[:8]}"
            topics.append(topic)
            started = time.perf_counter()
            produce(bootstrap, topic, count, args.partitions)
            print(
                f"round {round_}: produced {count:,} messages to {topic} "
                f"({args.partitions} partitions) in {time.perf_counter() - started:.1f} s",
                flush=True,
            )
            for key, measure in variants(topic).items():
                started = time.perf_counter()
                run = measure()
                rates.setdefault(key, []).append(run.rate)
                states[key] = run.state
                print(
                    f"round {round_}: {key[0]}, {key[1]}: {run.rate:,.0f} msgs/s "
                    f"({time.perf_counter() - started:.1f} s)",
                    flush=True,
                )
    finally:
        delete_topics(bootstrap, topics)
        engine.dispose()

    print()
    print(
        f"Kafka -> PostgreSQL, the same handler with and without dedup: {count:,} messages, "
        f"{args.partitions} partitions, batches of {batch}, medians of {args.runs} runs"
    )
    print()
    print("| handler | variant | msgs/s (median) | runs | vs no dedup |")
    print("|---|---|---:|---|---:|")
    goals = []
    for style in styles:
        reference_runs = rates.get((style, NODEDUP))
        reference = statistics.median(reference_runs) if reference_runs else float("nan")
        for (s, name), values in rates.items():
            if s != style:
                continue
            median = statistics.median(values)
            runs = ", ".join(f"{v:,.0f}" for v in values)
            label = "bulk `handle_batch`" if style == "bulk" else "per-message `handle`"
            print(f"| {label} | {name} | {median:,.0f} | {runs} | {median / reference:.2f} |")
            if name == OFFSETS:
                goals.append((style, median / reference))
    print()
    for style, ratio in goals:
        verdict = "met" if ratio >= 0.9 else "NOT met"
        print(f"Goal: offsets in the database >= 0.9 of no dedup, {style}: {ratio:.3f} ({verdict})")
    print()
    print(f"Framework tables after a run of {count:,} messages (last round):")
    print()
    print("| handler | variant | table | rows | pg_total_relation_size |")
    print("|---|---|---|---:|---:|")
    for (style, name), state in states.items():
        for table, rows, size in state:
            if rows:
                print(f"| {style} | {name} | {table} | {rows:,} | {size / 1024:,.0f} kB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

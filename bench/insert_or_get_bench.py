"""What ``insert_or_get`` costs next to a plain insert and the hand-written savepoint form.

One SQLAlchemy ``Session`` transaction per round of ``--calls`` calls into a table with
a unique ``email`` column (the framework's own connection setup, no consumer), for each
way of writing it:

* ``plain insert``: ``session.execute(insert(t), row)`` of a fresh key (no answer for a
  taken key: the baseline);
* ``insert_or_get, new key`` / ``existing key``;
* ``savepoint form, new key`` / ``existing key``: ``with session.begin_nested():
  insert`` and, on ``IntegrityError``, a read of the stored row.

Rounds interleave the variants; the figures are medians of the rounds, microseconds per
call.

Usage: .venv/bin/python bench/insert_or_get_bench.py [--calls 200] [--rounds 7]
[--database URL ...] (default: MQDEDUP_TEST_DATABASE_URL, MQDEDUP_TEST_MARIADB_URL and a
temporary SQLite file). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from mqdedup import create_engine, insert_or_get
from mqdedup.db.schema import MYSQL_TABLE_OPTIONS, KeyString

Call = Callable[[Session, Table, dict[str, str]], object]


def plain(session: Session, table: Table, row: dict[str, str]) -> object:
    return session.execute(insert(table), row)


def helper(session: Session, table: Table, row: dict[str, str]) -> object:
    return insert_or_get(session, table, row, key="email")


def savepoint(session: Session, table: Table, row: dict[str, str]) -> object:
    try:
        with session.begin_nested():
            session.execute(insert(table), row)
    except IntegrityError:
        return session.execute(select(table).where(table.c.email == row["email"])).one()
    return None


VARIANTS: list[tuple[str, Call, bool]] = [
    ("plain insert", plain, False),
    ("insert_or_get, new key", helper, False),
    ("insert_or_get, existing key", helper, True),
    ("savepoint form, new key", savepoint, False),
    ("savepoint form, existing key", savepoint, True),
]


def one_round(engine: Engine, table: Table, call: Call, existing: bool, calls: int) -> float:
    """Microseconds per call of one transaction of ``calls`` calls."""
    rows = [{"email": f"{uuid.uuid4().hex}@x", "name": "n"} for _ in range(calls)]
    if existing:
        with engine.begin() as connection:
            connection.execute(insert(table), rows)
    with Session(engine) as session, session.begin():
        session.connection()  # the transaction's BEGIN is not timed
        started = time.perf_counter()
        for row in rows:
            call(session, table, row)
        elapsed = time.perf_counter() - started
    return elapsed / calls * 1e6


def measure(url: str, calls: int, rounds: int) -> dict[str, float]:
    engine = create_engine(url)
    metadata = MetaData()
    table = Table(
        f"bench_iog_{uuid.uuid4().hex[:8]}",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("email", KeyString(255), nullable=False, unique=True),
        Column("name", String(64), nullable=False),
        **MYSQL_TABLE_OPTIONS,
    )
    metadata.create_all(engine)
    try:
        samples: dict[str, list[float]] = {name: [] for name, _, _ in VARIANTS}
        for _ in range(rounds + 1):  # the first round warms caches and is dropped
            for name, call, existing in VARIANTS:
                samples[name].append(one_round(engine, table, call, existing, calls))
        return {name: statistics.median(values[1:]) for name, values in samples.items()}
    finally:
        metadata.drop_all(engine)
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--database", action="append", default=None)
    args = parser.parse_args()
    urls = args.database or [
        url
        for url in (
            os.environ.get("MQDEDUP_TEST_DATABASE_URL"),
            os.environ.get("MQDEDUP_TEST_MARIADB_URL"),
        )
        if url
    ]
    if not args.database:
        urls.append(f"sqlite:///{tempfile.mkdtemp()}/bench.db")
    results = {url.split(":", 1)[0]: measure(url, args.calls, args.rounds) for url in urls}
    print(f"µs per call, median of {args.rounds} rounds of {args.calls} calls in one transaction\n")
    print("| variant | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    for name, _, _ in VARIANTS:
        print(f"| {name} | " + " | ".join(f"{r[name]:.0f}" for r in results.values()) + " |")


if __name__ == "__main__":
    main()

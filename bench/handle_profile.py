"""Where a per-message ``handle`` spends its time, by library, under py-spy.

    py-spy record --idle -r 400 -f raw -o handle.raw -- \\
        python -m bench.handle_profile run [--messages 60000]
    python -m bench.handle_profile report handle.raw

``run`` drives the handlers suite's plain handler (``ctx.session.execute(insert(t),
row)``, in-memory broker -> PostgreSQL at ``MQDEDUP_TEST_DATABASE_URL``, batches of 500,
every statement executed when called).
``report`` reads py-spy's raw output and splits the worker's samples (idle included) by
the innermost library on each stack: psycopg (waiting on the server or client work),
SQLAlchemy, mqdedup by module, the handler's own code.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Sequence

_WAITING = ("wait", "select", "poll")


def run(messages: int) -> None:
    from bench.suite_handlers import Plain, Tables, run_mqdedup
    from bench.suite_handlers import messages as make_messages
    from mqdedup import tune_gc
    from mqdedup.db import create_engine

    tune_gc()
    engine = create_engine(os.environ["MQDEDUP_TEST_DATABASE_URL"])
    tables = Tables(engine)
    try:
        run_mqdedup(Plain, tables, make_messages(2_000))  # warm-up
        rate = run_mqdedup(Plain, tables, make_messages(messages))
        print(f"{rate:,.0f} msgs/s")
    finally:
        tables.drop()
        engine.dispose()


def category(frames: Sequence[str]) -> str:
    """The innermost library of one stack (py-spy raw frames, leaf last)."""
    leaf = frames[-1].lower()
    for frame in reversed(frames):
        if "psycopg/" in frame:
            waiting = any(word in leaf for word in _WAITING)
            return "psycopg: waiting" if waiting else "psycopg: client work"
        if "sqlalchemy/" in frame:
            return "SQLAlchemy"
        if "mqdedup/" in frame:
            return "mqdedup: " + frame.rsplit("(", 1)[-1].split(":")[0]
        if "suite_handlers" in frame:
            return "the handler's own code"
    return "other"


def report(path: str) -> None:
    shares: Counter[str] = Counter()
    with open(path, encoding="utf-8") as raw:
        for line in raw:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if "Worker.run" in stack:  # the timed worker only, not the setup
                shares[category(stack.split(";"))] += int(count)
    total = sum(shares.values()) or 1
    for name, samples in shares.most_common():
        print(f"{samples / total:6.1%}  {name}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run")
    run_parser.add_argument("--messages", type=int, default=60_000)
    report_parser = commands.add_parser("report")
    report_parser.add_argument("raw")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.messages)
    else:
        report(args.raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())

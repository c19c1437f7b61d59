"""mqdedup benchmark suite: ``python -m bench [--quick] [--only SUITES]``.

Measures side by side, medians over several runs, on the real services of
``scripts/services.sh`` (addresses from ``scripts/services.sh env``):

* kafka, rabbitmq: consumer -> PostgreSQL throughput of mqdedup (batch with a bulk
  handler, batch with a per-message handler, one transaction per message), a
  hand-written "SELECT then INSERT" consumer and a raw client loop with no database;
* handlers: per-message handler styles (plain, driver SQL, ``ctx.stage``, transaction
  mode) next to bulk ``handle_batch`` and raw psycopg, in-memory broker -> PostgreSQL;
* relay: the outbox relay against a raw publish loop, per broker, and the
  commit-to-publish latency (p50/p99) with NOTIFY and with polling;
* claim: claim cost with 0 / 1M / 10M rows in the dedup table, and purge speed;
* memory: peak RSS of a worker subprocess over 1,000,000 messages (in-memory broker);
* async (``--only async``): asyncio consumers (``async def`` handlers, ``AsyncSession``)
  next to the synchronous ones, bulk and per-message (``bench/suite_async.py``).

Writes ``bench/results/results.md``, ``results.json`` and PNG charts, and in full mode
(all suites) ``docs/benchmarks.md``. ``--quick`` is a smoke run of the same suites (one
run, small sizes, about half a minute on 2 cores) that writes to a temporary folder
unless ``--out`` is given, so it never replaces the committed results; the full mode
took 5–8 minutes on a 2-core machine (limit: 20).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.suite_common import FULL, QUICK, Section, Settings, Sizes, fmt, progress

ROOT = Path(__file__).resolve().parent.parent
#: Results of standalone bench scripts appended to docs/benchmarks.md (see docs_markdown).
STANDALONE_RESULTS = [ROOT / "bench" / "results" / "id_order.md"]
SUITES = ("kafka", "rabbitmq", "handlers", "relay", "claim", "memory")
#: Suites run only when named in ``--only`` (not part of the default full / quick run).
OPTIONAL = ("async",)


NEEDS = {
    "kafka": ("postgres", "kafka"),
    "rabbitmq": ("postgres", "rabbitmq"),
    "handlers": ("postgres",),
    "relay": ("postgres", "kafka", "rabbitmq"),
    "claim": ("postgres",),
    "memory": ("postgres",),
    "async": ("postgres", "kafka", "rabbitmq"),
}


def unreachable(names: Sequence[str], settings: Settings) -> list[str]:
    """The services the chosen suites need that do not accept a TCP connection."""
    import socket
    from urllib.parse import urlsplit

    from sqlalchemy import make_url

    database = make_url(settings.database_url)
    rabbit = urlsplit(settings.rabbitmq_url)
    kafka_host, _, kafka_port = settings.kafka_bootstrap.split(",")[0].rpartition(":")
    addresses = {
        "postgres": (database.host or "127.0.0.1", database.port or 5432),
        "kafka": (kafka_host or "127.0.0.1", int(kafka_port or 9092)),
        "rabbitmq": (rabbit.hostname or "127.0.0.1", rabbit.port or 5672),
    }
    missing = []
    for service in sorted({service for name in names for service in NEEDS[name]}):
        host, port = addresses[service]
        try:
            socket.create_connection((host, port), timeout=3).close()
        except OSError:
            missing.append(f"{service} at {host}:{port}")
    return missing


def run_suites(names: Sequence[str], settings: Settings, sizes: Sizes) -> list[Section]:
    from bench.suite_async import async_suite
    from bench.suite_consumers import kafka_suite, rabbitmq_suite
    from bench.suite_dedup import dedup_suite
    from bench.suite_handlers import handlers_suite
    from bench.suite_memory import memory_suite
    from bench.suite_relay import relay_suite

    plan: dict[str, tuple[Callable[[], Section | tuple[Section, ...]], tuple[str, ...]]] = {
        "kafka": (lambda: kafka_suite(settings, sizes), ("kafka",)),
        "rabbitmq": (lambda: rabbitmq_suite(settings, sizes), ("rabbitmq",)),
        "handlers": (lambda: handlers_suite(settings, sizes), ("handlers",)),
        "relay": (lambda: relay_suite(settings, sizes), ("relay", "latency")),
        "claim": (lambda: dedup_suite(settings, sizes), ("claim", "purge")),
        "memory": (lambda: memory_suite(settings, sizes), ("memory",)),
        "async": (lambda: async_suite(settings, sizes), ("async",)),
    }
    sections: list[Section] = []
    for name in names:
        measure, keys = plan[name]
        progress(f"suite {name}: start")
        started = time.perf_counter()
        try:
            result = measure()
            produced = list(result) if isinstance(result, tuple) else [result]
        except Exception as error:
            traceback.print_exc()
            message = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            produced = [Section(key, key, "", error=message) for key in keys]
        elapsed = time.perf_counter() - started
        for section in produced:
            section.seconds = elapsed
        sections.extend(produced)
        progress(f"suite {name}: done in {elapsed:.0f} s")
    return sections


def docs_markdown(
    sections: Sequence[Section], info: dict[str, str], wall: float, sizes: Sizes
) -> str:
    from bench.suite_report import headline_table

    by_key = {s.key: s for s in sections}
    machine = (
        f"{info['nproc']} cores ({info['CPU']}), {info['memory']} RAM, PostgreSQL "
        f"{info['PostgreSQL']} ({info.get('PostgreSQL settings', 'settings unknown')}), "
        f"Kafka {info['Kafka']}, RabbitMQ {info['RabbitMQ']}, "
        f"Python {info['Python']}; {info['libraries']}"
    )
    lines = [
        "## Benchmarks",
        "",
        "mqdedup next to what you would write by hand, measured in one run of "
        f"`python -m bench` (medians of {sizes.runs} runs, {wall / 60:.0f} min wall time) on "
        f"one machine with every service on loopback: {machine}.",
        "",
        headline_table(by_key),
        "![consumer throughput](../bench/results/consumers.png)",
        "",
        '"Hand-written" is the consumer a team writes without mqdedup: per message, '
        "`SELECT` the id, then `INSERT` it and the business row, one transaction per "
        "message, then ack/commit the offset; its batch variant claims a whole batch of "
        "500 and writes its rows set-based in one transaction, then commits the offsets "
        "(Kafka) or sends one `multiple=True` ack (RabbitMQ). The raw loop reads without "
        "touching the database: the ceiling.",
        "",
    ]
    summary = []
    relay, latency = by_key.get("relay"), by_key.get("latency")
    if relay and not relay.error:
        for broker in ("kafka", "rabbitmq"):
            raw, out = (
                relay.row(f"{broker}: raw publish loop"),
                relay.row(f"{broker}: mqdedup relay"),
            )
            if raw and out:
                summary.append(
                    f"- Relay to {broker}: {fmt(out.median, out.unit)} rows/s, "
                    f"{out.median / raw.median:.0%} of a raw publish loop with the same "
                    f"guarantees ({fmt(raw.median, raw.unit)} msgs/s)."
                )
    if latency and not latency.error:
        cells = {row.variant: fmt(row.median, "ms") for row in latency.rows}
        for broker in ("kafka", "rabbitmq"):
            summary.append(
                f"- Commit-to-publish latency, {broker}: NOTIFY p50 "
                f"{cells.get(f'{broker}, NOTIFY: p50')} ms / p99 "
                f"{cells.get(f'{broker}, NOTIFY: p99')} ms; polling (1 s) p50 "
                f"{cells.get(f'{broker}, polling (1 s): p50')} ms / p99 "
                f"{cells.get(f'{broker}, polling (1 s): p99')} ms."
            )
    claim, purge = by_key.get("claim"), by_key.get("purge")
    if claim and not claim.error:
        summary.append(
            "- Claims/s (batches of 500) with the dedup table already holding "
            + "; ".join(f"{row.variant}: {fmt(row.median, row.unit)}" for row in claim.rows)
            + "."
        )
    if purge and not purge.error and purge.rows:
        summary.append(
            "- Purge: "
            + "; ".join(f"{row.variant}: {fmt(row.median, row.unit)} rows/s" for row in purge.rows)
            + "."
        )
    memory = by_key.get("memory")
    if memory and not memory.error:
        summary.append(
            f"- Worker memory over {sizes.memory_messages:,} messages (in-memory broker, "
            f"PostgreSQL): peak RSS {fmt(memory.rows[0].median, 'MiB')} MiB, "
            f"{memory.extra.get('growth', '')}."
        )
    failed = [s.key for s in sections if s.error]
    if failed:
        summary.append(f"- Not measured in this run: {', '.join(failed)} (see results.md).")
    lines += summary
    lines += [
        "",
        "Full tables (every run's value), charts for the relay, latency, claim cost and "
        "memory: [bench/results/results.md](../bench/results/results.md).",
        "",
        "### Running the benchmarks",
        "",
        "<!-- docs-test: fresh-checkout -->",
        "```bash",
        "scripts/services.sh start postgres kafka rabbitmq",
        'eval "$(scripts/services.sh env)"',
        ".venv/bin/pip install -e '.[all,bench]'",
        ".venv/bin/python -m bench --quick   # smoke run: 1 run, small sizes, ~30 s",
        "```",
        "",
        "`--quick` checks that every suite runs on your machine; its figures are not for "
        "comparison, and it writes to a temporary folder (printed at the end) unless you "
        "pass `--out`. The full run:",
        "",
        "<!-- docs-test: skip: the full run takes 5–8 minutes; the block above runs every "
        "suite with --quick -->",
        "```bash",
        f".venv/bin/python -m bench         # {wall / 60:.0f} minutes here",
        "```",
        "",
        "`scripts/bench.sh` does the same (it starts the services first). "
        "`--only kafka,rabbitmq,handlers,relay,claim,memory` runs some suites (`--only async` adds "
        "the asyncio consumers, not part of the default run); `--runs N` changes "
        "the number of runs. Results go to `bench/results/` (`results.md`, `results.json`, "
        "`*.png`); a full run of every suite also rewrites this page. Absolute numbers "
        "depend on the machine; compare the ratios.",
        "",
    ]
    # Measurements of their own scripts (long runs, not part of `python -m bench`),
    # kept on this page through its rewrites.
    for standalone in STANDALONE_RESULTS:
        if standalone.is_file():
            lines += [standalone.read_text(encoding="utf-8").rstrip(), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="mqdedup benchmark suite (see bench/__main__.py)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: one run, small sizes, ~30 s; results to a temporary folder",
    )
    parser.add_argument(
        "--only",
        default=",".join(SUITES),
        help=f"comma-separated suites: {','.join(SUITES + OPTIONAL)} (default: all but async)",
    )
    parser.add_argument("--runs", type=int, default=None, help="runs per measurement")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default: bench/results; with --quick a new temporary folder)",
    )
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(names) - set(SUITES) - set(OPTIONAL))
    if unknown:
        choices = ", ".join(SUITES + OPTIONAL)
        parser.error(f"unknown suite(s): {', '.join(unknown)} (choose from {choices})")
    sizes = QUICK if args.quick else FULL
    if args.runs is not None:
        if args.runs < 1:
            parser.error("--runs must be at least 1")
        sizes = dataclasses.replace(sizes, runs=args.runs)
    mode = "quick" if args.quick else "full"
    if args.out is None:
        args.out = (
            Path(tempfile.mkdtemp(prefix="mqdedup-bench-quick-"))
            if args.quick
            else ROOT / "bench" / "results"
        )

    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("kafka", "pika"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    settings = Settings.from_env()
    missing = unreachable(names, settings)
    if missing:
        print(
            f"bench: not reachable: {', '.join(missing)} (start them with "
            "scripts/services.sh start, or set the MQDEDUP_* URLs)",
            file=sys.stderr,
        )
        return 2

    from bench.suite_report import charts, machine, results_markdown, section_markdown
    from mqdedup import tune_gc

    # The process runs with the garbage collector settings of `mqdedup worker` and
    # `mqdedup relay`, for every variant (raw and hand-written loops included).
    tune_gc()
    started = time.perf_counter()
    info = machine(settings)
    progress(f"bench ({mode}): suites {', '.join(names)}; {info['nproc']} cores, {info['memory']}")
    sections = run_suites(names, settings, sizes)
    wall = time.perf_counter() - started

    args.out.mkdir(parents=True, exist_ok=True)
    subtitle = f"mqdedup bench ({mode}), {info['nproc']} cores, {info['memory']}"
    written = charts(sections, args.out, subtitle)
    (args.out / "results.md").write_text(
        results_markdown(sections, info, mode, sizes.runs, wall), encoding="utf-8"
    )
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "mode": mode,
                "sizes": dataclasses.asdict(sizes),
                "machine": info,
                "wall_seconds": round(wall, 1),
                "sections": [dataclasses.asdict(section) for section in sections],
            },
            indent=1,
            default=str,
        ),
        encoding="utf-8",
    )
    complete = not args.quick and names == list(SUITES) and not args.no_docs
    if complete:
        (ROOT / "docs" / "benchmarks.md").write_text(
            docs_markdown(sections, info, wall, sizes), encoding="utf-8"
        )
    for section in sections:
        print(section_markdown(section))
    print(
        f"wall time {wall / 60:.1f} min; wrote {args.out / 'results.md'}, "
        + ", ".join(str(path.name) for path in written)
        + ("; docs/benchmarks.md" if complete else "")
    )
    return 1 if any(section.error for section in sections) else 0


if __name__ == "__main__":
    sys.exit(main())

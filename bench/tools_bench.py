"""Throughput of the idempotency tools on the real services (medians of N runs).

    eval "$(scripts/services.sh env)"
    .venv/bin/python bench/tools_bench.py [--runs 3] [--only transitions,tokens,claims,redis]

* transitions: one conditional UPDATE per transaction on one connection (``applied``,
  then the ``already in target state`` path: UPDATE + locking SELECT);
* tokens: issue and consume, one transaction each (database), one script call (Redis);
* claims: 10,000 deliveries with 30% duplicates through the processor, batch 500,
  ``handle_batch`` (one INSERT per batch), on PostgreSQL and on MariaDB with the
  ``RETURNING`` claim and with the MySQL row-count claim;
* redis: the same 10,000 deliveries through the Redis dedup processor (no database).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, insert
from sqlalchemy.orm import Session

from mqdedup import Context, InMemoryBroker, Message, RedisDedup, Worker, run_until_idle
from mqdedup.consumers.base import Consumer
from mqdedup.consumers.context import BatchContext
from mqdedup.db import create_engine, dialects, init_schema
from mqdedup.db.schema import MYSQL_TABLE_OPTIONS, KeyString, schema
from mqdedup.dedup.redis_tokens import RedisTokenStore
from mqdedup.dedup.tokens import DatabaseTokenStore
from mqdedup.dedup.transitions import StateMachine

N_TRANSITIONS = 2_000
N_TOKENS = 2_000
N_MESSAGES = 10_000


def median_rate(runs: int, once: Callable[[], tuple[int, float]]) -> float:
    rates = []
    for _ in range(runs):
        count, seconds = once()
        rates.append(count / seconds)
    return statistics.median(rates)


def databases() -> dict[str, str]:
    urls = {"postgresql": os.environ.get("MQDEDUP_TEST_DATABASE_URL", "")}
    urls["mariadb"] = os.environ.get("MQDEDUP_TEST_MARIADB_URL", "")
    return {name: url for name, url in urls.items() if url}


class Tables:
    """Fresh framework + business tables under a unique prefix; dropped by ``drop``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.prefix = f"b_{uuid.uuid4().hex[:8]}_"
        self.metadata = MetaData()
        self.accounts = Table(
            f"{self.prefix}accounts",
            self.metadata,
            Column("id", Integer, primary_key=True, autoincrement=False),
            Column("state", String(20), nullable=False),
            **MYSQL_TABLE_OPTIONS,
        )
        self.orders = Table(
            f"{self.prefix}orders",
            self.metadata,
            Column("row_id", Integer, primary_key=True, autoincrement=True),
            Column("message_id", KeyString(255), nullable=False),
            **MYSQL_TABLE_OPTIONS,
        )
        init_schema(engine, self.prefix)
        self.metadata.create_all(engine)

    def drop(self) -> None:
        self.metadata.drop_all(self.engine)
        schema(self.prefix).metadata.drop_all(self.engine)


def bench_transitions(url: str, runs: int) -> dict[str, float]:
    engine = create_engine(url)
    results: dict[str, list[float]] = {"applied": [], "already in target state": []}
    for _ in range(runs):
        tables = Tables(engine)
        machine = StateMachine(tables.accounts, {"CREATED": {"PAID"}})
        with engine.begin() as connection:
            connection.execute(
                insert(tables.accounts),
                [{"id": n, "state": "CREATED"} for n in range(N_TRANSITIONS)],
            )
        for rates in results.values():
            started = time.perf_counter()
            with Session(engine) as session:
                for n in range(N_TRANSITIONS):
                    with session.begin():
                        machine.transition(session, n, to="PAID")
            rates.append(N_TRANSITIONS / (time.perf_counter() - started))
        tables.drop()
    engine.dispose()
    return {f"transition {k} /s": statistics.median(v) for k, v in results.items()}


def bench_db_tokens(url: str, runs: int) -> dict[str, float]:
    engine = create_engine(url)
    issue_rates, consume_rates = [], []
    for _ in range(runs):
        tables = Tables(engine)
        store = DatabaseTokenStore(engine, prefix=tables.prefix)
        started = time.perf_counter()
        tokens = [store.issue(f"user-{n % 50}", 600) for n in range(N_TOKENS)]
        issue_rates.append(N_TOKENS / (time.perf_counter() - started))
        started = time.perf_counter()
        for n, token in enumerate(tokens):
            store.consume(f"user-{n % 50}", token)
        consume_rates.append(N_TOKENS / (time.perf_counter() - started))
        tables.drop()
    engine.dispose()
    return {
        "token issue /s": statistics.median(issue_rates),
        "token consume /s": statistics.median(consume_rates),
    }


def bench_redis_tokens(url: str, runs: int) -> dict[str, float]:
    client = redis.Redis.from_url(url)
    issue_rates, consume_rates = [], []
    for _ in range(runs):
        namespace = f"bench:{uuid.uuid4().hex[:8]}:"
        store = RedisTokenStore(client, namespace=namespace)
        started = time.perf_counter()
        tokens = [store.issue(f"user-{n % 50}", 600) for n in range(N_TOKENS)]
        issue_rates.append(N_TOKENS / (time.perf_counter() - started))
        started = time.perf_counter()
        for n, token in enumerate(tokens):
            store.consume(f"user-{n % 50}", token)
        consume_rates.append(N_TOKENS / (time.perf_counter() - started))
        _delete_namespace(client, namespace)
    return {
        "token issue /s": statistics.median(issue_rates),
        "token consume /s": statistics.median(consume_rates),
    }


def _published_broker() -> tuple[InMemoryBroker, int]:
    broker = InMemoryBroker(seed=1)
    for n in range(N_MESSAGES):
        broker.publish("q", b"{}", message_id=f"m{n}")
    copies = broker.inject_duplicates("q", 0.3)
    return broker, N_MESSAGES + copies


def bench_claims(url: str, runs: int, *, returning: bool = True) -> float:
    engine = create_engine(url)

    saved = dialects.mysql_supports_returning
    if not returning:
        dialects.mysql_supports_returning = lambda _dialect: False

    def once() -> tuple[int, float]:
        tables = Tables(engine)
        orders = tables.orders

        class Bulk(Consumer):
            name = "bench"
            batch_size = 500
            poll_timeout = 0.01
            table_prefix = tables.prefix

            def handle_batch(
                self, messages: Sequence[Message], ctx: BatchContext
            ) -> dict[str, Any]:
                ctx.session.execute(insert(orders), [{"message_id": m.id} for m in messages])
                return {}

        broker, deliveries = _published_broker()
        started = time.perf_counter()
        metrics = run_until_idle(Bulk(), broker.transport("q"), engine)
        seconds = time.perf_counter() - started
        assert metrics.processed == N_MESSAGES, metrics
        tables.drop()
        return deliveries, seconds

    try:
        return median_rate(runs, once)
    finally:
        dialects.mysql_supports_returning = saved
        engine.dispose()


def bench_redis_dedup(url: str, runs: int) -> float:
    client = redis.Redis.from_url(url)

    def once() -> tuple[int, float]:
        namespace = f"bench:{uuid.uuid4().hex[:8]}:"

        class Sms(Consumer):
            name = "bench"
            batch_size = 500
            poll_timeout = 0.01
            dedup = RedisDedup(url=url, namespace=namespace)

            def handle(self, message: Message, ctx: Context) -> Any:
                return None

        broker, deliveries = _published_broker()
        started = time.perf_counter()
        metrics = Worker(Sms(), broker.transport("q"), None).run(until_idle=True)
        seconds = time.perf_counter() - started
        assert metrics.processed == N_MESSAGES, metrics
        _delete_namespace(client, namespace)
        return deliveries, seconds

    return median_rate(runs, once)


def _delete_namespace(client: redis.Redis, namespace: str) -> None:
    keys = list(client.scan_iter(match=f"{namespace}*", count=1000))
    for start in range(0, len(keys), 1000):
        client.delete(*keys[start : start + 1000])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", default="transitions,tokens,claims,redis")
    args = parser.parse_args()
    only = set(args.only.split(","))
    redis_url = os.environ.get("MQDEDUP_REDIS_URL", "")
    figures: dict[str, Any] = {}
    for name, url in databases().items():
        if "transitions" in only:
            figures[name] = {**figures.get(name, {}), **bench_transitions(url, args.runs)}
        if "tokens" in only:
            figures[name] = {**figures.get(name, {}), **bench_db_tokens(url, args.runs)}
        if "claims" in only:
            figures.setdefault(name, {})
            figures[name]["10k deliveries (30% dup), batch 500 /s"] = bench_claims(url, args.runs)
            if name == "mariadb":
                figures[name]["same, MySQL row-count claim /s"] = bench_claims(
                    url, args.runs, returning=False
                )
    if redis_url and "tokens" in only:
        figures["redis"] = bench_redis_tokens(redis_url, args.runs)
    if redis_url and "redis" in only:
        figures.setdefault("redis", {})
        figures["redis"]["10k deliveries (30% dup) with RedisDedup /s"] = bench_redis_dedup(
            redis_url, args.runs
        )
    print(
        json.dumps({k: {m: round(v) for m, v in f.items()} for k, f in figures.items()}, indent=2)
    )


if __name__ == "__main__":
    main()

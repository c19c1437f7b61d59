"""Clients placing orders, with retries: ``python -m examples.fastapi_orders.demo``.

Runs the app in this process (its lifespan starts the shipping consumer) and sends
``--orders`` orders through HTTP, each with its own ``Idempotency-Key``. A share of the
clients retry (the same key and body again, as after a timeout), some send their
request twice at the same moment; a client answered 409 (its first request still in
flight) waits and asks again. Then it waits until ``mqdedup relay`` (started beside it)
published every event and the consumer shipped every order, and prints the report.
Exit 1 if an order was placed or shipped twice, or a client got no order.

``--relay`` starts ``mqdedup relay`` beside the clients (a subprocess with the same
environment) and stops it at the end; without it, run ``mqdedup relay`` yourself.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import func, select

from examples import settings
from examples.fastapi_orders import config
from examples.fastapi_orders.app import create_app
from mqdedup import create_async_engine

#: How long the demo waits for the relay and the consumer to ship every order.
SHIPPING_TIMEOUT = 90.0


@dataclass
class Tally:
    """What the clients saw."""

    statuses: Counter[int] = field(default_factory=Counter)
    replayed: int = 0
    #: Order id each client ended with, by idempotency key (every answer for a key agrees).
    orders: dict[str, int] = field(default_factory=dict)
    disagreements: int = 0


async def place(
    http: httpx.AsyncClient, key: str, customer: str, body: dict[str, object], tally: Tally
) -> None:
    """One client request, asked again after a 409 until it has an answer."""
    for _attempt in range(200):
        response = await http.post(
            "/orders",
            json=body,
            headers={
                "Idempotency-Key": key,
                "Authorization": f"Bearer {config.customer_token(customer)}",
            },
        )
        tally.statuses[response.status_code] += 1
        if response.status_code == 409:
            await asyncio.sleep(0.05)  # the draft's advice: retry after a while
            continue
        if response.status_code != 201:
            raise RuntimeError(f"unexpected answer {response.status_code}: {response.text}")
        if response.headers.get("idempotent-replayed") == "true":
            tally.replayed += 1
        order_id = int(response.json()["id"])
        if tally.orders.setdefault(key, order_id) != order_id:
            tally.disagreements += 1
        return
    raise RuntimeError(f"no answer for key {key} after 200 attempts")


async def client(
    http: httpx.AsyncClient,
    number: int,
    retry: bool,
    twice: bool,
    tally: Tally,
    limit: asyncio.Semaphore,
) -> None:
    """One customer's order: sent once, retried after its answer, or sent twice at once."""
    key = str(uuid.uuid4())
    customer = f"customer-{number % 50}"
    body: dict[str, object] = {"item": f"item-{number}", "quantity": 1 + number % 3}
    async with limit:
        if twice:
            await asyncio.gather(
                place(http, key, customer, body, tally), place(http, key, customer, body, tally)
            )
        else:
            await place(http, key, customer, body, tally)
        if retry:
            await place(http, key, customer, body, tally)


async def run(orders: int, retries: float, concurrent: float, parallel: int) -> int:
    """Send the orders, wait for the shipments, print the report; return the exit code."""
    engine = create_async_engine(settings.database_url())
    app = create_app(engine)
    table_orders, shipments = config.tables()
    tally = Tally()
    chance = random.Random(7)
    started = time.monotonic()
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://orders") as http:
            limit = asyncio.Semaphore(parallel)
            await asyncio.gather(
                *(
                    client(
                        http,
                        number,
                        chance.random() < retries,
                        chance.random() < concurrent,
                        tally,
                        limit,
                    )
                    for number in range(orders)
                )
            )
            sent_seconds = time.monotonic() - started
            deadline = time.monotonic() + SHIPPING_TIMEOUT
            while await _count(engine, select(func.count()).select_from(shipments)) < orders:
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            health = await http.get("/healthz/consumers")
    placed = await _count(engine, select(func.count()).select_from(table_orders))
    shipped = await _count(engine, select(func.count()).select_from(shipments))
    shipped_orders = await _count(engine, select(func.count(func.distinct(shipments.c.order_id))))
    await engine.dispose()
    answers = ", ".join(f"{status}: {count}" for status, count in sorted(tally.statuses.items()))
    print(f"clients                       {orders}")
    print(f"requests sent                 {sum(tally.statuses.values())} ({answers})")
    print(f"answers replayed              {tally.replayed}")
    print(f"orders placed                 {placed}")
    print(f"orders shipped                {shipped_orders}")
    print(f"shipments written             {shipped}")
    print(f"consumer health               {health.status_code}")
    print(f"requests took                 {sent_seconds:.1f} s")
    once = placed == orders == len(set(tally.orders.values())) and tally.disagreements == 0
    shipped_once = shipped == shipped_orders == orders
    print(
        "each order placed once and shipped once"
        if once and shipped_once
        else "PROBLEM: an order was placed or shipped twice, or not at all"
    )
    return 0 if once and shipped_once else 1


async def _count(engine: object, statement: object) -> int:
    async with engine.connect() as connection:  # type: ignore[attr-defined]
        return int((await connection.execute(statement)).scalar_one())


@contextmanager
def relay(wanted: bool) -> Iterator[None]:
    """``mqdedup relay`` in a subprocess while the clients run (when ``wanted``)."""
    if not wanted:
        yield
        return
    command = shutil.which("mqdedup") or str(Path(sys.executable).parent / "mqdedup")
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen([command, "relay"], stdout=log, stderr=subprocess.STDOUT)
        try:
            yield
        finally:
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=30)
            if code != 0:
                log.seek(0)
                print(log.read().decode(errors="replace")[-2000:], file=sys.stderr)
                print(f"mqdedup relay exited {code}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    """Parse the options and run the clients."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--orders", type=int, default=200, help="clients, one order each")
    parser.add_argument(
        "--retries",
        type=float,
        default=0.3,
        help="share of clients that send their request again after the answer",
    )
    parser.add_argument(
        "--concurrent",
        type=float,
        default=0.1,
        help="share of clients that send their request twice at the same moment",
    )
    parser.add_argument("--parallel", type=int, default=20, help="clients at the same time")
    parser.add_argument("--relay", action="store_true", help="run mqdedup relay beside them")
    args = parser.parse_args(argv)
    with relay(args.relay):
        code = asyncio.run(run(args.orders, args.retries, args.concurrent, args.parallel))
    sys.exit(code)


if __name__ == "__main__":
    main()

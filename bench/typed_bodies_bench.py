"""The cost of typed bodies beside ``message.json()``: ``python -m bench.typed_bodies_bench``.

Decodes the same order body (an id, a customer, three lines with sku / qty / price, a
note) N times per kind, in one process, three rounds, and prints the median µs per
message and the rate:

* ``message.json()``: what an unannotated handler does by hand (no validation);
* dataclass: ``json.loads`` plus mqdedup's field checks (``mqdedup.consumers.bodies``);
* pydantic v2: ``Model.model_validate_json`` (parse and validate in Rust);
* msgspec: ``msgspec.json.Decoder(Struct).decode`` (parse and validate in C).

Then the pipeline's own per-message overhead for an unannotated handler: ``Handlers.call``
(the seam where the body would be decoded) with a handler doing nothing, to show that a
handler taking the raw ``Message`` pays nothing but one ``is None`` test (run the same
section on a tree before typed bodies to compare: ``PYTHONPATH=<tree>``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pydantic

from mqdedup import Consumer, Message
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.transport import Delivery

BODY = json.dumps(
    {
        "order_id": 123456,
        "customer": "c-42",
        "lines": [
            {"sku": "sku-1", "qty": 2, "price": 9.5},
            {"sku": "sku-2", "qty": 1, "price": 19.0},
            {"sku": "sku-3", "qty": 5, "price": 1.25},
        ],
        "note": "leave at the door",
    }
).encode()


@dataclasses.dataclass
class DLine:
    sku: str
    qty: int
    price: float


@dataclasses.dataclass
class DOrder:
    order_id: int
    customer: str
    lines: list[DLine]
    note: str | None = None


class PLine(pydantic.BaseModel):
    sku: str
    qty: int
    price: float


class POrder(pydantic.BaseModel):
    order_id: int
    customer: str
    lines: list[PLine]
    note: str | None = None


class MLine(msgspec.Struct):
    sku: str
    qty: int
    price: float


class MOrder(msgspec.Struct):
    order_id: int
    customer: str
    lines: list[MLine]
    note: str | None = None


def decoders() -> dict[str, Callable[[Message], Any]]:
    from mqdedup.consumers.bodies import decoder_for

    kinds: dict[str, Callable[[Message], Any]] = {"message.json()": Message.json}
    for label, model in (("dataclass", DOrder), ("pydantic", POrder), ("msgspec", MOrder)):
        decode = decoder_for(model)
        assert decode is not None
        kinds[label] = decode
    return kinds


def time_per_message(function: Callable[[Any], Any], argument: Any, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        function(argument)
    return (time.perf_counter() - started) / count


class Raw(Consumer):
    name = "bench-raw"

    def handle(self, message: Message, ctx: Any) -> Any:
        return None


def handlers_call_cost(count: int) -> float:
    from mqdedup.consumers.handling import Handlers

    handlers = Handlers(Raw(), Metrics())
    delivery = Delivery(Message(body=BODY, id="m-1"), 0)
    call = handlers.call
    started = time.perf_counter()
    for _ in range(count):
        call(None, delivery)
    return (time.perf_counter() - started) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=50_000, help="messages per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pipeline-only", action="store_true", help="only Handlers.call")
    args = parser.parse_args()
    message = Message(body=BODY, id="m-1", headers={"content-type": b"application/json"})
    print(f"body: {len(BODY)} bytes; {args.count:,} messages x {args.rounds} rounds (medians)")
    if not args.pipeline_only:
        kinds = decoders()
        rounds: dict[str, list[float]] = {label: [] for label in kinds}
        for _ in range(args.rounds):
            for label, decode in kinds.items():  # interleaved: load drift hits all alike
                rounds[label].append(time_per_message(decode, message, args.count))
        base = statistics.median(rounds["message.json()"])
        print(f"{'kind':<16} {'µs/message':>11} {'messages/s':>12} {'x json()':>9}")
        for label, seconds in rounds.items():
            median = statistics.median(seconds)
            print(f"{label:<16} {median * 1e6:>11.2f} {1 / median:>12,.0f} {median / base:>9.2f}")
    costs = [handlers_call_cost(args.count) for _ in range(args.rounds)]
    print(
        f"Handlers.call, unannotated handler doing nothing: "
        f"{statistics.median(costs) * 1e6:.3f} µs/message (median of {args.rounds})"
    )


if __name__ == "__main__":
    main()

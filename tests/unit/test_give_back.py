"""Transport.give_back: unsettled deliveries go back to the source and come again.

The in-memory transport puts them back at the front of the queue, in order, marked
redelivered; the Worker gives back what a batch left unsettled (a dead-letter publish
that failed) and backs off while that is all a batch does.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine

from mqdedup import InMemoryBroker, RetryPolicy, StopToken, Worker
from mqdedup.consumers.memory import MemoryTransport
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.errors import BrokerUnavailableError
from tests.services import wait_for
from tests.support import OrderConsumer, order_counts

FAST = RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.01)


def publish(broker: InMemoryBroker, count: int) -> None:
    for number in range(count):
        broker.publish("orders", json.dumps({"order": number}), message_id=f"m{number}")


def ids(deliveries: Sequence[Delivery[Any]]) -> list[str | None]:
    return [d.message.header("message-id") for d in deliveries]


class FlakyDeadLetters(MemoryTransport):
    """The dead-letter target is down for the first ``outages`` publishes."""

    outages = 1

    def __init__(self, broker: InMemoryBroker, queue: str) -> None:
        super().__init__(broker, queue)
        self.given_back: list[list[str | None]] = []
        self.given_back_at: list[float] = []  # time.monotonic() of each give_back

    def dead_letter(self, delivery: Delivery[int], record: DeadLetter) -> None:
        if self.outages > 0:
            self.outages -= 1
            raise BrokerUnavailableError("the dead-letter queue is unreachable")
        super().dead_letter(delivery, record)

    def give_back(self, deliveries: Sequence[Delivery[int]]) -> None:
        self.given_back.append(ids(deliveries))
        self.given_back_at.append(time.monotonic())
        super().give_back(deliveries)


class Orders(OrderConsumer):
    retry_policy = FAST
    fail_ids = frozenset({"m2"})


def test_memory_give_back_returns_deliveries_to_the_front_in_order_marked_redelivered() -> None:
    broker = InMemoryBroker()
    publish(broker, 5)
    transport = broker.transport("orders")
    first = transport.fetch(3, 0)
    transport.settle(first[:1])
    transport.give_back([first[2], first[1]])
    transport.give_back([first[0], first[1]])  # settled / given back already: ignored
    assert transport.in_flight == 0
    assert broker.pending("orders") == 4

    again = transport.fetch(10, 0)
    assert ids(again) == ["m1", "m2", "m3", "m4"]
    assert [d.message.redelivered for d in again] == [True, True, False, False]
    assert [d.message.attempt for d in again[:2]] == [first[1].message.attempt + 1] * 2


def test_the_worker_gives_back_a_batchs_unsettled_rest_and_it_is_processed_once(
    sqlite_engine: Engine,
) -> None:
    broker = InMemoryBroker()
    publish(broker, 5)
    transport = FlakyDeadLetters(broker, "orders")
    Worker(Orders(), transport, sqlite_engine).run(max_batches=2)

    # Batch 1: m2 fails, its dead letter cannot be published -> given back at once.
    # Batch 2: m2 again (redelivered, attempts used up) -> dead-lettered, settled.
    assert transport.given_back == [["m2"]]
    assert [d.message.header("message-id") for d in broker.dead_letters["orders"]] == ["m2"]
    assert broker.settled_count["orders"] == 5
    assert broker.pending("orders") == 0 and transport.in_flight == 0
    assert order_counts(sqlite_engine) == {"m0": 1, "m1": 1, "m3": 1, "m4": 1}


def test_a_batch_that_only_gives_back_backs_off_instead_of_spinning(
    sqlite_engine: Engine,
) -> None:
    broker = InMemoryBroker()
    publish(broker, 3)
    transport = FlakyDeadLetters(broker, "orders")
    transport.outages = 1_000_000  # the dead-letter target stays down
    stop = StopToken()
    worker = Worker(Orders(), transport, sqlite_engine, stop=stop)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    wait_for(lambda: len(transport.given_back) >= 3, 30, "three give-backs")
    stop.request()
    thread.join(10)
    assert not thread.is_alive()
    # Batch 1 made progress (m0, m1): no wait. Then only m2 comes back, each time
    # after a longer back-off (0.5 s, then 1 s); without it this would be thousands of
    # rounds. Lower bounds only: a loaded machine makes the gaps longer, never shorter.
    assert transport.given_back[:3] == [["m2"], ["m2"], ["m2"]]
    _, second, third = transport.given_back_at[:3]
    assert third - second >= 0.45, f"gave back again after {third - second:.3f} s"
    assert order_counts(sqlite_engine) == {"m0": 1, "m1": 1}
    assert broker.pending("orders") == 1  # m2: returned on close, nothing lost

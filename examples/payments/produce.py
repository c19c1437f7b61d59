"""Send payment events to RabbitMQ: ``python -m examples.payments.produce --payments 200``.

For each payment: ``authorized``, then ``captured`` (every 5th payment is ``voided``
instead), and every 3rd captured payment is ``refunded``. Each event has its own AMQP
``message_id``. On top of that:

* ``--duplicates 0.2`` resends 20% of the events with the *same* message id (a
  producer retry): mqdedup's dedup skips them;
* ``--webhook-retries 0.2`` resends 20% of the events with a *new* message id (the
  provider's retry): the state transition reports ``already in target state``, or
  ``rejected`` for a capture that comes back after its refund; nothing is applied twice.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass

import pika

from examples import settings
from examples.payments import config
from examples.payments.setup import declare_queues


@dataclass(frozen=True)
class Event:
    """One payment event and its message id."""

    message_id: str
    body: dict[str, object]


def events(count: int, id_prefix: str) -> list[Event]:
    """The events of ``count`` payments, in order."""
    result: list[Event] = []
    for n in range(count):
        payment_id = f"{id_prefix}-{n}"
        base: dict[str, object] = {"payment_id": payment_id}
        amount = f"{(n % 50) + 10}.00"
        authorized: dict[str, object] = {
            **base,
            "event": "authorized",
            "order_id": f"order-{n}",
            "amount": amount,
        }
        result.append(Event(f"{payment_id}-authorized", authorized))
        if n % 5 == 4:
            result.append(Event(f"{payment_id}-voided", {**base, "event": "voided"}))
            continue
        result.append(Event(f"{payment_id}-captured", {**base, "event": "captured"}))
        if n % 3 == 0:
            result.append(Event(f"{payment_id}-refunded", {**base, "event": "refunded"}))
    return result


def expected(count: int) -> dict[str, int]:
    """Final statuses and ledger entries the events above must lead to."""
    voided = sum(1 for n in range(count) if n % 5 == 4)
    refunded = sum(1 for n in range(count) if n % 5 != 4 and n % 3 == 0)
    return {
        config.VOIDED: voided,
        config.REFUNDED: refunded,
        config.CAPTURED: count - voided - refunded,
        "capture entries": count - voided,
        "refund entries": refunded,
    }


def main(argv: list[str] | None = None) -> None:
    """Publish the events with publisher confirms."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--payments", type=int, default=200)
    parser.add_argument("--duplicates", type=float, default=0.2, help="resent, same id")
    parser.add_argument("--webhook-retries", type=float, default=0.2, help="resent, new id")
    parser.add_argument("--id-prefix", default="pay")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args(argv)
    stream = events(args.payments, args.id_prefix)
    rng = random.Random(args.seed)
    duplicates = rng.sample(stream, int(len(stream) * args.duplicates))
    retries = [
        Event(f"{event.message_id}-retry-{n}", event.body)
        for n, event in enumerate(rng.sample(stream, int(len(stream) * args.webhook_retries)))
    ]
    queue = declare_queues()
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url()))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for event in stream + duplicates + retries:
            channel.basic_publish(
                exchange="",
                routing_key=queue,
                body=json.dumps(event.body).encode(),
                properties=pika.BasicProperties(
                    message_id=event.message_id,
                    content_type="application/json",
                    delivery_mode=2,
                ),
                mandatory=True,
            )
    finally:
        connection.close()
    print(
        f"sent {len(stream) + len(duplicates) + len(retries)} events to {queue}: "
        f"{len(stream)} events of {args.payments} payments, {len(duplicates)} duplicates, "
        f"{len(retries)} webhook retries with new ids"
    )
    print(f"expected: {expected(args.payments)}")


if __name__ == "__main__":
    main()

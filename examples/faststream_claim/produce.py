"""Publish payments with FastStream's publisher, resending some as a retrying producer would.

``python -m examples.faststream_claim.produce [--count 20] [--resend 5]``: ``count``
payments ``pay-0 … pay-<count-1>``, then ``resend`` of them again with the same
``message-id`` header (the id the consumer claims).
"""

from __future__ import annotations

import argparse
import asyncio

from faststream.kafka import KafkaBroker
from faststream.rabbit import RabbitBroker

from examples import settings
from examples.faststream_claim import config


async def publish(count: int, resend: int) -> int:
    """Publish and return how many messages were sent."""
    ids = [f"pay-{n}" for n in range(count)] + [f"pay-{n}" for n in range(resend)]
    if config.broker_kind() == "kafka":
        async with KafkaBroker(settings.kafka_bootstrap()) as kafka:
            for message_id in ids:
                body = {"amount": 10 + int(message_id.split("-")[1])}
                await kafka.publish(body, config.topic(), headers={"message-id": message_id})
    else:
        async with RabbitBroker(settings.rabbitmq_url()) as rabbit:
            for message_id in ids:
                body = {"amount": 10 + int(message_id.split("-")[1])}
                await rabbit.publish(body, config.queue(), headers={"message-id": message_id})
    return len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--resend", type=int, default=5)
    args = parser.parse_args()
    sent = asyncio.run(publish(args.count, args.resend))
    print(f"published {sent} messages ({args.count} payments, {args.resend} resent)")


if __name__ == "__main__":
    main()

"""A FastStream subscriber made effectively-once with ``mqdedup.async_claim``.

Run it with ``python -m examples.faststream_claim.app`` (or ``faststream run
examples.faststream_claim.app:app``); ``CLAIM_BROKER`` picks Kafka (default) or
RabbitMQ. The subscriber stays a FastStream subscriber: the only changes are the
claim, first in the handler's own transaction, and acking after the commit
(``AckPolicy.NACK_ON_ERROR``; on Kafka FastStream's default ``ACK_FIRST`` commits the
offset *before* the handler runs, so a crash would lose the message).
"""

from __future__ import annotations

import logging
from typing import Any

from faststream import AckPolicy, Context, FastStream
from faststream.kafka import KafkaBroker
from faststream.message import StreamMessage
from faststream.rabbit import RabbitBroker, RabbitQueue
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession

from examples import settings
from examples.faststream_claim import config
from mqdedup import async_claim, create_async_engine

log = logging.getLogger("examples.claim")
engine = create_async_engine(settings.database_url())
payments = config.payments_table()


async def on_payment(
    body: dict[str, Any],
    message: StreamMessage[Any] = Context(),  # noqa: B008
) -> None:
    """Charge once per message id, however often the broker delivers it."""
    # The id the producer set (examples/faststream_claim/produce.py): a header.
    message_id = message.headers.get("message-id") or message.correlation_id
    async with AsyncSession(engine) as session, session.begin():
        claimed = await async_claim(
            session, message_id, consumer=config.consumer_name(), prefix=settings.mqdedup_prefix()
        )
        if claimed.is_duplicate:
            log.info("duplicate %s: first run stored %s", message_id, claimed.stored_result)
            return
        await session.execute(insert(payments).values(message_id=message_id, amount=body["amount"]))
        await claimed.store_result({"charged": body["amount"]})
    # Committed; FastStream acks when this function returns. A crash here redelivers
    # the message, and its claim makes the redelivery a duplicate.
    config.crash_point(message_id)
    log.info("processed %s", message_id)


def build() -> FastStream:
    """The app on the broker ``CLAIM_BROKER`` names."""
    broker: KafkaBroker | RabbitBroker
    if config.broker_kind() == "kafka":
        broker = KafkaBroker(settings.kafka_bootstrap())
        timeout = config.session_timeout_ms()
        broker.subscriber(
            config.topic(),
            group_id=config.group(),
            auto_offset_reset="earliest",
            session_timeout_ms=timeout,
            heartbeat_interval_ms=min(3000, timeout // 3),
            ack_policy=AckPolicy.NACK_ON_ERROR,
        )(on_payment)
    else:
        broker = RabbitBroker(settings.rabbitmq_url())
        broker.subscriber(
            RabbitQueue(config.queue(), durable=True), ack_policy=AckPolicy.NACK_ON_ERROR
        )(on_payment)
    application = FastStream(broker)
    application.after_shutdown(engine.dispose)
    return application


app = build()

if __name__ == "__main__":
    import asyncio

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(app.run())

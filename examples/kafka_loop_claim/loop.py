"""A hand-written kafka-python loop made effectively-once with ``mqdedup.claim``.

``python -m examples.kafka_loop_claim.loop`` consumes the same topic as the FastStream
example (:mod:`examples.faststream_claim.config`; produce with
``python -m examples.faststream_claim.produce``). The loop stays the team's loop: one
transaction per record, the claim first in it, and the offsets committed after the
transactions (``enable_auto_commit=False``). A crash between the two redelivers the
batch; each record whose transaction committed finds its claim and is skipped.
SIGTERM / Ctrl-C ends it after the current batch.
"""

from __future__ import annotations

import json
import logging
import signal
import threading

from kafka import KafkaConsumer
from sqlalchemy import insert
from sqlalchemy.orm import Session

from examples import settings
from examples.faststream_claim import config
from mqdedup import claim


def run(stop: threading.Event) -> None:
    """Poll, handle each record in its own transaction, then commit the offsets."""
    log = logging.getLogger("examples.claim")
    engine = settings.engine()
    payments = config.payments_table()
    timeout = config.session_timeout_ms()
    consumer = KafkaConsumer(
        config.topic(),
        bootstrap_servers=settings.kafka_bootstrap(),
        group_id=config.group(),
        enable_auto_commit=False,  # offsets are committed after the database commit
        auto_offset_reset="earliest",
        session_timeout_ms=timeout,
        heartbeat_interval_ms=min(3000, timeout // 3),
    )
    try:
        while not stop.is_set():
            batches = consumer.poll(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    headers = {key: value for key, value in record.headers or []}
                    message_id = headers.get("message-id", b"").decode()
                    body = json.loads(record.value)
                    with Session(engine) as session, session.begin():
                        claimed = claim(
                            session,
                            message_id,
                            consumer=config.consumer_name(),
                            prefix=settings.mqdedup_prefix(),
                        )
                        if claimed.is_duplicate:
                            log.info(
                                "duplicate %s: first run stored %s",
                                message_id,
                                claimed.stored_result,
                            )
                            continue
                        session.execute(
                            insert(payments).values(message_id=message_id, amount=body["amount"])
                        )
                        claimed.store_result({"charged": body["amount"]})
                    config.crash_point(message_id)  # committed, offset not yet: tests only
                    log.info("processed %s", message_id)
            if batches:
                consumer.commit()  # after every transaction of the batch committed
    finally:
        consumer.close()
        engine.dispose()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    run(stop)


if __name__ == "__main__":
    main()

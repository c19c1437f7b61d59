"""A worker process consuming what FastStream producers publish (no ``message-id``):
``python -m tests.integration.faststream_worker``.

The consumer takes its message id from FastStream's ``correlation_id``
(:func:`mqdedup.ids.from_correlation_id`) and its body as a typed dataclass. Configured
by ``FS_SPEC`` (JSON: broker ``kafka`` / ``rabbitmq``, topic or queue, group, prefix,
bootstrap or url, ``hold_file``); the database by ``MQDEDUP_TEST_DATABASE_URL``. With a
``hold_file``, the process writes its pid there after its first commit, before the
broker is settled (offset commit / ack), and waits there to be killed with SIGKILL.
Duplicates it skips are appended to ``duplicates_file``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from sqlalchemy import insert

from mqdedup import Consumer, Context, Message, ids
from mqdedup.db import create_engine
from mqdedup.kafka import KafkaConsumer
from mqdedup.logs import configure
from mqdedup.rabbitmq import RabbitMQConsumer
from mqdedup.stopping import ImmediateStop, StopToken, graceful_signals
from tests.integration.kafka.consumers import FAST_GROUP
from tests.support import orders_table


@dataclasses.dataclass
class Order:
    order: int
    amount: int


class FastStreamOrders(Consumer):
    """One row per order; the message id is FastStream's correlation_id."""

    message_id_strategy = ids.from_correlation_id()
    batch_size = 20
    poll_timeout = 0.2
    prefix: ClassVar[str] = ""
    hold_file: ClassVar[str | None] = None
    duplicates_file: ClassVar[str | None] = None
    _commits = 0

    def handle(self, order: Order, ctx: Context) -> Any:
        ctx.session.execute(
            insert(orders_table(self.prefix)).values(
                message_id=ctx.message.id, body=json.dumps(dataclasses.asdict(order))
            )
        )
        return None

    def on_duplicate(self, message: Message, stored_result: Any) -> None:
        if self.duplicates_file:
            with open(self.duplicates_file, "a", encoding="utf-8") as out:
                out.write(f"{message.id}\n")

    def after_commit(self, messages: Sequence[Message]) -> None:
        self._commits += 1
        if self.hold_file and self._commits == 1:
            Path(self.hold_file).write_text(str(os.getpid()))
            time.sleep(120)  # committed, not yet settled: the test kills us here


def consumer_class(spec: dict[str, Any]) -> type[Consumer]:
    common = {
        "prefix": spec["prefix"],
        "table_prefix": spec["prefix"],
        "hold_file": spec.get("hold_file"),
        "duplicates_file": spec.get("duplicates_file"),
    }
    if spec["broker"] == "kafka":
        return type(
            "FastStreamKafkaOrders",
            (FastStreamOrders, KafkaConsumer),
            {
                **common,
                "topics": (spec["topic"],),
                "group_id": spec["group"],
                "bootstrap_servers": spec["bootstrap"],
                "kafka_config": FAST_GROUP,
            },
        )
    return type(
        "FastStreamRabbitOrders",
        (FastStreamOrders, RabbitMQConsumer),
        {**common, "queue": spec["queue"], "url": spec["url"]},
    )


def main() -> int:
    configure("INFO")
    spec = json.loads(os.environ["FS_SPEC"])
    engine = create_engine(os.environ["MQDEDUP_TEST_DATABASE_URL"])
    stop = StopToken()
    try:
        with graceful_signals(stop):
            consumer_class(spec)().run(engine, stop=stop)
    except ImmediateStop:
        return 130
    finally:
        engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())

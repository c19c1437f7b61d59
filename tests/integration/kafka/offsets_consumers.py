"""A consumer with its offsets in the database, for the fault tests of issue 44.

``tests/integration/kafka/test_kafka_offsets_in_database_faults.py`` runs it in real
processes: ``mqdedup worker tests.integration.kafka.offsets_consumers:OffsetsOrders`` (a
supervisor and its worker children) or ``python -m tests.integration.kafka.offsets_consumers``
(one bare worker, ``consumer.run`` under ``graceful_signals`` as the CLI does). The test's
names travel as JSON in ``OFFSETS_TEST_SPEC`` (read at import).

The message id is the record's coordinates (``topic/partition/offset``): with offsets in
the database no claim is written, so only the offset rows (and their fencing) stand
between a redelivered record and a second effect. The business row is keyed by the
producer's ``message-id`` header instead, so the test counts effects per message.

Hold points (a file protocol, one process at a time): the test creates
``<control>/arm-<point>``; the first process to reach ``<point>`` renames it to
``<control>/held-<pid>`` (a rename succeeds for exactly one) and waits there, to be
killed (SIGKILL) or paused (SIGSTOP), until ``<control>/go`` exists (it then removes
``go``: one release per hold). Points:
``handler`` (inside a handler, after its insert, the transaction open) and
``after_commit`` (the batch's transaction committed, its broker offsets not yet).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from sqlalchemy import insert

from mqdedup import Context, Message, RetryPolicy
from mqdedup.dedup.ids import from_coordinates
from mqdedup.kafka import KafkaConsumer
from tests.support import orders_table

SPEC_ENV = "OFFSETS_TEST_SPEC"
_SPEC: dict[str, Any] = json.loads(os.environ.get(SPEC_ENV) or "{}")
#: How long a held process waits for ``go`` at most (it is killed or let go long before).
HOLD_LIMIT = 120.0


def hold(control: str, point: str) -> None:
    """Wait at ``point`` if the test armed it and this process took it (see the module)."""
    if not control:
        return
    armed = os.path.join(control, f"arm-{point}")
    if not os.path.exists(armed):
        return
    try:
        os.rename(armed, os.path.join(control, f"held-{os.getpid()}"))
    except FileNotFoundError:  # another process took it first
        return
    go = os.path.join(control, "go")
    deadline = time.monotonic() + HOLD_LIMIT
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(go)  # let go once: the test sees it taken


def producer_id(message: Message) -> str:
    """The producer's ``message-id`` header: what the test counts effects by."""
    value = message.headers.get("message-id")
    return value.decode() if isinstance(value, bytes) else str(value)


class OffsetsOrders(KafkaConsumer):
    """One business row per message, offsets in the database, coordinate ids."""

    __test__ = False  # not a pytest class
    offsets_in_database: ClassVar[bool] = True
    message_id_strategy = from_coordinates
    topics = (_SPEC.get("topic", "offsets-orders"),)
    group_id = _SPEC.get("group", "offsets-group")
    table_prefix = _SPEC.get("prefix", "offsets_")
    bootstrap_servers = _SPEC.get("bootstrap", "localhost:9092")
    batch_size = int(_SPEC.get("batch_size", 20))
    poll_timeout = 0.2
    # New partitions (the topic grows mid-run) show within a second.
    metadata_refresh = 1.0
    kafka_config: ClassVar[dict[str, Any]] = {
        "session_timeout_ms": int(_SPEC.get("session_timeout_ms", 6000)),
        "heartbeat_interval_ms": int(_SPEC.get("heartbeat_interval_ms", 1000)),
        **{key: _SPEC[key] for key in ("max_poll_interval_ms",) if key in _SPEC},
    }
    retry_policy = RetryPolicy(
        max_attempts=int(_SPEC.get("max_attempts", 3)), initial_backoff=0.05, max_backoff=0.2
    )
    metrics_interval = 2.0
    control: ClassVar[str] = _SPEC.get("control", "")
    delay: ClassVar[float] = float(_SPEC.get("delay", 0.0))

    def handle(self, message: Message, ctx: Context) -> Any:
        ctx.session.execute(
            insert(orders_table(self.table_prefix)).values(
                message_id=producer_id(message),
                body=message.coordinates[:255],
                worker=str(os.getpid()),
            )
        )
        hold(self.control, "handler")
        return None

    def after_commit(self, messages: Sequence[Message]) -> None:
        hold(self.control, "after_commit")
        if self.delay:
            time.sleep(self.delay)


def main() -> int:
    """One bare worker: ``consumer.run(engine, stop=...)`` under ``graceful_signals``."""
    from mqdedup.db import create_engine
    from mqdedup.logs import configure
    from mqdedup.stopping import ImmediateStop, StopToken, graceful_signals

    configure("INFO")
    logging.getLogger("kafka").setLevel("WARNING")
    engine = create_engine(os.environ["MQDEDUP_DATABASE_URL"])
    stop = StopToken()
    try:
        with graceful_signals(stop):
            OffsetsOrders().run(engine, stop=stop)
    except ImmediateStop:
        return 130
    finally:
        engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Test consumers for the Kafka integration tests, configurable per test.

They live in a module (not in the test files) so that the worker subprocess script can
build the same classes from its command line.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from sqlalchemy import insert

from mqdedup import Context, Message, RetryPolicy
from mqdedup.consumers.context import BatchContext
from mqdedup.kafka import KafkaConsumer
from tests.services import KAFKA_SESSION_TIMEOUT_ENV
from tests.support import orders_table

#: Fast failure detection for tests (the broker's minimum session timeout is 6 s).
FAST_GROUP = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}


def kill_group() -> dict[str, int]:
    """:data:`FAST_GROUP` with the session timeout that a test killing workers hands its
    worker processes in ``MQDEDUP_TEST_KAFKA_SESSION_TIMEOUT_MS``
    (:func:`tests.services.kill_session_timeout_ms`); :data:`FAST_GROUP` without it."""
    session = os.environ.get(KAFKA_SESSION_TIMEOUT_ENV)
    return {**FAST_GROUP, "session_timeout_ms": int(session)} if session else dict(FAST_GROUP)


class TestOrders(KafkaConsumer):
    """Writes one row per message; ``fail_ids`` always fail; ``delay`` slows each batch."""

    __test__ = False  # not a pytest class
    business_prefix: ClassVar[str] = ""
    fail_ids: ClassVar[frozenset[str]] = frozenset()
    delay: ClassVar[float] = 0.0
    worker_label: ClassVar[str] = ""
    #: A file touched (with the batch number) after the ``hold_at``-th commit, before the
    #: offsets are committed; the worker then sleeps ``hold_for`` s (to be killed there).
    hold_file: ClassVar[str | None] = None
    hold_at: ClassVar[int] = 0
    hold_for: ClassVar[float] = 0.0

    def __init__(self) -> None:
        self._commits = 0

    def _row(self, message: Message) -> dict[str, Any]:
        return {
            "message_id": message.id,
            "body": message.body.decode("utf-8", "replace")[:255],
            "worker": self.worker_label,
        }

    def handle(self, message: Message, ctx: Context) -> Any:
        if message.id in self.fail_ids:
            raise ValueError(f"cannot handle {message.id}")
        ctx.session.execute(insert(orders_table(self.business_prefix)).values(self._row(message)))
        return None

    def after_commit(self, messages: Sequence[Message]) -> None:
        self._commits += 1
        if self.delay:
            time.sleep(self.delay)
        if self.hold_file and self._commits == self.hold_at:
            Path(self.hold_file).write_text(str(self._commits))
            time.sleep(self.hold_for)


class BulkTestOrders(TestOrders):
    """The same effects through one INSERT per batch."""

    __test__ = False

    def handle_batch(self, messages: Sequence[Message], ctx: BatchContext) -> Mapping[str, Any]:
        if any(m.id in self.fail_ids for m in messages):
            raise ValueError("a message of this batch cannot be handled")
        ctx.session.execute(
            insert(orders_table(self.business_prefix)), [self._row(m) for m in messages]
        )
        return {}


class StagedTestOrders(TestOrders):
    """The same effects through ``ctx.stage``: set-based once per batch."""

    __test__ = False

    def handle(self, message: Message, ctx: Context) -> Any:
        if message.id in self.fail_ids:
            raise ValueError(f"cannot handle {message.id}")
        ctx.stage(orders_table(self.business_prefix), self._row(message))
        return None


def make_consumer(
    *,
    topic: str,
    group: str,
    prefix: str,
    bootstrap: str,
    bulk: bool = True,
    staged: bool = False,
    batch_size: int = 200,
    kafka_config: Mapping[str, Any] | None = None,
    **attributes: Any,
) -> type[TestOrders]:
    """A consumer class bound to one test's topic, group and table prefix (``staged``: a
    per-message handler writing with ``ctx.stage``)."""
    base = StagedTestOrders if staged else BulkTestOrders if bulk else TestOrders
    settings: dict[str, Any] = {
        "topics": [topic],
        "group_id": group,
        "table_prefix": prefix,
        "business_prefix": prefix,
        "bootstrap_servers": bootstrap,
        "batch_size": batch_size,
        "poll_timeout": 0.2,
        "kafka_config": {**FAST_GROUP, **(kafka_config or {})},
        "retry_policy": RetryPolicy(max_attempts=3, initial_backoff=0.05, max_backoff=0.2),
        "metrics_interval": 5.0,
    }
    assignor = attributes.pop("assignor", None)
    if assignor == "cooperative-sticky":  # JSON specs cannot carry the class itself
        from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor

        settings["kafka_config"]["partition_assignment_strategy"] = [CooperativeStickyAssignor]
    elif assignor is not None:
        raise ValueError(f"unknown assignor {assignor!r}")
    settings.update(attributes)
    return type(f"Orders_{group.replace('-', '_')}", (base,), settings)


def consumer_from_env() -> type[TestOrders]:
    """The consumer class described by ``MQDEDUP_TEST_CONSUMER`` (JSON), for workers."""
    spec = json.loads(os.environ["MQDEDUP_TEST_CONSUMER"])
    if "fail_ids" in spec:
        spec["fail_ids"] = frozenset(spec["fail_ids"])
    return make_consumer(**spec)

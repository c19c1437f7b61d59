"""Consumers for tests/acceptance/test_cli_table_prefix.py (configured by ``PREFIX_*``).

``PrefixOrders`` sets no ``table_prefix``: the CLI's ``--table-prefix`` /
``MQDEDUP_TABLE_PREFIX`` / TOML decides its tables. ``PinnedOrders`` sets its own.
"""

from __future__ import annotations

import os
from typing import Any

from mqdedup import Context, Message
from mqdedup.kafka import KafkaConsumer
from tests.integration.kafka.consumers import FAST_GROUP


class PrefixOrders(KafkaConsumer):
    """Claims each message and writes one outbox row to ``PREFIX_OUT_TOPIC``."""

    __test__ = False
    topics = (os.environ.get("PREFIX_TOPIC", "prefix-orders"),)
    group_id = os.environ.get("PREFIX_GROUP", "prefix-group")
    batch_size = 50
    poll_timeout = 0.2
    kafka_config = FAST_GROUP

    def handle(self, message: Message, ctx: Context) -> Any:
        ctx.outbox.publish({"seen": message.id}, topic=os.environ.get("PREFIX_OUT_TOPIC", "out"))
        return None


class PinnedOrders(PrefixOrders):
    """The same consumer with a table prefix of its own."""

    __test__ = False
    table_prefix = "pinned_"

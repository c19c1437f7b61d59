"""A Kafka consumer for ``mqdedup worker`` CLI tests, described by ``MQDEDUP_TEST_CONSUMER``.

The supervisor imports ``tests.integration.kafka.cli_consumer:CliOrders`` in each worker
process; the class is built from the JSON spec (see ``consumers.make_consumer``).
"""

from __future__ import annotations

import os

from tests.integration.kafka.consumers import TestOrders, consumer_from_env

CliOrders: type[TestOrders] = (
    consumer_from_env() if os.environ.get("MQDEDUP_TEST_CONSUMER") else TestOrders
)

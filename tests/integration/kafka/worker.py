"""A Kafka worker process for the fault tests: ``python -m tests.integration.kafka.worker``.

The consumer is described by ``MQDEDUP_TEST_CONSUMER`` (JSON, see
``consumers.consumer_from_env``); the database by ``MQDEDUP_TEST_DATABASE_URL``. On a
graceful stop (SIGTERM/SIGINT) it writes its metrics as JSON to ``MQDEDUP_TEST_METRICS``.
It is exactly what ``mqdedup worker`` does: ``consumer.run(engine, stop=...)`` under
``graceful_signals``.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from mqdedup.db import create_engine
from mqdedup.logs import configure
from mqdedup.stopping import ImmediateStop, StopToken, graceful_signals
from tests.integration.kafka.consumers import consumer_from_env


def main() -> int:
    configure("INFO")
    logging.getLogger("kafka").setLevel(os.environ.get("MQDEDUP_TEST_KAFKA_LOG", "WARNING"))
    engine = create_engine(os.environ["MQDEDUP_TEST_DATABASE_URL"])
    consumer = consumer_from_env()()
    stop = StopToken()
    try:
        with graceful_signals(stop):
            metrics = consumer.run(engine, stop=stop)
    except ImmediateStop:
        return 130
    finally:
        engine.dispose()
    output = os.environ.get("MQDEDUP_TEST_METRICS")
    if output:
        with open(output, "w") as handle:
            json.dump(metrics.snapshot(), handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())

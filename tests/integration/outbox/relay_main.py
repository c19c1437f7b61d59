"""A relay in its own process for the fault tests.

Run as ``python -m tests.integration.outbox.relay_main <json>``.

One JSON argument: ``database_url``, ``prefix``, ``kafka`` (bootstrap) and/or ``rabbitmq``
(URL), and optional relay settings (``batch_size``, ``lease``, ``shards``,
``rebalance_interval``, ``poll_interval``, ``coordination``, ``broker_backoff_max``) and
``control_database_url``. ``hold_batch``: after
publishing its n-th batch and *before* marking it, the relay prints ``UNMARKED <rows>``
and waits to be killed (the most dangerous moment: published, not marked).
``batch_pause``: seconds to sleep before marking each batch, so that a test killing the
relay "at a random moment" finds work left even on a fast, idle machine.

It runs ``Relay.run`` under graceful signal handling (what ``mqdedup relay`` will do),
prints ``STARTED`` first and ``METRICS <json>`` after a graceful stop.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from mqdedup.db import create_engine
from mqdedup.outbox import Relay, RelayConfig
from mqdedup.outbox.publishers import Publisher
from mqdedup.outbox.relay_publishing import CycleReport

SETTINGS = ("batch_size", "lease", "shards", "rebalance_interval", "poll_interval", "coordination")


def main() -> int:
    config: dict[str, Any] = json.loads(sys.argv[1])
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s"
    )
    publishers: dict[str, Publisher] = {}
    if config.get("kafka"):
        from mqdedup.kafka import KafkaPublisher

        publishers["kafka"] = KafkaPublisher(config["kafka"])
    if config.get("rabbitmq"):
        from mqdedup.rabbitmq import RabbitMQPublisher

        publishers["rabbitmq"] = RabbitMQPublisher(config["rabbitmq"])
    settings = {name: config[name] for name in SETTINGS if name in config}
    relay_config = RelayConfig(broker_backoff_max=config.get("broker_backoff_max", 1.0), **settings)
    hold_batch = config.get("hold_batch")
    batch_pause = float(config.get("batch_pause", 0.0))

    class TestRelay(Relay):
        batches_seen = 0

        def _before_mark(self, report: CycleReport) -> None:
            self.batches_seen += 1
            if hold_batch is not None and self.batches_seen == hold_batch:
                print(f"UNMARKED {len(report.published)}", flush=True)
                time.sleep(600)  # killed here by the test
            if batch_pause:
                time.sleep(batch_pause)

    engine = create_engine(config["database_url"])
    control = config.get("control_database_url")
    relay = TestRelay(
        engine,
        publishers,
        prefix=config["prefix"],
        config=relay_config,
        control_engine=create_engine(control) if control else None,
    )
    print("STARTED", flush=True)
    metrics = relay.run(handle_signals=True)
    engine.dispose()
    print("METRICS " + json.dumps(metrics.snapshot()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

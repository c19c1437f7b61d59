"""What a supervised child process runs (see :mod:`mqdedup.cli.supervisor`)."""

from __future__ import annotations

import os
from typing import Any

from mqdedup.cli.supervisor import ChildSpec, MetricsHolder
from mqdedup.gc_tuning import tune_gc
from mqdedup.stopping import StopToken


def run_consumer(spec: ChildSpec, stop: StopToken, metrics: MetricsHolder) -> None:
    """Import the consumer, connect, and consume until the stop token is set."""
    from mqdedup.cli.config import use_table_prefix
    from mqdedup.cli.loading import create_consumer
    from mqdedup.db.engine import check_connection, create_engine

    _export_environment(spec.options)
    consumer = create_consumer(spec.options["consumer"])
    consumer.validate()
    if not consumer.dedup.needs_database:  # claims in Redis: no database to connect to
        tune_gc()
        consumer.run(None, stop=stop, metrics=metrics.source)
        return
    # The supervisor resolved the consumer's table prefix (flag / env / TOML / class).
    use_table_prefix(consumer, spec.options["table_prefix"])
    engine = create_engine(spec.options["database_url"])
    try:
        check_connection(engine)
        if consumer.asynchronous:  # it runs on an AsyncEngine of the same URL: no idle pool
            engine.dispose()
        tune_gc()
        consumer.run(engine, stop=stop, metrics=metrics.source)
    finally:
        engine.dispose()


def run_relay(spec: ChildSpec, stop: StopToken, metrics: MetricsHolder) -> None:
    """Connect and relay committed outbox rows until the stop token is set."""
    from mqdedup.cli.publishers import create_publishers
    from mqdedup.db.engine import check_connection, create_engine
    from mqdedup.outbox.relay import Relay
    from mqdedup.outbox.relay_config import RelayConfig

    options = spec.options
    engine = create_engine(options["database_url"])
    try:
        check_connection(engine)
        publishers = create_publishers(
            kafka_bootstrap=options.get("kafka_bootstrap"), rabbitmq_url=options.get("rabbitmq_url")
        )
        config = RelayConfig(
            batch_size=options["relay_batch_size"],
            poll_interval=options["poll_interval"],
            delete_published=not options.get("relay_keep_published", False),
        )
        relay = Relay(engine, publishers, prefix=options["table_prefix"], config=config)
        metrics.source = relay.metrics
        tune_gc()
        relay.run(stop)
    finally:
        engine.dispose()


def _export_environment(options: dict[str, Any] | Any) -> None:
    """Broker URLs given as flags reach the consumer classes as their env defaults."""
    for key, variable in (
        ("kafka_bootstrap", "MQDEDUP_KAFKA_BOOTSTRAP"),
        ("rabbitmq_url", "MQDEDUP_RABBITMQ_URL"),
        ("redis_url", "MQDEDUP_REDIS_URL"),
    ):
        value = options.get(key)
        if value:
            os.environ[variable] = str(value)

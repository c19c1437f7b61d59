"""What a child process of ``mqdedup worker`` or ``mqdedup relay`` runs (spawned by
:mod:`mqdedup.cli.supervisor`): a consumer until it is stopped, or a relay with the
standard Kafka / RabbitMQ publishers, which this edge builds (:func:`create_publishers`)
because the relay never imports a broker adapter."""

from __future__ import annotations

import os
from typing import Any

from mqdedup.cli.supervisor import ChildSpec, MetricsHolder
from mqdedup.errors import ConfigurationError
from mqdedup.gc_tuning import tune_gc
from mqdedup.outbox.publishers import Publisher
from mqdedup.stopping import StopToken


def run_consumer(spec: ChildSpec, stop: StopToken, metrics: MetricsHolder) -> None:
    """Import the consumer, connect, and consume until the stop token is set."""
    from mqdedup.cli.config import use_table_prefix
    from mqdedup.cli.loading import create_consumer
    from mqdedup.db.engine import check_connection, create_engine

    _export_environment(spec.options)
    # Its slot among the target's processes and its supervisor's pid: a Kafka consumer's
    # static group member id (mqdedup.kafka.membership) stays the same when the supervisor
    # restarts this child, and differs between two supervisors on one host.
    os.environ["MQDEDUP_WORKER_SLOT"] = str(spec.index)
    os.environ["MQDEDUP_WORKER_SUPERVISOR"] = str(os.getppid())
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
    from mqdedup.db.engine import check_connection, create_engine
    from mqdedup.outbox.relay import Relay, RelayConfig

    options = spec.options
    engine = create_engine(options["database_url"])
    control_url = options.get("control_database_url")
    control = create_engine(control_url) if control_url else None
    try:
        check_connection(engine)
        publishers = create_publishers(
            kafka_bootstrap=options.get("kafka_bootstrap"), rabbitmq_url=options.get("rabbitmq_url")
        )
        config = RelayConfig(
            batch_size=options["relay_batch_size"],
            poll_interval=options["poll_interval"],
            delete_published=not options.get("relay_keep_published", False),
            coordination=options.get("relay_coordination") or "session",
        )
        relay = Relay(
            engine,
            publishers,
            prefix=options["table_prefix"],
            config=config,
            control_engine=control,
        )
        metrics.source = relay.metrics
        tune_gc()
        relay.run(stop)
    finally:
        engine.dispose()
        if control is not None:
            control.dispose()


def create_publishers(
    *, kafka_bootstrap: str | None = None, rabbitmq_url: str | None = None
) -> dict[str, Publisher]:
    """The standard publishers for the given brokers (``MQDEDUP_KAFKA_BOOTSTRAP`` and
    ``MQDEDUP_RABBITMQ_URL`` when not given); at least one must be configured."""
    kafka_bootstrap = kafka_bootstrap or os.environ.get("MQDEDUP_KAFKA_BOOTSTRAP")
    rabbitmq_url = rabbitmq_url or os.environ.get("MQDEDUP_RABBITMQ_URL")
    publishers: dict[str, Publisher] = {}
    if kafka_bootstrap:
        from mqdedup.kafka.publisher import KafkaPublisher  # lazy: the kafka extra

        publishers["kafka"] = KafkaPublisher(kafka_bootstrap)
    if rabbitmq_url:
        from mqdedup.rabbitmq.publisher import RabbitMQPublisher  # lazy: the rabbitmq extra

        publishers["rabbitmq"] = RabbitMQPublisher(rabbitmq_url)
    if not publishers:
        raise ConfigurationError(
            "no broker configured for the relay: set MQDEDUP_KAFKA_BOOTSTRAP and/or "
            "MQDEDUP_RABBITMQ_URL"
        )
    return publishers


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

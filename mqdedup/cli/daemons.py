"""Handlers of the long-running sub-commands: worker, relay, and replay."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mqdedup.cli import exitcodes
from mqdedup.cli.admin import connected_engine, require_current_schema
from mqdedup.cli.commands.operations import (
    OutboxGauges,
)
from mqdedup.cli.commands.reachability import check_relay_brokers, wait_for_consumer_broker
from mqdedup.cli.commands.replay import (
    format_replay_report,
    parse_position,
    replay_kafka,
    replay_stream,
    requeue_from_dlq,
)
from mqdedup.cli.loading import create_consumer
from mqdedup.cli.options import consumer_prefix, resolve_settings
from mqdedup.cli.publishers import create_publishers
from mqdedup.cli.runners import _export_environment
from mqdedup.cli.supervisor import ChildSpec, Supervisor
from mqdedup.db.engine import check_connection, create_engine
from mqdedup.errors import (
    ConfigurationError,
)
from mqdedup.stopping import ImmediateStop, StopToken, graceful_signals


def cmd_replay(args: argparse.Namespace) -> int:
    settings = resolve_settings(
        args, "database_url", "table_prefix", "kafka_bootstrap", "rabbitmq_url"
    )
    _export_environment(settings)
    start = parse_position(args.start)
    end = parse_position(args.end, end=True)
    consumer = create_consumer(args.consumer)
    consumer_prefix(args, args.consumer, consumer)
    consumer.validate()
    engine, _ = connected_engine(args, require_schema=False)
    require_current_schema(engine, consumer.table_prefix)
    kind = consumer.broker
    if args.from_dlq:
        if kind != "rabbitmq":
            raise ConfigurationError("--from-dlq is for RabbitMQ consumers")
        _connect_broker(consumer)
        print(requeue_from_dlq(consumer, engine, args.limit))
        return exitcodes.OK
    if kind is None:
        raise ConfigurationError(
            f"{args.consumer} is neither a KafkaConsumer nor a RabbitMQConsumer: "
            "replay needs a broker to read from"
        )
    _connect_broker(consumer)
    stop = StopToken()
    try:
        with graceful_signals(stop):
            if kind == "kafka":
                report = replay_kafka(
                    consumer,
                    engine,
                    start=start,
                    end=end,
                    partitions=args.partitions,
                    dry_run=args.dry_run,
                    allow_reprocess=args.allow_reprocess,
                    stop=stop,
                    progress=sys.stderr,
                )
            else:
                report = replay_stream(
                    consumer,
                    engine,
                    start=start,
                    end=end,
                    stream=args.stream,
                    dry_run=args.dry_run,
                    allow_reprocess=args.allow_reprocess,
                    stop=stop,
                )
    except ImmediateStop:
        return exitcodes.INTERRUPTED
    print(format_replay_report(report))
    return exitcodes.OK


def _connect_broker(consumer: Any) -> None:
    """Wait for the consumer's broker up to its start-up timeout, then check it once.

    Kafka and RabbitMQ behave the same: an unreachable broker is awaited (one line says
    so) for ``connect_timeout`` / ``startup_timeout`` seconds, then the command exits
    with BROKER_UNAVAILABLE; a broker that answers but refuses (login, topology) fails
    at once with the consumer's own check.
    """

    wait_for_consumer_broker(consumer, lambda line: print(f"mqdedup: {line}", file=sys.stderr))
    consumer.check_connection()


def cmd_relay(args: argparse.Namespace) -> int:
    settings = resolve_settings(
        args,
        "database_url",
        "table_prefix",
        "kafka_bootstrap",
        "rabbitmq_url",
        "relay_processes",
        "poll_interval",
        "relay_batch_size",
        "relay_keep_published",
        "shutdown_timeout",
        "health_port",
        "health_host",
    )
    if settings["relay_processes"] < 1:
        raise ConfigurationError("--processes must be at least 1")
    engine = create_engine(settings["database_url"])
    check_connection(engine)
    require_current_schema(engine, settings["table_prefix"])
    engine.dispose()
    for publisher in create_publishers(
        kafka_bootstrap=settings["kafka_bootstrap"], rabbitmq_url=settings["rabbitmq_url"]
    ).values():
        publisher.close()  # validates the configuration; connections open lazily
    check_relay_brokers(settings["kafka_bootstrap"], settings["rabbitmq_url"])
    specs = [
        ChildSpec(
            name="relay",
            index=index,
            runner="mqdedup.cli.runners:run_relay",
            options=settings,
            log_level=args.log_level,
            log_format=args.log_format,
        )
        for index in range(settings["relay_processes"])
    ]
    return _supervise(specs, settings)


def _supervise(
    specs: list[Any],
    settings: dict[str, Any],
    *,
    outbox_gauges: bool = True,
    prefix: str | None = None,
) -> int:
    """Run ``specs`` under a supervisor with the health endpoint; return its exit code.

    ``outbox_gauges``: report the outbox backlog on /metrics (not for Redis-only workers,
    which have no database). ``prefix``: the outbox's table prefix (default: the setting).
    """

    gauges = OutboxGauges(settings["database_url"], prefix or settings["table_prefix"])
    supervisor = Supervisor(
        specs,
        shutdown_timeout=settings["shutdown_timeout"],
        health_port=settings["health_port"],
        health_host=settings["health_host"],
        shared_metrics=gauges if outbox_gauges else None,
    )
    return supervisor.run()


def cmd_worker(args: argparse.Namespace) -> int:
    settings = resolve_settings(
        args,
        "database_url",
        "table_prefix",
        "kafka_bootstrap",
        "rabbitmq_url",
        "redis_url",
        "processes",
        "shutdown_timeout",
        "health_port",
        "health_host",
    )
    if settings["processes"] < 1:
        raise ConfigurationError("--processes must be at least 1")
    _export_environment(settings)
    consumers = [create_consumer(reference) for reference in args.consumers]
    # Consumers whose claims live outside the database (RedisDedup) need none.
    database_consumers = [c for c in consumers if c.dedup.needs_database]
    prefixes = {
        reference: consumer_prefix(args, reference, consumer)
        for reference, consumer in zip(args.consumers, consumers, strict=True)
        if consumer.dedup.needs_database
    }
    for consumer in consumers:
        consumer.validate()
        consumer.dedup.check()  # e.g. Redis unreachable: one line, exit code 5
    if database_consumers:
        engine = create_engine(settings["database_url"])
        check_connection(engine)
        for database_consumer in database_consumers:
            require_current_schema(engine, database_consumer.table_prefix)
        engine.dispose()
    for consumer in consumers:
        _connect_broker(consumer)
    specs = [
        ChildSpec(
            name=consumer.consumer_name,
            index=index,
            # What a child runs: ``mqdedup.django`` sets its own (Django's connection).
            runner=getattr(args, "worker_runner", None) or "mqdedup.cli.runners:run_consumer",
            options={
                "consumer": reference,
                **settings,
                "table_prefix": prefixes.get(reference, settings["table_prefix"]),
            },
            log_level=args.log_level,
            log_format=args.log_format,
        )
        for reference, consumer in zip(args.consumers, consumers, strict=True)
        for index in range(settings["processes"])
    ]
    shared = set(prefixes.values())
    return _supervise(
        specs,
        settings,
        outbox_gauges=bool(database_consumers),
        prefix=shared.pop() if len(shared) == 1 else None,
    )

"""``mqdedup console``: serve the operator's web console (:mod:`mqdedup.console`).

It takes the database and broker settings every command takes, and the consumer classes
(``module:Class``) it may replay dead letters through. Bound to anything but loopback it
refuses to start without ``--token`` / ``MQDEDUP_CONSOLE_TOKEN`` or ``--basic-auth`` /
``MQDEDUP_CONSOLE_BASIC_AUTH``; the credentials are never logged or printed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine

from mqdedup.cli import exitcodes
from mqdedup.cli.admin import connected_engine, require_current_schema
from mqdedup.cli.config import consumer_prefix, resolve_settings
from mqdedup.cli.loading import create_consumer
from mqdedup.cli.runners import _export_environment
from mqdedup.cli.status import consumer_lags
from mqdedup.console import ConsoleApp, ConsoleServer, ConsoleSettings
from mqdedup.console.deadletters import DeadLetterService
from mqdedup.console.metrics import MetricsSampler
from mqdedup.console.security import Access, check_binding, parse_basic_auth
from mqdedup.consumers.base import Consumer
from mqdedup.deadletters import DatabaseDeadLetters, DeadLetterPlace, DeadLetterRecord, replay
from mqdedup.errors import ConfigurationError

log = logging.getLogger(__name__)

TOKEN_ENV = "MQDEDUP_CONSOLE_TOKEN"  # noqa: S105 - the variable's name, not a secret
BASIC_AUTH_ENV = "MQDEDUP_CONSOLE_BASIC_AUTH"
DEFAULT_PORT = 8470


def cmd_console(args: argparse.Namespace) -> int:
    settings = resolve_settings(
        args, "database_url", "table_prefix", "kafka_bootstrap", "rabbitmq_url"
    )
    token = args.token or os.environ.get(TOKEN_ENV) or None
    basic = parse_basic_auth(args.basic_auth or os.environ.get(BASIC_AUTH_ENV))
    check_binding(args.host, token, basic)  # before connecting to anything
    if args.body_limit < 1:
        raise ConfigurationError(f"--body-limit must be at least 1 byte, not {args.body_limit}")
    if not 0 < args.hours <= 24 * 7:
        raise ConfigurationError(f"--hours must be more than 0 and at most 168, not {args.hours}")
    _export_environment(settings)
    consumers = [create_consumer(reference) for reference in args.consumers]
    prefixes = {
        consumer_prefix(args, reference, consumer)
        for reference, consumer in zip(args.consumers, consumers, strict=True)
    }
    engine, prefix = connected_engine(args, require_schema=False)
    if len(prefixes) == 1:
        prefix = prefixes.pop()
    require_current_schema(engine, prefix)
    sampler = MetricsSampler(args.metrics).start() if args.metrics else None
    app = ConsoleApp(
        ConsoleSettings(
            engine=engine,
            prefix=prefix,
            consumers=consumers,
            access=Access(token=token, basic=basic),
            read_only=args.read_only,
            body_limit=args.body_limit,
            hours=args.hours,
            lags=consumer_lags,
            metrics=sampler,
            dead_letters=DeadLetterService(
                places=dead_letter_places(engine, prefix, settings, consumers),
                replay=replay_through(engine),
            ),
        )
    )
    try:
        server = ConsoleServer(app, args.host, args.port)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot listen on {args.host}:{args.port}: {exc.strerror}"
        ) from None
    where = f"http://{_host_for_url(args.host)}:{server.port}/"
    mode = "read-only" if args.read_only else "actions allowed"
    auth = "token" if token else "basic auth" if basic else "no sign-in (loopback only)"
    print(f"mqdedup console on {where} ({mode}; {auth}); Ctrl-C stops it", flush=True)
    log.info("console listening", extra={"host": args.host, "port": server.port})
    signal.signal(signal.SIGTERM, _interrupt)  # a service manager's stop: exit 0 as on Ctrl-C
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("mqdedup console stopped", file=sys.stderr)
    finally:
        server.stop()
        engine.dispose()
    return exitcodes.OK


def dead_letter_places(
    engine: Engine, prefix: str, settings: dict[str, Any], consumers: Sequence[Consumer]
) -> list[DeadLetterPlace]:
    """The database place, and the Kafka / RabbitMQ places the settings reach."""
    places: list[DeadLetterPlace] = [DatabaseDeadLetters(engine, prefix)]
    places.extend(_broker_places(engine, prefix, settings, consumers))
    return places


def _broker_places(
    engine: Engine, prefix: str, settings: dict[str, Any], consumers: Sequence[Consumer]
) -> list[DeadLetterPlace]:
    """Kafka: the given Kafka consumers' dead-letter topics (none given: every ``.DLT``
    topic of the bootstrap servers). RabbitMQ: the given RabbitMQ consumers' dead-letter
    queues (queues cannot be discovered)."""
    places: list[DeadLetterPlace] = []
    kafka = [c for c in consumers if hasattr(c, "kafka_settings")]
    rabbit = [c for c in consumers if hasattr(c, "topology")]
    if kafka or (settings.get("kafka_bootstrap") and not consumers):
        from mqdedup.kafka.dead_letter_topic import KafkaDeadLetterTopics

        if kafka:
            # One place over every given consumer's dead-letter topics (a pattern
            # consumer, without topics: every .DLT topic).
            first = KafkaDeadLetterTopics.for_consumer(kafka[0], engine)
            wanted: set[str] = set()
            every = False
            for consumer in kafka:
                kafka_settings = consumer.kafka_settings()
                every = every or not kafka_settings.topics
                wanted |= {kafka_settings.dead_letter_topic_for(t) for t in kafka_settings.topics}
            places.append(
                KafkaDeadLetterTopics(
                    first.bootstrap_servers,
                    engine,
                    topics=None if every else sorted(wanted),
                    prefix=prefix,
                )
            )
        else:
            places.append(KafkaDeadLetterTopics(settings["kafka_bootstrap"], engine, prefix=prefix))
    if rabbit:
        from mqdedup.rabbitmq.dead_letter_queue import RabbitDeadLetterQueues

        queues = [c.topology().dead_letter_queue for c in rabbit]
        places.append(
            RabbitDeadLetterQueues(
                rabbit[0].broker_url,  # type: ignore[attr-defined]
                queues,
                engine=engine,
                prefix=prefix,
            )
        )
    return places


def replay_through(engine: Engine) -> Any:
    """The console's replay: dead letters of one place through one consumer's claims."""

    def run(
        consumer: Consumer, place: DeadLetterPlace, records: Sequence[DeadLetterRecord]
    ) -> tuple[int, str]:
        outcome = replay(records, consumer, engine, place)
        return outcome.handed_out, str(outcome)

    return run


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host

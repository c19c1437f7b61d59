"""Can the brokers be reached? TCP-level checks before a command starts, so that an
unreachable broker is awaited up to the consumer's start-up timeout and then reported in
one line."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.masking import mask_url


def check_kafka_reachable(bootstrap: str, timeout: float = 3.0) -> None:
    """Raise BrokerUnavailableError unless one of the bootstrap servers accepts a connection."""
    servers = [s.strip() for s in bootstrap.split(",") if s.strip()]
    if not servers:
        raise ConfigurationError("Kafka bootstrap servers are empty")
    errors = []
    for server in servers:
        # ``SASL_SSL://host:9093`` and ``[::1]:9092`` are valid bootstrap entries too.
        host, _, port = server.rpartition("://")[2].rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit():
            raise ConfigurationError(
                f"Kafka bootstrap server {mask_url(server)!r} must be host:port"
            )
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                return
        except OSError as exc:
            errors.append(f"{mask_url(server)}: {exc.strerror or exc}")
    raise BrokerUnavailableError(f"cannot reach Kafka ({'; '.join(errors)})")


def check_rabbitmq_reachable(url: str, timeout: float = 3.0) -> None:
    """Raise BrokerUnavailableError unless the RabbitMQ URL's host accepts a connection
    (for a cluster's comma-separated node URLs: one of them)."""
    from mqdedup.rabbitmq.topology import split_urls  # lazy: the rabbitmq extra

    errors = []
    for node_url in split_urls(url) or [url]:
        parts = urlsplit(node_url)
        if parts.scheme not in ("amqp", "amqps") or not parts.hostname:
            raise ConfigurationError(
                "RabbitMQ URL must look like amqp://user:password@host:5672/vhost"
            )
        port = parts.port or (5671 if parts.scheme == "amqps" else 5672)
        try:
            with socket.create_connection((parts.hostname, port), timeout=timeout):
                return
        except OSError as exc:
            errors.append(f"{parts.hostname}:{port}: {exc.strerror or exc}")
    raise BrokerUnavailableError(f"cannot reach RabbitMQ at {'; '.join(errors)}")


def consumer_broker(consumer: Any) -> tuple[str, str, float] | None:
    """``(broker, address, start-up timeout)`` of a Kafka or RabbitMQ consumer, else None.

    The timeout is the consumer's own: ``startup_timeout`` (RabbitMQ) or
    ``connect_timeout`` (Kafka), 30 s by default for both.
    """
    kafka_settings = getattr(consumer, "kafka_settings", None)
    if kafka_settings is not None:
        servers = ",".join(kafka_settings().bootstrap_servers)
        return "Kafka", servers, float(getattr(consumer, "connect_timeout", 30.0))
    url = getattr(consumer, "broker_url", None)
    if isinstance(url, str) and hasattr(consumer, "startup_timeout"):
        return "RabbitMQ", url, float(consumer.startup_timeout)
    return None


def check_consumer_broker(consumer: Any, timeout: float = 3.0) -> None:
    """One TCP check of the consumer's broker (nothing to check for other consumers)."""
    broker = consumer_broker(consumer)
    if broker is None:
        return
    kind, address, _ = broker
    check = check_kafka_reachable if kind == "Kafka" else check_rabbitmq_reachable
    check(address, timeout=timeout)


def wait_for_consumer_broker(
    consumer: Any, say: Callable[[str], None] | None = None, *, poll: float = 0.5
) -> None:
    """Wait until the consumer's broker accepts connections, up to its start-up timeout.

    ``say`` gets one line when the first attempt fails, naming what is awaited; after the
    timeout BrokerUnavailableError says how long it waited. Kafka and RabbitMQ workers
    behave the same (docs/running.md, "Start-up: an unreachable broker").
    """
    broker = consumer_broker(consumer)
    if broker is None:
        return
    kind, _, timeout = broker
    deadline = time.monotonic() + timeout
    announced = False
    while True:
        try:
            check_consumer_broker(consumer, timeout=min(3.0, max(timeout, 0.1)))
            return
        except BrokerUnavailableError as exc:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrokerUnavailableError(f"{exc} (waited {timeout:g}s)") from None
            if not announced and say is not None:
                say(f"waiting up to {timeout:g}s for {kind}: {exc}")
                announced = True
            time.sleep(min(poll, remaining))


def connect_broker(consumer: Any) -> None:
    """Wait for the consumer's broker up to its start-up timeout, then check it once.

    Kafka and RabbitMQ behave the same: an unreachable broker is awaited (one line says
    so) for ``connect_timeout`` / ``startup_timeout`` seconds, then the command exits
    with BROKER_UNAVAILABLE; a broker that answers but refuses (login, topology) fails
    at once with the consumer's own check.
    """

    wait_for_consumer_broker(consumer, lambda line: print(f"mqdedup: {line}", file=sys.stderr))
    consumer.check_connection()


def check_relay_brokers(kafka_bootstrap: str | None, rabbitmq_url: str | None) -> list[str]:
    """The configured brokers that answer now; a relay needs only one of them.

    An unreachable broker is reported on stderr (its rows wait: the relay retries it
    with backoff while the other broker's rows flow). Raises BrokerUnavailableError
    only when no configured broker answers.
    """
    checks = {
        "kafka": (kafka_bootstrap, check_kafka_reachable),
        "rabbitmq": (rabbitmq_url, check_rabbitmq_reachable),
    }
    reachable: list[str] = []
    down: list[str] = []
    for name, (target, check) in checks.items():
        if not target:
            continue
        try:
            check(target)
        except BrokerUnavailableError as exc:
            down.append(str(exc))
            continue
        reachable.append(name)
    if not reachable:
        raise BrokerUnavailableError("; ".join(down) or "no broker configured")
    for problem in down:
        print(
            f"mqdedup: warning: {problem}; its outbox rows wait (retried with backoff), "
            f"relaying to {' and '.join(reachable)} meanwhile",
            file=sys.stderr,
        )
    return reachable

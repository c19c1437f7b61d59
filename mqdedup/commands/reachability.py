"""Can the brokers be reached? A TCP-level check for start-up errors in one line."""

from __future__ import annotations

import socket
import sys
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
        host, _, port = server.rpartition(":")
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
    """Raise BrokerUnavailableError unless the RabbitMQ URL's host accepts a connection."""
    parts = urlsplit(url)
    if parts.scheme not in ("amqp", "amqps") or not parts.hostname:
        raise ConfigurationError("RabbitMQ URL must look like amqp://user:password@host:5672/vhost")
    port = parts.port or (5671 if parts.scheme == "amqps" else 5672)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout):
            return
    except OSError as exc:
        raise BrokerUnavailableError(
            f"cannot reach RabbitMQ at {parts.hostname}:{port}: {exc.strerror or exc}"
        ) from exc


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

"""RabbitMQ connection settings and the topology mqdedup declares (queues, DLQ, bindings).

Only RabbitMQ modules import this (it imports ``pika``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import pika
import pika.exceptions

from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.masking import mask_text, mask_url

RABBITMQ_URL_ENV = "MQDEDUP_RABBITMQ_URL"
DEFAULT_RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
DEFAULT_DEAD_LETTER_EXCHANGE = "mqdedup.dead-letter"
QueueType = Literal["classic", "quorum"]
QUEUE_TYPES: tuple[str, ...] = ("classic", "quorum")
EXCHANGE_TYPES: tuple[str, ...] = ("direct", "fanout", "topic", "headers")
MAX_PREFETCH = 65535  # AMQP prefetch-count is a 16-bit field
_MAX_NAME = 255  # AMQP short string


def rabbitmq_url_from_env(default: str = DEFAULT_RABBITMQ_URL) -> str:
    """``MQDEDUP_RABBITMQ_URL``, or a local broker with the guest account."""
    return os.environ.get(RABBITMQ_URL_ENV) or default


def mask_amqp_url(url: str) -> str:
    """``url`` with its secrets replaced by ``***`` (:func:`mqdedup.masking.mask_url`)."""
    return mask_url(url)


def connection_parameters(url: str, connection_name: str) -> pika.URLParameters:
    """Parse an ``amqp://`` / ``amqps://`` URL into pika parameters.

    ``connection_name`` is sent as the ``connection_name`` client property, so operators
    (and tests) can find this connection in ``rabbitmqctl list_connections``.
    Raises :class:`ConfigurationError` with the masked URL when it is malformed.
    """
    masked = mask_amqp_url(url)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("amqp", "amqps"):
        raise ConfigurationError(
            f"RabbitMQ URL {masked!r} must start with amqp:// or amqps:// "
            f"(set it with the consumer's `url` or {RABBITMQ_URL_ENV})"
        )
    try:
        parameters = pika.URLParameters(_with_password(url))
    except (ValueError, TypeError, IndexError) as exc:
        raise ConfigurationError(
            f"malformed RabbitMQ URL {masked!r}: {mask_text(str(exc), url)}"
        ) from None
    properties = dict(parameters.client_properties or {})
    properties["connection_name"] = connection_name
    parameters.client_properties = properties
    # One TCP attempt per connect: mqdedup's own backoff decides when to try again.
    parameters.connection_attempts = 1
    return parameters


def check_broker(url: str, timeout: float = 10.0) -> None:
    """Open one connection to ``url`` and close it; raise a one-line error if that fails."""
    masked = mask_amqp_url(url)
    parameters = connection_parameters(url, f"mqdedup-check:{socket.gethostname()}:{os.getpid()}")
    parameters.socket_timeout = timeout
    parameters.stack_timeout = timeout
    try:
        connection = pika.BlockingConnection(parameters)
    except (
        pika.exceptions.ProbableAuthenticationError,
        pika.exceptions.ProbableAccessDeniedError,
        pika.exceptions.AuthenticationError,
    ) as exc:
        raise ConfigurationError(
            f"RabbitMQ at {masked} refused the login (check the user, password and virtual "
            f"host): {type(exc).__name__}"
        ) from exc
    except (pika.exceptions.AMQPError, OSError) as exc:
        raise BrokerUnavailableError(
            f"cannot connect to RabbitMQ at {masked}: {type(exc).__name__}"
        ) from exc
    connection.close()


def _with_password(url: str) -> str:
    """``amqp://user@host/`` as ``amqp://user:@host/``: a user without a password means an
    empty password (pika itself fails on it with a TypeError about ``None``)."""
    try:
        parts = urlsplit(url)
        has_user_only = parts.username is not None and parts.password is None
    except ValueError:
        return url
    if not has_user_only:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo}:@{host}"))


def default_connection_name(consumer_name: str) -> str:
    """``mqdedup:<consumer>:<host>:<pid>``: unique per worker process."""
    return f"mqdedup:{consumer_name}:{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class Binding:
    """Bind the consumer's queue to ``exchange`` with ``routing_key`` (declared if needed)."""

    exchange: str
    routing_key: str = ""
    exchange_type: str = "direct"
    arguments: Mapping[str, Any] | None = None

    def validate(self, owner: str) -> None:
        """Raise ConfigurationError for a binding that cannot be declared."""
        if not self.exchange:
            raise ConfigurationError(
                f"{owner}: a Binding needs an exchange name (the default exchange "
                "routes by queue name already)"
            )
        if self.exchange_type not in EXCHANGE_TYPES:
            raise ConfigurationError(
                f"{owner}: Binding exchange_type {self.exchange_type!r} is not one of "
                f"{', '.join(EXCHANGE_TYPES)}"
            )


@dataclass(frozen=True)
class Topology:
    """Everything declared for one consumer, on every (re)connect.

    The queue and its dead-letter queue are durable; the dead-letter queue gets the same
    queue type. With ``declare=False`` nothing is created, only checked (passively).
    """

    queue: str
    queue_type: QueueType = "classic"
    queue_arguments: Mapping[str, Any] = field(default_factory=dict)
    bindings: Sequence[Binding] = ()
    dead_letter_exchange: str = DEFAULT_DEAD_LETTER_EXCHANGE
    dead_letter_queue: str = ""
    declare: bool = True
    #: Extra ``x-*`` arguments of the dead-letter queue (e.g. ``x-max-length``).
    dead_letter_arguments: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.dead_letter_queue:
            object.__setattr__(self, "dead_letter_queue", f"{self.queue}.dlq")

    @property
    def dead_letter_routing_key(self) -> str:
        """Routing key of dead-lettered copies (the dead-letter queue's name)."""
        return self.dead_letter_queue

    def validate(self, owner: str) -> None:
        """Raise ConfigurationError (one line, naming the attribute) for unusable settings."""
        if not isinstance(self.queue, str) or not self.queue.strip():
            raise ConfigurationError(f"{owner}.queue must name the RabbitMQ queue to consume")
        if self.queue.startswith("amq."):
            raise ConfigurationError(
                f"{owner}.queue {self.queue!r}: names starting with 'amq.' are reserved"
            )
        for name, value in (("queue", self.queue), ("dead_letter_queue", self.dead_letter_queue)):
            if len(value) > _MAX_NAME:
                raise ConfigurationError(f"{owner}.{name} is longer than {_MAX_NAME} characters")
        if self.dead_letter_queue == self.queue:
            raise ConfigurationError(
                f"{owner}.dead_letter_queue must differ from the consumed queue {self.queue!r}"
            )
        if self.queue_type not in QUEUE_TYPES:
            raise ConfigurationError(
                f"{owner}.queue_type must be 'classic' or 'quorum', not {self.queue_type!r}"
            )
        for name, arguments in (
            ("queue_arguments", self.queue_arguments),
            ("dead_letter_queue_arguments", self.dead_letter_arguments),
        ):
            if not isinstance(arguments, Mapping):
                raise ConfigurationError(f"{owner}.{name} must be a mapping, not {arguments!r}")
            if "x-queue-type" in arguments:
                raise ConfigurationError(
                    f"{owner}.{name} must not set x-queue-type; use queue_type"
                )
        for binding in self.bindings:
            if not isinstance(binding, Binding):
                raise ConfigurationError(
                    f"{owner}.bindings must hold mqdedup Binding objects, not {binding!r}"
                )
            binding.validate(owner)

    def queue_declare_arguments(self) -> dict[str, Any]:
        """Arguments of the consumed queue's declaration."""
        arguments = dict(self.queue_arguments)
        if self.queue_type == "quorum":
            arguments["x-queue-type"] = "quorum"
        return arguments

    def dead_letter_queue_arguments(self) -> dict[str, Any]:
        """Arguments of the dead-letter queue's declaration (same queue type)."""
        arguments = dict(self.dead_letter_arguments)
        if self.queue_type == "quorum":
            arguments["x-queue-type"] = "quorum"
        return arguments


def declare_topology(channel: Any, topology: Topology) -> None:
    """Declare (or, with ``declare=False``, passively check) the queue, DLQ and bindings.

    ``channel`` is a pika ``BlockingChannel``. A mismatch with an existing queue or
    exchange closes the channel (``ChannelClosedByBroker`` 406 / 404); callers turn that
    into a clear error.
    """
    passive = not topology.declare
    channel.queue_declare(
        queue=topology.queue,
        durable=True,
        passive=passive,
        arguments=None if passive else topology.queue_declare_arguments(),
    )
    for binding in topology.bindings:
        channel.exchange_declare(
            exchange=binding.exchange,
            exchange_type=binding.exchange_type,
            durable=True,
            passive=passive,
        )
        if not passive:
            channel.queue_bind(
                queue=topology.queue,
                exchange=binding.exchange,
                routing_key=binding.routing_key,
                arguments=dict(binding.arguments) if binding.arguments else None,
            )
    declare_dead_letter_topology(channel, topology)


def declare_dead_letter_topology(channel: Any, topology: Topology) -> None:
    """Declare (or check) the dead-letter exchange, queue and their binding."""
    passive = not topology.declare
    channel.queue_declare(
        queue=topology.dead_letter_queue,
        durable=True,
        passive=passive,
        arguments=None if passive else topology.dead_letter_queue_arguments(),
    )
    if topology.dead_letter_exchange:
        channel.exchange_declare(
            exchange=topology.dead_letter_exchange,
            exchange_type="direct",
            durable=True,
            passive=passive,
        )
        if not passive:
            channel.queue_bind(
                queue=topology.dead_letter_queue,
                exchange=topology.dead_letter_exchange,
                routing_key=topology.dead_letter_routing_key,
            )


def validate_prefetch(owner: str, prefetch: int) -> int:
    """Return ``prefetch`` when it fits AMQP's prefetch-count, else raise."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int):
        raise ConfigurationError(f"{owner}.prefetch must be an integer, not {prefetch!r}")
    if not 1 <= prefetch <= MAX_PREFETCH:
        raise ConfigurationError(f"{owner}.prefetch must be between 1 and {MAX_PREFETCH}")
    return prefetch

"""RabbitMQ connection settings and the topology mqdedup declares (queues, DLQ, bindings).

Only RabbitMQ modules import this (it imports ``pika``).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import pika
import pika.exceptions

from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.masking import mask_text, mask_url
from mqdedup.rabbitmq.reconnecting import describe

RABBITMQ_URL_ENV = "MQDEDUP_RABBITMQ_URL"
DEFAULT_RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
DEFAULT_DEAD_LETTER_EXCHANGE = "mqdedup.dead-letter"
QueueType = Literal["classic", "quorum"]
#: A quorum queue's broker-side limit of deliveries (then dead-lettered or dropped by the
#: broker): a last resort above the consumer's own retry policy, see docs/rabbitmq.md.
DELIVERY_LIMIT_ARGUMENT = "x-delivery-limit"
QUEUE_TYPES: tuple[str, ...] = ("classic", "quorum")
EXCHANGE_TYPES: tuple[str, ...] = ("direct", "fanout", "topic", "headers")
MAX_PREFETCH = 65535  # AMQP prefetch-count is a 16-bit field
_MAX_NAME = 255  # AMQP short string


#: Where a list of node URLs is split: a comma (and blanks) before the next ``amqp(s)://``,
#: so a comma inside a password never splits a URL.
_URL_LIST_SEPARATOR = re.compile(r"\s*,\s*(?=amqps?://)", re.IGNORECASE)


def split_urls(url: str | Sequence[str]) -> list[str]:
    """The node URLs of ``url``: one ``amqp://`` URL, several joined by commas, or a list.

    A cluster is given as the URLs of its nodes (``amqp://u:p@node1/%2F,amqp://u:p@node2/%2F``);
    connections try them in turn (:class:`BrokerNodes`).
    """
    urls = [url] if isinstance(url, str) else list(url)
    parts = [part for item in urls for part in _URL_LIST_SEPARATOR.split(item.strip())]
    return [part for part in parts if part]


def join_urls(url: str | Sequence[str]) -> str:
    """``url`` as one string (the node URLs joined by commas), as settings carry it."""
    return ",".join(split_urls(url))


def rabbitmq_url_from_env(default: str = DEFAULT_RABBITMQ_URL) -> str:
    """``MQDEDUP_RABBITMQ_URL``, or a local broker with the guest account."""
    return os.environ.get(RABBITMQ_URL_ENV) or default


def mask_amqp_url(url: str) -> str:
    """``url`` with its secrets replaced by ``***`` (:func:`mqdedup.masking.mask_url`)."""
    return ",".join(mask_url(part) for part in split_urls(url)) or mask_url(url)


def connection_parameters(url: str, connection_name: str) -> pika.URLParameters:
    """Parse an ``amqp://`` / ``amqps://`` URL into pika parameters.

    ``connection_name`` is sent as the ``connection_name`` client property, so operators
    (and tests) can find this connection in ``rabbitmqctl list_connections``.
    Raises :class:`ConfigurationError` with the masked URL when it is malformed.
    """
    masked = mask_amqp_url(url)
    if len(split_urls(url)) > 1:
        raise ConfigurationError(
            f"RabbitMQ URL {masked!r} names several nodes; this connection takes one "
            "(node lists are for consumers and publishers: BrokerNodes)"
        )
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


class BrokerNodes:
    """The connection parameters of a broker's nodes (one URL, or a cluster's node URLs).

    :meth:`connect` tries the nodes in turn, starting with the one after the node whose
    connection was lost last (:meth:`lost`), so a consumer whose node died reconnects to
    a live node first instead of waiting on the dead one. Not thread-safe: one owner.
    """

    def __init__(self, url: str | Sequence[str], connection_name: str) -> None:
        urls = split_urls(url)
        if not urls:
            raise ConfigurationError(
                f"RabbitMQ URL is empty (set it with the consumer's `url` or {RABBITMQ_URL_ENV})"
            )
        self.parameters = [connection_parameters(part, connection_name) for part in urls]
        self.masked = [mask_amqp_url(part) for part in urls]
        self._first = 0
        #: Index of the node of the last connection :meth:`connect` opened.
        self.current = 0

    def __len__(self) -> int:
        return len(self.parameters)

    def order(self) -> list[int]:
        """Node indexes in the order the next connect tries them."""
        count = len(self.parameters)
        return [(self._first + step) % count for step in range(count)]

    def lost(self) -> None:
        """The current node's connection was lost: the next connect starts with the next node."""
        self._first = (self.current + 1) % len(self.parameters)

    def connect(self) -> Any:
        """A ``pika.BlockingConnection`` to the first node that accepts one.

        A refused login or access is raised at once (every node shares the users);
        when no node answers, the last node's error is raised.
        """
        error: BaseException | None = None
        for index in self.order():
            try:
                connection = pika.BlockingConnection(self.parameters[index])
            except (
                pika.exceptions.ProbableAuthenticationError,
                pika.exceptions.ProbableAccessDeniedError,
                pika.exceptions.AuthenticationError,
            ):
                raise
            except (pika.exceptions.AMQPConnectionError, OSError) as failure:
                error = failure
                continue
            self.current = index
            return connection
        raise error or BrokerUnavailableError("no RabbitMQ node to connect to")

    def open(self) -> Any:
        """:meth:`connect`, a failure raised as one :class:`BrokerUnavailableError` line
        naming the (masked) nodes and the error (a refused login too)."""
        try:
            return self.connect()
        except (pika.exceptions.AMQPError, OSError) as error:
            raise BrokerUnavailableError(
                f"cannot connect to RabbitMQ at {','.join(self.masked)}: {describe(error)}"
            ) from error

    def confirm_channel(self) -> tuple[Any, Any]:
        """``(connection, channel)``: :meth:`connect` (its errors as they are, for callers
        that retry), and a channel with publisher confirms."""
        connection = self.connect()
        channel = connection.channel()
        channel.confirm_delivery()
        return connection, channel


def queue_depth(connection: Any, queue: str) -> int | None:
    """Ready messages in ``queue`` by a passive declare on a throw-away channel of a
    blocking ``connection`` (None: no such queue). Other refusals are raised."""
    channel = connection.channel()
    try:
        frame = channel.queue_declare(queue=queue, passive=True)
    except pika.exceptions.ChannelClosedByBroker as error:
        if error.reply_code == 404:
            return None
        raise
    if channel.is_open:
        channel.close()
    return int(frame.method.message_count)


def check_broker(url: str, timeout: float = 10.0) -> None:
    """Open one connection to a node of ``url`` and close it; raise a one-line error if no
    node accepts it."""
    masked = mask_amqp_url(url)
    nodes = BrokerNodes(url, f"mqdedup-check:{socket.gethostname()}:{os.getpid()}")
    for parameters in nodes.parameters:
        parameters.socket_timeout = timeout
        parameters.stack_timeout = timeout
    try:
        connection = nodes.connect()
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

    ``queue_type="quorum"`` declares replicated quorum queues (``x-queue-type: quorum``),
    the type to use in a cluster: their leader is placed on the node the declaring
    connection is on and moves to another member when that node dies; messages
    survive as long as a majority of members does. ``x-delivery-limit`` in
    ``queue_arguments`` (quorum only, a positive integer) is the broker's last resort
    above the retry policy; keep it well above ``max_attempts + 1``.
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
        limit = self.queue_arguments.get(DELIVERY_LIMIT_ARGUMENT)
        if limit is not None:
            if self.queue_type != "quorum":
                raise ConfigurationError(
                    f"{owner}.queue_arguments: {DELIVERY_LIMIT_ARGUMENT} is only honoured by "
                    "quorum queues (set queue_type = 'quorum')"
                )
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ConfigurationError(
                    f"{owner}.queue_arguments: {DELIVERY_LIMIT_ARGUMENT} must be a positive "
                    f"integer, not {limit!r}"
                )
        for binding in self.bindings:
            if not isinstance(binding, Binding):
                raise ConfigurationError(
                    f"{owner}.bindings must hold mqdedup Binding objects, not {binding!r}"
                )
            binding.validate(owner)

    def queue_declare_arguments(self) -> dict[str, Any]:
        """Arguments of the consumed queue's declaration."""
        return self._typed(self.queue_arguments)

    def dead_letter_queue_arguments(self) -> dict[str, Any]:
        """Arguments of the dead-letter queue's declaration (same queue type)."""
        return self._typed(self.dead_letter_arguments)

    def _typed(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        quorum = {"x-queue-type": "quorum"} if self.queue_type == "quorum" else {}
        return {**arguments, **quorum}


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

"""RabbitMQ consumers (pika): subclass :class:`RabbitMQConsumer` and implement ``handle``.

::

    class OrderConsumer(RabbitMQConsumer):
        queue = "orders"
        bindings = (Binding("shop", routing_key="order.created", exchange_type="topic"),)
        batch_size = 200                      # prefetch: two batches

        def handle(self, message, ctx):
            ctx.session.add(Order(**message.json()))

    OrderConsumer().run(create_engine(), stop=stop_token)

The queue (durable), its bindings and the dead-letter queue ``<queue>.dlq`` are declared
on every (re)connect. The dedup scope (consumer name) defaults to the queue name; the
message id to the AMQP ``message_id`` property. Messages are acknowledged only after the
transaction holding their dedup claims and the handler's writes has committed. See
``docs/rabbitmq.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from mqdedup.consumers.base import Consumer
from mqdedup.consumers.metrics import Metrics
from mqdedup.dedup.ids import MessageIdStrategy, from_amqp_message_id
from mqdedup.errors import ConfigurationError
from mqdedup.rabbitmq.codec import (
    MESSAGE_ID_HEADER,
    REQUEUED_HEADER,
    SOURCE_QUEUE_HEADER,
)
from mqdedup.rabbitmq.dead_letter_queue import RequeueResult, requeue_dead_letters
from mqdedup.rabbitmq.topology import (
    DEFAULT_DEAD_LETTER_EXCHANGE,
    MAX_PREFETCH,
    RABBITMQ_URL_ENV,
    Binding,
    QueueType,
    Topology,
    check_broker,
    default_connection_name,
    join_urls,
    rabbitmq_url_from_env,
    validate_prefetch,
)
from mqdedup.rabbitmq.transport import AmqpToken, RabbitMQTransport
from mqdedup.stopping import StopToken

if TYPE_CHECKING:
    from sqlalchemy import Engine

__all__ = [
    "MESSAGE_ID_HEADER",
    "RABBITMQ_URL_ENV",
    "REQUEUED_HEADER",
    "SOURCE_QUEUE_HEADER",
    "AmqpToken",
    "Binding",
    "RabbitMQConsumer",
    "RabbitMQTransport",
    "RequeueResult",
    "requeue_dead_letters",
]


class RabbitMQConsumer(Consumer):
    """A consumer of one RabbitMQ queue. Set ``queue`` and implement ``handle``.

    ``batch_size`` is the number of messages per transaction; unless ``prefetch`` is set,
    the channel's prefetch count is two batches, so the broker streams the next batch in
    while this one commits.
    """

    broker: ClassVar[str | None] = "rabbitmq"

    #: The queue to consume (required). Also the default consumer name (dedup scope).
    queue: ClassVar[str] = ""
    #: Exchanges to declare and bind the queue to (the default exchange needs none).
    bindings: ClassVar[Sequence[Binding]] = ()
    #: ``classic`` or ``quorum``; the dead-letter queue gets the same type.
    queue_type: ClassVar[QueueType] = "classic"
    #: Extra ``x-*`` arguments of the queue declaration (e.g. ``x-max-length``).
    queue_arguments: ClassVar[Mapping[str, Any]] = {}
    #: ``False``: declare nothing, only check that queue, DLQ and exchanges exist.
    declare: ClassVar[bool] = True
    #: Unacked deliveries the broker may push; ``None`` means two batches
    #: (``2 * batch_size``, at most 65,535). ``prefetch = batch_size`` stops the broker
    #: from sending more while a batch commits (``1`` with ``batch_size = 1``: strict
    #: one-at-a-time dispatch among competing workers, for slow handlers).
    prefetch: ClassVar[int | None] = None
    #: ``amqp://`` URL; ``None`` means ``MQDEDUP_RABBITMQ_URL`` (or a local broker).
    #: Query options such as ``?heartbeat=30`` are passed to pika. A cluster: the URLs of
    #: its nodes, as a list or joined by commas; a lost connection reconnects to the next
    #: live node (docs/rabbitmq.md, "In a cluster").
    url: ClassVar[str | Sequence[str] | None] = None
    #: Shown in ``rabbitmqctl list_connections``; default ``mqdedup:<name>:<host>:<pid>``.
    connection_name: ClassVar[str | None] = None
    #: Direct exchange dead-lettered copies are published to ("" = the default exchange).
    dead_letter_exchange: ClassVar[str] = DEFAULT_DEAD_LETTER_EXCHANGE
    #: The dead-letter queue; ``None`` means ``<queue>.dlq``.
    dead_letter_queue: ClassVar[str | None] = None
    #: Extra ``x-*`` arguments of the dead-letter queue's declaration, e.g.
    #: ``{"x-max-length": 100_000, "x-overflow": "reject-publish"}``. Changing them for an
    #: existing queue is a configuration error (406), as for ``queue_arguments``.
    dead_letter_queue_arguments: ClassVar[Mapping[str, Any]] = {}
    #: Seconds to keep trying to reach the broker at start-up before giving up.
    startup_timeout: ClassVar[float] = 30.0
    #: Cap of the exponential backoff between reconnect attempts, in seconds.
    reconnect_backoff_max: ClassVar[float] = 10.0
    message_id_strategy: ClassVar[MessageIdStrategy] = from_amqp_message_id

    def default_name(self) -> str:
        """The queue name: the dedup scope unless ``name`` is set."""
        return self.queue or type(self).__name__

    # -- configuration -----------------------------------------------------------------------

    @property
    def effective_prefetch(self) -> int:
        """The channel's prefetch count: ``prefetch``, else two batches (at most 65,535).

        Two batches let the I/O thread receive and decode the next batch while the worker
        commits this one (measured: the bulk path +20-30% on RabbitMQ against a prefetch
        of one batch, see docs/rabbitmq.md); a larger ``batch_size`` is refused by
        :func:`validate_prefetch`.
        """
        if self.prefetch is not None:
            return self.prefetch
        return max(self.batch_size, min(2 * self.batch_size, MAX_PREFETCH))

    @property
    def broker_url(self) -> str:
        """The connection URL, or the node URLs joined by commas (may contain passwords:
        never log it unmasked)."""
        return join_urls(self.url) if self.url else rabbitmq_url_from_env()

    def topology(self) -> Topology:
        """What is declared on every (re)connect."""
        return Topology(
            queue=self.queue,
            queue_type=self.queue_type,
            queue_arguments=dict(self.queue_arguments),
            bindings=tuple(self.bindings),
            dead_letter_exchange=self.dead_letter_exchange,
            dead_letter_queue=self.dead_letter_queue or "",
            declare=self.declare,
            dead_letter_arguments=dict(self.dead_letter_queue_arguments),
        )

    def validate(self) -> None:
        """Raise ConfigurationError (one line, naming the attribute) for unusable settings."""
        owner = type(self).__name__
        self.topology().validate(owner)
        validate_prefetch(owner, self.effective_prefetch)
        if self.startup_timeout < 0 or self.reconnect_backoff_max <= 0:
            raise ConfigurationError(
                f"{owner}.startup_timeout must be >= 0 and reconnect_backoff_max > 0"
            )
        super().validate()

    # -- running -----------------------------------------------------------------------------

    def create_transport(
        self, *, stop: StopToken | None = None, metrics: Metrics | None = None
    ) -> RabbitMQTransport:
        """Connect to the broker, declare the topology and start consuming.

        ``stop``: when requested, the transport stops consuming (``basic.cancel``) and
        hands back its buffered deliveries, while the batch in flight is still acked.
        """
        self.validate()
        transport = RabbitMQTransport(
            self.topology(),
            self.broker_url,
            connection_name=self.connection_name or default_connection_name(self.consumer_name),
            prefetch=self.effective_prefetch,
            stop=stop,
            metrics=metrics,
            startup_timeout=self.startup_timeout,
            reconnect_backoff_max=self.reconnect_backoff_max,
        )
        return transport.start()

    def check_connection(self) -> None:
        """Connect once and close: BrokerUnavailableError / ConfigurationError if that fails."""
        self.validate()
        check_broker(self.broker_url)

    def lag(self) -> dict[str, int]:
        """Messages waiting in the queue and in its dead-letter queue (passive declares)."""
        import pika

        from mqdedup.rabbitmq.topology import BrokerNodes, queue_depth

        topology = self.topology()
        connection = BrokerNodes(self.broker_url, f"mqdedup-status-{self.consumer_name}").connect()
        try:
            counts: dict[str, int] = {}
            for queue in (topology.queue, topology.dead_letter_queue):
                try:
                    counts[queue] = queue_depth(connection, queue) or 0  # 0: not declared yet
                except pika.exceptions.ChannelClosedByBroker:
                    counts[queue] = 0  # not readable by this user: as before, shown as 0
            return counts
        finally:
            connection.close()

    # -- dead letters ------------------------------------------------------------------------

    def requeue_dead_letters(
        self,
        limit: int | None = None,
        *,
        database: Engine | None = None,
    ) -> RequeueResult:
        """Move dead-lettered messages (all, or up to ``limit``) back to ``queue``.

        Each copy is published with a broker confirm before it is removed from the
        dead-letter queue, so none is lost. With ``database``, the attempt counters of the
        moved messages are reset so each gets ``retry_policy.max_attempts`` runs again.
        """
        self.validate()
        return requeue_dead_letters(
            self.broker_url,
            dead_letter_queue=self.topology().dead_letter_queue,
            target_queue=self.queue,
            limit=limit,
            database=database,
            table_prefix=self.table_prefix,
            consumer_name=self.consumer_name,
        )

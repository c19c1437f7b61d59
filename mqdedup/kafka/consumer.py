"""Kafka consumers (kafka-python): subclass :class:`KafkaConsumer` and implement ``handle``.

::

    class Orders(KafkaConsumer):
        topics = ["orders"]
        group_id = "billing"            # also the dedup scope (consumer name)
        batch_size = 500

        def handle(self, message, ctx):
            ctx.session.execute(insert(invoices).values(...))

    Orders().run(engine, stop=stop_token)

Each batch: the message ids are claimed in the dedup table in the same transaction as
the handler's writes; after the commit the partition offsets are committed, contiguously
(a message still being retried holds its partition back). A message that keeps failing
goes to the dead-letter topic (``<topic>.DLT``) with its original key, value and headers
plus ``x-mqdedup-*`` headers; only then does the offset move past it. ``run`` is the
shared :class:`~mqdedup.consumers.worker.Worker` loop over :meth:`create_transport`,
whose poll thread keeps polling (with paused partitions) while a batch is in flight, so
long handlers and database outages never get the worker kicked out of the group. See
``docs/kafka.md``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from mqdedup.consumers.base import Consumer
from mqdedup.consumers.metrics import Metrics
from mqdedup.dedup.choices import SqlDedup
from mqdedup.dedup.ids import from_coordinates
from mqdedup.errors import ConfigurationError
from mqdedup.kafka.membership import GROUP_DEFAULTS, static_instance_id
from mqdedup.kafka.settings import TOPIC_PLACEHOLDER, KafkaSettings
from mqdedup.kafka.transport import KafkaTransport
from mqdedup.stopping import StopToken

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session, sessionmaker

    from mqdedup.consumers.replay import ReplayReport

BOOTSTRAP_ENV = "MQDEDUP_KAFKA_BOOTSTRAP"

# kafka_config keys mqdedup sets itself, and why a user may not.
_RESERVED_CONSUMER_KEYS = {
    "enable_auto_commit": "mqdedup commits offsets itself, after the database commit",
    "group_id": "set the group_id class attribute instead",
    "bootstrap_servers": f"set the bootstrap_servers class attribute or ${BOOTSTRAP_ENV}",
    "key_deserializer": "handlers receive the raw bytes (decode them in handle())",
    "value_deserializer": "handlers receive the raw bytes (decode them in handle())",
}
# Connection settings (security, SASL, TLS, ...) shared by the consumer, the dead-letter
# producer and the admin client.
_SHARED_PREFIXES = ("ssl_", "sasl_")
_SHARED_KEYS = frozenset(
    {
        "security_protocol",
        "api_version",
        "client_dns_lookup",
        "proxy_url",
        "socks5_proxy",
        "reconnect_backoff_ms",
        "reconnect_backoff_max_ms",
        "connections_max_idle_ms",
        "metadata_max_age_ms",
        "request_timeout_ms",
        "retry_backoff_ms",
        "bootstrap_timeout_ms",
        "socket_options",
        "receive_buffer_bytes",
        "send_buffer_bytes",
    }
)

#: kafka-python settings mqdedup changes for every client (consumer, dead-letter producer,
#: admin) so that a broker restart is followed within seconds: reconnect at most 1 s
#: apart (kafka-python's default backs off up to 30 s) and give up on a request to a
#: dead broker after 10 s (default 30 s). ``kafka_config`` overrides them.
RECOVERY_DEFAULTS: dict[str, int] = {
    "reconnect_backoff_max_ms": 1000,
    "request_timeout_ms": 10_000,
}
#: Longest wait (seconds) for the dead-letter topic's metadata before a publish is
#: given up (missing topic or outage; see ``KafkaClient.dead_letter``).
DEAD_LETTER_METADATA_WAIT = 5.0


class KafkaConsumer(Consumer):
    """A consumer of Kafka topics; subclass it and implement ``handle`` / ``handle_batch``.

    Configure it with class attributes (all optional except the topics and the group):
    ``topics`` or ``topic_pattern``, ``group_id`` (the Kafka consumer group and, unless
    ``name`` is set, the dedup scope), ``bootstrap_servers`` (default: the
    ``MQDEDUP_KAFKA_BOOTSTRAP`` environment variable), ``batch_size``, ``poll_timeout``,
    ``message_id_strategy`` (default: the ``message-id`` header), ``retry_policy``,
    ``dead_letter_topic`` (default ``{topic}.DLT``), ``offsets_in_database`` (the
    partitions' offsets stored with each batch's effects) and ``kafka_config``, passed
    through to kafka-python's ``KafkaConsumer`` (security / SASL / TLS settings are also
    given to the dead-letter producer).
    """

    broker: ClassVar[str | None] = "kafka"

    #: Topics to subscribe to (or set ``topic_pattern``).
    topics: ClassVar[Sequence[str]] = ()
    #: A regular expression of topics to subscribe to, instead of ``topics``.
    topic_pattern: ClassVar[str | None] = None
    #: The Kafka consumer group; also the dedup scope unless ``name`` is set.
    group_id: ClassVar[str | None] = None
    #: ``host:port`` list (or a comma-separated string); default ``$MQDEDUP_KAFKA_BOOTSTRAP``.
    bootstrap_servers: ClassVar[str | Sequence[str] | None] = None
    batch_size: ClassVar[int] = 500
    #: Where failed messages go; ``{topic}`` is replaced by the source topic.
    dead_letter_topic: ClassVar[str] = "{topic}.DLT"
    #: Create a missing dead-letter topic (same partition count as its source topic).
    create_dead_letter_topics: ClassVar[bool] = True
    #: Passed to kafka-python's ``KafkaConsumer`` (e.g. ``security_protocol``, ``sasl_*``).
    kafka_config: ClassVar[Mapping[str, Any]] = {}
    #: Passed to the dead-letter ``KafkaProducer`` (after the shared connection settings).
    producer_config: ClassVar[Mapping[str, Any]] = {}
    #: Where a new consumer group starts: ``earliest`` (default) or ``latest``.
    auto_offset_reset: ClassVar[str] = "earliest"
    #: Seconds to wait for an offset commit / a dead-letter acknowledgement.
    commit_timeout: ClassVar[float] = 10.0
    #: Seconds between offset commits while messages flow (settled offsets are also
    #: committed on rebalance and on stop). Later commits mean more redeliveries after
    #: a crash, never a lost or doubled effect.
    commit_interval: ClassVar[float] = 0.2
    dead_letter_timeout: ClassVar[float] = 30.0
    #: Seconds to wait for the first connection to the brokers.
    connect_timeout: ClassVar[float] = 30.0
    #: Batches fetched ahead of the one being processed.
    prefetch_batches: ClassVar[int] = 2
    #: Seconds between metadata refreshes (kafka-python's ``metadata_max_age_ms``): new
    #: partitions of a subscribed topic, and new topics of a ``topic_pattern``, are
    #: noticed within this bound (then a rebalance of a few seconds assigns them).
    metadata_refresh: ClassVar[float] = 10.0
    #: A child of ``mqdedup worker`` joins the group as a static member with an id
    #: stable per supervisor slot and host, so after a crash its restart takes its
    #: partitions back at once (see :mod:`mqdedup.kafka.membership`).
    static_membership: ClassVar[bool] = True
    #: Store each partition's next offset in ``<prefix>kafka_offsets``, written in the
    #: same transaction as the batch's effects (one conditional statement per partition
    #: and batch; a worker that lost its partitions is fenced). On assignment the
    #: stored offsets decide: records below them are duplicates without a claim. Message
    #: ids are still claimed when ``message_id_strategy`` names a producer id (a header,
    #: a body key); with ``ids.from_coordinates`` nothing is claimed: the dedup state is
    #: one row per partition. The group's offsets are still committed to the broker after
    #: the database commit (lag tools keep working). See ``docs/kafka.md``, "Offsets in
    #: the database: when to choose it".
    offsets_in_database: ClassVar[bool] = False

    def group_instance_id(self, group_id: str) -> str | None:
        """The static member id of this process (None: a dynamic member), unless
        ``kafka_config`` sets ``group_instance_id`` itself."""
        if not type(self).static_membership:
            return None
        return static_instance_id(group_id)

    def default_name(self) -> str:
        """The dedup scope when ``name`` is not set: the consumer group."""
        return type(self).group_id or type(self).__name__

    # -- configuration -------------------------------------------------------------------

    def validate(self) -> None:
        """Check the class attributes; raise ConfigurationError naming the problem."""
        super().validate()
        cls = type(self)
        label = cls.__name__
        if isinstance(cls.topics, str):
            raise ConfigurationError(f"{label}.topics must be a list of topic names, not a string")
        if bool(cls.topics) == bool(cls.topic_pattern):
            raise ConfigurationError(f"{label} must set exactly one of topics or topic_pattern")
        if cls.topic_pattern:
            try:
                re.compile(cls.topic_pattern)
            except re.error as error:
                raise ConfigurationError(
                    f"{label}.topic_pattern is not a valid regular expression: {error}"
                ) from error
        if not (cls.group_id or cls.name):
            raise ConfigurationError(f"{label} needs a group_id (the Kafka consumer group)")
        if not cls.dead_letter_topic or not isinstance(cls.dead_letter_topic, str):
            raise ConfigurationError(f"{label}.dead_letter_topic must be a topic name")
        if (
            cls.topic_pattern
            and TOPIC_PLACEHOLDER not in cls.dead_letter_topic
            and re.fullmatch(cls.topic_pattern, cls.dead_letter_topic)
        ):
            raise ConfigurationError(
                f"{label}.dead_letter_topic {cls.dead_letter_topic!r} matches its own "
                "topic_pattern: dead letters would be consumed again"
            )
        if cls.auto_offset_reset not in ("earliest", "latest"):
            raise ConfigurationError(f"{label}.auto_offset_reset must be 'earliest' or 'latest'")
        for attribute in (
            "commit_timeout",
            "dead_letter_timeout",
            "connect_timeout",
            "metadata_refresh",
        ):
            if getattr(cls, attribute) <= 0:
                raise ConfigurationError(f"{label}.{attribute} must be positive")
        if cls.commit_interval < 0:
            raise ConfigurationError(f"{label}.commit_interval must not be negative")
        if cls.prefetch_batches < 1:
            raise ConfigurationError(f"{label}.prefetch_batches must be at least 1")
        if cls.offsets_in_database and not isinstance(cls.dedup, SqlDedup):
            raise ConfigurationError(
                f"{label}.offsets_in_database needs the database claim store: the offsets "
                "are written in the handler's transaction (dedup = SqlDedup())"
            )
        self._check_kafka_config()

    def _check_kafka_config(self) -> None:
        import kafka

        label = type(self).__name__
        known = set(kafka.KafkaConsumer.DEFAULT_CONFIG)
        unknown = sorted(set(self.kafka_config) - known)
        if unknown:
            raise ConfigurationError(
                f"{label}.kafka_config has unknown kafka-python consumer setting(s): "
                f"{', '.join(unknown)}"
            )
        for key, why in _RESERVED_CONSUMER_KEYS.items():
            if key in self.kafka_config:
                raise ConfigurationError(f"{label}.kafka_config must not set {key}: {why}")
        producer_known = set(kafka.KafkaProducer.DEFAULT_CONFIG)
        unknown = sorted(set(self.producer_config) - producer_known)
        if unknown:
            raise ConfigurationError(
                f"{label}.producer_config has unknown kafka-python producer setting(s): "
                f"{', '.join(unknown)}"
            )
        if self.producer_config.get("acks", "all") not in ("all", -1):
            raise ConfigurationError(
                f"{label}.producer_config must keep acks='all': dead letters must be durable"
            )

    def resolve_bootstrap(self) -> tuple[str, ...]:
        """The bootstrap servers: the class attribute, else ``$MQDEDUP_KAFKA_BOOTSTRAP``."""
        value: str | Sequence[str] | None = type(self).bootstrap_servers or os.environ.get(
            BOOTSTRAP_ENV
        )
        if not value:
            raise ConfigurationError(
                f"{type(self).__name__} has no Kafka bootstrap servers: set "
                f"bootstrap_servers or the {BOOTSTRAP_ENV} environment variable"
            )
        servers = value.split(",") if isinstance(value, str) else list(value)
        cleaned = tuple(s.strip() for s in servers if s.strip())
        for server in cleaned:
            host, _, port = server.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigurationError(
                    f"Kafka bootstrap server {server!r} is not host:port "
                    f"(from {type(self).__name__}.bootstrap_servers or {BOOTSTRAP_ENV})"
                )
        return cleaned

    def kafka_settings(self) -> KafkaSettings:
        """Validate and resolve everything the transport needs (bootstrap included)."""
        import kafka

        self.validate()
        cls = type(self)
        bootstrap = self.resolve_bootstrap()
        group_id = cls.group_id or self.consumer_name
        shared = {
            key: value
            for key, value in self.kafka_config.items()
            if key in _SHARED_KEYS or key.startswith(_SHARED_PREFIXES)
        }
        consumer_config: dict[str, Any] = {
            "bootstrap_servers": list(bootstrap),
            "client_id": f"mqdedup-{self.consumer_name}",
            "group_id": group_id,
            "enable_auto_commit": False,
            "auto_offset_reset": cls.auto_offset_reset,
            "max_poll_records": max(cls.batch_size, 1),
            "bootstrap_timeout_ms": int(cls.connect_timeout * 1000),
            **RECOVERY_DEFAULTS,
            **GROUP_DEFAULTS,
            "metadata_max_age_ms": int(cls.metadata_refresh * 1000),
        }
        instance_id = self.group_instance_id(group_id)
        if instance_id is not None:
            consumer_config["group_instance_id"] = instance_id
        consumer_config.update(self.kafka_config)
        producer_config: dict[str, Any] = {
            "bootstrap_servers": list(bootstrap),
            "client_id": f"mqdedup-{self.consumer_name}-dead-letter",
            "acks": "all",
            "enable_idempotence": True,
            "bootstrap_timeout_ms": int(cls.connect_timeout * 1000),
            **RECOVERY_DEFAULTS,
            # A missing dead-letter topic or an outage shows within this wait for metadata.
            "max_block_ms": int(min(cls.dead_letter_timeout, DEAD_LETTER_METADATA_WAIT) * 1000),
        }
        producer_config.update(
            {k: v for k, v in shared.items() if k in kafka.KafkaProducer.DEFAULT_CONFIG}
        )
        producer_config.update(self.producer_config)
        admin_config: dict[str, Any] = {
            "bootstrap_servers": list(bootstrap),
            "client_id": f"mqdedup-{self.consumer_name}-admin",
            **RECOVERY_DEFAULTS,
            "bootstrap_timeout_ms": int(min(cls.connect_timeout, 10.0) * 1000),
        }
        admin_config.update(
            {k: v for k, v in shared.items() if k in kafka.KafkaAdminClient.DEFAULT_CONFIG}
        )
        return KafkaSettings(
            consumer_name=self.consumer_name,
            group_id=group_id,
            topics=tuple(cls.topics),
            pattern=cls.topic_pattern,
            bootstrap_servers=bootstrap,
            consumer_config=consumer_config,
            producer_config=producer_config,
            admin_config=admin_config,
            dead_letter_topic=cls.dead_letter_topic,
            create_dead_letter_topics=cls.create_dead_letter_topics,
            commit_timeout=cls.commit_timeout,
            commit_interval=cls.commit_interval,
            dead_letter_timeout=cls.dead_letter_timeout,
            max_buffered=cls.batch_size * (cls.prefetch_batches + 1),
            offsets_in_database=cls.offsets_in_database,
            table_prefix=cls.table_prefix,
            claims_with_offsets=cls.message_id_strategy is not from_coordinates,
        )

    # -- running -------------------------------------------------------------------------

    def create_transport(
        self, *, stop: StopToken | None = None, metrics: Metrics | None = None
    ) -> KafkaTransport:
        """Join the consumer group: a started transport with its own poll thread.

        ``stop``: when requested, the transport hands out nothing more while the batch
        in flight is still settled and committed; closing it commits and leaves the
        group. Raises BrokerUnavailableError when no bootstrap server answers.
        """
        return KafkaTransport(self.kafka_settings(), stop=stop, metrics=metrics).start()

    def check_connection(self) -> None:
        """Raise BrokerUnavailableError (one line) if no bootstrap server answers."""
        import kafka
        import kafka.errors

        from mqdedup.errors import BrokerUnavailableError

        settings = self.kafka_settings()
        admin_config = {
            **settings.admin_config,
            "bootstrap_timeout_ms": int(type(self).connect_timeout * 1000),
        }
        try:
            admin = kafka.KafkaAdminClient(**admin_config)
        except kafka.errors.KafkaError as error:
            raise BrokerUnavailableError(
                f"cannot reach Kafka at {','.join(settings.bootstrap_servers)}: "
                f"{type(error).__name__}"
            ) from error
        admin.close()

    def lag(self) -> dict[str, int]:
        """``topic/partition -> messages not yet committed`` for this consumer's group."""
        from mqdedup.kafka.lag import group_lag

        return group_lag(self.kafka_settings())

    def replay(
        self,
        database: Engine | sessionmaker[Session],
        *,
        start: int | datetime | None = None,
        end: int | datetime | None = None,
        partitions: Sequence[int] | None = None,
        topics: Sequence[str] | None = None,
        dry_run: bool = False,
        stop: StopToken | None = None,
    ) -> ReplayReport:
        """Run the consumer again over a past range, without joining the group.

        The range is a transport (:class:`~mqdedup.kafka.range.KafkaRangeTransport`) run
        by the same Worker and processor as :meth:`run`.

        ``start`` / ``end``: an offset (every selected partition) or a timestamp
        (``offsets_for_times``); default: from the beginning up to the end offsets at
        the start of the replay (exclusive). ``partitions`` defaults to all of each
        topic; ``topics`` to the consumer's ``topics``. Already processed messages are
        duplicates; ``dry_run`` only counts (new / duplicates / without id) and writes
        nothing. Nothing is committed to the consumer group.
        """
        from mqdedup.kafka.replay import KafkaReplay

        return KafkaReplay(
            self,
            database,
            start=start,
            end=end,
            partitions=partitions,
            topics=topics,
            dry_run=dry_run,
            stop=stop,
        ).run()

"""One kafka-python consumer (plus the dead-letter producer), used from one thread.

:class:`KafkaClient` does the broker work of the Kafka transport and keeps the ack
contract of :mod:`mqdedup.consumers.transport`:

* offsets are committed (``enable_auto_commit=False``) only for *settled* deliveries,
  and only up to the first one that is not settled yet (:mod:`mqdedup.kafka.offsets`);
  what is committed, and when, is decided and done by one object, its commit policy
  (:class:`~mqdedup.kafka.offset_commits.OffsetCommits`), which it tells what happens:
  a turn of the poll thread, the first records of a fresh assignment, a revoke, the stop;
* on a rebalance, settled offsets of revoked partitions are committed; the in-flight
  deliveries of partitions that really went to another worker are dropped (their settles
  are ignored; the next owner gets them again and the dedup table turns them into
  duplicates), those of partitions kept across the rebalance carry on; a commit that
  fails because of the rebalance is logged, never fatal;
* ``give_back`` seeks a partition back to its first given-back offset (the partition
  gets a new epoch: deliveries of it handed out later are dropped and fetched again);
* ``dead_letter`` publishes through :class:`~mqdedup.kafka.dead_letters.KafkaDeadLetters`
  and waits for the broker's acknowledgement before it returns.

Threads: kafka-python's consumer is not thread-safe. Every call on it (poll, pause,
seek, commit, close) happens on the *owner* thread, the one that called :meth:`open`:
the poll thread of :class:`~mqdedup.kafka.transport.KafkaTransport`. ``settle``,
``give_back`` and ``dead_letter`` may be called from another thread: the first two only
record what to do (the tracker is thread-safe) and the owner thread commits / seeks on its
next turn; dead letters go through the producer and an admin client, never through the
consumer.

Its parts: the rebalance listener (:mod:`mqdedup.kafka.rebalance`), offset commits
(:mod:`mqdedup.kafka.offset_commits`) with the clean-stop marker and the previous
owner's check (:mod:`mqdedup.kafka.clean_stop`), the partitions' lag
(:mod:`mqdedup.kafka.partition_lag`), the assignment across rebalances
(:mod:`mqdedup.kafka.assignment`), the group-join watchdog (:mod:`mqdedup.kafka.group_join`),
giving deliveries back (:mod:`mqdedup.kafka.rewinds`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import kafka
import kafka.errors as kafka_errors

from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.transport import DeadLetter, Delivery, new_delivery
from mqdedup.errors import BrokerUnavailableError, ConfigurationError
from mqdedup.kafka.assignment import Assignment
from mqdedup.kafka.dead_letters import KafkaDeadLetters
from mqdedup.kafka.group_join import JoinWatch
from mqdedup.kafka.membership import fenced_reason
from mqdedup.kafka.offset_commits import CommitPolicy, OffsetCommits
from mqdedup.kafka.offset_store import OffsetRows
from mqdedup.kafka.offsets import OffsetTracker, PartitionKey
from mqdedup.kafka.partition_lag import PartitionLag
from mqdedup.kafka.rebalance import RebalanceListener
from mqdedup.kafka.records import (
    KafkaToken,
    describe_error,
    is_retriable,
    kafka_token,
    partition_key,
    to_message,
)
from mqdedup.kafka.rewinds import request_rewinds, seek_rewinds

if TYPE_CHECKING:
    from mqdedup.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)


class KafkaClient:
    """A kafka-python consumer plus the dead-letter producer (see the module docs).

    It subscribes as a member of the consumer group and commits offsets; the transport
    drives it from its poll thread only (kafka-python's consumer is not thread-safe).
    """

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        # Possibly redelivered after an assignment: the batch a dead previous owner was
        # handling plus the batches it settled since its last commit (see the tracker).
        self.tracker = OffsetTracker(redelivery_window=settings.max_buffered)
        self._client: Any = None
        self.dead_letters = KafkaDeadLetters(settings)
        #: What to commit, when, and the commits themselves (the only committer).
        self.commits: CommitPolicy = OffsetCommits(settings, self.tracker, on_fenced=self.fence)
        #: Offsets stored in the database with each batch (``offsets_in_database``).
        self.offset_rows: OffsetRows | None = None
        if settings.offsets_in_database:
            self.offset_rows = OffsetRows(
                settings.group_id,
                settings.consumer_name,
                self.tracker,
                prefix=settings.table_prefix,
                claims=settings.claims_with_offsets,
                fence_hold=float(settings.consumer_config.get("session_timeout_ms", 10_000)) / 1000,
            )
        self._assignment = Assignment(self.tracker, self._assigned_keys)
        self._join = JoinWatch(
            settings.consumer_name,
            resubscribe=self._resubscribe,
            session_timeout=float(settings.consumer_config.get("session_timeout_ms", 0)) / 1000,
        )
        self._closed = False
        self._lag = PartitionLag()
        #: Why the broker fenced this static member (None: it is not fenced).
        self.fenced: str | None = None

    # -- life cycle ----------------------------------------------------------------------

    def open(self) -> None:
        """Connect, and subscribe Raises BrokerUnavailableError if unreachable."""
        if self._client is not None:
            return
        settings = self.settings
        config = dict(settings.consumer_config)
        try:
            client = kafka.KafkaConsumer(**config)
        except kafka_errors.KafkaConfigurationError as error:
            raise ConfigurationError(f"invalid Kafka settings: {error}") from error
        except kafka_errors.KafkaError as error:
            raise BrokerUnavailableError(
                f"cannot reach Kafka at {','.join(settings.bootstrap_servers)}: "
                f"{describe_error(error)}"
            ) from error
        self._client = client
        self._subscribe(client)
        log.info(
            "kafka consumer connected",
            extra={
                "consumer": settings.consumer_name,
                "group_id": settings.group_id,
                "topics": list(settings.topics) or settings.pattern,
                "bootstrap": ",".join(settings.bootstrap_servers),
            },
        )

    def fence(self) -> None:
        """The broker fenced this static member (another one joined under its instance
        id): consume and commit nothing more, never join again (that would fence the other
        back), report not ready with the reason, and say so once."""
        if self.fenced is not None:
            return
        self.commits.fence()
        instance_id = self.settings.consumer_config.get("group_instance_id")
        self.fenced = fenced_reason(self.settings.group_id, instance_id)
        self.metrics.fenced = self.fenced
        self.metrics.consumer_attached = False
        log.error(
            self.fenced,
            extra={
                "consumer": self.settings.consumer_name,
                "group_id": self.settings.group_id,
                "instance_id": instance_id,
            },
        )

    @property
    def client(self) -> Any:
        """The kafka-python ``KafkaConsumer`` (opened on first use)."""
        if self._client is None:
            self.open()
        return self._client

    def close(self, *, commit: bool = True, timeout: float = 10.0) -> None:
        """Commit what is settled (unless ``commit=False``), leave the group, disconnect."""
        if self._closed:
            return
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            if commit:
                self.commits.stopping(client, timeout)
            try:
                client.close(autocommit=False, timeout_ms=int(timeout * 1000))
            except Exception as error:
                log.warning(
                    "kafka consumer did not close cleanly",
                    extra={"consumer": self.settings.consumer_name, "error": describe_error(error)},
                )
        self.dead_letters.close(timeout)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    # -- any thread ----------------------------------------------------------------------

    def settle(self, deliveries: Sequence[Delivery[KafkaToken]]) -> None:
        """Mark deliveries settled (any thread); the owner thread's next turn commits
        their offsets contiguously (:meth:`commit_due`).

        Deliveries of revoked or rewound partitions are ignored: they will be fetched
        again (by this or another worker) and deduplicated.
        """
        self.tracker.settle_many(
            (d.token.partition, d.token.offset, d.token.epoch) for d in deliveries
        )

    def dead_letter(self, delivery: Delivery[KafkaToken], record: DeadLetter) -> None:
        """Publish the original record with ``record``'s headers; wait for the broker's ack.

        Never touches the consumer (safe from any thread); see
        :meth:`KafkaDeadLetters.publish` for the errors it raises.
        """
        if self._closed:
            raise BrokerUnavailableError("the Kafka transport is closed")
        self.dead_letters.publish(delivery.token, record)

    # -- owner thread --------------------------------------------------------------------

    def poll(self, max_records: int, timeout: float) -> list[Delivery[KafkaToken]]:
        """One kafka-python poll; records become tracked deliveries (owner thread only).

        While the group is (re)joining, the poll waits at least
        :data:`~mqdedup.kafka.group_join.REBALANCE_POLL` seconds so the join can complete
        inside the call (see :class:`~mqdedup.kafka.group_join.JoinWatch`). A fenced
        member polls nothing: it waits ``timeout`` and returns nothing.
        """
        if self.fenced is not None:
            time.sleep(timeout)
            return []
        client = self.client
        timeout = self._join.poll_timeout(client, timeout)
        try:
            batches = client.poll(timeout_ms=int(timeout * 1000), max_records=max_records)
        except kafka_errors.FencedInstanceIdError:
            self.fence()
            return []
        except kafka_errors.CommitFailedError as error:
            log.warning(
                "offset commit failed during a rebalance; redeliveries will be deduplicated",
                extra={"consumer": self.settings.consumer_name, "error": describe_error(error)},
            )
            return []
        except kafka_errors.KafkaError as error:
            if not is_retriable(error):
                raise
            log.warning(
                "kafka poll failed; retrying",
                extra={"consumer": self.settings.consumer_name, "error": describe_error(error)},
            )
            return []
        self._assignment.drop_unassigned()
        deliveries: list[Delivery[KafkaToken]] = []
        append = deliveries.append
        for topic_partition, records in batches.items():
            key = partition_key(topic_partition)
            if self._assignment.unchecked(key) and records:
                # Before its first records: is the careful window needed? (once)
                self._assignment.checked(key)
                self.commits.first_records(client, topic_partition, records[0].offset)
            tracked = self.tracker.track_many(key, [record.offset for record in records])
            for record, track in zip(records, tracked, strict=True):
                if track is None:
                    continue  # its partition is being rewound; it will come again
                epoch, redelivered = track
                append(
                    new_delivery(
                        to_message(record, redelivered),
                        kafka_token(key, record.offset, epoch, record),
                    )
                )
        return deliveries

    def current(self, deliveries: Iterable[Delivery[KafkaToken]]) -> list[Delivery[KafkaToken]]:
        """The deliveries whose partition epoch is still current (others were dropped)."""
        deliveries = list(deliveries)
        # A batch holds a few (partition, epoch) pairs: check each pair once.
        pairs = list({(d.token.partition, d.token.epoch) for d in deliveries})
        stale = {
            pair
            for pair, keep in zip(pairs, self.tracker.current_epochs(pairs), strict=True)
            if not keep
        }
        if not stale:
            return deliveries
        return [d for d in deliveries if (d.token.partition, d.token.epoch) not in stale]

    def pause_all(self) -> None:
        """Pause every assigned partition (fetching stops; group membership stays)."""
        client = self.client
        unpaused = set(client.assignment() or ()) - set(client.paused() or ())
        if unpaused:
            client.pause(*unpaused)

    def resume_all(self) -> None:
        """Resume every paused partition (kafka-python keeps the paused flag of a partition
        that stays assigned across a rebalance)."""
        if self._client is None:
            return
        paused = set(self._client.paused() or ())
        if paused:
            self._client.resume(*paused)

    def commit_due(self, wait: float) -> bool:
        """A turn of the owner thread for the commit policy (see
        :meth:`~mqdedup.kafka.offset_commits.CommitPolicy.due`); waits at most ``wait``."""
        return self.commits.due(self._client, wait)

    def give_back(self, deliveries: Iterable[Delivery[KafkaToken]]) -> None:
        """Fetch these unsettled deliveries (and what followed them) again.

        Records the first given-back offset of each partition (ignored when the
        delivery's epoch is over: its partition moved or was given back already); the
        seek itself happens on the owner thread (:meth:`apply_rewinds`).
        """
        request_rewinds(self.tracker, deliveries, self.settings.consumer_name)

    def apply_rewinds(self) -> None:
        """Seek partitions back to their first unsettled delivery (owner thread only)."""
        seek_rewinds(self._client, self.tracker)

    def update_lag(self) -> dict[str, int]:
        """Per-partition lag (high-water mark minus committed/consumed offset) into metrics."""
        if self._client is None:
            return self.metrics.lag
        lag = self._lag.measure(self._client, self.tracker)
        self.metrics.lag = lag
        return lag

    # -- rebalances -----------------------------------------------------------------------

    def _subscribe(self, client: Any) -> None:
        listener = RebalanceListener(
            self.settings.consumer_name,
            revoked=self._partitions_revoked,
            lost=self._partitions_lost,
            assigned=self._partitions_assigned,
        )
        if self.settings.pattern is not None:
            client.subscribe(pattern=self.settings.pattern, listener=listener)
        else:
            client.subscribe(topics=list(self.settings.topics), listener=listener)

    def _resubscribe(self) -> None:
        """Leave the group and join it again (owner thread; the join watchdog's public-API
        fallback). What kafka-python still assigned is dropped by the next poll; its
        deliveries come again and are deduplicated."""
        if self._client is None:
            return
        self._client.unsubscribe()
        self._subscribe(self._client)

    def _assigned_keys(self) -> set[PartitionKey]:
        if self._client is None:
            return set()
        return {partition_key(tp) for tp in self._client.assignment() or ()}

    def _partitions_revoked(self, keys: list[PartitionKey]) -> dict[PartitionKey, int]:
        """Listener (IO thread): commit what is settled; the drop waits for the assignment.

        With the eager protocol every partition is "revoked" before each rebalance, but
        kafka-python keeps the fetch state (position, buffered records) of a partition
        that is assigned again; its in-flight work must then be kept, not dropped.
        """
        self._lag.forget(keys)
        uncommitted = self.commits.revoked(self._client, keys)
        self._assignment.revoking(keys)
        return uncommitted

    def _partitions_assigned(self, keys: list[PartitionKey]) -> tuple[list[PartitionKey], ...]:
        """Listener (IO thread): see :meth:`Assignment.assigned`; ``(gone, fresh, kept)``."""
        self._lag.forget(keys)
        gone, fresh, kept = self._assignment.assigned(keys)
        if self.offset_rows is not None:  # read the stored offsets before the next batch
            self.offset_rows.forget([*gone, *fresh])
        return gone, fresh, kept

    def _partitions_lost(self, keys: list[PartitionKey]) -> None:
        """Listener (IO thread): membership expired; nothing may be committed any more."""
        self._lag.forget(keys)
        self._assignment.lost(keys)
        if self.offset_rows is not None:
            self.offset_rows.forget(keys)

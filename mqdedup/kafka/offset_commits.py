"""The one owner of a group member's offset commits: what to commit, when, and the act.

:class:`~mqdedup.kafka.client.KafkaClient` reports the events of its consumer to a
:class:`CommitPolicy` and commits nothing itself:

* **a turn of the poll thread** (:meth:`~CommitPolicy.due`): the settled offsets not
  committed yet, at most one commit per ``commit_interval`` (after a failure, at least a
  second later), waiting at most the poll thread's bound;
* **the first records of a fresh assignment** (:meth:`~CommitPolicy.first_records`):
  unless the previous owner may have died on them, their start offset is committed
  without the clean-stop marker (a death from now on leaves a trace) and the partition
  needs no careful window (:mod:`mqdedup.kafka.clean_stop`);
* **a revoke** (:meth:`~CommitPolicy.revoked`, kafka-python's IO thread): the settled
  offsets of the revoked partitions, asynchronously, with the clean-stop marker where the
  next owner needs no care;
* **the stop** (:meth:`~CommitPolicy.stopping`): the same, blocking, bounded by the
  stop's timeout.

:class:`OffsetCommits` is the policy of today: offsets go to the group coordinator. It is
the only writer of the tracker's commit state (``committed``, ``expect_clean``). A failed
commit is logged and never fatal: an offset not committed yet only means its messages may
come again, deduplicated. Commits failing through an outage are one WARNING when they
start failing and one INFO when one succeeds again (DEBUG between). A fenced member
commits nothing more (its offsets are the new member's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import kafka.errors as kafka_errors

from mqdedup.kafka.clean_stop import commit_request, stopped_cleanly
from mqdedup.kafka.offsets import OffsetTracker, PartitionKey
from mqdedup.kafka.records import describe_error, partition_key
from mqdedup.outages import OutageLog

if TYPE_CHECKING:
    from mqdedup.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)

#: The errors of a commit refused because the group is rebalancing (or moved on).
_REBALANCE_ERRORS = (
    kafka_errors.CommitFailedError,
    kafka_errors.RebalanceInProgressError,
    kafka_errors.IllegalGenerationError,
    kafka_errors.UnknownMemberIdError,
)


class CommitPolicy(Protocol):
    """What to commit, when: the events of a group member's consumer (see the module docs).

    ``consumer`` is the kafka-python ``KafkaConsumer`` (``None`` once it is closed).
    """

    def due(self, consumer: Any, wait: float) -> bool:
        """A turn of the poll thread; waits at most ``wait`` seconds. True: nothing left."""

    def first_records(self, consumer: Any, topic_partition: Any, start: int) -> None:
        """The first records of a fresh assignment of ``topic_partition`` start at ``start``."""

    def revoked(self, consumer: Any, keys: Iterable[PartitionKey]) -> dict[PartitionKey, int]:
        """``keys`` are revoked (no blocking call); return the settled offsets committed."""

    def stopping(self, consumer: Any, timeout: float) -> None:
        """The member stops gracefully: commit what is settled within ``timeout``."""

    def fence(self) -> None:
        """The member was fenced: commit nothing more."""


class OffsetCommits:
    """Commits one group member's settled offsets to the group coordinator.

    ``on_fenced`` is called when a commit finds the member fenced (another member joined
    under its static instance id).
    """

    def __init__(
        self,
        settings: KafkaSettings,
        tracker: OffsetTracker,
        *,
        on_fenced: Callable[[], None] = lambda: None,
    ) -> None:
        self.consumer_name = settings.consumer_name
        self.interval = settings.commit_interval
        self.timeout = settings.commit_timeout
        self.tracker = tracker
        self.failures = OutageLog(
            "kafka offset commits", logger=log, context={"consumer": settings.consumer_name}
        )
        self._on_fenced = on_fenced
        self._fenced = False
        self._next_attempt = 0.0

    # -- the events ----------------------------------------------------------------------

    def due(self, consumer: Any, wait: float) -> bool:
        """Commit the settled offsets of assigned partitions, at most once per interval.

        Waits at most ``min(commit_timeout, wait)``: the poll thread passes its stop
        bound, so a stop while the broker is down is not held by a commit in flight; a
        commit that times out is retried on a later turn.
        """
        if consumer is None or self._fenced:
            return True  # fenced: its offsets are the new member's to commit
        if time.monotonic() < self._next_attempt:
            return False
        offsets = _only(self.tracker.to_commit(), _assigned(consumer))
        if not offsets:
            return True
        ok = self.commit(consumer, offsets, min(self.timeout, wait))
        if self._fenced:
            return True
        self._next_attempt = time.monotonic() + (self.interval if ok else max(1.0, self.interval))
        return ok

    def first_records(self, consumer: Any, topic_partition: Any, start: int) -> None:
        """Is the careful window needed for a fresh assignment's first records?

        Not when the previous owner stopped gracefully (its last commit carries the
        clean-stop marker) nor when nobody ever committed. Either way the start offset is
        first committed *without* the marker, so a death from now on leaves a trace for
        the next owner; if that commit fails, the window stays.
        """
        if self._fenced or not stopped_cleanly(consumer, topic_partition, self.timeout):
            return  # the previous owner may have died on these records (or unknown)
        key = partition_key(topic_partition)
        if self.commit(consumer, {key: start}, self.timeout):
            self.tracker.expect_clean(key)

    def revoked(self, consumer: Any, keys: Iterable[PartitionKey]) -> dict[PartitionKey, int]:
        """Best-effort commit from the rebalance listener (kafka-python's IO thread).

        A blocking commit is not allowed there; the asynchronous commit is queued before
        the group is re-joined, so the coordinator handles it while we still own them.
        Returns the settled offsets not committed before (for the log).
        """
        wanted = set(keys)
        uncommitted = _only(self.tracker.to_commit(), wanted)
        clean = _only(self.tracker.clean_offsets(), wanted)
        offsets = {**clean, **uncommitted}
        if consumer is None or self._fenced or not offsets:
            return uncommitted
        try:
            consumer.commit_async(commit_request(offsets, clean), callback=self._revoke_done)
        except Exception as error:
            self._revoke_done(offsets, error)
        return uncommitted

    def stopping(self, consumer: Any, timeout: float) -> None:
        """Commit what is settled, with the clean-stop marker where the next owner needs
        no care (:meth:`OffsetTracker.clean_offsets`), waiting at most ``timeout``."""
        if consumer is None or self._fenced:
            return
        assigned = _assigned(consumer)
        offsets = _only(self.tracker.to_commit(), assigned)
        clean = _only(self.tracker.clean_offsets(), assigned)
        self.commit(consumer, {**clean, **offsets}, timeout, clean=clean)

    def fence(self) -> None:
        """Commit nothing more (the member was fenced)."""
        self._fenced = True

    # -- the act -------------------------------------------------------------------------

    def commit(
        self,
        consumer: Any,
        offsets: Mapping[PartitionKey, int],
        timeout: float,
        *,
        clean: Collection[PartitionKey] = (),
    ) -> bool:
        """Commit ``offsets`` (``clean``: with the clean-stop marker); True when committed."""
        if not offsets:
            return True
        try:
            consumer.commit(commit_request(offsets, clean), timeout_ms=int(timeout * 1000))
        except kafka_errors.FencedInstanceIdError:
            self._fenced = True
            self._on_fenced()
            return False
        except _REBALANCE_ERRORS as error:
            log.warning(
                "offset commit failed because of a rebalance; redeliveries will be deduplicated",
                extra={"consumer": self.consumer_name, "error": describe_error(error)},
            )
            return False
        except kafka_errors.KafkaError as error:
            self.failures.down(describe_error(error), "offset commit failed; will retry")
            return False
        self.failures.up()
        self.tracker.committed(dict(offsets))
        return True

    def _revoke_done(self, _offsets: Any, response: Any) -> None:
        if isinstance(response, Exception):
            log.warning(
                "offset commit on revoke failed; redeliveries will be deduplicated",
                extra={"consumer": self.consumer_name, "error": describe_error(response)},
            )


def _assigned(consumer: Any) -> set[PartitionKey]:
    return {partition_key(tp) for tp in consumer.assignment() or ()}


def _only(
    offsets: Mapping[PartitionKey, int], keys: Collection[PartitionKey]
) -> dict[PartitionKey, int]:
    return {key: offset for key, offset in offsets.items() if key in keys}

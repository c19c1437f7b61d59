"""Offset commits of the aiokafka transport: settled offsets only, after the database commit.

:class:`AioOffsetCommits` commits what the offset tracker
(:class:`~mqdedup.kafka.offsets.OffsetTracker`) says is committable, one commit at a
time, optionally with the clean-stop marker (:mod:`mqdedup.kafka.clean_stop`), and checks
a fresh partition's previous owner (is the careful window needed?). A failed commit is
logged, never fatal: an offset not committed yet only means its messages may come again,
deduplicated. Coroutines, run on the event loop of the transport.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping
from typing import Any

import aiokafka.errors as aio_errors  # type: ignore[import-untyped]
from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped]
from aiokafka.structs import TopicPartition  # type: ignore[import-untyped]

from mqdedup.kafka.aio_settings import AioKafkaSettings
from mqdedup.kafka.clean_stop import CLEAN_STOP_METADATA
from mqdedup.kafka.offsets import OffsetTracker, PartitionKey
from mqdedup.kafka.records import describe_error, partition_key
from mqdedup.outages import OutageLog

log = logging.getLogger("mqdedup.kafka.aio_transport")

_REBALANCE_ERRORS: tuple[type[BaseException], ...] = (
    aio_errors.CommitFailedError,
    aio_errors.RebalanceInProgressError,
    aio_errors.IllegalGenerationError,
    aio_errors.UnknownMemberIdError,
    aio_errors.IllegalStateError,
)


class AioOffsetCommits:
    """Commits the settled offsets of one aiokafka consumer (set :attr:`consumer` once started)."""

    def __init__(self, settings: AioKafkaSettings, tracker: OffsetTracker) -> None:
        self.settings = settings
        self.tracker = tracker
        #: The started ``AIOKafkaConsumer`` (None before the start).
        self.consumer: Any = None
        self._lock = asyncio.Lock()
        self._next_commit = 0.0
        #: Commits failing through an outage: one WARNING, then one INFO when one succeeds.
        self.failures = OutageLog(
            "kafka offset commits", logger=log, context={"consumer": settings.consumer_name}
        )

    @property
    def due(self) -> bool:
        """True when ``commit_interval`` has passed since the last commit."""
        return time.monotonic() >= self._next_commit

    def assigned(self) -> set[PartitionKey]:
        """The partitions the consumer owns now."""
        if self.consumer is None:
            return set()
        return {partition_key(tp) for tp in self.consumer.assignment() or ()}

    async def commit_pending(self) -> bool:
        """Commit settled offsets not committed yet; True when nothing is left to commit."""
        assigned = self.assigned()
        offsets = {k: v for k, v in self.tracker.to_commit().items() if k in assigned}
        if not offsets:
            return True
        ok = await self.commit(offsets, self.settings.base.commit_timeout)
        interval = self.settings.base.commit_interval
        self._next_commit = time.monotonic() + (interval if ok else max(1.0, interval))
        return ok

    async def commit_on_stop(self, timeout: float) -> None:
        """A graceful stop: commit what is settled, with the clean-stop marker where allowed."""
        assigned = self.assigned()
        offsets = {k: v for k, v in self.tracker.to_commit().items() if k in assigned}
        clean = {k: v for k, v in self.tracker.clean_offsets().items() if k in assigned}
        await self.commit({**clean, **offsets}, timeout, clean=set(clean))

    async def commit(
        self,
        offsets: Mapping[PartitionKey, int],
        timeout: float,
        *,
        clean: Collection[PartitionKey] = (),
    ) -> bool:
        """Commit ``offsets`` (``clean``: with the clean-stop marker); True when committed."""
        if not offsets or self.consumer is None:
            return True
        request = {
            TopicPartition(*key): (offset, CLEAN_STOP_METADATA if key in clean else "")
            for key, offset in offsets.items()
        }
        async with self._lock:
            try:
                await asyncio.wait_for(self.consumer.commit(request), timeout)
            except _REBALANCE_ERRORS as error:
                log.warning(
                    "offset commit failed because of a rebalance; redeliveries will be "
                    "deduplicated",
                    extra={"consumer": self.settings.consumer_name, "error": describe_error(error)},
                )
                return False
            except (aio_errors.KafkaError, TimeoutError, OSError) as error:
                self.failures.down(describe_error(error), "offset commit failed; will retry")
                return False
        self.failures.up()
        self.tracker.committed(dict(offsets))
        return True

    async def check_previous_owner(
        self, key: PartitionKey, topic_partition: Any, start: int
    ) -> None:
        """Before the first records of a fresh assignment: is the careful window needed?

        Not when the previous owner stopped gracefully (its last commit carries the
        clean-stop marker) nor when nobody ever committed. Either way the start offset is
        first committed without the marker, so a death from now on leaves a trace.
        """
        try:
            # aiokafka's consumer.committed() drops the metadata; the admin client keeps it
            # (once per fresh partition: about 5 ms for its connection, measured).
            answer = await asyncio.wait_for(
                self._committed(topic_partition), self.settings.base.commit_timeout
            )
        except Exception:
            return  # unknown: keep the careful window
        committed = answer.get(topic_partition)
        clean = (
            committed is None or committed.offset < 0 or committed.metadata == CLEAN_STOP_METADATA
        )
        if clean and await self.commit({key: start}, self.settings.base.commit_timeout):
            self.tracker.expect_clean(key)

    async def _committed(self, topic_partition: Any) -> dict[Any, Any]:
        """The group's committed offset of ``topic_partition``, with its metadata."""
        admin = AIOKafkaAdminClient(**self.settings.admin)
        try:
            await admin.start()
            return dict(
                await admin.list_consumer_group_offsets(
                    self.settings.base.group_id, partitions=[topic_partition]
                )
            )
        finally:
            await admin.close()

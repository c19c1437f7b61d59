"""Committing a consumer's settled offsets, blocking or from the rebalance listener."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

import kafka.errors as kafka_errors

from mqdedup.kafka.clean_stop import commit_request
from mqdedup.kafka.offsets import OffsetTracker, PartitionKey
from mqdedup.kafka.records import describe_error
from mqdedup.outages import OutageLog

log = logging.getLogger(__name__)


class OffsetCommits:
    """Commits offsets for one consumer (``consumer_name`` in the logs) into ``tracker``.

    A failed commit is logged and never fatal: an offset not committed yet only means its
    messages may come again, deduplicated. Commits failing through an outage are one
    WARNING when they start failing and one INFO when one succeeds again (DEBUG between).
    A fenced member's commit raises ``FencedInstanceIdError`` for the client to handle
    (:meth:`~mqdedup.kafka.client.KafkaClient.fence`).
    """

    def __init__(self, consumer_name: str, tracker: OffsetTracker) -> None:
        self.consumer_name = consumer_name
        self.tracker = tracker
        self.failures = OutageLog(
            "kafka offset commits", logger=log, context={"consumer": consumer_name}
        )

    def commit(
        self,
        client: Any,
        offsets: Mapping[PartitionKey, int],
        timeout: float,
        *,
        clean: Collection[PartitionKey] = (),
    ) -> bool:
        """Commit ``offsets`` (``clean``: with the clean-stop marker); True when committed."""
        if not offsets:
            return True
        request = commit_request(offsets, clean)
        try:
            client.commit(request, timeout_ms=int(timeout * 1000))
        except kafka_errors.FencedInstanceIdError:
            raise  # not a failure to retry: the client stops consuming (KafkaClient.fence)
        except (
            kafka_errors.CommitFailedError,
            kafka_errors.RebalanceInProgressError,
            kafka_errors.IllegalGenerationError,
            kafka_errors.UnknownMemberIdError,
        ) as error:
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

    def commit_on_revoke(
        self,
        client: Any,
        offsets: Mapping[PartitionKey, int],
        *,
        clean: Collection[PartitionKey] = (),
    ) -> None:
        """Best-effort commit from the rebalance listener (kafka-python's IO thread).

        A blocking commit is not allowed there; the asynchronous commit is queued before
        the group is re-joined, so the coordinator handles it while we still own them.
        """
        if client is None or not offsets:
            return
        request = commit_request(offsets, clean)
        try:
            client.commit_async(request, callback=self._revoke_commit_done)
        except Exception as error:
            log.warning(
                "offset commit on revoke failed; redeliveries will be deduplicated",
                extra={"consumer": self.consumer_name, "error": describe_error(error)},
            )

    def _revoke_commit_done(self, offsets: Any, response: Any) -> None:
        if isinstance(response, Exception):
            log.warning(
                "offset commit on revoke failed; redeliveries will be deduplicated",
                extra={"consumer": self.consumer_name, "error": describe_error(response)},
            )

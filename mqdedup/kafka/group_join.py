"""The group-join watchdog: a poll waits for a join, a join that never completes is
started again (:class:`JoinWatch`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from kafka.structs import MemberState

log = logging.getLogger(__name__)

#: Shortest poll while the group is (re)joining, so the join completes inside one call.
REBALANCE_POLL = 1.0
#: A join still not complete after this many seconds is started again.
REJOIN_AFTER = 5.0


class JoinWatch:
    """Watches one consumer's group membership (``consumer_name`` in the logs)."""

    def __init__(self, consumer_name: str) -> None:
        self.consumer_name = consumer_name
        self._rebalancing_since: float | None = None

    def poll_timeout(self, client: Any, timeout: float) -> float:
        """``timeout``, at least ``REBALANCE_POLL`` while the group is (re)joining."""
        if self.watch(client):
            return max(timeout, REBALANCE_POLL)
        return timeout

    def watch(self, client: Any) -> bool:
        """True while the member is not STABLE; repairs a join that never completes.

        kafka-python 3.0 loses a completed JoinGroup/SyncGroup when the ``poll()`` that
        started it timed out first and the rebalance was triggered by a metadata change
        (e.g. a new topic's partitions): the member then stays ``REBALANCING`` with no
        partitions for good. If that lasts ``REJOIN_AFTER`` seconds, ask the coordinator
        to rejoin (harmless while a join is still in flight: it is awaited again).
        """
        state = getattr(client.group_metadata(), "state", None)
        if state == MemberState.STABLE:
            self._rebalancing_since = None
            return False
        now = time.monotonic()
        if self._rebalancing_since is None:
            self._rebalancing_since = now
        elif now - self._rebalancing_since >= REJOIN_AFTER:
            coordinator = getattr(client, "_coordinator", None)
            request_rejoin = getattr(coordinator, "request_rejoin", None)
            if callable(request_rejoin):
                log.warning(
                    "group join did not complete; rejoining",
                    extra={"consumer": self.consumer_name, "state": str(state)},
                )
                request_rejoin()
            self._rebalancing_since = now
        return True

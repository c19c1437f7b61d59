"""The group-join watchdog: a poll waits for a join, a join that never completes is
started again (:class:`JoinWatch`).

Starting it again uses kafka-python's public API: leave the group and subscribe again
(``unsubscribe()`` + ``subscribe()``). Asking kafka-python's coordinator to rejoin
(``_coordinator.request_rejoin()``, an internal) was measured no faster: a lost join
repaired in 2.7–3.1 s either way (2 s watchdog), a rebalance held 15 s by a member that
does not poll completed after 16–18 s either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kafka.structs import MemberState

log = logging.getLogger(__name__)

#: Shortest poll while the group is (re)joining, so the join completes inside one call.
REBALANCE_POLL = 1.0
#: A join still not complete after this many seconds is started again (at least; see
#: :class:`JoinWatch`).
REJOIN_AFTER = 5.0
#: Seconds past the session timeout before a join counts as stuck.
SESSION_MARGIN = 2.0


class JoinWatch:
    """Watches one consumer's group membership (``consumer_name`` in the logs).

    ``resubscribe`` starts a stuck join again (``unsubscribe()``, then ``subscribe()``
    with the same topics and listener). A rebalance legitimately waits up to the session
    timeout for a member that died (``kill -9``) to be dropped, so a join counts as stuck
    only after ``session_timeout`` + ``SESSION_MARGIN`` seconds (at least
    ``REJOIN_AFTER``): starting it again earlier restarted healthy rebalances of every
    member in turn, a storm that held a 3-member group for minutes after one crash
    (issue 33's crash bench).
    """

    def __init__(
        self,
        consumer_name: str,
        resubscribe: Callable[[], None],
        *,
        session_timeout: float = 0.0,
    ) -> None:
        self.consumer_name = consumer_name
        self._resubscribe = resubscribe
        self._rejoin_after = max(REJOIN_AFTER, session_timeout + SESSION_MARGIN)
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
        partitions for good. If that lasts ``REJOIN_AFTER`` seconds, leave the group and
        join it again.
        """
        state = getattr(client.group_metadata(), "state", None)
        if state == MemberState.STABLE:
            self._rebalancing_since = None
            return False
        now = time.monotonic()
        if self._rebalancing_since is None:
            self._rebalancing_since = now
        elif now - self._rebalancing_since >= self._rejoin_after:
            log.warning(
                "group join did not complete; leaving the group and subscribing again",
                extra={"consumer": self.consumer_name, "state": str(state)},
            )
            self._resubscribe()
            self._rebalancing_since = now
        return True

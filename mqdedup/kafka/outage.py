"""Noticing a Kafka outage that the client rides out inside its own poll.

kafka-python absorbs a broker outage: its poll keeps returning nothing, it reconnects
on its own, and no error reaches the transport. So the transport samples the client's
connection state through a public API, at most once per :data:`CHECK_INTERVAL` while
polls return nothing, and logs the outage through
:class:`~mqdedup.outages.OutageLog`: one WARNING when it starts, one INFO with its
duration when it ends (the Transport contract's recovery bounds).

The probe (a public API; measured on kafka-python 3.0.12, see docs/kafka.md "Recovery
times"):

* kafka-python: ``KafkaConsumer.metrics()["consumer-metrics"]["connection-count"]``, the
  number of open broker connections (0 within a second of a broker kill, back when the
  client reconnected). ``metrics()`` returns nothing with ``metrics_enabled=False``, and
  kafka-python calls it an unstable interface: a missing value means "unknown" and no
  outage is logged (the behaviour before the probe existed).

A probe's answer must hold for :data:`SETTLE` seconds before the state flips (both ways),
so a partition just resumed after a long batch, or one refused reconnect in a restart,
is not an outage. Records arriving end an outage at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mqdedup.outages import OutageLog

#: Least seconds between two samples of the probe.
CHECK_INTERVAL = 1.0
#: Seconds a probe's answer must hold before the outage starts or ends.
SETTLE = 2.0


class OutageWatch:
    """Samples ``probe`` (True: connected, False: not, None: unknown) and logs through
    ``outage``. One owner (the poll thread)."""

    def __init__(
        self,
        outage: OutageLog,
        probe: Callable[[], bool | None],
        *,
        interval: float = CHECK_INTERVAL,
        settle: float = SETTLE,
    ) -> None:
        self.outage = outage
        self.probe = probe
        self.interval = interval
        self.settle = settle
        self._next_check = 0.0
        #: Since when the probe contradicts the current state (None: it does not).
        self._contradicted: float | None = None

    def idle(self) -> None:
        """A poll returned nothing: sample the probe if :data:`CHECK_INTERVAL` passed."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.interval
        try:
            connected = self.probe()
        except Exception:
            connected = None  # the client's state is unknown: change nothing
        if connected is None or connected is not self.outage.ongoing:
            self._contradicted = None
            return
        if self._contradicted is None:
            self._contradicted = now
        elif now - self._contradicted >= self.settle:
            self._flip(connected)

    def working(self) -> None:
        """Records arrived: the broker answers, an ongoing outage is over."""
        if self.outage.ongoing:
            self._flip(True)

    def _flip(self, connected: bool) -> None:
        self._contradicted = None
        if connected:
            self.outage.up()
        else:
            self.outage.down("no broker connection", "kafka unreachable; the client reconnects")


def kafka_python_probe(consumer: Any) -> Callable[[], bool | None]:
    """Connected per kafka-python's ``connection-count`` metric (None: no metrics)."""

    def probe() -> bool | None:
        metrics = consumer.metrics()
        if not metrics:
            return None
        count = metrics.get("consumer-metrics", {}).get("connection-count")
        return None if count is None else bool(count > 0)

    return probe

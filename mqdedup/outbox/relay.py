"""The relay: moves committed outbox rows to Kafka / RabbitMQ, at least once.

One cycle:

1. **claim** a batch of due pending rows, oldest id first, in a short transaction that
   reads the rows (writing nothing on them) and takes or renews the relay's one lease
   row in ``<prefix>outbox_leases`` (its shards, until ``now + lease``);
2. **publish** them with no transaction or row lock open (Kafka: ``acks=all``,
   idempotent producer, one flush; RabbitMQ: persistent, ``mandatory``, publisher
   confirms in a window);
3. **mark** the published rows (or delete them and count them per destination and
   hour, ``delete_published=True``); rows the broker refused for their own reason get
   an attempt, a backoff and, after ``max_attempts``, the ``failed`` state (kept, never
   deleted; see :meth:`Relay.retry_failed`); rows not published because the broker was
   unavailable stay pending unchanged and that broker is paused with backoff.

Batches follow each other in a *burst* (the next one claimed while one is published,
ids above it); when the burst is settled the relay removes its lease. A relay that dies
between 2 and 3 leaves its lease and its rows pending: a relay taking over its shards
waits until the lease expires, then publishes them a second time with the same message
ids, which the next consumer's dedup absorbs.

Several relays can run at once on PostgreSQL and MySQL/MariaDB: rows are sharded by key
hash and each shard is owned by one relay through a lock, so a key's rows are published
by one relay in id order. The relay sees this only through
:class:`~mqdedup.outbox.coordination.ShardCoordinator`, built by
:func:`~mqdedup.outbox.shard_coordinators.create_coordinator` from the database's traits.
SQLite has neither row locks nor advisory locks: run a single relay there, which polls.

This module drives the cycles (bursts, waiting, maintenance, shutdown); the steps of one
cycle and the relay's state are in :mod:`~mqdedup.outbox.relay_cycle`. Its other parts:
settings (:mod:`~mqdedup.outbox.relay_config`), bookkeeping
(:mod:`~mqdedup.outbox.relay_metrics`), helper threads and connections
(:mod:`~mqdedup.outbox.relay_connections`), publishing a batch
(:mod:`~mqdedup.outbox.relay_publishing`), broker backoff
(:mod:`~mqdedup.outbox.broker_pauses`) and shard take-over
(:mod:`~mqdedup.outbox.lease_takeover`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from mqdedup.db.dialects import is_transient
from mqdedup.outages import Outages
from mqdedup.outbox.publishers import OutboxRecord
from mqdedup.outbox.relay_cycle import RelayCycle, RelayStoppedError
from mqdedup.outbox.relay_metrics import CycleReport, RelayMetrics
from mqdedup.outbox.store import OutboxStatus
from mqdedup.stopping import StopToken, graceful_signals

log = logging.getLogger(__name__)


class Relay(RelayCycle):
    """Publishes committed outbox rows through ``publishers`` (broker name → publisher).

    ``publishers`` maps the ``broker`` column (``kafka``, ``rabbitmq`` or a custom
    name given to the writer) to a :class:`~mqdedup.outbox.publishers.Publisher`. Rows
    for other brokers are left for relays that have one.
    """

    # -- the daemon ----------------------------------------------------------------------------

    def run(
        self,
        stop: StopToken | None = None,
        *,
        until_idle: bool = False,
        handle_signals: bool = False,
    ) -> RelayMetrics:
        """Relay until ``stop`` is requested (or, with ``until_idle``, nothing is claimable).

        A stop lets the batch in flight finish: published, marked, then return (rows
        claimed ahead for the next batch are released). With ``handle_signals``
        SIGTERM/SIGINT request that stop (a second one stops at once). Publishers and
        the control connection are closed on the way out.
        """
        if stop is not None:
            self.stop = stop
        log.info(
            "relay started",
            extra={
                "relay": self.relay_id,
                "table": self.store.table.name,
                "brokers": sorted(self.publishers),
            },
        )
        with self._signals(handle_signals):
            try:
                while not self.stop.requested:
                    try:
                        self._maintain()
                        moved = self._burst()
                    except RelayStoppedError:
                        break
                    if moved:
                        continue  # more may be waiting; an empty claim leads to the wait
                    if until_idle and not self._paused_brokers():
                        break
                    self._idle()
            finally:
                self.close()
        log.info(
            "relay stopped",
            extra={"relay": self.relay_id, **self.metrics.snapshot(histograms=False)},
        )
        return self.metrics

    def run_once(self) -> CycleReport:
        """One claim → publish → mark cycle without overlap (plus due maintenance)."""
        self._maintain()
        records = self._with_database_retry(self._claim)
        if not records:
            return CycleReport()
        report = self._publish_batch(records)
        self._before_mark(report)
        self._settle(report)
        self._end_lease()
        return report

    def drain(self, timeout: float = 60.0) -> RelayMetrics:
        """Publish until nothing is claimable (tests, one-shot jobs); bounded by ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._maintain()
            moved = self._burst(until=deadline)
            if not moved and not self._paused_brokers():
                return self.metrics
            if not moved:
                self._idle(min(self.config.poll_interval, max(0.0, deadline - time.monotonic())))
        raise TimeoutError(f"outbox not drained within {timeout} s")

    def _burst(self, until: float | None = None) -> int:
        """Claim → publish → mark, batch after batch; return the rows claimed.

        While a batch is being published, the next one is claimed and the previous one
        marked on two helper threads, so the broker and the database work at the same
        time. A batch that did not publish completely ends the burst: the rows claimed
        ahead are dropped (they stay pending) and its failures are settled first, so a
        key's later rows never overtake a row that has to be retried. The burst also ends
        at maintenance time (shards may move between bursts only) and on a stop request.
        """
        if until is None:
            due = [self._next_rebalance] if self._control is not None else []
            if self.config.retention is not None:
                due.append(self._next_purge)
            until = min(due, default=float("inf"))
        batch = self._with_database_retry(self._claim)
        claimed = 0
        marks: list[tuple[Future[None], list[int]]] = []
        try:
            while batch:
                claimed += len(batch)
                ahead: Future[list[OutboxRecord]] | None = None
                if not self.stop.requested and time.monotonic() < until:
                    # Rows of this batch and of batches still being marked are pending
                    # yet: the claim made ahead must skip them.
                    marks = _unfinished(marks)
                    in_flight = [record.id for record in batch]
                    in_flight.extend(row_id for _, ids in marks for row_id in ids)
                    ahead = self._connections.helper("claim").submit(
                        self._with_database_retry,
                        functools.partial(self._claim, in_flight),
                        background=True,
                    )
                report = self._publish_batch(batch)
                self._before_mark(report)
                if ahead is not None and report.complete and not self.stop.requested:
                    marker = self._connections.helper("mark")
                    marks.append(
                        (
                            marker.submit(self._settle, report, True),
                            [record.id for record in batch],
                        )
                    )
                    batch = ahead.result()
                    continue
                if ahead is not None:
                    ahead.result()  # dropped: its rows stay pending for the next burst
                for mark, _ in marks:  # the marking connection is free again after these
                    mark.result()
                marks.clear()
                self._settle(report)
                batch = []
        finally:
            for mark, _ in marks:
                mark.result()
        if claimed:
            self._end_lease()
        return claimed

    def close(self) -> None:
        """Close the publishers and the control connection (releases shards)."""
        self._connections.close()
        for name, publisher in self.publishers.items():
            try:
                publisher.close()
            except Exception:
                log.exception("closing publisher failed", extra={"broker": name})
        if self._control is not None:
            self._control.close()

    # -- operators -----------------------------------------------------------------------------

    def status(self) -> OutboxStatus:
        """Pending / failed / published counts, per destination."""
        return self.store.status(self.engine)

    def retry_failed(self, **narrow: Any) -> int:
        """Put failed rows back to pending (see :meth:`OutboxStore.retry_failed`)."""
        return self.store.retry_failed(self.engine, **narrow)

    def purge(self) -> int:
        """Delete published rows older than the retention now; return how many."""
        if self.config.retention is None:
            return 0
        deleted = self.store.purge(self.engine, self.config.retention, self.config.purge_chunk_size)
        self.metrics.purged += deleted
        return deleted

    # -- waiting and maintenance ---------------------------------------------------------------

    def _idle(self, limit: float | None = None) -> None:
        """Wait for a notification, the poll interval, the next broker retry or a stop."""
        timeout = self.config.poll_interval if limit is None else limit
        next_retry = self._brokers.next_retry()
        if next_retry is not None:
            timeout = min(timeout, max(0.0, next_retry - time.monotonic()))
        control = self._control
        if control is not None and control.notifies and control.connected and control.owned:
            deadline = time.monotonic() + timeout
            # Short slices: heartbeats and stop requests are served while listening.
            while (remaining := deadline - time.monotonic()) > 0 and not self.stop.requested:
                try:
                    if control.wait(min(remaining, 0.5)):
                        break
                except Exception as error:
                    if not is_transient(error):
                        raise
                    log.warning("relay control connection lost", extra={"error": str(error)})
                    control.close()
                    break
                self._keepalive()
        else:
            self._pause(timeout)

    def _pause(self, seconds: float) -> bool:
        """Sleep, serving publisher heartbeats; False if a stop was requested."""
        outages = Outages(
            stop=self.stop, is_transient=is_transient, keepalive=self._keepalive, slice_seconds=0.5
        )
        return outages.pause(seconds)

    def _maintain(self) -> None:
        now = time.monotonic()
        control = self._control
        if control is not None and (
            not control.connected or not control.owned or now >= self._next_rebalance
        ):
            self._with_database_retry(self._rebalance)
            self._next_rebalance = now + self.config.rebalance_interval
        if self.config.retention is not None and now >= self._next_purge:
            self._next_purge = now + self.config.purge_interval
            self._with_database_retry(self.purge)

    def _rebalance(self) -> None:
        control = self._control
        assert control is not None
        try:
            if not control.connected:
                control.open()
            control.rebalance()
        except Exception:
            control.close()
            raise

    # -- infrastructure ------------------------------------------------------------------------

    @contextmanager
    def _signals(self, enabled: bool) -> Iterator[None]:
        if not enabled:
            yield
            return
        with graceful_signals(self.stop):
            yield


def _unfinished(
    marks: list[tuple[Future[None], list[int]]],
) -> list[tuple[Future[None], list[int]]]:
    """The marks still running (with their row ids); a finished one raises its error."""
    running = []
    for mark, ids in marks:
        if mark.done():
            mark.result()
        else:
            running.append((mark, ids))
    return running

"""The relay: the daemon that moves committed outbox rows to Kafka / RabbitMQ, at least
once. :class:`Relay` claims due pending rows, publishes them through its publishers
(:mod:`~mqdedup.outbox.relay_publishing`) and marks them, batch after batch, waiting for
notifications or polling in between and riding out database and broker outages; with it
live its settings (:class:`RelayConfig`), its counters (:class:`RelayMetrics`) and its
helper threads with their database connections; it shares the table with other relays
through shard coordination (:mod:`~mqdedup.outbox.coordination`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine

from mqdedup.backoff import Backoff
from mqdedup.db.dialects import is_transient, prepare_relay_connection, traits
from mqdedup.db.pooling import session_state_works
from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.dedup.store import utcnow
from mqdedup.errors import ConfigurationError
from mqdedup.histograms import Histograms
from mqdedup.outages import Outages
from mqdedup.outbox.publishers import OutboxRecord, Publisher, PublishResult
from mqdedup.outbox.relay_coordination import (
    RelayCoordination,
    check_coordination_mode,
    relay_coordination,
)
from mqdedup.outbox.relay_publishing import BrokerPauses, CycleReport, publish_records
from mqdedup.outbox.store import OutboxStatus, OutboxStore
from mqdedup.stopping import StopToken, graceful_signals

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RelayConfig:
    """How a relay claims, retries and cleans up.

    * ``batch_size``: rows per claim (and per flush / confirm round). A relay holds up to
      three batches (one claimed ahead, one publishing, one being marked): lower it when
      rows are large. Larger batches spread each batch's fixed costs (the claim's round
      trip, the final flush or the last confirms) over more rows.
    * ``poll_interval``: seconds between polls when no notification arrives.
    * ``lease``: seconds a claimed row stays reserved; must exceed the time to publish a
      batch (the publishers' own timeouts), or a slow batch is published twice.
    * ``max_attempts``, ``initial_backoff``, ``max_backoff``: per-row retries after the
      broker refused the row (unroutable, too large); then the row is ``failed``.
    * ``broker_backoff_max``: longest pause between tries while a broker is unavailable.
    * ``database_backoff_max``: longest pause between tries while the database is down.
    * ``delete_published``: delete rows once published and count them per destination
      and hour in ``<prefix>outbox_counts`` (the default: a delete costs the database
      about a fifth of the mark's update); ``False`` marks them ``published`` and keeps
      them for ``retention``.
    * ``retention``: published rows kept (``delete_published=False``) older than this are
      purged every ``purge_interval`` seconds, ``purge_chunk_size`` rows per transaction
      (``None``: never).
    * ``shards``: PostgreSQL and MySQL/MariaDB; every relay of one table must use the
      same number.
    * ``rebalance_interval``: seconds between shard rebalancing checks.
    * ``listen``: use ``LISTEN``/``NOTIFY`` on PostgreSQL (MySQL/MariaDB always poll).
    * ``coordination`` (PostgreSQL): ``session`` (the default) shares the table through
      session advisory locks and ``LISTEN`` on a control connection (the relay's
      ``control_engine``, else its engine), which needs a session: a direct connection
      or a pooler in session mode. ``transaction`` needs no session state, for a
      database reached only through a transaction pooler (PgBouncer
      ``pool_mode = transaction``): each claim takes a transaction-level advisory lock
      and claims nothing while another relay's lease is live, so relays take turns
      (one publishes at a time) and poll every ``poll_interval``. Relays of both kinds
      may share a table (a rolling switch): turn-taking ones claim nothing while a
      ``session`` relay runs (see :class:`~mqdedup.outbox.coordination.PostgreSQLCoordinator`).
    """

    batch_size: int = 2000
    poll_interval: float = 1.0
    lease: float = 60.0
    max_attempts: int = 10
    initial_backoff: float = 1.0
    max_backoff: float = 300.0
    broker_backoff_max: float = 10.0
    database_backoff_max: float = 5.0
    delete_published: bool = True
    retention: timedelta | None = timedelta(days=7)
    purge_interval: float = 600.0
    purge_chunk_size: int = 5000
    shards: int = 16
    rebalance_interval: float = 5.0
    listen: bool = True
    coordination: str = "session"

    def __post_init__(self) -> None:
        check_coordination_mode(self.coordination)
        if self.batch_size < 1:
            raise ConfigurationError("relay batch_size must be at least 1")
        if self.max_attempts < 1:
            raise ConfigurationError("relay max_attempts must be at least 1")
        if self.lease <= 0 or self.poll_interval <= 0:
            raise ConfigurationError("relay lease and poll_interval must be positive")
        if self.initial_backoff < 0 or self.max_backoff < 0 or self.broker_backoff_max <= 0:
            raise ConfigurationError(
                "relay backoffs must not be negative and broker_backoff_max must be positive"
            )
        if self.purge_chunk_size < 1:
            raise ConfigurationError("relay purge_chunk_size must be at least 1")

    def row_backoff(self, attempts: int) -> float:
        """Seconds before a refused row's next try (exponential, capped, ±10% jitter)."""
        return Backoff(self.initial_backoff, self.max_backoff, jitter=(0.9, 1.1)).delay(attempts)


@dataclass
class RelayMetrics:
    """What one relay has done since it started."""

    batches: int = 0
    claimed: int = 0
    published: int = 0
    rejected: int = 0
    failed: int = 0
    unavailable: int = 0
    broker_outages: int = 0
    database_retries: int = 0
    #: What the relay is waiting for while it cannot make progress (None: nothing).
    outage: str | None = None
    purged: int = 0
    seconds_publishing: float = 0.0
    #: ``publish_delay_seconds``: an outbox row's commit to its confirmed publish.
    histograms: Histograms = field(default_factory=Histograms, repr=False)

    def snapshot(self, *, histograms: bool = True) -> dict[str, Any]:
        """A plain copy for the metrics endpoint (``histograms=False``: for a log line)."""
        data = {
            item.name: getattr(self, item.name)
            for item in fields(self)
            if item.name != "histograms"
        }
        if histograms:
            data["histograms"] = self.histograms.snapshot()
        return data


class RelayStoppedError(Exception):
    """A stop was requested while the relay waited for the database."""


class Relay:
    """Publishes committed outbox rows through ``publishers`` (broker name → publisher).

    ``publishers`` maps the ``broker`` column (``kafka``, ``rabbitmq`` or a custom
    name given to the writer) to a :class:`~mqdedup.outbox.publishers.Publisher`. Rows
    for other brokers are left for relays that have one.

    One cycle:

    1. **claim** a batch of due pending rows, oldest id first, in a short transaction
       that reads the rows (writing nothing on them) and takes or renews the relay's one
       lease row in ``<prefix>outbox_leases`` (its shards, until ``now + lease``);
    2. **publish** them with no transaction or row lock open (Kafka: ``acks=all``,
       idempotent producer, one flush; RabbitMQ: persistent, ``mandatory``, publisher
       confirms in a window);
    3. **mark** the published rows (or delete them and count them per destination and
       hour, ``delete_published=True``); rows the broker refused for their own reason get
       an attempt, a backoff and, after ``max_attempts``, the ``failed`` state (kept,
       never deleted; see :meth:`retry_failed`); rows not published because the broker
       was unavailable stay pending unchanged and that broker is paused with backoff.

    Batches follow each other in a *burst* (the next one claimed while one is published,
    ids above it); when the burst is settled the relay removes its lease. A relay that
    dies between 2 and 3 leaves its lease and its rows pending: a relay taking over its
    shards waits until the lease expires, then publishes them a second time with the same
    message ids, which the next consumer's dedup absorbs.

    Several relays can run at once on PostgreSQL and MySQL/MariaDB: rows are sharded by
    key hash and each shard is owned by one relay through a lock, so a key's rows are
    published by one relay in id order. The relay sees this only through its
    :class:`~mqdedup.outbox.relay_coordination.RelayCoordination`, one class per mode,
    chosen once by :func:`~mqdedup.outbox.relay_coordination.relay_coordination` from the
    configured mode and the database's traits. SQLite has neither row locks nor advisory
    locks: run a single relay there, which polls.
    """

    def __init__(
        self,
        engine: Engine,
        publishers: Mapping[str, Publisher],
        *,
        prefix: str = DEFAULT_PREFIX,
        config: RelayConfig | None = None,
        relay_id: str | None = None,
        control_engine: Engine | None = None,
    ) -> None:
        if not publishers:
            raise ConfigurationError("a relay needs at least one publisher (kafka or rabbitmq)")
        traits(engine)  # ConfigurationError for a database mqdedup does not support
        self.engine = engine
        self.publishers = dict(publishers)
        self.config = config or RelayConfig()
        self.store = OutboxStore(prefix)
        self.relay_id = relay_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.metrics = RelayMetrics()
        self.stop = StopToken()
        self._brokers = BrokerPauses(publishers, self.config.broker_backoff_max)
        #: How this relay shares its table (its mode, chosen once).
        self.coordination: RelayCoordination = relay_coordination(
            engine,
            control_engine,
            coordination=self.config.coordination,
            store=self.store,
            relay_id=self.relay_id,
            brokers=list(publishers),
            shards=self.config.shards,
            listen=self.config.listen,
            rebalance_interval=self.config.rebalance_interval,
            batch_size=self.config.batch_size,
            lease=self.config.lease,
        )
        self._next_purge = 0.0
        self._connections = RelayConnections(
            engine, dedicated=self.coordination.dedicated_connections
        )
        self._metrics_lock = threading.Lock()

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
                "coordination": self.config.coordination,
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
            due = [self.coordination.next_maintenance()]
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
        self.coordination.close()

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

    # -- the steps of one cycle ----------------------------------------------------------------

    def _on(self, name: str, statement: Callable[..., T], *arguments: Any, **options: Any) -> T:
        """Run a store statement on the relay's ``name`` connection (claim / mark)."""
        return self._connections.on(name, statement, *arguments, **options)

    def _claim(self, in_flight: Sequence[int] = ()) -> list[OutboxRecord]:
        """Claim the next batch, skipping ``in_flight`` (this relay's unsettled rows)."""
        brokers = [name for name in self.publishers if name not in self._paused_brokers()]
        if not brokers:
            return []
        return self.coordination.claim(functools.partial(self._on, "claim"), brokers, in_flight)

    def _end_lease(self) -> None:
        """Remove this relay's lease once its batches are settled (shards may move)."""
        self._with_database_retry(lambda: self._on("mark", self.store.end_lease, self.relay_id))

    def _publish_batch(self, records: Sequence[OutboxRecord]) -> CycleReport:
        """Send each broker's records through its publisher (id order per broker)."""
        started = time.monotonic()
        report = publish_records(self.publishers, records, self._broker_result)
        now = utcnow()
        with self._metrics_lock:
            for record in report.published:
                delay = (now - record.created_at).total_seconds()
                self.metrics.histograms.observe("publish_delay_seconds", max(0.0, delay))
            self.metrics.batches += 1
            self.metrics.claimed += len(records)
            self.metrics.seconds_publishing += time.monotonic() - started
        return report

    def _before_mark(self, report: CycleReport) -> None:
        """Hook between publishing and marking (fault-injection tests override it)."""

    def _settle(self, report: CycleReport, background: bool = False) -> None:
        """Mark published rows, count refused ones; the others stay pending."""
        config = self.config
        if report.published:
            published = report.published
            self._with_database_retry(
                lambda: self._on(
                    "mark",
                    self.store.mark_published,
                    published,
                    delete_rows=config.delete_published,
                ),
                background=background,
            )
            with self._metrics_lock:
                self.metrics.published += len(published)
        if report.rejected:
            for record, error in report.rejected:
                log.warning(
                    "broker refused an outbox row; it will be retried",
                    extra={
                        "message_id": record.message_id,
                        "broker": record.broker,
                        "destination": record.destination,
                        "attempt": record.attempts + 1,
                        "error": error,
                    },
                )
            report.failed = self._with_database_retry(
                lambda: self.store.record_failures(
                    self.engine, report.rejected, config.max_attempts, config.row_backoff
                )
            )
            with self._metrics_lock:
                self.metrics.rejected += len(report.rejected)
                self.metrics.failed += len(report.failed)
            for record in report.failed:
                log.error(
                    "outbox row failed after its last attempt; kept as failed",
                    extra={
                        "message_id": record.message_id,
                        "broker": record.broker,
                        "destination": record.destination,
                        "attempts": record.attempts + 1,
                    },
                )
        if report.unavailable:  # left pending as they are: the next claim finds them
            with self._metrics_lock:
                self.metrics.unavailable += len(report.unavailable)

    def _broker_result(self, broker: str, results: Sequence[PublishResult]) -> None:
        if self._brokers.record(broker, results):
            self.metrics.broker_outages += 1

    def _paused_brokers(self) -> set[str]:
        return self._brokers.paused()

    def _keepalive(self) -> None:
        for name, publisher in self.publishers.items():
            try:
                publisher.keepalive()
            except Exception:
                log.warning("publisher keepalive failed", extra={"broker": name}, exc_info=True)

    def _with_database_retry(self, work: Callable[[], T], *, background: bool = False) -> T:
        """Run ``work`` through database outages (:class:`~mqdedup.outages.Outages`).

        ``background``: called from a helper thread, which must not touch the publishers
        (their connections belong to the relay's thread).
        """
        outages = Outages(
            stop=self.stop,
            is_transient=is_transient,
            backoff_max=self.config.database_backoff_max,
            keepalive=self._keepalive,
            on_retry=self._count_database_retry,
            on_change=self._set_outage,
            stopped=RelayStoppedError,
            context={"relay": self.relay_id},
            slice_seconds=0.5,
        )
        return outages.run(work, background=background)

    def _count_database_retry(self) -> None:
        with self._metrics_lock:
            self.metrics.database_retries += 1

    def _set_outage(self, cause: str | None) -> None:
        self.metrics.outage = cause

    # -- waiting and maintenance ---------------------------------------------------------------

    def _idle(self, limit: float | None = None) -> None:
        """Wait for a notification, the poll interval, the next broker retry or a stop."""
        timeout = self.config.poll_interval if limit is None else limit
        next_retry = self._brokers.next_retry()
        if next_retry is not None:
            timeout = min(timeout, max(0.0, next_retry - time.monotonic()))
        self.coordination.idle(
            timeout, pause=self._pause, keepalive=self._keepalive, stop=self.stop
        )

    def _pause(self, seconds: float) -> bool:
        """Sleep, serving publisher heartbeats; False if a stop was requested."""
        outages = Outages(
            stop=self.stop, is_transient=is_transient, keepalive=self._keepalive, slice_seconds=0.5
        )
        return outages.pause(seconds)

    def _maintain(self) -> None:
        now = time.monotonic()
        self.coordination.maintain(now, self._with_database_retry)
        if self.config.retention is not None and now >= self._next_purge:
            self._next_purge = now + self.config.purge_interval
            self._with_database_retry(self.purge)

    # -- infrastructure ------------------------------------------------------------------------

    @contextmanager
    def _signals(self, enabled: bool) -> Iterator[None]:
        if not enabled:
            yield
            return
        with graceful_signals(self.stop):
            yield


class RelayConnections:
    """One helper thread and one database connection per name (``claim``, ``mark``).

    ``dedicated``: the relay shares its table with other relays (PostgreSQL,
    MySQL/MariaDB); otherwise (SQLite) statements run on the engine's pool.
    """

    def __init__(self, engine: Engine, *, dedicated: bool) -> None:
        self.engine = engine
        self.dedicated = dedicated
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._connections: dict[str, Connection] = {}

    def on(self, name: str, statement: Callable[..., T], *arguments: Any, **options: Any) -> T:
        """Run a store statement on the relay's ``name`` connection (claim / mark).

        On PostgreSQL each helper has its own connection, detached from the pool, in
        autocommit with the relay's session settings: a claim or a mark is one round
        trip. On MySQL/MariaDB likewise, at ``READ COMMITTED``, each statement group in
        its own transaction. A connection that failed is dropped; the retry opens a new
        one.
        """
        if not self.dedicated:
            return statement(self.engine, *arguments, **options)
        connection = self._connections.get(name)
        if connection is None or connection.closed or connection.invalidated:
            connection = self.engine.connect()
            if not session_state_works(connection):
                # A transaction pooler: session settings would reach other clients'
                # transactions. Each statement group runs as a short transaction
                # with SET LOCAL instead.
                connection.close()
                self.dedicated = False
                log.info("relay statements run as pooled transactions (transaction pooler)")
                return statement(self.engine, *arguments, **options)
            connection = prepare_relay_connection(connection)
            connection.detach()  # the session settings must not reach the pool
            self._connections[name] = connection
        try:
            return statement(connection, *arguments, **options)
        except Exception:
            self._connections.pop(name, None)
            _give_back(connection)
            raise

    def helper(self, name: str) -> ThreadPoolExecutor:
        """The ``name`` helper thread (one worker, started on first use)."""
        executor = self._executors.get(name)
        if executor is None:
            executor = ThreadPoolExecutor(1, thread_name_prefix=f"mqdedup-relay-{name}")
            self._executors[name] = executor
        return executor

    def close(self) -> None:
        """Wait for the helper threads, then close their connections."""
        for executor in self._executors.values():
            executor.shutdown(wait=True)
        self._executors.clear()
        for connection in self._connections.values():
            _give_back(connection)
        self._connections.clear()


def _give_back(connection: Connection) -> None:
    """Close a relay connection, first undoing its session settings (PostgreSQL ``RESET
    ALL``): behind a session pooler its server goes to the next client."""
    with contextlib.suppress(Exception):  # a broken connection: its session is gone
        if traits(connection).family == "postgresql" and not connection.invalidated:
            connection.exec_driver_sql("RESET ALL")
    with contextlib.suppress(Exception):
        connection.close()


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

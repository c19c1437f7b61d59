"""``mqdedup worker`` and ``mqdedup relay``: what is checked before they start (settings,
the database and its schema, the brokers), then the supervisor that runs their child
processes (:mod:`mqdedup.cli.runners`) and serves, beside the children's metrics, the
outbox backlog (:class:`OutboxGauges`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from sqlalchemy import Engine

from mqdedup.cli import exitcodes
from mqdedup.cli.admin import require_current_schema
from mqdedup.cli.config import consumer_prefix, resolve_settings
from mqdedup.cli.drain import drain_outbox
from mqdedup.cli.lifecycle import (
    RELAY_COUNTS,
    WORKER_COUNTS,
    relay_start_line,
    say,
    stop_line,
    sum_counters,
    worker_start_line,
)
from mqdedup.cli.lineage import Slot, lock_slots
from mqdedup.cli.loading import create_consumer
from mqdedup.cli.reachability import check_relay_brokers, connect_broker
from mqdedup.cli.runners import _export_environment, create_publishers
from mqdedup.cli.supervisor import ChildSpec, Supervisor, stop_signals
from mqdedup.db.engine import check_connection, create_engine
from mqdedup.db.replication import replication_warning
from mqdedup.errors import (
    ConfigurationError,
)
from mqdedup.masking import mask_url
from mqdedup.outbox.coordination import check_control_connection, check_coordination
from mqdedup.outbox.store import OutboxStore

log = logging.getLogger(__name__)


def cmd_worker(args: argparse.Namespace) -> int:
    settings = resolve_settings(
        args,
        "database_url",
        "table_prefix",
        "kafka_bootstrap",
        "rabbitmq_url",
        "redis_url",
        "processes",
        "shutdown_timeout",
        "health_port",
        "health_host",
    )
    if settings["processes"] < 1:
        raise ConfigurationError("--processes must be at least 1")
    _check_shutdown_timeout(settings)
    _export_environment(settings)
    consumers = [create_consumer(reference) for reference in args.consumers]
    # Consumers whose claims live outside the database (RedisDedup) need none.
    database_consumers = [c for c in consumers if c.dedup.needs_database]
    prefixes = {
        reference: consumer_prefix(args, reference, consumer)
        for reference, consumer in zip(args.consumers, consumers, strict=True)
        if consumer.dedup.needs_database
    }
    for consumer in consumers:
        consumer.validate()
    # Before anything waits: a second supervisor of these consumers is refused at once.
    locks = lock_slots(
        [
            Slot(
                "worker",
                consumer.consumer_name,
                settings["database_url"],
                prefixes.get(reference, settings["table_prefix"]),
            )
            for reference, consumer in zip(args.consumers, consumers, strict=True)
        ]
    )
    for consumer in consumers:
        consumer.dedup.check()  # e.g. Redis unreachable: one line, exit code 5
    if database_consumers:
        engine = create_engine(settings["database_url"])
        check_connection(engine)
        for database_consumer in database_consumers:
            require_current_schema(engine, database_consumer.table_prefix)
        replication = replication_warning(engine)
        if replication is not None:
            log.warning(replication, extra={"database": mask_url(engine.url)})
        engine.dispose()
    try:
        with _stop_signals_end_the_wait():
            for consumer in consumers:
                connect_broker(consumer)
    except _StoppedWhileWaitingError:
        log.info("stop signal while waiting for the broker; not starting the workers")
        return exitcodes.OK  # a stop is not an error, in any state (Transport contract)
    specs = [
        ChildSpec(
            name=consumer.consumer_name,
            index=index,
            # What a child runs: ``mqdedup.django`` sets its own (Django's connection).
            runner=getattr(args, "worker_runner", None) or "mqdedup.cli.runners:run_consumer",
            options={
                "consumer": reference,
                **settings,
                "table_prefix": prefixes.get(reference, settings["table_prefix"]),
            },
            log_level=args.log_level,
            log_format=args.log_format,
        )
        for reference, consumer in zip(args.consumers, consumers, strict=True)
        for index in range(settings["processes"])
    ]
    shared = set(prefixes.values())
    start = worker_start_line(consumers, settings, database=bool(database_consumers))
    return _supervise(
        specs,
        settings,
        locks,
        outbox_gauges=bool(database_consumers),
        prefix=shared.pop() if len(shared) == 1 else None,
        announce=None if getattr(args, "quiet", False) else ("worker", start, WORKER_COUNTS),
    )


class _StoppedWhileWaitingError(Exception):
    """SIGTERM/SIGINT while the worker command waited for an unreachable broker."""


@contextlib.contextmanager
def _stop_signals_end_the_wait() -> Iterator[None]:
    """Within the block, SIGTERM/SIGINT/SIGHUP end the wait for the broker (then exit 0)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _stop(_signum: int, _frame: FrameType | None) -> None:
        raise _StoppedWhileWaitingError

    previous = {sig: signal.signal(sig, _stop) for sig in stop_signals()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_relay(args: argparse.Namespace) -> int:
    settings = resolve_settings(
        args,
        "database_url",
        "table_prefix",
        "kafka_bootstrap",
        "rabbitmq_url",
        "relay_processes",
        "poll_interval",
        "relay_batch_size",
        "relay_keep_published",
        "control_database_url",
        "relay_coordination",
        "shutdown_timeout",
        "health_port",
        "health_host",
    )
    if settings["relay_processes"] < 1:
        raise ConfigurationError("--processes must be at least 1")
    _check_shutdown_timeout(settings)
    table = OutboxStore(settings["table_prefix"]).table.name
    locks = lock_slots([Slot("relay", table, settings["database_url"], settings["table_prefix"])])
    engine = create_engine(settings["database_url"])
    check_connection(engine)
    require_current_schema(engine, settings["table_prefix"])
    _check_relay_coordination(engine, settings)
    engine.dispose()
    for publisher in create_publishers(
        kafka_bootstrap=settings["kafka_bootstrap"], rabbitmq_url=settings["rabbitmq_url"]
    ).values():
        publisher.close()  # validates the configuration; connections open lazily
    check_relay_brokers(settings["kafka_bootstrap"], settings["rabbitmq_url"])
    quiet = getattr(args, "quiet", False)
    start = relay_start_line(settings, table, drain=bool(getattr(args, "drain", False)))
    if getattr(args, "drain", False):
        if not quiet:
            say(start)
        try:
            return drain_outbox(settings, timeout=args.drain_timeout, quiet=quiet)
        finally:
            for fd in locks:  # the slot's lock, held by this process alone
                with contextlib.suppress(OSError):
                    os.close(fd)
    specs = [
        ChildSpec(
            name="relay",
            index=index,
            runner="mqdedup.cli.runners:run_relay",
            options=settings,
            log_level=args.log_level,
            log_format=args.log_format,
        )
        for index in range(settings["relay_processes"])
    ]
    return _supervise(
        specs, settings, locks, announce=None if quiet else ("relay", start, RELAY_COUNTS)
    )


def _check_shutdown_timeout(settings: dict[str, Any]) -> None:
    timeout = settings["shutdown_timeout"]
    if not math.isfinite(timeout) or timeout < 0:
        raise ConfigurationError(
            f"--shutdown-timeout must be a number of seconds, 0 or more; got {timeout}"
        )


def _check_relay_coordination(engine: Engine, settings: dict[str, Any]) -> None:
    """Refuse, in one line, a relay whose shard locks and LISTEN could not hold (a
    transaction pooler without a control database), before any child starts."""
    control_url = settings["control_database_url"]
    control = create_engine(control_url) if control_url else None
    try:
        if control is not None:
            check_connection(control)
        coordination = settings["relay_coordination"]
        table = OutboxStore(settings["table_prefix"]).table.name
        check_coordination(engine, control, coordination, table_name=table)
        if coordination == "session":
            check_control_connection(control or engine)
    finally:
        if control is not None:
            control.dispose()


def _supervise(
    specs: list[Any],
    settings: dict[str, Any],
    locks: list[int],
    *,
    outbox_gauges: bool = True,
    prefix: str | None = None,
    announce: tuple[str, str, Sequence[tuple[str, str]]] | None = None,
) -> int:
    """Run ``specs`` under a supervisor with the health endpoint; return its exit code.

    ``outbox_gauges``: report the outbox backlog on /metrics (not for Redis-only workers,
    which have no database). ``prefix``: the outbox's table prefix (default: the setting).
    ``locks``: the slot locks, which the children hold too (:mod:`mqdedup.cli.lineage`).
    ``announce``: (command, start line, counters of the stop line) to print on stderr
    when the children start and when the command ends (None: ``--quiet``).
    """

    gauges = OutboxGauges(settings["database_url"], prefix or settings["table_prefix"])
    supervisor = Supervisor(
        specs,
        shutdown_timeout=settings["shutdown_timeout"],
        health_port=settings["health_port"],
        health_host=settings["health_host"],
        shared_metrics=gauges if outbox_gauges else None,
        locks=locks,
    )
    if announce is None:
        return supervisor.run()
    command, start_line, counts = announce
    began: list[float] = []  # when the children started (the start line was printed)

    def _started() -> None:
        began.append(time.monotonic())
        say(start_line)

    code = exitcodes.INTERRUPTED  # unless run() returns: a second Ctrl-C while starting
    try:
        code = supervisor.run(on_start=_started)
        return code
    finally:
        if began:  # an error before the start (a health port in use) is its own line
            totals = sum_counters(supervisor.history())
            say(stop_line(command, code, time.monotonic() - began[0], totals, counts))


class OutboxGauges:
    """The outbox backlog for ``/metrics``, read at most every ``max_age`` seconds."""

    def __init__(self, database_url: str, prefix: str, max_age: float = 5.0) -> None:
        self.database_url = database_url
        self.prefix = prefix
        self.max_age = max_age
        self._engine: Engine | None = None
        self._value: dict[str, float] = {}
        self._read_at = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> dict[str, float]:
        """``{"backlog": pending rows, "oldest_pending_seconds": age}`` ({} if unreadable)."""

        with self._lock:
            if time.monotonic() - self._read_at < self.max_age:
                return self._value
            self._read_at = time.monotonic()
            try:
                if self._engine is None:
                    self._engine = create_engine(self.database_url, pool_size=1)
                status = OutboxStore(self.prefix).status(self._engine)
            except Exception:  # a scrape must not fail because the database is away
                log.warning("outbox backlog unavailable", exc_info=True)
                self._value = {}
                return self._value
            self._value = {
                "backlog": float(status.pending),
                "oldest_pending_seconds": float(status.oldest_pending_age or 0.0),
            }
            return self._value

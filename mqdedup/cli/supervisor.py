"""The process supervisor behind ``mqdedup worker`` and ``mqdedup relay``: it starts N
child processes per target (spawned, not forked, so no lock or connection of the parent
leaks into a child), restarts a child that dies with exponential backoff, forwards
SIGTERM/SIGINT/SIGHUP to the children for a graceful drain within the shutdown timeout,
and kills them on a second signal or when the timeout passes; children send their metrics
over a pipe, and the supervisor serves them on ``/metrics`` and the children's state on
``/healthz``. SIGHUP is a clean stop: there is nothing to reload (logs go to stderr,
settings are read at start). No child outlives its supervisor and no second supervisor
runs beside them (:mod:`mqdedup.cli.lineage`)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from mqdedup.backoff import Backoff
from mqdedup.cli import exitcodes
from mqdedup.cli.health import HealthServer, process_stats, snapshot_ready
from mqdedup.cli.lineage import Bond, Lifeline, watch_supervisor
from mqdedup.consumers.metrics import Metrics
from mqdedup.errors import ConfigurationError, MqdedupError
from mqdedup.logs import configure
from mqdedup.stopping import ImmediateStop, StopToken

log = logging.getLogger(__name__)

#: The signals that stop the supervisor cleanly (a second one of any: at once).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def stop_signals() -> tuple[signal.Signals, ...]:
    """:data:`STOP_SIGNALS`, without SIGHUP when it is ignored (``nohup``: keep it so)."""
    return tuple(
        sig
        for sig in STOP_SIGNALS
        if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN
    )


METRICS_INTERVAL = 1.0
RESTART_BACKOFF_INITIAL = 0.5
RESTART_BACKOFF_MAX = 30.0
#: A child that ran at least this long gets its restart backoff reset.
STABLE_AFTER = 30.0


class MetricsHolder:
    """What a child reports: ``source`` is anything with ``snapshot() -> dict``.

    Consumers count into the default :class:`~mqdedup.consumers.metrics.Metrics`; a
    relay replaces ``source`` with its own counters.
    """

    def __init__(self, source: Any) -> None:
        self.source = source

    def snapshot(self) -> dict[str, Any]:
        """The source's current counters, with this process's CPU and memory figures."""

        return {**self.source.snapshot(), "process": process_stats()}


@dataclass(frozen=True)
class ChildSpec:
    """What one child runs: ``runner`` is ``module:function`` taking (spec, stop, holder)."""

    name: str
    index: int
    runner: str
    options: Mapping[str, Any] = field(default_factory=dict)
    log_level: str = "WARNING"
    log_format: str = "text"

    @property
    def label(self) -> str:
        """``name#index``, used in logs and metric labels."""
        return f"{self.name}#{self.index}"


@dataclass
class _Child:
    spec: ChildSpec
    process: BaseProcess | None = None
    connection: Connection | None = None
    started_at: float = 0.0
    restarts: int = 0
    restart_at: float | None = None
    last_exit: int | None = None
    snapshot: dict[str, Any] = field(default_factory=dict)
    #: The last snapshots of this slot's earlier processes (before restarts), for totals.
    earlier: list[dict[str, Any]] = field(default_factory=list)


class Supervisor:
    """Runs children until a stop signal; returns the exit code."""

    def __init__(
        self,
        specs: list[ChildSpec],
        *,
        shutdown_timeout: float = 30.0,
        health_port: int | None = None,
        health_host: str = "0.0.0.0",  # noqa: S104 - probes come from outside the pod
        shared_metrics: Callable[[], Mapping[str, float]] | None = None,
        locks: list[int] | None = None,
    ) -> None:
        """``locks``: the slot locks taken (:func:`mqdedup.cli.lineage.lock_slots`); the
        children hold them too, and they are released when the last of them is gone."""
        self._context = multiprocessing.get_context("spawn")
        self.children = [_Child(spec) for spec in specs]
        self.shutdown_timeout = shutdown_timeout
        self.health_port = health_port
        self.health_host = health_host
        self.shared_metrics = shared_metrics
        self._draining_since: float | None = None
        self._kill_now = False
        self._fatal_code: int | None = None
        self._lock = threading.Lock()
        self._lifeline = Lifeline(locks or ())
        self.health: Any = None

    # -- public ------------------------------------------------------------------------

    def run(self, on_start: Callable[[], None] | None = None) -> int:
        """Start the children, supervise them, drain on a signal; return an exit code.

        ``on_start``: called once the health endpoint serves and the children are started
        (the command's start line: not printed when the health port is refused)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in stop_signals()}
        try:
            self._start_health()
            for child in self.children:
                self._start(child)
            if on_start is not None:
                on_start()
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.health is not None:
                self.health.stop()
            self._lifeline.close()

    def status(self) -> tuple[bool, bool, dict[str, Any]]:
        """(live, ready, details) for ``/healthz``: ready when every child runs (and
        none reports a detached consumer, see :func:`mqdedup.cli.health.snapshot_ready`)."""

        with self._lock:
            running = sum(
                1 for c in self.children if c.process is not None and c.process.is_alive()
            )
            detached = [c.spec.label for c in self.children if not snapshot_ready(c.snapshot)]
            # Why a child is not ready, where it says (fenced, an outage).
            reasons = {
                c.spec.label: c.snapshot.get("fenced") or c.snapshot.get("outage")
                for c in self.children
                if c.snapshot.get("fenced") or c.snapshot.get("outage")
            }
            details = {
                "children": len(self.children),
                "running": running,
                "pids": [
                    c.process.pid
                    for c in self.children
                    if c.process is not None and c.process.is_alive()
                ],
                "restarts": sum(c.restarts for c in self.children),
                "draining": self._draining_since is not None,
                "detached": detached,
                "reasons": reasons,
            }
        ready = running == len(self.children) and self._draining_since is None and not detached
        return True, ready, details

    def snapshots(self) -> dict[tuple[str, str], dict[str, Any]]:
        """The latest metrics of every child, keyed by (name, index)."""
        with self._lock:
            return {
                (c.spec.name, str(c.spec.index)): dict(c.snapshot)
                for c in self.children
                if c.snapshot
            }

    def history(self) -> list[dict[str, Any]]:
        """The last metrics of every child process that ran, restarted ones included
        (what the command did in all: the stop line adds them up)."""
        with self._lock:
            return [
                snapshot for c in self.children for snapshot in (*c.earlier, c.snapshot) if snapshot
            ]

    # -- loop --------------------------------------------------------------------------

    def _loop(self) -> int:
        deadline_passed = False
        while True:
            now = time.monotonic()
            if self._kill_now:
                self._kill_all()
                return exitcodes.INTERRUPTED
            if self._fatal_code is not None:
                self._terminate_all()
                self._wait_all(self.shutdown_timeout)
                return self._fatal_code
            if self._draining_since is not None:
                if not any(self._alive(c) for c in self.children):
                    for child in self.children:
                        if child.process is not None:
                            self._reap(child)
                    if deadline_passed:
                        return exitcodes.SHUTDOWN_TIMEOUT
                    # -SIGTERM: a child still starting up when the drain began (it had no
                    # handler yet) simply stopped; that is a clean stop too.
                    failed = [
                        c.last_exit
                        for c in self.children
                        if c.last_exit not in (None, 0, -signal.SIGTERM)
                    ]
                    return int(failed[0]) if failed else exitcodes.OK
                if now - self._draining_since > self.shutdown_timeout and not deadline_passed:
                    log.error("children did not drain in time; killing them")
                    deadline_passed = True
                    self._kill_all()
            else:
                for child in self.children:
                    if (
                        child.process is None
                        and child.restart_at is not None
                        and now >= child.restart_at
                    ):
                        self._start(child)
            self._wait_for_events(0.2)

    def _wait_for_events(self, timeout: float) -> None:
        waitables: list[Any] = []
        for child in self.children:
            if child.process is not None:
                waitables.append(child.process.sentinel)
            if child.connection is not None:
                waitables.append(child.connection)
        ready = wait(waitables, timeout=timeout) if waitables else []
        if not waitables:
            time.sleep(timeout)
        for child in self.children:
            if child.connection is not None and child.connection in ready:
                self._receive(child)
            if child.process is not None and child.process.sentinel in ready:
                self._reap(child)

    def _receive(self, child: _Child) -> None:
        assert child.connection is not None
        try:
            while child.connection.poll():
                message = child.connection.recv()
                with self._lock:
                    child.snapshot = message
        except (EOFError, OSError):
            child.connection.close()
            child.connection = None

    def _reap(self, child: _Child) -> None:
        assert child.process is not None
        child.process.join(timeout=1)
        code = child.process.exitcode
        lived = time.monotonic() - child.started_at
        child.process = None
        child.last_exit = code
        if child.connection is not None:
            self._receive(child)
        if self._draining_since is not None:
            log.info("child stopped", extra={"child": child.spec.label, "exit_code": code})
            return
        if code in exitcodes.FATAL_CHILD_CODES:
            log.error(
                "child failed for a reason a restart cannot fix",
                extra={"child": child.spec.label, "exit_code": code},
            )
            self._fatal_code = code
            return
        if lived >= STABLE_AFTER:
            child.restarts = 0
        backoff = Backoff(RESTART_BACKOFF_INITIAL, RESTART_BACKOFF_MAX).delay(child.restarts + 1)
        child.restarts += 1
        child.restart_at = time.monotonic() + backoff
        log.warning(
            "child died; restarting",
            extra={"child": child.spec.label, "exit_code": code, "restart_in": round(backoff, 2)},
        )

    # -- children ----------------------------------------------------------------------

    def _start(self, child: _Child) -> None:
        if child.snapshot:  # a restart: the previous process's counts stay in the totals
            with self._lock:
                child.earlier.append(child.snapshot)
                child.snapshot = {}
        parent_end, child_end = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=child_main,
            args=(child.spec, child_end, self._lifeline.bond()),
            name=child.spec.label,
            daemon=False,
        )
        process.start()
        child_end.close()
        child.process, child.connection = process, parent_end
        child.started_at = time.monotonic()
        child.restart_at = None
        child.last_exit = None
        log.info("child started", extra={"child": child.spec.label, "pid": process.pid})

    @staticmethod
    def _alive(child: _Child) -> bool:
        return child.process is not None and child.process.is_alive()

    def _terminate_all(self) -> None:
        for child in self.children:
            if self._alive(child) and child.process is not None and child.process.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.process.pid, signal.SIGTERM)

    def _kill_all(self) -> None:
        for child in self.children:
            if self._alive(child) and child.process is not None and child.process.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.process.pid, signal.SIGKILL)
        self._wait_all(5)

    def _wait_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for child in self.children:
            if child.process is not None:
                child.process.join(max(0.0, deadline - time.monotonic()))

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self._draining_since is not None:
            log.warning("second stop signal: killing children")
            self._kill_now = True
            return
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            log.warning(
                "SIGHUP: nothing to reload (logs go to stderr, settings are read at start); "
                "stopping cleanly",
                extra={"signal": name},
            )
        else:
            log.info("stop signal: draining children", extra={"signal": name})
        self._draining_since = time.monotonic()
        self._terminate_all()

    def _start_health(self) -> None:
        if self.health_port is None:
            return

        try:
            server = HealthServer(
                self.health_port,
                self.status,
                self.snapshots,
                self.shared_metrics,
                host=self.health_host,
            )
        except (OSError, OverflowError) as exc:  # port taken, not allowed, out of range
            reason = getattr(exc, "strerror", None) or str(exc)
            raise ConfigurationError(
                f"cannot serve /healthz and /metrics on port {self.health_port}: {reason} "
                "(choose another --health-port / MQDEDUP_HEALTH_PORT)"
            ) from exc
        self.health = server.start()


# -- in the child ---------------------------------------------------------------------


def child_main(spec: ChildSpec, connection: Connection, bond: Bond) -> None:
    """Entry point of a child process: run ``spec.runner`` until SIGTERM (or until its
    supervisor is gone), then exit."""

    configure(spec.log_level, spec.log_format)
    # The supervisor forwards signals; a terminal's SIGINT or SIGHUP to the whole group is
    # ignored so that it does not count as a second (immediate) stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    stop = StopToken()
    metrics = MetricsHolder(Metrics())

    def _on_term(_signum: int, _frame: FrameType | None) -> None:
        if stop.requested:
            raise ImmediateStop("SIGTERM")
        stop.request()

    signal.signal(signal.SIGTERM, _on_term)
    watch_supervisor(bond, lambda: _orphaned(spec, stop))
    reporter = threading.Thread(
        target=_report_metrics, args=(connection, metrics, stop), daemon=True, name="metrics"
    )
    reporter.start()
    module_name, _, function_name = spec.runner.partition(":")
    runner: Callable[[ChildSpec, Any, MetricsHolder], None] = getattr(
        importlib.import_module(module_name), function_name
    )
    code = exitcodes.OK
    try:
        runner(spec, stop, metrics)
    except ImmediateStop:
        code = exitcodes.INTERRUPTED
    except MqdedupError as exc:
        print(f"mqdedup: {spec.label}: error: {exc}", flush=True)
        code = exitcodes.exit_code_for(exc)
    finally:
        with contextlib.suppress(OSError, ValueError):
            connection.send(metrics.snapshot())
            connection.close()
    os._exit(code)  # skip atexit handlers of libraries that might block on exit


def _orphaned(spec: ChildSpec, stop: StopToken) -> None:
    """The supervisor is gone: stop as on SIGTERM; exit at the shutdown timeout at the
    latest (nobody is left to kill this process)."""
    timeout = float(spec.options.get("shutdown_timeout", 30.0))
    log.error(
        "the supervisor is gone; stopping cleanly",
        extra={"child": spec.label, "shutdown_timeout": timeout},
    )
    stop.request()
    time.sleep(timeout)  # a daemon thread: the process exits first when the stop ends
    log.error("did not stop within the shutdown timeout; exiting", extra={"child": spec.label})
    os._exit(exitcodes.SHUTDOWN_TIMEOUT)


def _report_metrics(connection: Connection, metrics: Any, stop: Any) -> None:
    while True:
        try:
            connection.send(metrics.snapshot())
        except (OSError, ValueError):
            return
        stop.wait(METRICS_INTERVAL)
        if stop.requested:
            stop.wait(METRICS_INTERVAL)

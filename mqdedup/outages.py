"""Waiting out an infrastructure outage: the one retry helper of workers and relays.

Promise 6 ("outages pause, they don't poison"): while the database (or Redis, or a
broker) is unreachable, a unit of work is run again with jittered exponential backoff,
without limit, and never counts against a message. Every wait is logged with its cause,
counted, and flagged (``on_change``) so ``/healthz`` answers not ready until the work
succeeds again. A stop request ends the wait: the caller's ``stopped`` exception is
raised and nothing more is attempted.

An outage is a service that does not answer. Some errors only look like one: a row
over MySQL's ``max_allowed_packet`` drops the connection, a handler that exhausted its
own pool gets a pool timeout, a pooler's queue times out. For the units of work that
belong to messages (``run(work, blame=True)``) the caller's ``answers`` (a probe on a
fresh connection, :mod:`mqdedup.db.probe`) decides: the database does not answer → an
outage, waited out as above; it answers → the work runs once more at once (a restart
that dropped the connection is over by then) and, failing again while the database
answers, :class:`NotAnOutageError` is raised: the error is the work's, the caller
blames its messages. The probe runs only after an error that already looked transient.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_never,
)

from mqdedup.backoff import FULL_JITTER, Backoff
from mqdedup.logs import RepeatedLog
from mqdedup.stopping import StopToken

log = logging.getLogger(__name__)
T = TypeVar("T")


class StoppedDuringOutageError(Exception):
    """A stop was requested while waiting for unreachable infrastructure."""


class NotAnOutageError(Exception):
    """A unit of work failed with an error that looks like an outage while the database
    answers a probe: the error (``error``) belongs to the work's messages."""

    def __init__(self, error: Exception) -> None:
        super().__init__(f"the database answers; not an outage: {type(error).__name__}")
        self.error = error


def _nothing(*_args: Any) -> None:
    return None


def _never(_error: BaseException) -> bool:
    return False


def _no_cause(_error: BaseException) -> str | None:
    return None


class OutageLog:
    """The log lines of one kind of outage: one WARNING when it starts, one INFO (with
    its duration) when it ends, DEBUG for every retry in between.

    Broker transports call :meth:`down` on every failed attempt (a lost connection, a
    failed reconnect or poll) and :meth:`up` once connected / polling again, so a
    16-second outage is two lines, not one per reconnect attempt. ``what`` is the
    message's subject ("rabbitmq connection", "kafka poll"); ``context`` is added to
    every line (queue, consumer). Not thread-safe: one owner (an I/O thread, a loop).
    """

    def __init__(
        self, what: str, *, logger: logging.Logger | None = None, context: Mapping[str, Any]
    ) -> None:
        self.what = what
        self.log = logger or log
        self.context = dict(context)
        self._since: float | None = None
        self._attempts = 0

    @property
    def ongoing(self) -> bool:
        """True between :meth:`down` and :meth:`up`."""
        return self._since is not None

    def down(self, error: str | None, message: str | None = None) -> None:
        """An attempt failed: the WARNING when the outage starts, else a DEBUG line."""
        self._attempts += 1
        if self._since is None:
            self._since = time.monotonic()
            self._attempts = 1
            self.log.warning(
                message or f"{self.what} unavailable; retrying until it is back",
                extra={**self.context, "error": error},
            )
            return
        self.log.debug(
            f"{self.what} still unavailable",
            extra={**self.context, "error": error, "attempt": self._attempts},
        )

    def up(self) -> float | None:
        """Working again: the INFO line with the outage's duration (seconds), if any."""
        since, self._since = self._since, None
        if since is None:
            return None
        seconds = time.monotonic() - since
        self.log.info(
            f"{self.what} back after {seconds:.1f}s",
            extra={**self.context, "outage_seconds": round(seconds, 1), "attempts": self._attempts},
        )
        return seconds


class Outages:
    """Runs units of work through infrastructure outages.

    ``is_transient`` says which errors are an outage (anything else is raised at once).
    ``what`` names the infrastructure in log lines and in the health flag
    (``"database"``, ``"redis"``). ``keepalive`` runs while waiting (broker heartbeats);
    ``on_retry`` counts each wait; ``on_change`` gets the cause while waiting and None
    once the work succeeded again. ``stopped`` is the exception raised when a stop is
    requested during a wait. ``answers(error)``: True when the database answers a probe
    although ``error`` looked like an outage (asked only by ``run(..., blame=True)``).
    ``cause(error)``: what to log and flag instead of "<what> unavailable" for an error
    that is no outage of the service itself (a pool too small), None for an outage.
    """

    def __init__(
        self,
        *,
        stop: StopToken,
        is_transient: Callable[[BaseException], bool],
        what: str = "database",
        backoff_max: float = 5.0,
        keepalive: Callable[[], None] = _nothing,
        on_retry: Callable[[], None] = _nothing,
        on_change: Callable[[str | None], None] = _nothing,
        stopped: type[Exception] = StoppedDuringOutageError,
        context: Mapping[str, Any] | None = None,
        slice_seconds: float = 0.2,
        answers: Callable[[BaseException], bool] = _never,
        cause: Callable[[BaseException], str | None] = _no_cause,
    ) -> None:
        self.stop = stop
        self.is_transient = is_transient
        self.what = what
        self.backoff_max = backoff_max
        self.keepalive = keepalive
        self.on_retry = on_retry
        self.on_change = on_change
        self.stopped = stopped
        self.context = dict(context or {})
        self.slice_seconds = slice_seconds
        self.answers = answers
        self.cause = cause
        # One outage's "retrying" line: at once, then after 1 s, 2 s, 4 s ... (at most
        # every minute, with the count left out), not one per attempt.
        self._repeats = RepeatedLog(log)

    def run(
        self,
        work: Callable[[], T],
        *,
        background: bool = False,
        blame: bool = False,
        again: bool = True,
    ) -> T:
        """Run ``work``; while it fails with an outage, wait with backoff and run it again.

        The first attempt runs directly (building the retry machinery costs ~30 µs, a
        tenth of a one-message transaction). After an outage error the next attempt
        follows at once: a connection found dead in the pool (the database restarted)
        invalidates the pool, so it usually succeeds on a fresh connection; further
        attempts back off. ``background``: called from a helper thread that must not
        run ``keepalive`` (the connections of another thread). ``blame``: the work
        belongs to messages; an error that looks like an outage while the database
        answers (``answers``) raises :class:`NotAnOutageError`, after one more run at
        once (``again``; False when the work already failed so with the database there).
        """
        if blame:
            work = functools.partial(self._blamable, work, again)
        try:
            return work()
        except Exception as error:
            if not self.is_transient(error):
                raise
            self._waiting(1, error)
        retrying = Retrying(
            retry=retry_if_exception(self.is_transient),
            wait=Backoff(0.1, self.backoff_max, jitter=FULL_JITTER),
            stop=stop_never,
            sleep=self._sleep_quietly if background else self._sleep,
            before_sleep=self._before_sleep,
            reraise=True,
        )
        try:
            return retrying(work)
        finally:
            self.on_change(None)  # the outage is over (or no longer ours to wait out)
            self._repeats.forget()

    def _blamable(self, work: Callable[[], T], again: bool) -> T:
        """``work``, NotAnOutageError when it fails so while the database answers."""
        try:
            return work()
        except Exception as error:
            if not (self.is_transient(error) and self.answers(error)):
                raise
            if not again:
                raise NotAnOutageError(error) from error
            if self.stop.requested:  # no second wait (a pool's timeout, say) when stopping
                raise self.stopped(f"stop requested after {type(error).__name__}") from error
            self.on_retry()  # a transaction retried for its connection, not flagged
            log.info(
                f"the {self.what} answers a probe after {type(error).__name__}; "
                "running the work once more",
                extra={**self.context, "error": type(error).__name__},
            )
        try:
            return work()
        except Exception as error:
            if self.is_transient(error) and self.answers(error):
                raise NotAnOutageError(error) from error
            raise

    def pause(self, seconds: float) -> bool:
        """Wait ``seconds`` running ``keepalive``; False if a stop was requested."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            if self.stop.requested:
                return False
            self.keepalive()
            self.stop.wait(min(remaining, self.slice_seconds))
        return not self.stop.requested

    # -- tenacity hooks -----------------------------------------------------------------

    def _sleep(self, seconds: float) -> None:
        if not self.pause(seconds):
            raise self.stopped(f"stop requested while the {self.what} was unavailable")

    def _sleep_quietly(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise self.stopped(f"stop requested while the {self.what} was unavailable")

    def _before_sleep(self, state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        self._waiting(state.attempt_number + 1, error)

    def _waiting(self, attempt: int, error: BaseException | None) -> None:
        self.on_retry()
        cause = self.cause(error) if error is not None else None
        if cause is not None:
            self.on_change(cause)
            self._repeats.warning(
                f"{cause}; retrying",
                extra={**self.context, "attempt": attempt, "error": type(error).__name__},
            )
            return
        self.on_change(f"{self.what} unavailable: {type(error).__name__ if error else '?'}")
        self._repeats.warning(
            f"{self.what} unavailable; retrying",
            extra={
                **self.context,
                "attempt": attempt,
                "error": type(error).__name__ if error else None,
            },
        )

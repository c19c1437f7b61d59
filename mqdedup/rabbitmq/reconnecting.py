"""What a failed RabbitMQ connect means, and the backoff that retries it.

Used by the consumer's I/O thread (:mod:`mqdedup.rabbitmq.io_thread`): a refused login
or a topology the broker rejects (403/404/406) is a configuration error, anything else
is a broker that may come back and is retried with backoff (tenacity).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pika
import pika.exceptions
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    stop_never,
)

from mqdedup.backoff import FULL_JITTER, Backoff
from mqdedup.errors import BrokerUnavailableError, ConfigurationError

# The transport's logger, as before these helpers moved out of mqdedup.rabbitmq.transport.
log = logging.getLogger("mqdedup.rabbitmq.transport")
T = TypeVar("T")

#: Channel-close reply codes that mean "your configuration is wrong", not "try again".
CONFIGURATION_REPLY_CODES = frozenset({403, 404, 406})


class ClosingError(Exception):
    """Internal: the transport is closing; abandon the reconnect loop."""


def connect_retrying(
    first: bool,
    *,
    startup_timeout: float,
    backoff_max: float,
    closing: threading.Event,
    queue: str,
    masked_url: str,
) -> Callable[[Callable[[], T]], T]:
    """Backoff for (re)connecting: bounded by ``startup_timeout`` only the first time.

    An outage is logged once, not per attempt: a WARNING for the first failed attempt
    at start-up (a reconnect follows the I/O thread's "detached" WARNING), DEBUG for the
    rest (ERROR for a configuration error), and an INFO with the outage's duration once
    connected again.
    """

    def sleep_unless_closing(seconds: float) -> None:
        if closing.wait(seconds):
            raise ClosingError

    def log_connect_retry(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        log.log(
            logging.ERROR
            if error is not None and is_configuration_error(error)
            else logging.WARNING
            if first and state.attempt_number == 1
            else logging.DEBUG,
            "cannot connect to RabbitMQ; retrying",
            extra={
                "queue": queue,
                "url": masked_url,
                "attempt": state.attempt_number,
                "error": describe(error) if error is not None else None,
            },
        )

    retrying = Retrying(
        retry=retry_if_exception(lambda error: retry_connect(error, first)),
        wait=Backoff(0.2, backoff_max, jitter=FULL_JITTER),
        stop=stop_after_delay(startup_timeout) if first else stop_never,
        sleep=sleep_unless_closing,
        before_sleep=log_connect_retry,
        reraise=True,
    )

    def connect(fn: Callable[[], T]) -> T:
        started = time.monotonic()
        result = retrying(fn)
        attempts = int(retrying.statistics.get("attempt_number", 1))
        if attempts > 1 or not first:
            seconds = time.monotonic() - started
            log.info(
                f"RabbitMQ connection back after {seconds:.1f}s",
                extra={"queue": queue, "outage_seconds": round(seconds, 1), "attempts": attempts},
            )
        return result

    return connect


def retry_connect(error: BaseException, first: bool) -> bool:
    """Whether a failed (re)connect is worth another attempt."""
    if isinstance(error, ClosingError):
        return False
    if first:
        return not is_configuration_error(error)
    # After a reconnect a refused login may be a broker still booting: retried. A
    # topology the broker rejects will not change by itself: a configuration error.
    return not is_topology_error(error)


def startup_failure(
    error: BaseException,
    *,
    masked_url: str,
    queue: str,
    declare: bool,
    startup_timeout: float,
) -> BaseException:
    """The error a failed connect is reported as: configuration error or broker unavailable."""
    if isinstance(error, ConfigurationError | BrokerUnavailableError):
        return error
    if isinstance(
        error,
        pika.exceptions.ProbableAuthenticationError
        | pika.exceptions.ProbableAccessDeniedError
        | pika.exceptions.AuthenticationError,
    ):
        return ConfigurationError(
            f"RabbitMQ at {masked_url} refused the login: {describe(error)} "
            "(check the user, password and virtual host)"
        )
    if isinstance(error, pika.exceptions.ChannelClosedByBroker):
        return ConfigurationError(
            f"RabbitMQ at {masked_url} rejected the topology of queue "
            f"{queue!r}: {describe(error)}"
            + (
                " (declare=False: the queue, dead-letter queue and exchanges must exist)"
                if not declare
                else ""
            )
        )
    return BrokerUnavailableError(
        f"cannot connect to RabbitMQ at {masked_url} within "
        f"{startup_timeout:.0f}s: {describe(error)}"
    )


def close_quietly(connection: Any) -> None:
    """Close a pika connection if it is open, logging (not raising) any error."""
    try:
        if connection.is_open:
            connection.close()
    except Exception as error:
        log.debug("ignoring error while closing a RabbitMQ connection: %r", error)


def is_configuration_error(error: BaseException) -> bool:
    """A refused login or a rejected declaration: trying again will not help."""
    if isinstance(
        error,
        ConfigurationError
        | pika.exceptions.ProbableAuthenticationError
        | pika.exceptions.ProbableAccessDeniedError
        | pika.exceptions.AuthenticationError,
    ):
        return True
    return (
        isinstance(error, pika.exceptions.ChannelClosedByBroker)
        and error.reply_code in CONFIGURATION_REPLY_CODES
    )


def is_topology_error(error: BaseException) -> bool:
    """The broker rejected a declaration (mismatch 406, not allowed 403, missing 404)."""
    return isinstance(error, ConfigurationError) or (
        isinstance(error, pika.exceptions.ChannelClosedByBroker)
        and error.reply_code in CONFIGURATION_REPLY_CODES
    )


def describe(error: BaseException) -> str:
    """A one-line description of a pika / socket error (never contains credentials)."""
    if isinstance(error, pika.exceptions.ChannelClosed | pika.exceptions.ConnectionClosed):
        return f"{type(error).__name__}({error.reply_code}, {error.reply_text!r})"
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__

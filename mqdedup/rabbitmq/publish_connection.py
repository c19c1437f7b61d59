"""The relay publisher's connection: a pika ``SelectConnection`` driven from the relay's
thread (:meth:`PublisherConnection._run_until`), its confirm-mode channel, the broker's
``connection.blocked`` notices, the passive check that exchanges exist, and a teardown
that never leaves a connection behind on the broker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pika

from mqdedup.rabbitmq.publish_window import ConfirmWindow

# The publisher's logger, as before this code moved out of mqdedup.rabbitmq.publisher.
log = logging.getLogger("mqdedup.rabbitmq.publisher")


class UnavailableError(Exception):
    """The broker cannot be used right now (connect failed, channel lost)."""


class PublisherConnection(ConfirmWindow):
    """Opens, watches and closes the publisher's connection and channel.

    The base of :class:`~mqdedup.rabbitmq.publisher.RabbitMQPublisher`; not used alone.
    """

    # -- connection ------------------------------------------------------------------------

    def _ensure_channel(self) -> None:
        if self._channel is not None and self._channel.is_open:
            return
        if self._connection is None or not self._connection.is_open:
            self._reset()
            self._last_error = None
            self._connection = pika.SelectConnection(
                self.parameters,
                on_open_callback=self._on_connection_open,
                on_open_error_callback=self._on_connection_error,
                on_close_callback=self._on_connection_closed,
            )
            self._loop = self._connection.ioloop
        else:
            self._open_channel()
        self._run_until(
            lambda: self._channel is not None or self._connection is None, self.connect_timeout
        )
        if self._channel is None:
            error = self._last_error or f"no channel within {self.connect_timeout} s"
            raise UnavailableError(f"cannot connect to RabbitMQ at {self.safe_url}: {error}")

    def _on_connection_open(self, connection: Any) -> None:
        connection.add_on_connection_blocked_callback(self._on_blocked)
        connection.add_on_connection_unblocked_callback(self._on_unblocked)
        self._open_channel()

    def _on_connection_error(self, _connection: Any, error: BaseException) -> None:
        self._last_error = f"{type(error).__name__}: {error}"
        self._connection = None
        self._channel = None
        self._stop_loop()

    def _on_connection_closed(self, connection: Any, reason: BaseException) -> None:
        if connection is not self._connection:
            return
        self._last_error = f"connection closed: {type(reason).__name__}: {reason}"
        self._connection = None
        self._channel = None
        self._forget_connection_facts()
        self._stop_loop()

    def _on_blocked(self, _connection: Any, _frame: Any) -> None:
        self._blocked = True
        log.warning("RabbitMQ blocks publishing (resource alarm); the relay waits")
        self._stop_loop()

    def _on_unblocked(self, _connection: Any, _frame: Any) -> None:
        self._blocked = False
        log.info("RabbitMQ unblocked publishing")

    def _open_channel(self) -> None:
        self._channel = None
        self._orphans.clear()  # their confirms would have come on the closed channel
        self._opening = self._connection.channel(on_open_callback=self._on_channel_open)

    def _on_channel_open(self, channel: Any) -> None:
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(
            ack_nack_callback=self._on_confirm,
            callback=lambda _frame: self._on_confirm_mode(channel),
        )

    def _on_confirm_mode(self, channel: Any) -> None:
        self._channel = channel
        self._next_tag = 1
        self._channel_close = None
        self._check_done()

    def _on_channel_closed(self, channel: Any, reason: BaseException) -> None:
        if channel is self._channel or channel is self._opening:
            self._channel = None
            self._channel_close = (
                getattr(reason, "reply_code", None),
                str(getattr(reason, "reply_text", reason)),
            )
            self._last_error = f"channel closed: {type(reason).__name__}: {reason}"
        self._stop_loop()

    def _forget_connection_facts(self) -> None:
        self._known_exchanges.clear()
        self._proven_exchanges.clear()
        self._proven_user_ids.clear()
        self._largest_confirmed = -1
        self._orphans.clear()
        self._blocked = False

    def _reset(self) -> None:
        connection, self._connection = self._connection, None
        self._channel = None
        self._forget_connection_facts()
        if connection is None:
            return
        try:
            if connection.is_open:
                connection.close()
                self._connection = connection  # let the close handshake run
                self._run_until(lambda: connection.is_closed, 2.0)
        except Exception:
            log.debug("closing the RabbitMQ connection failed", exc_info=True)
        finally:
            self._connection = None
        if not connection.is_closed:
            # No close handshake (e.g. a blocked connection): tear the socket down, so
            # no connection is left behind on the broker.
            _abort(connection)

    # -- exchanges -------------------------------------------------------------------------

    def _check_exchanges(self, exchanges: set[str]) -> None:
        """Passively declare exchanges not checked yet; remember missing ones for a while."""
        now = time.monotonic()
        for exchange in sorted(exchanges - self._known_exchanges - {""}):
            missing = self._missing.get(exchange)
            if missing is not None and missing[1] > now:
                continue
            if self._exchange_exists(exchange):
                self._known_exchanges.add(exchange)
                self._missing.pop(exchange, None)
                continue
            if self._channel_close is not None and self._channel_close[0] == 404:
                reason = f"RabbitMQ exchange {exchange!r} does not exist"
                self._missing[exchange] = (reason, now + self._refusals.ttl)
                self._ensure_channel()
                continue
            raise UnavailableError(
                f"cannot check exchange {exchange!r}: {self._last_error or 'no answer'}"
            )

    def _exchange_exists(self, exchange: str) -> bool:
        """Passive declare; False when the broker closed the channel instead of answering."""
        confirmed: list[bool] = []
        channel = self._channel

        def on_ok(_frame: Any) -> None:
            confirmed.append(True)
            self._stop_loop()

        channel.exchange_declare(exchange=exchange, passive=True, callback=on_ok)
        self._run_until(
            lambda: bool(confirmed) or self._channel is not channel, self.connect_timeout
        )
        return bool(confirmed)

    # -- the I/O loop ----------------------------------------------------------------------

    def _run_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Run the connection's I/O loop until ``done()`` or ``timeout`` seconds (at least
        one pass, so ``timeout=0`` serves what is pending)."""
        deadline = time.monotonic() + timeout
        first = True
        while not done() and self._connection is not None and self._loop is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and not first:
                break
            first = False
            loop = self._loop
            self._done = done
            timer = loop.call_later(max(0.0, remaining), loop.stop)
            try:
                loop.start()
            finally:
                self._done = None
                loop.remove_timeout(timer)
        return done()


def _abort(connection: Any) -> None:
    """Close ``connection``'s socket now, without the close handshake.

    pika has no public abort: this uses its ``_terminate_stream`` (an internal; see
    docs/architecture.md, "Third-party internals in the adapters"), then runs the
    connection's I/O loop once, where pika closes the socket. Without the internal the
    connection is only dropped: it stays on the broker until the process ends.
    """
    terminate = getattr(connection, "_terminate_stream", None)
    if not callable(terminate):
        log.warning(
            "pika cannot abort a connection (no _terminate_stream); it stays on the broker "
            "until the relay stops"
        )
        return
    try:
        terminate(None)
        loop = connection.ioloop
        timer = loop.call_later(0.5, loop.stop)  # in case pika queued nothing
        loop.add_callback_threadsafe(loop.stop)  # after pika's own callbacks
        try:
            loop.start()
        finally:
            loop.remove_timeout(timer)
    except Exception:
        log.debug("tearing down the RabbitMQ connection failed", exc_info=True)

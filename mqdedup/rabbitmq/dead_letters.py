"""The worker's own publishing connection to RabbitMQ (dead letters).

RabbitMQ recommends separate connections for publishing and consuming: a resource
alarm (memory, disk) blocks every connection that publishes (``connection.blocked``),
and a blocked connection carries nothing, acks included. So dead letters go out on
this connection, never on the consuming one, and a blocked publish can only delay the
dead letter, never the acks of the messages around it.

The connection belongs to the worker thread (the one calling ``Transport.dead_letter``)
and is used from that thread only; it is opened lazily and reopened after a failure.
While the broker blocks it (an alarm), a publish waits at most ``blocked_timeout``
seconds, then pika closes the connection (nothing is left behind) and publishes are
refused at once (``BrokerUnavailableError``) for a growing pause, so a long alarm costs
the worker one short wait per pause, not one per poison message.

A publish the broker refuses because of the record itself raises
:class:`~mqdedup.errors.DeadLetterRefusedError` with the broker's reason, at once: a
publisher nack (e.g. the dead-letter queue is full with ``overflow=reject-publish``),
a message returned as unroutable twice (after declaring the dead-letter topology
again), or a channel the broker closed for this record (403 not allowed, 406 too large
or a foreign ``user_id``, 404 once the topology could not be declared again).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pika
import pika.exceptions

from mqdedup.backoff import Backoff
from mqdedup.errors import BrokerUnavailableError, DeadLetterRefusedError
from mqdedup.rabbitmq.reconnecting import describe
from mqdedup.rabbitmq.topology import (
    BrokerNodes,
    Topology,
    declare_dead_letter_topology,
)

log = logging.getLogger("mqdedup.rabbitmq.publishing")  # its name before the module was renamed

#: Longest pause, in seconds, between publish attempts while the broker blocks publishers.
_BLOCKED_PAUSE_MAX = 5.0


class DeadLetterPublisher:
    """Publishes dead letters with confirms and ``mandatory`` on a connection of its own."""

    def __init__(
        self,
        url: str,
        topology: Topology,
        *,
        connection_name: str,
        blocked_timeout: float = 1.0,
    ) -> None:
        self.topology = topology
        self.connection_name = connection_name
        # One URL or a cluster's node URLs; after a lost connection the next node first.
        self._nodes = BrokerNodes(url, connection_name)
        for parameters in self._nodes.parameters:
            # A blocked publish waits this long; then pika closes the connection.
            parameters.blocked_connection_timeout = blocked_timeout
        self._connection: Any = None
        self._channel: Any = None
        self._blocked = False
        self._refuse_until = 0.0
        self._pause = 1.0

    # -- public ----------------------------------------------------------------------------

    def publish(self, body: bytes, properties: pika.BasicProperties) -> None:
        """Publish one dead letter and wait for the broker's confirm.

        Raises :class:`DeadLetterRefusedError` when the broker refuses this record and
        :class:`BrokerUnavailableError` when the broker cannot take it now (connection
        lost, publishing blocked by a resource alarm).
        """
        now = time.monotonic()
        if now < self._refuse_until or self._blocked_now():
            raise BrokerUnavailableError(
                "RabbitMQ blocks publishing (a resource alarm); the dead letter waits"
            )
        for attempt in (1, 2):
            channel = self._open_channel()
            try:
                channel.basic_publish(
                    exchange=self.topology.dead_letter_exchange,
                    routing_key=self.topology.dead_letter_routing_key,
                    body=body,
                    properties=properties,
                    mandatory=True,
                )
            except pika.exceptions.NackError as error:
                raise DeadLetterRefusedError(
                    f"dead-letter queue {self.topology.dead_letter_queue!r} refused the "
                    "message (publisher nack: the queue is full with overflow=reject-publish, "
                    "or a policy rejects it)"
                ) from error
            except pika.exceptions.UnroutableError as error:
                if attempt == 2:
                    raise DeadLetterRefusedError(
                        f"dead letter unroutable: exchange "
                        f"{self.topology.dead_letter_exchange!r} has no binding to "
                        f"{self.topology.dead_letter_queue!r}"
                    ) from error
                self._redeclare("unroutable")
            except pika.exceptions.ChannelClosedByBroker as error:
                self._channel = None
                if error.reply_code == 404 and attempt == 1:
                    self._redeclare(describe(error))
                    continue
                raise DeadLetterRefusedError(
                    f"RabbitMQ refused the dead letter: {describe(error)}"
                ) from error
            except pika.exceptions.ConnectionBlockedTimeout as error:
                self._on_blocked_timeout()
                raise BrokerUnavailableError(
                    "RabbitMQ blocked the dead-letter publish (a resource alarm); the "
                    "connection was closed and the dead letter waits"
                ) from error
            except (pika.exceptions.AMQPError, OSError) as error:
                # Not confirmed: never taken as published. Its node may be dead: the
                # next connection tries a cluster's other nodes first.
                self._nodes.lost()
                self._drop()
                if attempt == 2:
                    raise BrokerUnavailableError(
                        f"dead-letter publish failed: {describe(error)}"
                    ) from error
                continue  # a connection the broker closed while idle: once more, fresh
            else:
                self._pause = 1.0
                return

    def service(self) -> None:
        """Answer heartbeats and notice blocks; drop a connection that broke meanwhile."""
        connection = self._connection
        if connection is None:
            return
        try:
            if connection.is_open:
                connection.process_data_events(time_limit=0)
                return
        except (pika.exceptions.AMQPError, OSError) as error:
            log.info(
                "dead-letter connection lost; reopened when needed",
                extra={"connection_name": self.connection_name, "error": describe(error)},
            )
        self._nodes.lost()
        self._drop()

    def close(self) -> None:
        """Close the connection (quietly: it may be broken already)."""
        self._drop()

    # -- internals -------------------------------------------------------------------------

    def _blocked_now(self) -> bool:
        if self._blocked:
            self.service()  # an unblock may be waiting on the socket
        return self._blocked

    def _open_channel(self) -> Any:
        if self._connection is None or not self._connection.is_open:
            self._drop()
            try:
                connection = self._nodes.connect()
            except (pika.exceptions.AMQPError, OSError) as error:
                raise BrokerUnavailableError(
                    f"cannot open the dead-letter connection: {describe(error)}"
                ) from error
            connection.add_on_connection_blocked_callback(self._on_blocked)
            connection.add_on_connection_unblocked_callback(self._on_unblocked)
            self._connection = connection
            self._blocked = False
        if self._channel is None or not self._channel.is_open:
            try:
                channel = self._connection.channel()
                channel.confirm_delivery()
            except (pika.exceptions.AMQPError, OSError) as error:
                self._drop()
                raise BrokerUnavailableError(
                    f"cannot open a dead-letter channel: {describe(error)}"
                ) from error
            self._channel = channel
        return self._channel

    def _redeclare(self, why: str) -> None:
        log.warning(
            "dead-letter publish failed; declaring the dead-letter queue again",
            extra={"queue": self.topology.queue, "error": why},
        )
        try:
            declare_dead_letter_topology(self._open_channel(), self.topology)
        except pika.exceptions.ChannelClosedByBroker as error:
            self._channel = None
            raise DeadLetterRefusedError(
                f"cannot declare the dead-letter queue {self.topology.dead_letter_queue!r}: "
                f"{describe(error)}"
            ) from error

    def _on_blocked(self, _connection: Any, _frame: Any) -> None:
        self._blocked = True
        log.warning(
            "RabbitMQ blocks publishing (resource alarm); dead letters wait, acks go on",
            extra={"connection_name": self.connection_name},
        )

    def _on_unblocked(self, _connection: Any, _frame: Any) -> None:
        self._blocked = False
        self._refuse_until = 0.0
        log.info("RabbitMQ unblocked publishing", extra={"connection_name": self.connection_name})

    def _on_blocked_timeout(self) -> None:
        self._drop()
        self._refuse_until = time.monotonic() + self._pause
        self._pause = Backoff(1.0, _BLOCKED_PAUSE_MAX).after(self._pause)

    def _drop(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        self._blocked = False
        if connection is None:
            return
        try:
            if connection.is_open:
                connection.close()
        except Exception as error:
            log.debug("ignoring error while closing the dead-letter connection: %r", error)

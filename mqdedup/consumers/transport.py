"""The transport seam: what a broker wrapper must do for the processor.

Ack contract (every transport keeps it):

* ``fetch`` hands out deliveries; the broker keeps each one *unsettled* until
  ``settle`` or ``dead_letter`` succeeds for it. Unsettled deliveries come back
  (to this or another worker) after a crash, a lost connection or a rebalance.
* ``settle`` is called only after the database transaction holding the deliveries'
  claims has committed. It acknowledges (RabbitMQ) or commits offsets (Kafka). A
  delivery whose channel/partition was lost meanwhile is silently dropped: it will be
  redelivered and deduplicated. ``settle`` never settles a delivery it was not given.
* ``give_back`` returns handed-out deliveries that will not be settled (a dead-letter
  publish that failed, for example): they go back to the source and are fetched again,
  marked redelivered, before later ones of their partition / queue where the broker
  allows it. Kafka seeks the partition back to the first given offset (what followed
  it comes again too), RabbitMQ nacks them with requeue, memory puts them back at the
  front. A delivery whose partition / channel was lost meanwhile is ignored (the broker
  hands it out again anyway). The :class:`~mqdedup.consumers.worker.Worker` gives back
  the unsettled rest of every batch, whatever the transport.
* ``dead_letter`` durably stores the original message with the reason (confirmed
  publish to a dead-letter queue/topic, or the in-memory list) *before* returning; it
  raises if it could not, and the processor then leaves the delivery unsettled. A
  dead-lettered delivery is then passed to ``settle`` like a processed one.
* ``keepalive`` is called while the processor waits (retry backoff, database outage,
  long batches): a transport without an I/O thread of its own services heartbeats /
  polls there so the broker does not drop the worker (Kafka's and RabbitMQ's
  transports own their I/O thread, which does that all the time).
* ``close`` releases the connection; deliveries still unsettled go back to the broker.

Recovery bounds (every transport keeps them; ``tests/integration/test_recovery_parity.py``
checks them on KafkaConsumer, AsyncKafkaConsumer, RabbitMQConsumer and
AsyncRabbitMQConsumer):

* **A stop ends within 2 s in any state** — connected, mid-batch, broker down, or still
  starting against an unreachable broker — whether it comes from a signal, the stop
  token or ``task.cancel()`` (``run_async`` then ends with ``CancelledError``; a stop is
  not an error, ``mqdedup worker`` exits 0). The batch in flight is finished and what
  committed is settled if the broker is reachable; nothing else is acked. No command of
  a stop waits on a connection that is down.
* **A dead-letter publish never holds the acks or the next batch longer than 1 s**: a
  publish the broker blocks (a resource alarm) or refuses raises within that time, the
  delivery stays unsettled, the rest of the batch is settled and the worker goes on.
* **``connect_timeout`` / ``startup_timeout`` is waited out** at start before
  ``BrokerUnavailableError``, by every client alike.
* **A channel the broker closes is one WARNING with the broker's reply code and text**,
  counted in ``Metrics.channel_reopens`` when the channel is open again.
* **An outage is one WARNING when it starts and one INFO (with its duration) when it
  ends**, not a line per reconnect attempt (:class:`~mqdedup.outages.OutageLog`).

Deliveries are typed by their transport's token (``Delivery[KafkaToken]``,
``Delivery[AmqpToken]``, ``Delivery[int]`` in memory): core code that works with any
transport uses ``Delivery[Any]`` / ``Transport[Any]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from mqdedup.message import Message

#: The transport-specific part of a delivery (where to ack it, its offset, ...).
TokenT = TypeVar("TokenT")


@dataclass(frozen=True, slots=True)
class Delivery(Generic[TokenT]):
    """One message as handed out by a transport; ``token`` is the transport's own."""

    message: Message
    token: TokenT


def new_delivery(message: Message, token: TokenT) -> Delivery[TokenT]:
    """``Delivery(message, token)`` for a transport's hot path (one per message): sets
    the two slots directly, without the frozen dataclass's ``object.__setattr__`` calls."""
    delivery: Delivery[TokenT] = _new(Delivery)
    _set_message(delivery, message)
    _set_token(delivery, token)
    return delivery


_new = object.__new__
_set_message = Delivery.__dict__["message"].__set__
_set_token = Delivery.__dict__["token"].__set__


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Why a message was dead-lettered."""

    reason: str
    consumer: str
    attempts: int
    error_class: str | None = None
    error_message: str | None = None

    def headers(self) -> dict[str, str]:
        """The ``x-mqdedup-*`` headers written on the dead-lettered copy."""
        headers = {
            "x-mqdedup-reason": self.reason,
            "x-mqdedup-consumer": self.consumer,
            "x-mqdedup-attempts": str(self.attempts),
        }
        if self.error_class:
            headers["x-mqdedup-error-class"] = self.error_class
        if self.error_message is not None:
            headers["x-mqdedup-error-message"] = self.error_message[:1000]
        return headers


@runtime_checkable
class Transport(Protocol[TokenT]):
    """A source of deliveries that honours the module's ack contract."""

    def fetch(self, max_messages: int, timeout: float) -> Sequence[Delivery[TokenT]]:
        """Up to ``max_messages`` deliveries, waiting at most ``timeout`` seconds."""
        ...

    def settle(self, deliveries: Sequence[Delivery[TokenT]]) -> None:
        """Acknowledge / commit the offsets of deliveries that are done."""
        ...

    def give_back(self, deliveries: Sequence[Delivery[TokenT]]) -> None:
        """Return unsettled deliveries to the source: they are fetched again."""
        ...

    def dead_letter(self, delivery: Delivery[TokenT], record: DeadLetter) -> None:
        """Store the original message with ``record`` durably, or raise."""
        ...

    def keepalive(self) -> None:
        """Service the connection while the worker is busy or waiting."""
        ...

    def close(self) -> None:
        """Release the connection; unsettled deliveries go back to the broker."""
        ...

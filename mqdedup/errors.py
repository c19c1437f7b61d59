"""Exception types shared by every part of mqdedup.

User mistakes (bad configuration, bad input) derive from :class:`MqdedupError` and carry
a message meant to be shown as one line; the CLI prints it without a traceback.
"""

from __future__ import annotations


class MqdedupError(Exception):
    """Base class of errors that mqdedup reports to its user in one line."""


class ConfigurationError(MqdedupError):
    """A setting is missing or malformed (URL, consumer attribute, CLI flag)."""


class DatabaseUnavailableError(MqdedupError):
    """The database cannot be reached (at start-up, or after retries were exhausted)."""


class BrokerUnavailableError(MqdedupError):
    """The message broker cannot be reached."""


class DeadLetterRefusedError(MqdedupError):
    """The broker refused this one dead letter for good (too large, rejected by a queue
    policy, not authorised, the target does not exist and cannot be created).

    Raised by ``Transport.dead_letter`` for a refusal that belongs to the record, never
    for an outage (connection lost, broker down: ``BrokerUnavailableError``). The
    processor then keeps the message in the database's dead-letter table instead, so the
    delivery can still be settled and nothing behind it waits.
    """


class ConsumerImportError(MqdedupError):
    """A ``module.path:ClassName`` consumer reference cannot be loaded."""


class MessageError(Exception):
    """The message itself is bad (its id or body); it is dead-lettered, never retried.

    ``reason`` is the short text written to the dead-letter record.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class MissingMessageIdError(MessageError):
    """The consumer's message-id strategy found no id on the message."""

    def __init__(self, detail: str = "") -> None:
        super().__init__("missing message id" + (f": {detail}" if detail else ""))


class UndecodableMessageError(MessageError):
    """The body cannot be decoded as the handler asked (text, JSON)."""


class SimulatedCrash(BaseException):
    """Raised by fault-injection hooks to stop a worker as if its process died.

    It derives from BaseException so that no ``except Exception`` in user code or in
    mqdedup swallows it.
    """

"""Which deliveries of a batch are the same message: message ids and in-batch repeats."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mqdedup.bridge import call_hook_protected
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.dedup.ids import (
    InvalidMessageIdError,
    MessageIdStrategy,
    check_message_id,
    returns_checked_ids,
)
from mqdedup.errors import MessageError

if TYPE_CHECKING:
    from mqdedup.consumers.metrics import Metrics
    from mqdedup.consumers.report import BatchReport
    from mqdedup.consumers.spec import ConsumerSpec


def identify(
    consumer: ConsumerSpec,
    deliveries: Sequence[Delivery[Any]],
    report: BatchReport,
    dead_letter: Callable[[Exception, int], DeadLetter],
) -> tuple[list[Delivery[Any]], list[tuple[Delivery[Any], str]]]:
    """Attach message ids; split off messages without one and in-batch repeats.

    A message without a valid id is dead-lettered (``dead_letter`` builds the record);
    a repeat of an id seen earlier in the batch is returned with that id.
    """
    unique: list[Delivery[Any]] = []
    repeats: list[tuple[Delivery[Any], str]] = []
    seen: set[str] = set()
    strategy = checked_strategy(consumer)
    for delivery in deliveries:
        message = delivery.message
        try:
            if strategy is None:
                message_id = message_id_of(consumer, delivery)
            else:  # message_id_of's checked-strategy path, inlined (one call per message)
                message_id = strategy(message)
        except MessageError as error:
            report.dead_lettered.append((delivery, dead_letter(error, 1)))
            continue
        except Exception as error:
            report.dead_lettered.append((delivery, dead_letter(strategy_failed(error), 1)))
            continue
        if message_id in seen:
            repeats.append((delivery, message_id))
            continue
        seen.add(message_id)
        identified = message.identified(message_id)
        unique.append(delivery if identified is message else Delivery(identified, delivery.token))
    return unique, repeats


def checked_strategy(consumer: ConsumerSpec) -> MessageIdStrategy | None:
    """The consumer's id strategy when its ids need no second check, else None.

    That is one of :mod:`mqdedup.dedup.ids`'s strategies (they check what they return)
    used through the unchanged ``Consumer.message_id``. Spares a check per message.
    """
    method = type(consumer).message_id
    if getattr(method, "__qualname__", None) != "Consumer.message_id":
        return None  # overridden: what it returns is checked here
    strategy = type(consumer).message_id_strategy
    return strategy if returns_checked_ids(strategy) else None


def message_id_of(
    consumer: ConsumerSpec, delivery: Delivery[Any], strategy: MessageIdStrategy | None = None
) -> str:
    """The delivery's message id, valid for every claim store, or a MessageError.

    Whatever the strategy raises belongs to this message (a user function failing
    on its body, say): it is dead-lettered with that reason, never a worker crash.
    ``strategy``: the consumer's, from :func:`checked_strategy` (its ids are checked).
    """
    try:
        if strategy is not None:
            return strategy(delivery.message)
        message_id = consumer.message_id(delivery.message)
    except MessageError:
        raise
    except Exception as error:
        raise strategy_failed(error) from error
    return check_message_id(message_id, "the consumer's message id")


def strategy_failed(error: Exception) -> InvalidMessageIdError:
    """What a message id strategy's own failure makes of its message (dead-lettered)."""
    failure = InvalidMessageIdError(
        f"the message id strategy failed: {type(error).__name__}: {error}"
    )
    failure.__cause__ = error
    return failure


def resolve_repeats(
    consumer: ConsumerSpec,
    repeats: list[tuple[Delivery[Any], str]],
    report: BatchReport,
    metrics: Metrics,
) -> None:
    """A repeat inside the batch shares the fate of its first copy.

    ``on_duplicate`` is called for a repeat of a processed message after the batch
    committed, protected as every hook is: what it raises is logged, never a crash.
    """
    if not repeats:
        return
    fate: dict[str, Any] = {}
    for delivery in report.processed + report.duplicates:
        fate[str(delivery.message.id)] = "done"
    for delivery, record in report.dead_lettered:
        if delivery.message.id is not None:
            fate[delivery.message.id] = record
    for delivery, message_id in repeats:
        outcome = fate.get(message_id)
        repeat = Delivery(delivery.message.identified(message_id), delivery.token)
        if outcome == "done":
            report.duplicates.append(repeat)
            metrics.duplicates += 1
            if consumer.wants_duplicate_results:
                call_hook_protected(
                    consumer.on_duplicate,
                    repeat.message,
                    report.results.get(message_id),
                    consumer=consumer.consumer_name,
                    after="the commit",
                )
        elif isinstance(outcome, DeadLetter):
            report.dead_lettered.append((repeat, outcome))
        else:
            report.unsettled.append(repeat)

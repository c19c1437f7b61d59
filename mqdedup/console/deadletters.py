"""The dead letters the console shows and acts on, from the places of
:mod:`mqdedup.deadletters` (the database table, Kafka dead-letter topics, RabbitMQ
dead-letter queues).

:class:`DeadLetterService` holds the places and how a replay runs (given by the CLI,
which knows the consumers and brokers); the pages only call :meth:`groups`,
:meth:`record`, :meth:`keys_of_group` and :meth:`act`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mqdedup.consumers.base import Consumer
    from mqdedup.deadletters.records import DeadLetterPlace, DeadLetterRecord

#: The dead letters read per place for the listing (and a group's replay).
LIST_LIMIT = 5000
ACTIONS = ("replay", "requeue", "delete")

#: ``replay(consumer, place, records)`` -> (messages replayed, one line saying what happened).
Replayer = Callable[["Consumer", "DeadLetterPlace", Sequence["DeadLetterRecord"]], tuple[int, str]]


@dataclass(frozen=True)
class Group:
    """Dead letters of one place, consumer and error."""

    place: str
    consumer: str | None
    error: str
    records: list[DeadLetterRecord]

    @property
    def oldest(self) -> Any:
        """When the oldest of them was dead-lettered (None if unknown)."""
        moments = [r.dead_lettered_at for r in self.records if r.dead_lettered_at is not None]
        return min(moments) if moments else None


@dataclass
class PlaceState:
    """One place as the listing shows it: its depth, or why it could not be read."""

    place: str
    depth: int | None
    error: str | None = None
    groups: list[Group] = field(default_factory=list)


@dataclass
class DeadLetterService:
    """The places the console reads, and the replay it runs through a consumer."""

    places: Sequence[DeadLetterPlace]
    replay: Replayer | None = None

    def place(self, name: str) -> DeadLetterPlace:
        """The place called ``name``."""
        for place in self.places:
            if place.place == name:
                return place
        raise KeyError(name)

    def overview(self, limit: int = LIST_LIMIT) -> list[PlaceState]:
        """Every place with its depth and groups; a place that fails says why."""
        from mqdedup.deadletters.records import group

        states: list[PlaceState] = []
        for place in self.places:
            try:
                records = place.list(limit=limit)
                depth = place.depth()
            except Exception as exc:  # one broker down must not hide the other places
                states.append(PlaceState(place.place, None, _reason(exc)))
                continue
            groups = [
                Group(place.place, consumer, error, members)
                for (consumer, error), members in group(records).items()
            ]
            states.append(PlaceState(place.place, depth, None, groups))
        return states

    def keys_of_group(self, place: str, consumer: str, error: str) -> list[DeadLetterRecord]:
        """The dead letters of one group, now."""
        records = self.place(place).list(consumer=consumer or None, limit=LIST_LIMIT)
        return [r for r in records if (r.consumer or "") == consumer and r.error == error]

    def record(self, place: str, key: str) -> DeadLetterRecord | None:
        """One dead letter."""
        return self.place(place).get(key)

    def act(
        self, action: str, place_name: str, keys: Sequence[str], consumer: Consumer | None
    ) -> tuple[int, str]:
        """Run ``action`` on ``keys``: (messages acted on, what happened, one line)."""
        place = self.place(place_name)
        if action == "delete":
            count = place.delete(keys)
            return count, f"deleted {count} dead letter(s) from {place_name}"
        if action == "requeue":
            count = place.requeue(keys)
            return count, f"requeued {count} dead letter(s) from {place_name} to their source"
        if action == "replay":
            if consumer is None or self.replay is None:
                raise ValueError("no consumer class given for this consumer")
            # One read of the place; keys already handled (a second click) are gone.
            wanted = set(keys)
            records = [
                r
                for r in place.list(consumer=consumer.consumer_name, limit=LIST_LIMIT)
                if r.key in wanted
            ]
            return self.replay(consumer, place, records)
        raise ValueError(f"unknown action {action!r}")


def _reason(error: Exception) -> str:
    from mqdedup.masking import mask_text

    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return mask_text(f"cannot read: {text}")

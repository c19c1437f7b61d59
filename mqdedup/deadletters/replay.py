"""Replaying dead letters: the consumer's Worker and Processor over chosen dead letters.

A replay is a transport over dead letters, run by the same
:class:`~mqdedup.consumers.worker.Worker` as live traffic, so each message is claimed
first: one already processed is a duplicate, and replaying twice runs its effects once.
Kept dead letters (the ``database`` place) go through
:class:`~mqdedup.consumers.replay.ParkedTransport`; those of a Kafka topic or RabbitMQ
queue through :class:`RecordTransport`, which drops a dead letter from its place
(:meth:`DeadLetterPlace.delete`) only after its message was settled (processed or a
duplicate, committed): every :data:`DROP_EVERY` settled messages and at the end of the
run. A message that fails again stays where it was.

If the replay stops (or the broker fails) between a commit and that drop, the dead
letter is still listed; replaying it again finds the claim (a duplicate) and drops it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.replay import ParkedTransport
from mqdedup.consumers.spec import ConsumerSpec
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.consumers.worker import Worker
from mqdedup.db.engine import session_factory
from mqdedup.deadletters.database import row_id_of
from mqdedup.deadletters.records import DeadLetterPlace, DeadLetterRecord
from mqdedup.dedup.store import DedupStore
from mqdedup.errors import ConfigurationError
from mqdedup.stopping import StopToken


@dataclass
class ReplayOutcome:
    """What replaying dead letters did."""

    handed_out: int = 0
    #: Messages whose effects were applied now.
    processed: int = 0
    #: Messages already processed before (nothing ran).
    duplicates: int = 0
    #: Messages whose handler failed again: they stay in their place.
    dead_lettered_again: int = 0
    #: Dead letters removed from their place (settled: processed or duplicates).
    removed: int = 0

    def __str__(self) -> str:
        return (
            f"replayed {self.handed_out} dead letter(s): {self.processed} processed, "
            f"{self.duplicates} already processed, {self.dead_lettered_again} failed again "
            f"(still kept); {self.removed} removed from their place"
        )


#: A replay drops settled dead letters from their place at least this often.
DROP_EVERY = 1000


class RecordTransport:
    """Hands out the messages of chosen dead letters once each; settling drops them from
    their place, a dead letter again leaves them there. ``token``: the record's key."""

    def __init__(self, records: Sequence[DeadLetterRecord], place: DeadLetterPlace) -> None:
        self.place = place
        self._waiting: list[Delivery[Any]] = [Delivery(r.message, r.key) for r in records]
        self._again: list[Delivery[Any]] = []
        self._kept_again: set[str] = set()
        self._done: list[str] = []
        self.settled = 0
        self.dead_lettered_again = 0

    def fetch(self, max_messages: int, timeout: float) -> list[Delivery[Any]]:
        """The next ``max_messages`` (none left: an empty list)."""
        source = self._again if self._again else self._waiting
        batch, rest = source[:max_messages], source[max_messages:]
        if source is self._again:
            self._again = rest
        else:
            self._waiting = rest
        return batch

    def settle(self, deliveries: Sequence[Delivery[Any]]) -> None:
        """Note the dead letters whose message is done (not those that failed again);
        they are dropped from their place together (one scan of a RabbitMQ queue, one
        mark of a Kafka topic), at the latest when the run closes the transport."""
        self._done.extend(str(d.token) for d in deliveries if str(d.token) not in self._kept_again)
        if len(self._done) >= DROP_EVERY:
            self._drop()

    def give_back(self, deliveries: Sequence[Delivery[Any]]) -> None:
        """Hand these out again, first."""
        again = [
            Delivery(dataclasses.replace(d.message, redelivered=True), d.token) for d in deliveries
        ]
        self._again = again + self._again

    def dead_letter(self, delivery: Delivery[Any], record: DeadLetter) -> None:
        """Failed again: the dead letter stays in its place (the worker logs the reason)."""
        self._kept_again.add(str(delivery.token))
        self.dead_lettered_again += 1

    def keepalive(self) -> None:
        """Nothing to keep alive."""

    def close(self) -> None:
        """Drop what is done from the place; dead letters not settled stay."""
        self._drop()

    def _drop(self) -> None:
        done, self._done = self._done, []
        if done:
            self.settled += self.place.delete(done)


def replay(
    records: Sequence[DeadLetterRecord],
    consumer: ConsumerSpec,
    database: Engine,
    place: DeadLetterPlace,
    *,
    stop: StopToken | None = None,
) -> ReplayOutcome:
    """Run ``consumer`` over ``records`` (dead letters of ``place``), through its claims.

    Each message gets its full retries again (its attempt count is forgotten first).
    Records of another consumer are refused: a replay runs one consumer's handler.
    """
    mine = (None, consumer.consumer_name)
    others = sorted({str(r.consumer) for r in records if r.consumer not in mine})
    if others:
        raise ConfigurationError(
            f"these dead letters belong to {', '.join(others)}, not to "
            f"{consumer.consumer_name!r}: replay them with their own consumer"
        )
    if not records:
        return ReplayOutcome()
    sessions: sessionmaker[Session] = session_factory(database)
    _forget_attempts(sessions, consumer, records)
    metrics = Metrics()
    if place.place == "database":
        parked = ParkedTransport(
            sessions,
            consumer.consumer_name,
            prefix=consumer.table_prefix,
            ids=[row_id_of(r.key) for r in records],
        )
        Worker(consumer, parked, sessions, stop=stop, metrics=metrics).run(until_idle=True)
        settled, again = parked.settled, parked.dead_lettered_again
    else:
        transport = RecordTransport(records, place)
        Worker(consumer, transport, sessions, stop=stop, metrics=metrics).run(until_idle=True)
        settled, again = transport.settled, transport.dead_lettered_again
    return ReplayOutcome(
        handed_out=metrics.delivered,
        processed=metrics.processed,
        duplicates=metrics.duplicates,
        dead_lettered_again=again,
        removed=settled,
    )


def _forget_attempts(
    sessions: sessionmaker[Session], consumer: ConsumerSpec, records: Sequence[DeadLetterRecord]
) -> None:
    ids = sorted({r.message_id for r in records if r.message_id is not None})
    if not ids:
        return
    store = DedupStore(consumer.table_prefix)
    with sessions() as session, session.begin():
        store.forget_attempts(consumer.consumer_name, ids, session)

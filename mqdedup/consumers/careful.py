"""Careful mode: redelivered messages run one at a time, their attempt counted first.

A redelivered message may be the one whose handler killed the previous worker
(``os._exit``, OOM, a segfault): nothing could record that attempt. So each redelivered
message that is not a duplicate gets its attempt counted and committed *before* its
handler runs, then runs alone in its own transaction. A process-killer thus reaches
``max_attempts`` and is dead-lettered without running again, and its batch-mates are
processed around it. Committed duplicates (the common redelivery, after a crash between
commit and settle) are found with one read for the whole batch and cost nothing more.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from mqdedup.consumers.report import BatchReport, Outcome
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.errors import MessageError

if TYPE_CHECKING:
    from mqdedup.consumers.pipeline import Pipeline
    from mqdedup.dedup.claims import AttemptLog

log = logging.getLogger(__name__)

#: The last error of an attempt counted before its handler ran, until it finishes; the
#: dead-letter reason when the attempts ran out that way (the process died each time).
WORKER_DIED = "the worker died while handling it"


class Lease(Protocol):
    """The claim store's unit of work, held for a run of single messages."""

    def unit(self) -> Any:
        """The ``unit`` argument of the claim store (a session, a worker id)."""
        ...

    def close(self) -> None:
        """Give it back."""
        ...


class RunsAlone(Protocol):
    """What careful mode needs from a claim store's unit of work."""

    def lease(self) -> Lease:
        """A unit of work for a run of single messages."""
        ...

    def alone(self, delivery: Delivery[Any], lease: Any) -> Outcome:
        """Run one message on its own (its own transaction, its own claim round)."""
        ...


class CarefulRuns:
    """Runs the redelivered deliveries of a batch carefully (claim stores that are an
    :class:`~mqdedup.dedup.claims.AttemptLog`: SQL and Redis)."""

    def __init__(self, processor: Pipeline, runs: RunsAlone, store: AttemptLog) -> None:
        self.p = processor
        self.runs = runs
        self.store = store
        self.name = processor.name
        self.policy = processor.consumer.retry_policy

    def run(self, deliveries: Sequence[Delivery[Any]], report: BatchReport) -> list[Delivery[Any]]:
        """Process the redelivered deliveries one at a time; return the others."""
        careful = [d for d in deliveries if d.message.redelivered]
        others = [d for d in deliveries if not d.message.redelivered]
        fresh = self._skip_processed(careful, report)
        lease = self.runs.lease()
        try:
            for index, delivery in enumerate(fresh):
                if self.p.stop.requested:
                    report.unsettled.extend(fresh[index:])
                    report.unsettled.extend(others)
                    return []
                self._careful_one(delivery, lease, report)
        finally:
            lease.close()
        return others

    def _skip_processed(
        self, deliveries: list[Delivery[Any]], report: BatchReport
    ) -> list[Delivery[Any]]:
        """Settle the deliveries whose claims are committed; return the rest (one read)."""
        if not self.p.consumer.deduplicate or not deliveries:
            return deliveries
        ids = [str(d.message.id) for d in deliveries]
        done = self.p.outages.run(functools.partial(self.store.processed, self.name, ids))
        if not done:
            return deliveries
        duplicates = [d for d in deliveries if d.message.id in done]
        stored = {key: value for key, value in done.items() if value is not None}
        self.p.committed(Outcome(duplicates=duplicates, stored_results=stored), report)
        return [d for d in deliveries if d.message.id not in done]

    def _careful_one(self, delivery: Delivery[Any], lease: Lease, report: BatchReport) -> None:
        """Count the attempt first, then run the message alone; retry up to the policy."""
        message_id = str(delivery.message.id)
        outages = self.p.outages
        while True:
            attempts, last_error, started = outages.run(
                functools.partial(self._start_attempt, message_id, lease)
            )
            if not started:
                record = self._exhausted_record(attempts, last_error)
                report.dead_lettered.append((delivery, record))
                log.warning(
                    "redelivered message has no attempts left; dead-lettering it unrun",
                    extra={
                        "consumer": self.name,
                        "message_id": message_id,
                        "reason": record.reason,
                    },
                )
                return
            outcome = outages.run(functools.partial(self.runs.alone, delivery, lease))
            self.p.committed(outcome, report)
            if outcome.duplicates:  # claimed meanwhile by another worker: nothing ran
                outages.run(functools.partial(self.store.undo_attempt, self.name, message_id))
            if not outcome.failures:
                return
            error = outcome.failures[0][1]
            outages.run(
                functools.partial(
                    self.store.finish_attempt,
                    self.name,
                    message_id,
                    f"{type(error).__name__}: {error}",
                )
            )
            self.p.metrics.failures += 1
            if isinstance(error, MessageError) or attempts >= self.policy.max_attempts:
                report.dead_lettered.append((delivery, self.p.letters.record(error, attempts)))
                return
            if not outages.pause(self.policy.backoff(attempts)):
                report.unsettled.append(delivery)  # stopping: leave it to the next owner
                return
            self.p.metrics.retries += 1

    def _start_attempt(self, message_id: str, lease: Lease) -> tuple[int, str | None, bool]:
        unit = lease.unit()
        try:
            return self.store.start_attempt(
                unit, self.name, message_id, WORKER_DIED, self.policy.max_attempts
            )
        except BaseException:
            lease.close()
            raise

    def _exhausted_record(self, attempts: int, last_error: str | None) -> DeadLetter:
        """The dead letter of a message whose attempts were used up before it ran again."""
        if last_error is None or last_error == WORKER_DIED:
            reason = WORKER_DIED
        else:
            reason = f"handler failed after {attempts} attempts: {last_error}"
        return DeadLetter(
            reason=reason,
            consumer=self.name,
            attempts=attempts,
            error_message=last_error,
        )

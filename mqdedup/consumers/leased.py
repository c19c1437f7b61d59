"""Claim stores without a transaction (Redis): claims leased while their handlers run.

The unit of work of a non-transactional claim store (``RedisDedup``): claim the batch's
ids in one round trip under this worker's id; run each new message's handler (no
``ctx.session``); right after it returns, write its completion with its result; after a
failure, release its claim. Leases are renewed while the batch is worked through. A
message claimed by another worker (busy) is waited for until that worker completes it
(then it is a duplicate) or its lease runs out (then it is ours).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mqdedup.consumers.handling import Handlers
from mqdedup.consumers.report import WorkOutcome, log_failure

if TYPE_CHECKING:
    from mqdedup.consumers.metrics import Metrics
    from mqdedup.consumers.transport import Delivery
    from mqdedup.dedup.claims import ClaimStore
    from mqdedup.outages import Outages

#: Bounds of one wait for a busy claim (seconds): the lease left, clamped to these.
BUSY_WAIT = (0.05, 0.5)


class LeasedRuns:
    """Runs deliveries against a leasing claim store; returns what they came to.

    ``outages`` waits out the claim store's outages around each of its calls (a
    completion must not be lost to a blip after its handler ran).
    """

    def __init__(
        self,
        name: str,
        store: ClaimStore,
        handlers: Handlers,
        metrics: Metrics,
        outages: Outages,
        worker_id: str | None = None,
    ) -> None:
        self.name = name
        self.store = store
        self.handlers = handlers
        self.metrics = metrics
        self.outages = outages
        #: Identifies this worker's claims; unique per processor.
        self.worker_id = worker_id or uuid.uuid4().hex

    def batch(self, deliveries: Sequence[Delivery[Any]]) -> WorkOutcome:
        """Run a batch until every message is claimed by us or done."""
        return self._until_claimed(deliveries)

    def one(self, delivery: Delivery[Any], lease: _WorkerLease | None = None) -> WorkOutcome:
        """One message on its own claim round."""
        return self._until_claimed([delivery])

    def lease(self) -> _WorkerLease:
        """This worker's id, for careful mode's attempts."""
        return _WorkerLease(self.worker_id)

    def _until_claimed(self, deliveries: Sequence[Delivery[Any]]) -> WorkOutcome:
        total = WorkOutcome()
        waiting = list(deliveries)
        while waiting:
            outcome, busy = self._round(waiting)
            total.add(outcome)
            if not busy:
                break
            waiting = [d for d, _ in busy]
            low, high = BUSY_WAIT
            if not self.outages.pause(min(max(min(left for _, left in busy), low), high)):
                total.unsettled.extend(waiting)  # stopping: the next owner gets them
                break
        return total

    def _round(
        self, deliveries: Sequence[Delivery[Any]]
    ) -> tuple[WorkOutcome, list[tuple[Delivery[Any], float]]]:
        """Claim ``deliveries`` (one round trip) and run the handler for the new ones."""
        store, outages, name, worker = self.store, self.outages, self.name, self.worker_id
        outcome = WorkOutcome()
        busy: list[tuple[Delivery[Any], float]] = []
        ids = [str(d.message.id) for d in deliveries]
        started = time.monotonic()
        claims = outages.run(functools.partial(store.claim, worker, name, ids))
        claimed_at = time.monotonic()
        self.metrics.histograms.observe("claim_seconds", claimed_at - started)
        new: list[Delivery[Any]] = []
        for delivery in deliveries:
            message_id = str(delivery.message.id)
            if message_id in claims.new:
                new.append(delivery)
            elif message_id in claims.busy:
                busy.append((delivery, claims.busy[message_id]))
            else:
                outcome.duplicates.append(delivery)
                stored = claims.done.get(message_id)
                if stored is not None:
                    outcome.stored_results[message_id] = stored
        renew_after = (store.lease or float("inf")) / 3
        for index, delivery in enumerate(new):
            if time.monotonic() - claimed_at > renew_after:
                rest = [str(d.message.id) for d in new[index:]]
                outages.run(functools.partial(store.renew, worker, name, rest))
                claimed_at = time.monotonic()
            self._handle_one(delivery, outcome)
        return outcome, busy

    def _handle_one(self, delivery: Delivery[Any], outcome: WorkOutcome) -> None:
        store, outages, name, worker = self.store, self.outages, self.name, self.worker_id
        message_id = str(delivery.message.id)
        try:
            result = self.handlers.call(None, delivery)
        except Exception as error:
            log_failure(name, delivery, error)
            outages.run(functools.partial(store.forget, worker, name, [message_id]))
            outcome.failures.append((delivery, error))
            return
        outages.run(functools.partial(store.save_results, worker, name, {message_id: result}))
        outcome.durable_at = time.monotonic()
        outcome.processed.append(delivery)
        if result is not None:
            outcome.results[message_id] = result


class _WorkerLease:
    """The unit of work of a leasing store is the worker id: nothing to open or close."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id

    def unit(self) -> str:
        """The worker id the claims are held under."""
        return self.worker_id

    def close(self) -> None:
        """Nothing to give back."""

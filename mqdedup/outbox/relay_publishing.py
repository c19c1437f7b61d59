"""The relay's publish step: :func:`publish_records` sends each broker's rows of a claimed
batch through its publisher, in id order, with a producer trace span per row, and sorts
the outcome into a :class:`CycleReport` (published / refused by the broker / not
published because the broker was unavailable); :class:`BrokerPauses` keeps an unavailable
broker paused with backoff until its rows go through again."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from mqdedup import tracing
from mqdedup.backoff import Backoff
from mqdedup.logs import RepeatedLog
from mqdedup.outbox.publishers import (
    PUBLISHED,
    OutboxRecord,
    Publisher,
    PublishOutcome,
    PublishResult,
)
from mqdedup.tracing import TRACE_HEADERS, PublishTrace

log = logging.getLogger(__name__)
#: Written at each failed batch of a paused broker: once, then less often.
BROKER_WAIT = "broker unavailable; its rows wait"
_WAITS = RepeatedLog(log)


@dataclass
class CycleReport:
    """What one claim → publish → mark cycle did."""

    claimed: int = 0
    published: list[OutboxRecord] = field(default_factory=list)
    rejected: list[tuple[OutboxRecord, str]] = field(default_factory=list)
    failed: list[OutboxRecord] = field(default_factory=list)
    unavailable: list[OutboxRecord] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """True when every claimed row was published."""
        return len(self.published) == self.claimed


def publish_records(
    publishers: Mapping[str, Publisher],
    records: Sequence[OutboxRecord],
    broker_result: Callable[[str, Sequence[PublishResult]], None],
) -> CycleReport:
    """Send each broker's records through its publisher (id order per broker).

    ``broker_result`` hears each broker's results (its availability backoff). A
    publisher that raises, or returns the wrong number of results, makes its records
    unavailable.
    """
    by_broker: dict[str, list[int]] = {}
    for index, record in enumerate(records):
        by_broker.setdefault(record.broker, []).append(index)
    results: list[PublishResult] = [PUBLISHED] * len(records)
    traced = tracing.enabled()  # once per batch: without a tracer provider, no spans
    for broker, indexes in by_broker.items():
        traces = [_trace(records[i]) for i in indexes] if traced else []
        batch = (
            [_with_trace(records[i], span.headers) for i, span in zip(indexes, traces, strict=True)]
            if traced
            else [records[i] for i in indexes]  # the rows' own trace headers go out
        )
        try:
            outcome = publishers[broker].publish_batch(batch)
            if len(outcome) != len(batch):
                raise RuntimeError(
                    f"publisher returned {len(outcome)} results for {len(batch)} records"
                )
        except Exception as error:
            log.exception("publisher failed", extra={"broker": broker})
            failure = PublishResult.unavailable(f"{type(error).__name__}: {error}")
            outcome = [failure] * len(batch)
        for index, result in zip(indexes, outcome, strict=True):
            results[index] = result
        for span, result in zip(traces, outcome, strict=False):  # no traces: nothing to end
            span.end(None if result.outcome is PublishOutcome.PUBLISHED else result.error)
        broker_result(broker, outcome)
    report = CycleReport(claimed=len(records))
    for record, result in zip(records, results, strict=True):
        if result.outcome is PublishOutcome.PUBLISHED:
            report.published.append(record)
        elif result.outcome is PublishOutcome.REJECTED:
            report.rejected.append((record, result.error or "rejected"))
        else:
            report.unavailable.append(record)
    return report


def _trace(record: OutboxRecord) -> PublishTrace:
    """The producer span of one row."""
    return PublishTrace(
        # The default exchange routes by key: name the queue then.
        record.destination or record.routing_key or "(default exchange)",
        record.message_id,
        record.headers,
    )


def _with_trace(record: OutboxRecord, trace_headers: Mapping[str, str]) -> OutboxRecord:
    """``record`` carrying ``trace_headers`` (the publish span) instead of its own."""
    if all(record.headers.get(name) == trace_headers.get(name) for name in TRACE_HEADERS):
        return record  # no span (or none recorded): the row's own trace headers go out
    headers = {k: v for k, v in record.headers.items() if k not in TRACE_HEADERS}
    headers.update(trace_headers)
    return record._replace(headers=headers)


@dataclass
class _BrokerState:
    """Backoff of one broker while it is unavailable."""

    failures: int = 0
    paused_until: float = 0.0


class BrokerPauses:
    """Which brokers are paused, and until when, after their rows came back unavailable."""

    def __init__(self, brokers: Iterable[str], backoff_max: float) -> None:
        self._brokers: dict[str, _BrokerState] = {name: _BrokerState() for name in brokers}
        self._backoff = Backoff(0.25, backoff_max, jitter=(0.8, 1.0))

    def record(self, broker: str, results: Sequence[PublishResult]) -> bool:
        """Note ``broker``'s results of one batch; True when an outage begins."""
        state = self._brokers[broker]
        down = [r for r in results if r.outcome is PublishOutcome.UNAVAILABLE]
        if not down:
            if state.failures:
                log.info("broker available again", extra={"broker": broker})
                _WAITS.done(BROKER_WAIT, key=broker)
            state.failures = 0
            state.paused_until = 0.0
            return False
        state.failures += 1
        pause = self._backoff.delay(state.failures)
        state.paused_until = time.monotonic() + pause
        _WAITS.warning(
            BROKER_WAIT,
            key=broker,
            extra={
                "broker": broker,
                "rows": len(down),
                "retry_in": round(pause, 2),
                "consecutive": state.failures,
                "error": down[0].error,
            },
        )
        return state.failures == 1

    def paused(self) -> set[str]:
        """The brokers paused now."""
        now = time.monotonic()
        return {name for name, state in self._brokers.items() if state.paused_until > now}

    def next_retry(self) -> float | None:
        """The earliest end of a pause (``time.monotonic()``), None if none was set."""
        pauses = [s.paused_until for s in self._brokers.values() if s.paused_until]
        return min(pauses) if pauses else None

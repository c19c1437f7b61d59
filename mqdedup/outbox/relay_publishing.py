"""Publishing one claimed batch: each broker's rows through its publisher, traced, sorted
into a :class:`~mqdedup.outbox.relay_metrics.CycleReport` (published / refused /
not published because the broker was unavailable)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from mqdedup import tracing
from mqdedup.outbox.publishers import (
    PUBLISHED,
    OutboxRecord,
    Outcome,
    Publisher,
    PublishResult,
)
from mqdedup.outbox.relay_metrics import CycleReport
from mqdedup.tracing import TRACE_HEADERS, PublishTrace

log = logging.getLogger(__name__)


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
            span.end(None if result.outcome is Outcome.PUBLISHED else result.error)
        broker_result(broker, outcome)
    report = CycleReport(claimed=len(records))
    for record, result in zip(records, results, strict=True):
        if result.outcome is Outcome.PUBLISHED:
            report.published.append(record)
        elif result.outcome is Outcome.REJECTED:
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

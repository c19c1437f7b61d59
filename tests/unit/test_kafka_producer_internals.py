"""The recovering producer's use of kafka-python internals, and its public-API fallback.

One internal is used (docs/architecture.md, "Third-party internals in the adapters"): the
record future's ``_produce_future``, whose ``base_offset`` tells a batch the broker
refused (``None``) from one aborted because the producer went fatal (``-1``). Without it
(another kafka-python) every record that failed with a refusal in a round of several is
sent again alone: only a lone record's refusal is believed. The producer's fatal state is
read from the futures' errors (public), not from ``_transaction_manager``.
"""

from __future__ import annotations

from typing import Any

import kafka.errors as kafka_errors

from mqdedup.kafka.producer import ProducerRecord, RecoveringProducer, SendOutcome, _was_aborted


class Future:
    """A kafka-python record future, done; ``base_offset`` given: with the internal."""

    def __init__(self, error: BaseException | None = None, **internal: Any) -> None:
        self.is_done = True
        self.exception = error
        if "base_offset" in internal:
            self._produce_future = type(
                "Batch", (), {"is_done": True, "value": (internal["base_offset"], None, None)}
            )()

    def succeeded(self) -> bool:
        return self.exception is None

    def get(self, timeout: float | None = None) -> None:
        return None


class Producer:
    """``plan``: value -> the Future its send returns (default: acknowledged)."""

    def __init__(self, plan: dict[bytes, Future]) -> None:
        self.plan = plan
        self.sent: list[bytes] = []
        self.closed = False

    def send(self, topic: str, key: Any, value: bytes, headers: Any) -> Future:
        self.sent.append(value)
        return self.plan.get(value, Future())

    def flush(self, timeout: float | None = None) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
        self.closed = True


def recovering(*plans: dict[bytes, Future]) -> tuple[RecoveringProducer, list[Producer]]:
    made: list[Producer] = []

    def factory(**_config: Any) -> Producer:
        made.append(Producer(plans[min(len(made), len(plans) - 1)]))
        return made[-1]

    return RecoveringProducer({}, name="test", factory=factory), made


def records(*values: bytes) -> list[ProducerRecord]:
    return [ProducerRecord("t", b"k", value, []) for value in values]


TOO_LARGE = kafka_errors.MessageSizeTooLargeError(None)


def test_with_the_internal_aborted_batch_mates_go_again_together() -> None:
    first = {
        b"a": Future(TOO_LARGE, base_offset=-1),
        b"big": Future(TOO_LARGE, base_offset=None),
        b"b": Future(TOO_LARGE, base_offset=-1),
    }
    producer, made = recovering(first, {})
    sent = producer.send_all(records(b"a", b"big", b"b"), 5.0)
    assert [s.outcome for s in sent] == [
        SendOutcome.PUBLISHED,
        SendOutcome.REFUSED,
        SendOutcome.PUBLISHED,
    ]
    assert made[1].sent == [b"a", b"b"]  # one round, the refused record not again


def test_without_the_internal_every_suspect_is_sent_alone_and_the_outcomes_are_the_same() -> None:
    """kafka-python without ``_produce_future``: the public-API fallback."""
    first = {b"a": Future(TOO_LARGE), b"big": Future(TOO_LARGE), b"b": Future(TOO_LARGE)}
    alone = {b"big": Future(TOO_LARGE)}
    producer, made = recovering(first, alone)
    sent = producer.send_all(records(b"a", b"big", b"b"), 5.0)
    assert [s.outcome for s in sent] == [
        SendOutcome.PUBLISHED,
        SendOutcome.REFUSED,
        SendOutcome.PUBLISHED,
    ]
    assert "MessageSizeTooLargeError" in str(sent[1].error)
    assert [value for producer in made[1:] for value in producer.sent] == [b"a", b"big", b"b"]


def test_an_internal_of_another_shape_counts_as_missing() -> None:
    future = Future(TOO_LARGE, base_offset=-1)
    future._produce_future.value = (-1, None)  # not kafka-python 3.0's (offset, ts, error)
    assert _was_aborted(future) is None
    future._produce_future.value = (-1, None, None)
    assert _was_aborted(future) is True
    assert _was_aborted(Future(TOO_LARGE)) is None


def test_a_producer_the_cluster_refuses_is_replaced_without_reading_its_internals() -> None:
    """kafka-python makes the idempotent producer fatal when the cluster refuses it (no
    IdempotentWrite permission): the futures say so; a fresh producer is made for the
    next call, so writing resumes once the permission is granted."""
    denied = {b"x": Future(kafka_errors.ClusterAuthorizationFailedError())}
    producer, made = recovering(denied, {})
    [first] = producer.send_all(records(b"x"), 5.0)
    assert first.outcome is SendOutcome.UNAVAILABLE  # an outage to fix, not the record's fault
    assert made[0].closed and producer.replacements == 1
    [second] = producer.send_all(records(b"x"), 5.0)
    assert second.outcome is SendOutcome.PUBLISHED

"""One object decides and performs a Kafka group member's offset commits (issue 41).

:class:`~mqdedup.kafka.offset_commits.OffsetCommits` against a fake kafka-python consumer
(no broker): what it commits on each event (a poll-thread turn, the first records of a
fresh assignment, a revoke, the stop), when, how long it may wait, and that a fenced
member commits nothing more. The real-broker behaviour is in
``tests/integration/kafka/`` (careful mode, assignment, faults).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kafka.errors as kafka_errors
import pytest
from kafka.structs import OffsetAndMetadata, TopicPartition

from mqdedup.kafka import offset_commits
from mqdedup.kafka.clean_stop import CLEAN_STOP_METADATA
from mqdedup.kafka.offset_commits import OffsetCommits
from mqdedup.kafka.offsets import OffsetTracker

P0 = ("orders", 0)
P1 = ("orders", 1)
KAFKA = Path(__file__).resolve().parents[2] / "mqdedup" / "kafka"


class FakeConsumer:
    """The kafka-python consumer calls a commit policy makes, recorded."""

    def __init__(self, assigned: list[tuple[str, int]], previous: Any = None) -> None:
        self.assigned = [TopicPartition(*key) for key in assigned]
        self.previous = previous  # what ``committed`` answers
        self.commits: list[tuple[dict[tuple[str, int], tuple[int, str]], int]] = []
        self.async_commits: list[dict[tuple[str, int], tuple[int, str]]] = []
        self.error: Exception | None = None

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def committed(self, _tp: TopicPartition, **_kwargs: Any) -> Any:
        return self.previous

    def commit(self, request: dict[Any, OffsetAndMetadata], timeout_ms: int) -> None:
        if self.error is not None:
            raise self.error
        self.commits.append((_plain(request), timeout_ms))

    def commit_async(self, request: dict[Any, OffsetAndMetadata], callback: Any) -> None:
        self.async_commits.append(_plain(request))


def _plain(request: dict[Any, OffsetAndMetadata]) -> dict[tuple[str, int], tuple[int, str]]:
    return {(tp.topic, tp.partition): (om.offset, om.metadata) for tp, om in request.items()}


def policy(
    interval: float = 0.2, on_fenced: Callable[[], None] = lambda: None
) -> tuple[OffsetCommits, OffsetTracker]:
    tracker = OffsetTracker(redelivery_window=10)
    settings: Any = SimpleNamespace(
        consumer_name="orders", commit_interval=interval, commit_timeout=10.0
    )
    return OffsetCommits(settings, tracker, on_fenced=on_fenced), tracker


def settle(tracker: OffsetTracker, key: tuple[str, int], offsets: range) -> None:
    for offset, tracked in zip(offsets, tracker.track_many(key, offsets), strict=True):
        assert tracked is not None
        tracker.settle_many([(key, offset, tracked[0])])


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(offset_commits.time, "monotonic", lambda: now[0])
    return now


def test_a_turn_commits_settled_offsets_of_assigned_partitions_once_per_interval(
    clock: list[float],
) -> None:
    commits, tracker = policy(interval=0.2)
    settle(tracker, P0, range(0, 5))
    settle(tracker, ("gone", 3), range(0, 2))  # tracked, no longer assigned
    consumer = FakeConsumer([P0, P1])
    assert commits.due(consumer, wait=0.5)
    # The stop bound caps the wait (the consumer's commit_timeout is 10 s).
    assert consumer.commits == [({P0: (5, "")}, 500)]
    settle(tracker, P0, range(5, 7))
    assert not commits.due(consumer, wait=0.5)  # within the interval: not yet
    clock[0] += 0.2
    assert commits.due(consumer, wait=0.5)
    assert consumer.commits[-1] == ({P0: (7, "")}, 500)
    clock[0] += 1
    assert commits.due(consumer, wait=0.5)  # nothing settled since: no commit
    assert len(consumer.commits) == 2


def test_a_failed_commit_is_retried_a_second_later(clock: list[float]) -> None:
    commits, tracker = policy(interval=0.2)
    settle(tracker, P0, range(0, 3))
    consumer = FakeConsumer([P0])
    consumer.error = kafka_errors.KafkaConnectionError("down")
    assert not commits.due(consumer, wait=0.5)
    consumer.error = None
    clock[0] += 0.5
    assert not commits.due(consumer, wait=0.5)  # backing off
    clock[0] += 0.5
    assert commits.due(consumer, wait=0.5)
    assert consumer.commits == [({P0: (3, "")}, 500)]
    assert tracker.to_commit() == {}


def test_the_stop_commits_with_the_clean_stop_marker() -> None:
    commits, tracker = policy()
    settle(tracker, P0, range(0, 4))
    settle(tracker, P1, range(0, 2))
    tracker.committed({P1: 2})  # committed already: marked again for the next owner
    consumer = FakeConsumer([P0, P1])
    commits.stopping(consumer, timeout=0.5)
    assert consumer.commits == [({P0: (4, CLEAN_STOP_METADATA), P1: (2, CLEAN_STOP_METADATA)}, 500)]


def test_a_revoke_commits_asynchronously_what_it_revokes() -> None:
    commits, tracker = policy()
    settle(tracker, P0, range(0, 4))
    settle(tracker, P1, range(0, 2))
    consumer = FakeConsumer([P0, P1])
    assert commits.revoked(consumer, [P0]) == {P0: 4}
    assert consumer.async_commits == [{P0: (4, CLEAN_STOP_METADATA)}]
    assert consumer.commits == []  # never blocking on kafka-python's IO thread
    assert commits.revoked(None, [P1]) == {P1: 2}  # closed: nothing to commit through


@pytest.mark.parametrize(
    ("previous", "careful"),
    [
        (OffsetAndMetadata(7, CLEAN_STOP_METADATA, -1), False),
        (None, False),  # nobody ever committed
        (OffsetAndMetadata(7, "", -1), True),  # the previous owner may have died
    ],
)
def test_the_first_records_of_an_assignment_leave_a_trace(previous: Any, careful: bool) -> None:
    commits, tracker = policy()
    tracker.assign([P0])
    consumer = FakeConsumer([P0], previous=previous)
    commits.first_records(consumer, TopicPartition(*P0), 7)
    [tracked] = tracker.track_many(P0, [7])
    assert tracked is not None
    # Not careful: its start is committed without the marker, so a death leaves a trace.
    assert tracked[1] is careful
    assert consumer.commits == ([] if careful else [({P0: (7, "")}, 10_000)])


def test_a_fenced_member_commits_nothing_more() -> None:
    fenced: list[bool] = []
    commits, tracker = policy(on_fenced=lambda: fenced.append(True))
    settle(tracker, P0, range(0, 3))
    consumer = FakeConsumer([P0])
    consumer.error = kafka_errors.FencedInstanceIdError()
    assert commits.due(consumer, wait=0.5)  # nothing is left for this member to commit
    assert fenced == [True]
    consumer.error = None
    settle(tracker, P0, range(3, 5))
    assert commits.due(consumer, wait=0.5)
    commits.stopping(consumer, timeout=0.5)
    assert commits.revoked(consumer, [P0]) == {P0: 5}
    assert consumer.commits == [] and consumer.async_commits == []


def test_only_the_commit_policy_commits_offsets() -> None:
    """No other module of the sync Kafka adapter calls a consumer's commit."""
    committers = []
    for path in sorted(KAFKA.glob("*.py")):
        if path.name.startswith("aio_"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in {"commit", "commit_async"}:
                committers.append(path.name)
    assert set(committers) == {"offset_commits.py"}

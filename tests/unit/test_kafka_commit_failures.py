"""Offset commits failing through a Kafka outage are one WARNING and one INFO (issue 33),
on both clients, not a line per failed commit."""

from __future__ import annotations

import logging
from typing import Any

import kafka.errors as kafka_errors
import pytest

from mqdedup.kafka.offset_commits import OffsetCommits
from mqdedup.kafka.offsets import OffsetTracker


class FlakyClient:
    """Fails the first ``failures`` commits with a broker error, then succeeds."""

    def __init__(self, failures: int, error: type[Exception]) -> None:
        self.failures = failures
        self.error = error
        self.commits = 0

    def commit(self, *_args: Any, **_kwargs: Any) -> None:
        self.commits += 1
        if self.commits <= self.failures:
            raise self.error("broker unreachable")


def commit_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [
        (record.levelno, record.getMessage())
        for record in caplog.records
        if "offset commit" in record.getMessage()
    ]


def test_kafka_python_commits_failing_through_an_outage_log_two_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Settings:  # what OffsetCommits reads of a consumer's KafkaSettings
        consumer_name = "orders"
        commit_interval = 0.0
        commit_timeout = 1.0

    settings: Any = Settings()
    commits = OffsetCommits(settings, OffsetTracker())
    client = FlakyClient(8, kafka_errors.KafkaConnectionError)
    caplog.set_level(logging.DEBUG, logger="mqdedup.kafka.offset_commits")
    results = [commits.commit(client, {("orders", 0): n}, 1.0) for n in range(1, 10)]
    assert results == [False] * 8 + [True]
    lines = [(level, text) for level, text in commit_lines(caplog) if level >= logging.INFO]
    assert [level for level, _ in lines] == [logging.WARNING, logging.INFO]
    assert lines[0][1] == "offset commit failed; will retry"
    assert lines[1][1].startswith("kafka offset commits back after")

"""The Kafka outage watch: one WARNING, one INFO, nothing without a probe answer."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from mqdedup.kafka.outage import OutageWatch, kafka_python_probe
from mqdedup.outages import OutageLog


def watch(answers: list[bool | None]) -> OutageWatch:
    answers = list(answers)
    return OutageWatch(
        OutageLog("kafka", logger=logging.getLogger("mqdedup.test"), context={"consumer": "c"}),
        lambda: answers.pop(0),
        interval=0.0,
        settle=0.0,
    )


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "mqdedup.test"]


def test_an_outage_is_one_warning_and_one_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    outage = watch([True, False, False, False, False, True, True, True])
    for _ in range(8):
        outage.idle()
    assert [level for level, _ in lines(caplog)] == [logging.WARNING, logging.INFO]
    assert lines(caplog)[1][1].startswith("kafka back after")


def test_one_contrary_sample_does_not_flip(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    outage = watch([False, True, False, None, False, True])
    for _ in range(6):
        outage.idle()
    assert lines(caplog) == []


def test_records_end_an_outage_at_once(caplog: pytest.LogCaptureFixture) -> None:
    outage = watch([False, False])
    outage.idle()
    outage.idle()
    assert outage.outage.ongoing
    outage.working()
    assert not outage.outage.ongoing


def test_without_metrics_or_with_a_failing_probe_nothing_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class NoMetrics:
        def metrics(self) -> None:  # metrics_enabled=False
            return None

    class Broken:
        def metrics(self) -> Any:
            raise RuntimeError("changed")

    for consumer in (NoMetrics(), Broken()):
        outage = OutageWatch(
            OutageLog("kafka", logger=logging.getLogger("mqdedup.test"), context={}),
            kafka_python_probe(consumer),
            interval=0.0,
            settle=0.0,
        )
        for _ in range(3):
            outage.idle()
    assert lines(caplog) == []


def test_kafka_python_probe_reads_the_connection_count() -> None:
    class Consumer:
        count = 0.0

        def metrics(self) -> Any:
            return {"consumer-metrics": {"connection-count": self.count}}

    consumer = Consumer()
    probe = kafka_python_probe(consumer)
    assert probe() is False
    consumer.count = 2.0
    assert probe() is True

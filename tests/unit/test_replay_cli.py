"""``mqdedup replay`` picks its broker from the consumer's adapter (``Consumer.broker``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from mqdedup import Consumer
from mqdedup.cli import exitcodes
from mqdedup.cli.main import main
from mqdedup.kafka import KafkaConsumer


class PlainConsumer(Consumer):
    """No adapter: it is run over a transport given explicitly, so nothing to replay."""

    name = "plain"

    def handle(self, message: Any, ctx: Any) -> None:
        return None


class TopicConsumer(KafkaConsumer):
    topics: ClassVar[tuple[str, ...]] = ("orders",)
    group_id = "orders"
    bootstrap_servers: ClassVar[tuple[str, ...]] = ("127.0.0.1:1",)

    def handle(self, message: Any, ctx: Any) -> None:
        return None


def test_adapter_consumers_name_their_broker() -> None:
    assert (Consumer.broker, KafkaConsumer.broker, TopicConsumer.broker) == (None, "kafka", "kafka")


@pytest.mark.parametrize(
    ("reference", "flags", "expected", "code"),
    [
        (
            "PlainConsumer",
            [],
            "neither a KafkaConsumer nor a RabbitMQConsumer",
            exitcodes.CONFIGURATION,
        ),
        # A flag the consumer's broker cannot honour: the command line is wrong.
        ("TopicConsumer", ["--from-dlq"], "--from-dlq is for RabbitMQ consumers", exitcodes.USAGE),
    ],
)
def test_replay_refuses_what_the_consumer_s_broker_cannot_do(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    reference: str,
    flags: list[str],
    expected: str,
    code: int,
) -> None:
    database = f"sqlite:///{tmp_path / 'replay.db'}"
    assert main(["db", "init", "--database", database]) == exitcodes.OK
    capsys.readouterr()
    result = main(["replay", f"{__name__}:{reference}", "--database", database, *flags])
    err = capsys.readouterr().err
    assert result == code, err
    assert expected in err and "Traceback" not in err

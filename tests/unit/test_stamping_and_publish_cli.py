"""What the producer helpers stamp, and ``mqdedup publish``'s answers to bad input."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import msgspec
import pydantic
import pytest

from mqdedup.cli import exitcodes
from mqdedup.cli.main import main
from mqdedup.id_generators import uuid7_time
from mqdedup.kafka.producing import send_message, stamp_headers
from mqdedup.stamping import encode_body, stamp


class PModel(pydantic.BaseModel):
    order: int


class MModel(msgspec.Struct):
    order: int


@dataclasses.dataclass
class DModel:
    order: int


@pytest.mark.parametrize(
    ("body", "encoded", "content_type"),
    [
        (b"\x00raw", b"\x00raw", "application/octet-stream"),
        ("héllo", "héllo".encode(), "text/plain; charset=utf-8"),
        ({"order": 1}, b'{"order":1}', "application/json"),
        (PModel(order=1), b'{"order":1}', "application/json"),
        (MModel(order=1), b'{"order":1}', "application/json"),
        (DModel(order=1), b'{"order":1}', "application/json"),
        (
            {"id": uuid.UUID(int=1)},
            b'{"id":"00000000-0000-0000-0000-000000000001"}',
            "application/json",
        ),
    ],
)
def test_bodies_are_encoded_with_their_content_type(
    body: Any, encoded: bytes, content_type: str
) -> None:
    assert encode_body(body) == (encoded, content_type)


def test_a_stamp_has_a_time_ordered_id_the_content_type_and_the_callers_headers() -> None:
    first, second = stamp({"order": 1}), stamp({"order": 1}, headers={"tenant": b"acme"})
    assert first.message_id < second.message_id  # UUIDv7: time-ordered
    uuid7_time(first.message_id)  # a valid UUIDv7
    assert second.headers == {
        "message-id": second.message_id,
        "content-type": "application/json",
        "tenant": "acme",
    }
    assert stamp(b"x", message_id="order-1").headers["message-id"] == "order-1"
    with pytest.raises(ValueError, match="'message-id' is stamped by mqdedup"):
        stamp({}, headers={"message-id": "x"})
    with pytest.raises(ValueError, match="message_id must be a non-empty string"):
        stamp({}, message_id=" ")
    with pytest.raises(TypeError, match="cannot send the body as JSON"):
        encode_body({"n": float("nan")})


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, topic: str, **kwargs: Any) -> Any:
        self.sent.append({"topic": topic, **kwargs})
        return self

    def get(self, timeout: float) -> None:
        return None


def test_send_message_stamps_the_record_and_keeps_a_given_id() -> None:
    producer = FakeProducer()
    message_id = send_message(producer, "orders", {"order": 1}, key="order-1")
    again = send_message(producer, "orders", {"order": 1}, key="order-1", message_id=message_id)
    assert again == message_id
    first = producer.sent[0]
    assert first["value"] == b'{"order":1}' and first["key"] == b"order-1"
    assert first["headers"][:2] == [
        ("message-id", message_id.encode()),
        ("content-type", b"application/json"),
    ]
    assert dict(stamp_headers({"x": "1"}, message_id="m"))["message-id"] == b"m"


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        (
            ["--topic", "t", "--body", "x", "--header", "nope"],
            "--header 'nope': expected NAME=VALUE",
        ),
        (["--topic", "t", "--body", "x"], "--topic needs Kafka: pass --kafka-bootstrap"),
        (["--queue", "q", "--body", "x"], "needs --rabbitmq-url or MQDEDUP_RABBITMQ_URL"),
        (
            ["--exchange", "e", "--body", "x", "--rabbitmq-url", "amqp://h"],
            "--exchange needs --routing-key",
        ),
        (
            ["--topic", "t", "--file", "/nonexistent/body.json"],
            "cannot read --file /nonexistent/body.json",
        ),
    ],
)
def test_publish_refuses_bad_input_in_one_line(
    arguments: list[str], error: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    for name in ("MQDEDUP_KAFKA_BOOTSTRAP", "MQDEDUP_RABBITMQ_URL", "MQDEDUP_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    code = main(["publish", *arguments])
    err = capsys.readouterr().err
    assert code == exitcodes.CONFIGURATION
    assert err.startswith("mqdedup: error: ") and error in err
    assert "Traceback" not in err

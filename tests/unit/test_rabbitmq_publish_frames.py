"""The relay's own ``basic.publish`` encoding: byte for byte pika's, one write per round."""

from __future__ import annotations

import math
from typing import Any

import pika
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pika import frame, spec

from mqdedup.rabbitmq.publish_frames import (
    CannotEncodeError,
    PublishFrames,
    encode_properties,
    encode_publish,
)
from tests.unit.amqp_strategies import basic_properties

SHORT_TEXT = st.text(max_size=40)
HEADER_VALUES = st.one_of(st.text(max_size=30), st.integers(-(2**63), 2**63 - 1), st.booleans())
PROPERTIES = basic_properties(
    SHORT_TEXT, st.dictionaries(st.text(min_size=1, max_size=20), HEADER_VALUES, max_size=5)
)


def pika_frames(
    channel: int, body_max: int, exchange: str, key: str, properties: dict[str, Any], body: bytes
) -> bytes:
    """What pika's ``Connection._send_message`` writes for a mandatory publish."""
    pieces = [
        frame.Method(
            channel, spec.Basic.Publish(exchange=exchange, routing_key=key, mandatory=True)
        ).marshal(),
        frame.Header(channel, len(body), pika.BasicProperties(**properties)).marshal(),
    ]
    for chunk in range(math.ceil(len(body) / body_max)):
        pieces.append(
            frame.Body(channel, body[chunk * body_max : (chunk + 1) * body_max]).marshal()
        )
    return b"".join(pieces)


@settings(max_examples=300, deadline=None)
@given(
    channel=st.integers(1, 2047),
    body_max=st.integers(1, 300),
    exchange=SHORT_TEXT,
    key=SHORT_TEXT,
    properties=PROPERTIES,
    body=st.binary(max_size=1000),
)
def test_frames_are_pikas(
    channel: int,
    body_max: int,
    exchange: str,
    key: str,
    properties: dict[str, Any],
    body: bytes,
) -> None:
    ours = encode_publish(channel, body_max, exchange, key, properties, body)
    assert ours == pika_frames(channel, body_max, exchange, key, properties, body)


@pytest.mark.parametrize(
    ("properties", "body"),
    [
        ({"surprise": "x"}, b"{}"),  # not an AMQP property
        ({"message_id": "x" * 256}, b"{}"),  # longer than a short string
        ({"priority": 256}, b"{}"),
        ({"priority": True}, b"{}"),
        ({"timestamp": -1}, b"{}"),
        ({"headers": ["not", "a", "table"]}, b"{}"),
        ({"content_type": 5}, b"{}"),
        ({"headers": {"ratio": 0.5}}, b"{}"),  # pika has no float field type
        ({}, "text, not bytes"),
    ],
)
def test_what_pika_would_refuse_is_left_to_pika(properties: dict[str, Any], body: Any) -> None:
    with pytest.raises(CannotEncodeError):
        encode_publish(1, 131_064, "", "queue", properties, body)


def test_long_exchange_name_is_left_to_pika() -> None:
    with pytest.raises(CannotEncodeError):
        encode_publish(1, 131_064, "e" * 256, "queue", {}, b"")


def test_empty_properties_have_no_flags() -> None:
    assert encode_properties({}) == b"\x00\x00"


class FakeConnection:
    """The two pika internals the writer uses, and pika's counters."""

    def __init__(self) -> None:
        self._body_max_length = 4
        self.bytes_sent = 0
        self.frames_sent = 0
        self.writes: list[bytes] = []

    def _adapter_emit_data(self, data: bytes) -> None:
        self.writes.append(data)


class FakeChannel:
    channel_number = 3


def test_a_round_is_one_write_and_pikas_counters_follow() -> None:
    connection = FakeConnection()
    frames = PublishFrames.open(connection, FakeChannel())
    assert frames is not None
    frames.add("", "q", {"message_id": "a"}, b"0123456789")  # 3 body frames of 4 bytes
    frames.add("", "q", {"message_id": "b"}, b"")  # no body frame
    assert connection.writes == []
    frames.flush()
    expected = pika_frames(3, 4, "", "q", {"message_id": "a"}, b"0123456789") + pika_frames(
        3, 4, "", "q", {"message_id": "b"}, b""
    )
    assert connection.writes == [expected]
    assert connection.bytes_sent == len(expected)
    assert connection.frames_sent == 5 + 2
    frames.flush()
    assert len(connection.writes) == 1  # nothing buffered: nothing written


def test_a_refused_message_buffers_nothing() -> None:
    connection = FakeConnection()
    frames = PublishFrames.open(connection, FakeChannel())
    assert frames is not None
    with pytest.raises(CannotEncodeError):
        frames.add("", "q", {"priority": 999}, b"x")
    frames.flush()
    assert connection.writes == []


def test_a_pika_without_the_internals_gets_none() -> None:
    class Bare:
        pass

    assert PublishFrames.open(Bare(), FakeChannel()) is None
    connection = FakeConnection()
    connection._body_max_length = 0
    assert PublishFrames.open(connection, FakeChannel()) is None

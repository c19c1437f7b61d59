"""The consuming channel's delivery fast path, fed with real AMQP frames (pika's encoder).

A fake pika connection stands in for the I/O loop: it records the frames handed to
pika's own ``_process_frame``, so each test sees what the fast path decoded itself,
what it left to pika, and in which order.
"""

from __future__ import annotations

import itertools
from typing import Any

import pika
import pika.exceptions
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pika import frame, spec

from mqdedup.rabbitmq.codec import delivery_message
from mqdedup.rabbitmq.io_frames import DeliveryFastPath, install
from tests.unit.amqp_strategies import basic_properties

CHANNEL = 1
TAG = "mqdedup.1.test"


class FakeImpl:
    """The parts of pika's connection the fast path uses."""

    def __init__(self) -> None:
        self._frame_buffer = b""
        self.bytes_received = 0
        self.frames_received = 0
        self.pika_frames: list[Any] = []

    def _process_frame(self, frame_value: Any) -> None:
        self.pika_frames.append(frame_value)


def deliver(
    tag: int,
    body: bytes,
    *,
    consumer_tag: str = TAG,
    channel: int = CHANNEL,
    redelivered: bool = False,
    properties: pika.BasicProperties | None = None,
    frame_max: int = 131072,
) -> bytes:
    """The frames of one ``basic.deliver``, as the broker sends them."""
    method = spec.Basic.Deliver(consumer_tag, tag, redelivered, "shop", "order.created")
    props = properties or pika.BasicProperties(message_id=f"m-{tag}", delivery_mode=2)
    frames = [
        frame.Method(channel, method).marshal(),
        frame.Header(channel, len(body), props).marshal(),
    ]
    size = frame_max - 8
    frames += [
        frame.Body(channel, body[at : at + size]).marshal() for at in range(0, len(body), size)
    ]
    return b"".join(frames)


def fast_path() -> tuple[DeliveryFastPath, FakeImpl, list[tuple[Any, ...]]]:
    impl = FakeImpl()
    got: list[tuple[Any, ...]] = []
    path = DeliveryFastPath(impl, CHANNEL, TAG, lambda *delivery: got.append(delivery))
    return path, impl, got


def test_deliveries_are_decoded_with_their_properties_and_bodies() -> None:
    path, impl, got = fast_path()
    stream = deliver(1, b'{"order": 1}') + deliver(2, b"", redelivered=True)
    path.data_available(stream)
    assert [(d[0], d[1], d[2], d[3], d[5]) for d in got] == [
        (1, False, "shop", "order.created", b'{"order": 1}'),
        (2, True, "shop", "order.created", b""),
    ]
    assert got[0][4].message_id == "m-1" and got[0][4].delivery_mode == 2
    assert impl.pika_frames == [] and impl._frame_buffer == b""
    assert impl.bytes_received == len(stream)
    assert impl.frames_received == 5  # an empty body has no body frame


def test_a_delivery_split_across_reads_waits_for_its_last_byte() -> None:
    path, impl, got = fast_path()
    stream = deliver(1, b"x" * 300_000, frame_max=4096) + deliver(2, b"y")
    joins = 0
    parse = path._delivery

    def counting(data: bytes, at: int, end: int) -> int:
        nonlocal joins
        joins += 1
        return parse(data, at, end)

    path._delivery = counting  # type: ignore[method-assign]
    for at in range(0, len(stream), 1000):
        path.data_available(stream[at : at + 1000])
        assert impl.bytes_received == min(at + 1000, len(stream)), "every byte counts as alive"
    assert [(d[0], len(d[5])) for d in got] == [(1, 300_000), (2, 1)]
    assert joins < 10, "a large body is not re-joined on every read"
    assert got[0][5] == b"x" * 300_000
    assert impl.pika_frames == [] and impl._frame_buffer == b""


def test_other_frames_go_to_pika_in_order_between_deliveries() -> None:
    path, impl, got = fast_path()
    order: list[Any] = []
    impl._process_frame = order.append  # type: ignore[method-assign]
    path._on_delivery = lambda *d: order.append(d[0])
    heartbeat = frame.Heartbeat().marshal()
    cancel_ok = frame.Method(CHANNEL, spec.Basic.CancelOk("other")).marshal()
    other_channel = deliver(7, b"admin", channel=2)
    other_consumer = deliver(8, b"theirs", consumer_tag="someone-else")
    path.data_available(
        deliver(1, b"a")
        + heartbeat
        + cancel_ok
        + deliver(2, b"b")
        + other_channel
        + other_consumer
        + deliver(3, b"c")
    )
    kinds = [item if isinstance(item, int) else type(item).__name__ for item in order]
    # Deliveries of another channel or consumer are pika's, frame by frame.
    assert kinds == [
        1,
        "Heartbeat",
        "Method",
        2,
        "Method",
        "Header",
        "Body",
        "Method",
        "Header",
        "Body",
        3,
    ]
    assert got == []


def test_the_brokers_reason_for_closing_the_channel_is_kept_and_the_frame_is_pikas() -> None:
    """pika keeps the reason only in a private attribute; the fast path sees the frame."""
    path, impl, _ = fast_path()
    close = spec.Channel.Close(406, "PRECONDITION_FAILED - unknown delivery tag 9", 60, 80)
    other = spec.Channel.Close(404, "NOT_FOUND - no queue 'x'", 50, 10)
    path.data_available(deliver(1, b"a") + frame.Method(2, other).marshal())
    assert path.closed_by_broker is None  # another channel's close is not ours
    path.data_available(frame.Method(CHANNEL, close).marshal())
    assert isinstance(path.closed_by_broker, pika.exceptions.ChannelClosedByBroker)
    assert path.closed_by_broker.reply_code == 406
    assert path.closed_by_broker.reply_text == close.reply_text
    assert [type(f.method).__name__ for f in impl.pika_frames] == ["Close", "Close"]


def test_a_partial_frame_left_by_pika_is_completed_by_the_next_read() -> None:
    path, impl, got = fast_path()
    stream = deliver(1, b"a") + frame.Heartbeat().marshal() + deliver(2, b"b")
    impl._frame_buffer = stream[:5]  # what pika buffered before the fast path took over
    path.data_available(stream[5:20])
    path.data_available(stream[20:])
    assert [d[0] for d in got] == [1, 2]
    assert [type(f).__name__ for f in impl.pika_frames] == ["Heartbeat"]


def test_after_cancel_deliveries_are_left_to_pika() -> None:
    path, impl, got = fast_path()
    path.active = False
    path.data_available(deliver(1, b"a"))
    assert got == [] and len(impl.pika_frames) == 3


def test_malformed_frames_are_left_to_pika_which_raises() -> None:
    path, impl, got = fast_path()
    broken = bytearray(deliver(1, b"a"))
    broken[-1] = 0  # a body frame without its end marker
    with pytest.raises(pika.exceptions.InvalidFrameError):
        path.data_available(bytes(broken))
    assert got == []
    assert [type(f).__name__ for f in impl.pika_frames] == ["Method", "Header"]


def test_a_delivery_with_headers_becomes_the_same_message_as_through_pika() -> None:
    path, _impl, got = fast_path()
    props = pika.BasicProperties(
        message_id="m-9",
        headers={"tenant": "acme", "x-delivery-count": 2, "n": 7},
        timestamp=1_700_000_000,
        correlation_id="c-1",
    )
    path.data_available(deliver(9, b"{}", properties=props))
    _tag, redelivered, exchange, routing_key, decoded, body = got[0]
    message = delivery_message("orders", redelivered, exchange, routing_key, decoded, body)
    assert message.headers == {"tenant": "acme", "x-delivery-count": "2", "n": "7"}
    assert message.attempt == 3
    assert dict(message.properties) == {
        "correlation_id": "c-1",
        "message_id": "m-9",
        "timestamp": 1_700_000_000,
        "exchange": "shop",
        "routing_key": "order.created",
    }
    assert message.timestamp is not None and message.timestamp.year == 2023


def test_install_declines_a_pika_without_the_internals() -> None:
    class Opaque:
        pass

    assert install(Opaque(), Opaque(), TAG, lambda *d: None) is None


_SHORT_STRING = st.one_of(
    st.text(max_size=40).filter(lambda t: len(t.encode("utf-8")) <= 255),
    st.binary(max_size=40).filter(lambda b: not _utf8(b)),  # kept as bytes, as pika does
)


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(
    basic_properties(
        _SHORT_STRING, st.dictionaries(st.text(max_size=5), st.integers(0, 99), max_size=3)
    )
)
def test_properties_decode_as_pika_decodes_them(values: dict[str, Any]) -> None:
    """Whatever properties a producer sets, the fast path's BasicProperties equal pika's."""
    path, _impl, got = fast_path()
    properties = pika.BasicProperties(**values)
    path.data_available(deliver(1, b"x", properties=properties))
    header = frame.Header(CHANNEL, 1, properties).marshal()
    expected = spec.BasicProperties()
    expected.decode(header, 19)
    assert vars(got[0][4]) == vars(expected)
    assert list(vars(got[0][4])) == list(vars(expected))


# -- whole deliveries, held to pika's own decoding byte for byte ----------------------------


def _pikas_deliveries(stream: bytes) -> list[tuple[Any, ...]]:
    """What pika makes of ``stream``: its frame decoder and its channel's content
    assembler (``pika.channel.ContentFrameAssembler``), heartbeats skipped."""
    return _assembled(_pikas_frames(stream))


def _pikas_frames(stream: bytes) -> list[Any]:
    frames = []
    while stream:
        consumed, frame_value = frame.decode_frame(stream)
        assert frame_value is not None, "the test stream holds whole frames"
        frames.append(frame_value)
        stream = stream[consumed:]
    return frames


def _assembled(frames: list[Any]) -> list[tuple[Any, ...]]:
    assembler = pika.channel.ContentFrameAssembler()
    deliveries = []
    for frame_value in frames:
        if isinstance(frame_value, frame.Heartbeat):
            continue
        content = assembler.process(frame_value)
        if content is not None:
            method_frame, header_frame, body = content
            deliveries.append(_delivery(method_frame.method, header_frame.properties, body))
    return deliveries


def _not_ours(frames: list[Any]) -> list[bytes]:
    """The frames that are not part of a delivery to ``TAG``, marshalled, in order."""
    left, ours = [], False
    for frame_value in frames:
        if isinstance(frame_value, frame.Method):
            ours = frame_value.method.consumer_tag == TAG
        elif not isinstance(frame_value, frame.Header | frame.Body):
            ours = False
        if not ours or isinstance(frame_value, frame.Heartbeat):
            left.append(frame_value.marshal())
    return left


def _delivery(method: Any, properties: Any, body: bytes) -> tuple[Any, ...]:
    """Everything a handler's message is built from, with the types pika gives."""
    return (
        method.consumer_tag,
        method.delivery_tag,
        bool(method.redelivered),
        method.exchange,
        method.routing_key,
        list(vars(properties).items()),  # every attribute, its value and pika's order
        body,
    )


_HEADER_VALUES = st.one_of(
    st.text(max_size=20),
    st.integers(-(2**63), 2**63 - 1),
    st.booleans(),
    st.binary(max_size=20),
    st.none(),
)
_DELIVERY = st.fixed_dictionaries(
    {
        "ours": st.booleans(),
        "tag": st.integers(1, 2**64 - 1),
        "redelivered": st.booleans(),
        "exchange": _SHORT_STRING,
        "routing_key": _SHORT_STRING,
        "properties": basic_properties(
            _SHORT_STRING,
            st.dictionaries(st.text(min_size=1, max_size=8), _HEADER_VALUES, max_size=4),
        ),
        "body": st.binary(max_size=1500),
        "heartbeat_after": st.booleans(),
    }
)


@settings(max_examples=300, deadline=None)
@given(
    deliveries=st.lists(_DELIVERY, min_size=1, max_size=5),
    body_max=st.integers(1, 600),
    cuts=st.lists(st.integers(0, 20_000), max_size=12),
)
def test_whole_deliveries_decode_as_pika_decodes_them(
    deliveries: list[dict[str, Any]], body_max: int, cuts: list[int]
) -> None:
    """Any stream of deliveries (any properties and headers, any body split into body
    frames of any size, deliveries of another consumer, heartbeats between them) read in
    chunks of any size: the fast path's deliveries are pika's own decoding of the same
    bytes, field for field and byte for byte, and what it leaves to pika is exactly the
    other frames, unchanged and in order."""
    stream = b""
    for d in deliveries:
        method = spec.Basic.Deliver(
            TAG if d["ours"] else "another-consumer",
            d["tag"],
            d["redelivered"],
            d["exchange"],
            d["routing_key"],
        )
        body = d["body"]
        stream += frame.Method(CHANNEL, method).marshal()
        stream += frame.Header(
            CHANNEL, len(body), pika.BasicProperties(**d["properties"])
        ).marshal()
        for at in range(0, len(body), body_max):
            stream += frame.Body(CHANNEL, body[at : at + body_max]).marshal()
        if d["heartbeat_after"]:
            stream += frame.Heartbeat().marshal()
    expected = _pikas_deliveries(stream)

    path, impl, got = fast_path()
    bounds = sorted({cut % (len(stream) + 1) for cut in cuts} | {0, len(stream)})
    for start, end in itertools.pairwise(bounds):
        path.data_available(stream[start:end])

    ours = [
        _delivery(
            spec.Basic.Deliver(TAG, tag, redelivered, exchange, routing_key), properties, body
        )
        for tag, redelivered, exchange, routing_key, properties, body in got
    ]
    assert ours == [d for d in expected if d[0] == TAG]
    assert _assembled(impl.pika_frames) == [d for d in expected if d[0] != TAG]
    assert [f.marshal() for f in impl.pika_frames] == _not_ours(_pikas_frames(stream))
    assert impl._frame_buffer == b"" and impl.bytes_received == len(stream)
    assert impl.frames_received + len(impl.pika_frames) == len(_pikas_frames(stream))

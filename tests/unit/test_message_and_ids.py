from __future__ import annotations

import pytest

from mqdedup import Message, MissingMessageIdError, UndecodableMessageError
from mqdedup.dedup import ids


def test_json_and_text_decode_the_body() -> None:
    message = Message(body=b'{"a": 1}')
    assert message.json() == {"a": 1}
    assert message.text() == '{"a": 1}'


def test_malformed_bodies_raise_a_message_error_with_a_clear_reason() -> None:
    with pytest.raises(UndecodableMessageError, match="invalid JSON"):
        Message(body=b"{nope").json()
    with pytest.raises(UndecodableMessageError, match="not utf-8"):
        Message(body=b"\xff\xfe").text()


def test_message_is_immutable_and_with_id_copies() -> None:
    message = Message(body=b"x", source="t", partition=1, offset=5)
    with pytest.raises(AttributeError):
        message.id = "other"  # type: ignore[misc]
    assert message.with_id("m1").id == "m1" and message.id is None
    assert message.coordinates == "t/1/5"


def test_identified_fills_in_an_unset_id_and_copies_only_to_change_one() -> None:
    fresh = Message(body=b"x")
    assert fresh.identified("m1") is fresh and fresh.id == "m1"  # no copy per delivery
    assert fresh.identified("m1") is fresh
    other = fresh.identified("m2")  # another consumer's strategy: its own copy
    assert (other.id, fresh.id) == ("m2", "m1")


def test_header_strategy_reads_bytes_and_text_headers() -> None:
    strategy = ids.from_header()
    assert strategy(Message(body=b"", headers={"message-id": b"abc"})) == "abc"
    assert strategy(Message(body=b"", headers={"message-id": "abc"})) == "abc"
    assert ids.from_header("x-id")(Message(body=b"", headers={"x-id": "7"})) == "7"


@pytest.mark.parametrize(
    "message",
    [
        Message(body=b""),
        Message(body=b"", headers={"message-id": b""}),
        Message(body=b"", headers={"message-id": "  "}),
    ],
)
def test_header_strategy_without_id_raises_missing_message_id(message: Message) -> None:
    with pytest.raises(MissingMessageIdError, match="missing message id"):
        ids.from_header()(message)


def test_too_long_ids_are_refused() -> None:
    with pytest.raises(MissingMessageIdError, match="longer than 255"):
        ids.from_header()(Message(body=b"", headers={"message-id": "x" * 256}))


def test_amqp_coordinates_hash_and_callable_strategies() -> None:
    assert ids.from_amqp_message_id(Message(body=b"", properties={"message_id": "p1"})) == "p1"
    with pytest.raises(MissingMessageIdError):
        ids.from_amqp_message_id(Message(body=b""))
    assert ids.from_coordinates(Message(body=b"", source="t", partition=0, offset=9)) == "t/0/9"
    with pytest.raises(MissingMessageIdError):
        ids.from_coordinates(Message(body=b"", source="queue"))
    one = ids.from_content_hash(Message(body=b"same"))
    assert (
        one
        == ids.from_content_hash(Message(body=b"same"))
        != ids.from_content_hash(Message(body=b"other"))
    )
    assert one.startswith("sha256:")
    custom = ids.from_callable(lambda m: m.json().get("order"))
    assert custom(Message(body=b'{"order": "o-1"}')) == "o-1"
    with pytest.raises(MissingMessageIdError):
        custom(Message(body=b"{}"))


def test_first_of_falls_back_in_order() -> None:
    strategy = ids.first_of(ids.from_header(), ids.from_content_hash)
    assert strategy(Message(body=b"b", headers={"message-id": "h"})) == "h"
    assert strategy(Message(body=b"b")).startswith("sha256:")

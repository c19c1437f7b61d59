"""RabbitMQ pure logic: deliveries to messages, dead-letter copies, requeue, ack plans."""

from __future__ import annotations

import json
import pickle
from datetime import UTC, datetime
from decimal import Decimal

import pika
import pytest
from pika.spec import Basic

from mqdedup.consumers.transport import DeadLetter
from mqdedup.dedup.ids import from_amqp_message_id
from mqdedup.errors import MissingMessageIdError
from mqdedup.rabbitmq.codec import (
    AckPlan,
    dead_letter_properties,
    delivery_attempt,
    header_value,
    plan_acks,
    requeue_properties,
    to_message,
)


def deliver(tag: int = 7, redelivered: bool = False) -> Basic.Deliver:
    return Basic.Deliver(
        consumer_tag="ctag",
        delivery_tag=tag,
        redelivered=redelivered,
        exchange="shop",
        routing_key="order.created",
    )


RECORD = DeadLetter(
    reason="handler failed after 3 attempts: ValueError: bad amount",
    consumer="orders",
    attempts=3,
    error_class="builtins.ValueError",
    error_message="bad amount",
)


class TestToMessage:
    def test_properties_headers_and_coordinates(self) -> None:
        properties = pika.BasicProperties(
            message_id="m-1",
            correlation_id="c-1",
            content_type="application/json",
            delivery_mode=2,
            timestamp=1_700_000_000,
            headers={"tenant": "acme", "raw": b"\xff", "n": 3, "flag": True, "d": Decimal("1.5")},
        )
        message = to_message("orders", deliver(), properties, b'{"a": 1}')
        assert message.body == b'{"a": 1}'
        assert message.source == "orders"
        assert message.properties["message_id"] == "m-1"
        assert message.properties["correlation_id"] == "c-1"
        assert message.properties["delivery_mode"] == 2
        assert message.properties["exchange"] == "shop"
        assert message.properties["routing_key"] == "order.created"
        assert "headers" not in message.properties
        assert "reply_to" not in message.properties, "unset properties are left out"
        assert message.headers == {
            "tenant": "acme",
            "raw": b"\xff",
            "n": "3",
            "flag": "true",
            "d": "1.5",
        }
        assert message.timestamp == datetime.fromtimestamp(1_700_000_000, UTC)
        assert (message.redelivered, message.attempt) == (False, 1)
        assert message.id is None, "the processor attaches the id"
        assert from_amqp_message_id(message) == "m-1"

    def test_properties_are_a_read_only_mapping_equal_to_the_dict_of_set_ones(self) -> None:
        properties = pika.BasicProperties(message_id="m-1", delivery_mode=2, app_id="shop")
        view = to_message("orders", deliver(), properties, b"").properties
        as_dict = {
            "delivery_mode": 2,
            "message_id": "m-1",
            "app_id": "shop",
            "exchange": "shop",
            "routing_key": "order.created",
        }
        assert view == as_dict and as_dict == view
        assert list(view) == list(as_dict) and len(view) == 5
        assert view.get("reply_to") is None and view.get("reply_to", "-") == "-"
        assert "message_id" in view and "reply_to" not in view and "nope" not in view
        with pytest.raises(KeyError):
            view["reply_to"]
        with pytest.raises(TypeError):
            view["message_id"] = "other"  # type: ignore[index]
        assert pickle.loads(pickle.dumps(view)) == as_dict
        assert json.loads(json.dumps(dict(view))) == as_dict

    def test_a_nested_table_key_that_is_not_utf8_still_makes_a_message(self) -> None:
        # pika decodes a short string that is not UTF-8 as bytes, table keys included
        headers = {"t": {b"\xff": 1, "a": [{b"\xfe": None}]}}
        properties = pika.BasicProperties(message_id="m-1", headers=headers)
        message = to_message("orders", deliver(), properties, b"")
        assert message.headers == {"t": '{"a": [{"\\ufffd": null}], "\\ufffd": 1}'}

    def test_a_timestamp_no_datetime_holds_leaves_message_timestamp_unset(self) -> None:
        for huge in (2**64 - 1, 2**63 - 1, 253_402_300_800):
            properties = pika.BasicProperties(message_id="m-1", timestamp=huge)
            message = to_message("orders", deliver(), properties, b"")
            assert message.timestamp is None
            assert message.properties["timestamp"] == huge

    def test_no_message_id_is_a_missing_id(self) -> None:
        message = to_message("orders", deliver(), pika.BasicProperties(), None)
        assert message.body == b""
        with pytest.raises(MissingMessageIdError, match="AMQP message_id"):
            from_amqp_message_id(message)

    def test_redelivery_attempts_classic_and_quorum(self) -> None:
        classic = to_message("q", deliver(redelivered=True), pika.BasicProperties(), b"")
        assert (classic.redelivered, classic.attempt) == (True, 2)
        quorum = to_message(
            "q",
            deliver(redelivered=True),
            pika.BasicProperties(headers={"x-delivery-count": 4}),
            b"",
        )
        assert quorum.attempt == 5
        assert delivery_attempt(False, {"x-delivery-count": True}) == 1  # not a count

    def test_header_values_become_text(self) -> None:
        assert header_value(None) is None
        assert header_value(b"x") == b"x"
        assert header_value(False) == "false"
        assert header_value(datetime(2026, 1, 2, tzinfo=UTC)) == "2026-01-02T00:00:00+00:00"
        assert header_value({"b": [1, 2], "a": "x"}) == '{"a": "x", "b": [1, 2]}'


class TestDeadLetterCopy:
    def test_keeps_the_original_and_adds_the_reason_headers(self) -> None:
        original = pika.BasicProperties(
            message_id="m-1",
            correlation_id="c-1",
            content_type="application/json",
            delivery_mode=1,
            expiration="60000",
            user_id="publisher",
            priority=5,
            headers={"tenant": "acme"},
        )
        now = datetime(2026, 11, 30, tzinfo=UTC)
        copy = dead_letter_properties(
            original, RECORD, source_queue="orders", message_id="m-1", now=now
        )
        assert copy.message_id == "m-1" and copy.correlation_id == "c-1"
        assert copy.content_type == "application/json" and copy.priority == 5
        assert copy.delivery_mode == 2, "dead letters are persistent"
        assert copy.expiration is None, "a dead letter must not expire in the DLQ"
        assert copy.user_id is None, "the broker would reject another user's user_id"
        assert copy.headers == {
            "tenant": "acme",
            "x-mqdedup-reason": RECORD.reason,
            "x-mqdedup-consumer": "orders",
            "x-mqdedup-attempts": "3",
            "x-mqdedup-error-class": "builtins.ValueError",
            "x-mqdedup-error-message": "bad amount",
            "x-mqdedup-source-queue": "orders",
            "x-mqdedup-dead-lettered-at": "2026-11-30T00:00:00+00:00",
            "x-mqdedup-message-id": "m-1",
            "x-mqdedup-original-expiration": "60000",
            "x-mqdedup-original-user-id": "publisher",
        }
        assert original.headers == {"tenant": "acme"}, "the original is not modified"

    def test_message_without_id_has_no_id_header(self) -> None:
        copy = dead_letter_properties(
            pika.BasicProperties(), RECORD, source_queue="orders", message_id=None
        )
        assert "x-mqdedup-message-id" not in copy.headers

    def test_requeue_strips_reasons_and_counts_moves(self) -> None:
        dead = dead_letter_properties(
            pika.BasicProperties(message_id="m-1", headers={"tenant": "acme"}),
            RECORD,
            source_queue="orders",
            message_id="m-1",
        )
        once = requeue_properties(dead)
        assert once.headers == {"tenant": "acme", "x-mqdedup-requeued": 1}
        assert once.message_id == "m-1" and once.delivery_mode == 2
        again = requeue_properties(
            dead_letter_properties(once, RECORD, source_queue="orders", message_id="m-1")
        )
        assert again.headers["x-mqdedup-requeued"] == 2


class TestAckPlan:
    def test_contiguous_batch_is_one_multiple_ack(self) -> None:
        assert plan_acks({1, 2, 3, 4}, [1, 2, 3, 4]) == AckPlan(4, ())

    def test_later_buffered_tags_are_not_covered(self) -> None:
        # 5..8 are delivered but still in the buffer: multiple=True up to 4 is safe.
        plan = plan_acks({1, 2, 3, 4, 5, 6, 7, 8}, [1, 2, 3, 4])
        assert plan == AckPlan(4, ())

    def test_a_gap_stops_the_multiple_ack(self) -> None:
        # 3 is not being settled (e.g. unsettled after a failed dead-letter publish).
        plan = plan_acks({1, 2, 3, 4, 5}, [1, 2, 4, 5])
        assert plan == AckPlan(2, (4, 5))
        assert plan.frames == 3

    def test_lowest_outstanding_not_settled_means_singles_only(self) -> None:
        assert plan_acks({1, 2, 3}, [2, 3]) == AckPlan(None, (2, 3))

    def test_single_tag_is_a_plain_ack(self) -> None:
        assert plan_acks({9}, [9]) == AckPlan(None, (9,))

    def test_unknown_tags_are_ignored(self) -> None:
        # Tags already acked or from an older channel are never sent.
        assert plan_acks({10, 11}, [1, 2, 10, 11]) == AckPlan(11, ())
        assert plan_acks(set(), [1, 2]) == AckPlan(None, ())
        assert plan_acks({1, 2}, []).frames == 0

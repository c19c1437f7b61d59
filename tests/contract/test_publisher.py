"""The Publisher contract (``mqdedup/outbox/publishers.py``), run against every publisher.

``MemoryPublisher``, ``KafkaPublisher`` (a fresh 2-partition topic whose
``max.message.bytes`` is small) and ``RabbitMQPublisher`` (a fresh queue behind the
default exchange). The tests assert what is on the broker when ``publish_batch``
returns, and each record's outcome.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

from mqdedup.outbox.publishers import PublishOutcome
from tests.contract.conftest import PublisherKit


def test_published_records_are_on_the_broker_when_publish_returns(
    publisher_kit: PublisherKit,
) -> None:
    records = [publisher_kit.record(f"p{n:03d}", b'{"n": %d}' % n, b"k") for n in range(20)]
    results = publisher_kit.publisher().publish_batch(records)

    assert [result.outcome for result in results] == [PublishOutcome.PUBLISHED] * 20
    assert publisher_kit.on_broker() == 20, "PUBLISHED before the broker confirmed"


def test_message_id_headers_key_and_payload_are_preserved(publisher_kit: PublisherKit) -> None:
    records = [
        publisher_kit.record(f"h{n:03d}", json.dumps({"n": n}).encode(), f"key-{n}".encode())
        for n in range(5)
    ]
    assert all(r.ok for r in publisher_kit.publisher().publish_batch(records))

    received = {item.message_id: item for item in publisher_kit.read(expected=5)}
    assert set(received) == {record.message_id for record in records}
    for record in records:
        item = received[record.message_id]
        assert item.payload == record.payload
        assert item.headers["message-id"] == record.message_id
        assert item.headers["x-test"] == f"h-{record.message_id}"
        if publisher_kit.keeps_key:
            assert item.key == record.key


def test_order_per_key_is_kept(publisher_kit: PublisherKit) -> None:
    records = [
        publisher_kit.record(
            f"o{n:03d}", json.dumps({"key": f"k{n % 4}", "seq": n}).encode(), f"k{n % 4}".encode()
        )
        for n in range(40)
    ]
    publisher = publisher_kit.publisher()
    for start in range(0, 40, 10):  # several batches, as the relay sends them
        assert all(r.ok for r in publisher.publish_batch(records[start : start + 10]))

    received = [json.loads(item.payload) for item in publisher_kit.read(expected=40)]
    assert len(received) == 40
    if publisher_kit.ordering == "queue":
        assert [item["seq"] for item in received] == list(range(40))
    else:
        per_key: dict[str, list[int]] = defaultdict(list)
        for item in received:
            per_key[item["key"]].append(item["seq"])
        for key, seqs in per_key.items():
            assert seqs == sorted(seqs), f"{key} out of order: {seqs}"


def test_a_refused_record_fails_alone_and_the_records_after_it_are_published(
    publisher_kit: PublisherKit,
) -> None:
    records = [publisher_kit.record(f"r{n:03d}", b'{"n": %d}' % n, b"k") for n in range(6)]
    records.insert(3, publisher_kit.refused_record("refused"))
    results = publisher_kit.publisher().publish_batch(records)

    outcomes = {record.message_id: result for record, result in zip(records, results, strict=True)}
    assert outcomes["refused"].outcome is PublishOutcome.REJECTED
    assert outcomes["refused"].error, "a refusal names the broker's reason"
    assert all(
        r.outcome is PublishOutcome.PUBLISHED for mid, r in outcomes.items() if mid != "refused"
    )
    received = {str(item.message_id) for item in publisher_kit.read(expected=6)}
    # At least once: a record aborted with the refused one may be on the log twice
    # (same message id, absorbed by the consumers' dedup); the refused one never is.
    assert received == {f"r{n:03d}" for n in range(6)}


def test_a_broker_that_is_down_is_an_outage_for_every_record_not_a_refusal(
    publisher_kit: PublisherKit,
) -> None:
    records = [publisher_kit.record(f"d{n:03d}", b"{}", b"k") for n in range(3)]
    started = time.monotonic()
    results = publisher_kit.publisher(reachable=False).publish_batch(records)

    assert [result.outcome for result in results] == [PublishOutcome.UNAVAILABLE] * 3
    assert all(result.error for result in results)
    assert time.monotonic() - started < 30, "an outage is reported within the timeouts"

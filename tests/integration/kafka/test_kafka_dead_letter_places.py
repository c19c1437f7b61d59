"""The Kafka dead-letter place: real dead letters in ``<topic>.DLT``, listed, shown,
replayed (effects once, also twice), requeued and deleted; handled ones no longer list."""

from __future__ import annotations

import pytest

from mqdedup.deadletters import group, replay
from mqdedup.kafka.dead_letter_topic import KafkaDeadLetterTopics
from tests.integration.kafka.consumers import make_consumer
from tests.integration.kafka.helpers import row_counts
from tests.services import KafkaHelper, Outgoing, TestDatabase, unique_name

pytestmark = pytest.mark.integration

FAILING = frozenset({"dl-1", "dl-3", "dl-4", "dl-5"})


def test_kafka_dead_letters_list_show_replay_requeue_and_delete(
    kafka_helper: KafkaHelper, db: TestDatabase
) -> None:
    topic = kafka_helper.create_topic(partitions=1)
    ids = [f"dl-{i}" for i in range(7)]
    kafka_helper.produce(
        topic, [Outgoing(mid, f"body-{mid}".encode(), key=mid.encode()) for mid in ids]
    )
    group_id = unique_name("group")
    broken = make_consumer(
        topic=topic,
        group=group_id,
        prefix=db.prefix,
        bootstrap=kafka_helper.bootstrap,
        fail_ids=FAILING,
    )
    report = broken().replay(db.engine)  # a run over the topic: 4 dead letters in the DLT
    assert (report.new, report.dead_lettered) == (3, 4)
    place = KafkaDeadLetterTopics.for_consumer(broken(), db.engine)

    records = place.list()
    assert [r.message_id for r in records] == ["dl-1", "dl-3", "dl-4", "dl-5"]
    assert [r.key for r in records] == [f"{topic}.DLT:0:{n}" for n in range(4)]
    first = records[0]
    assert first.place == "kafka" and first.consumer == group_id and first.attempts == 3
    assert first.error == "ValueError: cannot handle dl-1"
    assert first.reason == "handler failed after 3 attempts: ValueError: cannot handle dl-1"
    assert first.body == b"body-dl-1" and first.message.key == b"dl-1"
    assert first.message.source == topic and first.message.offset == 1
    assert not any(name.startswith("x-mqdedup-") for name in first.message.headers)
    assert list(group(records)) == [
        (group_id, f"ValueError: cannot handle {m}") for m in sorted(FAILING)
    ]
    assert place.get(first.key) == first
    assert place.depth() == 4 and place.depths() == {f"{topic}.DLT": 4}
    assert place.list(consumer="someone-else") == []

    fixed = make_consumer(
        topic=topic, group=group_id, prefix=db.prefix, bootstrap=kafka_helper.bootstrap
    )
    outcome = replay(records[:2], fixed(), db.engine, place)
    assert (outcome.processed, outcome.duplicates, outcome.removed) == (2, 0, 2)
    assert row_counts(db.engine, db.prefix) == {m: 1 for m in ids if m not in {"dl-4", "dl-5"}}
    assert [r.message_id for r in place.list()] == ["dl-4", "dl-5"]  # replayed: handled
    assert place.get(first.key) is None and place.depth() == 2

    again = replay(records[:2], fixed(), db.engine, place)  # twice: the claims decide
    assert (again.processed, again.duplicates) == (0, 2)
    assert row_counts(db.engine, db.prefix)["dl-1"] == 1

    assert place.requeue([records[2].key]) == 1
    copies = [r for r in kafka_helper.read_all(topic, expected=8) if r.key == b"dl-4"]
    assert len(copies) == 2 and copies[1].value == b"body-dl-4"
    requeued_headers = dict(copies[1].headers)
    assert requeued_headers["message-id"] == b"dl-4"
    assert not any(name.startswith("x-mqdedup-") for name in requeued_headers)

    assert place.delete([records[3].key, records[3].key]) == 1
    assert place.delete([records[3].key]) == 0  # handled already
    assert place.list() == [] and place.depth() == 0

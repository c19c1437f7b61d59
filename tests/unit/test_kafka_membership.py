"""The static group member id of a worker child (mqdedup.kafka.membership)."""

from __future__ import annotations

import socket

from mqdedup.kafka.membership import static_instance_id


def test_a_process_outside_the_supervisor_is_a_dynamic_member() -> None:
    assert static_instance_id("orders", {}) is None


def test_two_supervisors_on_one_host_never_share_an_id() -> None:
    first = static_instance_id(
        "orders", {"MQDEDUP_WORKER_SLOT": "0", "MQDEDUP_WORKER_SUPERVISOR": "4101"}
    )
    second = static_instance_id(
        "orders", {"MQDEDUP_WORKER_SLOT": "0", "MQDEDUP_WORKER_SUPERVISOR": "4177"}
    )
    assert first is not None and second is not None and first != second
    host = socket.gethostname()
    assert first.startswith("orders.") and first.endswith(".4101.0") and host[:5] in first


def test_a_restarted_child_of_one_supervisor_keeps_its_id() -> None:
    env = {"MQDEDUP_WORKER_SLOT": "2", "MQDEDUP_WORKER_SUPERVISOR": "4101"}
    assert static_instance_id("orders", env) == static_instance_id("orders", dict(env))


def test_a_named_supervisor_keeps_its_ids_across_its_own_restarts() -> None:
    before = static_instance_id(
        "orders",
        {
            "MQDEDUP_WORKER_SLOT": "1",
            "MQDEDUP_WORKER_SUPERVISOR": "4101",
            "MQDEDUP_INSTANCE_HOST": "orders-worker-0",
        },
    )
    after = static_instance_id(
        "orders",
        {
            "MQDEDUP_WORKER_SLOT": "1",
            "MQDEDUP_WORKER_SUPERVISOR": "9876",
            "MQDEDUP_INSTANCE_HOST": "orders-worker-0",
        },
    )
    assert before == after == "orders.orders-worker-0.1"


def test_characters_kafka_refuses_are_replaced_and_the_length_is_bounded() -> None:
    instance = static_instance_id(
        "orders group/" + "x" * 300,
        {"MQDEDUP_WORKER_SLOT": "3", "MQDEDUP_INSTANCE_HOST": "host name"},
    )
    assert instance is not None
    assert len(instance) <= 249 and instance.endswith("host-name.3")
    assert " " not in instance and "/" not in instance

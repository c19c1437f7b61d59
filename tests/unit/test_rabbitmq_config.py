"""RabbitMQ consumer configuration: clear one-line errors, defaults, topology, URLs."""

from __future__ import annotations

from typing import Any

import pytest

from mqdedup import Message
from mqdedup.consumers.context import Context
from mqdedup.errors import ConfigurationError
from mqdedup.rabbitmq.consumer import Binding, RabbitMQConsumer
from mqdedup.rabbitmq.topology import (
    RABBITMQ_URL_ENV,
    Topology,
    connection_parameters,
    declare_topology,
    mask_amqp_url,
)


class Orders(RabbitMQConsumer):
    queue = "orders"

    def handle(self, message: Message, ctx: Context) -> Any:
        return None


def variant(**attributes: Any) -> RabbitMQConsumer:
    return type("Variant", (Orders,), attributes)()


def test_defaults() -> None:
    consumer = Orders()
    consumer.validate()
    assert consumer.consumer_name == "orders", "the dedup scope is the queue"
    assert consumer.effective_prefetch == 2 * consumer.batch_size, "two batches"
    assert variant(batch_size=40_000).effective_prefetch == 65535, "AMQP's limit"
    topology = consumer.topology()
    assert topology.dead_letter_queue == "orders.dlq"
    assert topology.dead_letter_exchange == "mqdedup.dead-letter"
    assert topology.queue_declare_arguments() == {}
    assert variant(name="billing").consumer_name == "billing"
    assert variant(prefetch=1000).effective_prefetch == 1000


def test_message_id_defaults_to_the_amqp_property() -> None:
    message = Message(body=b"", properties={"message_id": "abc"}, headers={"message-id": "h"})
    assert Orders().message_id(message) == "abc"


def test_url_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RABBITMQ_URL_ENV, "amqp://u:p@broker:5673/v")
    assert Orders().broker_url == "amqp://u:p@broker:5673/v"
    assert variant(url="amqp://other/").broker_url == "amqp://other/"


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ({"queue": ""}, "Variant.queue must name the RabbitMQ queue"),
        ({"queue": "amq.gen"}, "reserved"),
        ({"queue_type": "stream"}, "queue_type must be 'classic' or 'quorum'"),
        ({"prefetch": 0}, "prefetch must be between 1 and 65535"),
        ({"batch_size": 70_000}, "prefetch must be between 1 and 65535"),
        ({"dead_letter_queue": "orders"}, "dead_letter_queue must differ"),
        ({"queue_arguments": {"x-queue-type": "quorum"}}, "use queue_type"),
        ({"bindings": (Binding("", "k"),)}, "needs an exchange name"),
        ({"bindings": (Binding("shop", "k", exchange_type="bogus"),)}, "exchange_type 'bogus'"),
        ({"bindings": ("shop",)}, "must hold mqdedup Binding objects"),
        ({"startup_timeout": -1}, "startup_timeout"),
    ],
)
def test_bad_configuration_is_one_clear_line(attributes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as error:
        variant(**attributes).validate()
    assert "\n" not in str(error.value)


def test_missing_handler_is_reported() -> None:
    class NoHandler(RabbitMQConsumer):
        queue = "q"

    with pytest.raises(ConfigurationError, match="implements neither handle"):
        NoHandler().validate()


def test_quorum_queue_and_its_dlq_are_declared_as_quorum() -> None:
    topology = variant(queue_type="quorum", queue_arguments={"x-max-length": 10}).topology()
    assert topology.queue_declare_arguments() == {"x-max-length": 10, "x-queue-type": "quorum"}
    assert topology.dead_letter_queue_arguments() == {"x-queue-type": "quorum"}


class RecordingChannel:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        def record(**kwargs: Any) -> None:
            self.calls.append((name, kwargs))

        return record


def test_declared_topology() -> None:
    channel = RecordingChannel()
    topology = Topology(
        queue="orders",
        bindings=(Binding("shop", "order.*", exchange_type="topic"),),
    )
    declare_topology(channel, topology)
    names = [(name, kwargs.get("queue"), kwargs.get("exchange")) for name, kwargs in channel.calls]
    assert names == [
        ("queue_declare", "orders", None),
        ("exchange_declare", None, "shop"),
        ("queue_bind", "orders", "shop"),
        ("queue_declare", "orders.dlq", None),
        ("exchange_declare", None, "mqdedup.dead-letter"),
        ("queue_bind", "orders.dlq", "mqdedup.dead-letter"),
    ]
    assert all(kwargs.get("durable", True) for _, kwargs in channel.calls)
    assert channel.calls[2][1]["routing_key"] == "order.*"
    assert channel.calls[5][1]["routing_key"] == "orders.dlq"


def test_declare_false_only_checks_passively() -> None:
    channel = RecordingChannel()
    declare_topology(channel, Topology(queue="orders", bindings=(Binding("shop"),), declare=False))
    assert [name for name, _ in channel.calls] == [
        "queue_declare",
        "exchange_declare",
        "queue_declare",
        "exchange_declare",
    ]
    assert all(kwargs["passive"] for _, kwargs in channel.calls)


def test_default_exchange_for_dead_letters_declares_no_exchange() -> None:
    channel = RecordingChannel()
    declare_topology(channel, Topology(queue="orders", dead_letter_exchange=""))
    assert [name for name, _ in channel.calls] == ["queue_declare", "queue_declare"]


def test_url_masking_never_shows_the_password() -> None:
    assert mask_amqp_url("amqp://guest:s3cret@host:5672/%2F") == "amqp://guest:***@host:5672/%2F"
    assert mask_amqp_url("amqp://host/") == "amqp://host/"
    assert "s3cret" not in mask_amqp_url("amqp://guest:s3cret@host:notaport/")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://guest:s3cret@host/", "must start with amqp:// or amqps://"),
        ("amqp://guest:s3cret@host:notaport/", "malformed RabbitMQ URL"),
        ("amqp://guest:s3cret@host/?heartbeat=abc", "malformed RabbitMQ URL"),
        ("amqp://guest:s3cret@host/?bogus=1", "Unknown URL parameter"),
    ],
)
def test_bad_urls_are_clear_and_masked(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as error:
        connection_parameters(url, "name")
    assert "s3cret" not in str(error.value)


def test_connection_parameters_carry_the_connection_name() -> None:
    parameters = connection_parameters("amqp://g:p@h:5673/v?heartbeat=7", "mqdedup:orders:x:1")
    assert parameters.client_properties["connection_name"] == "mqdedup:orders:x:1"
    assert (parameters.host, parameters.port, parameters.virtual_host) == ("h", 5673, "v")
    assert parameters.heartbeat == 7
    assert parameters.connection_attempts == 1

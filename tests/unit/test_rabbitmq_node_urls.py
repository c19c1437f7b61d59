"""A RabbitMQ cluster given as its nodes' URLs: splitting, masking, the order of tries."""

from __future__ import annotations

import pytest

from mqdedup.errors import ConfigurationError
from mqdedup.rabbitmq.topology import (
    BrokerNodes,
    connection_parameters,
    join_urls,
    mask_amqp_url,
    split_urls,
)

NODES = "amqp://u:p,w@n1:5672/%2F, amqp://u:s@n2:5672/%2F,amqps://u:s@n3:5671/%2F"


def test_split_at_commas_before_a_url_only() -> None:
    assert split_urls(NODES) == [
        "amqp://u:p,w@n1:5672/%2F",  # a comma in a password does not split
        "amqp://u:s@n2:5672/%2F",
        "amqps://u:s@n3:5671/%2F",
    ]
    assert split_urls(["amqp://a/", "amqp://b/,amqp://c/"]) == [
        "amqp://a/",
        "amqp://b/",
        "amqp://c/",
    ]
    assert join_urls(["amqp://a/", "amqp://b/"]) == "amqp://a/,amqp://b/"


def test_every_password_is_masked() -> None:
    masked = mask_amqp_url(NODES)
    assert "s@" not in masked and "p,w" not in masked
    assert masked.count("***") == 3


def test_a_lost_node_is_tried_last() -> None:
    nodes = BrokerNodes(NODES, "test")
    assert len(nodes) == 3 and nodes.order() == [0, 1, 2]
    nodes.current = 1
    nodes.lost()
    assert nodes.order() == [2, 0, 1]
    assert nodes.parameters[2].host == "n3" and nodes.masked[2].startswith("amqps://u:***@")


def test_a_single_connection_refuses_a_node_list() -> None:
    with pytest.raises(ConfigurationError, match="names several nodes"):
        connection_parameters(NODES, "test")
    with pytest.raises(ConfigurationError, match="empty"):
        BrokerNodes(" ", "test")


def test_a_delivery_limit_needs_a_quorum_queue_and_a_positive_count() -> None:
    from mqdedup.rabbitmq.topology import Topology

    Topology("q", queue_type="quorum", queue_arguments={"x-delivery-limit": 20}).validate("Q")
    with pytest.raises(ConfigurationError, match="only honoured by quorum queues"):
        Topology("q", queue_arguments={"x-delivery-limit": 20}).validate("Q")
    with pytest.raises(ConfigurationError, match="positive integer"):
        Topology("q", queue_type="quorum", queue_arguments={"x-delivery-limit": 0}).validate("Q")


def test_the_async_consumer_takes_a_node_list_with_the_same_checks() -> None:
    from mqdedup.rabbitmq import AsyncRabbitMQConsumer

    class Orders(AsyncRabbitMQConsumer):
        queue = "orders"
        url = ("amqp://u:p,w@n1/%2F", "amqp://u:s@n2/%2F")

    assert Orders().broker_url == "amqp://u:p,w@n1/%2F,amqp://u:s@n2/%2F"

    class Classic(Orders):
        queue_arguments = {"x-delivery-limit": 5}  # noqa: RUF012

    with pytest.raises(ConfigurationError, match="only honoured by quorum queues"):
        Classic().validate()

    class Negative(Orders):
        queue_type = "quorum"
        queue_arguments = {"x-delivery-limit": -1}  # noqa: RUF012

    with pytest.raises(ConfigurationError, match="positive integer"):
        Negative().validate()

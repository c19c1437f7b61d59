"""The asyncio transports outside the greenlet bridge, and without their extra.

No broker needed: a method called from plain synchronous code must say what to do
instead (run the consumer with ``run`` / ``run_async``), before it touches the network;
and the adapter packages import without aiokafka / aio-pika.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from mqdedup.consumers.transport import Delivery
from mqdedup.message import Message


def test_aio_transport_methods_outside_the_bridge_raise_a_clear_error() -> None:
    from mqdedup.kafka import AsyncKafkaConsumer
    from mqdedup.kafka.aio_transport import AioKafkaTransport
    from mqdedup.rabbitmq.aio_transport import AioPikaTransport
    from mqdedup.rabbitmq.topology import Topology

    class Orders(AsyncKafkaConsumer):
        topics = ("orders",)
        group_id = "orders"
        bootstrap_servers = "127.0.0.1:1"

        async def handle(self, message: Message, ctx: object) -> None:
            return None

    kafka = AioKafkaTransport(Orders().aiokafka_settings())
    rabbit = AioPikaTransport(
        Topology("orders"), "amqp://guest:guest@127.0.0.1:1/", connection_name="x", prefetch=10
    )
    delivery = Delivery(Message(body=b""), None)
    for transport in (kafka, rabbit):
        name = type(transport).__name__
        for call in (
            lambda t=transport: t.start(),
            lambda t=transport: t.fetch(10, 0.1),
            lambda t=transport: t.settle([delivery]),
            lambda t=transport: t.give_back([delivery]),
        ):
            with pytest.raises(RuntimeError, match="inside the greenlet bridge") as raised:
                call()
            assert name in str(raised.value)
    with pytest.raises(RuntimeError, match="run / run_async"):
        Orders().create_transport()


def test_the_adapters_import_without_loading_aiokafka_or_aio_pika() -> None:
    probe = (
        "import sys; import mqdedup.kafka, mqdedup.rabbitmq; "
        "from mqdedup.kafka import AsyncKafkaConsumer; "
        "from mqdedup.rabbitmq import AsyncRabbitMQConsumer; "
        "loaded = [m for m in ('aiokafka', 'aio_pika', 'aiormq') if m in sys.modules]; "
        "print(loaded); sys.exit(1 if loaded else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr

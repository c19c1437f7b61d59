"""Plain pika clients for the test kit's harnesses (:mod:`mqdedup.testing.brokers`).

A confirm channel and raw publishes: what a test needs to drive a real broker around a
consumer. Here so that the test kit never imports pika.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pika

from mqdedup.rabbitmq.topology import BrokerNodes


def confirm_channel(url: str, connection_name: str) -> tuple[Any, Any]:
    """``(connection, channel)``: a blocking connection and a channel with publisher confirms."""
    return BrokerNodes(url, connection_name).confirm_channel()


def persistent_properties(message_id: str | None, headers: Mapping[str, str]) -> Any:
    """``BasicProperties`` of a persistent message with ``message_id`` and ``headers``."""
    return pika.BasicProperties(
        message_id=message_id, headers=dict(headers) or None, delivery_mode=2
    )

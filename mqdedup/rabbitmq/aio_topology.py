"""Declaring a consumer's topology over aio-pika, as :mod:`mqdedup.rabbitmq.topology` does
over pika: the durable queue, its bindings, the dead-letter exchange and queue.

On a robust channel aio-pika declares them again after every reconnect.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
import aio_pika.exceptions as aio_errors

from mqdedup.errors import ConfigurationError
from mqdedup.rabbitmq.topology import BrokerNodes, Topology

#: What a lost or closed channel / connection raises (the broker then redelivers).
CHANNEL_FAILURES: tuple[type[BaseException], ...] = (
    aio_errors.AMQPError,
    aio_errors.ChannelInvalidStateError,
    OSError,
)
#: The same, or no answer in time.
CONNECTION_FAILURES: tuple[type[BaseException], ...] = (*CHANNEL_FAILURES, TimeoutError)


async def declare_topology(channel: Any, topology: Topology) -> Any:
    """Declare (or, with ``declare=False``, passively check) queue, bindings and DLQ.

    Returns the consumed queue. A mismatch with an existing queue or exchange (406), a
    missing one with ``declare=False`` (404) or a refused one (403) raises
    :class:`ConfigurationError` naming it.
    """
    passive = not topology.declare
    try:
        queue = await channel.declare_queue(
            topology.queue,
            durable=True,
            passive=passive,
            arguments=None if passive else topology.queue_declare_arguments(),
        )
        for binding in topology.bindings:
            exchange = await channel.declare_exchange(
                binding.exchange,
                type=aio_pika.ExchangeType(binding.exchange_type),
                durable=True,
                passive=passive,
            )
            if not passive:
                await queue.bind(
                    exchange,
                    routing_key=binding.routing_key,
                    arguments=dict(binding.arguments) if binding.arguments else None,
                )
        await declare_dead_letter_topology(channel, topology)
    except aio_errors.ChannelClosed as error:
        raise ConfigurationError(
            f"RabbitMQ refused the topology of queue {topology.queue!r}: {describe_error(error)}"
        ) from error
    return queue


async def declare_dead_letter_topology(channel: Any, topology: Topology) -> None:
    """Declare (or check) the dead-letter queue, exchange and their binding."""
    passive = not topology.declare
    queue = await channel.declare_queue(
        topology.dead_letter_queue,
        durable=True,
        passive=passive,
        arguments=None if passive else topology.dead_letter_queue_arguments(),
    )
    if topology.dead_letter_exchange:
        exchange = await channel.declare_exchange(
            topology.dead_letter_exchange,
            type=aio_pika.ExchangeType.DIRECT,
            durable=True,
            passive=passive,
        )
        if not passive:
            await queue.bind(exchange, routing_key=topology.dead_letter_routing_key)


async def connect_first_live_node(
    nodes: BrokerNodes, connect: Callable[[str], Awaitable[Any]]
) -> Any:
    """``await connect(url)`` for the nodes in :meth:`BrokerNodes.order` until one answers;
    its result (marked ``nodes.current``). A refused login is raised at once (every node
    shares the users); when no node answers, the last node's error."""
    error: BaseException | None = None
    for index in nodes.order():
        try:
            connection = await connect(nodes.urls[index])
        except aio_errors.ProbableAuthenticationError:
            raise
        except CONNECTION_FAILURES as failure:
            error = failure
            continue
        nodes.current = index
        return connection
    assert error is not None  # BrokerNodes holds at least one node
    raise error


def describe_error(error: BaseException) -> str:
    """A one-line description of an aio-pika / socket error (never the URL)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__

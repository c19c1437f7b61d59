"""Consumers: the base class to subclass, the processing core and the transports."""

from mqdedup.consumers.async_consumer import AsyncConsumer
from mqdedup.consumers.base import Consumer, RetryPolicy
from mqdedup.consumers.context import AsyncBatchContext, AsyncContext, BatchContext, Context
from mqdedup.consumers.memory import InMemoryBroker, MemoryTransport
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.processor import BatchReport, Processor
from mqdedup.consumers.transport import DeadLetter, Delivery, Transport
from mqdedup.consumers.worker import Worker, run_until_idle
from mqdedup.stopping import StopToken, graceful_signals

__all__ = [
    "AsyncBatchContext",
    "AsyncConsumer",
    "AsyncContext",
    "BatchContext",
    "BatchReport",
    "Consumer",
    "Context",
    "DeadLetter",
    "Delivery",
    "InMemoryBroker",
    "MemoryTransport",
    "Metrics",
    "Processor",
    "RetryPolicy",
    "StopToken",
    "Transport",
    "Worker",
    "graceful_signals",
    "run_until_idle",
]

"""mqdedup: effectively-once Kafka and RabbitMQ consumers.

Each message id is claimed in a dedup table inside the same database transaction as
the handler's business writes and outbox rows; the broker is settled only after commit.
"""

# First: a Ctrl-C while the `mqdedup` command imports the rest ends it quietly.
from mqdedup import interrupts as _interrupts  # noqa: F401

# isort: split
from mqdedup import ids
from mqdedup.claiming import AsyncClaim, Claim, ClaimError, async_claim, claim
from mqdedup.consumers import (
    AsyncConsumer,
    AsyncContext,
    Consumer,
    Context,
    DeadLetter,
    Delivery,
    InMemoryBroker,
    Metrics,
    RetryPolicy,
    StopToken,
    Transport,
    Worker,
    run_until_idle,
)
from mqdedup.consumers.bodies import InvalidBodyError
from mqdedup.consumers.context import (
    HandlerEndedTransactionError,
    InvalidResultError,
    NoTransactionError,
)
from mqdedup.db.async_engine import create_async_engine
from mqdedup.db.engine import create_engine, init_schema
from mqdedup.db.transaction_state import HandlerBrokeTransactionError
from mqdedup.dedup import (
    ClaimStore,
    DedupStore,
    InsertOrGet,
    InsertOrGetError,
    RedisDedup,
    SqlDedup,
    async_insert_or_get,
    insert_or_get,
)
from mqdedup.dedup.ids import InvalidMessageIdError
from mqdedup.errors import (
    ConfigurationError,
    DeadLetterRefusedError,
    MessageError,
    MissingMessageIdError,
    MqdedupError,
    UndecodableMessageError,
)
from mqdedup.gc_tuning import tune_gc
from mqdedup.message import Message
from mqdedup.outbox.async_writer import AsyncOutboxWriter

__version__ = "0.1.0"

__all__ = [
    "AsyncClaim",
    "AsyncConsumer",
    "AsyncContext",
    "AsyncOutboxWriter",
    "Claim",
    "ClaimError",
    "ClaimStore",
    "ConfigurationError",
    "Consumer",
    "Context",
    "DeadLetter",
    "DeadLetterRefusedError",
    "DedupStore",
    "Delivery",
    "HandlerBrokeTransactionError",
    "HandlerEndedTransactionError",
    "InMemoryBroker",
    "InsertOrGet",
    "InsertOrGetError",
    "InvalidBodyError",
    "InvalidMessageIdError",
    "InvalidResultError",
    "Message",
    "MessageError",
    "Metrics",
    "MissingMessageIdError",
    "MqdedupError",
    "NoTransactionError",
    "RedisDedup",
    "RetryPolicy",
    "SqlDedup",
    "StopToken",
    "Transport",
    "UndecodableMessageError",
    "Worker",
    "__version__",
    "async_claim",
    "async_insert_or_get",
    "claim",
    "create_async_engine",
    "create_engine",
    "ids",
    "init_schema",
    "insert_or_get",
    "run_until_idle",
    "tune_gc",
]

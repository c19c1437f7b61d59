"""What the pipeline reads of a consumer: its settings and handlers, and the retry policy.

The Worker, the Processor and its steps take a :class:`ConsumerSpec`; the
:class:`~mqdedup.consumers.base.Consumer` class users subclass implements it. The base
class sits above the pipeline (it starts a Worker in ``Consumer.run``), so the pipeline
depends on this protocol, not on the class: no import cycle between them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from mqdedup.backoff import Backoff
from mqdedup.dedup.claims import Dedup
from mqdedup.dedup.ids import MessageIdStrategy
from mqdedup.errors import ConfigurationError
from mqdedup.message import Message

FailureIsolation = Literal["auto", "savepoint", "rerun", "transaction"]
FAILURE_ISOLATIONS: tuple[str, ...] = ("auto", "savepoint", "rerun", "transaction")


@dataclass(frozen=True)
class RetryPolicy:
    """How often a failing handler runs, and how long to wait between attempts.

    ``max_attempts`` counts every run of the handler for one message, across
    redeliveries; after the last one the message is dead-lettered. Database outages do
    not count: they are retried without limit using ``infrastructure_backoff_max``.
    """

    max_attempts: int = 3
    initial_backoff: float = 0.2
    max_backoff: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.1
    infrastructure_backoff_max: float = 5.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigurationError("RetryPolicy.max_attempts must be at least 1")
        if self.initial_backoff < 0 or self.max_backoff < 0:
            raise ConfigurationError("RetryPolicy backoffs must not be negative")

    def backoff(self, failed_attempts: int) -> float:
        """Seconds to wait after ``failed_attempts`` failures (exponential, capped, jittered)."""
        jitter = (1 - self.jitter, 1 + self.jitter)
        backoff = Backoff(self.initial_backoff, self.max_backoff, self.multiplier, jitter)
        return backoff.delay(failed_attempts)


class ConsumerSpec(Protocol):
    """The consumer as the pipeline sees it (implemented by ``Consumer``)."""

    @property
    def consumer_name(self) -> str:
        """The dedup scope."""
        ...

    @property
    def table_prefix(self) -> str:
        """Prefix of the framework's tables."""
        ...

    @property
    def batch_size(self) -> int:
        """Messages per batch."""
        ...

    @property
    def poll_timeout(self) -> float:
        """Seconds to wait for a batch to fill."""
        ...

    @property
    def metrics_interval(self) -> float:
        """Seconds between the worker's metrics log lines."""
        ...

    @property
    def retry_policy(self) -> RetryPolicy:
        """How often a failing handler runs."""
        ...

    @property
    def failure_isolation(self) -> FailureIsolation:
        """How a failing handler is kept from failing its batch-mates."""
        ...

    @property
    def deduplicate(self) -> bool:
        """False only for benchmark baselines: no claim at all."""
        ...

    @property
    def asynchronous(self) -> bool:
        """True when the handlers and hooks are coroutines."""
        ...

    @property
    def uses_steps(self) -> bool:
        """True when the handlers declare they call ``ctx.step`` (two connections)."""
        ...

    @property
    def dedup(self) -> Dedup:
        """Where the claims live."""
        ...

    #: How the dedup key is taken from a message (a class attribute: read off the class).
    message_id_strategy: ClassVar[MessageIdStrategy]

    @property
    def has_batch_handler(self) -> bool:
        """True when ``handle_batch`` is implemented."""
        ...

    @property
    def has_single_handler(self) -> bool:
        """True when ``handle`` is implemented."""
        ...

    @property
    def wants_duplicate_results(self) -> bool:
        """True when ``on_duplicate`` is overridden."""
        ...

    def message_id(self, message: Message) -> str:
        """The message id of ``message``."""
        ...

    def handle(self, message: Message, ctx: Any) -> Any:
        """One new message's effects."""
        ...

    def handle_batch(self, messages: Sequence[Message], ctx: Any) -> Mapping[str, Any] | None:
        """All new messages of a batch."""
        ...

    def on_duplicate(self, message: Message, stored_result: Any) -> None:
        """A duplicate, with the first delivery's stored result."""
        ...

    def after_commit(self, messages: Sequence[Message]) -> None:
        """After the commit, before settling."""
        ...

    def validate(self) -> None:
        """Raise ConfigurationError for settings that cannot work."""
        ...

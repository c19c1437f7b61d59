"""The base class users subclass (the retry policy and what the pipeline reads of a
consumer are in ``spec.py``, the context in ``context.py``)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy.orm import Session

from mqdedup.consumers.bodies import body_decoder
from mqdedup.consumers.metrics import Metrics
from mqdedup.consumers.spec import FAILURE_ISOLATIONS, FailureIsolation, RetryPolicy
from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.dedup.choices import SqlDedup
from mqdedup.dedup.ids import MAX_ID_LENGTH, MessageIdStrategy, from_header
from mqdedup.errors import ConfigurationError
from mqdedup.stopping import StopToken

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.ext.asyncio import AsyncEngine
    from sqlalchemy.orm import sessionmaker

    from mqdedup.consumers.context import BatchContext, Context
    from mqdedup.consumers.transport import Transport
    from mqdedup.dedup.claims import Dedup
    from mqdedup.message import Message

__all__ = ["Consumer", "RetryPolicy"]


class Consumer:
    """Subclass this and implement :meth:`handle` (or :meth:`handle_batch`).

    Each message's dedup claim, the handler's writes through ``ctx.session`` and its
    ``ctx.outbox`` rows commit in one transaction; the broker is settled afterwards.
    Class attributes configure the consumer; broker subclasses add their own.
    """

    #: The dedup scope. Defaults to the broker's group / queue, else the class name.
    name: ClassVar[str | None] = None
    #: Messages per transaction (per broker settle with ``failure_isolation = "transaction"``).
    batch_size: ClassVar[int] = 100
    #: Seconds to wait for a batch to fill.
    poll_timeout: ClassVar[float] = 1.0
    #: How the dedup key is taken from a message (see :mod:`mqdedup.dedup.ids`).
    message_id_strategy: ClassVar[MessageIdStrategy] = from_header()
    retry_policy: ClassVar[RetryPolicy] = RetryPolicy()
    #: How a failing handler is kept from failing its batch-mates (its own writes and its
    #: claim are always undone; the others commit):
    #: ``auto`` (default): handlers run without savepoints; on a failure the transaction
    #: rolls back and the batch reruns without the failing message, in savepoints.
    #: ``savepoint``: every handler runs in a savepoint (two more round trips each).
    #: ``rerun``: never savepoints; each failure reruns the batch without it.
    #: Rerunning calls batch-mates' handlers again: keep effects in the transaction.
    #: ``transaction``: one transaction per message (claim, handler, commit), run one
    #: after the other over the batch; a failure rolls back only its own message and no
    #: handler runs twice. The broker is settled once per batch, after the last commit,
    #: so ``batch_size`` still sets how many messages one ack / offset commit covers.
    #: ``handle_batch`` then receives one message at a time.
    failure_isolation: ClassVar[FailureIsolation] = "auto"
    table_prefix: ClassVar[str] = DEFAULT_PREFIX
    #: Skip the claim entirely (a baseline for benchmarks; never for real consumers).
    deduplicate: ClassVar[bool] = True
    #: The adapter this consumer reads through (``"kafka"``, ``"rabbitmq"``; None for
    #: consumers given a transport explicitly): picks the broker-specific CLI options.
    broker: ClassVar[str | None] = None
    #: Where claims live: ``SqlDedup()`` (default: the dedup table, in the handler's
    #: transaction) or ``RedisDedup(lease=..., retention=...)`` for handlers without a
    #: database write (no ``ctx.session`` / ``ctx.outbox`` then). See
    #: :mod:`mqdedup.dedup.choices`.
    dedup: ClassVar[Dedup] = SqlDedup()
    #: Seconds between the worker's periodic ``consumer metrics`` log lines.
    metrics_interval: ClassVar[float] = 30.0
    #: True for :class:`~mqdedup.consumers.async_consumer.AsyncConsumer`: its handlers and
    #: hooks are coroutines, awaited by the pipeline running on an event loop (the bridge).
    asynchronous: ClassVar[bool] = False
    #: Declare True when the handlers call ``ctx.step``: a step runs on a second
    #: connection of the engine while the message's transaction holds the first, so a
    #: worker refuses to start (``ConfigurationError``) on an engine whose pool cannot
    #: give two at once. Undeclared, such a pool is a WARNING at start and the first
    #: step that waits for the connection fails its message (see ``docs/operations.md``).
    uses_steps: ClassVar[bool] = False

    @property
    def consumer_name(self) -> str:
        """The dedup scope of this consumer."""
        return self.name or self.default_name()

    def default_name(self) -> str:
        """The name used when ``name`` is not set; broker subclasses use group / queue."""
        return type(self).__name__

    def message_id(self, message: Message) -> str:
        """The message id of ``message``; raises MissingMessageIdError when it has none."""
        return type(self).message_id_strategy(message)

    def handle(self, message: Message | Any, ctx: Context) -> Any:
        """Apply one new message's effects through ``ctx.session`` / ``ctx.outbox``.

        Annotate ``message`` with a pydantic model, a dataclass or a msgspec Struct to
        get the body decoded and validated into it (``ctx.message`` is then the raw
        message; an invalid body is dead-lettered at once with each field's error: see
        :mod:`mqdedup.consumers.bodies`).

        Return a JSON-serialisable result to store it with the claim (duplicates get it
        back in :meth:`on_duplicate`). Raise to fail the message: it is retried, then
        dead-lettered; :class:`~mqdedup.errors.MessageError` dead-letters at once.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement handle()")

    def handle_batch(
        self, messages: Sequence[Message] | Sequence[Any], ctx: BatchContext
    ) -> Mapping[str, Any] | None:
        """Optional bulk handler for all new messages of a batch (e.g. one INSERT).

        ``Sequence[Model]`` gets the validated bodies (``ctx.messages`` the raw messages,
        in the same order); a message whose body is invalid is dead-lettered alone.

        Return ``{message_id: result}`` or ``None``. If it raises, the batch falls back
        to :meth:`handle` per message so the failing message can be found.
        """
        raise NotImplementedError

    def on_duplicate(self, message: Message, stored_result: Any) -> None:
        """Called for each duplicate with the first delivery's stored result (or None)."""

    def after_commit(self, messages: Sequence[Message]) -> None:
        """Called after the transaction committed (``RedisDedup``: after the completions
        were written) and before the broker is settled."""

    def create_transport(
        self, *, stop: StopToken | None = None, metrics: Metrics | None = None
    ) -> Transport[Any]:
        """The started transport this consumer reads from; broker subclasses implement it.

        ``stop``: when requested, the transport hands out nothing more (the batch in
        flight is still settled until ``close``); ``metrics``: where it reports its
        connection state and lag. Every subclass keeps this signature.
        """
        raise ConfigurationError(
            f"{type(self).__name__} has no broker: subclass KafkaConsumer or "
            "RabbitMQConsumer, or pass a transport explicitly"
        )

    def run(
        self,
        database: Engine | AsyncEngine | sessionmaker[Session] | None,
        *,
        stop: StopToken | None = None,
        metrics: Metrics | None = None,
    ) -> Metrics:
        """Consume until ``stop`` is requested, counting into ``metrics``.

        What ``mqdedup worker`` calls in each worker process, for every broker: a
        :class:`~mqdedup.consumers.worker.Worker` over :meth:`create_transport`. On a
        stop request the batch in flight is finished and settled, then the transport is
        closed (Kafka: settled offsets committed, the group left). Outages of the
        broker or the database are waited out; messages are never dead-lettered for them.
        """
        from mqdedup.consumers.worker import Worker  # the worker imports this module

        stop = stop or StopToken()
        metrics = metrics if metrics is not None else Metrics()
        transport = self.create_transport(stop=stop, metrics=metrics)
        try:
            worker = Worker(self, transport, database, stop=stop, metrics=metrics)
        except BaseException:
            transport.close()
            raise
        return worker.run()

    def check_connection(self) -> None:
        """Raise BrokerUnavailableError if the broker cannot be reached (CLI start-up)."""

    # -- introspection used by the processor -------------------------------------------

    @property
    def has_batch_handler(self) -> bool:
        """True when the subclass implements :meth:`handle_batch`."""
        return type(self).handle_batch is not Consumer.handle_batch

    @property
    def has_single_handler(self) -> bool:
        """True when the subclass implements :meth:`handle`."""
        return type(self).handle is not Consumer.handle

    @property
    def wants_duplicate_results(self) -> bool:
        """True when :meth:`on_duplicate` is overridden (stored results are read then)."""
        return type(self).on_duplicate is not Consumer.on_duplicate

    def validate(self) -> None:
        """Raise ConfigurationError for settings that cannot work."""
        if self.batch_size < 1:
            raise ConfigurationError(f"{type(self).__name__}.batch_size must be at least 1")
        if self.failure_isolation not in FAILURE_ISOLATIONS:
            raise ConfigurationError(
                f"{type(self).__name__}.failure_isolation must be 'auto', 'savepoint', "
                f"'rerun' or 'transaction', not {self.failure_isolation!r}"
            )
        if not (self.has_single_handler or self.has_batch_handler):
            raise ConfigurationError(
                f"{type(self).__name__} implements neither handle() nor handle_batch()"
            )
        if not isinstance(self.uses_steps, bool):
            raise ConfigurationError(
                f"{type(self).__name__}.uses_steps must be True or False, not {self.uses_steps!r}"
            )
        problem = consumer_name_problem(self.consumer_name)
        if problem:
            raise ConfigurationError(f"{type(self).__name__}: the consumer name {problem}")
        problem = handler_style_problem(self)
        if problem:
            raise ConfigurationError(problem)
        # Typed bodies: an annotation naming no model is refused here, at start.
        if self.has_single_handler:
            body_decoder(type(self), "handle")
        if self.has_batch_handler:
            body_decoder(type(self), "handle_batch")


#: The methods a consumer overrides that the pipeline calls (async in an AsyncConsumer).
HANDLER_METHODS = ("handle", "handle_batch", "on_duplicate", "after_commit")


def handler_style_problem(consumer: Consumer) -> str | None:
    """Why ``consumer``'s handlers cannot run: ``async def`` in a synchronous consumer,
    or plain ``def`` in an async one."""
    name = type(consumer).__name__
    for method in HANDLER_METHODS:
        is_async = inspect.iscoroutinefunction(getattr(type(consumer), method))
        if is_async and not consumer.asynchronous:
            return (
                f"{name}.{method} is `async def`: subclass mqdedup.AsyncConsumer for async "
                "handlers (Consumer runs plain `def` handlers)"
            )
        if consumer.asynchronous and not is_async:
            return f"{name}.{method} must be `async def` in an AsyncConsumer"
    return None


def consumer_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a consumer name (the dedup scope stored with every claim)."""
    if not isinstance(name, str):
        return f"must be a string, not {type(name).__name__}"
    if not name.strip():
        return "is empty"
    if len(name) > MAX_ID_LENGTH:
        return (
            f"is {len(name)} characters long; the dedup tables hold at most {MAX_ID_LENGTH} "
            f"(set a shorter `name`): {name[:40]!r}…"
        )
    if "\x00" in name:
        return f"contains a NUL byte: {name!r}"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return f"is not valid Unicode (a lone surrogate): {name!r}"
    return None

"""The base class users subclass, the per-message context and the retry policy."""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from sqlalchemy.orm import Session

from mqdedup.consumers.metrics import Metrics
from mqdedup.db.schema import DEFAULT_PREFIX
from mqdedup.dedup.choices import SqlDedup
from mqdedup.dedup.claims import Dedup
from mqdedup.dedup.ids import MAX_ID_LENGTH, MessageIdStrategy, from_header
from mqdedup.errors import ConfigurationError, MessageError
from mqdedup.message import Message
from mqdedup.stopping import StopToken

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import sessionmaker

    from mqdedup.consumers.transport import Transport
    from mqdedup.outbox.writer import OutboxWriter

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
        base = min(
            self.max_backoff, self.initial_backoff * self.multiplier ** (failed_attempts - 1)
        )
        return base * (1 + random.uniform(-self.jitter, self.jitter))


class HandlerEndedTransactionError(RuntimeError):
    """A handler called ``commit``, ``rollback``, ``close`` or ``begin`` on ``ctx.session``.

    The transaction belongs to the processor: it holds the message's claim and its
    batch-mates' work, and commits them together before the broker is settled. The call
    is refused (nothing is ended) and the message fails like any raising handler.
    """


class InvalidResultError(MessageError):
    """A handler returned a result no database can store as JSON (NaN, infinity, a NUL
    character, a lone surrogate, a type JSON does not have); the message is
    dead-lettered at once with this reason."""


#: Session methods that would end (or replace) the processor's transaction.
GUARDED_SESSION_METHODS = ("commit", "rollback", "close", "begin", "reset", "invalidate")


def _refusal(method: str) -> Any:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise HandlerEndedTransactionError(
            f"a handler must not end the transaction: ctx.session.{method}() is not allowed "
            "(mqdedup commits the message's claim and effects together after the handler)"
        )

    refuse.__name__ = method
    return refuse


def _guarded_begin(session: Session) -> Any:
    refuse = _refusal("begin")

    def begin(nested: bool = False) -> Any:
        if nested:  # begin_nested(): a savepoint inside the transaction is fine
            return Session.begin(session, nested=True)
        return refuse()

    return begin


_REFUSALS: dict[str, Any] = {method: _refusal(method) for method in GUARDED_SESSION_METHODS}
_REFUSALS_KEY = "mqdedup.refusals"


def guard_session(session: Session) -> None:
    """Make ``session``'s transaction-ending methods raise HandlerEndedTransactionError.

    Instance attributes shadow the methods, so ``ctx.session`` stays a real ``Session``
    (``ctx.outbox``, ORM calls and savepoints with ``begin_nested()`` keep working) and
    the guard costs two dictionary updates per transaction.
    """
    refusals = session.info.get(_REFUSALS_KEY)
    if refusals is None:  # built once per session (a lease reuses it for a batch)
        refusals = {**_REFUSALS, "begin": _guarded_begin(session)}
        session.info[_REFUSALS_KEY] = refusals
    session.__dict__.update(refusals)


def unguard_session(session: Session) -> None:
    """Undo :func:`guard_session` (the processor is about to end the transaction)."""
    namespace = session.__dict__
    for method in GUARDED_SESSION_METHODS:
        namespace.pop(method, None)


class NoTransactionError(ConfigurationError):
    """A handler used ``ctx.session`` or ``ctx.outbox`` of a consumer whose claims live
    outside the database (``dedup = RedisDedup(...)``): there is no transaction."""


class Context:
    """What a handler gets besides the message: the transaction's session and outbox.

    ``session`` is the processor's transaction, guarded: ``commit()``, ``rollback()``,
    ``close()`` or ``begin()`` raise :class:`HandlerEndedTransactionError` (use
    ``begin_nested()`` for a savepoint of your own). A consumer whose claim store has
    no transaction (``dedup = RedisDedup(...)``) has neither: using them raises
    :class:`NoTransactionError` saying why.
    """

    def __init__(self, session: Session | None, consumer: Consumer, message: Message) -> None:
        self._session = session
        self.consumer = consumer
        self.message = message

    @property
    def session(self) -> Session:
        """The transaction's (guarded) session."""
        if self._session is None:
            raise NoTransactionError(self._no_transaction("ctx.session"))
        return self._session

    def _no_transaction(self, what: str) -> str:
        return (
            f"{what} is not available: {type(self.consumer).__name__} keeps its claims in "
            f"{self.consumer.dedup.describe()}, so its handler runs in no database "
            "transaction (use the default SQL dedup to write to a database)"
        )

    @cached_property
    def log(self) -> logging.LoggerAdapter[logging.Logger]:
        """A logger for the handler that adds the message id and consumer name."""
        return logging.LoggerAdapter(
            logging.getLogger(f"mqdedup.handler.{self.consumer.consumer_name}"),
            {"message_id": self.message.id, "consumer": self.consumer.consumer_name},
        )

    @property
    def consumer_name(self) -> str:
        """The dedup scope this message is claimed in."""
        return self.consumer.consumer_name

    @cached_property
    def outbox(self) -> OutboxWriter:
        """Add outgoing messages to the outbox, in this transaction."""
        from mqdedup.outbox.writer import OutboxWriter

        if self._session is None:
            raise NoTransactionError(self._no_transaction("ctx.outbox"))
        return OutboxWriter(
            self.session,
            consumer_name=self.consumer.consumer_name,
            causation_id=self.message.id,
            prefix=self.consumer.table_prefix,
            message=self.message,
        )


class BatchContext(Context):
    """Context of :meth:`Consumer.handle_batch`; ``message`` is the batch's first one."""

    def __init__(
        self, session: Session | None, consumer: Consumer, messages: Sequence[Message]
    ) -> None:
        super().__init__(session, consumer, messages[0])
        self.messages = messages


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
    #: Where claims live: ``SqlDedup()`` (default: the dedup table, in the handler's
    #: transaction) or ``RedisDedup(lease=..., retention=...)`` for handlers without a
    #: database write (no ``ctx.session`` / ``ctx.outbox`` then). See
    #: :mod:`mqdedup.dedup.choices`.
    dedup: ClassVar[Dedup] = SqlDedup()
    #: Seconds between the worker's periodic ``consumer metrics`` log lines.
    metrics_interval: ClassVar[float] = 30.0

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

    def handle(self, message: Message, ctx: Context) -> Any:
        """Apply one new message's effects through ``ctx.session`` / ``ctx.outbox``.

        Return a JSON-serialisable result to store it with the claim (duplicates get it
        back in :meth:`on_duplicate`). Raise to fail the message: it is retried, then
        dead-lettered; :class:`~mqdedup.errors.MessageError` dead-letters at once.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement handle()")

    def handle_batch(
        self, messages: Sequence[Message], ctx: BatchContext
    ) -> Mapping[str, Any] | None:
        """Optional bulk handler for all new messages of a batch (e.g. one INSERT).

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
        database: Engine | sessionmaker[Session] | None,
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
        problem = consumer_name_problem(self.consumer_name)
        if problem:
            raise ConfigurationError(f"{type(self).__name__}: the consumer name {problem}")


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

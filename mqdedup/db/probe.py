"""Does the database answer? A trivial query on a fresh connection, asked only when an
error already looks like an outage.

Promise 6 says an outage is a service that does not answer. A lost connection, a
connection error without SQLSTATE or a pool that gave no connection *look* like one,
but so do a row over MySQL's ``max_allowed_packet`` (the server drops the connection)
and a handler that exhausted its own pool. :class:`Probe` tells them apart: it opens a
connection of its own (never one of the pool, which the failed work may have used up or
left broken), runs ``SELECT 1`` and closes it. Answered: the database is there, the
error is the work's. Not answered: an outage, waited out.

:class:`mqdedup.outages.Outages` asks it; healthy paths never do (no round trip unless
an error already looked transient). :func:`pool_shortage` words the pool-exhaustion case.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, ClassVar

from sqlalchemy import Engine, event
from sqlalchemy.pool import QueuePool

from mqdedup.errors import ConfigurationError
from mqdedup.masking import mask_url

log = logging.getLogger(__name__)


class Probe:
    """``answers()``: True when a fresh connection to ``engine``'s database runs
    ``SELECT 1``; also reads the limits worth naming in a reason (MySQL/MariaDB's
    ``max_allowed_packet``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        #: MySQL/MariaDB ``max_allowed_packet`` in bytes, read by the last probe that answered.
        self.max_allowed_packet: int | None = None
        self._watch = _PoolWatch.of(engine)

    @property
    def most_checked_out(self) -> int:
        """The most connections of the engine's pool checked out at once in this
        process: its capacity once a checkout timed out (a pool says its size through
        its public methods, not its overflow)."""
        return self._watch.most

    def answers(self) -> bool:
        """One fresh connection, one trivial query; never raises."""
        pool = self.engine.pool.recreate()  # same creator and connect settings, empty
        try:
            connection = pool.connect()
            try:
                cursor = connection.cursor()
                if self.engine.dialect.name in ("mysql", "mariadb"):
                    cursor.execute("SELECT @@max_allowed_packet")
                    row: Any = cursor.fetchone()
                    self.max_allowed_packet = int(row[0]) if row else None
                else:
                    cursor.execute("SELECT 1")
                    cursor.fetchone()
                cursor.close()
                connection.rollback()
            finally:
                connection.close()
        except Exception as error:  # any failure means "does not answer"
            log.debug("database probe failed", extra={"error": type(error).__name__})
            return False
        finally:
            pool.dispose()
        return True


class _PoolWatch:
    """Keeps the most connections checked out at once of one engine's pool (one
    ``checkout`` listener per engine, however many Processors use it)."""

    _watches: ClassVar[weakref.WeakKeyDictionary[Engine, _PoolWatch]] = weakref.WeakKeyDictionary()
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, engine: Engine) -> None:
        self._engine = weakref.ref(engine)
        self.most = 0

    @classmethod
    def of(cls, engine: Engine) -> _PoolWatch:
        with cls._lock:
            watch = cls._watches.get(engine)
            if watch is None:
                watch = cls._watches[engine] = cls(engine)
                event.listen(engine, "checkout", watch.checked_out)
            return watch

    def checked_out(self, *_args: Any) -> None:
        engine = self._engine()
        pool = engine.pool if engine is not None else None
        if isinstance(pool, QueuePool):
            self.most = max(self.most, pool.checkedout())


def engine_of(bind: object) -> Engine | None:
    """The engine to probe behind a session factory's bind: a server database's engine
    (PostgreSQL, MySQL/MariaDB). None otherwise: a bind that is no engine, or SQLite, a
    file in the process that always "answers" (its transient errors are lock waits)."""
    if not isinstance(bind, Engine) or bind.dialect.name == "sqlite":
        return None
    return bind


def pool_shortage(engine: Engine, held: int, *, in_handler: bool) -> str:
    """Why a pool gave no connection, and how big it must be; ``held``: the most
    connections checked out at once (all of them, when a checkout timed out).

    Pool figures are read through the pool's public methods (``size()``,
    ``checkedout()``, ``timeout()``); ``in_handler``: the handler asked for it while the
    message's transaction held one.
    """
    pool = engine.pool
    name = mask_url(engine.url)
    if isinstance(pool, QueuePool):
        held = max(held, pool.size())
        where = "the handler" if in_handler else "the worker"
        return (
            f"the pool of {name} is too small by 1: {where} waited {pool.timeout():g}s for "
            f"a connection while all {held} were checked out, the message's transaction "
            f"holding one; give the engine at least {held + 1} connections (pool_size + "
            "max_overflow): a worker process needs 1 for the message's transaction, plus 1 "
            "for ctx.step or any other connection its handlers open (declare uses_steps = "
            "True on the consumer to have a pool too small refused at start)"
        )
    return (
        f"the pool of {name} ({type(pool).__name__}) gave no connection: a worker needs 1 "
        "connection for the message's transaction, plus 1 for ctx.step"
    )


class MessageDatabaseError(Exception):
    """An error of a database that answers, which belongs to the message whose work
    raised it: a driver limit, a packet too large, a pool its handler exhausted. Counted
    toward the message's attempts; its text is the dead-letter reason."""


def explain(error: BaseException, probe: Probe | None, *, answered: bool) -> Exception | None:
    """``error`` reworded for the message's dead letter when it is a database error that
    belongs to the message (None: not one of those; the error stays as it is).

    ``answered``: a probe found the database answering although ``error`` looked like an
    outage. The clear error keeps ``error`` as its cause.
    """
    from mqdedup.db import dialects  # the module that knows every database's codes

    reason = dialects.driver_limit(error)
    if reason is None and dialects.is_pool_timeout(error) and probe is not None:
        reason = pool_shortage(probe.engine, probe.most_checked_out, in_handler=True)
    elif reason is None and dialects.is_pooler_queue_timeout(error):
        reason = (
            "the pooler (PgBouncer) gave no server connection within its query_wait_timeout "
            "while the database answers: its server pool (default_pool_size) is too small "
            "for the worker processes; a worker process needs 1 server connection, 2 when "
            "its handlers use ctx.step (see docs/operations.md, pool sizes)"
        )
    elif reason is None and answered:
        reason = (
            f"{type(error).__name__} on this message's statements, twice, while the "
            "database answers a probe on a fresh connection: not an outage"
        )
        packet = probe.max_allowed_packet if probe is not None else None
        if packet:
            reason += (
                "; MySQL/MariaDB drops the connection this way for a statement or row "
                f"over max_allowed_packet ({packet:,} bytes)"
            )
    if reason is None:
        return None
    clear = MessageDatabaseError(reason)
    clear.__cause__ = error
    return clear


def pool_gives_two(engine: Engine, *, wait: float = 2.0) -> bool | None:
    """Whether ``engine``'s pool can give a worker a second connection while it holds
    one (a step's, while the message's transaction holds the first).

    A pool of ``pool_size`` >= 2 can; otherwise (``pool_size=1``: it depends on its
    ``max_overflow``, which SQLAlchemy does not publish) one connection is held and a
    second asked for from a helper thread for up to ``wait`` seconds. None: the
    database could not be reached (nothing is said at start then).
    """
    pool = engine.pool
    if not isinstance(pool, QueuePool) or pool.size() >= 2:
        return True
    if engine.dialect.is_async:  # an AsyncEngine's pool connects on its event loop only
        return None
    try:
        first = pool.connect()
    except Exception:  # the database is away at start: the outage logic takes over
        return None
    given = threading.Event()

    def second() -> None:
        try:
            connection = pool.connect()
        except Exception:
            return
        given.set()
        connection.close()

    helper = threading.Thread(target=second, daemon=True, name="pool-check")
    helper.start()
    try:
        return given.wait(min(wait, pool.timeout()) or wait)
    finally:
        first.close()  # a helper still waiting gets this one back, and gives it back


def pool_too_small_for_steps(engine: Engine) -> str:
    """The start line for a pool that gives one connection at once."""
    return (
        f"the pool of {mask_url(engine.url)} gives 1 connection at once: enough for "
        "handlers without steps, too small by 1 for a handler that uses ctx.step (or "
        "opens a second connection of the engine), whose messages would fail waiting for "
        "it; give the engine pool_size + max_overflow >= 2 (a consumer declaring "
        "uses_steps = True is refused at start on such a pool)"
    )


def check_pool_for_steps(engine: Engine, owner: str, uses_steps: bool, consumer: str) -> None:
    """At start: a pool that cannot give a second connection while the message's
    transaction holds one refuses a consumer declaring ``uses_steps`` (``owner``: its
    class name) with a :class:`~mqdedup.errors.ConfigurationError` of one line, and is
    one WARNING line for a consumer that does not declare it (it may not call steps)."""
    if pool_gives_two(engine) is not False:
        return
    if uses_steps:
        raise ConfigurationError(
            f"{owner} declares uses_steps = True, but the pool of {mask_url(engine.url)} "
            "gives 1 connection at once, too small by 1: a step needs a second connection "
            "while the message's transaction holds the first; give the engine "
            "pool_size + max_overflow >= 2"
        )
    log.warning(pool_too_small_for_steps(engine), extra={"consumer": consumer})

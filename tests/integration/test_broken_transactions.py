"""Issue 39: a handler that breaks the transaction fails alone (promise 7).

The framework checks the transaction after every handler and before every commit. A
handler that catches a database error without a savepoint (PostgreSQL: the transaction
is aborted) or ends the transaction by any route (the Session's or the Connection's
``commit()`` / ``rollback()``, the transaction objects, a ``COMMIT`` / ``ROLLBACK``
statement, DDL that MariaDB commits implicitly) fails: it is retried, then dead-lettered
with a reason naming the cause and the fix. Its batch-mates keep their writes and their
claims (each exactly once), the worker stays alive, in every failure-isolation mode.

Every test runs the real worker over an in-memory broker against the real PostgreSQL
(and MariaDB where its behaviour differs); the batch is ``[good-a, culprit, good-b]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, insert, select, text
from sqlalchemy.exc import IntegrityError

from mqdedup import AsyncConsumer, AsyncContext, Consumer, Context, InMemoryBroker, Message
from mqdedup.consumers.worker import Worker
from mqdedup.db import init_schema
from mqdedup.db.async_engine import create_async_engine
from mqdedup.db.schema import schema
from tests import differential
from tests.differential import MAX_ATTEMPTS, RETRY
from tests.services import checked_engine, table_prefix

pytestmark = pytest.mark.integration
QUEUE = "broken"
ISOLATIONS = ("auto", "rerun", "savepoint", "transaction")


@dataclass(frozen=True)
class Env:
    """An engine, this test's tables and their prefix."""

    engine: Engine
    prefix: str
    rows: Table  # one row per message that ran: (id, msg)
    taken: Table  # a row with id 1: inserting it again violates the primary key


def _tables(prefix: str) -> tuple[MetaData, Table, Table]:
    metadata = MetaData()
    rows = Table(
        f"{prefix}rows",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("msg", String(64), nullable=False),
    )
    taken = Table(
        f"{prefix}taken", metadata, Column("id", Integer, primary_key=True, autoincrement=False)
    )
    return metadata, rows, taken


def _env(url: str, service: str) -> Iterator[Env]:
    engine = checked_engine(url, service)
    prefix = table_prefix()
    metadata, rows, taken = _tables(prefix)
    init_schema(engine, prefix)
    metadata.create_all(engine)
    with engine.begin() as connection:
        connection.execute(insert(taken), {"id": 1})
    try:
        yield Env(engine, prefix, rows, taken)
    finally:
        with engine.begin() as connection:
            connection.execute(text(f"DROP TABLE IF EXISTS {prefix}ddl"))
        metadata.drop_all(engine)
        schema(prefix).metadata.drop_all(engine)
        engine.dispose()


@pytest.fixture
def pg(pg_url: str) -> Iterator[Env]:
    yield from _env(pg_url, "PostgreSQL")


@pytest.fixture
def maria(mariadb_url: str) -> Iterator[Env]:
    yield from _env(mariadb_url, "MariaDB")


#: What the culprit does; returning True ends its handler there (no write of its own).
Behaviour = Callable[[Context, Env], bool | None]


class Broken(Consumer):
    """Writes one row per message; the message ``culprit`` also does ``culprit``."""

    name: ClassVar[str | None] = "broken"
    poll_timeout = 0.01
    retry_policy = RETRY
    batch_size = 3

    def __init__(self, env: Env, culprit: Behaviour) -> None:
        self.env = env
        self.culprit = culprit
        self.calls: dict[str, int] = {}
        self.charges: dict[str, int] = {}

    def handle(self, message: Message, ctx: Context) -> Any:
        message_id = str(message.id)
        self.calls[message_id] = self.calls.get(message_id, 0) + 1
        if message.json().get("step"):
            ctx.step("charge", lambda _key: self._charge(message_id))
        if message_id == "culprit" and self.culprit(ctx, self.env):
            return {"ok": message_id}
        ctx.session.execute(insert(self.env.rows), {"msg": message_id})
        return {"ok": message_id}

    def _charge(self, message_id: str) -> str:
        self.charges[message_id] = self.charges.get(message_id, 0) + 1
        return "charged"


def run(env: Env, culprit: Behaviour, isolation: str, step: bool = False) -> tuple[Broken, Any]:
    """``good-a``, ``culprit``, ``good-b`` in one batch through a worker until idle."""
    broker = InMemoryBroker()
    for message_id in ("good-a", "culprit", "good-b"):
        broker.publish(QUEUE, json.dumps({"step": step}), message_id=message_id)
    configured = type(
        "Configured", (Broken,), {"table_prefix": env.prefix, "failure_isolation": isolation}
    )
    consumer = configured(env, culprit)
    crash = differential.run_bounded(consumer, broker, QUEUE, env.engine, timeout=60)
    assert crash is None, f"the worker failed: {crash}"
    return consumer, broker


def written(env: Env) -> list[str]:
    """The messages whose row is in the table, sorted (a message twice: twice)."""
    with env.engine.connect() as connection:
        return sorted(connection.scalars(select(env.rows.c.msg)))


def claims(env: Env) -> dict[str, Any]:
    """The claims of the consumer, with their stored results."""
    return differential.stored_results(env.engine, env.prefix, "broken")


def letters(broker: InMemoryBroker) -> dict[str, tuple[int, str]]:
    """``message id -> (attempts, reason)`` of each dead letter."""
    return {
        str(letter.message.headers["message-id"]): (letter.record.attempts, letter.record.reason)
        for letter in broker.dead_letters.get(QUEUE, [])
    }


def assert_culprit_failed_alone(
    env: Env, consumer: Broken, broker: InMemoryBroker, *, fix: str
) -> None:
    """The batch-mates' rows and claims exactly once; the culprit retried, dead-lettered
    with the fix in the reason, its claim and its row absent."""
    assert written(env) == ["good-a", "good-b"]
    assert claims(env) == {"good-a": {"ok": "good-a"}, "good-b": {"ok": "good-b"}}
    dead = letters(broker)
    assert list(dead) == ["culprit"]
    attempts, reason = dead["culprit"]
    assert attempts == MAX_ATTEMPTS
    assert consumer.calls["culprit"] == MAX_ATTEMPTS
    assert fix in reason, reason


# -- a caught database error without a savepoint ----------------------------------------------


def swallow(ctx: Context, env: Env) -> bool:
    """Catch IntegrityError without a savepoint and return: the next statement of the
    transaction (a batch-mate's) is refused by PostgreSQL."""
    with contextlib.suppress(IntegrityError):  # the bug: the transaction is aborted now
        ctx.session.execute(insert(env.taken), {"id": 1})
    return True


def swallow_and_write(ctx: Context, env: Env) -> None:
    """The same, then the handler's own write (refused: "transaction is aborted")."""
    swallow(ctx, env)


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize("culprit", [swallow, swallow_and_write], ids=["returns", "writes"])
def test_a_swallowed_integrity_error_fails_only_its_message(
    pg: Env, isolation: str, culprit: Behaviour
) -> None:
    consumer, broker = run(pg, culprit, isolation)
    assert_culprit_failed_alone(pg, consumer, broker, fix="ctx.session.begin_nested()")
    assert "caught IntegrityError" in letters(broker)["culprit"][1]


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_swallowed_error_keeps_the_batch_mates_steps_and_rows(pg: Env, isolation: str) -> None:
    consumer, broker = run(pg, swallow, isolation, step=True)
    assert_culprit_failed_alone(pg, consumer, broker, fix="ctx.session.begin_nested()")
    # one external charge per message, the culprit's retries got the recorded one
    assert consumer.charges == {"good-a": 1, "culprit": 1, "good-b": 1}


def savepointed(ctx: Context, env: Env) -> None:
    """The right way: the failed insert undoes only itself; the message succeeds."""
    try:
        with ctx.session.begin_nested():
            ctx.session.execute(insert(env.taken), {"id": 1})
    except IntegrityError:
        pass


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_caught_error_inside_a_savepoint_is_fine(pg: Env, isolation: str) -> None:
    consumer, broker = run(pg, savepointed, isolation)
    assert written(pg) == ["culprit", "good-a", "good-b"]
    assert set(claims(pg)) == {"culprit", "good-a", "good-b"}
    assert letters(broker) == {}
    assert consumer.calls["culprit"] == 1


# -- ending or replacing the transaction --------------------------------------------------------


def connection_commit(ctx: Context, _env: Env) -> None:
    ctx.session.connection().commit()  # SQLAlchemy 2.0 "commit as you go"


def connection_rollback(ctx: Context, _env: Env) -> None:
    ctx.session.connection().rollback()


def session_transaction_commit(ctx: Context, _env: Env) -> None:
    transaction = ctx.session.get_transaction()
    assert transaction is not None
    transaction.commit()


def connection_transaction_commit(ctx: Context, _env: Env) -> None:
    transaction = ctx.session.connection().get_transaction()
    assert transaction is not None
    transaction.commit()


def connection_transaction_rollback(ctx: Context, _env: Env) -> None:
    transaction = ctx.session.connection().get_transaction()
    assert transaction is not None
    transaction.rollback()


def commit_statement(ctx: Context, _env: Env) -> None:
    ctx.session.execute(text("COMMIT"))


def rollback_statement(ctx: Context, _env: Env) -> None:
    ctx.session.execute(text("ROLLBACK"))


def driver_sql_commit(ctx: Context, _env: Env) -> None:
    ctx.session.connection().exec_driver_sql("COMMIT")


ROUTES = {
    "connection.commit": connection_commit,
    "connection.rollback": connection_rollback,
    "session.get_transaction().commit": session_transaction_commit,
    "connection.get_transaction().commit": connection_transaction_commit,
    "connection.get_transaction().rollback": connection_transaction_rollback,
    "text(COMMIT)": commit_statement,
    "text(ROLLBACK)": rollback_statement,
    "exec_driver_sql(COMMIT)": driver_sql_commit,
}


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_ending_the_transaction_fails_only_its_message(pg: Env, route: str, isolation: str) -> None:
    consumer, broker = run(pg, ROUTES[route], isolation)
    assert_culprit_failed_alone(pg, consumer, broker, fix="must not")


@pytest.mark.parametrize("route", ["text(COMMIT)", "connection.get_transaction().commit"])
def test_ending_the_transaction_on_mariadb(maria: Env, route: str) -> None:
    consumer, broker = run(maria, ROUTES[route], "auto")
    assert_culprit_failed_alone(maria, consumer, broker, fix="must not")


def ddl(ctx: Context, env: Env) -> None:
    ctx.session.execute(text(f"CREATE TABLE IF NOT EXISTS {env.prefix}ddl (id INTEGER)"))


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_ddl_that_commits_implicitly_on_mariadb_fails_only_its_message(
    maria: Env, isolation: str
) -> None:
    consumer, broker = run(maria, ddl, isolation)
    assert_culprit_failed_alone(maria, consumer, broker, fix="outside handlers")


def test_ddl_in_a_handler_on_postgresql_is_transactional_and_fine(pg: Env) -> None:
    consumer, broker = run(pg, ddl, "auto")
    assert written(pg) == ["culprit", "good-a", "good-b"]
    assert letters(broker) == {}
    assert consumer.calls["culprit"] == 1


class DuplicateOrderError(Exception):
    """What a handler raises instead of the IntegrityError it caught."""


def translate(ctx: Context, env: Env) -> None:
    """Catches IntegrityError and raises its own error from it: an ordinary failure."""
    try:
        ctx.session.execute(insert(env.taken), {"id": 1})
    except IntegrityError as error:
        raise DuplicateOrderError("order 1 exists") from error


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_an_error_raised_from_a_caught_one_keeps_its_own_reason(pg: Env, isolation: str) -> None:
    consumer, broker = run(pg, translate, isolation)
    assert_culprit_failed_alone(pg, consumer, broker, fix="DuplicateOrderError: order 1 exists")


# -- async consumers: the same transaction, the same check ----------------------------------


@pytest.mark.parametrize("route", ["swallow", "text(COMMIT)"])
def test_an_async_handler_that_breaks_the_transaction_fails_alone(
    pg: Env, pg_url: str, route: str
) -> None:
    env = pg

    class AsyncBroken(AsyncConsumer):
        name: ClassVar[str | None] = "broken"
        table_prefix = env.prefix
        poll_timeout = 0.01
        retry_policy = RETRY
        batch_size = 3

        def __init__(self) -> None:
            self.calls: dict[str, int] = {}

        async def handle(self, message: Message, ctx: AsyncContext) -> Any:
            message_id = str(message.id)
            self.calls[message_id] = self.calls.get(message_id, 0) + 1
            if message_id == "culprit":
                if route == "swallow":
                    with contextlib.suppress(IntegrityError):
                        await ctx.session.execute(insert(env.taken), {"id": 1})
                    return {"ok": message_id}
                await ctx.session.execute(text("COMMIT"))
            await ctx.session.execute(insert(env.rows), {"msg": message_id})
            return {"ok": message_id}

    broker = InMemoryBroker()
    for message_id in ("good-a", "culprit", "good-b"):
        broker.publish(QUEUE, "{}", message_id=message_id)
    consumer = AsyncBroken()

    async def scenario() -> None:
        engine = create_async_engine(pg_url)
        try:
            await Worker(consumer, broker.transport(QUEUE), engine).run_async(until_idle=True)
        finally:
            await engine.dispose()

    asyncio.run(scenario())
    assert written(env) == ["good-a", "good-b"]
    assert claims(env) == {"good-a": {"ok": "good-a"}, "good-b": {"ok": "good-b"}}
    assert list(letters(broker)) == ["culprit"]
    assert letters(broker)["culprit"][0] == MAX_ATTEMPTS
    assert consumer.calls["culprit"] == MAX_ATTEMPTS
    assert broker.pending(QUEUE) == 0

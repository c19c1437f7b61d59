"""Generated scenarios for the invariant fuzz tests (and ``bench/fuzz_soak.py``).

A scenario is a batch of messages a hostile producer and a careless handler could make:
ids of any Unicode (NUL, lone surrogates, empty, too long), headers of any type
(text, valid and invalid UTF-8 bytes, numbers, missing), bodies (invalid UTF-8, JSON
nested 100,000 deep, large), handler behaviours (succeed, raise, raise a
``MessageError``, end the transaction, return a result no database stores, fail once),
copies of messages (duplicates) and a crash (mid-batch or between commit and settle).
It runs through the in-memory broker into a real database, then :func:`check` verifies
the promises:

* the worker never raises (a simulated crash is the only exception, and is survived);
* every delivered copy is settled exactly once: processed, a duplicate or dead-lettered;
* every dead letter has a reason; a copy whose id or result cannot be stored, or whose
  handler kept failing, is dead-lettered, never claimed with partial effects;
* no claim without its effects, no effects without a claim, no effect twice;
* a processed or duplicate copy is settled only after its claim committed.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, func, insert, select
from sqlalchemy import create_engine as plain_engine

from mqdedup import Consumer, InMemoryBroker, Message, RetryPolicy
from mqdedup.consumers.context import Context
from mqdedup.consumers.memory import MemoryTransport
from mqdedup.consumers.transport import DeadLetter, Delivery
from mqdedup.consumers.worker import Worker
from mqdedup.db.schema import KeyString, schema
from mqdedup.dedup.ids import MAX_ID_LENGTH
from mqdedup.errors import MessageError, SimulatedCrash

QUEUE = "fuzz"
BEHAVIOURS = (
    "ok",
    "ok",
    "ok",
    "json",
    "raise",
    "raise_nul",
    "message_error",
    "flaky",
    "end:commit",
    "end:rollback",
    "end:close",
    "end:begin",
    "result:nan",
    "result:inf",
    "result:nul",
    "result:surrogate",
    "result:set",
)
#: Behaviours whose message ends processed (when its id is valid and it comes first).
SUCCEEDS = frozenset({"ok", "json", "flaky"})
ISOLATIONS = ("auto", "savepoint", "rerun", "transaction")
FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff=0.0, max_backoff=0.0, jitter=0.0)


def effects_table(prefix: str) -> Table:
    """One row per handler effect; ``consumer_name`` scopes each example."""
    return Table(
        f"{prefix}fuzz_effects",
        MetaData(),
        Column("row_id", Integer, primary_key=True, autoincrement=True),
        Column("consumer_name", KeyString(255), nullable=False),
        Column("message_id", KeyString(255), nullable=False),
        Column("note", String(40), nullable=True),
    )


@dataclass(frozen=True)
class Sent:
    """One published message: its header value, body and handler behaviour."""

    header: Any  # str, bytes, int or None (no header)
    body: bytes
    behaviour: str


@dataclass(frozen=True)
class Scenario:
    """What one example publishes and how it runs."""

    messages: tuple[Sent, ...]
    duplicate_rate: float
    isolation: str
    batch_size: int
    crash: str | None  # None, "mid-batch" or "after-commit"
    crash_after: int


GOOD_IDS = st.sampled_from(["order-1", "order-2", "order-3", "ünïcødé-4", "5"])
HOSTILE_IDS = st.one_of(
    st.sampled_from(
        ["", " ", "bad\x00id", "\x00", "a\ud800b", "\udfff", "x" * 255, "y" * 256, "z" * 1000]
    ),
    st.text(st.characters(codec=None, exclude_categories=()), max_size=300),
    st.text(min_size=250, max_size=260),
)
HEADERS = st.one_of(
    GOOD_IDS,
    GOOD_IDS.map(lambda text: text.encode("utf-8")),
    HOSTILE_IDS,
    st.sampled_from([b"\xff\xfe", b"caf\xe9", 7, 3.5, None]),
)
BODIES = st.one_of(
    st.builds(lambda n: json.dumps({"n": n}).encode(), st.integers()),
    st.binary(max_size=64),
    st.sampled_from([b"\xff", b'{"a": NaN}', b"[" * 100_000, b"x" * 200_000]),
)
MESSAGES = st.builds(Sent, header=HEADERS, body=BODIES, behaviour=st.sampled_from(BEHAVIOURS))
SCENARIOS = st.builds(
    Scenario,
    messages=st.lists(MESSAGES, min_size=1, max_size=10).map(tuple),
    duplicate_rate=st.sampled_from([0.0, 0.3, 1.0]),
    isolation=st.sampled_from(ISOLATIONS),
    batch_size=st.sampled_from([1, 3, 100]),
    crash=st.sampled_from([None, None, "mid-batch", "after-commit"]),
    crash_after=st.integers(min_value=0, max_value=5),
)


def create_tables(engine: Engine, prefix: str) -> None:
    """The framework's tables (``prefix``) and the effects table, if missing."""
    from mqdedup.db import init_schema

    init_schema(engine, prefix)
    table = effects_table(prefix)
    table.metadata.create_all(engine)


def drop_tables(engine: Engine, prefix: str) -> None:
    """Undo :func:`create_tables`."""
    effects_table(prefix).metadata.drop_all(engine)
    schema(prefix).metadata.drop_all(engine)


def _bad_result(kind: str) -> Any:
    return {
        "nan": math.nan,
        "inf": {"total": -math.inf},
        "nul": {"note": "a\x00b"},
        "surrogate": ["\udc80"],
        "set": {1, 2},
    }[kind]


def consumer_class(name: str, prefix: str, scenario: Scenario) -> type[Consumer]:
    """The fuzzed consumer: the behaviour travels in the ``x-behaviour`` header."""
    failed_once: set[str] = set()
    effects = effects_table(prefix)

    class Fuzzed(Consumer):
        batch_size = scenario.batch_size
        poll_timeout = 0.0
        retry_policy = FAST_RETRY
        table_prefix = prefix
        failure_isolation = scenario.isolation  # type: ignore[assignment]

        def handle(self, message: Message, ctx: Context) -> Any:
            behaviour = str(message.headers.get("x-behaviour"))
            if behaviour == "json":
                message.json()
            ctx.session.execute(
                insert(effects).values(
                    consumer_name=name, message_id=message.id, note=behaviour[:40]
                )
            )
            if behaviour == "raise":
                raise RuntimeError("handler failed")
            if behaviour == "raise_nul":  # an error text no database stores as it is
                raise RuntimeError("handler failed: \x00 \ud800")
            if behaviour == "message_error":
                raise MessageError("the handler refused this message")
            if behaviour == "flaky" and message.id not in failed_once:
                failed_once.add(str(message.id))
                raise ConnectionError("first attempt fails")
            if behaviour.startswith("end:"):
                getattr(ctx.session, behaviour[4:])()
            if behaviour.startswith("result:"):
                return _bad_result(behaviour[7:])
            return {"ok": True, "n": len(message.body)}

    Fuzzed.name = name
    return Fuzzed


class CheckingTransport:
    """The in-memory transport, checking that a settled copy's claim has committed."""

    def __init__(self, inner: MemoryTransport, reader: Engine, claims: Table, name: str) -> None:
        self.inner = inner
        self.reader = reader
        self.claims = claims
        self.name = name
        self.dead_tokens: set[Any] = set()
        self.violations: list[str] = []

    def fetch(self, max_messages: int, timeout: float) -> list[Delivery[int]]:
        return self.inner.fetch(max_messages, timeout)

    def settle(self, deliveries: Sequence[Delivery[int]]) -> None:
        expected = {
            d.message.id
            for d in deliveries
            if d.token not in self.dead_tokens and d.message.id is not None
        }
        if expected:
            with self.reader.connect() as connection:
                committed = set(
                    connection.execute(
                        select(self.claims.c.message_id).where(
                            self.claims.c.consumer_name == self.name,
                            self.claims.c.message_id.in_(sorted(expected)),
                        )
                    ).scalars()
                )
            missing = expected - committed
            if missing:
                self.violations.append(f"settled before its claim committed: {missing!r}")
        self.inner.settle(deliveries)

    def give_back(self, deliveries: Sequence[Delivery[int]]) -> None:
        self.inner.give_back(deliveries)

    def dead_letter(self, delivery: Delivery[int], record: DeadLetter) -> None:
        if not record.reason:
            self.violations.append("a dead letter without a reason")
        self.dead_tokens.add(delivery.token)
        self.inner.dead_letter(delivery, record)

    def keepalive(self) -> None:
        self.inner.keepalive()

    def close(self) -> None:
        self.inner.close()

    def crash(self) -> None:
        self.inner.crash()

    @property
    def in_flight(self) -> int:
        return self.inner.in_flight


@dataclass
class Outcome:
    """What one example left behind."""

    published: int
    settled: int
    dead_letters: list[Any]
    claims: set[str]
    effects: dict[str, int]
    violations: list[str] = field(default_factory=list)


def run(engine: Engine, reader: Engine, prefix: str, name: str, scenario: Scenario) -> Outcome:
    """Publish the scenario and run it to the end (through a crash if it has one)."""
    broker = InMemoryBroker(seed=len(scenario.messages))
    for sent in scenario.messages:
        headers: dict[str, Any] = {"x-behaviour": sent.behaviour}
        if sent.header is not None:
            headers["message-id"] = sent.header
        broker.publish(QUEUE, sent.body, headers=headers)
    copies = broker.inject_duplicates(QUEUE, scenario.duplicate_rate)
    claims_table = schema(prefix).processed
    effects = effects_table(prefix)
    violations: list[str] = []
    consumer_type = consumer_class(name, prefix, scenario)

    def worker(consumer: Consumer) -> Worker:
        transport = CheckingTransport(broker.transport(QUEUE), reader, claims_table, name)
        checkers.append(transport)
        return Worker(consumer, transport, engine)  # type: ignore[arg-type]

    checkers: list[CheckingTransport] = []
    if scenario.crash is not None:
        crashing = _crashing(consumer_type(), scenario.crash, scenario.crash_after)
        with contextlib.suppress(SimulatedCrash):  # the crash is the point; survive it
            worker(crashing).run(until_idle=True)
    worker(consumer_type()).run(until_idle=True)  # must not raise
    for checker in checkers:
        violations.extend(checker.violations)
    with engine.connect() as connection:
        claimed = set(
            connection.execute(
                select(claims_table.c.message_id).where(claims_table.c.consumer_name == name)
            ).scalars()
        )
        effect_rows = dict(
            connection.execute(
                select(effects.c.message_id, func.count())
                .where(effects.c.consumer_name == name)
                .group_by(effects.c.message_id)
            ).all()
        )
    if broker.pending(QUEUE):
        violations.append(f"{broker.pending(QUEUE)} messages left in the queue")
    return Outcome(
        published=len(scenario.messages) + copies,
        settled=broker.settled_count.get(QUEUE, 0),
        dead_letters=list(broker.dead_letters.get(QUEUE, [])),
        claims=claimed,
        effects=effect_rows,
        violations=violations,
    )


def _crashing(consumer: Consumer, kind: str, after: int) -> Consumer:
    from mqdedup.testing.plugin import _crash_after_commit, _crash_mid_batch

    if kind == "after-commit":
        return _crash_after_commit(consumer)
    return _crash_mid_batch(consumer, after)


def valid_id(header: Any) -> str | None:
    """The message id the default strategy takes from ``header`` (None: invalid)."""
    if isinstance(header, bytes):
        try:
            header = header.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if header is None:
        return None
    text = str(header)
    if not text.strip() or len(text) > MAX_ID_LENGTH or "\x00" in text:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return text


def check(scenario: Scenario, outcome: Outcome) -> None:
    """Assert the promises for one example (see the module docstring)."""
    assert outcome.violations == []
    assert outcome.settled == outcome.published, "each copy settled exactly once"
    assert all(d.record.reason for d in outcome.dead_letters)
    assert set(outcome.effects) == outcome.claims, "no claim without effects and vice versa"
    assert all(count == 1 for count in outcome.effects.values()), "an effect twice"
    dead_ids = [valid_id(d.message.headers.get("message-id")) for d in outcome.dead_letters]
    for sent in scenario.messages:
        message_id = valid_id(sent.header)
        if message_id is None:
            assert None in dead_ids, f"invalid id {sent.header!r} not dead-lettered"
            continue
        assert message_id in outcome.claims or message_id in dead_ids, (
            f"{message_id!r} neither processed nor dead-lettered"
        )
    # Where every message sharing an id agrees on success, the id's fate is known.
    fates: dict[str, set[bool]] = {}
    for sent in scenario.messages:
        message_id = valid_id(sent.header)
        if message_id is not None:
            fates.setdefault(message_id, set()).add(_succeeds(sent))
    for message_id, succeeded in fates.items():
        if succeeded == {True}:
            assert message_id in outcome.claims, f"{message_id!r} not processed"
        elif succeeded == {False}:
            assert message_id not in outcome.claims, f"{message_id!r} claimed"
            assert message_id in dead_ids, f"{message_id!r} not dead-lettered"


def _succeeds(sent: Sent) -> bool:
    if sent.behaviour == "json":
        return _parses(sent.body)
    return sent.behaviour in SUCCEEDS


def _parses(body: bytes) -> bool:
    try:
        json.loads(body)
    except (ValueError, RecursionError):
        return False
    return True


def reader_for(engine: Engine) -> Engine:
    """A second engine for the settle check: on SQLite a plain one (no BEGIN IMMEDIATE,
    so reading never waits for the processor's write lock)."""
    if engine.dialect.name == "sqlite":
        return plain_engine(engine.url)
    return engine

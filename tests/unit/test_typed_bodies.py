"""Typed bodies: handle(self, order: Order, ctx) with pydantic, dataclasses, msgspec.

The body is decoded and validated before the handler runs; an invalid body is
dead-lettered at once (never retried) with each field path and error in its reason;
batch-mates of an invalid body are processed; unannotated handlers are unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import msgspec
import pydantic
import pytest
from sqlalchemy import Engine, insert

from mqdedup import (
    AsyncConsumer,
    ConfigurationError,
    Consumer,
    InMemoryBroker,
    InvalidBodyError,
    Message,
    RetryPolicy,
    run_until_idle,
)
from mqdedup.consumers.context import AsyncContext, BatchContext, Context
from tests.support import order_counts, orders

# -- the three kinds of model, each with a nested list of items -------------------------------


class PItem(pydantic.BaseModel):
    sku: str
    qty: int


class POrder(pydantic.BaseModel):
    order: int
    amount: int
    items: list[PItem] = []


@dataclasses.dataclass
class DItem:
    sku: str
    qty: int


class Channel(enum.Enum):
    WEB = "web"
    SHOP = "shop"


@dataclasses.dataclass
class DOrder:
    order: int
    amount: int
    items: list[DItem] = dataclasses.field(default_factory=list)
    channel: Channel = Channel.WEB
    note: str | None = None
    kind: Literal["new", "repeat"] = "new"


class MItem(msgspec.Struct):
    sku: str
    qty: int


class MOrder(msgspec.Struct):
    order: int
    amount: int
    items: list[MItem] = []


FAST = RetryPolicy(max_attempts=3, initial_backoff=0.001, max_backoff=0.01)
CALLS: list[str] = []


def _write(ctx: Context, body: Any) -> dict[str, Any]:
    assert isinstance(ctx.message, Message)  # the raw message is still there
    CALLS.append(str(ctx.message.id))
    ctx.session.execute(
        insert(orders).values(
            message_id=ctx.message.id, order_id=str(body.order), amount=body.amount
        )
    )
    return {"order": body.order, "items": len(body.items)}


class PydanticOrders(Consumer):
    name = "typed"
    poll_timeout = 0.01
    retry_policy = FAST

    def handle(self, order: POrder, ctx: Context) -> Any:
        assert isinstance(order, POrder)
        return _write(ctx, order)


class DataclassOrders(PydanticOrders):
    def handle(self, order: DOrder, ctx: Context) -> Any:
        assert isinstance(order, DOrder) and all(isinstance(i, DItem) for i in order.items)
        return _write(ctx, order)


class MsgspecOrders(PydanticOrders):
    def handle(self, order: MOrder, ctx: Context) -> Any:
        assert isinstance(order, MOrder)
        return _write(ctx, order)


KINDS = {"pydantic": PydanticOrders, "dataclass": DataclassOrders, "msgspec": MsgspecOrders}

#: the reason for {"order": 3, "amount": 1, "items": [{"sku": "a", "qty": "many"}, {"qty": 1}]}
NESTED_REASONS = {
    "pydantic": (
        "invalid body for POrder: items[0].qty: Input should be a valid integer, unable to "
        "parse string as an integer; items[1].sku: Field required"
    ),
    "dataclass": (
        "invalid body for DOrder: items[0].qty: expected an integer, got string; "
        "items[1].sku: field required"
    ),
    # msgspec reports the first error it meets
    "msgspec": "invalid body for MOrder: items[0].qty: Expected `int`, got `str`",
}


def publish(broker: InMemoryBroker, body: Any, message_id: str, **kwargs: Any) -> None:
    text = body if isinstance(body, str | bytes) else json.dumps(body)
    broker.publish("orders", text, message_id=message_id, **kwargs)


@pytest.fixture(autouse=True)
def _clear_calls() -> None:
    CALLS.clear()


@pytest.mark.parametrize("kind", KINDS)
def test_valid_bodies_reach_the_handler_typed_and_invalid_ones_are_dead_lettered_at_once(
    sqlite_engine: Engine, kind: str
) -> None:
    broker = InMemoryBroker()
    publish(broker, {"order": 1, "amount": 10, "items": [{"sku": "a", "qty": 2}]}, "m1")
    bad = {"order": 3, "amount": 1, "items": [{"sku": "a", "qty": "many"}, {"qty": 1}]}
    publish(broker, bad, "m-bad")
    publish(broker, {"order": 2, "amount": 20}, "m2")

    metrics = run_until_idle(KINDS[kind](), broker.transport("orders"), sqlite_engine)

    assert order_counts(sqlite_engine) == {"m1": 1, "m2": 1}
    assert "m-bad" not in CALLS  # validated before the handler ran
    letters = broker.dead_letters["orders"]
    assert [letter.message.id for letter in letters] == ["m-bad"]
    assert letters[0].record.reason == NESTED_REASONS[kind]
    assert letters[0].record.attempts == 1  # not retried
    assert letters[0].message.body == json.dumps(bad).encode()  # its original bytes
    assert (metrics.processed, metrics.dead_lettered, metrics.retries) == (2, 1, 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("{not json", "body: "),
        ("[1, 2]", "body: "),
        ('{"amount": 1}', "order: "),
    ],
)
def test_malformed_json_and_missing_fields_are_named(
    sqlite_engine: Engine, kind: str, body: str, fragment: str
) -> None:
    broker = InMemoryBroker()
    publish(broker, body, "m1")
    run_until_idle(KINDS[kind](), broker.transport("orders"), sqlite_engine)
    (letter,) = broker.dead_letters["orders"]
    assert letter.record.reason.startswith("invalid body for ")
    assert fragment in letter.record.reason
    assert order_counts(sqlite_engine) == {}


def test_a_content_type_that_is_not_json_is_refused(sqlite_engine: Engine) -> None:
    broker = InMemoryBroker()
    publish(broker, {"order": 1, "amount": 1}, "m1", headers={"content-type": b"text/plain"})
    publish(
        broker, {"order": 2, "amount": 1}, "m2", properties={"content_type": "application/json"}
    )
    run_until_idle(PydanticOrders(), broker.transport("orders"), sqlite_engine)
    assert order_counts(sqlite_engine) == {"m2": 1}
    (letter,) = broker.dead_letters["orders"]
    assert (
        letter.record.reason
        == "invalid body for POrder: body: content type 'text/plain' is not JSON"
    )


def test_dataclass_fields_enums_literals_and_optionals(sqlite_engine: Engine) -> None:
    broker = InMemoryBroker()
    publish(broker, {"order": 1, "amount": 1, "channel": "shop", "note": None}, "ok")
    publish(broker, {"order": 2, "amount": 1.5, "channel": "fax", "kind": "old"}, "bad")
    run_until_idle(DataclassOrders(), broker.transport("orders"), sqlite_engine)
    assert order_counts(sqlite_engine) == {"ok": 1}
    (letter,) = broker.dead_letters["orders"]
    assert letter.record.reason == (
        "invalid body for DOrder: amount: expected an integer, got number; "
        "channel: expected one of 'web', 'shop', got 'fax'; kind: expected one of 'new', "
        "'repeat', got string"
    )


# -- handle_batch --------------------------------------------------------------------------------


class BatchOrders(Consumer):
    name = "typed-batch"
    poll_timeout = 0.01
    retry_policy = FAST
    batches: ClassVar[list[int]] = []

    def handle_batch(self, bodies: Sequence[POrder], ctx: BatchContext) -> dict[str, Any]:
        assert all(isinstance(body, POrder) for body in bodies)
        type(self).batches.append(len(bodies))
        ctx.session.execute(
            insert(orders),
            [
                {"message_id": m.id, "order_id": str(b.order), "amount": b.amount}
                for m, b in zip(ctx.messages, bodies, strict=True)
            ],
        )
        return {str(m.id): {"order": b.order} for m, b in zip(ctx.messages, bodies, strict=True)}


class MsgspecBatchOrders(BatchOrders):
    def handle_batch(self, bodies: Sequence[MOrder], ctx: BatchContext) -> dict[str, Any]:
        type(self).batches.append(len(bodies))
        ctx.session.execute(
            insert(orders),
            [
                {"message_id": m.id, "order_id": str(b.order), "amount": b.amount}
                for m, b in zip(ctx.messages, bodies, strict=True)
            ],
        )
        return {}


@pytest.mark.parametrize("consumer_class", [BatchOrders, MsgspecBatchOrders])
@pytest.mark.parametrize("isolation", ["auto", "savepoint", "rerun", "transaction"])
def test_a_batch_mate_with_an_invalid_body_is_dead_lettered_alone(
    sqlite_engine: Engine, consumer_class: type[BatchOrders], isolation: str
) -> None:
    consumer_class.batches = []
    broker = InMemoryBroker()
    for number in range(6):
        body: Any = {"order": number, "amount": number}
        if number in (2, 4):
            body = {"order": number, "amount": "lots"}
        publish(broker, body, f"m{number}")

    consumer = consumer_class()
    consumer.failure_isolation = isolation  # type: ignore[misc]
    metrics = run_until_idle(consumer, broker.transport("orders"), sqlite_engine)

    assert order_counts(sqlite_engine) == {f"m{n}": 1 for n in (0, 1, 3, 5)}
    letters = broker.dead_letters["orders"]
    assert sorted(letter.message.id for letter in letters) == ["m2", "m4"]
    assert all(letter.record.reason.startswith("invalid body for ") for letter in letters)
    assert all("amount: " in letter.record.reason for letter in letters)
    assert (metrics.processed, metrics.dead_lettered, metrics.retries) == (4, 2, 0)
    if isolation in ("auto", "rerun"):
        # the valid four still ran in ONE handle_batch call (the batch ran again without
        # the invalid two, not one call per message)
        assert consumer_class.batches == [4]


# -- async, unannotated, Message-annotated, misconfigured ----------------------------------------


class AsyncOrders(AsyncConsumer):
    name = "typed-async"
    poll_timeout = 0.01

    async def handle(self, order: POrder, ctx: AsyncContext) -> Any:
        assert isinstance(order, POrder) and isinstance(ctx.message, Message)
        await ctx.session.execute(
            insert(orders).values(message_id=ctx.message.id, order_id=str(order.order))
        )
        return None


def test_async_consumers_get_typed_bodies_too(sqlite_engine: Engine) -> None:
    broker = InMemoryBroker()
    publish(broker, {"order": 1, "amount": 1}, "m1")
    publish(broker, {"order": "x", "amount": 1}, "m2")
    run_until_idle(AsyncOrders(), broker.transport("orders"), sqlite_engine)
    assert order_counts(sqlite_engine) == {"m1": 1}
    assert [d.message.id for d in broker.dead_letters["orders"]] == ["m2"]


class RawOrders(Consumer):
    name = "raw"
    poll_timeout = 0.01

    def handle(self, message: Message, ctx: Context) -> Any:
        assert isinstance(message, Message)
        return None


class UnannotatedOrders(RawOrders):
    def handle(self, message, ctx):  # type: ignore[no-untyped-def]
        assert isinstance(message, Message)


def test_message_annotated_and_unannotated_handlers_get_the_raw_message(
    sqlite_engine: Engine,
) -> None:
    for consumer_class in (RawOrders, UnannotatedOrders):
        broker = InMemoryBroker()
        publish(broker, "not json at all", consumer_class.__name__)
        metrics = run_until_idle(consumer_class(), broker.transport("orders"), sqlite_engine)
        assert metrics.processed == 1 and metrics.dead_lettered == 0


class WrongAnnotation(Consumer):
    def handle(self, order: int, ctx: Context) -> Any:
        return None


def test_an_annotation_that_names_no_model_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"WrongAnnotation\.handle: .*annotated"):
        WrongAnnotation().validate()


def test_invalid_body_error_lists_every_error_and_caps_the_list() -> None:
    error = InvalidBodyError("Order", [(f"items[{i}]", "bad") for i in range(25)])
    assert error.reason.startswith("invalid body for Order: items[0]: bad; items[1]: bad")
    assert error.reason.endswith("; and 5 more")


def test_the_testing_harness_keeps_the_handlers_typed(sqlite_engine: Engine, tmp_path: Any) -> None:
    """``mqdedup.testing`` wraps the user's handlers (to hold or kill mid-batch): the
    wrapped handlers still get the validated model."""
    from mqdedup.testing.worker import build_consumer_class

    harnessed = build_consumer_class(
        {
            "consumer": f"{__name__}:PydanticOrders",
            "folder": str(tmp_path),
            "label": "typed",
        }
    )
    broker = InMemoryBroker()
    publish(broker, {"order": 1, "amount": 10}, "m1")
    publish(broker, {"order": "x", "amount": 10}, "m2")
    run_until_idle(harnessed(), broker.transport("orders"), sqlite_engine)
    assert order_counts(sqlite_engine) == {"m1": 1}
    assert [d.message.id for d in broker.dead_letters["orders"]] == ["m2"]


if TYPE_CHECKING:
    from mqdedup.consumers.context import Context as CheckedContext


class ContextOnlyForTypeCheckers(Consumer):
    name = "typed-checking"
    poll_timeout = 0.01

    def handle(self, order: POrder, ctx: CheckedContext) -> Any:
        _write(ctx, order)


def test_only_the_message_parameter_must_resolve(sqlite_engine: Engine) -> None:
    """``ctx: Context`` imported under TYPE_CHECKING (a NameError for get_type_hints on
    the whole handler) does not keep the body from being typed."""
    broker = InMemoryBroker()
    publish(broker, {"order": 1, "amount": 10}, "m1")
    run_until_idle(ContextOnlyForTypeCheckers(), broker.transport("orders"), sqlite_engine)
    assert order_counts(sqlite_engine) == {"m1": 1}

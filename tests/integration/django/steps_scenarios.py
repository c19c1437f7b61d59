"""Django steps scenarios on a real database: run by ``test_django_steps.py`` in a pytest
of their own (``-p no:django``), with the example project's settings and a migrated
database in the environment. Not collected by the main suite (no ``test_`` prefix).
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from typing import Any

import django
import pytest

django.setup()  # DJANGO_SETTINGS_MODULE=orders_project.settings (the example project)

from django.conf import settings  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from orders.models import Order  # noqa: E402

from mqdedup import Consumer, Context, Message, RetryPolicy  # noqa: E402
from mqdedup.consumers.memory import InMemoryBroker  # noqa: E402
from mqdedup.consumers.worker import Worker  # noqa: E402
from mqdedup.django import sessions  # noqa: E402

PREFIX = settings.MQDEDUP["TABLE_PREFIX"]
FATES = ["ok", "fail", "ok", "ok", "fail", "ok"]


def charging(run: str, isolation: str, calls: Counter[str]) -> Consumer:
    """Charges through ``ctx.step``, creates an Order, then fails for ``fail`` bodies."""

    class Charging(Consumer):
        name = run
        table_prefix = PREFIX
        batch_size = 10
        poll_timeout = 0.02
        failure_isolation = isolation  # type: ignore[assignment]
        retry_policy = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02)

        def handle(self, message: Message, ctx: Context) -> Any:
            def charge(key: str) -> dict[str, Any]:
                calls[str(message.id)] += 1
                return {"charge": key[:8], "amount": 1e16, "z": 1, "a": 2}

            charged = ctx.step("charge", charge)
            assert list(charged) == ["charge", "amount", "z", "a"]
            Order.objects.create(customer=str(message.id), total=1)
            if message.json()["fate"] == "fail":
                raise RuntimeError("declined after the charge")
            return charged

    return Charging()


def publish(broker: InMemoryBroker, run: str) -> list[str]:
    ids = [f"{run}-{n}" for n in range(len(FATES))]
    for message_id, fate in zip(ids, FATES, strict=True):
        broker.publish("charges", json.dumps({"fate": fate}), message_id=message_id)
    return ids


def step_rows(run: str) -> dict[str, tuple[str, int]]:
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT message_id, state, attempts FROM {PREFIX}steps WHERE consumer_name = %s",
            [run],
        )
        return {row[0]: (row[1], row[2]) for row in cursor.fetchall()}


@pytest.mark.parametrize("isolation", ["auto", "savepoint", "rerun", "transaction"])
def test_each_step_calls_once_next_to_a_failing_batch_mate(isolation: str) -> None:
    """The step's record commits on a connection of its own: neither the failing
    message's retries nor its batch-mates' reruns call again."""
    run = f"s{uuid.uuid4().hex[:8]}"
    calls: Counter[str] = Counter()
    broker = InMemoryBroker()
    ids = publish(broker, run)

    Worker(charging(run, isolation, calls), broker.transport("charges"), sessions()).run(
        until_idle=True
    )

    assert calls == dict.fromkeys(ids, 1)  # one external call per message and step
    assert step_rows(run) == dict.fromkeys(ids, ("done", 1))
    good = [i for i, fate in zip(ids, FATES, strict=True) if fate == "ok"]
    orders = Order.objects.filter(customer__startswith=run).values_list("customer", flat=True)
    created = Counter(orders)
    assert created == dict.fromkeys(good, 1)
    assert len(broker.dead_letters["charges"]) == FATES.count("fail")


def test_inside_an_atomic_block_opened_before_the_steps_stay_in_its_transaction() -> None:
    """As in a test case of pytest-django: the records are the message's, so they
    vanish with the test's rollback instead of outliving it."""
    run = f"t{uuid.uuid4().hex[:8]}"
    calls: Counter[str] = Counter()
    broker = InMemoryBroker()
    ids = publish(broker, run)

    with transaction.atomic():
        Worker(charging(run, "savepoint", calls), broker.transport("charges"), sessions()).run(
            until_idle=True
        )
        good = [i for i, fate in zip(ids, FATES, strict=True) if fate == "ok"]
        assert set(step_rows(run)) == set(good)  # the failed ones rolled back with them
        transaction.set_rollback(True)

    assert step_rows(run) == {}
    assert all(calls[i] == 1 for i in good)

"""The test kit with Django: your consumer against the test database of pytest-django.

In ``conftest.py``::

    pytest_plugins = ["mqdedup.django.testing"]

then::

    def test_shipments_are_effectively_once(mqdedup_django_harness):
        harness = mqdedup_django_harness(Shipments)
        for n in range(20):
            harness.publish({"order": n}, message_id=f"order-{n}")
        harness.deliver_each_twice()
        harness.run_crashing_after_commit(times=3)
        harness.run()
        assert Shipment.objects.count() == 20

``mqdedup_django_harness`` uses pytest-django's ``db`` fixture: the test runs in a
transaction that is rolled back at its end, and every transaction of the consumer is a
savepoint of it (a commit releases the savepoint, a rollback rolls back to it), so
claims, ORM rows and outbox rows behave as they do in production and vanish afterwards.
(``run_relay`` is refused there: the relay's own connections cannot see the test's
transaction; query the outbox table instead.)

The real-broker harnesses (:mod:`mqdedup.testing.brokers`) run workers in processes of
their own, which cannot see a test transaction: give them
``sessions="mqdedup.django.testing:worker_sessions"`` and a database the workers reach
through ``DJANGO_SETTINGS_MODULE`` (e.g. one migrated for the test run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import django  # type: ignore[import-untyped]
import pytest
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.consumers.base import Consumer
from mqdedup.errors import ConfigurationError
from mqdedup.testing.plugin import ConsumerHarness


class DjangoConsumerHarness(ConsumerHarness):
    """:class:`~mqdedup.testing.plugin.ConsumerHarness` on Django's test database."""

    def run_relay(self, timeout: float = 60.0) -> int:
        """Not here: the relay needs connections of its own, and they cannot see the
        test's transaction. Check the outbox rows with a query (or run the relay in a
        ``transactional_db`` test against the real broker harnesses)."""
        raise ConfigurationError(
            "run_relay() does not work on the test transaction of pytest-django "
            "(the relay's own connections cannot see it): query the outbox table instead"
        )


def worker_sessions(_database_url: str) -> sessionmaker[Session]:
    """What a real-broker harness worker runs with: Django set up from
    ``DJANGO_SETTINGS_MODULE`` (inherited), sessions on ``MQDEDUP["DATABASE"]``."""
    django.setup()
    from mqdedup.django.connection import sessions  # needs the apps loaded

    return sessions()


@pytest.fixture
def mqdedup_django_harness(db: Any) -> Callable[..., DjangoConsumerHarness]:
    """``mqdedup_django_harness(ConsumerClass, using=None)`` → a
    :class:`~mqdedup.testing.plugin.ConsumerHarness` on Django's test database."""
    from mqdedup.django.connection import engine, sessions

    def make(
        consumer: Callable[[], Consumer], *, using: str | None = None, **options: Any
    ) -> DjangoConsumerHarness:
        return DjangoConsumerHarness(consumer, engine(using), sessions=sessions(using), **options)

    return make

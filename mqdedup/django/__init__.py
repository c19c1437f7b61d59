"""Django integration: handlers write through the ORM in the claim's transaction.

Add ``"mqdedup.django"`` to ``INSTALLED_APPS`` and run ``manage.py migrate`` (mqdedup's
tables are this app's migrations). Then:

* ``manage.py mqdedup_worker app.consumers:OrderConsumer`` runs a Kafka or RabbitMQ
  consumer whose ``handle(message, ctx)`` writes with the ORM (``Order.objects.create``)
  in the same transaction as the message's claim, stored result and ``ctx.outbox`` rows;
* :func:`outbox` writes outgoing messages from a view, in the view's atomic block;
* :func:`idempotent` gives a view HTTP ``Idempotency-Key`` handling (the stored response
  for repeats, committed with the view's writes);
* ``manage.py mqdedup_relay`` publishes committed outbox rows;
* :func:`sessions` / :func:`engine` are the SQLAlchemy side of a Django alias (what the
  commands run consumers with; for tests and scripts).

See docs/django.md.
"""

# -- the django extra (typed43): an ImportError naming it; keep this block first ---
from mqdedup.extras import require as _require

_require("mqdedup.django", "django")
# isort: split
# ruff: noqa: E402 - the imports below come after the extra is checked

from mqdedup.dedup.request_keys import SHARED_SCOPE
from mqdedup.django.connection import TransactionBrokenError, engine, session, sessions
from mqdedup.django.idempotency import idempotent
from mqdedup.django.outbox import outbox

__all__ = [
    "SHARED_SCOPE",
    "TransactionBrokenError",
    "engine",
    "idempotent",
    "outbox",
    "session",
    "sessions",
]

"""A Celery task made effectively-once with ``mqdedup.claim`` (``acks_late``).

The task stays a Celery task: ``acks_late=True`` acks after it returns,
``task_reject_on_worker_lost=True`` makes the broker redeliver when the worker dies, and
the claim of ``self.request.id`` (the producer sets it: ``task_id="pay-7"``, the same on
every resend) is the first statement of the task's transaction. Uses the names of
:mod:`examples.faststream_claim.config` (``CLAIM_QUEUE``, ``CLAIM_CONSUMER``, the table).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, Task
from sqlalchemy import insert
from sqlalchemy.orm import Session

from examples import settings
from examples.faststream_claim import config
from mqdedup import claim

log = logging.getLogger("examples.claim")

app = Celery("claim_payments", broker=settings.rabbitmq_url())
app.conf.update(
    task_default_queue=config.queue(),
    task_acks_late=True,  # ack after the task returned, never on receipt
    task_reject_on_worker_lost=True,  # a killed worker: redelivered, not acked
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
_engine = None


def engine() -> Any:
    """One engine per worker process."""
    global _engine  # noqa: PLW0603 (a module-level cache, made on first use)
    if _engine is None:
        _engine = settings.engine()
    return _engine


@app.task(bind=True, name="claim_payments.charge")
def charge(self: Task, amount: int) -> Any:
    """Charge once per task id, however often the broker delivers the task."""
    message_id = self.request.id
    with Session(engine()) as session, session.begin():
        claimed = claim(
            session, message_id, consumer=config.consumer_name(), prefix=settings.mqdedup_prefix()
        )
        if claimed.is_duplicate:
            log.info("duplicate %s: first run stored %s", message_id, claimed.stored_result)
            return claimed.stored_result
        session.execute(
            insert(config.payments_table()).values(message_id=message_id, amount=amount)
        )
        claimed.store_result({"charged": amount})
    config.crash_point(message_id)  # committed, not acked yet: the crash tests
    log.info("processed %s", message_id)
    return {"charged": amount}

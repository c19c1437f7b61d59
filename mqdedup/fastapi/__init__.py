"""FastAPI integration: ``Idempotency-Key`` endpoints and consumers in the app's lifespan.

* :class:`Idempotency` + :class:`IdempotentRoute`: an endpoint's writes, its outbox rows
  and its response commit with the request's key; repeats get the stored response
  (see ``docs/http-idempotency.md``).
* :func:`consumers_lifespan` / :class:`ConsumerTasks` + :func:`consumers_health`: async
  consumers as tasks of the app's event loop, stopped gracefully on shutdown.
"""

# -- the fastapi extra (typed43): an ImportError naming it; keep this block first ---
from mqdedup.extras import require as _require

_require("mqdedup.fastapi", "fastapi")
# isort: split
# ruff: noqa: E402 - the imports below come after the extra is checked

from mqdedup.dedup.request_keys import SHARED_SCOPE
from mqdedup.fastapi.idempotency import Idempotency, IdempotentRoute
from mqdedup.fastapi.lifespan import ConsumerTasks, consumers_health, consumers_lifespan

__all__ = [
    "SHARED_SCOPE",
    "ConsumerTasks",
    "Idempotency",
    "IdempotentRoute",
    "consumers_health",
    "consumers_lifespan",
]

"""FastAPI integration: ``Idempotency-Key`` endpoints and consumers in the app's lifespan.

* :class:`Idempotency` + :class:`IdempotentRoute`: an endpoint's writes, its outbox rows
  and its response commit with the request's key; repeats get the stored response
  (see ``docs/http-idempotency.md``).
"""

from mqdedup.fastapi.idempotency import Idempotency, IdempotentRoute

__all__ = ["Idempotency", "IdempotentRoute"]

"""A Redis-deduplicated worker process for the kill -9 test.

It is handed ``sms-0``, ``sms-1`` and ``sms-2`` in one batch. ``sms-0`` is handled
normally (its effect and its completion reach Redis); in ``sms-1`` the handler touches
``<dir>/entered`` and then blocks until the test kills the process, so ``sms-1`` (in
its handler) and ``sms-2`` (claimed, not started) are left with this worker's claims.

    python -m tests.integration.tools.redis_claim_holder REDIS_URL NAMESPACE LEASE DIR
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import redis

from mqdedup import Consumer, Context, InMemoryBroker, Message, RedisDedup, Worker


def main() -> None:
    url, namespace, lease, gate = sys.argv[1], sys.argv[2], float(sys.argv[3]), Path(sys.argv[4])

    effects = redis.Redis.from_url(url)

    class Sms(Consumer):
        name = "sms"
        poll_timeout = 0.05
        dedup = RedisDedup(url=url, namespace=namespace, lease=lease)

        def handle(self, message: Message, ctx: Context) -> Any:
            if message.id == "sms-1":
                (gate / "entered").touch()
                time.sleep(120)  # the test kills this process long before
                raise TimeoutError("the test never killed the holder")
            effects.rpush(f"{namespace}effects", str(message.id))
            return {"sent": message.id}

    broker = InMemoryBroker()
    for number in range(3):
        broker.publish("sms", f"hello {number}", message_id=f"sms-{number}")
    Worker(Sms(), broker.transport("sms"), None).run(until_idle=True)


if __name__ == "__main__":
    main()

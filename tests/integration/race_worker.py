"""A worker process for the race test: it is handed message ``race-1`` and processes it.

The ``holder`` keeps its transaction open (after its claim) until the test releases it,
so that the ``second`` worker's claim has to wait on the unique index.
Prints the worker's metrics as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from mqdedup import InMemoryBroker, Message, create_engine, run_until_idle
from mqdedup.consumers.context import Context
from tests.support import OrderConsumer


def main() -> None:
    url, role, gate = sys.argv[1], sys.argv[2], Path(sys.argv[3])

    class RaceConsumer(OrderConsumer):
        def handle(self, message: Message, ctx: Context) -> Any:
            result = super().handle(message, ctx)
            if role == "holder":
                (gate / "entered").touch()
                deadline = time.monotonic() + 60
                while not (gate / "release").exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError("never released")
                    time.sleep(0.01)
            return result

    broker = InMemoryBroker()
    broker.publish("orders", b'{"order": "race"}', message_id="race-1")
    engine = create_engine(url)
    metrics = run_until_idle(RaceConsumer(), broker.transport("orders"), engine)
    print(json.dumps(metrics.snapshot()))


if __name__ == "__main__":
    main()

"""A RabbitMQ test worker in its own process: ``consumer.run`` under graceful_signals.

Config (one JSON argument): queue, prefix, url, database_url, batch_size and optional
fault switches:

* ``kill_after_commit``: a message id; ``after_commit`` of the batch holding it SIGKILLs
  this process (committed, not acked: the most dangerous moment).
* ``slow_id`` / ``slow_seconds`` / ``marker``: the handler of ``slow_id`` touches
  ``marker`` and then works ``slow_seconds`` (a batch the test can signal in the middle of).

Prints one JSON line at exit: the metrics and the duplicates the processor reported.
Exit code 0 after a graceful stop, 130 after an immediate one (second signal).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mqdedup import Message, create_engine
from mqdedup.consumers.metrics import Metrics
from mqdedup.stopping import ImmediateStop, StopToken, graceful_signals
from tests.integration.rabbitmq.support import make_consumer


def main() -> int:
    config: dict[str, Any] = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    kill_id = config.get("kill_after_commit")
    slow_id = config.get("slow_id")
    marker = Path(config["marker"]) if config.get("marker") else None

    def before_write(message: Message) -> None:
        if message.id == slow_id:
            if marker is not None:
                marker.write_text(str(os.getpid()))
            time.sleep(float(config.get("slow_seconds", 3.0)))  # simulated long work

    class Worker(
        make_consumer(  # type: ignore[misc]
            config["queue"],
            config["prefix"],
            config["url"],
            batch_size=int(config.get("batch_size", 50)),
            before_write=before_write if slow_id else None,
        )
    ):
        def after_commit(self, messages: Sequence[Message]) -> None:
            if kill_id is not None and any(m.id == kill_id for m in messages):
                os.kill(os.getpid(), signal.SIGKILL)

    consumer = Worker()
    engine = create_engine(config["database_url"])
    stop = StopToken()
    metrics = Metrics()
    code = 0
    try:
        with graceful_signals(stop):
            consumer.run(engine, stop=stop, metrics=metrics)
    except ImmediateStop:
        code = 130
    print(
        json.dumps({"metrics": metrics.snapshot(), "duplicates": consumer.duplicate_ids}),
        flush=True,
    )
    return code


if __name__ == "__main__":
    sys.exit(main())

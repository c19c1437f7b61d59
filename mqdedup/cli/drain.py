"""``mqdedup relay --drain``: one relay in this process publishes the outbox rows that are
due, then the command exits; a job for a deploy step, a cron entry or a test.

It runs :meth:`Relay.run(until_idle=True) <mqdedup.outbox.relay.Relay.run>` (the same
claims, publishing and marking as the daemon, sharing the table with running relays), so
it ends when a claim finds nothing due and no broker is paused, when ``timeout`` passes
(a broker that stays unavailable), or on SIGTERM / SIGINT (the batch in flight is
finished first). The exit code says whether the outbox was drained:

* 0: every row it claimed was published and nothing due is left;
* :data:`~mqdedup.cli.exitcodes.NOT_DRAINED` (9): the broker refused rows (each waits
  for its retry with a backoff, or was marked failed after its last attempt: ``mqdedup
  outbox status``), or rows due were left: the timeout passed with a broker unavailable,
  or their shards belong to another running relay, or a stopped relay's lease on them
  has not expired yet;
* 130: stopped by a signal before it was done.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from sqlalchemy import func, select

from mqdedup.cli import exitcodes
from mqdedup.cli.lifecycle import RELAY_COUNTS, say, stop_line
from mqdedup.cli.runners import create_publishers
from mqdedup.db.engine import check_connection, create_engine
from mqdedup.dedup.store import utcnow
from mqdedup.errors import MqdedupError
from mqdedup.outbox.relay import Relay, RelayConfig
from mqdedup.outbox.writer import PENDING
from mqdedup.stopping import ImmediateStop, StopToken


def drain_outbox(settings: dict[str, Any], *, timeout: float, quiet: bool = False) -> int:
    """Publish what is due with one relay, then return the exit code (module docstring)."""
    engine = create_engine(settings["database_url"])
    control_url = settings.get("control_database_url")
    control = create_engine(control_url) if control_url else None
    started = time.monotonic()
    try:
        publishers = create_publishers(
            kafka_bootstrap=settings.get("kafka_bootstrap"),
            rabbitmq_url=settings.get("rabbitmq_url"),
        )
        relay = Relay(
            engine,
            publishers,
            prefix=settings["table_prefix"],
            config=RelayConfig(
                batch_size=settings["relay_batch_size"],
                poll_interval=settings["poll_interval"],
                delete_published=not settings.get("relay_keep_published", False),
                coordination=settings.get("relay_coordination") or "session",
            ),
            control_engine=control,
        )
        stop = StopToken()
        timed_out = threading.Event()

        def _give_up() -> None:
            timed_out.set()
            stop.request()

        timer = threading.Timer(timeout, _give_up)
        timer.daemon = True
        timer.start()
        try:
            metrics = relay.run(stop, until_idle=True, handle_signals=True)
        except ImmediateStop:  # a second signal: at once, nothing more is said
            return exitcodes.INTERRUPTED
        finally:
            timer.cancel()
        code, reason = _outcome(engine, relay, metrics, stop, timed_out.is_set(), timeout)
        if not quiet or code != exitcodes.OK:
            say(
                stop_line(
                    "relay --drain",
                    code,
                    time.monotonic() - started,
                    metrics.snapshot(histograms=False),
                    RELAY_COUNTS,
                    reason,
                )
            )
        return code
    finally:
        engine.dispose()
        if control is not None:
            control.dispose()


def _outcome(
    engine: Any, relay: Relay, metrics: Any, stop: StopToken, timed_out: bool, timeout: float
) -> tuple[int, str]:
    """The exit code and what the stop line adds to the counts."""
    if stop.requested and not timed_out:
        return exitcodes.INTERRUPTED, "; stopped by a signal before the outbox was drained"
    left = _due_rows(engine, relay)
    problems = []
    if metrics.rejected:
        problems.append(
            f"the broker refused {metrics.rejected:,} row(s) (each waits for its retry, or "
            "was marked failed after its last attempt: see mqdedup outbox status)"
        )
    if timed_out:
        outage = f" ({metrics.outage})" if metrics.outage else ""
        problems.append(f"not drained within --drain-timeout {timeout:g}s{outage}")
    if left:
        problems.append(
            f"{left:,} due row(s) left (a broker unavailable, shards of another running "
            "relay, or the lease of a stopped relay not yet expired)"
        )
    if problems:
        return exitcodes.NOT_DRAINED, "; " + "; ".join(problems)
    return exitcodes.OK, "; nothing due left"


def _due_rows(engine: Any, relay: Relay) -> int:
    """Pending rows due now for the relay's brokers (a retry's backoff is not due)."""
    table = relay.store.table
    query = select(func.count()).where(
        table.c.state == PENDING,
        table.c.available_at <= utcnow(),
        table.c.broker.in_(sorted(relay.publishers)),
    )
    try:
        with engine.connect() as connection:
            return int(connection.execute(query).scalar_one())
    except MqdedupError:
        raise
    except Exception:
        check_connection(engine)  # DatabaseUnavailableError (exit 5) when it is away
        raise

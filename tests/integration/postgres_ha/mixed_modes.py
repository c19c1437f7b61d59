"""Relays of one outbox table in different coordination modes (issue 40, part 1).

The three ways a PostgreSQL relay coordinates:

* ``session``: shard locks and ``LISTEN`` on its own direct connection;
* ``control``: statements through PgBouncer (transaction mode), shard locks on a direct
  ``--control-database`` connection;
* ``transaction``: statements through PgBouncer, no session at all (relays take turns).

:func:`run_pair` runs two relays of two modes at once while two writers add keyed rows,
or (``rolling=True``) switches from the first relay to the second under load: the
second starts once a third of the rows is written, the first stops at two thirds. It
returns the broker's copies of each message id and the per-key order problems. Used by
``test_relay_mixed_modes.py`` (1,000 rows) and ``bench/relay_modes_bench.py`` (6,000).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine

from mqdedup.db import create_engine
from mqdedup.outbox import Relay, RelayConfig
from mqdedup.rabbitmq import RabbitMQPublisher
from mqdedup.stopping import StopToken
from tests.integration.outbox.helpers import OutboxDb, order_problems, write_keyed_rows
from tests.services import RabbitAdmin, wait_for

MODES = ("session", "control", "transaction")


@dataclass
class PairResult:
    """What the broker received from one run."""

    modes: tuple[str, str]
    rolling: bool
    rows: int
    published: int
    doubled: int
    order_problems: int

    def line(self) -> str:
        how = "rolling switch" if self.rolling else "together"
        return (
            f"{self.modes[0]:>11} + {self.modes[1]:<11} ({how}): {self.rows} rows, "
            f"{self.published} published, {self.doubled} ids doubled, "
            f"{self.order_problems} per-key order regressions"
        )


def make_relay(
    mode: str, *, direct_url: str, pooled_url: str, prefix: str, rabbitmq_url: str
) -> Relay:
    """A relay of ``mode`` (see the module docstring) on the table of ``prefix``."""
    config = RelayConfig(
        batch_size=50,
        lease=10.0,
        poll_interval=0.05,
        rebalance_interval=0.5,
        coordination="transaction" if mode == "transaction" else "session",
    )
    engine = create_engine(direct_url if mode == "session" else pooled_url)
    control = create_engine(direct_url) if mode == "control" else None
    return Relay(
        engine,
        {"rabbitmq": RabbitMQPublisher(rabbitmq_url)},
        prefix=prefix,
        config=config,
        control_engine=control,
        relay_id=f"{mode}-{id(config):x}",
    )


class RunningRelay:
    """``relay.run`` in a thread, until :meth:`stop`."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.stop_token = StopToken()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name=f"relay-{relay.relay_id}")
        self.thread.start()

    def _run(self) -> None:
        try:
            self.relay.run(self.stop_token)
        except BaseException as error:  # reported by stop()
            self.errors.append(error)

    def stop(self) -> None:
        self.stop_token.request()
        self.thread.join(timeout=120)
        assert not self.thread.is_alive(), "relay did not stop"
        assert not self.errors, self.errors
        engines: list[Engine] = [self.relay.engine]
        engines.extend(e for e in [self._control_engine()] if e is not None)
        for engine in engines:
            engine.dispose()

    def _control_engine(self) -> Engine | None:
        control = getattr(self.relay.coordination, "coordinator", None)
        engine = getattr(control, "engine", None)
        return engine if isinstance(engine, Engine) and engine is not self.relay.engine else None


def run_pair(
    modes: tuple[str, str],
    *,
    direct: OutboxDb,
    pooled: OutboxDb,
    rabbit: RabbitAdmin,
    rabbitmq_url: str,
    keys: int,
    per_key: int,
    rolling: bool = False,
    log: Callable[[str], None] | None = None,
) -> PairResult:
    """Two relays of ``modes`` on one table under two writers (see the module docstring)."""
    queue = rabbit.queue()
    total = keys * per_key

    def relay(mode: str) -> RunningRelay:
        return RunningRelay(
            make_relay(
                mode,
                direct_url=direct.url,
                pooled_url=pooled.url,
                prefix=direct.prefix,
                rabbitmq_url=rabbitmq_url,
            )
        )

    def written_so_far() -> int:
        status = direct.status()
        return status.pending + status.published + status.failed

    written: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    def write() -> None:
        try:
            written.update(
                write_keyed_rows(
                    pooled,
                    {"exchange": "", "routing_key": queue},
                    keys=keys,
                    per_key=per_key,
                    threads=2,
                )
            )
        except BaseException as error:
            errors.append(error)

    first = relay(modes[0])
    second = None if rolling else relay(modes[1])
    writer = threading.Thread(target=write, name="writers")
    writer.start()
    try:
        if rolling:
            wait_for(
                lambda: _counted(direct) >= total // 3 or not writer.is_alive(),
                120,
                "a third written",
            )
            second = relay(modes[1])
            wait_for(
                lambda: _counted(direct) >= 2 * total // 3 or not writer.is_alive(),
                120,
                "two thirds written",
            )
            first.stop()
        writer.join(timeout=300)
        assert not errors, errors
        wait_for(lambda: direct.status().pending == 0, 180, "every row published", interval=0.2)
    finally:
        for running in (first, second):
            if running is not None and running.thread.is_alive():
                running.stop()
    messages = rabbit.drain(queue, total)
    copies = Counter(str(properties.message_id) for properties, _ in messages)
    sequence = [(body["key"], body["seq"]) for body in (json.loads(b) for _, b in messages)]
    every = {message_id for ids in written.values() for message_id in ids}
    assert len(every) == total
    result = PairResult(
        modes=modes,
        rolling=rolling,
        rows=total,
        published=len(set(copies) & every),
        doubled=sum(1 for count in copies.values() if count > 1),
        order_problems=len({problem.split(":")[0] for problem in order_problems(sequence)}),
    )
    if log is not None:
        log(result.line())
    return result


def _counted(db: OutboxDb) -> int:
    """Rows written so far (pending, published or deleted and counted)."""
    from sqlalchemy import func, select

    from mqdedup.outbox.store import OutboxStore

    store = OutboxStore(db.prefix)
    with db.engine.connect() as connection:
        rows = connection.execute(select(func.count()).select_from(store.table)).scalar_one()
        counted = connection.execute(
            select(func.coalesce(func.sum(store.counts.c.published), 0))
        ).scalar_one()
    return int(rows) + int(counted)

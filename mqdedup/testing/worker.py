"""The worker process of the real-broker test kit: ``python -m mqdedup.testing.worker``.

Started by :mod:`mqdedup.testing.brokers`, never by hand. Its configuration is one JSON
object in the ``MQDEDUP_TESTING_WORKER`` environment variable (not on the command line,
where a database password would show in ``ps``):

* ``consumer``: the user's consumer class by reference, ``package.module:Class``;
* ``attributes``: class attributes overriding the user's (topic / queue, group, table
  prefix, ...), applied in a generated subclass: the user's class is not changed;
* ``database_url``; ``sessions`` (optional: ``module:function`` returning the engine
  or session factory to run with, given the URL); ``folder`` (where progress and
  marker files go); ``label``;
* faults: ``hold_after_commit`` (n: after the n-th committed batch of this process,
  before the broker is settled, write ``<label>.held`` and wait to be killed),
  ``hold_mid_batch`` (k: before the (k+1)-th handler call, inside the open transaction,
  write ``<label>.held`` and wait to be killed), ``batch_pause`` (seconds to sleep after
  each commit, so a rebalance finds the worker busy). A held worker also goes on when
  ``<label>.release`` appears (the rebalance fault holds one worker while another
  joins, then releases it).

After each commit the worker rewrites ``<label>.progress`` with the number of messages
committed by this process. It runs ``consumer.run(engine, stop=...)`` under graceful
signal handling, exactly like ``mqdedup worker``: SIGTERM finishes the batch in flight,
settles it and exits 0. An async consumer (``AsyncConsumer``) runs the same way, on
the process's one event loop; its holds wait on that loop (heartbeats go on).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from mqdedup.consumers.async_consumer import AsyncConsumer
from mqdedup.consumers.base import Consumer
from mqdedup.consumers.context import AsyncBatchContext, AsyncContext, BatchContext, Context
from mqdedup.db.engine import create_engine
from mqdedup.errors import ConfigurationError
from mqdedup.logs import configure
from mqdedup.message import Message
from mqdedup.stopping import ImmediateStop, StopToken, graceful_signals

CONFIG_ENV = "MQDEDUP_TESTING_WORKER"
#: How long a held worker waits to be killed before it gives up (a bound, not a timer).
HOLD_SECONDS = 600.0

log = logging.getLogger("mqdedup.testing.plugin.worker")


def load_class(reference: str) -> type[Consumer]:
    """Import ``package.module:Class`` (nested classes as ``Outer.Inner``)."""
    module_name, _, qualname = reference.partition(":")
    if not module_name or not qualname:
        raise ConfigurationError(f"consumer reference {reference!r} is not 'module:Class'")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    if not (isinstance(target, type) and issubclass(target, Consumer)):
        raise ConfigurationError(f"{reference} is not a mqdedup Consumer subclass")
    return target


def _touch(path: Path, text: str) -> None:
    """Write ``text`` atomically (readers never see a half-written file)."""
    partial = path.with_suffix(path.suffix + ".tmp")
    partial.write_text(text)
    partial.replace(path)


def build_consumer_class(config: Mapping[str, Any]) -> type[Consumer]:
    """The user's class with the harness's attributes and fault switches."""
    user_class = load_class(str(config["consumer"]))
    folder = Path(str(config["folder"]))
    label = str(config["label"])
    hold_after_commit = config.get("hold_after_commit")
    hold_mid_batch = config.get("hold_mid_batch")
    batch_pause = float(config.get("batch_pause") or 0.0)
    state = {"committed": 0, "commits": 0, "handled": 0}

    def holding(moment: str) -> Path:
        _touch(folder / f"{label}.held", moment)
        log.warning("holding to be killed", extra={"moment": moment, "label": label})
        return folder / f"{label}.release"

    def hold(moment: str) -> None:
        release = holding(moment)
        deadline = time.monotonic() + HOLD_SECONDS
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    async def hold_async(moment: str) -> None:  # the event loop (heartbeats) keeps running
        release = holding(moment)
        deadline = time.monotonic() + HOLD_SECONDS
        while not release.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def must_hold_mid_batch(messages: int) -> bool:
        held = hold_mid_batch is not None and state["handled"] + messages > int(hold_mid_batch)
        state["handled"] += messages
        return held

    def must_hold_after_commit(messages: Sequence[Message]) -> bool:
        state["commits"] += 1
        state["committed"] += len(messages)
        _touch(folder / f"{label}.progress", str(state["committed"]))
        return hold_after_commit is not None and state["commits"] == int(hold_after_commit)

    class Harnessed(user_class):  # type: ignore[valid-type,misc]
        def handle(self, message: Message, ctx: Context) -> Any:
            if must_hold_mid_batch(1):
                hold("mid-batch")
            return super().handle(message, ctx)

        def handle_batch(
            self, messages: Sequence[Message], ctx: BatchContext
        ) -> Mapping[str, Any] | None:
            if must_hold_mid_batch(len(messages)):
                hold("mid-batch")
            results: Mapping[str, Any] | None = super().handle_batch(messages, ctx)
            return results

        def after_commit(self, messages: Sequence[Message]) -> None:
            super().after_commit(messages)
            if must_hold_after_commit(messages):
                hold("after-commit")
            if batch_pause:
                time.sleep(batch_pause)

    class AsyncHarnessed(user_class):  # type: ignore[valid-type,misc]
        async def handle(self, message: Message, ctx: AsyncContext) -> Any:
            if must_hold_mid_batch(1):
                await hold_async("mid-batch")
            return await super().handle(message, ctx)

        async def handle_batch(
            self, messages: Sequence[Message], ctx: AsyncBatchContext
        ) -> Mapping[str, Any] | None:
            if must_hold_mid_batch(len(messages)):
                await hold_async("mid-batch")
            results: Mapping[str, Any] | None = await super().handle_batch(messages, ctx)
            return results

        async def after_commit(self, messages: Sequence[Message]) -> None:
            await super().after_commit(messages)
            if must_hold_after_commit(messages):
                await hold_async("after-commit")
            if batch_pause:
                await asyncio.sleep(batch_pause)

    harnessed: type[Consumer] = AsyncHarnessed if user_class.asynchronous else Harnessed
    # Keep the user's handler choice: only wrap the handler(s) the user implemented.
    base = AsyncConsumer if user_class.asynchronous else Consumer
    if user_class.handle is base.handle:
        del harnessed.handle
    if user_class.handle_batch is base.handle_batch:
        del harnessed.handle_batch
    # Typed bodies: the wrappers take what the user's handlers take (their annotations).
    for method in ("handle", "handle_batch"):
        if method in vars(harnessed):
            vars(harnessed)[method].__wrapped__ = getattr(user_class, method)
    for name, value in dict(config.get("attributes") or {}).items():
        setattr(harnessed, name, value)
    harnessed.__name__ = harnessed.__qualname__ = user_class.__name__
    return harnessed


def main() -> int:
    """Run the configured consumer until SIGTERM; 130 after an immediate stop."""

    config: dict[str, Any] = json.loads(os.environ[CONFIG_ENV])
    configure(str(config.get("log_level") or "WARNING"))
    logging.getLogger("kafka").setLevel(logging.WARNING)
    logging.getLogger("pika").setLevel(logging.WARNING)
    # ``sessions``: ``module:function`` giving the database from the URL (mqdedup.django's
    # runs the consumer on Django's connection); default: an engine of the URL.
    # First: it may set up what the consumer's module needs to import (Django's apps).
    sessions = config.get("sessions")
    database = (
        _load_object(str(sessions))(str(config["database_url"]))
        if sessions
        else create_engine(str(config["database_url"]))
    )
    consumer = build_consumer_class(config)()
    stop = StopToken()
    _touch(Path(str(config["folder"])) / f"{config['label']}.started", str(os.getpid()))
    try:
        with graceful_signals(stop):
            consumer.run(database, stop=stop)
    except ImmediateStop:
        return 130
    finally:
        if isinstance(database, Engine):
            database.dispose()
    return 0


def _load_object(reference: str) -> Any:
    """Import ``package.module:name``."""
    module_name, _, name = reference.partition(":")
    return getattr(importlib.import_module(module_name), name)


if __name__ == "__main__":
    sys.exit(main())

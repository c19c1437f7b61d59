"""The real-broker half of the test kit: your consumer class in real worker processes.

:class:`KafkaHarness` and :class:`RabbitMQHarness` run a user's ``KafkaConsumer`` /
``RabbitMQConsumer`` subclass, unchanged, against a real broker and a real database:

* a fresh topic (3 partitions) and consumer group, or a fresh queue, per harness, and a
  fresh table prefix for mqdedup's own tables; they are applied to a generated subclass
  in the worker process, so the user's class keeps its production settings;
* ``publish`` / ``deliver_each_twice`` produce to the real broker (a second send of the
  same message is exactly what a retrying producer does);
* each ``run_*`` starts ``python -m mqdedup.testing.worker`` (the same
  ``consumer.run(engine, stop=...)`` as ``mqdedup worker``) and ``kill -9``\\ s it at
  the dangerous moments, or stops it with SIGTERM once the work is done;
* ``run_relay`` publishes the outbox rows with the real relay, and ``read_topic`` /
  ``read_queue`` return what arrived downstream (see
  :func:`mqdedup.testing.plugin.downstream_effects`).

The consumer class must be importable by reference (``module:Class``, i.e. defined at
module level), because the worker processes import it. ``kafka`` / ``pika`` are
imported only when a Kafka / RabbitMQ harness is used.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from mqdedup.consumers.base import Consumer
from mqdedup.db.engine import create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.errors import ConfigurationError
from mqdedup.outbox import Relay, RelayConfig
from mqdedup.testing.effects import DownstreamMessage
from mqdedup.testing.worker import CONFIG_ENV, load_class

log = logging.getLogger("mqdedup.testing.plugin")

#: The session timeout a harness asks for where the broker allows it: a killed worker's
#: partitions move on after this long.
FAST_SESSION_TIMEOUT_MS = 3000


def fast_kafka_group(admin: Any) -> dict[str, Any]:
    """Fast failure detection for a harness's workers: a 3 s session, or the broker's
    ``group.min.session.timeout.ms`` where that is longer (Kafka's default is 6 s)."""
    from mqdedup.kafka.tools import min_session_timeout_ms

    session = max(FAST_SESSION_TIMEOUT_MS, min_session_timeout_ms(admin))
    return {"session_timeout_ms": session, "heartbeat_interval_ms": 1000}


class HarnessError(AssertionError):
    """A harness step did not happen (a worker died, a wait timed out)."""


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` until it is true; :class:`HarnessError` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def class_reference(consumer_class: type[Consumer]) -> str:
    """``module:Class`` for ``consumer_class``; ConfigurationError if not importable."""
    reference = f"{consumer_class.__module__}:{consumer_class.__qualname__}"
    if "<locals>" in reference:
        raise ConfigurationError(
            f"{consumer_class.__name__} must be defined at module level: worker processes "
            "import it by reference"
        )
    try:
        found = load_class(reference)
    except (ImportError, AttributeError, ConfigurationError) as exc:
        raise ConfigurationError(f"consumer {reference} cannot be imported: {exc}") from exc
    if found is not consumer_class:
        raise ConfigurationError(f"{reference} does not import as the class given")
    return reference


def unique_name(kind: str) -> str:
    """A topic / queue / group name no other test run uses."""
    return f"mqdedup-test-{kind}-{uuid.uuid4().hex[:10]}"


class WorkerProcess:
    """One ``python -m mqdedup.testing.worker`` process."""

    def __init__(self, config: Mapping[str, Any], folder: Path, label: str) -> None:
        self.label = label
        self.folder = folder
        self.log_path = folder / f"{label}.log"
        path = [entry or os.getcwd() for entry in sys.path]
        env = {
            **os.environ,
            CONFIG_ENV: json.dumps({**config, "folder": str(folder), "label": label}),
            "PYTHONPATH": os.pathsep.join(path),
        }
        with self.log_path.open("ab") as output:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "mqdedup.testing.worker"],
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT,
            )

    def file(self, suffix: str) -> Path:
        """``<folder>/<label>.<suffix>``: ``held``, ``progress``, ``started``."""
        return self.folder / f"{self.label}.{suffix}"

    @property
    def committed(self) -> int:
        """Messages this process committed so far."""
        try:
            return int(self.file("progress").read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.process.poll() is None

    def ensure_alive(self) -> None:
        """HarnessError with the log's tail if the process has exited."""
        code = self.process.poll()
        if code is not None:
            raise HarnessError(f"worker {self.label} exited with {code}:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL (``kill -9``): no cleanup at all, exactly like a crash."""
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful stop: finish and settle the batch in flight); the exit code."""
        if self.alive:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise HarnessError(f"worker {self.label} did not stop within {timeout:.0f}s") from None

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the worker's output."""
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class BrokerHarness:
    """What both real-broker harnesses share (:class:`KafkaHarness`, :class:`RabbitMQHarness`)."""

    broker = ""

    def __init__(
        self,
        consumer_class: type[Consumer],
        database_url: str,
        folder: Path,
        *,
        attributes: Mapping[str, Any] | None = None,
        timeout: float = 120.0,
        sessions: str | None = None,
    ) -> None:
        self.consumer_class = consumer_class
        #: ``module:function`` the workers get their database from (see testing.worker).
        self.sessions = sessions
        self.reference = class_reference(consumer_class)
        self.database_url = database_url
        self.folder = folder
        self.timeout = timeout
        #: mqdedup's own tables of this harness: ``<prefix>processed_messages``, ...
        self.prefix = f"t{uuid.uuid4().hex[:8]}_"
        self.attributes: dict[str, Any] = {"table_prefix": self.prefix, "poll_timeout": 0.2}
        self.user_attributes = dict(attributes or {})
        self.engine: Engine = create_engine(database_url)
        init_schema(self.engine, self.prefix)
        #: Message ids published (each once, whatever the copies).
        self.ids: list[str] = []
        self.kills = 0
        self.workers: list[WorkerProcess] = []
        self._sent: list[tuple[bytes, str | None, Mapping[str, str], bytes | None]] = []

    # -- publishing --------------------------------------------------------------------------

    def publish(
        self,
        payload: bytes | str | Mapping[str, Any] | Sequence[Any],
        *,
        message_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        key: bytes | None = None,
    ) -> None:
        """Send one message to the harness's topic / queue; dicts and lists as JSON."""
        body = payload if isinstance(payload, bytes | str) else json.dumps(payload)
        data = body.encode() if isinstance(body, str) else body
        self._send([(data, message_id, dict(headers or {}), key)])
        self._sent.append((data, message_id, dict(headers or {}), key))
        if message_id is not None:
            self.ids.append(message_id)

    def deliver_each_twice(self) -> int:
        """Send every message published so far once more (a retrying producer)."""
        self._send(list(self._sent))
        return len(self._sent)

    def _send(
        self, messages: Sequence[tuple[bytes, str | None, Mapping[str, str], bytes | None]]
    ) -> None:
        raise NotImplementedError

    # -- running -----------------------------------------------------------------------------

    def start_worker(self, label: str | None = None, **faults: Any) -> WorkerProcess:
        """Start a worker process of the consumer (faults: see :mod:`mqdedup.testing.worker`)."""
        label = label or f"worker{len(self.workers) + 1}"
        config = {
            "consumer": self.reference,
            "attributes": {**self.attributes, **self.user_attributes},
            "database_url": self.database_url,
            "sessions": self.sessions,
            **faults,
        }
        worker = WorkerProcess(config, self.folder, label)
        self.workers.append(worker)
        return worker

    def run_killing_after_commit(self, times: int = 1, *, at_commit: int = 1) -> int:
        """``times`` rounds: a worker commits ``at_commit`` batches of new messages and is
        killed with ``kill -9`` before the broker is settled (no ack / no offset commit).
        Returns the kills done: fewer when the new messages ran out (a round that finds
        only duplicates left is stopped gracefully)."""
        done = 0
        for _ in range(times):
            if self.drained() or not self._kill_when_held(
                self.start_worker(hold_after_commit=at_commit)
            ):
                break
            done += 1
        return done

    def run_killing_mid_batch(self, after_messages: int) -> bool:
        """A worker is killed with ``kill -9`` inside a batch's open transaction, after
        ``after_messages`` handler calls. False when no new message was left."""
        if self.drained():
            return False
        return self._kill_when_held(self.start_worker(hold_mid_batch=after_messages))

    def _nothing_left(self, worker: WorkerProcess) -> bool:
        """True when ``worker`` will find no more work (checked every 2 s)."""
        return self.drained()

    def _wait(self, worker: WorkerProcess, condition: Callable[[], bool], what: str) -> None:
        """Wait for ``condition`` (or the worker's exit, which is an error)."""
        wait_for(lambda: condition() or not worker.alive, self.timeout, what)
        worker.ensure_alive()

    def _kill_when_held(self, worker: WorkerProcess) -> bool:
        """Kill ``worker`` at its fault point; False (and a graceful stop) if the work
        ran out before it got there."""
        deadline = time.monotonic() + self.timeout
        next_check = time.monotonic() + 2.0
        while not worker.file("held").exists():
            worker.ensure_alive()
            if time.monotonic() > next_check:
                if self._nothing_left(worker):
                    if worker.terminate() != 0:
                        raise HarnessError(f"worker {worker.label} failed:\n{worker.log_tail()}")
                    return False
                next_check = time.monotonic() + 2.0
            if time.monotonic() > deadline:
                raise HarnessError(f"timed out waiting for {worker.label} to reach the fault")
            time.sleep(0.05)
        worker.kill()
        self.kills += 1
        return True

    def run_until_drained(self) -> None:
        """Run a worker until everything is processed and settled, then SIGTERM it."""
        for attempt in range(3):
            worker = self.start_worker(label=f"drain{len(self.workers) + 1}")
            try:
                self._wait(worker, self.drained, "the drain")
                worker.ensure_alive()
            finally:
                code = worker.terminate()
            if code != 0:
                raise HarnessError(
                    f"worker {worker.label} exited with {code}:\n{worker.log_tail()}"
                )
            if self.drained():
                return
            log.info("work left after a graceful stop; draining again", extra={"attempt": attempt})
        raise HarnessError("the topic / queue was not drained after three workers")

    def drained(self) -> bool:
        """True when every message is processed and settled on the broker."""
        raise NotImplementedError

    def publishers(self) -> dict[str, Any]:
        """The relay's publishers for this broker."""
        raise NotImplementedError

    def run_relay(self, timeout: float = 60.0) -> int:
        """Publish this harness's committed outbox rows with the real relay; rows published."""

        relay = Relay(
            self.engine,
            self.publishers(),
            prefix=self.prefix,
            config=RelayConfig(poll_interval=0.1, listen=False),
        )
        try:
            return int(relay.drain(timeout).snapshot().get("published", 0))
        finally:
            relay.close()

    def close(self) -> None:
        """Kill leftover workers, drop this harness's framework tables."""
        for worker in self.workers:
            if worker.alive:
                worker.kill()
        with contextlib.suppress(Exception):  # cleanup only
            schema(self.prefix).metadata.drop_all(self.engine)
        self.engine.dispose()


class KafkaHarness(BrokerHarness):
    """A Kafka consumer class on a fresh topic and group of a real broker."""

    broker = "kafka"

    def __init__(
        self,
        consumer_class: type[Consumer],
        database_url: str,
        folder: Path,
        *,
        bootstrap: str,
        partitions: int = 3,
        attributes: Mapping[str, Any] | None = None,
        timeout: float = 120.0,
        sessions: str | None = None,
    ) -> None:
        from mqdedup.kafka import tools as kafka_tools  # lazy: the kafka extra

        super().__init__(
            consumer_class,
            database_url,
            folder,
            attributes=attributes,
            timeout=timeout,
            sessions=sessions,
        )
        self._kafka = kafka_tools
        self.bootstrap = bootstrap
        self.admin = kafka_tools.admin_client(bootstrap)
        self.topics: list[str] = []
        self.topic = self.create_topic("in", partitions)
        self.group = unique_name("group")
        user_config = dict(getattr(consumer_class, "kafka_config", {}) or {})
        self.attributes.update(
            topics=[self.topic],
            group_id=self.group,
            bootstrap_servers=bootstrap,
            kafka_config={**user_config, **fast_kafka_group(self.admin)},
        )
        self._producer: Any = None

    def create_topic(self, kind: str = "out", partitions: int = 3) -> str:
        """Create a fresh topic (deleted at close); e.g. the one your consumer writes to."""
        name = unique_name(kind)
        self.admin.create_topics({name: {"num_partitions": partitions}}, wait_for_metadata=True)
        self.topics.append(name)
        return name

    def _send(
        self, messages: Sequence[tuple[bytes, str | None, Mapping[str, str], bytes | None]]
    ) -> None:
        if self._producer is None:
            self._producer = self._kafka.producer(self.bootstrap)
        for body, message_id, headers, key in messages:
            pairs = [(name, value.encode()) for name, value in headers.items()]
            if message_id is not None:
                pairs.append(("message-id", message_id.encode()))
            self._producer.send(self.topic, value=body, key=key, headers=pairs)
        self._producer.flush(timeout=60)

    def _offsets(self) -> tuple[dict[int, int], dict[int, int]]:
        return self._kafka.group_offsets(self.bootstrap, self.group, self.topic)

    def drained(self) -> bool:
        """The group's committed offsets reached the end of every partition."""
        committed, ends = self._offsets()
        return committed == ends

    def run_with_rebalance(self, batch_pause: float = 0.1) -> dict[str, int]:
        """Force two rebalances that move partitions between live workers.

        A first worker commits one batch and is held there (its batch committed in the
        database, its offsets not yet committed); a second process joins the group, is
        assigned partitions and commits new messages from them; the first is released;
        the second leaves (SIGTERM: a second rebalance hands its partitions back), and
        the first stops too. Raises HarnessError if the second worker never got work
        (the rebalance moved nothing). Returns messages committed per worker.
        """
        first = self.start_worker(
            label=f"first{len(self.workers) + 1}", hold_after_commit=1, batch_pause=batch_pause
        )
        self._wait(first, lambda: first.file("held").exists(), "the first worker's batch")
        second = self.start_worker(label=f"second{len(self.workers) + 1}", batch_pause=batch_pause)
        self._wait(second, lambda: second.committed > 0, "the second worker to get partitions")
        first.file("release").touch()
        codes = {second.label: second.terminate()}
        codes[first.label] = first.terminate()
        if any(codes.values()):
            raise HarnessError(
                f"workers exited with {codes}:\n{first.log_tail()}\n{second.log_tail()}"
            )
        return {"first": first.committed, "second": second.committed}

    def read_topic(self, topic: str, at_least: int = 0, timeout: float = 30.0) -> list[Any]:
        """Every record of ``topic`` as :class:`~mqdedup.testing.effects.DownstreamMessage`
        (waits for ``at_least`` of them, then for a quiet second)."""
        records = self._kafka.read_topic(
            self.bootstrap, topic, at_least=at_least, timeout=timeout, wait_for=wait_for
        )
        return [DownstreamMessage.from_headers(value, headers) for value, headers in records]

    def publishers(self) -> dict[str, Any]:
        from mqdedup.kafka.publisher import KafkaPublisher  # lazy: the kafka extra

        return {"kafka": KafkaPublisher(self.bootstrap)}

    def close(self) -> None:
        """Workers, tables, then the topics this harness created (and their ``.DLT``)."""
        super().close()
        if self._producer is not None:
            self._producer.close(timeout=5)
        with contextlib.suppress(Exception):  # cleanup only
            existing = set(self.admin.list_topics())
            doomed = [t for t in self.topics + [f"{t}.DLT" for t in self.topics] if t in existing]
            if doomed:
                self.admin.delete_topics(doomed)
        self.admin.close()


class RabbitMQHarness(BrokerHarness):
    """A RabbitMQ consumer class on a fresh queue (and dead-letter queue) of a real broker."""

    broker = "rabbitmq"

    def __init__(
        self,
        consumer_class: type[Consumer],
        database_url: str,
        folder: Path,
        *,
        url: str,
        attributes: Mapping[str, Any] | None = None,
        timeout: float = 120.0,
        sessions: str | None = None,
    ) -> None:
        from mqdedup.rabbitmq import tools as rabbitmq_tools  # lazy: the rabbitmq extra
        from mqdedup.rabbitmq.topology import declare_topology  # lazy: the rabbitmq extra

        super().__init__(
            consumer_class,
            database_url,
            folder,
            attributes=attributes,
            timeout=timeout,
            sessions=sessions,
        )
        self.url = url
        self.queue = unique_name("in")
        self.queues: list[str] = [self.queue, f"{self.queue}.dlq"]
        self.attributes.update(queue=self.queue, url=url, dead_letter_queue=f"{self.queue}.dlq")
        self._rabbitmq = rabbitmq_tools
        self.connection, self.channel = rabbitmq_tools.confirm_channel(url, "mqdedup-testing")
        consumer_type = type(
            "Declared", (consumer_class,), dict(self.attributes, **self.user_attributes)
        )
        declare_topology(self.channel, consumer_type().topology())

    def declare_queue(self, kind: str = "out") -> str:
        """Declare a fresh durable queue (deleted at close); e.g. one your consumer writes to."""
        name = unique_name(kind)
        self.channel.queue_declare(name, durable=True)
        self.queues.append(name)
        return name

    def _send(
        self, messages: Sequence[tuple[bytes, str | None, Mapping[str, str], bytes | None]]
    ) -> None:
        for body, message_id, headers, _key in messages:
            properties = self._rabbitmq.persistent_properties(message_id, headers)
            self.channel.basic_publish("", self.queue, body, properties, mandatory=True)

    def _kill_when_held(self, worker: WorkerProcess) -> bool:
        killed = super()._kill_when_held(worker)
        # The broker requeues the dead worker's unacked deliveries when it notices the
        # closed connection: wait for that before looking at the queue again.
        wait_for(
            lambda: self.consumers() == 0, self.timeout, "the broker to drop the killed worker"
        )
        return killed

    def _nothing_left(self, worker: WorkerProcess) -> bool:
        return self.waiting() == 0

    def consumers(self) -> int:
        """Consumers attached to the consumer's queue."""
        declared = self.channel.queue_declare(self.queue, passive=True)
        return int(declared.method.consumer_count)

    def waiting(self, queue: str | None = None) -> int:
        """Ready messages in ``queue`` (default: the consumer's queue)."""
        declared = self.channel.queue_declare(queue or self.queue, passive=True)
        return int(declared.method.message_count)

    def drained(self) -> bool:
        """Nothing ready in the queue and no worker holding unacked deliveries."""
        return self.waiting() == 0 and not any(w.alive for w in self.workers)

    def run_until_drained(self) -> None:
        """Run a worker until the queue is empty, SIGTERM it; again if deliveries came back."""
        for _ in range(3):
            worker = self.start_worker(label=f"drain{len(self.workers) + 1}")
            try:
                self._wait(worker, lambda: self.waiting() == 0, "the drain")
                worker.ensure_alive()
                # Ready is 0; wait until the worker's last commits stop moving.
                last = -1
                while worker.committed != last:
                    last = worker.committed
                    time.sleep(0.5)
            finally:
                code = worker.terminate()
            if code != 0:
                raise HarnessError(
                    f"worker {worker.label} exited with {code}:\n{worker.log_tail()}"
                )
            if self.drained():
                return
        raise HarnessError("the queue was not drained after three workers")

    def read_queue(self, queue: str, at_least: int = 0, timeout: float = 30.0) -> list[Any]:
        """Take every message of ``queue`` (as
        :class:`~mqdedup.testing.effects.DownstreamMessage`)."""
        found: list[Any] = []
        deadline = time.monotonic() + timeout
        while True:
            method, properties, body = self.channel.basic_get(queue, auto_ack=True)
            if method is None:
                if len(found) >= at_least or time.monotonic() > deadline:
                    return found
                time.sleep(0.1)
                continue
            headers = {k: v for k, v in (properties.headers or {}).items()}
            if properties.message_id is not None:
                headers.setdefault("message-id", properties.message_id)
            found.append(DownstreamMessage.from_headers(body, headers))

    def publishers(self) -> dict[str, Any]:
        from mqdedup.rabbitmq.publisher import RabbitMQPublisher  # lazy: the rabbitmq extra

        return {"rabbitmq": RabbitMQPublisher(self.url)}

    def close(self) -> None:
        """Workers, tables, then the queues this harness declared."""
        super().close()
        with contextlib.suppress(Exception):  # cleanup only
            for queue in self.queues:
                self.channel.queue_delete(queue)
        with contextlib.suppress(Exception):
            self.connection.close()

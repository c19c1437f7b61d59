"""The services the tests use, in one place: where they are, fresh names, admin tools.

Every suite (unit, contract, integration, acceptance) reaches PostgreSQL, MariaDB,
Redis, Kafka and RabbitMQ through this module and the fixtures of ``tests/conftest.py``:

* ``require_service`` skips a test locally when a service is missing, and fails it in
  CI (a missing service must never pass silently there); ``require_module`` does the
  same for a module of an installed extra (``scripts/test.sh`` installs every extra);
* ``unique_name`` / ``table_prefix`` give each test its own topics, queues and tables,
  so parallel runs (other engineers, other sessions) on the shared services never
  collide;
* :class:`KafkaHelper` and :class:`RabbitAdmin` create, fill and read topics and queues
  and delete what they created; :func:`prefixed_database` gives a test its own framework
  and business tables in a shared database;
* :class:`PrivateService` starts a PRIVATE instance (own port and state dir) for tests
  that stop, kill or reconfigure a broker: the shared instances are never touched.

kafka-python and pika are imported where they are used, so the unit tests import
neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Any, NoReturn

import pytest
from sqlalchemy import Engine, MetaData

from mqdedup.db import check_connection, create_engine, init_schema
from mqdedup.db.schema import schema
from mqdedup.errors import DatabaseUnavailableError, MqdedupError

REPO = Path(__file__).resolve().parent.parent
SERVICES = REPO / "scripts" / "services.sh"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

PG_URL_ENV = "MQDEDUP_TEST_DATABASE_URL"
MARIADB_URL_ENV = "MQDEDUP_TEST_MARIADB_URL"
REDIS_URL_ENV = "MQDEDUP_REDIS_URL"
KAFKA_BOOTSTRAP_ENV = "MQDEDUP_KAFKA_BOOTSTRAP"
RABBITMQ_URL_ENV = "MQDEDUP_RABBITMQ_URL"


# -- finding the services --------------------------------------------------------------------


def require_service(name: str, reason: str) -> NoReturn:
    """Skip locally, fail in CI: a missing service must never pass silently there."""
    if IN_CI:
        pytest.fail(f"{name} is required in CI but unavailable: {reason}")
    pytest.skip(f"{name} unavailable: {reason}")


#: Modules a CI run may lack, and why: their tests skip there too (the only skips allowed
#: under ``CI=true`` besides the documentation blocks of ``test_docs_commands.ALLOWED_SKIPS``).
CI_OPTIONAL_MODULES: dict[str, str] = {
    "grimp": (
        "import-linter's dependency (the dev extra): the minimum-versions run "
        "(scripts/min_versions.sh) installs no linters; scripts/test.sh runs lint-imports"
    ),
}


def require_module(name: str) -> Any:
    """Import ``name``; if it is missing, skip locally and fail in CI.

    ``pytest.importorskip`` would skip in CI too, and hide a promise's test behind an
    extra that failed to install. Only the modules of :data:`CI_OPTIONAL_MODULES` skip
    there, with their reason.
    """
    try:
        return importlib.import_module(name)
    except ImportError as error:
        root = name.split(".", maxsplit=1)[0]
        if IN_CI and root not in CI_OPTIONAL_MODULES:
            pytest.fail(f"{name} is required in CI but cannot be imported: {error}")
        reason = CI_OPTIONAL_MODULES.get(root, "an extra that is not installed")
        pytest.skip(f"{name} cannot be imported ({reason}): {error}", allow_module_level=True)


def service_env(variable: str, name: str) -> str:
    """The value of ``variable`` (a service's address), or skip / fail naming it."""
    value = os.environ.get(variable)
    if not value:
        require_service(name, f"{variable} is not set")
    return value


#: Environment variable that hands :func:`kill_session_timeout_ms`'s answer to the consumer
#: classes of worker subprocesses (read at their import).
KAFKA_SESSION_TIMEOUT_ENV = "MQDEDUP_TEST_KAFKA_SESSION_TIMEOUT_MS"


def kill_session_timeout_ms(bootstrap: str) -> int:
    """``session_timeout_ms`` for consumers that a test kills with ``kill -9``.

    The group keeps a killed member until its session times out, and the next worker
    waits that long for its partitions. Brokers refuse sessions below their
    ``group.min.session.timeout.ms`` (Kafka's default 6 s; ``scripts/services.sh`` sets
    1 s), so: 3 s where the broker allows it, else its minimum (the test kit's rule).
    """
    if bootstrap not in _KILL_SESSION_TIMEOUTS:
        from mqdedup.kafka.tools import admin_client
        from mqdedup.testing.brokers import fast_kafka_group

        admin = admin_client(bootstrap)
        try:
            _KILL_SESSION_TIMEOUTS[bootstrap] = fast_kafka_group(admin)["session_timeout_ms"]
        finally:
            admin.close()
    return _KILL_SESSION_TIMEOUTS[bootstrap]


_KILL_SESSION_TIMEOUTS: dict[str, int] = {}


def kafka_bootstrap() -> str:
    """The shared Kafka (``MQDEDUP_KAFKA_BOOTSTRAP``), checked to answer."""
    import kafka
    from kafka.errors import KafkaError

    bootstrap = service_env(KAFKA_BOOTSTRAP_ENV, "Kafka")
    try:
        kafka.KafkaAdminClient(bootstrap_servers=bootstrap, bootstrap_timeout_ms=5000).close()
    except KafkaError:
        require_service("Kafka", f"no broker answers at {bootstrap}")
    return bootstrap


def rabbitmq_url() -> str:
    """The shared RabbitMQ (``MQDEDUP_RABBITMQ_URL``), checked to answer."""
    from mqdedup.rabbitmq.topology import check_broker

    url = service_env(RABBITMQ_URL_ENV, "RabbitMQ")
    try:
        check_broker(url)
    except MqdedupError as error:
        require_service("RabbitMQ", str(error))
    return url


def checked_engine(url: str, service: str, **engine_options: Any) -> Engine:
    """An engine on ``url`` that answers, or skip / fail naming ``service``."""
    engine = create_engine(url, **engine_options)
    try:
        check_connection(engine)
    except DatabaseUnavailableError as error:
        engine.dispose()
        require_service(service, str(error))
    return engine


# -- fresh names -----------------------------------------------------------------------------


def unique_name(kind: str) -> str:
    """A topic / queue name no other test (or engineer) uses."""
    return f"t-{kind}-{uuid.uuid4().hex[:10]}"


def table_prefix() -> str:
    """A table prefix of this test's own (``t_<uuid8>_``)."""
    return f"t_{uuid.uuid4().hex[:8]}_"


@dataclass(frozen=True)
class TestDatabase:
    """A shared database with this test's own framework tables (``prefix``)."""

    __test__ = False  # not a pytest class
    url: str
    engine: Engine
    prefix: str


@contextlib.contextmanager
def prefixed_database(
    url: str,
    service: str,
    business: MetaData | None = None,
    *,
    prefix: str | None = None,
    **engine_options: Any,
) -> Iterator[TestDatabase]:
    """The database at ``url`` with fresh framework tables and ``business`` tables.

    Everything is created under a fresh prefix and dropped afterwards.
    """
    engine = checked_engine(url, service, **engine_options)
    prefix = prefix or table_prefix()
    init_schema(engine, prefix)
    if business is not None:
        business.create_all(engine)
    try:
        yield TestDatabase(url=url, engine=engine, prefix=prefix)
    finally:
        if business is not None:
            business.drop_all(engine)
        schema(prefix).metadata.drop_all(engine)
        engine.dispose()


# -- waiting ---------------------------------------------------------------------------------


def wait_for(
    condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05
) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def wait_for_on_loop(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """:func:`wait_for` for a test running on an event loop: polls with ``asyncio.sleep``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


# -- Kafka -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outgoing:
    """A Kafka record to produce: ``message_id=None`` sends no ``message-id`` header."""

    message_id: str | None
    body: bytes
    key: bytes | None = None
    partition: int | None = None
    headers: tuple[tuple[str, bytes], ...] = ()


def kafka_headers(record: Any) -> dict[str, str]:
    """A consumed Kafka record's headers as text."""
    return {name: value.decode() for name, value in record.headers}


class KafkaHelper:
    """Topics, producing and reading on one Kafka broker; created topics (and their
    ``.DLT`` topics) are deleted at the end."""

    def __init__(self, bootstrap: str) -> None:
        import kafka

        self.bootstrap = bootstrap
        self.admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=15000)
        self.created: list[str] = []
        self._producer: Any = None

    def close(self, *, delete_topics: bool = True) -> None:
        """Disconnect; delete the topics this helper created unless told not to."""
        if self._producer is not None:
            self._producer.close(timeout=5)
        if not delete_topics:
            self.admin.close()
            return
        with contextlib.suppress(Exception):  # cleanup only
            existing = set(self.admin.list_topics())
            doomed = [t for t in self.created if t in existing]
            doomed += [f"{t}.DLT" for t in self.created if f"{t}.DLT" in existing]
            if doomed:
                self.admin.delete_topics(doomed, raise_errors=False)
        self.admin.close()

    def create_topic(
        self,
        partitions: int = 3,
        kind: str = "orders",
        name: str | None = None,
        config: dict[str, str] | None = None,
    ) -> str:
        name = name or unique_name(kind)
        spec: dict[str, Any] = {"num_partitions": partitions}
        if config:
            spec["configs"] = config
        self.admin.create_topics({name: spec}, wait_for_metadata=True)
        self.created.append(name)
        return name

    @property
    def producer(self) -> Any:
        import kafka

        if self._producer is None:
            self._producer = kafka.KafkaProducer(
                bootstrap_servers=self.bootstrap, acks="all", linger_ms=5
            )
        return self._producer

    def _send(self, topic: str, message: Outgoing) -> Any:
        headers = list(message.headers)
        if message.message_id is not None:
            headers.insert(0, ("message-id", message.message_id.encode()))
        return self.producer.send(
            topic,
            key=message.key,
            value=message.body,
            headers=headers,
            partition=message.partition,
        )

    def produce(self, topic: str, messages: Iterable[Outgoing]) -> int:
        count = 0
        for message in messages:
            self._send(topic, message)
            count += 1
        self.producer.flush(timeout=60)
        return count

    def produce_positions(
        self, topic: str, messages: Iterable[Outgoing]
    ) -> dict[str, list[tuple[int, int]]]:
        """Produce and return ``message id -> [(partition, offset), ...]``."""
        sent = [(message.message_id, self._send(topic, message)) for message in messages]
        self.producer.flush(timeout=60)
        positions: dict[str, list[tuple[int, int]]] = {}
        for message_id, future in sent:
            metadata = future.get(timeout=30)
            positions.setdefault(message_id or "", []).append((metadata.partition, metadata.offset))
        return positions

    def _consumer(self, group: str | None = None) -> Any:
        import kafka

        return kafka.KafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )

    def end_offsets(self, topic: str) -> dict[int, int]:
        from kafka.structs import TopicPartition

        consumer = self._consumer()
        try:
            partitions = sorted(consumer.partitions_for_topic(topic) or ())
            found = consumer.end_offsets([TopicPartition(topic, p) for p in partitions])
            return {tp.partition: offset for tp, offset in found.items()}
        finally:
            consumer.close()

    def committed(self, group: str, topic: str) -> dict[int, int | None]:
        """The group's committed offset per partition (None: nothing committed)."""
        from kafka.structs import TopicPartition

        consumer = self._consumer(group)  # never subscribes: does not join the group
        try:
            partitions = sorted(consumer.partitions_for_topic(topic) or ())
            return {p: consumer.committed(TopicPartition(topic, p)) for p in partitions}
        finally:
            consumer.close()

    def read_all(self, topic: str, expected: int, timeout: float = 60.0) -> list[Any]:
        """Every record of ``topic`` in partition order (waits for ``expected`` of them)."""
        from kafka.structs import TopicPartition

        consumer = self._consumer()
        try:
            wait_for(lambda: bool(consumer.partitions_for_topic(topic)), 30, f"topic {topic}")
            partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
            consumer.assign(partitions)
            consumer.seek_to_beginning(*partitions)
            records: list[Any] = []
            deadline = time.monotonic() + timeout
            while len(records) < expected and time.monotonic() < deadline:
                for batch in consumer.poll(timeout_ms=200).values():
                    records.extend(batch)
            # Anything beyond the expected count must show up too: read to the end offsets
            # (one more poll returns at most a poll's worth of them).
            ends = consumer.end_offsets(partitions)
            while time.monotonic() < deadline and any(
                consumer.position(partition) < end for partition, end in ends.items()
            ):
                for batch in consumer.poll(timeout_ms=200).values():
                    records.extend(batch)
            return records
        finally:
            consumer.close()


# -- RabbitMQ --------------------------------------------------------------------------------


class RabbitAdmin:
    """A plain pika connection for declaring, publishing and inspecting queues in tests.

    Queues made with :meth:`queue` are deleted by :meth:`close`.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.created: list[str] = []
        self._connection: Any = None
        self._channel: Any = None

    def channel(self) -> Any:
        """An open channel (reopened after the broker closed it)."""
        import pika

        if self._connection is None or not self._connection.is_open:
            self._connection = pika.BlockingConnection(pika.URLParameters(self.url))
            self._channel = None
        if self._channel is None or not self._channel.is_open:
            self._channel = self._connection.channel()
        return self._channel

    def queue(self, kind: str = "events", **arguments: Any) -> str:
        """Declare a durable queue with a fresh name (deleted at :meth:`close`)."""
        name = unique_name(kind)
        self.channel().queue_declare(name, durable=True, arguments=arguments or None)
        self.created.append(name)
        return name

    def declare(self, consumer: Any) -> None:
        """Declare a RabbitMQ consumer's queue, DLQ and bindings (as the consumer will)."""
        from mqdedup.rabbitmq.topology import declare_topology

        declare_topology(self.channel(), consumer.topology())

    def publish(
        self,
        queue: str,
        ids: Iterable[str | None],
        *,
        body: Callable[[str | None], bytes] | None = None,
        properties: Callable[[str | None], dict[str, Any]] | None = None,
        wait: bool = True,
    ) -> int:
        """Publish one persistent message per id (``message_id`` property); return the count."""
        import pika

        channel = self.channel()
        before = self.depth(queue) if wait else 0
        count = 0
        for message_id in ids:
            extra = properties(message_id) if properties else {}
            channel.basic_publish(
                exchange="",
                routing_key=queue,
                body=body(message_id) if body else json.dumps({"id": message_id}).encode(),
                properties=pika.BasicProperties(message_id=message_id, delivery_mode=2, **extra),
            )
            count += 1
        if wait:
            wait_for(
                lambda: self.depth(queue) >= before + count, 60, f"{count} messages in {queue}"
            )
        return count

    def depth(self, queue: str) -> int:
        """Ready messages in ``queue`` (unacked ones are not counted; 0 if it is missing)."""
        import pika.exceptions

        try:
            frame = self.channel().queue_declare(queue=queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker as error:
            if error.reply_code == 404:
                return 0
            raise
        return int(frame.method.message_count)

    def peek_all(self, queue: str) -> list[tuple[Any, bytes]]:
        """Every ready message of ``queue`` (properties, body), left in the queue."""
        channel = self.channel()
        found: list[tuple[Any, bytes]] = []
        while True:
            method, properties, body = channel.basic_get(queue, auto_ack=False)
            if method is None:
                break
            found.append((properties, body))
        channel.close()  # returns everything taken to the queue, in order
        self._channel = None
        return found

    def drain(self, queue: str, expected: int, timeout: float = 60.0) -> list[tuple[Any, bytes]]:
        """Take (and ack) every message of ``queue``; waits for ``expected`` of them."""
        channel = self.channel()
        messages: list[tuple[Any, bytes]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            method, properties, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                if len(messages) >= expected:
                    break
                time.sleep(0.05)
                continue
            messages.append((properties, body))
        return messages

    def delete(self, *queues: str) -> None:
        import pika.exceptions

        for queue in queues:
            try:
                self.channel().queue_delete(queue=queue)
            except pika.exceptions.AMQPError:
                self._channel = None

    def close(self) -> None:
        """Delete the queues made with :meth:`queue` and disconnect."""
        with contextlib.suppress(Exception):  # cleanup only
            self.delete(*self.created)
        if self._connection is not None and self._connection.is_open:
            with contextlib.suppress(Exception):
                self._connection.close()


# -- private instances -----------------------------------------------------------------------


#: A command prefix that starts a CLI subprocess with SIGINT and SIGHUP at their defaults,
#: as a terminal gives them, for tests that check the command's signal handling. A test run
#: started in the background (``cmd &`` in a script, ``nohup``) passes them on ignored, and
#: a command that starts with a signal ignored keeps it ignored (as documented).
TERMINAL_SIGNALS = ["env", "--default-signal=INT,HUP"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateService:
    """One service instance of ``scripts/services.sh`` under its own state dir and port."""

    def __init__(self, service: str, state_dir: Path, port_variable: str, port: int) -> None:
        self.service = service
        self.port = port
        self.env = {**os.environ, "MQDEDUP_STATE_DIR": str(state_dir), port_variable: str(port)}

    def _run(self, action: str) -> None:
        result = subprocess.run(
            ["bash", str(SERVICES), action, self.service],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"services.sh {action} {self.service} failed:\n{result.stdout}\n{result.stderr}"
            )

    def start(self) -> None:
        self._run("start")

    def stop(self) -> None:
        self._run("stop")

    def kill(self) -> None:
        self._run("kill")

    @property
    def bootstrap(self) -> str:
        """``127.0.0.1:<port>`` (Kafka's bootstrap address)."""
        return f"127.0.0.1:{self.port}"


@contextlib.contextmanager
def private_kafka(state_dir: Path, **settings: str) -> Iterator[PrivateService]:
    """A PRIVATE Kafka broker (own port and state dir) that a test may stop and start.

    ``settings`` are extra environment variables of ``services.sh`` (for example
    ``KAFKA_AUTO_CREATE_TOPICS="false"``). The broker is stopped at the end, and killed
    if it does not stop (also when its start failed half-way).
    """
    port = free_port()
    while port >= 65000:  # its controller listens on port + 1
        port = free_port()
    broker = PrivateService("kafka", state_dir, "KAFKA_PORT", port)
    broker.env.update(settings)
    try:
        broker.start()
        yield broker
    finally:
        try:
            broker.stop()
        except Exception:
            with contextlib.suppress(Exception):
                broker.kill()


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_amqp_port() -> int:
    """A free AMQP port for a private node (its Erlang distribution port is chosen by the
    services script: ``rmq_free_dist_port``, outside the ephemeral port range)."""
    rng = Random()
    for _ in range(200):
        port = rng.randint(21000, 29999)
        if _port_free(port):
            return port
    raise RuntimeError("no free port for a private RabbitMQ node")


@dataclass
class PrivateRabbitMQ:
    """A private RabbitMQ node: its URL, ``rabbitmqctl -n <node>`` and broker-setting helpers."""

    service: PrivateService
    url: str
    ctl: list[str]
    #: ``application:get_env`` of each key ``set_env`` changed, as printed before the change.
    _changed: dict[str, str] = field(default_factory=dict)
    _alarm: bool = False

    def run(self, *args: str) -> str:
        result = subprocess.run(
            [*self.ctl, *args], capture_output=True, text=True, timeout=60, check=True
        )
        return result.stdout

    def eval(self, expression: str) -> str:
        return self.run("eval", expression)

    def set_env(self, key: str, value: int) -> None:
        """``application:set_env(rabbit, key, value)`` (read by channels opened later);
        :meth:`reset` puts the node's own value back."""
        if key not in self._changed:
            self._changed[key] = self.eval(f"application:get_env(rabbit, {key}).").strip()
        self.eval(f"application:set_env(rabbit, {key}, {value}).")

    def memory_alarm(self, on: bool) -> None:
        """Raise or clear this node's memory alarm (publishers are blocked while it is on)."""
        if on:
            self.eval("rabbit_alarm:set_alarm({{resource_limit, memory, node()}, []}).")
        else:
            self.eval("rabbit_alarm:clear_alarm({resource_limit, memory, node()}).")
        self._alarm = on

    @property
    def running(self) -> bool:
        """Whether the node accepts AMQP connections."""
        with socket.socket() as sock:
            sock.settimeout(2.0)
            return sock.connect_ex(("127.0.0.1", self.service.port)) == 0

    def ensure_running(self) -> None:
        """Start the node if a test stopped or killed it (and did not start it again)."""
        if not self.running:
            self.service.start()
            self._changed.clear()  # a restarted node has its own settings again
            self._alarm = False

    def reset(self) -> None:
        """Running, with the settings it started with: what the next test expects."""
        self.ensure_running()
        restore = [
            f"application:unset_env(rabbit, {key})"
            if before == "undefined"
            else f"{{ok, V_{n}}} = {before}, application:set_env(rabbit, {key}, V_{n})"
            for n, (key, before) in enumerate(self._changed.items())
        ]
        if self._alarm:
            restore.append("rabbit_alarm:clear_alarm({resource_limit, memory, node()})")
        if restore:
            self.eval(", ".join(restore) + ".")
        self._changed.clear()
        self._alarm = False

    def connections(self, name_part: str) -> list[str]:
        """``state`` of the connections whose client-provided name contains ``name_part``."""
        out = self.run("list_connections", "state", "client_properties", "-q", "--no-table-headers")
        return [
            line.split("\t", 1)[0]
            for line in out.splitlines()
            if "connection_name" in line and name_part in line
        ]

    def queue_messages(self, queue: str) -> int:
        """Ready + unacknowledged messages of ``queue`` (0 if it does not exist)."""
        out = self.run("list_queues", "name", "messages", "-q", "--no-table-headers")
        for line in out.splitlines():
            name, _, count = line.partition("\t")
            if name == queue:
                return int(count)
        return 0


@contextlib.contextmanager
def private_rabbitmq(state_dir: Path) -> Iterator[PrivateRabbitMQ]:
    """A PRIVATE RabbitMQ node (own state dir and ports) for tests that stop it or change
    its settings; stopped (or killed) afterwards. The shared node is never touched."""
    port = _free_amqp_port()
    service = PrivateService("rabbitmq", state_dir / "services", "RABBITMQ_PORT", port)
    service.start()
    try:
        yield PrivateRabbitMQ(
            service,
            f"amqp://guest:guest@127.0.0.1:{port}/%2F",
            ["/usr/sbin/rabbitmqctl", "-n", f"rabbit-{port}@localhost"],
        )
    finally:
        try:
            service.stop()
        except RuntimeError:
            service.kill()

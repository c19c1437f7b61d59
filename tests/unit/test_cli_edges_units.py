"""In-process pieces of the CLI's rough edges: durations, config keys, reachability."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from mqdedup.cli.config import check_keys, resolve_with_source
from mqdedup.cli.parser import parse_duration
from mqdedup.cli.reachability import check_kafka_reachable, wait_for_consumer_broker
from mqdedup.dedup import RedisDedup
from mqdedup.errors import BrokerUnavailableError, ConfigurationError


@pytest.fixture
def listening() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield int(server.getsockname()[1])


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("text", ["90s", "15m", "12h", "7d", "2w", "1.5h"])
def test_durations_print_as_given(text: str) -> None:
    duration = parse_duration(text)
    assert str(duration) == text and f"older than {duration}" == f"older than {text}"
    assert duration.total_seconds() > 0


def test_unknown_keys_name_the_nearest_valid_one() -> None:
    check_keys({"mqdedup": {"database_url": "x"}, "worker": {"health_port": 1}}, "f.toml")
    with pytest.raises(ConfigurationError, match=r"did you mean 'shutdown_timeout'\?"):
        check_keys({"worker": {"shutdown_timeuot": 3}}, "f.toml")
    with pytest.raises(ConfigurationError, match=r"unknown setting 'zzz' in \[relay\] .*known:"):
        check_keys({"relay": {"zzz": 1}}, "f.toml")
    with pytest.raises(ConfigurationError, match=r"\[worker\] in f.toml must be a section"):
        check_keys({"worker": 4}, "f.toml")


def test_a_port_out_of_range_is_refused_from_every_source() -> None:
    with pytest.raises(ConfigurationError, match=r"config \[worker\] health_port: 70000"):
        resolve_with_source("health_port", None, {"worker": {"health_port": 70000}}, {})
    with pytest.raises(ConfigurationError, match="environment variable MQDEDUP_HEALTH_PORT: -1"):
        resolve_with_source("health_port", None, {}, {"MQDEDUP_HEALTH_PORT": "-1"})
    assert resolve_with_source("health_port", 0, {}, {}) == (0, "--health-port")


def test_kafka_bootstrap_entries_with_a_protocol_or_brackets_are_checked(listening: int) -> None:
    check_kafka_reachable(f"PLAINTEXT://127.0.0.1:{listening}")
    check_kafka_reachable(f"127.0.0.1:{_closed_port()},SASL_SSL://127.0.0.1:{listening}")
    with pytest.raises(BrokerUnavailableError, match="cannot reach Kafka"):
        check_kafka_reachable(f"[127.0.0.1]:{_closed_port()}", timeout=1)


class _Rabbit:
    startup_timeout = 0.6

    def __init__(self, port: int) -> None:
        self.broker_url = f"amqp://u:secret@127.0.0.1:{port}/%2F"


def test_waiting_for_a_broker_says_so_once_then_gives_up_after_its_timeout() -> None:
    said: list[str] = []
    started = time.monotonic()
    with pytest.raises(BrokerUnavailableError, match=r"cannot reach RabbitMQ .*\(waited 0.6s\)"):
        wait_for_consumer_broker(_Rabbit(_closed_port()), said.append, poll=0.1)
    assert 0.6 <= time.monotonic() - started < 5
    assert len(said) == 1 and said[0].startswith("waiting up to 0.6s for RabbitMQ")
    assert "secret" not in said[0]


def test_a_reachable_broker_is_not_waited_for(listening: int) -> None:
    said: list[Any] = []
    wait_for_consumer_broker(_Rabbit(listening), said.append)
    assert said == []


def test_a_redis_claimed_consumer_is_waited_for_through_its_own_broker(listening: int) -> None:
    """The claim store is an attribute: the broker is still the consumer's own."""

    class RedisClaimed(_Rabbit):
        dedup = RedisDedup(lease=5)

    said: list[Any] = []
    wait_for_consumer_broker(RedisClaimed(listening), said.append)
    assert said == []
    with pytest.raises(BrokerUnavailableError, match="cannot reach RabbitMQ"):
        wait_for_consumer_broker(RedisClaimed(_closed_port()), poll=0.05)

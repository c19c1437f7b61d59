"""Id generators hold their contracts (issue #39): fork-safe, a frozen clock refused.

* A process forked while another thread makes ids gets its UUIDv7s within a bounded
  time (50 forks), unique against the parent's; a Snowflake copied into such a child
  refuses at once with ``ForkedGeneratorError``, and a Snowflake with the child's own
  node id works there. Before, a child waited for ever on a generator lock the
  parent's thread held at the fork (a few in 100 forks for ``new_message_id``; a
  generator whose clock is slow to read holds its lock most of the time, so there the
  first fork or the second hung).
* A Snowflake whose clock stands still refuses its 4,097th id of the millisecond with
  ``ClockStalledError`` within a bounded time (before: a hang), and an error leaves
  no trace: once the clock moves on, the ids stay unique.
* ``import mqdedup.ids`` works and names the strategies and the generators the docs name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from mqdedup import id_generators
from mqdedup.id_generators import (
    ClockStalledError,
    ForkedGeneratorError,
    Snowflake,
    UUIDv7Generator,
    new_message_id,
)

FORKS = 50
CHILD_IDS = 200
CHILD_DEADLINE = 10.0  # seconds a child may take for its ids (it needs milliseconds)


BusyThread = Callable[[Callable[[], object]], list[object]]


@pytest.fixture
def busy_thread() -> Iterator[BusyThread]:
    """Start a thread that makes ids in a loop until the test ends; returns its ids."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(make: Callable[[], object]) -> list[object]:
        made: list[object] = []

        def spin() -> None:
            while not stop.is_set():
                made.append(make())

        thread = threading.Thread(target=spin, daemon=True)
        thread.start()
        threads.append(thread)
        return made

    yield start
    stop.set()
    for thread in threads:
        thread.join(timeout=10)


def run_in_fork(child: Callable[[], bytes]) -> bytes:
    """Fork, run ``child`` there and return what it wrote; fail if it takes too long."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only os calls and the code under test, then _exit
        try:
            os.write(writer, child())
        finally:
            os._exit(0)
    os.close(writer)
    deadline = time.monotonic() + CHILD_DEADLINE
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(reader)
            pytest.fail(f"a forked child made no id within {CHILD_DEADLINE:g} s (hung)")
        time.sleep(0.005)  # polling a child process; no event to wait on
    chunks = []
    while chunk := os.read(reader, 65536):
        chunks.append(chunk)
    os.close(reader)
    return b"".join(chunks)


def slow_clock() -> int:
    """The wall clock, read slowly: a generator's lock is held most of the time."""
    time.sleep(0.0005)
    return time.time_ns() // 1_000_000


def test_a_child_forked_while_a_thread_makes_uuid7s_gets_its_ids(busy_thread: BusyThread) -> None:
    slow = UUIDv7Generator(clock=slow_clock)  # a fork nearly always finds its lock held
    parent_ids = busy_thread(new_message_id)
    parent_slow_ids = busy_thread(lambda: str(slow.new()))
    children: set[str] = set()
    for _ in range(FORKS):

        def child() -> bytes:
            ids = [new_message_id() for _ in range(CHILD_IDS)]
            ids += [str(slow.new()) for _ in range(10)]
            return " ".join(ids).encode()

        made = run_in_fork(child).decode().split()
        assert len(made) == CHILD_IDS + 10 and made[:CHILD_IDS] == sorted(made[:CHILD_IDS])
        children.update(made)
    assert len(children) == FORKS * (CHILD_IDS + 10)  # unique across the children
    parent = {str(i) for i in [*parent_ids, *parent_slow_ids]}
    assert not children & parent  # and against the parent
    assert parent_ids and parent_slow_ids  # the threads made ids while the forks happened


def test_a_snowflake_copied_into_a_forked_child_refuses_at_once(busy_thread: BusyThread) -> None:
    snowflake = Snowflake(3, clock=slow_clock)  # its lock held most of the time
    parent_ids = busy_thread(snowflake.next_id)

    def child() -> bytes:
        try:
            snowflake.next_id()
            copied = b"made an id"
        except ForkedGeneratorError:
            copied = b"refused"
        own = Snowflake(4)  # a node id of the child's own works
        return copied + b" " + b" ".join(str(own.next_id()).encode() for _ in range(CHILD_IDS))

    children: set[int] = set()
    for _ in range(FORKS):
        outcome, *ids = run_in_fork(child).split()
        assert outcome == b"refused"
        children.update(int(i) for i in ids)
    assert not children & set(list(parent_ids))
    assert {Snowflake(0).parse(i)[1] for i in children} == {4}


def test_a_snowflake_with_a_frozen_clock_refuses_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    frozen = time.time_ns()
    monkeypatch.setattr(id_generators.time, "time_ns", lambda: frozen)
    snowflake = Snowflake(1)
    made: list[int] = []
    outcome: list[BaseException] = []

    def make() -> None:
        try:
            while True:
                made.append(snowflake.next_id())
        except BaseException as error:
            outcome.append(error)

    started = time.monotonic()
    thread = threading.Thread(target=make, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "next_id hung on a frozen clock"
    assert len(made) == Snowflake.MAX_SEQUENCE + 1
    assert isinstance(outcome[0], ClockStalledError)
    assert "clock stood still" in str(outcome[0])
    assert time.monotonic() - started < 30
    with pytest.raises(ClockStalledError):  # still refused, no id from a stale sequence
        snowflake.next_id()

    frozen += 1_000_000  # the clock moves on by a millisecond
    after = [snowflake.next_id() for _ in range(10)]
    assert not set(after) & set(made) and after == sorted(after) and after[0] > made[-1]


def test_import_mqdedup_ids_names_what_the_docs_name() -> None:
    code = (
        "import mqdedup.ids as ids, mqdedup\n"
        "from mqdedup import ids as same\n"
        "assert ids is same is mqdedup.ids\n"
        "names = ['from_header', 'from_amqp_message_id', 'from_coordinates',\n"
        "         'from_content_hash', 'from_callable', 'first_of', 'check_message_id',\n"
        "         'new_message_id', 'Snowflake', 'UUIDv7Generator', 'uuid7_time',\n"
        "         'ForkedGeneratorError', 'ClockMovedBackwardsError', 'ClockStalledError',\n"
        "         'InvalidMessageIdError', 'MissingMessageIdError',\n"
        "         'from_correlation_id', 'from_body_key']\n"
        "missing = [n for n in names if not hasattr(ids, n)]\n"
        "assert not missing, missing\n"
        "assert sorted(ids.__all__) == sorted(names + ['DEFAULT_HEADER', 'MAX_ID_LENGTH',\n"
        "                                               'MessageIdStrategy'])\n"
        "assert ids.Snowflake(7).next_id() > 0 and len(ids.new_message_id()) == 36\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"

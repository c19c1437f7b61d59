"""``mqdedup.id_generators`` (also ``mqdedup.ids.*``): UUIDv7 message ids and Snowflake ids.

8 processes x 100,000 ids of each kind: no duplicate, strictly increasing within each
process. A clock stepped back is waited out (UUIDv7: the last millisecond is kept;
Snowflake: up to ``max_backward_wait``) or refused (Snowflake beyond it), never a
duplicate; the clocks are injected.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import uuid
from datetime import UTC, datetime

import pytest

from mqdedup.id_generators import (
    ClockMovedBackwardsError,
    ForkedGeneratorError,
    Snowflake,
    UUIDv7Generator,
    new_message_id,
    uuid7_time,
)

PROCESSES = 8
PER_PROCESS = 100_000


def _make_ids(node_id: int) -> tuple[list[str], list[int]]:
    generator = Snowflake(node_id)
    return [new_message_id() for _ in range(PER_PROCESS)], [
        generator.next_id() for _ in range(PER_PROCESS)
    ]


def test_eight_processes_make_800k_unique_ids_of_each_kind_monotonic_per_process() -> None:
    with multiprocessing.get_context("fork").Pool(PROCESSES) as pool:
        results = pool.map(_make_ids, range(PROCESSES))

    uuids = [ids for ids, _ in results]
    snowflakes = [numbers for _, numbers in results]
    assert len({i for ids in uuids for i in ids}) == PROCESSES * PER_PROCESS
    assert len({n for numbers in snowflakes for n in numbers}) == PROCESSES * PER_PROCESS
    for ids, numbers in zip(uuids, snowflakes, strict=True):
        assert all(a < b for a, b in itertools.pairwise(ids))  # strings, strictly
        assert all(a < b for a, b in itertools.pairwise(numbers))
    sample = uuid.UUID(uuids[0][0])
    assert sample.version == 7 and sample.variant == uuid.RFC_4122
    assert abs((uuid7_time(sample) - datetime.now(UTC)).total_seconds()) < 300


class Clock:
    """An injectable millisecond clock a test moves by hand."""

    def __init__(self, now: int) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def __call__(self) -> int:
        return self.now

    def sleep_then_advance(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += 1


def test_a_uuid7_clock_stepped_back_keeps_the_ids_increasing() -> None:
    clock = Clock(1_700_000_000_000)
    generator = UUIDv7Generator(clock=clock)
    first = [generator.new() for _ in range(3)]
    clock.now -= 5_000  # NTP steps the clock back 5 s
    after = [generator.new() for _ in range(3)]
    ids = first + after
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert {uuid7_time(i) for i in ids} == {uuid7_time(first[0])}  # the last ms is kept
    clock.now += 10_000
    later = generator.new()
    assert later > ids[-1] and uuid7_time(later) > uuid7_time(first[0])


def test_a_snowflake_waits_out_a_small_step_back_and_refuses_a_large_one() -> None:
    clock = Clock(int(Snowflake.DEFAULT_EPOCH.timestamp() * 1000) + 10_000)
    snowflake = Snowflake(5, clock=clock, sleep=clock.sleep_then_advance, max_backward_wait=0.02)
    before = snowflake.next_id()
    clock.now -= 10  # 10 ms back: waited out (the injected sleep moves the clock on)
    after = snowflake.next_id()
    assert after > before and len(clock.sleeps) == 10
    assert snowflake.parse(after)[1:] == (5, 1)  # same millisecond as before: sequence 1
    clock.now -= 1_000  # 1 s back: beyond the 20 ms it may wait
    with pytest.raises(ClockMovedBackwardsError, match="moved back 1000 ms"):
        snowflake.next_id()
    clock.now += 2_000
    assert snowflake.next_id() > after  # the clock caught up: ids again


def test_a_snowflake_sequence_running_out_waits_for_the_next_millisecond() -> None:
    clock = Clock(int(Snowflake.DEFAULT_EPOCH.timestamp() * 1000) + 1)
    snowflake = Snowflake(1, clock=clock, sleep=clock.sleep_then_advance)
    ids = [snowflake.next_id() for _ in range(Snowflake.MAX_SEQUENCE + 2)]
    assert len(set(ids)) == len(ids) and ids == sorted(ids)
    assert snowflake.parse(ids[-1])[2] == 0 and clock.sleeps  # the next millisecond


def test_a_snowflake_used_in_a_forked_child_refuses() -> None:
    snowflake = Snowflake(9)
    snowflake.next_id()
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's generator must refuse
        try:
            snowflake.next_id()
            os.write(writer, b"made an id")
        except ForkedGeneratorError:
            os.write(writer, b"refused")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(reader, 100) == b"refused"
    os.close(reader)
    os.close(writer)


@pytest.mark.parametrize(
    ("node_id", "error"), [(-1, ValueError), (1024, ValueError), ("1", TypeError)]
)
def test_a_snowflake_node_id_out_of_range_is_refused(node_id: object, error: type) -> None:
    with pytest.raises(error, match="node_id"):
        Snowflake(node_id)  # type: ignore[arg-type]

"""Unique ids for producers: time-ordered UUIDv7 message ids and 64-bit Snowflake ids.

Timestamp + random ids collide under load, and random UUIDv4 ids spread the inserts of
a dedup or outbox table over its whole primary-key index. The two generators here are
time-ordered and never repeat an id within a process:

* :func:`new_message_id` returns a UUIDv7 string (RFC 9562, section 5.7): 48 bits of
  Unix milliseconds, then a 42-bit counter (the 12 ``rand_a`` bits and the top 30 bits
  of ``rand_b``, method 1 of section 6.2, "fixed bit-length dedicated counter") started
  at a random value below 2**41 each millisecond and incremented within it, then 32
  random bits. Ids of one process are strictly increasing (as strings and as UUIDs),
  also when the clock steps back (the last millisecond is kept until the clock passes
  it) or the counter runs out (the timestamp moves on by one millisecond). Across
  processes they are unique by their random bits (122 - 48 bits of randomness less
  the counter's headroom: 74 bits per millisecond). Thread-safe and fork-safe: a
  child forked while another thread was making an id gets a fresh lock and a fresh
  counter of its own (``os.register_at_fork``), never a lock held for ever.
* :class:`Snowflake` makes 63-bit positive integers for teams that want numeric ids:
  41 bits of milliseconds since an epoch (2024-01-01 by default, ~69 years of room),
  10 bits of node id, 12 bits of sequence (4,096 ids per millisecond and node). Unique
  only if every live generator has its own node id: a generator copied into a forked
  child refuses to make ids at once (:class:`ForkedGeneratorError`; also when another
  thread was making an id at the fork), as the child has no node id of its own. A
  clock that goes back is waited out up to ``max_backward_wait``, and refused beyond
  it (:class:`ClockMovedBackwardsError`); a clock that stands still after 4,096 ids in
  its millisecond is waited for up to :attr:`Snowflake.MAX_STALL_WAIT` and refused
  after (:class:`ClockStalledError`): never a duplicate id, never a hang.

Messages a consumer writes to its outbox keep their deterministic ids
(:func:`mqdedup.outbox.writer.outgoing_message_id`): a re-run of the handler must make
the same ids, which a clock cannot give. :func:`new_message_id` is for messages written
outside a consumer (``OutboxWriter`` without a consumer uses it) and for producers.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Protocol

from mqdedup.errors import MqdedupError

__all__ = [
    "ClockMovedBackwardsError",
    "ClockStalledError",
    "ForkedGeneratorError",
    "Snowflake",
    "UUIDv7Generator",
    "new_message_id",
    "uuid7_time",
]

#: A clock returning Unix time in milliseconds (injectable for tests).
MillisClock = Callable[[], int]

_COUNTER_BITS = 42
_COUNTER_MAX = (1 << _COUNTER_BITS) - 1
#: Each millisecond's counter starts below this (a random start with room to count up).
_COUNTER_SEED_LIMIT = 1 << (_COUNTER_BITS - 1)
_VERSION_7 = 0x7 << 76
_VARIANT_RFC = 0b10 << 62


def _wall_millis() -> int:
    return time.time_ns() // 1_000_000


class ForkedGeneratorError(MqdedupError, RuntimeError):
    """A :class:`Snowflake` generator was used in a process forked from the one that made
    it: both would make the same ids with the same node id. Create a generator with a
    node id of its own in each process."""


class ClockMovedBackwardsError(MqdedupError, RuntimeError):
    """The clock went back further than a :class:`Snowflake` may wait: no id was made
    (making one could repeat an id already given out)."""


class ClockStalledError(MqdedupError, RuntimeError):
    """A :class:`Snowflake` made its 4,096 ids of one millisecond and the clock did not
    move on within :attr:`Snowflake.MAX_STALL_WAIT`: no id was made (a frozen or
    mocked clock; waiting longer could hang for ever)."""


class _ForkAware(Protocol):
    def _after_fork_in_child(self) -> None: ...


# Every live generator, to reset in a forked child: a fork copies the process with
# only the forking thread, so a lock another thread held at that moment stays held
# for ever in the child.
_LIVE: weakref.WeakSet[_ForkAware] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def _track(generator: _ForkAware) -> None:
    with _LIVE_LOCK:
        _LIVE.add(generator)


def _reset_after_fork() -> None:
    global _LIVE_LOCK  # noqa: PLW0603 - the parent's copy may be held by another thread
    _LIVE_LOCK = threading.Lock()
    for generator in list(_LIVE):
        generator._after_fork_in_child()


if hasattr(os, "register_at_fork"):  # POSIX; there is no fork elsewhere
    os.register_at_fork(after_in_child=_reset_after_fork)


class UUIDv7Generator:
    """Strictly increasing UUIDv7 values (see the module's docstring for the layout).

    ``clock`` returns Unix milliseconds (default: the wall clock); ``random_bits(n)``
    returns ``n`` random bits (default: ``os.urandom``). Thread-safe.
    """

    def __init__(
        self,
        clock: MillisClock = _wall_millis,
        random_bits: Callable[[int], int] | None = None,
    ) -> None:
        self._clock = clock
        self._random_bits = random_bits or _urandom_bits
        self._lock = threading.Lock()
        self._last_ms = -1
        self._counter = 0
        self._pid = os.getpid()
        _track(self)

    def _after_fork_in_child(self) -> None:
        """A fresh lock (the parent's may have been held) and a counter of our own."""
        self._lock = threading.Lock()
        self._pid, self._last_ms = os.getpid(), -1

    def new(self) -> uuid.UUID:
        """The next UUIDv7, greater than every one this generator made before."""
        with self._lock:
            pid = os.getpid()
            if pid != self._pid:  # forked: a fresh random counter of our own
                self._pid, self._last_ms = pid, -1
            now = self._clock()
            if now > self._last_ms:
                self._last_ms = now
                self._counter = self._random_bits(_COUNTER_BITS - 1)
            elif self._counter < _COUNTER_MAX:
                self._counter += 1  # same millisecond, or the clock stepped back
            else:  # 2**41 ids in one millisecond at least: borrow the next one
                self._last_ms += 1
                self._counter = self._random_bits(_COUNTER_BITS - 1)
            millis, counter = self._last_ms, self._counter
        value = (
            (millis & 0xFFFF_FFFF_FFFF) << 80
            | _VERSION_7
            | (counter >> 30) << 64
            | _VARIANT_RFC
            | (counter & 0x3FFF_FFFF) << 32
            | self._random_bits(32)
        )
        return uuid.UUID(int=value)


def _urandom_bits(bits: int) -> int:
    return int.from_bytes(os.urandom((bits + 7) // 8), "big") >> (-bits % 8)


# The process's generator: ids are monotonic within a process only if one generator
# makes them all (as ``uuid.uuid1`` keeps its last timestamp).
_PROCESS_GENERATOR = UUIDv7Generator()


def new_message_id() -> str:
    """A new time-ordered message id: a UUIDv7 string, e.g. ``0191f3c4-...-7...``.

    Unique across processes and machines, strictly increasing within this process.
    Pass it as the ``message_id`` of a message you publish (a Kafka header, the AMQP
    ``message_id`` property) so that consumers deduplicate a re-send of it.
    """
    return str(_PROCESS_GENERATOR.new())


def uuid7_time(value: uuid.UUID | str) -> datetime:
    """The creation time (millisecond precision, UTC) of a UUIDv7."""
    parsed = value if isinstance(value, uuid.UUID) else uuid.UUID(value)
    if parsed.version != 7:
        raise ValueError(f"{value} is not a UUIDv7 (version {parsed.version})")
    return datetime.fromtimestamp((parsed.int >> 80) / 1000, UTC)


class Snowflake:
    """A 64-bit id generator: ``timestamp (41 bits) | node id (10) | sequence (12)``.

    ``node_id`` (0-1023) must be unique among the generators running at the same time
    (one per process: a worker's index, a pod ordinal, a row leased from a table).
    ``epoch`` is where the timestamp counts from (default 2024-01-01 UTC; keep it fixed
    forever, ids from another epoch overlap). When the clock reads earlier than the
    last id's millisecond, :meth:`next_id` waits for it to catch up if the gap is at
    most ``max_backward_wait`` seconds (default 0.05: NTP slews and small steps), else
    raises :class:`ClockMovedBackwardsError`. When the 4,096 ids of a millisecond are
    made, the next millisecond is awaited for up to :attr:`MAX_STALL_WAIT` seconds
    (:class:`ClockStalledError` after). ``clock`` (Unix milliseconds) and ``sleep``
    (seconds) are injectable. Thread-safe; a copy in a forked child raises
    :class:`ForkedGeneratorError` (create a generator with the child's own node id).
    """

    NODE_BITS = 10
    SEQUENCE_BITS = 12
    TIMESTAMP_BITS = 41
    MAX_NODE_ID = (1 << NODE_BITS) - 1
    MAX_SEQUENCE = (1 << SEQUENCE_BITS) - 1
    DEFAULT_EPOCH = datetime(2024, 1, 1, tzinfo=UTC)
    #: Seconds to wait for the clock to pass a millisecond whose ids are all made.
    MAX_STALL_WAIT = 0.1

    def __init__(
        self,
        node_id: int,
        *,
        epoch: datetime = DEFAULT_EPOCH,
        max_backward_wait: float = 0.05,
        clock: MillisClock = _wall_millis,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if isinstance(node_id, bool) or not isinstance(node_id, int):
            raise TypeError(f"Snowflake node_id must be an int, got {type(node_id).__name__}")
        if not 0 <= node_id <= self.MAX_NODE_ID:
            raise ValueError(f"Snowflake node_id must be 0 to {self.MAX_NODE_ID}, got {node_id}")
        if epoch.tzinfo is None:
            raise ValueError("Snowflake epoch must be timezone-aware (e.g. tzinfo=UTC)")
        if max_backward_wait < 0:
            raise ValueError("Snowflake max_backward_wait must not be negative")
        self.node_id = node_id
        self.epoch_ms = int(epoch.timestamp() * 1000)
        self.max_backward_wait = max_backward_wait
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._last_ms = -1
        self._sequence = 0
        self._pid = os.getpid()
        _track(self)

    def _after_fork_in_child(self) -> None:
        """A fresh lock, so that :meth:`next_id` refuses at once instead of waiting for
        ever on a lock another thread of the parent held at the fork."""
        self._lock = threading.Lock()

    def next_id(self) -> int:
        """The next id: unique for this node id, greater than every id made before."""
        with self._lock:
            if os.getpid() != self._pid:
                raise ForkedGeneratorError(
                    f"this Snowflake (node id {self.node_id}) was created in process "
                    f"{self._pid} and used in its forked child {os.getpid()}: both would "
                    "make the same ids; create a Snowflake with its own node id per process"
                )
            now = self._now()
            sequence = 0
            if now == self._last_ms:
                sequence = (self._sequence + 1) & self.MAX_SEQUENCE
                if sequence == 0:  # 4,096 ids this millisecond: wait for the next
                    now = self._next_millisecond()
            # Only a made id moves the state on: an error leaves it as it was.
            self._last_ms, self._sequence = now, sequence
            return (
                (now << (self.NODE_BITS + self.SEQUENCE_BITS))
                | (self.node_id << self.SEQUENCE_BITS)
                | sequence
            )

    def _next_millisecond(self) -> int:
        """Wait (bounded) for the clock to pass the last id's millisecond."""
        deadline = time.monotonic() + self.MAX_STALL_WAIT
        while True:
            # The deadline before the clock: a thread paused past the deadline reads the
            # clock once more before it refuses.
            expired = time.monotonic() > deadline
            now = self._now()
            if now > self._last_ms:
                return now
            if expired:
                raise ClockStalledError(
                    f"the clock stood still for {self.MAX_STALL_WAIT * 1000:.0f} ms after "
                    f"the {self.MAX_SEQUENCE + 1} ids of its millisecond: no id made (is the "
                    "clock frozen or mocked?)"
                )
            self._sleep(0.0001)

    def _now(self) -> int:
        """Milliseconds since the epoch, never earlier than the last id's."""
        now = self._clock() - self.epoch_ms
        if now < self._last_ms:
            behind = (self._last_ms - now) / 1000
            if behind > self.max_backward_wait:
                raise ClockMovedBackwardsError(
                    f"the clock moved back {behind * 1000:.0f} ms (more than the "
                    f"{self.max_backward_wait * 1000:.0f} ms a Snowflake waits): no id made"
                )
            deadline = time.monotonic() + behind + 1.0  # bounded even if the clock is stuck
            while now < self._last_ms:
                if time.monotonic() > deadline:
                    raise ClockMovedBackwardsError(
                        f"the clock did not catch up with the last id's time within "
                        f"{behind * 1000 + 1000:.0f} ms: no id made"
                    )
                self._sleep(min(behind, 0.001))
                now = self._clock() - self.epoch_ms
        if now >= 1 << self.TIMESTAMP_BITS:
            raise ClockMovedBackwardsError("the Snowflake timestamp ran out of its 41 bits")
        if now < 0:
            raise ClockMovedBackwardsError("the clock reads earlier than the Snowflake epoch")
        return now

    def parse(self, value: int) -> tuple[datetime, int, int]:
        """``(time, node id, sequence)`` of an id made with this generator's epoch."""
        millis = (value >> (self.NODE_BITS + self.SEQUENCE_BITS)) + self.epoch_ms
        node = (value >> self.SEQUENCE_BITS) & self.MAX_NODE_ID
        return datetime.fromtimestamp(millis / 1000, UTC), node, value & self.MAX_SEQUENCE

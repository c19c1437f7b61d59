"""Contiguous-offset bookkeeping of the Kafka transport (no broker)."""

from __future__ import annotations

import random
import threading

from mqdedup.kafka.offsets import OffsetTracker

P0 = ("orders", 0)
P1 = ("orders", 1)


def track(tracker: OffsetTracker, key: tuple[str, int], offset: int) -> int | None:
    """The epoch of one record handed out (None: dropped, a rewind is pending)."""
    [tracked] = tracker.track_many(key, [offset])
    return None if tracked is None else tracked[0]


def settle(tracker: OffsetTracker, key: tuple[str, int], offset: int, epoch: int) -> bool:
    """Settle one delivery; False when it is ignored."""
    return tracker.settle_many([(key, offset, epoch)]) == 1


def track_all(tracker: OffsetTracker, key: tuple[str, int], offsets: range | list[int]) -> int:
    epochs = {track(tracker, key, offset) for offset in offsets}
    assert len(epochs) == 1
    epoch = epochs.pop()
    assert epoch is not None
    return epoch


def test_commit_moves_only_past_contiguously_settled_offsets() -> None:
    tracker = OffsetTracker()
    tracker.assign([P0])
    epoch = track_all(tracker, P0, range(10, 15))

    assert tracker.to_commit() == {}
    for offset in (10, 11, 13, 14):  # 12 is still being retried
        assert settle(tracker, P0, offset, epoch)
    assert tracker.to_commit() == {P0: 12}  # held back at the unsettled message

    assert settle(tracker, P0, 12, epoch)
    assert tracker.to_commit() == {P0: 15}  # after the last one


def test_gaps_in_a_partition_do_not_block_it() -> None:
    tracker = OffsetTracker()
    epoch = track_all(tracker, P0, [3, 4, 7, 9])  # compaction / transaction markers
    for offset in (3, 4, 7, 9):
        settle(tracker, P0, offset, epoch)
    assert tracker.to_commit() == {P0: 10}


def test_committed_offsets_are_not_committed_again() -> None:
    tracker = OffsetTracker()
    epoch = track_all(tracker, P0, range(3))
    for offset in range(3):
        settle(tracker, P0, offset, epoch)
    tracker.committed({P0: 3})
    assert tracker.to_commit() == {}
    assert tracker.committed_offset(P0) == 3
    epoch = track_all(tracker, P0, range(3, 5))
    settle(tracker, P0, 3, epoch)
    assert tracker.to_commit() == {P0: 4}


def test_partitions_are_independent() -> None:
    tracker = OffsetTracker()
    e0 = track_all(tracker, P0, range(5))
    e1 = track_all(tracker, P1, range(5))
    settle(tracker, P1, 0, e1)
    settle(tracker, P1, 1, e1)
    settle(tracker, P0, 1, e0)  # offset 0 of P0 not settled
    assert tracker.to_commit() == {P1: 2}


def test_revoke_returns_uncommitted_offsets_and_ignores_later_settles() -> None:
    tracker = OffsetTracker()
    tracker.assign([P0, P1])
    e0 = track_all(tracker, P0, range(4))
    settle(tracker, P0, 0, e0)
    settle(tracker, P0, 1, e0)

    assert tracker.revoke([P0]) == {P0: 2}
    # In-flight work of the revoked partition must never move its offset.
    assert not settle(tracker, P0, 2, e0)
    assert tracker.current_epochs([(P0, e0)]) == [False]
    assert tracker.to_commit() == {}
    assert tracker.partitions == [P1]


def test_reassignment_starts_a_new_epoch() -> None:
    tracker = OffsetTracker()
    tracker.assign([P0])
    old = track_all(tracker, P0, range(3))
    tracker.revoke([P0])
    tracker.assign([P0])
    new = track_all(tracker, P0, range(0, 3))  # fetched again from the committed offset
    assert new != old
    assert not settle(tracker, P0, 0, old)
    assert settle(tracker, P0, 0, new)
    assert tracker.to_commit() == {P0: 1}


def test_rewind_drops_later_deliveries_and_refetches_from_the_unsettled_offset() -> None:
    tracker = OffsetTracker()
    epoch = track_all(tracker, P0, range(10))
    for offset in (0, 1, 2, 4, 5):
        settle(tracker, P0, offset, epoch)

    # Offset 3's dead-letter publish failed: fetch it (and what followed) again.
    assert tracker.request_rewind(P0, 3, epoch)
    assert tracker.current_epochs([(P0, epoch)]) == [False]
    assert track(tracker, P0, 6) is None  # fetched before the seek: dropped
    rewinds = tracker.take_rewinds()
    assert [(r.partition, r.offset) for r in rewinds] == [(P0, 3)]
    assert tracker.take_rewinds() == []
    assert tracker.to_commit() == {P0: 3}

    again = track_all(tracker, P0, range(3, 10))
    for offset in range(3, 10):
        assert settle(tracker, P0, offset, again)
    assert tracker.to_commit() == {P0: 10}


def test_rewind_of_an_old_epoch_is_ignored() -> None:
    tracker = OffsetTracker()
    epoch = track_all(tracker, P0, range(3))
    tracker.revoke([P0])
    assert not tracker.request_rewind(P0, 1, epoch)
    assert tracker.take_rewinds() == []


def test_a_position_that_moves_back_starts_a_new_epoch() -> None:
    tracker = OffsetTracker()
    old = track_all(tracker, P0, range(5, 10))
    settle(tracker, P0, 5, old)
    again = track(tracker, P0, 6)  # the consumer's fetch position was reset to 6
    assert again is not None and again != old
    assert not settle(tracker, P0, 7, old)  # in-flight work of before is dropped
    assert settle(tracker, P0, 6, again)
    assert tracker.to_commit() == {P0: 7}


def test_settle_twice_or_unknown_offset_is_ignored() -> None:
    tracker = OffsetTracker()
    epoch = track_all(tracker, P0, range(2))
    assert settle(tracker, P0, 0, epoch)
    assert not settle(tracker, P0, 0, epoch)
    assert not settle(tracker, P0, 99, epoch)
    assert tracker.to_commit() == {P0: 1}


def test_concurrent_settles_in_random_order_end_at_the_last_offset() -> None:
    tracker = OffsetTracker()
    epoch = track_all(tracker, P0, range(20_000))
    offsets = list(range(20_000))
    random.Random(7).shuffle(offsets)
    chunks = [offsets[i::4] for i in range(4)]
    threads = [
        threading.Thread(target=lambda c=c: [settle(tracker, P0, o, epoch) for o in c])
        for c in chunks
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert tracker.to_commit() == {P0: 20_000}


def test_batch_calls_take_one_lock_and_answer_as_the_single_ones() -> None:
    """The poll thread tracks a partition's records at once, the worker settles and
    checks a batch at once: the same answers as record by record."""
    single, batched = OffsetTracker(redelivery_window=3), OffsetTracker(redelivery_window=3)
    for tracker in (single, batched):
        tracker.assign([P0, P1])
    one_by_one = [single.track_many(P0, [offset])[0] for offset in range(100, 106)]
    tracked = batched.track_many(P0, range(100, 106))
    assert tracked == one_by_one
    assert [t[1] for t in tracked if t is not None] == [True, True, True, False, False, False]
    [p1_first] = batched.track_many(P1, [7])
    assert tracked[0] is not None and p1_first is not None
    p0_epoch, p1_epoch = tracked[0][0], p1_first[0]

    assert batched.request_rewind(P1, 7, p1_epoch)  # a rewind pending: P1's records wait
    assert batched.track_many(P1, [8, 9]) == [None, None]
    wanted = [(P0, p0_epoch), (P1, p1_epoch), (("other", 0), 1)]
    assert batched.current_epochs(wanted) == [True, False, False]
    settled = [(P0, offset, p0_epoch) for offset in (100, 101, 103)] + [(P1, 7, p1_epoch)]
    assert batched.settle_many(settled) == 3  # the old P1 epoch is ignored
    assert batched.to_commit() == {P0: 102}


def test_settle_many_in_any_order_commits_only_past_the_first_unsettled_offset() -> None:
    """Batches settled in order take the fast path (the partition's next offset pops at
    once); out-of-order ones must still hold the partition back until the gap closes."""
    rng = random.Random(11)
    for _ in range(50):
        tracker = OffsetTracker()
        offsets = [0, 1, 2, 5, 6, 9, 10, 11, 12, 20]  # gaps (compaction) do not block
        epoch = track_all(tracker, P0, offsets)
        order = offsets[:]
        if rng.random() < 0.7:
            rng.shuffle(order)
        done: set[int] = set()
        while order:
            batch = order[: rng.randint(1, 4)]
            order = order[len(batch) :]
            assert tracker.settle_many([(P0, o, epoch) for o in batch]) == len(batch)
            done.update(batch)
            unsettled = [o for o in offsets if o not in done]
            prefix = [o for o in offsets if not unsettled or o < unsettled[0]]
            # committable: the offset after the last contiguously settled delivery
            assert tracker.to_commit().get(P0) == (prefix[-1] + 1 if prefix else None)
        assert tracker.settle_many([(P0, 0, epoch)]) == 0  # settled already

"""Kafka has no redelivered flag: the offset tracker marks records that may come again."""

from __future__ import annotations

from mqdedup.kafka.offsets import OffsetTracker

P0 = ("orders", 0)
P1 = ("orders", 1)


def marks(tracker: OffsetTracker, key: tuple[str, int], offsets: range) -> list[int]:
    """Offsets tracked as possibly redelivered."""
    flagged = []
    for offset, tracked in zip(offsets, tracker.track_many(key, offsets), strict=True):
        assert tracked is not None
        if tracked[1]:
            flagged.append(offset)
    return flagged


def test_the_first_records_after_an_assignment_may_be_redelivered() -> None:
    tracker = OffsetTracker(redelivery_window=5)
    tracker.assign([P0, P1])
    assert marks(tracker, P0, range(100, 110)) == list(range(100, 105))
    assert marks(tracker, P1, range(0, 3)) == [0, 1, 2]
    assert marks(tracker, P1, range(3, 8)) == [3, 4]


def test_a_partition_kept_across_a_rebalance_is_not_marked_again() -> None:
    tracker = OffsetTracker(redelivery_window=2)
    tracker.assign([P0])
    assert marks(tracker, P0, range(0, 4)) == [0, 1]
    # A rebalance that keeps P0 (eager protocol) does not re-assign it in the tracker.
    assert marks(tracker, P0, range(4, 8)) == []
    # A fresh assignment (it went elsewhere and came back) starts a new window.
    tracker.revoke([P0])
    tracker.assign([P0])
    assert marks(tracker, P0, range(6, 10)) == [6, 7]


def test_records_fetched_again_after_a_rewind_are_marked() -> None:
    tracker = OffsetTracker(redelivery_window=0)
    tracker.assign([P0])
    epoch = None
    for offset in range(10):
        [tracked] = tracker.track_many(P0, [offset])
        assert tracked is not None and tracked[1] is False
        epoch = tracked[0]
    assert epoch is not None
    # offset 3's dead letter could not be published: the partition is rewound to it
    assert tracker.request_rewind(P0, 3, epoch)
    assert [r.offset for r in tracker.take_rewinds()] == [3]
    assert marks(tracker, P0, range(3, 12)) == list(range(3, 10))


def test_a_fetch_position_that_moved_back_marks_what_comes_again() -> None:
    tracker = OffsetTracker()
    assert marks(tracker, P0, range(0, 6)) == []
    assert marks(tracker, P0, range(2, 8)) == [2, 3, 4, 5]


def test_without_a_window_nothing_is_marked() -> None:
    tracker = OffsetTracker()
    tracker.assign([P0])
    assert marks(tracker, P0, range(0, 50)) == []


def test_after_a_clean_stop_nothing_is_marked() -> None:
    tracker = OffsetTracker(redelivery_window=5)
    tracker.assign([P0])
    tracker.expect_clean(P0)
    assert marks(tracker, P0, range(0, 10)) == []
    # expect_clean only applies before the first record of an assignment
    tracker.revoke([P0])
    tracker.assign([P0])
    assert marks(tracker, P0, range(10, 12)) == [10, 11]
    tracker.expect_clean(P0)
    assert marks(tracker, P0, range(12, 20)) == [12, 13, 14]


def test_a_graceful_stop_is_clean_unless_a_rewound_delivery_is_unsettled() -> None:
    tracker = OffsetTracker()
    tracker.assign([P0, P1])
    epochs = {}
    for key in (P0, P1):
        for offset in range(5):
            [tracked] = tracker.track_many(key, [offset])
            assert tracked is not None
            epochs[key] = tracked[0]
    for offset in range(5):
        tracker.settle_many([(P0, offset, epochs[P0])])
    for offset in range(2):
        tracker.settle_many([(P1, offset, epochs[P1])])
    # P1's offset 2 could not be dead-lettered: rewound, unsettled at the stop
    assert tracker.request_rewind(P1, 2, epochs[P1])
    assert tracker.clean_offsets() == {P0: 5}
    tracker.committed({P0: 5})
    assert tracker.clean_offsets() == {P0: 5}  # committed already: still reported clean

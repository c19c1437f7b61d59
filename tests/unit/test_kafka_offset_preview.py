"""``OffsetTracker.preview``: the offset stored in the database with a batch's effects
(``offsets_in_database``) is the committable offset *if* the batch were settled."""

from __future__ import annotations

from mqdedup.kafka.offsets import OffsetTracker

KEY = ("orders", 0)


def tracked(offsets: list[int]) -> tuple[OffsetTracker, int]:
    tracker = OffsetTracker()
    [(epoch, _)] = {track for track in tracker.track_many(KEY, offsets) if track}
    return tracker, epoch


def test_a_record_not_done_holds_the_offset_and_later_ones_stay_above() -> None:
    tracker, _epoch = tracked([0, 1, 2, 3, 4])
    assert tracker.preview(KEY, {0, 1, 3, 4}) == (2, [3, 4])
    assert tracker.to_commit() == {}  # nothing settled by a preview


def test_gaps_in_a_partition_do_not_hold_it() -> None:
    tracker, _epoch = tracked([10, 11, 14, 15])  # 12, 13: transaction markers, say
    assert tracker.preview(KEY, {10, 11, 14, 15}) == (16, [])


def test_settled_records_and_those_below_the_stored_offset_count_as_done() -> None:
    tracker, epoch = tracked([0, 1, 2, 3])
    tracker.settle_many([(KEY, 1, epoch)])  # settled out of order: 0 still pending
    assert tracker.preview(KEY, {2}) == (None, [1, 2])
    assert tracker.preview(KEY, {2}, done_below=1) == (3, [])


def test_an_unknown_partition_has_nothing_to_preview() -> None:
    assert OffsetTracker().preview(KEY, {1}) == (None, [])

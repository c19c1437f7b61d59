"""``tune_gc``: what a worker or relay process does to the garbage collector once set up."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from mqdedup import tune_gc
from mqdedup.gc_tuning import ENV, THRESHOLDS


@pytest.fixture
def restored_gc() -> Iterator[None]:
    """CPython's settings back after the test (the suite's process goes on)."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_the_objects_of_a_set_up_process_are_frozen_and_young_collections_are_rarer(
    restored_gc: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert tune_gc() is True
    assert gc.get_threshold() == THRESHOLDS
    assert gc.get_freeze_count() > 10_000  # the modules, caches and objects loaded so far
    # A full collection no longer walks them: the tracked objects left are few.
    assert len(gc.get_objects()) < gc.get_freeze_count() / 10


def test_default_keeps_cpythons_settings(
    restored_gc: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "default")
    before = gc.get_threshold()
    assert tune_gc() is False
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0

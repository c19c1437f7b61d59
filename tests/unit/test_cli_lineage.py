"""The supervisor's slot lock (:mod:`mqdedup.cli.lineage`): one supervisor per slot, a
clear refusal naming the holder, separate slots for separate ``MQDEDUP_INSTANCE_HOST``
values, and no refusal when the runtime directory cannot be written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mqdedup.cli.exitcodes import RefusedError
from mqdedup.cli.lineage import Slot, lock_slots

SLOT = Slot("worker", "orders", "postgresql://u:secret@db/app", "mqdedup_")


def release(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def test_a_second_lock_of_the_same_slot_is_refused_naming_the_holder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MQDEDUP_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("MQDEDUP_INSTANCE_HOST", raising=False)
    held = lock_slots([SLOT])
    try:
        with pytest.raises(RefusedError) as refused:
            lock_slots([Slot("worker", "payments", SLOT.database_url, "mqdedup_"), SLOT])
        message = str(refused.value)
        assert "another `mqdedup worker` runs orders" in message
        assert f"supervisor pid {os.getpid()}" in message and "secret" not in message
        assert len(list(tmp_path.iterdir())) == 2  # the payments lock was let go again
        other = lock_slots([Slot("relay", "orders", SLOT.database_url, "mqdedup_")])
        release(other)  # another command, another slot
    finally:
        release(held)
    release(lock_slots([SLOT]))  # free again once the holder let go


def test_each_instance_host_is_its_own_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MQDEDUP_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("MQDEDUP_INSTANCE_HOST", "a")
    first = lock_slots([SLOT])
    monkeypatch.setenv("MQDEDUP_INSTANCE_HOST", "b")
    second = lock_slots([SLOT])
    monkeypatch.setenv("MQDEDUP_INSTANCE_HOST", "a")
    with pytest.raises(RefusedError, match="as MQDEDUP_INSTANCE_HOST=a"):
        lock_slots([SLOT])
    release(first + second)


def test_an_unwritable_runtime_directory_runs_without_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MQDEDUP_RUNTIME_DIR", str(blocker / "run"))
    assert lock_slots([SLOT]) == []

"""``abandoned_on_stop``: a stop requested in the thread waiting in the block (a signal
handler interrupting it) ends the wait; nothing else does."""

from __future__ import annotations

import threading

import pytest

from mqdedup.stopping import StopToken, StopWhileWaiting, abandoned_on_stop


def test_a_stop_requested_in_the_waiting_thread_ends_the_block() -> None:
    stop = StopToken()
    expected = "stop requested while step 'charge' waited"
    with pytest.raises(StopWhileWaiting, match=expected), abandoned_on_stop("step 'charge' waited"):
        stop.request()  # what a signal handler does, in the thread it interrupted
    assert stop.requested
    assert not issubclass(StopWhileWaiting, Exception)  # a handler's `except Exception` lets it by


def test_a_stop_from_another_thread_or_outside_the_block_is_only_a_request() -> None:
    stop = StopToken()
    with abandoned_on_stop("waiting"):
        requester = threading.Thread(target=stop.request)
        requester.start()
        requester.join()
    assert stop.requested
    StopToken().request()  # outside any block: no exception


def test_the_block_is_left_clean_after_an_error() -> None:
    with pytest.raises(RuntimeError), abandoned_on_stop("waiting"):
        raise RuntimeError("boom")
    StopToken().request()  # the thread is no longer in a block

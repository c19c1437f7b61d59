"""``abandon_on_stop``: the event loop's counterpart of ``abandoned_on_stop``."""

from __future__ import annotations

import asyncio

import pytest

from mqdedup.stopping import StopToken, StopWhileWaiting, abandon_on_stop


def test_a_stop_requested_during_the_wait_cancels_it_and_raises() -> None:
    cancelled: list[bool] = []

    async def waits() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return "never"

    async def scenario() -> None:
        stop = StopToken()
        asyncio.get_running_loop().call_later(0.01, stop.request)
        with pytest.raises(StopWhileWaiting, match="stop requested while the checkout"):
            await abandon_on_stop(waits(), "the checkout")

    asyncio.run(scenario())
    assert cancelled == [True]


def test_without_a_stop_its_result_or_error_is_the_awaitables() -> None:
    async def fails() -> None:
        raise ValueError("refused")

    async def scenario() -> None:
        assert await abandon_on_stop(asyncio.sleep(0.06, "done"), "w") == "done"
        with pytest.raises(ValueError, match="refused"):
            await abandon_on_stop(fails(), "w")

    asyncio.run(scenario())


def test_a_stop_requested_before_the_wait_does_not_end_it() -> None:
    async def scenario() -> None:
        StopToken().request()
        assert await abandon_on_stop(asyncio.sleep(0.12, "done"), "w") == "done"

    asyncio.run(scenario())


def test_cancelling_the_waiter_cancels_the_wait() -> None:
    inner = asyncio.Event()

    async def waits() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            inner.set()
            raise

    async def scenario() -> None:
        waiter = asyncio.ensure_future(abandon_on_stop(waits(), "w"))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.wait_for(inner.wait(), 5)

    asyncio.run(scenario())

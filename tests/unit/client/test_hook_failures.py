"""An exception raised by a context hook reaches the application: the loop's exception handler hears of it
(with the hook and the exception), in the thread-pool and the inline mode, and the client carries on."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from waltz import AsyncWaltzClient
from waltz.testing import MockDriver

from .helpers import FAST, Ctx, recording_callbacks


class BrokenCompletion(Ctx):
    def on_completion(self, result: bool) -> None:
        super().on_completion(result)
        raise ValueError("the application's bug")


@pytest.mark.parametrize("mode", ["threads", "inline"])
def test_a_hook_that_raises_is_reported_to_the_loops_exception_handler(mode: str) -> None:
    async def main() -> None:
        heard: list[dict[str, Any]] = []
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: heard.append(context))
        client = AsyncWaltzClient(
            recording_callbacks(mode), FAST.replace(callback_mode=mode), driver=MockDriver()
        )
        async with client:
            broken = BrokenCompletion(b"a")
            await client.submit(broken)
            fine = Ctx(b"b")
            await client.submit(fine)
            await client.flush_transactions(timeout=5)
            async with asyncio.timeout(5):
                while not heard:  # noqa: ASYNC110 - the report hops from a pool thread in threads mode
                    await asyncio.sleep(0.005)
        assert len(heard) == 1
        assert isinstance(heard[0]["exception"], ValueError)
        assert heard[0]["waltz_hook"] == broken.on_completion
        assert "on_completion raised" in heard[0]["message"]
        # The failed hook ended nothing else: both contexts were applied, in order.
        assert broken.events == ["completion:True", "application"]
        assert fine.events == ["completion:True", "application"]

    asyncio.run(main())


def test_the_sync_client_hands_hook_failures_to_its_handler() -> None:
    import threading

    from waltz import WaltzClient

    heard: list[dict[str, Any]] = []
    got = threading.Event()

    def handler(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        heard.append(context)
        got.set()

    client = WaltzClient(recording_callbacks("threads"), FAST, driver=MockDriver())
    try:
        client.set_exception_handler(handler)
        broken = BrokenCompletion(b"a")
        client.submit(broken)
        assert got.wait(5)
    finally:
        client.close()
    assert isinstance(heard[0]["exception"], ValueError)
    assert heard[0]["waltz_hook"] == broken.on_completion

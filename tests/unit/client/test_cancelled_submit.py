"""A ``submit`` cancelled while its first attempt runs drops the context and gives its slot back (the
lifecycle's DROP), whether ``execute`` ran on a callback thread or was a coroutine awaited on the loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from waltz import AsyncWaltzClient, TransactionBuilder
from waltz.testing import MockDriver

from .helpers import FAST, Ctx, recording_callbacks


class BlockingCtx(Ctx):
    """``execute`` blocks on its callback thread until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__(b"blocked")
        self.started = threading.Event()
        self.release = threading.Event()

    def execute(self, builder: TransactionBuilder) -> bool:
        self.started.set()
        self.release.wait(10)
        return super().execute(builder)


class AwaitingCtx(Ctx):
    """A coroutine ``execute`` (inline mode) that waits until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__(b"awaiting")
        self.release = asyncio.Event()

    def execute(self, builder: TransactionBuilder) -> Any:
        async def wait() -> bool:
            await self.release.wait()
            return True

        return wait()


def run(coro: Any) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(30):
            await coro

    asyncio.run(bounded())


def test_a_submit_cancelled_while_execute_runs_on_a_thread_gives_its_slot_back() -> None:
    async def main() -> None:
        config = FAST.replace(callback_mode="threads", max_concurrent_transactions=1)
        async with AsyncWaltzClient(recording_callbacks("threads"), config, driver=MockDriver()) as client:
            await client.wait_applied(0, -1, timeout=5)  # Mounted.
            blocked = BlockingCtx()
            submit = asyncio.ensure_future(client.submit(blocked))
            await asyncio.to_thread(blocked.started.wait, 5)
            submit.cancel()
            await asyncio.gather(submit, return_exceptions=True)
            blocked.release.set()  # execute returns on its thread: the orphaned attempt drops the context.
            other = Ctx(b"next")
            await client.submit(other)  # The one slot is free again (or this times out).
            await client.flush_transactions(timeout=5)
            assert other.events == ["completion:True", "application"]
            assert blocked.events == []  # Dropped: no hook.
            assert not client.has_pending_transactions()

    run(main())


def test_a_submit_cancelled_while_a_coroutine_execute_waits_gives_its_slot_back() -> None:
    async def main() -> None:
        config = FAST.replace(callback_mode="inline", max_concurrent_transactions=1)
        async with AsyncWaltzClient(recording_callbacks("inline"), config, driver=MockDriver()) as client:
            await client.wait_applied(0, -1, timeout=5)
            waiting = AwaitingCtx()
            submit = asyncio.ensure_future(client.submit(waiting))
            await asyncio.sleep(0.01)
            assert not submit.done()
            submit.cancel()
            await asyncio.gather(submit, return_exceptions=True)
            other = Ctx(b"next")
            await client.submit(other)
            await client.flush_transactions(timeout=5)
            assert other.events == ["completion:True", "application"]
            assert waiting.events == []

    run(main())

"""``applied_high_water_mark`` and ``wait_applied``: what the client counts as applied, which is what the next
``execute`` gets, lags the application's own state by the end of an ``apply_transaction`` call; an
application that polls its state waits that gap out instead of taking a false lock conflict."""

from __future__ import annotations

import asyncio
import threading

import pytest

from waltz import AsyncWaltzClient, ClientCallbacks, Transaction, WaltzClient
from waltz.errors import ClientAheadError, ClientClosedError, ClientError, ClientTimeoutError
from waltz.testing import MockDriver

from .helpers import FAST, Ctx, RecordingCallbacks


class GatedCounter(ClientCallbacks):
    """Records each transaction in ``seen`` (the application's state) as soon as ``apply_transaction``
    starts, then holds the call until ``release`` (so the state is ahead of the client for a while)."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}
        self.gate = threading.Event()

    def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    def apply_transaction(self, transaction: Transaction) -> None:
        self.seen[transaction.partition_id] = transaction.transaction_id
        if not self.gate.wait(10):
            raise TimeoutError("the test never released apply_transaction")

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        raise AssertionError(f"apply of {transaction_id} failed: {exception!r}")


class AsyncGatedCounter(GatedCounter):
    """:class:`GatedCounter` for ``callbackMode: inline`` (the gate awaited on the loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.async_gate = asyncio.Event()

    def release(self) -> None:
        self.async_gate.set()

    async def apply_transaction(self, transaction: Transaction) -> None:  # type: ignore[override]
        self.seen[transaction.partition_id] = transaction.transaction_id
        async with asyncio.timeout(10):
            await self.async_gate.wait()


async def _until(predicate: object, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # type: ignore[operator]  # noqa: ASYNC110 - state on callback threads
            await asyncio.sleep(0.002)


@pytest.mark.parametrize("mode", ["threads", "inline"])
def test_wait_applied_returns_once_apply_transaction_returned_not_when_the_state_changed(mode: str) -> None:
    async def main() -> None:
        callbacks = AsyncGatedCounter() if mode == "inline" else GatedCounter()
        client = AsyncWaltzClient(callbacks, FAST.replace(callback_mode=mode), driver=MockDriver())
        async with client:
            await client.wait_applied(0, -1, timeout=5)  # mounted from the application's mark
            assert client.applied_high_water_mark(0) == -1
            await client.submit(Ctx(b"a"))
            await _until(lambda: callbacks.seen.get(0) == 0)
            # The application's state shows transaction 0; the client does not count it as applied yet (an
            # execute now would carry -1 and fail its lock check against 0).
            assert client.applied_high_water_mark(0) == -1
            with pytest.raises(ClientTimeoutError, match="transaction 0 not applied"):
                await client.wait_applied(0, 0, timeout=0.05)
            waiter = asyncio.ensure_future(client.wait_applied(0, 0, timeout=5))
            await asyncio.sleep(0.02)
            assert not waiter.done()
            if isinstance(callbacks, AsyncGatedCounter):
                callbacks.release()
            else:
                callbacks.gate.set()
            await waiter
            assert client.applied_high_water_mark(0) == 0
            with pytest.raises(ClientError, match="partition 3 is not mounted"):
                client.applied_high_water_mark(3)
            with pytest.raises(ClientError, match="partition 3 is not mounted"):
                await client.wait_applied(3, 0)

    asyncio.run(main())


def test_a_wait_for_a_transaction_that_never_comes_ends_with_the_client() -> None:
    async def main() -> None:
        callbacks = GatedCounter()
        client = AsyncWaltzClient(callbacks, FAST, driver=MockDriver())
        await client.start()
        waiter = asyncio.ensure_future(client.wait_applied(0, 5))
        await asyncio.sleep(0.02)
        await client.close()
        with pytest.raises(ClientClosedError):
            await waiter
        with pytest.raises(ClientClosedError):
            await client.wait_applied(0, 5)

    asyncio.run(main())


def test_a_wait_past_the_mark_of_a_partition_whose_client_is_ahead_ends_with_client_ahead() -> None:
    """CLIENT_AHEAD is terminal for the mount: nothing past the application's own mark will be fed, so a wait
    for more ends with the partition's error (as a submit does), not with a timeout, nor never."""

    async def main() -> None:
        client = AsyncWaltzClient(RecordingCallbacks({0: 5}), FAST, driver=MockDriver())
        async with client:
            waiter = asyncio.ensure_future(client.wait_applied(0, 6))  # waits from before the mount
            async with asyncio.timeout(5):
                with pytest.raises(ClientAheadError, match="partition 0"):
                    await waiter
                with pytest.raises(ClientAheadError, match="partition 0"):
                    await client.wait_applied(0, 6, timeout=5)
            # What the application's own mark covers is applied, ahead or not.
            await client.wait_applied(0, 5, timeout=0)
            assert client.applied_high_water_mark(0) == 5

    asyncio.run(main())


def test_the_sync_client_reads_the_applied_mark_from_any_thread_and_waits_for_it() -> None:
    callbacks = GatedCounter()
    with WaltzClient(callbacks, FAST, driver=MockDriver()) as client:
        client.wait_applied(0, -1, timeout=5)
        client.submit(Ctx(b"a"))
        deadline = threading.Event()
        for _ in range(500):
            if callbacks.seen.get(0) == 0:
                break
            deadline.wait(0.01)
        assert callbacks.seen.get(0) == 0
        assert client.applied_high_water_mark(0) == -1
        with pytest.raises(ClientTimeoutError):
            client.wait_applied(0, 0, timeout=0.05)
        callbacks.gate.set()
        client.wait_applied(0, 0, timeout=5)
        assert client.applied_high_water_mark(0) == 0

"""One append at a time: the append leaves at once (``send_append_now``) and, in inline mode, the task woken
by ``on_completion`` runs before the applier, so the next append goes out before the previous one is
applied."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from waltz import AsyncWaltzClient, Transaction
from waltz.client.builder import TransactionBuilder
from waltz.client.driver import DriverListener
from waltz.protocol.records import ReqId
from waltz.testing import MockDriver

from .helpers import FAST, ApplyOrderCallbacks, Ctx

pytestmark = pytest.mark.timeout(30)


class SendRecordingDriver(MockDriver):
    """Records which of the two send calls the core made for each append."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sends: list[str] = []

    def send_append(self, partition_id: int, req_id: ReqId, builder: TransactionBuilder, now: bool) -> None:
        self.sends.append("now" if now else "queued")
        super().send_append(partition_id, req_id, builder, now)


class _NowaitListener:
    """The client's listener as the network driver uses it: a feed entry goes to ``feed_run_nowait``
    first (from the socket reader, no coroutine), ``on_feed_data`` only when that has no room."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    async def on_feed_data(self, partition_id: int, transaction_id: int, req_id: Any, header: int) -> None:
        if self._inner.feed_run_nowait(partition_id, [(transaction_id, req_id, header)]) != 1:
            await self._inner.on_feed_data(partition_id, transaction_id, req_id, header)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class NowaitDriver(MockDriver):
    async def open(self, listener: DriverListener) -> None:
        await super().open(_NowaitListener(listener))


@pytest.mark.parametrize("mode", ["inline", "threads"])
def test_a_lone_append_is_sent_at_once_and_pipelined_ones_are_queued(mode: str) -> None:
    async def main() -> None:
        driver = SendRecordingDriver()
        client = AsyncWaltzClient(ApplyOrderCallbacks([]), FAST.replace(callback_mode=mode), driver=driver)
        async with client:
            for _ in range(3):  # one at a time
                await client.submit(Ctx(b"x"))
                await client.flush_transactions(timeout=5)
            assert driver.sends == ["now"] * 3
            del driver.sends[:]
            driver.suspend_feed()  # nothing commits until all four are in flight
            for _ in range(4):  # pipelined: only the first finds nothing else in flight
                await client.submit(Ctx(b"y"))
            driver.resume_feed()
            await client.flush_transactions(timeout=5)
            assert driver.sends == ["now", "queued", "queued", "queued"]

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["inline", "threads"])
def test_appends_alone_on_their_partitions_but_not_on_the_client_are_queued(mode: str) -> None:
    # With many partitions nearly every append is alone on its own partition: each used to leave in its own
    # socket write. Alone means alone on the client.
    async def main() -> None:
        driver = SendRecordingDriver(num_partitions=4)
        client = AsyncWaltzClient(ApplyOrderCallbacks([]), FAST.replace(callback_mode=mode), driver=driver)
        async with client:
            await client.submit(Ctx(b"w", 0))  # warm-up: the first submit may wait for the mount
            await client.flush_transactions(timeout=5)
            del driver.sends[:]
            driver.suspend_feed()
            for partition in range(4):
                await client.submit(Ctx(b"y", partition))
            driver.resume_feed()
            await client.flush_transactions(timeout=5)
            assert driver.sends == ["now", "queued", "queued", "queued"]
            del driver.sends[:]
            for partition in (3, 1):  # the count went back to nothing in flight
                await client.submit(Ctx(b"z", partition))
                await client.flush_transactions(timeout=5)
            assert driver.sends == ["now", "now"]

    asyncio.run(main())


class _SignallingCtx(Ctx):
    def __init__(self, data: bytes, done: asyncio.Future[bool], events: list[str]) -> None:
        super().__init__(data)
        self.done = done
        self.shared = events

    def on_completion(self, result: bool) -> None:
        super().on_completion(result)
        self.shared.append("completion")
        self.done.set_result(result)

    def on_application(self) -> None:
        super().on_application()
        self.shared.append("application")


def test_inline_the_task_woken_by_on_completion_runs_before_the_transaction_is_applied() -> None:
    async def main() -> None:
        events: list[str] = []
        client = AsyncWaltzClient(
            ApplyOrderCallbacks(events), FAST.replace(callback_mode="inline"), driver=NowaitDriver()
        )
        loop = asyncio.get_running_loop()
        async with client:
            await client.submit(Ctx(b"w"))  # warm-up: the first submit may wait for the mount
            await client.flush_transactions(timeout=5)
            del events[:]
            for i in range(1, 4):
                done: asyncio.Future[bool] = loop.create_future()
                await client.submit(_SignallingCtx(b"x", done, events))
                assert await done
                events.append("woken")  # here a lone-append application sends its next append
                await client.flush_transactions(timeout=5)
                assert events[4 * (i - 1) :] == ["completion", "woken", f"apply:{i}", "application"], events

    asyncio.run(main())


def test_inline_on_application_runs_in_the_loop_iteration_that_applied_its_transaction() -> None:
    async def main() -> None:
        events: list[str] = []
        loop = asyncio.get_running_loop()

        class MarkingCallbacks(ApplyOrderCallbacks):
            def apply_transaction(self, transaction: Transaction) -> None:
                super().apply_transaction(transaction)
                # Runs at the start of the next loop iteration: a hook run after it waited a loop pass.
                loop.call_soon(events.append, "next iteration")

        client = AsyncWaltzClient(
            MarkingCallbacks(events), FAST.replace(callback_mode="inline"), driver=NowaitDriver()
        )
        async with client:
            await client.submit(Ctx(b"w"))
            await client.flush_transactions(timeout=5)
            del events[:]
            done: asyncio.Future[bool] = loop.create_future()
            await client.submit(_SignallingCtx(b"x", done, events))
            await client.flush_transactions(timeout=5)
            assert events == ["completion", "apply:1", "application", "next iteration"], events

    asyncio.run(main())


class _CoroutineCtx(Ctx):
    """Coroutine hooks that yield to the loop (inline mode awaits them, in order)."""

    def __init__(self, name: str, events: list[str]) -> None:
        super().__init__(name.encode())
        self.name = name
        self.shared = events

    async def on_completion(self, result: bool) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        self.shared.append(f"completion:{self.name}")

    async def on_application(self) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        self.shared.append(f"application:{self.name}")


def test_inline_coroutine_hooks_keep_their_order_alone_and_pipelined() -> None:
    async def main() -> None:
        events: list[str] = []
        client = AsyncWaltzClient(
            ApplyOrderCallbacks(events), FAST.replace(callback_mode="inline"), driver=NowaitDriver()
        )
        async with client:
            await client.submit(Ctx(b"w"))
            await client.flush_transactions(timeout=5)
            del events[:]
            await client.submit(_CoroutineCtx("a", events))  # alone
            await client.flush_transactions(timeout=5)
            # A coroutine on_completion may still be running when the transaction is applied (as a hook on
            # a callback thread may): only on_application waits for both.
            assert sorted(events[:2]) == ["apply:1", "completion:a"], events
            assert events[2:] == ["application:a"], events
            del events[:]
            for name in ("b", "c", "d"):  # pipelined
                await client.submit(_CoroutineCtx(name, events))
            await client.flush_transactions(timeout=5)
        hooks = [e for e in events if not e.startswith("apply")]
        assert [e for e in hooks if e.startswith("completion")] == [
            "completion:b",
            "completion:c",
            "completion:d",
        ]
        assert [e for e in hooks if e.startswith("application")] == [
            "application:b",
            "application:c",
            "application:d",
        ]
        for name, tid in (("b", 2), ("c", 3), ("d", 4)):
            assert events.index(f"completion:{name}") < events.index(f"application:{name}")
            assert events.index(f"apply:{tid}") < events.index(f"application:{name}")

    asyncio.run(main())

"""Retry on knowledge: a lock failure is retried as soon as the conflicting transaction is applied (no
backoff), and this client's own contexts take turns on a write lock instead of failing each other."""

from __future__ import annotations

import asyncio

import pytest

from waltz import PartitionLocalLock
from waltz.testing import MockCluster, MockDriver

from .helpers import Ctx
from .test_async_client import client_with, data_of, run, wait_until

LOCK = PartitionLocalLock("account", 1)
SLOW_BACKOFF = {"retry_initial_backoff_ms": 3000, "retry_max_backoff_ms": 3000}
"""A backoff longer than the tests' waits: a retry that slept it would time the test out."""


@pytest.mark.parametrize("mode", ["threads", "inline"])
def test_a_lock_failure_is_retried_once_the_conflicting_transaction_is_applied_no_backoff(mode: str) -> None:
    cluster = MockCluster()
    other, mine = MockDriver(0, cluster), MockDriver(1, cluster)

    async def main() -> None:
        writer, _ = client_with(other, callback_mode=mode)
        client, _ = client_with(mine, callback_mode=mode, **SLOW_BACKOFF)
        async with writer, client:
            await wait_until(lambda: client._partitions[0].state is not None)
            mine.suspend_feed()  # This client does not see the other's transaction yet.
            first = Ctx(b"a", write=(LOCK,))
            await writer.submit(first)
            await wait_until(first.finished.is_set)
            ctx = Ctx(b"b", write=(LOCK,))
            await client.submit(ctx)
            await wait_until(lambda: mine.lock_failures == 1)
            await asyncio.sleep(0.05)
            assert ctx.executions == 1  # Held back until this client has applied transaction 0.
            mine.resume_feed()
            await client.flush_transactions(timeout=1.0)  # Far below the 3 s backoff.
            assert ctx.hwms_seen == [-1, 0]
            assert ctx.events == ["lock_failure", "completion:True", "application"]
            assert data_of(cluster) == [b"a", b"b"]

    run(main())


@pytest.mark.parametrize("mode", ["threads", "inline"])
def test_own_contexts_on_one_write_lock_take_turns_without_a_lock_failure(mode: str) -> None:
    driver = MockDriver()

    async def main() -> None:
        client, _ = client_with(driver, callback_mode=mode, **SLOW_BACKOFF)
        async with client:
            await wait_until(lambda: client._partitions[0].state is not None)
            driver.suspend_feed()
            a, b = Ctx(b"a", write=(LOCK,)), Ctx(b"b", write=(LOCK,))
            await client.submit(a)
            await client.submit(b)  # Returns: queued behind "a" counts as accepted.
            await asyncio.sleep(0.05)
            assert b.executions == 1  # Executed once, then queued: nothing sent.
            driver.resume_feed()
            await client.flush_transactions(timeout=2)
            assert driver.lock_failures == 0
            assert a.hwms_seen == [-1]
            assert b.hwms_seen == [-1, 0]  # Executed again after "a" (id 0) was applied.
            assert b.events == ["completion:True", "application"]
            assert data_of(driver.cluster) == [b"a", b"b"]

    run(main())


@pytest.mark.parametrize("mode", ["threads", "inline"])
def test_contexts_queued_on_one_key_commit_in_submit_order(mode: str) -> None:
    driver = MockDriver()

    async def main() -> None:
        client, _ = client_with(driver, callback_mode=mode, max_concurrent_transactions=64, **SLOW_BACKOFF)
        async with client:
            contexts = [Ctx(str(i).encode(), write=(LOCK,)) for i in range(40)]
            for ctx in contexts:
                await client.submit(ctx)
            await client.flush_transactions(timeout=10)
            assert driver.lock_failures == 0
            # FIFO turns: nobody is overtaken, so nobody starves.
            assert data_of(driver.cluster) == [str(i).encode() for i in range(40)]
            for i, ctx in enumerate(contexts):
                assert ctx.events == ["completion:True", "application"]
                assert ctx.hwms_seen[-1] == i - 1

    run(main())


def test_a_context_that_drops_the_lock_passes_its_turn_on() -> None:
    driver = MockDriver()

    class Fickle(Ctx):
        def execute(self, builder):  # type: ignore[no-untyped-def]
            if self.executions >= 1:
                self.write = ()  # Second time round it needs no lock at all.
            return super().execute(builder)

    async def main() -> None:
        client, _ = client_with(driver, **SLOW_BACKOFF)
        async with client:
            await wait_until(lambda: client._partitions[0].state is not None)
            driver.suspend_feed()
            a, b, c = Ctx(b"a", write=(LOCK,)), Fickle(b"b", write=(LOCK,)), Ctx(b"c", write=(LOCK,))
            for ctx in (a, b, c):
                await client.submit(ctx)
            driver.resume_feed()
            await client.flush_transactions(timeout=2)
            assert driver.lock_failures == 0
            assert sorted(data_of(driver.cluster)) == [b"a", b"b", b"c"]
            assert c.events == ["completion:True", "application"]

    run(main())

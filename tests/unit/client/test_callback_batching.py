"""The callback pool and the core's batched dispatch: one thread hop per submit, hooks and applies in batches,
and the threading guarantees unchanged (hooks once each and in order per context, applies sequential and in
id order per partition, never on the event loop)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from waltz import AsyncWaltzClient, Transaction
from waltz.client.builder import TransactionBuilder
from waltz.client.pool import CallbackPool
from waltz.testing import MockDriver

from .helpers import FAST, Ctx, RecordingCallbacks


def run(coro: Any, timeout_s: float = 30.0) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(timeout_s):
            return await coro

    return asyncio.run(bounded())


# -- CallbackPool ------------------------------------------------------------------------------------------


def test_pool_returns_results_and_exceptions_on_the_loop_from_named_threads() -> None:
    async def main() -> None:
        pool = CallbackPool(asyncio.get_running_loop(), 3, "test-cb")
        futures = [pool.call(lambda i=i: (i, threading.current_thread().name)) for i in range(50)]
        results = await asyncio.gather(*futures)
        assert [i for i, _ in results] == list(range(50))
        assert {name for _, name in results} <= {"test-cb-0", "test-cb-1", "test-cb-2"}

        def boom() -> None:
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            await pool.call(boom)
        await asyncio.to_thread(pool.shutdown)
        assert pool.is_shut_down
        with pytest.raises(RuntimeError):
            pool.call(lambda: None)

    run(main())


def test_pool_post_runs_a_batch_in_order_on_one_thread_then_calls_back_on_the_loop() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool = CallbackPool(loop, 4)
        seen: list[tuple[int, str]] = []
        done = loop.create_future()

        def record(i: int) -> None:
            seen.append((i, threading.current_thread().name))
            if i == 2:
                raise RuntimeError("logged, and the batch goes on")

        def then() -> None:
            assert threading.current_thread() is threading.main_thread()
            done.set_result(None)

        pool.post([(record, (i,)) for i in range(6)], then=then)
        await done
        assert [i for i, _ in seen] == list(range(6))
        assert len({name for _, name in seen}) == 1
        await asyncio.to_thread(pool.shutdown)

    run(main())


def test_pool_skips_a_call_cancelled_before_it_starts_and_hands_an_orphaned_result_back() -> None:
    async def main() -> None:
        pool = CallbackPool(asyncio.get_running_loop(), 1)
        gate = threading.Event()
        ran: list[str] = []
        orphans: list[str] = []
        blocker = pool.call(gate.wait)

        def mark() -> str:
            ran.append("running")
            return "result"

        running = pool.call(mark, orphan=orphans.append)
        queued = pool.call(lambda: ran.append("queued"))
        queued.cancel()  # Not started yet: skipped.
        running.cancel()  # Not started yet either; no orphan call for a skipped job.
        gate.set()
        await blocker

        def slow() -> str:
            time.sleep(0.05)
            return "late"

        late = pool.call(slow, orphan=orphans.append)
        await asyncio.sleep(0.01)
        late.cancel()  # Already running: its result goes to the orphan handler.
        await asyncio.to_thread(pool.shutdown)
        await asyncio.sleep(0.01)
        assert ran == []
        assert orphans == ["late"]

    run(main())


# -- the core ------------------------------------------------------------------------------------------------


class OrderCallbacks(RecordingCallbacks):
    """Also checks that applies of one partition never overlap and never run on the loop's thread."""

    def __init__(self, loop_thread: threading.Thread) -> None:
        super().__init__()
        self.loop_thread = loop_thread
        self.active: dict[int, int] = {}
        self.overlaps = 0

    def apply_transaction(self, transaction: Transaction) -> None:
        assert threading.current_thread() is not self.loop_thread
        p = transaction.partition_id
        with self.lock:
            self.active[p] = self.active.get(p, 0) + 1
            if self.active[p] > 1:
                self.overlaps += 1
        try:
            time.sleep(0.0002)
            super().apply_transaction(transaction)
        finally:
            with self.lock:
                self.active[p] -= 1


class ThreadCtx(Ctx):
    """Records which thread ran each method, and the order of its hooks."""

    def __init__(self, data: bytes, partition: int, loop_thread: threading.Thread) -> None:
        super().__init__(data, partition)
        self.loop_thread = loop_thread
        self.on_loop = 0

    def _check(self) -> None:
        if threading.current_thread() is self.loop_thread:
            self.on_loop += 1

    def partition_id(self, num_partitions: int) -> int:
        self._check()
        return super().partition_id(num_partitions)

    def execute(self, builder: TransactionBuilder) -> bool:
        self._check()
        return super().execute(builder)

    def on_completion(self, result: bool) -> None:
        self._check()
        super().on_completion(result)

    def on_application(self) -> None:
        self._check()
        super().on_application()


@pytest.mark.parametrize("in_flight", [1, 5, 64])
def test_pipelined_submits_call_each_hook_once_in_order_and_apply_sequentially(in_flight: int) -> None:
    driver = MockDriver(num_partitions=3)

    async def main() -> None:
        loop_thread = threading.current_thread()
        callbacks = OrderCallbacks(loop_thread)
        config = FAST.replace(max_concurrent_transactions=in_flight, num_consumer_threads=4)
        async with AsyncWaltzClient(callbacks, config, driver=driver) as client:
            contexts = [ThreadCtx(b"t%d" % i, i % 3, loop_thread) for i in range(300)]
            # Concurrent submitters, so completions and applies arrive in bursts (batched dispatch).
            queues = [contexts[i::4] for i in range(4)]

            async def submitter(batch: list[ThreadCtx]) -> None:
                for ctx in batch:
                    await client.submit(ctx)

            await asyncio.gather(*(submitter(q) for q in queues))
            await client.flush_transactions(timeout=10)
            assert not client.has_pending_transactions()
        for ctx in contexts:
            assert ctx.events == ["completion:True", "application"], ctx.events
            assert ctx.executions == 1
            assert ctx.on_loop == 0
        assert callbacks.overlaps == 0
        assert callbacks.errors == []
        for p in range(3):
            ids = [t for t, _ in callbacks.applied[p]]
            assert ids == list(range(len(ids)))
            assert sorted(callbacks.data(p)) == sorted(c.data for c in contexts if c.partition == p)
        assert callbacks.threads
        assert all(n.startswith("waltz-callback") for n in callbacks.threads)

    run(main())


def test_a_failing_apply_in_the_middle_of_a_batch_is_reported_and_delivered_again_in_order() -> None:
    driver = MockDriver()

    async def main() -> None:
        callbacks = RecordingCallbacks()
        callbacks.fail_next[(0, 5)] = 2
        async with AsyncWaltzClient(
            callbacks, FAST.replace(max_concurrent_transactions=64), driver=driver
        ) as c:
            contexts = [Ctx(b"x%d" % i) for i in range(20)]
            for ctx in contexts:
                await c.submit(ctx)
            await c.flush_transactions(timeout=10)
        assert [e[:2] for e in callbacks.errors] == [(0, 5), (0, 5)]
        assert [t for t, _ in callbacks.applied[0]] == list(range(20))
        assert callbacks.deliveries.count((0, 5)) == 3
        assert all(ctx.events == ["completion:True", "application"] for ctx in contexts)

    run(main())


def test_one_submit_costs_one_callback_call_when_a_slot_is_free() -> None:
    driver = MockDriver()

    async def main() -> None:
        callbacks = RecordingCallbacks()
        async with AsyncWaltzClient(callbacks, FAST, driver=driver) as client:
            await client.submit(Ctx(b"zero"))  # Mounts the partition.
            await client.flush_transactions(timeout=5)
            pool = client._pool
            assert pool is not None
            calls: list[Any] = []
            original = pool.call

            def counting(fn: Any, *args: Any, **kwargs: Any) -> Any:
                calls.append(fn)
                return original(fn, *args, **kwargs)

            pool.call = counting  # type: ignore[method-assign]
            await client.submit(Ctx(b"one"))
            assert calls == [client._first_attempt]  # partition_id and execute together
            await client.flush_transactions(timeout=5)

    run(main())


def test_a_slow_first_attempt_under_back_pressure_takes_the_slow_path_and_keeps_the_limit() -> None:
    driver = MockDriver()
    driver.suspend_feed()  # Nothing commits visibly: slots stay taken until the feed resumes.

    async def main() -> None:
        callbacks = RecordingCallbacks()
        config = FAST.replace(max_concurrent_transactions=2, submit_timeout_ms=5000)
        async with AsyncWaltzClient(callbacks, config, driver=driver) as client:
            contexts = [Ctx(b"s%d" % i) for i in range(4)]
            await client.submit(contexts[0])
            await client.submit(contexts[1])
            third = asyncio.create_task(client.submit(contexts[2]))
            await asyncio.sleep(0.1)
            assert not third.done()  # Waits for a slot on the loop (the slow path).
            assert contexts[2].executions == 0
            driver.resume_feed()
            await third
            await client.submit(contexts[3])
            await client.flush_transactions(timeout=10)
        assert [c.events for c in contexts] == [["completion:True", "application"]] * 4
        assert callbacks.data(0) == [b"s0", b"s1", b"s2", b"s3"]

    run(main())

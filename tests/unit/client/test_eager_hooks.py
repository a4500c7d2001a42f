"""A coroutine hook (``async def on_completion`` / ``on_application``) takes its first step in the loop pass
that heard its append's fate, with a real task as its current task (a runner of the client's, which runs the
rest of the hook if it suspends): ``asyncio.timeout`` and ``asyncio.current_task()`` work inside it, its
exceptions reach the loop's exception handler, its context variables stay its own, and a context's hooks
still run one after the other in the documented order."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

from waltz import AsyncWaltzClient, ClientCallbacks, Transaction, TransactionBuilder, TransactionContext
from waltz.testing import MockDriver

from .helpers import FAST


def run(coro: Any, timeout_s: float = 30.0) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(timeout_s):
            return await coro

    return asyncio.run(bounded())


class AsyncApply(ClientCallbacks):
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.hwm = -1

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm

    async def apply_transaction(self, transaction: Transaction) -> None:
        self.events.append(f"apply:{transaction.transaction_id}")
        self.hwm = transaction.transaction_id

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        raise AssertionError(f"apply of {transaction_id} failed: {exception!r}")


class AsyncCtx(TransactionContext):
    def __init__(self, events: list[str] | None = None) -> None:
        super().__init__()
        self.events = events if events is not None else []

    def partition_id(self, num_partitions: int) -> int:
        return 0

    async def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_transaction_data(b"x")
        return True

    async def on_completion(self, result: bool) -> None:
        self.events.append(f"completion:{result}")

    async def on_application(self) -> None:
        self.events.append("application")


async def started(events: list[str]) -> AsyncWaltzClient:
    client = AsyncWaltzClient(AsyncApply(events), FAST, driver=MockDriver())
    await client.start()
    # The first submit may find the partition not mounted yet (the slow path, a task): warm up.
    await client.submit(AsyncCtx(events))
    await client.flush_transactions(timeout=5)
    del events[:]
    return client


def test_a_coroutine_on_completion_starts_in_the_pass_that_heard_the_commit() -> None:
    # As a plain hook in inline mode: the application hears of its lone append before the transaction is
    # applied (a task started for the hook would start after the applier's wake-up).
    async def main() -> None:
        events: list[str] = []
        client = await started(events)
        try:
            for i in range(1, 4):
                await client.submit(AsyncCtx(events))
                await client.flush_transactions(timeout=5)
                assert events[3 * (i - 1) :] == ["completion:True", f"apply:{i}", "application"], events
        finally:
            await client.close()

    run(main())


class TimeoutCtx(AsyncCtx):
    """``asyncio.timeout`` around a first step that suspends, and one that expires after a suspension."""

    def __init__(self) -> None:
        super().__init__()
        self.tasks: list[asyncio.Task[Any] | None] = []
        self.timed_out = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def on_completion(self, result: bool) -> None:
        self.tasks.append(asyncio.current_task())
        async with asyncio.timeout(5):  # Entered in the first step: it needs the current task.
            await asyncio.sleep(0)  # The first step ends here; the runner runs the rest.
            self.tasks.append(asyncio.current_task())
        try:
            async with asyncio.timeout(0.01):
                await asyncio.Event().wait()
        except TimeoutError:
            self.timed_out = True
        self.tasks.append(asyncio.current_task())
        self.done.set_result(None)


def test_asyncio_timeout_works_inside_a_coroutine_hook() -> None:
    async def main() -> None:
        events: list[str] = []
        client = await started(events)
        try:
            for _ in range(3):  # The runner's cancellation is taken back each time: the next hook works.
                ctx = TimeoutCtx()
                await client.submit(ctx)
                await asyncio.wait_for(ctx.done, 5)
                first = ctx.tasks[0]
                assert first is not None
                assert first is not asyncio.current_task()
                assert ctx.tasks == [first, first, first]
                assert ctx.timed_out
                assert not first.cancelling()
            await client.flush_transactions(timeout=5)
        finally:
            await client.close()

    run(main())


class ExpiresBeforeItsRestCtx(AsyncCtx):
    """A timeout that expires before the runner has taken on the rest of the hook (one loop pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.outcome = ""

    async def on_completion(self, result: bool) -> None:
        try:
            async with asyncio.timeout(0):
                await asyncio.sleep(1)
        except TimeoutError:
            self.outcome = "timed out"
        else:
            self.outcome = "not timed out"


def test_a_timeout_that_expires_before_the_rest_of_the_hook_runs_is_the_hooks() -> None:
    async def main() -> None:
        events: list[str] = []
        client = await started(events)
        try:
            contexts = [ExpiresBeforeItsRestCtx() for _ in range(3)]
            for ctx in contexts:
                await client.submit(ctx)
                await client.flush_transactions(timeout=5)
            assert [ctx.outcome for ctx in contexts] == ["timed out"] * 3
        finally:
            await client.close()

    run(main())


NAME: contextvars.ContextVar[str] = contextvars.ContextVar("name", default="")


class ContextVarCtx(AsyncCtx):
    def __init__(self, name: str, seen: list[tuple[str, str, str]]) -> None:
        super().__init__()
        self.name = name
        self.seen = seen

    async def on_completion(self, result: bool) -> None:
        before = NAME.get()
        NAME.set(self.name)
        await asyncio.sleep(0)
        self.seen.append((self.name, before, NAME.get()))


def test_a_hook_s_context_variables_are_its_own_across_its_first_step() -> None:
    async def main() -> None:
        events: list[str] = []
        seen: list[tuple[str, str, str]] = []
        client = await started(events)
        try:
            for name in ("a", "b", "c"):
                await client.submit(ContextVarCtx(name, seen))
            await client.flush_transactions(timeout=5)
        finally:
            await client.close()
        # Each hook started with the caller's value (none) and kept its own after suspending.
        assert sorted(seen) == [("a", "", "a"), ("b", "", "b"), ("c", "", "c")]

    run(main())


class RaisingCtx(AsyncCtx):
    def __init__(self, where: str, events: list[str]) -> None:
        super().__init__(events)
        self.where = where

    async def on_completion(self, result: bool) -> None:
        self.events.append(f"completion:{result}")
        if self.where == "first step":
            raise ValueError(self.where)
        await asyncio.sleep(0)
        if self.where == "cancelled":
            raise asyncio.CancelledError()  # As a hook that cancelled its own task would.
        raise ValueError(self.where)


def test_a_coroutine_hook_s_exception_reaches_the_loop_s_handler_and_the_client_carries_on() -> None:
    async def main() -> None:
        heard: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: heard.append(context))
        events: list[str] = []
        client = await started(events)
        try:
            contexts = [RaisingCtx(where, []) for where in ("first step", "after a step", "cancelled")]
            for ctx in contexts:
                await client.submit(ctx)
                await client.flush_transactions(timeout=5)
            fine = AsyncCtx()
            await client.submit(fine)
            await client.flush_transactions(timeout=5)
        finally:
            await client.close()
        assert [type(h["exception"]) for h in heard] == [ValueError, ValueError, asyncio.CancelledError]
        assert [str(h["exception"]) for h in heard[:2]] == ["first step", "after a step"]
        for h, ctx in zip(heard, contexts, strict=True):
            assert h["waltz_hook"] == ctx.on_completion
            assert "on_completion raised" in h["message"]
        # The failed hooks ended nothing else: each context's on_application followed.
        for ctx in [*contexts, fine]:
            assert ctx.events == ["completion:True", "application"]

    run(main())


class SlowCompletionCtx(AsyncCtx):
    def __init__(self, events: list[str], release: asyncio.Event) -> None:
        super().__init__(events)
        self.release = release

    async def on_completion(self, result: bool) -> None:
        self.events.append("completion started")
        await self.release.wait()
        self.events.append("completion ended")


def test_on_application_waits_for_a_suspended_on_completion() -> None:
    async def main() -> None:
        events: list[str] = []
        client = await started(events)
        try:
            release = asyncio.Event()
            await client.submit(SlowCompletionCtx(events, release))
            await client.wait_applied(0, 1, timeout=5)
            for _ in range(5):
                await asyncio.sleep(0)
            assert events == ["completion started", "apply:1"]
            release.set()
            await client.flush_transactions(timeout=5)
            assert events == ["completion started", "apply:1", "completion ended", "application"]
        finally:
            await client.close()

    run(main())


def test_closing_with_a_hook_suspended_ends_it() -> None:
    async def main() -> None:
        events: list[str] = []
        client = await started(events)
        await client.submit(SlowCompletionCtx(events, asyncio.Event()))
        await client.wait_applied(0, 1, timeout=5)
        await client.close()
        assert events == ["completion started", "apply:1"]

    run(main())


class CancelsItsTaskCtx(AsyncCtx):
    async def on_completion(self, result: bool) -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # And returns without awaiting: nothing of this hook is left to cancel.
        self.events.append("completion")


def test_a_hook_that_cancels_its_task_and_returns_leaves_the_runner_usable() -> None:
    async def main() -> None:
        events: list[str] = []
        client = await started(events)
        try:
            for _ in range(3):
                ctx = CancelsItsTaskCtx()
                await client.submit(ctx)
                await client.flush_transactions(timeout=5)
                assert ctx.events == ["completion", "application"]
                for _ in range(3):
                    await asyncio.sleep(0)  # The runner hears the cancellation, and takes it back.
                idle = client._runners._idle
                assert len({id(runner) for runner in idle}) == len(idle)  # Parked once each.
                assert all(not runner.task.cancelling() for runner in idle)
            ctx_t = TimeoutCtx()
            await client.submit(ctx_t)
            await asyncio.wait_for(ctx_t.done, 5)
            assert ctx_t.timed_out
        finally:
            await client.close()

    run(main())

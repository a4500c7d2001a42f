"""TaskSet: every failure reaches a handler (the task's own, else the set's), a cancellation never does, and
aclose cancels and waits for every task, including those spawned while it waits."""

from __future__ import annotations

import asyncio
from typing import Any

from waltz.client.tasks import TaskSet


def test_failures_reach_their_handler_and_cancellations_do_not() -> None:
    async def main() -> None:
        default: list[tuple[str, str]] = []
        own: list[tuple[str, str]] = []
        tasks = TaskSet(lambda task, error: default.append((task.get_name(), str(error))))

        async def fail(message: str) -> None:
            raise RuntimeError(message)

        tasks.spawn(fail("a"), "first")
        tasks.spawn(fail("b"), "second", lambda task, error: own.append((task.get_name(), str(error))))
        sleeper = tasks.spawn(asyncio.sleep(60), "sleeper")
        await asyncio.sleep(0.01)
        sleeper.cancel()
        await asyncio.gather(sleeper, return_exceptions=True)
        await asyncio.sleep(0)  # Its done callback runs after the gather's.
        assert default == [("first", "a")]
        assert own == [("second", "b")]
        assert len(tasks) == 0

    asyncio.run(main())


def test_aclose_cancels_every_task_and_those_spawned_meanwhile() -> None:
    async def main() -> None:
        tasks = TaskSet(lambda task, error: None)
        cancelled: list[str] = []

        async def sleeper(name: str, spawn_on_cancel: bool) -> Any:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(name)
                if spawn_on_cancel:
                    tasks.spawn(sleeper("late", False), "late")
                raise

        tasks.spawn(sleeper("one", True), "one")
        tasks.spawn(sleeper("two", False), "two")
        await asyncio.sleep(0)
        await tasks.aclose()
        assert sorted(cancelled) == ["late", "one", "two"]
        assert len(tasks) == 0

    asyncio.run(main())

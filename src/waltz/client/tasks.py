"""``TaskSet``: the client's one way to own background tasks, with :class:`asyncio.TaskGroup`'s promise.

Every task the client core runs belongs to a :class:`TaskSet`, and a task that fails (ends with an exception
other than a cancellation) is never only logged: its failure is handed at once, on the loop, to the handler
named when it was spawned, which is the owner's decision of what the failure ends (a partition, say), or
by default to the set's own handler. :meth:`TaskSet.aclose` cancels every task and waits for them all.

Unlike :class:`asyncio.TaskGroup`, a set has no ``async with`` block to wait in (the client's tasks outlive
any one call of the application), and a failure does not cancel the other tasks by itself: the handler
decides what to stop, since one partition's failure must not end the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeAlias

__all__ = ["FailureHandler", "TaskSet"]

FailureHandler: TypeAlias = Callable[["asyncio.Task[Any]", BaseException], None]
"""Called on the loop with a task that failed and its exception (never for a cancellation)."""


class TaskSet:
    """The background tasks of one owner (event loop only); see the module docstring."""

    __slots__ = ("_on_failure", "_tasks")

    def __init__(self, on_failure: FailureHandler) -> None:
        self._on_failure = on_failure
        self._tasks: dict[asyncio.Task[Any], FailureHandler] = {}

    def spawn(
        self, coro: Coroutine[Any, Any, Any], name: str, on_failure: FailureHandler | None = None
    ) -> asyncio.Task[Any]:
        """Run ``coro`` as a task of this set; if it fails, ``on_failure`` (or the set's handler) hears."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks[task] = on_failure if on_failure is not None else self._on_failure
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        handler = self._tasks.pop(task, self._on_failure)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            handler(task, error)

    def __len__(self) -> int:
        return len(self._tasks)

    async def aclose(self) -> None:
        """Cancel every task and wait for all of them (tasks spawned meanwhile too)."""
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

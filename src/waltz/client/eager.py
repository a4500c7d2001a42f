"""Coroutine hooks started at once: a committed append's ``async def on_completion`` (or ``on_application``)
takes its first step in the loop pass that heard the commit, where a task made for it would start one pass
later (Python 3.11 has no eager tasks). An application awaiting the commit then sends its next append a pass
sooner, as with a plain hook in ``inline`` mode.

A first step runs with a *runner* as the current task: a task of the client's, idle between hooks, lent to
the step. So whatever inside the hook asks for its task (``asyncio.timeout``, ``asyncio.TaskGroup``,
``asyncio.current_task()``) gets a real task, and the one that runs the rest of the hook: if the first step
suspends, the runner is reserved for that hook and awaits the rest (:class:`Rest`), in the job the hooks'
batch hands it (see :mod:`waltz.client.hooks`). A hook that finishes in its first step (it sets a future,
say: the common case) costs no task, no loop pass and no wake-up. Each hook runs in a copy of its caller's
``contextvars`` context, as a task would, its first step and its rest in the same copy.

A runner is an :func:`asyncio.current_task` for a step it is not running itself: made current with
``asyncio.tasks._enter_task`` and ``_leave_task`` (private asyncio functions, there since Python 3.7, which
Python 3.12's eager tasks use the same way), the caller's task (if any) set aside meanwhile.
"""

from __future__ import annotations

import asyncio
import contextvars
import types
from asyncio.tasks import _enter_task, _leave_task
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Final

__all__ = ["Rest", "Runner", "Runners"]

if isinstance(asyncio.current_task, types.BuiltinFunctionType):  # In C (Python 3.12 on).
    _current_task: Callable[[asyncio.AbstractEventLoop], asyncio.Task[Any] | None] = asyncio.current_task
else:  # Python 3.11: the same lookup without its Python frame (a step makes it once per hook).
    from asyncio.tasks import _current_tasks  # type: ignore[attr-defined]

    _current_task = _current_tasks.get

MAX_IDLE_RUNNERS: Final = 4
"""Idle runners kept; a runner that finishes its jobs with this many idle ends (hooks that suspend are rare,
and each holds one runner only while it waits)."""


_UNSTARTED: Final = object()


class Rest:
    """The rest of a coroutine hook: awaiting it runs the rest in the awaiting task, in the coroutine's own
    context (a copy of its caller's). After a first step that suspended (``yielded``: what the step
    yielded), or from the start (a hook not started at once: :meth:`unstarted`). ``error``: an exception to
    throw into the coroutine before anything else (a cancellation of its runner that came before the runner
    awaited the rest)."""

    __slots__ = ("_context", "_coro", "_yielded", "error", "runner")

    def __init__(
        self,
        coro: Coroutine[Any, Any, Any],
        yielded: Any,
        context: contextvars.Context,
        runner: Runner | None,
    ) -> None:
        self._coro = coro
        self._yielded = yielded
        self._context = context
        self.error: BaseException | None = None
        self.runner = runner
        """The runner whose task was current in the first step: the rest must run there (None: any)."""

    @classmethod
    def unstarted(cls, coro: Coroutine[Any, Any, Any]) -> Rest:
        """All of ``coro``, in a copy of the current context (as a task of its own would run it)."""
        return cls(coro, _UNSTARTED, contextvars.copy_context(), None)

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, run = self._coro, self._context.run
        yielded, self._yielded = self._yielded, None
        value: Any = None
        while True:
            error, self.error = self.error, None
            if yielded is _UNSTARTED:
                yielded = None  # Its first step: send None, as a task does.
            elif error is None:
                try:
                    value = yield yielded  # To the awaiting task, as the coroutine yielded it.
                except GeneratorExit:
                    coro.close()
                    raise
                except BaseException as e:  # noqa: BLE001 - the task's (a cancellation): the coroutine's now
                    error = e
            try:
                yielded = run(coro.send, value) if error is None else run(coro.throw, error)
            except StopIteration as stop:
                return stop.value

    def close(self) -> None:
        """Drop the coroutine (the client closed before its rest ran)."""
        self._coro.close()


class Runner:
    """One of the client's tasks, lent to first steps while idle (see the module docstring)."""

    __slots__ = ("_jobs", "_owner", "_waiter", "lent", "loop", "rest", "task")

    def __init__(self, owner: Runners) -> None:
        self._owner = owner
        self._jobs: deque[Coroutine[Any, Any, None]] = deque()
        self.rest: Rest | None = None  # The suspended hook it is reserved for, until a job takes it on.
        self.lent = False  # Current task of a first step right now.
        self._waiter: asyncio.Future[None] | None = None
        self.task = owner.spawn(self._serve(), "waltz-hooks")
        self.loop = self.task.get_loop()

    def give(self, job: Coroutine[Any, Any, None]) -> None:
        """Run ``job`` in this runner's task, after the jobs given before it."""
        self._jobs.append(job)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _serve(self) -> None:
        owner = self._owner
        loop = self.loop
        while True:
            while self._jobs:
                job = self._jobs.popleft()
                self.rest = None
                await job
            if self.rest is None and not owner.park(self):
                return
            await self._wait_for_a_job(loop)

    async def _wait_for_a_job(self, loop: asyncio.AbstractEventLoop) -> None:
        """Idle (parked, or reserved for a hook's rest) until :meth:`give` hands a job."""
        while not self._jobs:
            waiter = self._waiter = loop.create_future()
            try:
                await waiter
            except asyncio.CancelledError as e:
                if self._owner.closing:
                    raise
                if self.rest is not None:
                    self.rest.error = e  # For the hook it waits to run (a timeout of its first step).
                else:
                    self.task.uncancel()  # A hook that cancelled its task in its first step, and finished.
            finally:
                self._waiter = None


class Runners:
    """The client's runners: idle ones to lend, and a job to run in one (see the module docstring)."""

    __slots__ = ("_idle", "closing", "spawn")

    def __init__(self, spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[Any]]) -> None:
        self.spawn = spawn
        self._idle: list[Runner] = []
        self.closing = False
        """Set by the client's close: a cancelled runner then ends, and none is lent any more."""

    def start(self) -> None:
        """On the loop: make the first runner (idle, and lent, once its task has run its first step)."""
        Runner(self)

    def step(self, coro: Coroutine[Any, Any, Any]) -> Rest | None:
        """Run the first step of ``coro`` now, with an idle runner as the current task, in a copy of the
        current context. None if it finished (its result dropped; its exception raised here); else the
        :class:`Rest` to await in :meth:`run`'s job: after its first step (``rest.runner`` is reserved for
        it), or all of it if no runner was idle (the job's task runs it)."""
        idle = self._idle
        if not idle or idle[-1].lent or self.closing:
            return Rest.unstarted(coro)
        runner = idle[-1]  # Left in the list while lent (the common case: the step finishes the hook).
        task = runner.task
        loop = runner.loop
        caller = _current_task(loop)
        if caller is not None:
            _leave_task(loop, caller)
        _enter_task(loop, task)
        runner.lent = True
        context = contextvars.copy_context()
        try:
            yielded = context.run(coro.send, None)
        except StopIteration:
            return None
        finally:
            runner.lent = False
            _leave_task(loop, task)
            if caller is not None:
                _enter_task(loop, caller)
        # Suspended: the runner is reserved for the rest, and another is made for the next first step.
        idle.remove(runner)
        rest = runner.rest = Rest(coro, yielded, context, runner)
        if not idle:
            Runner(self)  # Idle from the next loop pass.
        return rest

    def run(self, job: Coroutine[Any, Any, None], runner: Runner | None = None) -> None:
        """Run ``job`` in ``runner`` (reserved by :meth:`step`: the job awaits its rest), or in an idle
        runner, or a new one."""
        if runner is None or runner.task.done():  # (Done: the client closed before its job came.)
            runner = self._idle.pop() if self._idle else Runner(self)
        runner.give(job)

    def park(self, runner: Runner) -> bool:
        """``runner`` is idle: keep it to lend (True), or let it end (False: enough are idle, or closing)."""
        if self.closing or len(self._idle) >= MAX_IDLE_RUNNERS:
            return False
        self._idle.append(runner)
        return True

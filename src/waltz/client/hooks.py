"""The application's context hooks (``on_completion``, ``on_application``), in the order the lifecycle owes
them: a hook that runs on the loop (a coroutine function, an inherited no-op hook, or every hook in inline
mode) runs at once where its append's fate was heard, a coroutine's first step with a runner task current
(:mod:`waltz.client.eager`); the others are queued per loop iteration and run as one job, on a callback
thread (plain functions) or in a runner task on the loop (behind a coroutine hook still waiting).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import types
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from waltz.client.base import ClientBase
from waltz.client.eager import Rest
from waltz.client.lifecycle import Event, Hook, State
from waltz.client.pool import Call, report_hook_failure
from waltz.client.state import PartitionState, Run

__all__ = ["HooksMixin"]

log = logging.getLogger("waltz.client.core")  # The core's one logger (docs/client.md names it).

_COMPLETED, _ENDED = State.COMPLETED, State.ENDED
_TRUE_ARGS = (True,)
_Coroutine = types.CoroutineType


class HooksMixin(ClientBase):
    """Hook dispatch of the client core (see the module docstring)."""

    __slots__ = ()

    def _on_applied(self, partition: PartitionState, transaction_id: int) -> None:
        """Transactions up to ``transaction_id`` are applied: on_application for the runs that wait for it."""
        waiting = partition.awaiting_apply
        queue = partition.lock_queue
        # Nothing held (no context of this partition takes write locks): no release to make per run. Releases
        # only pass locks on, so nothing becomes held during this loop either.
        locked = bool(queue.held)  # queue.holds_any, without its property call (once per feed run).
        while waiting and waiting[0].transaction_id <= transaction_id:
            run = waiting.popleft()
            if locked:
                wake = queue.release(run)
                if wake:
                    self._wake(wake)
            if run.apply():  # on_application is owed now (on_completion ran; otherwise it follows that).
                self._run_hook(run, False)

    def _drop_awaiting_apply(self, partition: PartitionState) -> None:
        """The partition is gone: its committed runs end without on_application (as with close); a run whose
        on_completion has not run yet is over once it has (see _hook_done)."""
        waiting, partition.awaiting_apply = partition.awaiting_apply, deque()
        for run in waiting:
            over = run.state is _COMPLETED
            run.handle(Event.FAIL)  # No hook: appended.
            if over:
                self._finish(run)

    def _flush_hooks(self) -> None:
        if not self._hook_runs:
            return
        hooks, self._hooks = self._hooks, []
        runs, self._hook_runs = self._hook_runs, []
        lead, self._lead_awaitables = self._lead_awaitables, []
        on_loop, self._hooks_on_loop = self._hooks_on_loop, 0
        pool = self._pool
        if pool is None or pool.is_shut_down:
            for _fn, awaitable in lead:
                if inspect.iscoroutine(awaitable) or type(awaitable) is Rest:
                    awaitable.close()  # Dropped with its batch, as the hooks never called.
            return
        # A lead hook that suspended in its first step runs its rest in the runner that was its task then.
        runner = lead[0][1].runner if lead and type(lead[0][1]) is Rest else None
        if on_loop < len(hooks):
            # Plain hooks (on a callback thread): all of them when none runs on the loop, else the batch in
            # runs of one kind, in order.
            if lead or on_loop:
                self._runners.run(self._run_mixed_hooks(lead, hooks, runs), runner)
            else:
                pool.post(hooks, then=functools.partial(self._hooks_done, runs))
            return
        awaitables = _run_hooks_inline(hooks)  # Every hook runs on the loop.
        if lead:
            awaitables = lead + awaitables
        if awaitables:
            self._runners.run(self._await_hooks(awaitables, runs), runner)
        else:
            self._hooks_done(runs)

    def _run_hook(self, run: Run, completion: bool) -> None:
        """The one way ``on_completion(True)`` and ``on_application`` reach the application, once per append
        each. ``completion``: ``run``'s first append committed (its COMMIT is made here) and
        ``on_completion(True)`` is owed; otherwise ``on_application``, which its lifecycle owes.

        A hook that runs on the loop (see :mod:`waltz.client.dispatch`), with no hook queued in this loop
        iteration, runs now, where the commit or the apply was heard (the socket reader, the applier): a
        lone append's application hears of it one loop pass sooner. A coroutine hook takes its first step
        now too, with a runner task as its task (:mod:`waltz.client.eager`). Otherwise the hook joins this
        iteration's batch (:meth:`_flush_hooks`, one callback job or one job on the loop), in order. The
        rest of a coroutine hook that suspended is awaited first by this iteration's batch, before the
        hooks queued after it, which therefore still run in order."""
        context = run.context
        on_loop = self._inline or run.where[1 if completion else 2]
        if self._hook_runs or not on_loop:
            if not self._hook_runs:
                self._call_soon(self._flush_hooks)
            if completion:
                self._hooks.append((context.on_completion, _TRUE_ARGS))
            else:
                self._hooks.append((context.on_application, ()))
            if on_loop:
                self._hooks_on_loop += 1
        else:
            pool = self._pool
            if pool is None or pool.is_shut_down:  # As _flush_hooks: no hooks once the client is shut down.
                if completion:
                    run.commit()
                return
            fn: Callable[..., Any] = context.on_completion if completion else context.on_application
            result: Any  # The hooks are typed as returning None; an inline hook may return a coroutine.
            try:
                result = fn(True) if completion else fn()
                if result is not None and type(result) is _Coroutine:
                    result = self._runners.step(result)  # Its first step, now: None if that finished it.
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as e:  # noqa: BLE001 - reported to the application, as in _run_hooks_inline
                report_hook_failure(asyncio.get_running_loop(), fn, e)
                result = None
            if result is None or not inspect.isawaitable(result):
                if completion:
                    run.commit_complete()  # Committed, and on_completion(True) ran (one transition call).
                else:
                    self._finish(run)  # on_application ran: the last hook.
                return
            self._lead_awaitables = [(fn, result)]
            self._call_soon(self._flush_hooks)
        if completion:
            run.commit()  # Owes on_completion(True), queued above.
        self._hook_runs.append((run, completion))

    async def _await_hooks(
        self, awaitables: list[tuple[Callable[..., Any], Awaitable[Any]]], runs: list[tuple[Run, bool]]
    ) -> None:
        """Coroutine hooks (on the loop), one after the other, then the runs' next step."""
        loop = asyncio.get_running_loop()
        for fn, awaitable in awaitables:
            await self._await_hook(loop, fn, awaitable)
        self._hooks_done(runs)

    async def _await_hook(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], awaitable: Awaitable[Any]
    ) -> None:
        """Await what a hook returned (in a runner task), reporting its exception. A cancellation the
        hook let out while the client is open (it cancelled its own task) is reported too, and taken back
        from the task, which goes on with the next hook; once the client is closing, it ends the task."""
        if type(awaitable) is _Coroutine:
            awaitable = Rest.unstarted(awaitable)  # Its own context, as if it had started at once.
        try:
            await awaitable
        except asyncio.CancelledError as e:
            task = asyncio.current_task()
            if self._closed or task is None:
                raise
            task.uncancel()
            report_hook_failure(loop, fn, e)
        except Exception as e:  # noqa: BLE001 - reported to the application, not swallowed
            report_hook_failure(loop, fn, e)

    async def _run_mixed_hooks(
        self,
        lead: list[tuple[Callable[..., Any], Awaitable[Any]]],
        hooks: list[Call],
        runs: list[tuple[Run, bool]],
    ) -> None:
        """A batch of coroutine hooks (on the loop) and plain ones (on a callback thread), in order: each
        run of consecutive plain hooks is one callback-thread job."""
        loop = asyncio.get_running_loop()
        pool = self._require_pool()
        awaitables = list(lead)
        i = 0
        while True:
            for fn, awaitable in awaitables:
                await self._await_hook(loop, fn, awaitable)
            if i == len(hooks):
                break
            j = i
            if self._dispatch.on_loop(hooks[i][0]):
                while j < len(hooks) and self._dispatch.on_loop(hooks[j][0]):
                    j += 1
                awaitables = _run_hooks_inline(hooks[i:j])
            else:
                while j < len(hooks) and not self._dispatch.on_loop(hooks[j][0]):
                    j += 1
                done: asyncio.Future[None] = loop.create_future()
                pool.post(hooks[i:j], then=functools.partial(done.set_result, None))
                await done
                awaitables = []
            i = j
        self._hooks_done(runs)

    def _hooks_done(self, runs: list[tuple[Run, bool]]) -> None:
        for run, completion in runs:
            self._hook_done(run, completion)

    def _hook_done(self, run: Run, completion: bool) -> None:
        """``run``'s on_completion(True) (``completion``) or on_application ran: its next step, as its
        lifecycle says (on_application now, later once applied, or none: the run is over)."""
        if not completion:
            self._finish(run)  # on_application ran: the last hook.
        elif run.complete() and not self._closed:
            self._run_hook(run, False)
        elif run.state is _ENDED:
            self._finish(run)  # Ended meanwhile (closed, the partition released): no on_application.

    async def _end_with_exception(self, run: Run, error: BaseException, event: Event = Event.FAIL) -> None:
        """End ``run`` with ``on_exception(error)`` if its lifecycle owes it (once); a first attempt also
        raises it from submit."""
        if self._step(run, event) is Hook.EXCEPTION:
            if self._metrics is not None and run.partition is not None:
                self._metrics.context_failed(run.partition.id)
            await self._call_hook(run.context.on_exception, error)
        if run.first_send is not None and not run.first_send.done():
            run.first_send.set_exception(error)
            run.first_send.exception()  # submit() retrieves it; never log "exception was never retrieved".
        self._finish(run)


def _run_hooks_inline(hooks: list[Call]) -> list[tuple[Callable[..., Any], Awaitable[Any]]]:
    """Run context hooks on the loop (inline mode), reporting their exceptions to the loop's exception
    handler; returns the awaitables that coroutine hooks returned, in order, for the caller to await."""
    awaitables: list[tuple[Callable[..., Any], Awaitable[Any]]] = []
    for fn, args in hooks:
        try:
            result = fn(*args)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:  # noqa: BLE001 - reported to the application, not swallowed
            # BaseException too: a hook may now run inside the socket reader (on_completion), which a
            # CancelledError from application code must not end. (The loop is looked up here only: each
            # asyncio.get_running_loop() is a getpid() system call, twice per append on this path.)
            report_hook_failure(asyncio.get_running_loop(), fn, e)
            continue
        if result is not None and inspect.isawaitable(result):
            awaitables.append((fn, result))
    return awaitables

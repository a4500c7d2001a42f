"""``CallbackPool``: the threads that run application code, with a cheap way back to the event loop.

The client core runs every piece of application code (``execute``, the context hooks, ``ClientCallbacks``)
on these threads, never on its event loop. ``ThreadPoolExecutor`` + ``run_in_executor`` would do, but each
call there costs a ``concurrent.futures.Future`` chained to an asyncio one and a wake-up of the loop
(``call_soon_threadsafe``) per call. Here:

* :meth:`CallbackPool.call` returns an asyncio future; workers hand results back through one shared list, and
  only the first result after the loop last collected them wakes the loop, so a burst of results costs one
  wake-up;
* :meth:`CallbackPool.post` runs a *batch* of calls, one after the other on one thread, as one job (the core
  uses it for context hooks: one job per burst of resolutions instead of one per hook).

Threads ("waltz-callback-N") start on demand, up to ``size``, when no thread is idle. All methods except
those documented otherwise must be called on the loop the pool was made for.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["Call", "CallbackPool", "report_hook_failure"]

log = logging.getLogger(__name__)

T = TypeVar("T")

Call = tuple[Callable[..., Any], tuple[Any, ...]]
"""A function and its positional arguments."""


class _Job:
    __slots__ = ("args", "fn", "future", "orphan")

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        future: asyncio.Future[Any] | None,
        orphan: Callable[[Any], None] | None = None,
    ) -> None:
        self.fn = fn
        self.args = args
        self.future = future
        self.orphan = orphan


class CallbackPool:
    """Up to ``size`` threads named ``{name}-N`` running application code for one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, size: int, name: str = "waltz-callback") -> None:
        if size < 1:
            raise ValueError(f"a callback pool needs at least one thread, got {size}")
        self._loop = loop
        self._size = size
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._idle = 0  # Threads that finished a job and no job has been queued for since (under _lock).
        self._results: list[tuple[_Job, BaseException | None, Any]] = []
        # Marks this pool's threads (set once by each in _work): a blocking call of the client asks
        # is_pool_thread, one attribute read, to refuse to wait for work that needs the thread it blocks.
        self._members = threading.local()
        # A plain attribute, not a property: the client core reads it several times per append.
        self.is_shut_down = False
        """True once :meth:`shutdown` was called (no more work is accepted)."""

    # -- loop side -----------------------------------------------------------------------------------------

    def call(
        self, fn: Callable[..., T], *args: Any, orphan: Callable[[T], None] | None = None
    ) -> asyncio.Future[T]:
        """Run ``fn(*args)`` on a pool thread; the future (on the loop) gets its result or exception.

        Cancelling the future before a thread takes the job skips the call. If it is cancelled while the call
        runs, the result is lost, unless ``orphan`` is given: then ``orphan(result)`` runs on the loop (when
        the call returned rather than raised), to undo what the call did.
        """
        future: asyncio.Future[T] = self._loop.create_future()
        self._submit(_Job(fn, args, future, orphan))
        return future

    def post(self, calls: Sequence[Call], then: Callable[[], None] | None = None) -> None:
        """Run ``calls`` in order on one pool thread; then call ``then()`` on the loop, if given.

        An exception of one call does not stop the others: it goes to the loop's exception handler (see
        :func:`report_hook_failure`), where the application hears of it."""
        future: asyncio.Future[None] | None = None
        if then is not None:
            future = self._loop.create_future()
            future.add_done_callback(lambda _: then())
        self._submit(_Job(_run_all, (calls, self._hook_failed), future))

    def _hook_failed(self, fn: Callable[..., Any], error: Exception) -> None:
        # On a pool thread: the handler runs on the loop, like every other report of an asyncio callback.
        try:
            self._loop.call_soon_threadsafe(report_hook_failure, self._loop, fn, error)
        except RuntimeError:  # the loop is closed: logging is all that is left
            log.error("%s raised", _name(fn), exc_info=error)

    def _submit(self, job: _Job) -> None:
        if self.is_shut_down:
            raise RuntimeError("the callback pool is shut down")
        with self._lock:
            spawn = False
            if self._idle > 0:
                self._idle -= 1  # That thread takes this job.
            elif len(self._threads) < self._size:
                spawn = True
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
        self._jobs.put(job)
        if spawn:
            thread.start()

    def _collect(self) -> None:
        with self._lock:
            results, self._results = self._results, []
        for job, error, value in results:
            future = job.future
            assert future is not None
            if future.cancelled():
                if job.orphan is not None and error is None:
                    job.orphan(value)
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

    def shutdown(self) -> None:
        """Stop accepting work; the threads finish the jobs already queued, then exit. Blocking: call it
        through ``asyncio.to_thread`` (from any thread except a pool thread)."""
        self.is_shut_down = True
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join()

    def is_pool_thread(self) -> bool:
        """True on one of this pool's threads (cheap: a thread-local read)."""
        return getattr(self._members, "member", False)

    # -- thread side ---------------------------------------------------------------------------------------

    def _work(self) -> None:
        self._members.member = True
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is None:
                return
            error: BaseException | None = None
            value: Any = None
            if job.future is not None and job.future.cancelled():
                # Cancelled before it started (a plain read: the flag only ever goes from False to True).
                error = asyncio.CancelledError()
            else:
                try:
                    value = job.fn(*job.args)
                except BaseException as e:  # noqa: BLE001 - handed to the loop, which re-raises it
                    error = e
            if job.future is None:
                if error is not None:
                    log.error("a callback job failed", exc_info=error)
                with self._lock:
                    self._idle += 1
                continue
            with self._lock:
                self._idle += 1
                self._results.append((job, error, value))
                wake = len(self._results) == 1
            if wake:
                try:
                    self._loop.call_soon_threadsafe(self._collect)
                except RuntimeError:
                    pass  # The loop is closed: nobody waits for the result any more.
            del job, value, error


def _name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", fn))


def report_hook_failure(
    loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], error: BaseException
) -> None:
    """Tell the application that one of its hooks (``on_completion``, ``on_application``, ``on_lock_failure``,
    ``on_exception``) raised. Call on the loop.

    A hook has no caller to raise to, so its exception goes where asyncio sends the exceptions of callbacks:
    the loop's exception handler (``loop.set_exception_handler``), with the keys ``message``, ``exception``
    and ``waltz_hook`` (the function). The default handler logs it at ERROR with its traceback; an
    application that must not lose one installs its own handler.
    """
    loop.call_exception_handler(
        {
            "message": f"Waltz client: application hook {_name(fn)} raised",
            "exception": error,
            "waltz_hook": fn,
        }
    )


def _run_all(calls: Sequence[Call], failed: Callable[[Callable[..., Any], Exception], None]) -> None:
    for fn, args in calls:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - reported to the application, not swallowed
            failed(fn, e)

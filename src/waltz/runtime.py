"""What a Waltz process sets up once, at its entry point: the event loop (uvloop when installed), the
garbage collector and glibc's allocator tuned for a long-running node, and the wait for SIGTERM/SIGINT; and
the one way a component owns its background tasks (:class:`TaskSet`).

Imports nothing of Waltz: every layer (servers, storage nodes, the sync client, the Spark source, the CLI)
may use it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeAlias, TypeVar

__all__ = [
    "GC_THRESHOLDS",
    "MMAP_THRESHOLD_BYTES",
    "TRIM_THRESHOLD_BYTES",
    "FailureHandler",
    "TaskSet",
    "new_event_loop",
    "run",
    "tune_gc",
    "tune_malloc",
    "wait_for_stop_signal",
]

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """For entry points only: run ``main`` on uvloop when it is installed, else on the default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    result: T = uvloop.run(main)
    return result


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A private event loop for a thread of its own (the sync client's, the Spark source's I/O loop): uvloop
    when it is installed (its socket reads, futures and ``call_soon_threadsafe``, which every request from
    another thread crosses, cost less than asyncio's), else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


GC_THRESHOLDS = (50_000, 20, 100)
"""Collector thresholds of long-running nodes (CPython's defaults are ``(700, 10, 10)``)."""


def tune_gc() -> None:
    """For servers, once started: fewer, cheaper garbage collections.

    A node allocates a handful of container objects per message (tuples, futures, records) that almost all
    die young, while its caches keep hundreds of thousands alive; with the default thresholds the young
    generation is collected every 700 allocations and full collections walk every cached object. Freezing
    what start-up built moves it out of the collector's sight, and higher thresholds collect in larger,
    rarer steps; reference counting still frees the garbage that has no cycles, which is nearly all of it.
    """
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
"""glibc's largest mmap threshold on 64-bit: a record run (at most one frame, ~5.5 MB for 10,000 records of
512 bytes) and the buffers it is received into come from the heap below it."""
TRIM_THRESHOLD_BYTES = 128 * 1024 * 1024
"""Free heap a process keeps mapped for its next large buffers instead of giving it back to the system."""


def tune_malloc() -> bool:
    """For processes that move record runs (servers, storage nodes, reused Spark workers), once started: keep
    large buffers in memory that stays mapped. Returns whether the allocator is glibc's and was tuned.

    With glibc's defaults a buffer of a few megabytes (a range read's record run, received, joined, sent) is
    mapped afresh and unmapped when freed, so every page of every run is faulted in and zeroed by the kernel:
    one fault per 4 KiB moved, 0.1-0.2 faults per 512-byte record on the server and on the storage node.
    Blocks up to 32 MiB now come from the heap, and up to 128 MiB of free heap stay mapped for the next runs:
    the process keeps what its largest burst of reads needed (a few runs per reader) instead of returning it
    between runs. Elsewhere (not glibc) nothing changes."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    return True


async def wait_for_stop_signal() -> None:
    """Return on SIGTERM or SIGINT (the way ``waltz storage run`` and ``waltz server run`` are stopped)."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        await stop.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


FailureHandler: TypeAlias = Callable[["asyncio.Task[Any]", BaseException], None]
"""Called on the loop with a task that failed and its exception (never for a cancellation)."""


class TaskSet:
    """The one way a component owns background tasks (the client's core and network driver, the storage
    node's workers and scrub), with :class:`asyncio.TaskGroup`'s promise: a task that fails (ends with an
    exception other than a cancellation) is never only logged. Its failure is handed at once, on the loop, to
    the handler named when it was spawned, which is the owner's decision of what the failure ends (a
    partition, say, or the owner's health), or by default to the set's own handler. :meth:`aclose` cancels
    every task and waits for them all.

    Unlike :class:`asyncio.TaskGroup`, a set has no ``async with`` block to wait in (the tasks outlive any
    one call), and a failure does not cancel the other tasks by itself: the handler decides what to stop,
    since one partition's failure must not end the others. Event loop only.
    """

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

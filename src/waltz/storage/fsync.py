"""Where a storage node runs its group-commit fsyncs: on the event loop while the disk is fast, in a few
threads after a slow one (see :class:`FsyncPolicy`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

INLINE_FSYNC_LIMIT_S = 0.02
"""An fsync on the event loop slower than this sends the next ones to a thread."""
INLINE_FSYNC_BACKOFF_S = 10.0
"""The longest time fsyncs stay in threads after a slow one on the loop."""
INLINE_FSYNC_FIRST_BACKOFF_S = 1.0
"""How long fsyncs stay in threads after a slow one that follows none in the last ``INLINE_FSYNC_RESET_S``;
each slow one within that time doubles it, up to ``INLINE_FSYNC_BACKOFF_S``."""
INLINE_FSYNC_RESET_S = 60.0
FSYNC_THREADS = 4
"""Threads for the fsyncs not run on the loop (fsyncs of several partitions overlap on the disk)."""


class FsyncPolicy:
    """Where a node's group-commit fsyncs run, owned by the node and shared by its partitions.

    An fsync runs on the event loop thread while :meth:`inline_allowed` (no fsync is running in a thread and
    no slow one ran on the loop lately; the caller adds its own condition: no other partition has requests
    queued). The hand-off to a thread and back (a thread wake-up, a future, a wake-up of the loop, the GIL
    passed to and fro) costs more CPU than the fsync itself, and nothing waits for the loop meanwhile but
    arrivals, which then form the next group. Otherwise it runs in one of :data:`FSYNC_THREADS` threads
    (:meth:`run_threaded`), so the other partitions are served while the disk works.

    An fsync on the loop that took longer than :data:`INLINE_FSYNC_LIMIT_S` (by ``clock``) sends the next
    ones to the threads: for :data:`INLINE_FSYNC_FIRST_BACKOFF_S` after a lone slow one, doubling up to
    :data:`INLINE_FSYNC_BACKOFF_S` while they repeat within :data:`INLINE_FSYNC_RESET_S`. A slow disk
    would otherwise stall the loop (and /health, keep-alives, other partitions' reads) for every fsync.
    Only this object changes that state; ``clock`` (monotonic seconds) is injected so tests run on virtual
    time.
    """

    __slots__ = ("_backoff_s", "_clock", "_last_slow_s", "in_flight", "inline_off_until", "threads")

    def __init__(self, threads: int = FSYNC_THREADS, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.threads = FsyncThreads(threads)
        self.in_flight = 0
        """Fsyncs running in a thread now."""
        self.inline_off_until = 0.0
        """Until this time (by ``clock``) every fsync runs in a thread (a slow one ran on the loop)."""
        self._backoff_s = INLINE_FSYNC_FIRST_BACKOFF_S
        self._last_slow_s = -1e9
        """When an fsync on the loop last took longer than ``INLINE_FSYNC_LIMIT_S``."""

    def inline_allowed(self) -> bool:
        """No fsync runs in a thread and the back-off after a slow fsync on the loop has passed."""
        return self.in_flight == 0 and self._clock() >= self.inline_off_until

    def run_inline(self, fsync: Callable[[], None]) -> None:
        """Run ``fsync`` on the calling (loop) thread; its error propagates. A slow one starts a back-off."""
        clock = self._clock
        started = clock()
        fsync()
        now = clock()
        if now - started > INLINE_FSYNC_LIMIT_S:
            self._slow(now)

    def _slow(self, now: float) -> None:
        # A lone spike (a busy host) costs a second of the threads' hand-off; a disk that stays slow, up to
        # 10 s at a time (the hand-off costs a loop pass and a task wake-up per group, and appends can no
        # longer be answered in the pass that read them).
        if now - self._last_slow_s > INLINE_FSYNC_RESET_S:
            self._backoff_s = INLINE_FSYNC_FIRST_BACKOFF_S
        else:
            self._backoff_s = min(2 * self._backoff_s, INLINE_FSYNC_BACKOFF_S)
        self._last_slow_s = now
        self.inline_off_until = now + self._backoff_s

    async def run_threaded(self, fsync: Callable[[], None]) -> None:
        """Run ``fsync`` in one of the threads; its error propagates to the awaiting caller."""
        self.in_flight += 1
        try:
            await self.threads.run(fsync)
        finally:
            self.in_flight -= 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the threads after the fsyncs already handed to them (blocking)."""
        self.threads.close(timeout_s)


class FsyncThreads:
    """A few long-lived threads running the fsyncs handed to them from the event loop (see
    ``StoragePartition._fsync``), started on first use and stopped by :meth:`close`.

    Cheaper per hand-off than ``asyncio.to_thread`` (a context copy, an executor work item and a concurrent
    future chained to an asyncio one by callbacks both ways): here one ``SimpleQueue.put`` out and one
    ``call_soon_threadsafe`` back. Each
    partition has at most one group fsync in flight, so the queue holds at most one job per partition.
    """

    def __init__(self, threads: int) -> None:
        self._size = threads
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], asyncio.Future[None]] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []

    def run(self, fn: Callable[[], None]) -> asyncio.Future[None]:
        """Run ``fn`` in one of the threads; the future resolves on the loop when it returned or raised."""
        loop = asyncio.get_running_loop()
        if not self._threads:
            for i in range(self._size):
                thread = threading.Thread(
                    target=self._serve, args=(loop,), name=f"storage-fsync-{i}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
        done: asyncio.Future[None] = loop.create_future()
        self._jobs.put((fn, done))
        return done

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done = job
            error: BaseException | None = None
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting partition worker
                error = e
            try:
                loop.call_soon_threadsafe(_settle, done, error)
            except RuntimeError:
                pass  # the loop closed meanwhile: nobody waits for this fsync any more

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the threads after the jobs already queued (each waits at most ``timeout_s``)."""
        threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join(timeout_s)


def _settle(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.done():  # the waiting worker was cancelled (the node is closing)
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)

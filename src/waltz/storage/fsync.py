"""Where a storage node runs its group-commit fsyncs (on the event loop while the disk is fast, in a few
threads after a slow one: :class:`FsyncPolicy`), and how the fsyncs of several partitions go to a thread
together, in one hand-off (:class:`GroupSync`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from waltz.errors import StorageError

log = logging.getLogger(__name__)

R = TypeVar("R")

INLINE_FSYNC_LIMIT_S = 0.02
"""An fsync on the event loop slower than this sends the next ones to a thread."""
INLINE_FSYNC_BACKOFF_S = 10.0
"""The longest time fsyncs stay in threads after a slow one on the loop."""
INLINE_FSYNC_FIRST_BACKOFF_S = 1.0
"""How long fsyncs stay in threads after a slow one that follows none in the last ``INLINE_FSYNC_RESET_S``;
each slow one within that time doubles it, up to ``INLINE_FSYNC_BACKOFF_S``."""
INLINE_FSYNC_RESET_S = 60.0
FSYNC_THREADS = 4
"""Threads for the fsyncs not run on the loop (a node's hand-offs, and a closing node's last ones)."""
GROUP_SYNC_JOBS = FSYNC_THREADS
"""The most jobs a :class:`GroupSync` splits one batch of fsyncs into. They run at once, in as many threads:
the disk overlaps the fsyncs of different files, so a few busy partitions' fsyncs in turn in one thread
would wait for each other (4 files, 4 times as long; far worse when the disk is slow)."""


class JobRunner(Protocol):
    """Runs jobs off the loop (:class:`FsyncThreads`)."""

    def run(self, fn: Callable[[], R]) -> asyncio.Future[R]:
        """Run ``fn``; the future resolves on the loop with what it returned or raised."""
        ...

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop after the jobs already handed off (blocking)."""
        ...


class FsyncPolicy:
    """Where a node's group-commit fsyncs run, owned by the node and shared by its partitions.

    An fsync runs on the event loop thread while :meth:`inline_allowed` (no fsync is running in a thread and
    no slow one ran on the loop lately; the caller adds its own condition: no other partition has requests
    queued). The hand-off to a thread and back (a thread wake-up, a future, a wake-up of the loop, the GIL
    passed to and fro) costs more CPU than the fsync itself, and nothing waits for the loop meanwhile but
    arrivals, which then form the next group. Otherwise it runs in one of :data:`FSYNC_THREADS` threads
    (:meth:`run_threaded`, with the fsyncs of the other partitions waiting for one: see :class:`GroupSync`),
    so the other partitions are served while the disk works.

    An fsync on the loop that took longer than :data:`INLINE_FSYNC_LIMIT_S` (by ``clock``) sends the next
    ones to the threads: for :data:`INLINE_FSYNC_FIRST_BACKOFF_S` after a lone slow one, doubling up to
    :data:`INLINE_FSYNC_BACKOFF_S` while they repeat within :data:`INLINE_FSYNC_RESET_S`. A slow disk
    would otherwise stall the loop (and /health, keep-alives, other partitions' reads) for every fsync.
    Only this object changes that state; ``clock`` (monotonic seconds) is injected so tests run on virtual
    time.
    """

    __slots__ = ("_backoff_s", "_clock", "_last_slow_s", "in_flight", "inline_off_until", "threads")

    def __init__(
        self,
        threads: int = FSYNC_THREADS,
        clock: Callable[[], float] = time.monotonic,
        runner: JobRunner | None = None,
    ) -> None:
        self._clock = clock
        self.threads: JobRunner = runner if runner is not None else FsyncThreads(threads)
        """Runs the jobs handed off (:class:`FsyncThreads`; tests inject one they drive)."""
        self.in_flight = 0
        """Jobs running in a thread now."""
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

    def run_threaded(self, job: Callable[[], R]) -> asyncio.Future[R]:
        """Run ``job`` in one of the threads: a future that resolves on the loop with its result or error.
        :attr:`in_flight` counts it until then."""
        self.in_flight += 1
        done = self.threads.run(job)
        done.add_done_callback(self._landed)
        return done

    def _landed(self, _done: asyncio.Future[Any]) -> None:
        self.in_flight -= 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the threads after the fsyncs already handed to them (blocking)."""
        self.threads.close(timeout_s)


class Queued(Protocol):
    """The requests queued in all partitions of a node (a :class:`waltz.storage.work.Tally`)."""

    items: int


class GroupSync:
    """The group-commit fsyncs of a node's partitions, the files of several partitions in one hand-off to a
    thread; owned by the node, shared by its partitions.

    A partition worker whose group is written awaits :meth:`sync` with its data file's fsync. The fsyncs
    asked for in one pass of the event loop, and those asked for while the previous batch runs, go to the
    threads as one batch, split into at most :data:`GROUP_SYNC_JOBS` jobs run at once: each job runs its
    share one after the other, each on its own file, and records each one's outcome. Back on the loop every
    caller gets its own file's outcome: a failed fsync fails the group of that file only. One hand-off (a
    thread wake-up, the GIL passed to and fro, a wake-up of the loop: about as much CPU as the fsync of a
    small group) so serves many partitions: with 80 partitions waiting, 4 hand-offs instead of 80. The next
    batch starts when every job of the last one landed.

    A lone fsync (no other one asked for, none in a thread, nothing queued on the node) runs on the loop
    instead, while the :class:`FsyncPolicy` allows: the caller checks :meth:`inline_allowed` and calls
    :meth:`run_inline` at once, without a loop pass. Ordering: a partition has at most one group waiting here
    (its worker awaits it), so each partition's groups are answered in order.
    """

    __slots__ = ("_jobs", "_pending", "_policy", "_queued", "_scheduled", "handed_off", "handoffs")

    def __init__(self, policy: FsyncPolicy, queued: Queued, jobs: int = GROUP_SYNC_JOBS) -> None:
        self._policy = policy
        self._queued = queued
        self._jobs = jobs
        self._pending: list[tuple[Callable[[], None], asyncio.Future[bool]]] = []
        """Fsyncs asked for, not handed off yet (at most one per partition), with their callers' waiters."""
        self._scheduled = False
        """A call of :meth:`_start` is scheduled on the loop."""
        self.handoffs = 0
        """Jobs handed to a thread."""
        self.handed_off = 0
        """Fsyncs those jobs ran."""

    def inline_allowed(self) -> bool:
        """No fsync is waiting or running in a thread, and the policy lets fsyncs run on the loop."""
        return not self._pending and self._policy.inline_allowed()

    def run_inline(self, fsync: Callable[[], None]) -> None:
        """Run ``fsync`` on the loop thread now (the caller checked :meth:`inline_allowed`); its error
        propagates."""
        self._policy.run_inline(fsync)

    async def sync(self, fsync: Callable[[], None]) -> bool:
        """Run ``fsync`` together with the others asked for meanwhile; its own error propagates. True if it
        ran in a thread, False if on the loop (alone, see :meth:`_start`)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._pending.append((fsync, waiter))
        if not self._scheduled:
            # After the callbacks already due in this pass: the workers they wake add their fsyncs first.
            self._scheduled = True
            loop.call_soon(self._start)
        return await waiter

    def _start(self) -> None:
        self._scheduled = False
        policy = self._policy
        if policy.in_flight:
            return  # started again when the last job of the batch in flight lands
        batch = [entry for entry in self._pending if not entry[1].done()]  # done: its caller was cancelled
        self._pending = []
        if not batch:
            return
        if len(batch) == 1 and self._queued.items == 0 and policy.inline_allowed():
            fsync, waiter = batch[0]
            try:
                policy.run_inline(fsync)
            except Exception as e:  # noqa: BLE001 - the caller's group fails
                _settle(waiter, False, e)
            else:
                _settle(waiter, False, None)
            return
        jobs = min(self._jobs, len(batch))
        self.handoffs += jobs
        self.handed_off += len(batch)
        for i in range(jobs):
            self._hand_off(batch[i::jobs])

    def _hand_off(self, batch: list[tuple[Callable[[], None], asyncio.Future[bool]]]) -> None:
        fsyncs = [fsync for fsync, _ in batch]
        done = self._policy.run_threaded(lambda: _in_turn(fsyncs))
        done.add_done_callback(lambda landed: self._landed(batch, landed))

    def _landed(
        self,
        batch: list[tuple[Callable[[], None], asyncio.Future[bool]]],
        landed: asyncio.Future[list[Exception | None]],
    ) -> None:
        """A job returned: tell each caller its own fsync's outcome; after the batch's last job, start the
        fsyncs asked for meanwhile (after the callers woken now: those that take a next group at once join
        them)."""
        if landed.cancelled():
            outcomes: list[BaseException | None] = [StorageError("an fsync job was cancelled")] * len(batch)
        elif (error := landed.exception()) is not None:
            outcomes = [error] * len(batch)  # not one fsync's: none of the batch is known durable
        else:
            outcomes = list(landed.result())
        for (_, waiter), outcome in zip(batch, outcomes, strict=True):
            _settle(waiter, True, outcome)
        if self._pending and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._start)


def _in_turn(fsyncs: list[Callable[[], None]]) -> list[Exception | None]:
    """Run each fsync in turn (in a thread); each one's error, or None."""
    outcomes: list[Exception | None] = []
    for fsync in fsyncs:
        try:
            fsync()
        except Exception as e:  # noqa: BLE001 - that file's groups fail, the others' do not
            outcomes.append(e)
        else:
            outcomes.append(None)
    return outcomes


class FsyncThreads:
    """A few long-lived threads running the fsync jobs handed to them from the event loop (see
    :class:`GroupSync`), started on first use and stopped by :meth:`close`.

    Cheaper per hand-off than ``asyncio.to_thread`` (a context copy, an executor work item and a concurrent
    future chained to an asyncio one by callbacks both ways): here one ``SimpleQueue.put`` out and one
    ``call_soon_threadsafe`` back. A node has at most :data:`GROUP_SYNC_JOBS` jobs in flight, so the queue
    holds at most that many.
    """

    def __init__(self, threads: int) -> None:
        self._size = threads
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []

    def run(self, fn: Callable[[], R]) -> asyncio.Future[R]:
        """Run ``fn`` in one of the threads; the future resolves on the loop with what it returned or
        raised."""
        loop = asyncio.get_running_loop()
        if not self._threads:
            for i in range(self._size):
                thread = threading.Thread(
                    target=self._serve, args=(loop,), name=f"storage-fsync-{i}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
        done: asyncio.Future[R] = loop.create_future()
        self._jobs.put((fn, done))
        return done

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done = job
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting loop
                error = e
            try:
                loop.call_soon_threadsafe(_settle, done, result, error)
            except RuntimeError:
                pass  # the loop closed meanwhile: nobody waits for this fsync any more

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the threads after the jobs already queued (each waits at most ``timeout_s``)."""
        threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join(timeout_s)


def _settle(done: asyncio.Future[R], result: R, error: BaseException | None) -> None:
    if done.done():  # the waiter was cancelled (the node is closing)
        return
    if error is None:
        done.set_result(result)
    else:
        done.set_exception(error)

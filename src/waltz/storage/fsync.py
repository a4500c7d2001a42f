"""Where a storage node runs its group-commit fsyncs (on the event loop while the disk is fast, in a few
threads after a slow one: :class:`FsyncPolicy`), and how the fsyncs of several partitions go to a thread
together, in one hand-off (:class:`GroupSync`), made durable by one ``syncfs`` when they are many.

``syncfs`` instead of an fdatasync per file. When a batch holds at least ``storage.fsync.syncfsMinFiles``
files (0: never), one ``syncfs(2)`` on the node's data directory (a descriptor the node opens once,
:meth:`~waltz.storage.fileio.FileSystem.open_fs_sync`) makes all of them durable: one system call and one
journal commit instead of one per file (about 6x less system time and wall time with 80 files on ext4).
Rules that keep it as safe as the fsyncs it replaces:

* Only where ``syncfs`` reports writeback errors and commits to the disk: Linux from 5.8, a libc that has
  it, ext4, XFS or btrfs (not FUSE, whose ``syncfs`` never reaches the daemon). Elsewhere the node fsyncs
  each file; one INFO line at start-up says which mode it uses and why.
* A group is answered Success only after the ``syncfs`` (or its own file's fdatasync) returned 0, and the
  ``syncfs`` starts after every write of the batch's groups (each partition awaits its sync before writing
  more), so it covers them.
* A failed ``syncfs`` names no file: the job then fdatasyncs every file of the batch in turn. A file's own
  writeback error is still reported by its fdatasync (Linux keeps an error sequence per file besides the
  file system's), so exactly the failing files' groups fail (their partitions fail-stop, as after any
  failed fsync) and the others succeed once their fdatasync returned 0.
* A ``syncfs`` reports each error once, though the error may be another file's, outside the batch: the next
  ``syncfs`` returns 0 whatever that file lost. So after a failed ``syncfs`` every file of the node is
  fdatasynced on its own (its batch with it) until that succeeds once; only then may a ``syncfs`` stand for
  its fsync again.
* ``syncfs`` also writes back every other dirty file of the same file system (other programs' too): a node
  sharing its file system with heavy writers makes its appends wait for their data. docs/deploy.md
  recommends a dedicated data file system; ``storage.fsync.syncfsMinFiles: 0`` turns this off.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, Protocol, TypeVar

from waltz.errors import StorageError
from waltz.storage.fileio import FsSync

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
DEFAULT_SYNCFS_MIN_FILES = 4
"""A batch of at least this many files is made durable by one ``syncfs`` (``storage.fsync.syncfsMinFiles``).
On ext4 over virtio, 2 files already cost less system time with one ``syncfs`` than with two fdatasyncs,
4 cost a third; a single file costs more (the ``syncfs`` walks the whole file system's dirty inodes)."""
SYNCFS_FAILURE_LOG_S = 10.0
"""At most one WARNING per this many seconds about failed ``syncfs`` calls."""


class _Asked:
    """An fsync asked for (see :meth:`GroupSync.sync`)."""

    __slots__ = ("begin", "fsync", "key", "waiter")

    def __init__(
        self,
        fsync: Callable[[], None],
        begin: Callable[[], Callable[[], None]] | None,
        key: Hashable,
        waiter: asyncio.Future[bool],
    ) -> None:
        self.fsync = fsync
        self.begin = begin
        """How to record a ``syncfs`` covering the file (``flush_begin``); None: never covered by one."""
        self.key = key
        """The file's owner (its partition), to know whether its own fsync ran since the last failed
        ``syncfs``; None: never covered by a ``syncfs``."""
        self.waiter = waiter


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
    instead, while the :class:`FsyncPolicy` allows: the caller checks that :attr:`pending` is empty and the
    policy's ``inline_allowed``, and calls its ``run_inline`` at once, without a loop pass. Ordering: a
    partition has at most one group waiting here (its worker awaits it, or its ``commit_soon``, which the
    worker waits for), so each partition's groups are answered in order.

    With ``fs_sync`` and a batch of at least ``syncfs_min_files`` fsyncs that all say how to record a
    ``syncfs`` (``begin``), the batch is one job instead: one ``syncfs`` for all its files, every file's
    fdatasync in turn if it fails (see the module docstring).
    """

    __slots__ = (
        "_fs_sync",
        "_generation",
        "_jobs",
        "_last_failure_log_s",
        "_loop",
        "_policy",
        "_queued",
        "_scheduled",
        "_syncfs_min_files",
        "_verified",
        "handed_off",
        "handoffs",
        "pending",
        "syncfs_calls",
        "syncfs_failures",
    )

    def __init__(
        self,
        policy: FsyncPolicy,
        queued: Queued,
        jobs: int = GROUP_SYNC_JOBS,
        *,
        fs_sync: FsSync | None = None,
        syncfs_min_files: int = 0,
    ) -> None:
        self._policy = policy
        self._queued = queued
        self._jobs = jobs
        self._fs_sync = fs_sync
        self._syncfs_min_files = syncfs_min_files if fs_sync is not None else 0
        self._last_failure_log_s = -1e9
        self._generation = 0
        """Failed ``syncfs`` calls so far (see :attr:`_verified`)."""
        self._verified: dict[Hashable, int] = {}
        """Per file (its key), :attr:`_generation` when its last fsync (or ``syncfs``) succeeded; missing: 0.
        A failed ``syncfs`` reports a writeback error once, for whichever file it was; a later ``syncfs``
        returns 0. Only a file's own fsync still reports it. So after a failure a file joins a ``syncfs``
        again only once its own fsync succeeded."""
        self.syncfs_calls = 0
        """``syncfs`` calls made (each in place of a batch's fdatasyncs)."""
        self.syncfs_failures = 0
        """Of those, the ones that failed (their batch was then fdatasynced file by file)."""
        self.pending: list[_Asked] = []
        """Fsyncs asked for, not handed off yet (at most one per partition), with their callers' waiters;
        read-only outside. While any waits, a partition's fsync joins them instead of running on the loop."""
        self._scheduled = False
        """A call of :meth:`_start` is scheduled on the loop."""
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop of the first :meth:`ask` (a node's one loop), kept: each ``asyncio.get_running_loop()``
        costs a ``getpid`` system call, and this ran twice per group."""
        self.handoffs = 0
        """Jobs handed to a thread."""
        self.handed_off = 0
        """Fsyncs those jobs ran."""

    async def sync(
        self,
        fsync: Callable[[], None],
        begin: Callable[[], Callable[[], None]] | None = None,
        key: Hashable = None,
    ) -> bool:
        """Run ``fsync`` together with the others asked for meanwhile; its own error propagates. True if it
        ran in a thread, False if on the loop (alone, see :meth:`_start`). ``begin`` (called in the thread
        before a ``syncfs`` that covers the file; what it returns, once that returned 0) and ``key`` (the
        file's owner, the same for each call) let a ``syncfs`` stand for ``fsync``; without them ``fsync``
        itself runs."""
        return await self.ask(fsync, begin, key)

    def ask(
        self,
        fsync: Callable[[], None],
        begin: Callable[[], Callable[[], None]] | None = None,
        key: Hashable = None,
    ) -> asyncio.Future[bool]:
        """:meth:`sync` without a coroutine: the future it awaits (for a caller that is a callback)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self.pending.append(_Asked(fsync, begin, key, waiter))
        if not self._scheduled:
            # After the callbacks already due in this pass: the workers they wake add their fsyncs first.
            self._scheduled = True
            loop.call_soon(self._start)
        return waiter

    def _start(self) -> None:
        self._scheduled = False
        policy = self._policy
        if policy.in_flight:
            return  # started again when the last job of the batch in flight lands
        batch = [asked for asked in self.pending if not asked.waiter.done()]  # done: caller cancelled
        self.pending = []
        if not batch:
            return
        if len(batch) == 1 and self._queued.items == 0 and policy.inline_allowed():
            waiter = batch[0].waiter
            try:
                policy.run_inline(batch[0].fsync)
            except Exception as e:  # noqa: BLE001 - the caller's group fails
                _settle(waiter, False, e)
            else:
                _settle(waiter, False, None)
            return
        self.handed_off += len(batch)
        if 0 < self._syncfs_min_files <= len(batch) and all(map(self._trusted, batch)):
            self.handoffs += 1
            self._hand_off(batch, self._sync_fs)
            return
        jobs = min(self._jobs, len(batch))
        self.handoffs += jobs
        for i in range(jobs):
            self._hand_off(batch[i::jobs], _in_turn)

    def _trusted(self, asked: _Asked) -> bool:
        """Whether a ``syncfs`` may stand for this file's fsync (see :attr:`_verified`)."""
        if asked.begin is None or asked.key is None:
            return False
        return self._verified.get(asked.key, 0) == self._generation

    def _hand_off(
        self,
        batch: list[_Asked],
        job: Callable[[list[_Asked]], list[Exception | None]],
    ) -> None:
        done = self._policy.run_threaded(lambda: job(batch))
        done.add_done_callback(lambda landed: self._landed(batch, landed))

    def _sync_fs(self, batch: list[_Asked]) -> list[Exception | None]:
        """In a thread: one ``syncfs`` for the files of ``batch``; if it fails, each file's fdatasync in turn
        (its own error fails its own group only)."""
        fs_sync = self._fs_sync
        assert fs_sync is not None
        try:
            synced = [asked.begin() for asked in batch if asked.begin is not None]
        except Exception:  # noqa: BLE001 - a closed file: its own fsync reports it
            return _in_turn(batch)
        self.syncfs_calls += 1
        try:
            fs_sync.syncfs()
        except Exception as e:  # noqa: BLE001 - no file is known durable: each one's own fsync decides
            self._syncfs_failed(e, len(batch))
            return _in_turn(batch)
        for done in synced:
            done()
        return [None] * len(batch)

    def _syncfs_failed(self, e: Exception, files: int) -> None:
        # Before the files' own fsyncs: those that succeed now are marked verified at the new generation.
        self._generation += 1
        self.syncfs_failures += 1
        now = time.monotonic()
        if now - self._last_failure_log_s >= SYNCFS_FAILURE_LOG_S:
            self._last_failure_log_s = now
            log.warning(
                "syncfs of %s failed (%s): fdatasync of each of the %d files instead; failures so far: %d",
                fs_sync_path(self._fs_sync),
                e,
                files,
                self.syncfs_failures,
            )

    def _landed(
        self,
        batch: list[_Asked],
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
        generation = self._generation
        for asked, outcome in zip(batch, outcomes, strict=True):
            if outcome is None and asked.key is not None:
                # Its own fsync, or a syncfs that could stand for it (it was verified already).
                self._verified[asked.key] = generation
            _settle(asked.waiter, True, outcome)
        if self.pending and not self._scheduled:
            self._scheduled = True
            landed.get_loop().call_soon(self._start)


def fs_sync_path(fs_sync: FsSync | None) -> str:
    return fs_sync.path if fs_sync is not None else "?"


def _in_turn(batch: list[_Asked]) -> list[Exception | None]:
    """Run each fsync in turn (in a thread); each one's error, or None."""
    outcomes: list[Exception | None] = []
    for asked in batch:
        try:
            asked.fsync()
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
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop the threads were started for (they settle every job's future there)."""

    def run(self, fn: Callable[[], R]) -> asyncio.Future[R]:
        """Run ``fn`` in one of the threads; the future resolves on the loop with what it returned or
        raised."""
        loop = self._loop
        if loop is None or not self._threads:
            # The threads settle each job's future on this loop (a ``getpid`` saved per hand-off, too).
            loop = self._loop = asyncio.get_running_loop()
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

"""``submit`` and its first attempt: the fast path of an append. ``partition_id`` and, with a free slot on a
ready partition, ``execute`` run in one callback-thread call (or on the loop, inline; or on the application's
thread, for :class:`~waltz.client.sync.WaltzClient`), and the append is sent without a task. Anything else
(no free slot, the partition not mounted) continues in the retry path (:mod:`waltz.client.attempts`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
import types
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, NamedTuple, TypeAlias

from waltz.client.attempts import AttemptsMixin
from waltz.client.builder import TransactionBuilder
from waltz.client.context import TransactionContext
from waltz.client.dispatch import ALL_ON_LOOP
from waltz.client.driver import MountState
from waltz.client.lifecycle import HOLDS_SLOT, Event
from waltz.client.monitor import TransactionMonitor
from waltz.client.state import PartitionState, Run
from waltz.errors import (
    ClientClosedError,
    ClientError,
    ClientTimeoutError,
    PartitionStuckError,
)

__all__ = ["SubmissionMixin"]

log = logging.getLogger("waltz.client.core")  # The core's one logger (docs/client.md names it).


STUCK_SUBMIT_AFTER = 3
"""Failed deliveries of one transaction after which ``submit`` to its partition fails with
:class:`~waltz.errors.PartitionStuckError` (the feed cannot advance, so nothing appended would be applied)."""

_READY = MountState.READY
_Coroutine = types.CoroutineType
"""What an ``async def`` returns: tested by type first (a C check), ``inspect.isawaitable`` for the rest."""


class _Pending(NamedTuple):
    """A first attempt whose ``execute`` returned an awaitable (a coroutine on the loop). A named tuple, built
    in C with ``_new_tuple`` (no Python ``__init__`` call per coroutine ``execute``)."""

    builder: TransactionBuilder
    awaitable: Awaitable[Any]


_new_tuple = tuple.__new__


class _Refused:
    """A first attempt on an application thread that raised before it took a slot (``partition_id`` did, the
    partition is not mounted or stuck, no slot in time): the loop ends the run with ``error``."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


_First: TypeAlias = TransactionBuilder | Literal[False] | Exception | _Pending | None
"""What a submit's first callback-thread call returns (see ``SubmissionMixin._first_attempt``)."""
_Executed: TypeAlias = TransactionBuilder | Literal[False] | Exception | _Pending
"""A first attempt that took a slot and ran ``execute`` (filled, gave up, raised, or a coroutine to await)."""


class SubmissionMixin(AttemptsMixin):
    """``submit`` and the first attempt of a context (see the module docstring)."""

    __slots__ = ()

    async def submit(self, context: TransactionContext) -> None:
        """Execute ``context`` and append its transaction; return once the first append is sent.

        Waits (up to ``client.submitTimeout``) while the partition already has
        ``client.maxConcurrentTransactions`` contexts in flight, and (up to ``client.mountTimeout``) for
        the partition to be mounted. Failures after the return are retried in the background and reported
        through the context's hooks. If the first attempt fails with an exception (``execute`` raised, a
        timeout, ``CLIENT_AHEAD``, a closed client), ``on_exception`` is called and the exception is raised
        here as well.
        """
        pool = self._pool
        if self._closed or self._driver is None or pool is None or pool.is_shut_down:
            self._check_open()  # Raises the error that says why.
            pool = self._require_pool()
        run = Run(context, ALL_ON_LOOP if self._inline else self._dispatch.where(context))
        # Executed here, on the loop, without an await since the partition was found ready: nothing can
        # have changed it (set_partitions and close are coroutines), so it need not be checked again.
        fresh = on_loop = run.where[0]
        try:
            first: _First
            if on_loop:
                # Zero hops: partition_id() and execute() run right here, on the loop.
                first = self._first_attempt(run, self._num_partitions)
            else:
                # One callback-thread call: partition_id() and, with a free slot and the mount, execute().
                first = await pool.call(
                    self._first_attempt,
                    run,
                    self._num_partitions,
                    orphan=functools.partial(self._orphaned, run),
                )
            if first is None:
                fresh = False
                first = await self._first_after_wait(run)
            elif type(first) is _Pending:  # A coroutine execute (on the loop): awaited here.
                fresh = False
                first = await self._finish_first(run, first)
        except Exception as e:
            await self._end_with_exception(run, e)  # on_exception, and raised here as well.
            raise
        except BaseException:
            if run.state in HOLDS_SLOT:  # Cancelled: the context is dropped.
                self._step(run, Event.DROP)
            raise
        self._runs.add(run)
        partition = run.partition
        assert partition is not None
        # Checked again unless fresh: execute() may have changed the partition (set_partitions, close).
        self._continue_first(run, first, partition.monitor if fresh else self._ready_monitor(partition))
        if run.first_send is not None:
            # Not sent yet (or gave up, or failed): wait for the first send, or the end (raising its error).
            await asyncio.shield(run.first_send)

    async def _first_after_wait(self, run: Run) -> _Executed | None:
        """A first attempt that found no free slot (or no ready partition) when it was made. Returns what the
        first attempt returns; None if it took the slot but still did not execute (the run is ADMITTED: the
        retry path decides)."""
        partition = run.partition
        assert partition is not None
        await self._acquire_slot(partition)
        # A slot after a wait (the common case of a loaded sync client): execute now, as the first attempt
        # does when it finds a free slot, instead of a slow-path task that waits for the mount under a
        # timeout to do the same.
        try:
            self._check_open()
            executed = await self._execute_after_wait(run, partition)
        except BaseException:
            run.handle(Event.ADMIT)  # The slot is the run's: its end gives it back.
            raise
        if executed is None:
            run.handle(Event.ADMIT)
        return executed

    def on_callback_thread(self) -> bool:
        """True when called on one of this client's callback threads (``threads`` mode; cheap)."""
        pool = self._pool
        return pool is not None and pool.is_pool_thread()

    def submit_from_thread(self, contexts: Sequence[TransactionContext], wait_s: float = 0.0) -> int:
        """The submits of :class:`~waltz.client.sync.WaltzClient`, on an application thread (never the loop):
        :meth:`submit`'s path, its first attempts made on this thread.

        For each of ``contexts`` in order, the first attempt (:meth:`_first_attempt`: ``partition_id`` and,
        with a free slot on a mounted partition, ``execute``) runs right here, as on a callback thread; what
        it took goes to the loop in one :meth:`_hand_over` (one wake-up for the lot, in this order), where
        each continues as in ``submit``, without waiting for them: each append is sent in order before
        anything the thread asks the client afterwards. The first context alone may wait on this thread,
        up to ``wait_s`` seconds, for a slot of its mounted, full partition (a loaded sync client's common
        case: no coroutine, task or future per submit), past which it fails with the ``submit`` timeout
        error. Returns how many contexts were taken: it stops at the first it cannot take (its partition
        not ready, no free slot after the first, the client not started or closed), which the caller
        submits with :meth:`submit` (it waits on the loop). As with :meth:`submit`, an exception of a first
        attempt is raised here (the contexts before it are taken) and reported through ``on_exception``.
        """
        loop = self._loop
        if loop is None or self._closed or self._driver is None:
            return 0
        num_partitions = self._driver.num_partitions
        taken: list[tuple[Run, _Executed | _Refused]] = []
        try:
            for context in contexts:
                run = Run(context, self._dispatch.where(context))
                try:
                    first = self._first_attempt(run, num_partitions)
                    if first is None and not taken and wait_s > 0:
                        first = self._first_after_wait_on_thread(run, num_partitions, wait_s)
                except Exception as e:
                    taken.append((run, _Refused(e)))  # Ended on the loop, after those before it.
                    raise
                if first is None:
                    break
                taken.append((run, first))
                if isinstance(first, Exception):
                    raise first  # execute() raised: the loop ends it (on_exception) in its turn.
        finally:
            if taken:
                self._hand_over(loop, self._continue_batch, taken)
        return len(taken)

    def _first_after_wait_on_thread(self, run: Run, num_partitions: int, wait_s: float) -> _First:
        """A first attempt on an application thread that found no free slot (as :meth:`_first_after_wait`
        on the loop): while the run's partition is mounted and full, wait here for a slot (up to ``wait_s``
        seconds, then raise the ``submit`` timeout error) and make the attempt again. None if it was not
        executed: the loop decides."""
        deadline = time.monotonic() + wait_s
        first: _First = None
        while first is None:
            partition = run.partition
            if partition is None or self._closed or not partition.slots.is_full:
                return None  # Not mounted (or closed): waiting here is of no use.
            now = time.monotonic()
            if now >= deadline:
                raise self._slot_timeout_error(partition)
            partition.slots.wait_from_thread(deadline - now)
            first = self._first_attempt(run, num_partitions)
        return first

    def _hand_over(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
        """From an application thread: run ``fn(*args)`` on the loop, after everything handed over before.

        One ``call_soon_threadsafe`` (a handle and a wake-up of the loop) per burst instead of one per submit:
        only the first hand-over after the loop last took them schedules :meth:`_take_handed_over`. The call
        is made under the lock, so a thread that handed something over and then asks the loop anything else
        (another ``call_soon_threadsafe``) finds the first one ahead of it in the loop's queue."""
        with self._handoff_lock:
            self._handoff.append((fn, args))
            if self._handoff_scheduled:
                return
            try:
                loop.call_soon_threadsafe(self._take_handed_over)
            except BaseException:
                self._handoff.pop()
                raise
            self._handoff_scheduled = True

    def _take_handed_over(self) -> None:
        with self._handoff_lock:
            calls, self._handoff = self._handoff, []
            self._handoff_scheduled = False
        for fn, args in calls:
            try:
                fn(*args)
            except Exception:
                # Internal code only (no application code runs directly here): keep the others going.
                log.exception("handing a submit over to the client loop failed")

    def _continue_batch(self, taken: list[tuple[Run, _Executed | _Refused]]) -> None:
        """On the loop: the first attempts :meth:`submit_from_thread` made continue as in ``submit``."""
        for run, first in taken:
            self._runs.add(run)
            if isinstance(first, _Refused):  # As submit ends it (on_exception).
                self._spawn(self._end_with_exception(run, first.error), "waltz-failed-submit")
                continue
            partition = run.partition
            assert partition is not None
            self._continue_first(run, first, self._ready_monitor(partition))

    def _continue_first(self, run: Run, first: _Executed | None, monitor: TransactionMonitor | None) -> None:
        """On the loop: the one path of a first attempt after ``execute``, for ``submit`` and
        :meth:`submit_from_thread` alike. ``first`` is what :meth:`_first_attempt` returned (the run holds
        its slot and is admitted here; None: admitted already, not executed), ``monitor`` the partition's if
        it is ready. A filled builder is sent (the common case), or waits its turn on a write lock held by
        this client; anything else continues in a task, and ``run.first_send`` (made here only then) is
        resolved when the append is sent or the context ended: ``submit`` waits for it and raises its
        error."""
        partition = run.partition
        assert partition is not None
        if type(first) is TransactionBuilder and monitor is not None:  # The common case: sent now.
            locks = first.write_lock_hashes
            if locks:
                # Write locks: take them and send, or wait for the turn behind the context of ours holding
                # one (it executes again then). Either way submit returns now.
                wake = partition.lock_queue.take(run, locks)
                if wake is None:
                    run.admit_execute()
                    run.handle(Event.QUEUE)
                    self._park(partition, run, first)
                    self._spawn(self._run_context(run), f"waltz-run-p{partition.id}")
                    return
                if wake:
                    self._wake(wake)
            run.admit_execute_send()  # Before _send: a failed send resolves at once.
            self._send(partition, monitor, first, run)
            return
        name = f"waltz-run-p{partition.id}"
        if isinstance(first, _Pending):  # From submit_from_thread (submit awaits it before).
            self._spawn(self._continue_pending(run, first), name)
            return
        run.first_send = asyncio.get_running_loop().create_future()
        if first is not None:
            run.admit_execute()
        if isinstance(first, Exception):  # execute() raised
            self._spawn(self._end_with_exception(run, first), "waltz-failed-submit")
        elif first is False:  # execute() gave up
            self._step(run, Event.GIVE_UP)
            self._spawn(self._gave_up(run), "waltz-gave-up")
        elif self._closed:  # Closed while execute() ran.
            self._spawn(self._end_with_exception(run, ClientClosedError("the client is closed")), name)
        else:  # The partition is not ready: a task sends what was executed (or executes) once it is.
            self._spawn(self._run_context(run, first), name)

    async def _continue_pending(self, run: Run, pending: _Pending) -> None:
        first = await self._finish_first(run, pending)
        partition = run.partition
        assert partition is not None
        self._continue_first(run, first, self._ready_monitor(partition))

    async def _gave_up(self, run: Run) -> None:
        await self._call_hook(run.context.on_completion, False)
        self._finish(run)

    def _first_attempt(self, run: Run, num_partitions: int) -> _First:
        """On a callback thread: call ``partition_id`` and, if a slot is free at once on a ready partition,
        take it and call ``execute``. Returns the filled builder, False (execute gave up), the exception
        execute raised, or None (not executed: the caller waits for a slot and the mount on the loop).

        Reads loop state without the loop: each read is atomic, and what may change under it is re-checked
        on the loop (the mount is checked again before sending). The applied high-water mark only grows and
        only after ``apply_transaction`` returned, so the value read is a safe one for the builder.
        """
        context = run.context
        partition_id = context.partition_id(num_partitions)
        if type(partition_id) is not int or not 0 <= partition_id < num_partitions:
            if isinstance(partition_id, bool) or not isinstance(partition_id, int):
                raise ClientError(f"partition_id() returned {partition_id!r}, not an int")
            if not 0 <= partition_id < num_partitions:
                raise ClientError(f"partition_id() returned {partition_id}, outside 0..{num_partitions - 1}")
        partition = self._partitions.get(partition_id)
        if partition is None:
            raise self._not_mounted(partition_id)
        run.partition = partition
        stuck = partition.stuck
        if stuck is not None and stuck.failures >= STUCK_SUBMIT_AFTER:
            raise PartitionStuckError(stuck.describe(partition_id, self._clock()))
        monitor = partition.monitor
        if (
            monitor is None
            or partition.error is not None
            or partition.state is not _READY
            or self._closed
            or (self._retry.timeout_ms > 0 and self._retry.expired(context.creation_time, time.time()))
            or not partition.slots.try_acquire()
        ):
            return None
        # The slot is the run's now; the loop admits it (see _continue_first), which gives it back on its end.
        builder = TransactionBuilder(partition_id, monitor.applied_high_water_mark)
        try:
            result: Any = context.execute(builder)
        except Exception as e:  # noqa: BLE001 - reported through on_exception by submit
            return e
        if result is True:
            return builder
        if result is not None and (type(result) is _Coroutine or inspect.isawaitable(result)):
            return _new_tuple(_Pending, (builder, result))  # A coroutine execute: submit awaits it.
        return builder if result else False

    async def _execute_after_wait(
        self, run: Run, partition: PartitionState
    ) -> TransactionBuilder | Literal[False] | Exception | None:
        """``execute`` for a first attempt that waited for its slot (which it holds), if the partition is
        ready and the context not expired; None (not executed: the slow path decides) otherwise. Like
        :meth:`_first_attempt`, an exception of ``execute`` is returned, not raised."""
        monitor = self._ready_monitor(partition)
        if monitor is None or (
            self._retry.timeout_ms > 0 and self._retry.expired(run.context.creation_time, time.time())
        ):
            return None
        builder = TransactionBuilder(partition.id, monitor.applied_high_water_mark)
        try:
            result = await self._call_user(run.context.execute, builder)
        except Exception as e:  # noqa: BLE001 - reported through on_exception by submit
            return e
        return builder if result else False

    async def _finish_first(
        self, run: Run, pending: _Pending
    ) -> TransactionBuilder | Literal[False] | Exception:
        """Await a coroutine ``execute`` of a first attempt (inline mode)."""
        try:
            result = await pending.awaitable
        except asyncio.CancelledError:
            run.handle(Event.ADMIT)  # The slot is the run's: its end gives it back.
            raise
        except Exception as e:  # noqa: BLE001 - reported through on_exception by submit
            return e
        return pending.builder if result else False

    def _orphaned(self, run: Run, first: _First) -> None:
        """``submit`` was cancelled while its first attempt ran: give back the slot it may have taken (the
        context is dropped, as when ``submit`` is cancelled while it waits for a slot)."""
        if first is not None:  # It took a slot.
            run.handle(Event.ADMIT)
            self._step(run, Event.DROP)

    async def _acquire_slot(self, partition: PartitionState) -> None:
        self._say_if_waiting_on_zookeeper(partition)
        try:
            await partition.slots.acquire(self._config.submit_timeout_ms / 1000)
        except TimeoutError:
            raise self._slot_timeout_error(partition) from None

    def _slot_timeout_error(self, partition: PartitionState) -> ClientError:
        """Why a submit found no free slot within ``client.submitTimeout``."""
        if partition.stuck is not None:
            return PartitionStuckError(partition.stuck.describe(partition.id, self._clock()))
        trouble = self._coordination_trouble()
        if trouble is not None:
            return ClientTimeoutError(
                f"submit timed out after {self._config.submit_timeout_ms} ms (client.submitTimeout) "
                f"waiting on ZooKeeper: partition {partition.id}'s {partition.slots.limit} transactions in "
                f"flight wait for it; {trouble.description}"
            )
        return ClientTimeoutError(
            f"submit timed out after {self._config.submit_timeout_ms} ms: partition {partition.id} "
            f"already has {partition.slots.limit} transactions in flight "
            "(client.maxConcurrentTransactions); is the feed stalled or the application overloaded?"
        )

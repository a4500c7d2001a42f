"""An append's journey: registered and sent (:meth:`AttemptsMixin._send`), its fate heard, the same way for
every attempt (:meth:`AttemptsMixin._resolve`: a commit is finished there), and the retry path: a context
whose append did not commit (or whose first attempt had to wait) continues in a task
(:meth:`AttemptsMixin._run_context`) that executes it again, after a backoff or, for a lock failure, once the
winning transaction is applied, and sends it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from waltz.client.builder import TransactionBuilder
from waltz.client.driver import MountState
from waltz.client.hooks import HooksMixin
from waltz.client.lifecycle import Event, State
from waltz.client.monitor import Outcome, Resolution, TransactionMonitor
from waltz.client.state import PartitionState, Run
from waltz.client.transaction import Transaction
from waltz.errors import (
    ClientAheadError,
    ClientError,
    ClientTimeoutError,
    LocalProtocolError,
    PartitionStuckError,
    TrimmedError,
    WaltzError,
)
from waltz.protocol.records import ReqId

__all__ = ["AttemptsMixin"]

log = logging.getLogger("waltz.client.core")  # The core's one logger (docs/client.md names it).


_COMMITTED = Outcome.COMMITTED
_ENDED = State.ENDED
_MASK32 = 0xFFFFFFFF
_READY = MountState.READY
_new_tuple = tuple.__new__
"""Builds a named tuple (ReqId) from a tuple in C, without its generated Python ``__new__``."""

_FAILURE_EVENTS = {Outcome.LOCK_FAILED: Event.LOCK_FAIL, Outcome.FAILED: Event.LOST}
"""The lifecycle event of an append that did not commit."""


class _Expired(Exception):
    """The error of a context past ``client.transactionTimeout`` (the lifecycle's EXPIRE, not FAIL)."""

    def __init__(self, error: ClientTimeoutError) -> None:
        super().__init__(str(error))
        self.error = error


class AttemptsMixin(HooksMixin):
    """Sending appends, hearing their fate, and the retry path (see the module docstring)."""

    __slots__ = ()

    def _send(
        self,
        partition: PartitionState,
        monitor: TransactionMonitor,
        builder: TransactionBuilder,
        run: Run,
    ) -> None:
        """Register and send one append of ``run`` (APPENDING); synchronous, so registration order is send
        order. Its fate reaches the run on the loop, the same way for every attempt: a commit through
        :meth:`_resolve`, anything else through :meth:`_on_attempt_failed`."""
        driver = self._driver
        assert driver is not None  # Sending follows a check of the partition's mount.
        p = partition.id
        seq = self._next_seq.get(p, 0) + 1
        self._next_seq[p] = seq
        # ReqId.of(client id, generation, p, seq) without its two Python calls (classmethod, tuple __new__),
        # from the halves the partition keeps.
        req_id = _new_tuple(ReqId, (partition.req_msb, partition.req_lsb_base | (seq & _MASK32)))
        outcomes = partition.outcomes
        outcomes[req_id] = run
        self._outstanding += 1
        run.data = builder._data  # What its committed transaction carries (see _resolve).
        monitor.register(req_id, seq, self._clock())
        try:
            # Alone in flight on the whole client (one append at a time): nothing would join it in this
            # iteration's write, so it leaves now instead of one loop pass later. Pipelined appends share one
            # write, also when each is alone on its partition (many partitions: a write per append cost the
            # client a third of its CPU and the server a read per append).
            driver.send_append(p, req_id, builder, self._outstanding == 1)
        except LocalProtocolError as e:
            # It can never be sent (over the connection's frame limit, or a field the format cannot carry):
            # retrying would execute the context again for ever. The context ends with this error instead.
            log.warning("partition %d: append %r cannot be sent: %s", partition.id, req_id, e)
            monitor.fail(req_id)
            del outcomes[req_id]  # Registered above, in this same synchronous call.
            self._outstanding -= 1
            self._on_attempt_failed(run, e)
        except WaltzError as e:
            log.warning("partition %d: append %r not sent: %s", partition.id, req_id, e)
            self._resolve(partition, monitor.fail(req_id))

    def _send_flush(self, partition_id: int, req_id: ReqId) -> None:
        try:
            self._require_driver().send_flush(partition_id, req_id)
        except WaltzError as e:
            # Not fatal: the next nudge or READY sends another flush.
            log.warning("partition %d: flush not sent: %s", partition_id, e)

    def _resolve(
        self, partition: PartitionState, resolutions: list[Resolution], feed: list[Transaction] | None = None
    ) -> None:
        """Hand each resolution to the run whose append it is: a commit is finished here (its slot, its
        lifecycle, ``on_completion``), anything else through :meth:`_on_attempt_failed`. Once per feed run,
        not per append: the slots of the committed runs are given back in one ``Slots.release`` (one lock
        round) after the loop; with metrics on, their contexts' creation times go to the latency histogram in
        one call too.

        ``feed``: the transactions of the feed run that made ``resolutions`` (consecutive ids, every commit
        among them): a commit's transaction gets the data its append sent, so applying it costs no fetch."""
        outcomes = partition.outcomes
        first = feed[0].transaction_id if feed else 0
        awaiting_apply = partition.awaiting_apply
        metrics = self._metrics
        created: list[float] | None = None if metrics is None else []
        released = 0
        try:
            for resolution in resolutions:
                req_id, outcome, transaction_id = resolution
                run = outcomes.pop(req_id, None)
                if run is None:
                    continue
                self._outstanding -= 1
                if outcome is not _COMMITTED:
                    self._on_attempt_failed(run, resolution)
                    continue
                # Committed (once per append): it leaves APPENDING (its COMMIT is made by _run_hook), so its
                # slot is free.
                released += 1
                run.transaction_id = transaction_id
                if feed is not None:
                    transaction = feed[transaction_id - first]
                    if transaction.transaction_id == transaction_id:  # (Always: the feed's ids are dense.)
                        transaction._data = run.data
                awaiting_apply.append(run)
                self._run_hook(run, True)
                if created is not None:
                    created.append(run.context.creation_time)
        finally:
            if released:
                partition.slots.release(released)
                if metrics is not None and created:
                    metrics.committed(partition.id, created)

    def _fail_outcomes(self, partition: PartitionState, error: ClientError | TrimmedError) -> None:
        outcomes, partition.outcomes = partition.outcomes, {}
        self._outstanding -= len(outcomes)
        for run in outcomes.values():
            self._on_attempt_failed(run, error)

    def _on_attempt_failed(self, run: Run, result: Resolution | BaseException) -> None:
        """An append of ``run`` did not commit (a lock failure, lost, or an error): it continues in a task,
        the retry path, which ends it with ``result`` if that is an error."""
        partition = run.partition
        assert partition is not None
        if isinstance(result, Resolution):
            run.handle(_FAILURE_EVENTS[result.outcome])
            if self._metrics is not None:
                self._metrics.retried(partition.id, result.outcome)
        wake = partition.lock_queue.release(run)
        if wake:
            self._wake(wake)
        self._spawn(self._run_context(run, None, result), f"waltz-run-p{partition.id}")

    def _take_turn(self, partition: PartitionState, run: Run, builder: TransactionBuilder) -> bool:
        """True if ``run`` may send ``builder`` now (it then holds its write locks in the lock queue); False
        if another context of this client holds one of them (then ``run`` must wait for its turn)."""
        queue = partition.lock_queue
        locks = builder.write_lock_hashes
        if not locks and queue.is_idle(run):
            return True  # The common case, no write locks: nothing to hold, nobody to wake.
        wake = queue.take(run, locks)
        if wake is None:
            return False
        if wake:
            self._wake(wake)
        return True

    def _park(self, partition: PartitionState, run: Run, builder: TransactionBuilder) -> None:
        """Queue ``run`` behind the context holding one of ``builder``'s write locks (see _await_turn)."""
        blocker = partition.lock_queue.blocker(run, builder.write_lock_hashes)
        if blocker is None:
            raise ClientError("internal error: parking a context that is not blocked")
        run.turn = asyncio.get_running_loop().create_future()
        wake = partition.lock_queue.park(run, blocker)
        if wake:
            self._wake(wake)
        if run.first_send is not None and not run.first_send.done():
            run.first_send.set_result(None)  # Queued counts as accepted: submit returns.

    async def _await_turn(self, run: Run) -> None:
        """Return when it is the parked ``run``'s turn to execute again (the transaction of the context
        before it applied, or its append failed), or once the context expired."""
        if run.turn is None:
            return
        timeout_ms = self._config.transaction_timeout_ms
        try:
            if timeout_ms > 0:
                remaining_s = timeout_ms / 1000 - (time.time() - run.context.creation_time)
                # Past the deadline the caller's expiry check ends the context.
                await asyncio.wait_for(asyncio.shield(run.turn), max(remaining_s, 0))
            else:
                await run.turn
        except TimeoutError:
            pass  # Still QUEUED: the caller's expiry check ends the context.
        else:
            run.handle(Event.TURN)
        finally:
            run.turn = None

    async def _run_context(
        self,
        run: Run,
        builder: TransactionBuilder | None = None,
        pending: Resolution | BaseException | None = None,
    ) -> None:
        """The retry path of a context, up to its next send: every attempt after the first, or a first one
        that had to wait. Each append's fate reaches the run the same way (:meth:`_resolve`): a commit ends
        there, a failure starts this again.

        ``builder`` (if given) is the last attempt, executed but not sent yet; ``pending`` (if given) is the
        fate of the last one, sent and not committed. The attempts made are the lifecycle's to count.
        """
        try:
            await self._await_turn(run)  # Parked by submit.
            if pending is not None:
                if isinstance(pending, BaseException):
                    raise pending
                await self._after_failure(run, pending)
            while not await self._attempt(run, builder):
                builder = None
        except asyncio.CancelledError:
            raise  # close() reports ClientClosedError to the context.
        except _Expired as e:
            await self._end_with_exception(run, e.error, Event.EXPIRE)
        except Exception as e:  # noqa: BLE001 - every failure ends the context through on_exception
            await self._end_with_exception(run, e, Event.FAIL)
        finally:
            if run.state is _ENDED:
                self._finish(run)  # Ended here (an append in flight reaches the run through _resolve).

    def _check_may_retry(self, run: Run) -> None:
        """Before another execution: raise if ``client.maxTransactionAttempts`` appends were refused, or
        (:class:`_Expired`) if the context is past ``client.transactionTimeout``."""
        attempts = run.attempts
        if attempts > 0 and self._retry.attempts_exhausted(attempts):
            raise ClientTimeoutError(
                f"transaction context gave up after {attempts} attempts (client.maxTransactionAttempts)"
            )
        if self._retry.expired(run.context.creation_time, time.time()):
            raise _Expired(
                ClientTimeoutError(
                    f"transaction context expired after {self._config.transaction_timeout_ms} ms "
                    f"and {attempts} attempts (client.transactionTimeout)"
                )
            )

    async def _attempt(self, run: Run, builder: TransactionBuilder | None) -> bool:
        """One attempt of the retry path: execute (unless ``builder`` was), take a turn on its write locks,
        and send. True once this task is done with the run (sent: the append's fate reaches the run as a
        first attempt's does; or gave up), False for another attempt (its turn came after a wait)."""
        partition = run.partition
        assert partition is not None
        context = run.context
        if builder is None:
            self._check_may_retry(run)
            monitor = await self._wait_mounted(partition)
            builder = TransactionBuilder(partition.id, monitor.applied_high_water_mark)
            run.execute()
            if not await self._call_user(context.execute, builder):
                self._step(run, Event.GIVE_UP)
                await self._call_hook(context.on_completion, False)
                return True
        # The mount may have changed while execute ran; its high-water mark is still a safe one.
        monitor = await self._wait_mounted(partition)
        if not self._take_turn(partition, run, builder):
            # Not sent, so not counted: the attempt bound is about appends the server refused.
            run.handle(Event.QUEUE)
            self._park(partition, run, builder)
            await self._await_turn(run)
            return False
        run.send()  # Before _send: a failed send reaches the run at once.
        self._send(partition, monitor, builder, run)
        if run.first_send is not None and not run.first_send.done():
            run.first_send.set_result(None)
        return True  # Its fate reaches the run through _resolve (or _on_attempt_failed: another task).

    async def _after_failure(self, run: Run, failure: Resolution) -> None:
        """Between a failed attempt and the next execute: retry on knowledge, back off on ignorance.

        A lock failure names the transaction that took the lock, and the monitor releases it only once this
        client has applied that transaction, so executing again right away reads the state that won: no
        sleep. A lost append (or a send error) says nothing about when a retry could succeed: back off.
        """
        if failure.outcome is Outcome.LOCK_FAILED:
            await self._call_hook(run.context.on_lock_failure)
            return
        await asyncio.sleep(self._retry.delay_s(run.attempts))

    async def _wait_mounted(self, partition: PartitionState) -> TransactionMonitor:
        if partition.error is None and partition.state is _READY and partition.monitor is not None:
            return partition.monitor  # Mounted: no wait (the common case).
        self._say_if_waiting_on_zookeeper(partition)
        timeout_ms = self._config.mount_timeout_ms
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                while True:
                    if partition.error is not None:
                        raise partition.error
                    if partition.state is MountState.CLIENT_AHEAD:
                        raise ClientAheadError(
                            f"partition {partition.id}: the application's high-water mark is ahead of the "
                            "server's (wrong cluster, or the log lost data)"
                        )
                    if partition.state is _READY and partition.monitor is not None:
                        return partition.monitor
                    await partition.changed()
        except TimeoutError:
            if partition.stuck is not None:
                raise PartitionStuckError(partition.stuck.describe(partition.id, self._clock())) from None
            trouble = self._coordination_trouble()
            if trouble is not None:
                raise ClientTimeoutError(
                    f"partition {partition.id} was not mounted within {timeout_ms} ms (client.mountTimeout): "
                    f"waiting on ZooKeeper; {trouble.description}"
                ) from None
            raise ClientTimeoutError(
                f"partition {partition.id} was not mounted within {timeout_ms} ms (client.mountTimeout)"
            ) from None

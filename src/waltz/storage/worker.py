"""One partition on a storage node: its log, fencing session id, queue, health and worker."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from waltz.errors import (
    CorruptionError,
    PartitionNotAssignedError,
    RemoteProtocolError,
    SessionFencedError,
    StorageError,
    TransactionOutOfOrderError,
    WaltzError,
)
from waltz.protocol import storage as st
from waltz.runtime import TaskSet
from waltz.storage.config import StorageConfig
from waltz.storage.controlfile import FLAG_ASSIGNED, FLAG_AVAILABLE, FLAG_DAMAGED, ControlFile, PartitionInfo
from waltz.storage.fileio import FileSystem
from waltz.storage.fsync import FsyncPolicy, GroupSync
from waltz.storage.index_writes import FlushedIndexWrites
from waltz.storage.metrics import Metrics
from waltz.storage.partition import PartitionLog
from waltz.storage.replica_check import lost_below_mark, missing_log
from waltz.storage.segment import (
    RECORD_OVERHEAD_BYTES,
    RecordCorruptionError,
    ZeroFill,
    append_wire_run,
    encode_stored_run,
    verify_client_checksums,
)
from waltz.storage.work import MAX_DAMAGED_REPORTED, BoundedQueue, Item, Tally

log = logging.getLogger(__name__)

Handler = Callable[["StoragePartition", Item], st.StorageMessage]
"""Answers one request type for a partition (see :data:`waltz.storage.handlers.HANDLERS`)."""


class PartitionHost(Protocol):
    """What a partition, its worker and its request handlers use of the storage node (which satisfies it;
    :class:`waltz.storage.services.NodeServices` adds what the ports and scrub use)."""

    fs: FileSystem
    config: StorageConfig
    control: ControlFile
    metrics: Metrics
    fsync: FsyncPolicy
    group_sync: GroupSync
    index_writes: FlushedIndexWrites
    queued: Tally
    tasks: TaskSet
    handlers: dict[type[st.StorageMessage], Handler]
    """How a partition answers each request type other than an append."""

    def respond(self, item: Item, resp: st.StorageMessage) -> None: ...

    def send_payload(
        self, item: Item, payload: bytes | tuple[bytes, bytes | bytearray | memoryview]
    ) -> None: ...


HEAL_INTERVAL_S = 1.0
"""Least time between two attempts to heal a broken partition."""
HEAL_MIN_FREE_BYTES = 1 << 20
"""Free space the data directory needs before a broken partition tries to heal (so a full disk does not
make it flap between healed and broken)."""
PREALLOCATE_RETRY_S = 60.0
"""After a failed write of preallocated zeros (a full disk, say), how long a partition writes none."""


class Health(enum.Enum):
    """Whether a partition serves. Separate from it, a replica may be damaged (``StoragePartition.lost``):
    it then serves but does not vote in recovery until repaired."""

    SERVING = "serving"
    FAIL_STOPPED = "fail-stopped"
    """A write or fsync failed: every request is refused until a heal succeeds (``StoragePartition._heal``),
    tried at most every ``HEAL_INTERVAL_S`` on a request."""
    FAILED = "failed"
    """The worker hit a bug (or ended): every request is refused until the node restarts."""


_HEALTH_MOVES: dict[Health, frozenset[Health]] = {
    Health.SERVING: frozenset({Health.FAIL_STOPPED, Health.FAILED}),
    Health.FAIL_STOPPED: frozenset({Health.SERVING, Health.FAILED}),
    Health.FAILED: frozenset(),
}
"""The states a partition may move to from each (FAILED is final)."""


class StoragePartition:
    """One partition on this node: its log (if assigned), fencing session id, queue and worker."""

    def __init__(self, node: PartitionHost, partition_id: int) -> None:
        self.node = node
        self._handlers = node.handlers
        self.partition_id = partition_id
        self.log: PartitionLog | None = None
        info = node.control.partition_info(partition_id)
        self.session_id = info.session_id
        self.verified_session_id = info.session_id
        """The highest session id the cluster's metadata is known to have handed out (see authority.py)."""
        self.damaged: dict[int, str] = {}
        """Transaction ids whose stored copy failed verification here and was not repaired yet -> reason."""
        self.lost: str | None = None
        """Why this replica is damaged (it lost records it held; see waltz.storage.replica_check), or None.
        Set together with the control file's DAMAGED flag, cleared by ``check_repaired``."""
        self.marked_since_lost = False
        """A low-water mark was set since the damage was found (the repair's target; see replica_check)."""
        self.last_truncate_refusal_log_s = -1e9
        self.session_check = asyncio.Lock()
        self.last_refusal_s = -1e9
        self.last_refusal_log_s = -1e9
        self.queue = BoundedQueue(node.config.partition_queue_size, node.queued)
        self.fsync_count = 0
        self.threaded_fsync_count = 0
        """Of ``fsync_count``, those run in a thread (see ``_fsync``)."""
        self.appended_records = 0
        self.appended_bytes = 0
        """Records and data bytes appended and fsynced (exported by ``AppendCounters``)."""
        self._written_records = 0
        self._written_bytes = 0
        """Records and data bytes of the group written last (a partition has one group at a time between its
        write and its answers), added to the two above once it is answered Success."""
        self.health = Health.SERVING
        self.health_reason: str | None = None
        """Why the partition is not SERVING (see :class:`Health`)."""
        self.durable_max = -1
        """The highest id an fsync (or a truncation, which syncs) made durable: healing truncates to it."""
        self._next_heal_s = 0.0
        self._zeros: ZeroFill | None = None
        """A chunk of zeros written ahead and not fsynced yet: the next group fsync makes it durable (see
        ``_preallocate``)."""
        self.preallocate_off_until = 0.0
        """No zeros are written before this monotonic time (a zero write failed)."""
        self.preallocated_bytes = 0
        self.preallocate_failures = 0
        self._extending_writes_closed = 0
        """``extending_writes`` of the logs closed before the open one (a heal, an unassignment)."""
        self.worker_gone = False
        self.current: Item | None = None
        """The item the worker is on (answered by the node if the worker ends under it)."""
        self.busy = False
        """True while a request of this partition is being processed (by the worker, or by ``commit_now`` or
        ``commit_soon``)."""
        self._committing = False
        """True while a group of ``commit_soon`` waits for its fsync: the worker waits for it before its next
        item (so requests are answered in order, and the partition has one fsync waiting at a time)."""
        self._committed: asyncio.Future[None] | None = None
        """What the worker awaits while ``_committing`` (made only then: most groups have no worker
        waiting)."""
        # Metric children looked up once: ``labels()`` costs more than the update on the append path.
        # Read when scraped: setting it for every request the worker takes cost as much as the update.
        node.metrics.queue.labels(partition_id).set_function(lambda: len(self.queue))
        self.read_bytes = node.metrics.read_bytes.labels(partition_id)
        # The highest durable id, read when scraped (as the queue size): a Gauge.set per group commit took a
        # lock and three calls on the append path.
        node.metrics.max_txn.labels(partition_id).set_function(lambda: self.durable_max)

    @property
    def info(self) -> PartitionInfo:
        return self.node.control.partition_info(self.partition_id)

    def open_log(self) -> PartitionLog:
        if self.log is None:
            cfg = self.node.config
            info = self.info
            if info.assigned and self.lost is None:
                # Before PartitionLog.open, which would make a missing directory anew: an empty log must never
                # pass for the replica the control file describes.
                why = (
                    "it was found damaged before and is not repaired yet"
                    if info.replica_damaged
                    else missing_log(self.node.fs, str(cfg.directory), self.partition_id)
                )
                if why is not None:
                    self._mark_lost(why)
            self.log = PartitionLog.open(
                str(cfg.directory),
                self.node.control.key,
                self.partition_id,
                segment_size_threshold_bytes=cfg.segment_size_threshold_bytes,
                segment_cache_capacity=cfg.segment_cache_capacity,
                local_low_water_mark=self.info.local_low_water_mark,
                trim_point=self.node.control.trim_point(self.partition_id),
                fs=self.node.fs,
            )
            for txn in self.log.damaged_at_open:  # kept by recovery, not cut (see waltz.storage.resync)
                self.note_damage(txn, "durable but does not verify at open")
            if self.broken is None:
                # What a (re)start finds on disk is what the disk holds. A broken partition keeps the mark it
                # had: its page cache may hold records the disk lost (see ``_heal``).
                self.durable_max = self.log.max_transaction_id
            if info.assigned and self.lost is None:
                why = lost_below_mark(self.log.max_transaction_id, info) or self.log.lost_at_open
                if why is not None:
                    self._mark_lost(why)
        return self.log

    def _mark_lost(self, why: str) -> None:
        """Record that this replica lost records it held: durably (the DAMAGED flag), one ERROR line."""
        info = self.info
        if not info.replica_damaged:
            self.node.control.update(self.partition_id, flags=info.flags | FLAG_DAMAGED)
        self.lost = why
        self.marked_since_lost = False
        log.error(
            "partition %d: this replica is damaged: %s (low-water mark %d, local low-water mark %d); it does "
            "not vote in recovery until it is repaired (caught up to a low-water mark set after this, by the "
            "owning server's recovery or by `waltz storage recover-partition`)",
            self.partition_id,
            why,
            info.low_water_mark,
            info.local_low_water_mark,
        )

    def check_repaired(self) -> None:
        """Clear the damage once the replica holds a low-water mark set after it was found (see
        waltz.storage.replica_check): durably, one INFO line."""
        info = self.info
        if not self.marked_since_lost or self.durable_max < info.low_water_mark:
            return
        self.node.control.update(self.partition_id, flags=info.flags & ~FLAG_DAMAGED)
        log.info(
            "partition %d: the damaged replica is repaired: it holds 0..%d, at least its low-water mark %d "
            "(set by session %d after the damage was found: %s); it votes again",
            self.partition_id,
            self.durable_max,
            info.low_water_mark,
            info.session_id,
            self.lost,
        )
        self.lost = None
        self.marked_since_lost = False

    @property
    def preallocating(self) -> bool:
        """A chunk of zeros was written and waits for the next group fsync (see ``_preallocate``)."""
        return self._zeros is not None

    def close_log(self) -> None:
        self._zeros = None  # closing fsyncs (or, healing, drops) what they were written to
        if self.log is not None:
            self._extending_writes_closed += self.log.extending_writes
            self.log.close()
            self.log = None

    @property
    def extending_writes(self) -> int:
        """Group writes that went past the fsynced zeros (see ``PartitionLog.extending_writes``)."""
        plog = self.log
        return self._extending_writes_closed + (plog.extending_writes if plog is not None else 0)

    # -- checks -----------------------------------------------------------------------------------

    def check(self, msg: st.StorageMessage, offline: bool, *, may_adopt: bool = False) -> PartitionLog:
        """``may_adopt``: an offline request may carry a *newer* session id than the persisted one (an offline
        SetLowWaterMark, which then persists it: see ``_set_low_water_mark``)."""
        control = self.node.control
        damage = control.damaged.get(self.partition_id)
        if damage is not None:
            raise CorruptionError(
                f"partition {self.partition_id} is down on this node: its control file entry is damaged "
                f"({damage}); remove this replica with its files and add it again"
            )
        if self.health is not Health.SERVING:
            if self.health is Health.FAILED:
                raise StorageError(f"partition {self.partition_id} failed: {self.health_reason}")
            if not self._heal():
                raise StorageError(f"partition {self.partition_id} is fail-stopped: {self.health_reason}")
        info = control.partition_info(self.partition_id)
        flags = info.flags  # tested here, not through its properties: this runs for every request
        if not flags & FLAG_ASSIGNED or self.log is None:
            raise PartitionNotAssignedError(f"Partition:{self.partition_id} is not assigned.")
        if offline:
            if flags & FLAG_AVAILABLE:
                raise PartitionNotAssignedError(
                    f"Partition:{self.partition_id} is available; offline requests need it offline"
                )
            if msg.session_id != info.session_id and not (may_adopt and msg.session_id > info.session_id):
                raise SessionFencedError(
                    f"offline request session {msg.session_id} is not the persisted session {info.session_id}"
                )
        else:
            if not flags & FLAG_AVAILABLE:
                raise PartitionNotAssignedError(f"Partition:{self.partition_id} is not available.")
            if msg.session_id != self.session_id:
                raise SessionFencedError(
                    f"session {msg.session_id} of partition {self.partition_id} is fenced by session "
                    f"{self.session_id}"
                )
        return self.log

    def _heal(self) -> bool:
        """Try to bring a broken partition back (see the module docstring); True if it serves again."""
        now = time.monotonic()
        if now < self._next_heal_s:
            return False
        self._next_heal_s = now + HEAL_INTERVAL_S
        directory = str(self.node.config.directory)
        try:
            stat = os.statvfs(directory)
        except OSError as e:
            log.debug("partition %d: cannot stat %s: %s", self.partition_id, directory, e)
            return False
        free = stat.f_bavail * stat.f_frsize
        if free < HEAL_MIN_FREE_BYTES:
            return False
        try:
            self.close_log()
            plog = self.open_log()
            dropped = plog.max_transaction_id - self.durable_max
            if dropped > 0:
                plog.truncate(self.durable_max)
            plog.flush()
        except WaltzError as e:
            log.debug("partition %d: still broken: %s", self.partition_id, e)
            return False
        self.durable_max = plog.max_transaction_id
        log.info(
            'partition %d healed after "%s": %d MiB free, log cut to %d (the last durable id; %d '
            "unacknowledged records dropped); serving again",
            self.partition_id,
            self.broken,
            free >> 20,
            plog.max_transaction_id,
            max(0, dropped),
        )
        self._become(Health.SERVING, None)
        return True

    # -- the worker -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Process this partition's queue forever (cancelled when the node closes).

        Request errors are answered where they happen; an exception that reaches this loop is a bug. The
        partition then fails (it refuses every later request, so nothing of it can be trusted to a writer)
        but the worker goes on answering, so no request waits forever on a dead worker.
        """
        while True:
            item = self.current = await self.queue.get()
            self.busy = True
            try:
                if self._committing:
                    committed = self._committed = asyncio.get_running_loop().create_future()
                    await committed
                if item.op is not None:
                    await self._run_op(item)
                elif isinstance(item.msg, st.AppendRequest):
                    await self._group_commit(item)
                else:
                    self._respond(item, self._process(item))
            except Exception as e:  # noqa: BLE001 - a bug: fail the partition, answer the request
                self.fail(
                    f"{type(item.msg).__name__ if item.msg is not None else 'admin operation'}: {e!r}", e
                )
                self.answer_failed(item)
            self.current = None
            self.busy = False

    def fail(self, reason: str, error: BaseException | None = None) -> None:
        """Fail this partition for good (until the node restarts): one ERROR line, then health reports it."""
        if self._become(Health.FAILED, reason):
            log.error(
                "partition %d failed (%s); refusing every request until the node restarts",
                self.partition_id,
                reason,
                exc_info=error,
            )

    def answer_failed(self, item: Item) -> None:
        """Answer ``item`` with this partition's failure (if it was not answered yet)."""
        error = StorageError(f"partition {self.partition_id} failed: {self.failed}")
        if item.done is not None:
            if not item.done.done():
                item.done.set_exception(error)
        elif item.msg is not None:
            self._respond(item, self._failure(item.msg, error))

    async def enqueue(self, item: Item) -> None:
        """Queue ``item`` for the worker (waiting for room), or answer it at once if the worker is gone."""
        if self.worker_gone:
            self.answer_failed(item)
        else:
            await self.queue.put(item)

    def enqueue_nowait(self, item: Item) -> bool:
        """:meth:`enqueue` without waiting (the common case, saving a coroutine per request); False if the
        queue has no room for it now (nothing done)."""
        if self.worker_gone:
            self.answer_failed(item)
            return True
        return self.queue.put_nowait(item)

    def _become(self, state: Health, reason: str | None) -> bool:
        """Move to ``state`` if :data:`_HEALTH_MOVES` allows it (True), else stay (False)."""
        if state not in _HEALTH_MOVES[self.health]:
            return False
        self.health = state
        self.health_reason = reason
        return True

    @property
    def broken(self) -> str | None:
        """Why the partition is fail-stopped (it heals itself), or None."""
        return self.health_reason if self.health is Health.FAIL_STOPPED else None

    @property
    def failed(self) -> str | None:
        """Why the partition failed for good (until the node restarts), or None."""
        return self.health_reason if self.health is Health.FAILED else None

    @property
    def problem(self) -> str | None:
        """Why this partition does not serve fully, or None."""
        if self.failed is not None:
            return f"failed: {self.failed}"
        if self.broken is not None:
            return f"fail-stopped: {self.broken}"
        if self.lost is not None:
            return f"replica damaged: {self.lost}; it does not vote until repaired"
        return None

    async def _run_op(self, item: Item) -> None:
        assert item.op is not None
        assert item.done is not None
        try:
            result = item.op()
            if isinstance(result, Awaitable):
                result = await result
        except Exception as e:  # noqa: BLE001 - handed to the awaiting admin request
            if not item.done.done():
                item.done.set_exception(e)
        else:
            if not item.done.done():
                item.done.set_result(result)

    def _process(self, item: Item) -> st.StorageMessage:
        """Answer a request other than an append (see :data:`waltz.storage.handlers.HANDLERS`)."""
        msg = item.msg
        assert msg is not None
        self.node.metrics.requests.inc(type(msg).__name__)
        try:
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise RemoteProtocolError(f"{type(msg).__name__} is not a request")
            return handler(self, item)
        except RecordCorruptionError as e:
            self.note_damage(e.transaction_id, str(e))
            # Sent as the plain CorruptionError the peer knows: the server then reads another replica.
            return self._failure(msg, CorruptionError(str(e)))
        except WaltzError as e:
            return self._failure(msg, e)

    def note_damage(self, transaction_id: int, reason: str) -> None:
        """Report a damaged stored record: one ERROR line and a metric per record, kept for status."""
        if transaction_id in self.damaged:
            return
        if len(self.damaged) < MAX_DAMAGED_REPORTED:
            self.damaged[transaction_id] = reason
        self.node.metrics.corrupt_records.labels(self.partition_id).inc()
        log.error(
            "partition %d: stored transaction %d is damaged on this node (%s); readers fall back to another "
            "replica, which repairs this copy",
            self.partition_id,
            transaction_id,
            reason,
        )

    def forget_damage_above(self, max_id: int) -> None:
        """Damaged records a truncation removed are no longer held, so no longer reported."""
        for txn in [t for t in self.damaged if t > max_id]:
            del self.damaged[txn]

    def repaired(self, ids: list[int]) -> None:
        for txn in ids:
            self.damaged.pop(txn, None)
            self.node.metrics.repaired_records.labels(self.partition_id).inc()
        if ids:
            log.info(
                "partition %d: repaired %d damaged record(s) from another replica's copy (%d..%d)",
                self.partition_id,
                len(ids),
                min(ids),
                max(ids),
            )

    async def _group_commit(self, first: Item) -> None:
        """Write every append queued right now, fsync once, then answer them all in order.

        Each request is checked on its own right before its records join the group's run (ids continuing
        the log, client data checksums; :func:`append_wire_run` builds the stored layout straight from the
        request's bytes), so a bad request fails alone. The run of all accepted requests is then written with
        one :meth:`PartitionLog.append_run` (one pwrite per file for the whole group). Success is sent
        strictly after the data file's fsync returned; if the write or the fsync fails, every request of the
        group fails and the partition refuses further writes (see :meth:`_fsync`).
        """
        batch = [first]
        limit = self.node.config.max_group_commit_records
        queue = self.queue
        assert isinstance(first.msg, st.AppendRequest)
        count = len(first.msg.records)
        while count < limit:
            nxt = queue.peek()
            if nxt is None or not isinstance(nxt.msg, st.AppendRequest):
                break
            batch.append(queue.pop())
            count += len(nxt.msg.records)
        results, accepted, plog = self._write_group(batch)
        error = await self._fsync(plog) if accepted and plog is not None else None
        self._answer_group(batch, results, accepted, error)

    @property
    def may_commit_now(self) -> bool:
        """Whether an append that just arrived may be written, fsynced and answered at once, in the caller's
        loop pass (:meth:`commit_now`) instead of by the worker: the worker idles with nothing queued (so
        nothing is overtaken), no fsync of this node is running and fsyncs run on the loop (see
        :meth:`_fsync`). The caller also leaves to the worker an append with more requests read behind it
        (group commit)."""
        node = self.node
        return (
            not self.busy
            and node.queued.items == 0
            and not self.worker_gone
            and not node.group_sync.pending
            and node.fsync.inline_allowed()
        )

    def commit_now(self, item: Item) -> None:
        """:meth:`_group_commit` of ``item`` alone, its fsync on the loop, answered before this returns (call
        only when :attr:`may_commit_now`). Same checks, same durability: Success only after the fsync. It
        saves the worker's wake-up and a loop pass per append on a node whose requests come one at a time
        (one replication batch per partition in flight from the server)."""
        self.busy = True
        try:
            batch = [item]
            results, accepted, plog = self._write_group(batch)
            error = self._fsync_inline(plog) if accepted and plog is not None else None
            self._answer_group(batch, results, accepted, error)
        except Exception as e:  # noqa: BLE001 - a bug: as in run(), fail the partition, answer the request
            self.fail(f"AppendRequest: {e!r}", e)
            self.answer_failed(item)
        finally:
            self.busy = False

    @property
    def may_commit_soon(self) -> bool:
        """Whether an append that just arrived with more requests read behind it may be written now and its
        fsync join the node's batch (:meth:`commit_soon`) instead of waking the worker: the partition is idle
        with nothing queued and another partition's request is queued or fsync asked for in this pass (so a
        batch forms; alone, the worker groups it with the requests behind it, maybe of the same partition)."""
        node = self.node
        return (
            not self.busy
            and not self.queue
            and not self.worker_gone
            and (node.queued.items > 0 or bool(node.group_sync.pending))
        )

    def commit_soon(self, item: Item) -> None:
        """:meth:`_group_commit` of ``item`` alone without the worker (call only when
        :attr:`may_commit_soon`): written now, its fsync asked of the node's
        :class:`~waltz.storage.fsync.GroupSync` (one batch, one ``syncfs``, for the many partitions a read
        or a MultiAppendRequest brought), answered from the fsync's callback. Same checks, same durability:
        Success only after a sync covering the file returned. Saves two worker wake-ups per append."""
        self.busy = True
        batch = [item]
        try:
            results, accepted, plog = self._write_group(batch)
            if not accepted or plog is None:
                self._answer_group(batch, results, accepted, None)
                self.busy = False
                return
            waiter = self.node.group_sync.ask(plog.flush, plog.flush_begin, self.partition_id)
        except Exception as e:  # noqa: BLE001 - a bug: as in run(), fail the partition, answer the request
            self.fail(f"AppendRequest: {e!r}", e)
            self.answer_failed(item)
            self.busy = False
            return
        self._committing = True
        # A partial, not a lambda: one Python frame less per group.
        waiter.add_done_callback(functools.partial(self._soon_synced, batch, results, accepted, plog))

    def _soon_synced(
        self,
        batch: list[Item],
        results: list[bytes | None],
        accepted: list[int],
        plog: PartitionLog,
        waiter: asyncio.Future[bool],
    ) -> None:
        """The fsync of a :meth:`commit_soon` group (``batch``: its one item) returned: answer it as
        :meth:`_answer_group` does, then let the worker go on."""
        try:
            self._answer_group(batch, results, accepted, self._sync_outcome(plog, waiter))
        except Exception as e:  # noqa: BLE001 - a bug: as in run(), fail the partition, answer the request
            self.fail(f"AppendRequest: {e!r}", e)
            self.answer_failed(batch[0])
        finally:
            self.busy = self.current is not None  # the worker holds an item: it goes on with it now
            self._committing = False
            committed, self._committed = self._committed, None
            if committed is not None and not committed.done():
                committed.set_result(None)

    def _write_group(self, batch: list[Item]) -> tuple[list[bytes | None], list[int], PartitionLog | None]:
        """Check each append of ``batch`` and write the accepted ones' records with one ``append_run``:
        ``(responses so far, indexes of the accepted requests, the log)``; the accepted ones are answered
        after the fsync (see :meth:`_answer_group`)."""
        self.node.metrics.requests.inc("AppendRequest", len(batch))
        results: list[bytes | None] = [None] * len(batch)
        accepted: list[int] = []  # indexes into batch of requests whose records go into the group write
        parts: list[bytes | memoryview] = []  # of the group's stored run
        ends: list[int] = []
        plog: PartitionLog | None = None
        expected = -1
        for i, item in enumerate(batch):
            msg = item.msg
            assert isinstance(msg, st.AppendRequest)
            records = msg.records
            count = len(records)
            try:
                plog = self.check(msg, msg.offline)
                if expected < 0:
                    expected = plog.max_transaction_id + 1
                if not count:
                    results[i] = st.encode_success(msg.session_id, msg.seq_num, msg.partition_id)
                    continue
                if isinstance(records, st.WireRecordList):
                    if records.first_transaction_id != expected:
                        raise self._out_of_order(expected, records.first_transaction_id)
                    append_wire_run(parts, ends, records, expected)
                else:
                    if records[0].transaction_id != expected:
                        raise self._out_of_order(expected, records[0].transaction_id)
                    verify_client_checksums(records, expected)
                    part, part_ends = encode_stored_run(records)
                    base = ends[-1] if ends else 0
                    parts.append(part)
                    ends += [base + e for e in part_ends]
            except WaltzError as e:
                results[i] = st.encode(self._failure(msg, e))
                continue
            accepted.append(i)
            expected += count
        if accepted and plog is not None:
            first = expected - len(ends)
            run = b"".join(parts)
            try:
                plog.append_run(run, ends, first)
            except WaltzError as e:
                # Every record was checked above, so this is the disk (or a bug): nothing of the group may
                # be acknowledged, and if part of it reached the file the partition stops taking writes.
                if plog.max_transaction_id != first - 1 or _is_io_error(e):
                    self._break(f"write failed: {e}")
                for i in accepted:
                    results[i] = st.encode(self._failure(batch[i].msg, e))  # type: ignore[arg-type]
                accepted = []
            else:
                # A stored record is its data and RECORD_OVERHEAD_BYTES: the group's data bytes, counted
                # once it is answered Success (see _answer_group).
                self._written_records = len(ends)
                self._written_bytes = len(run) - RECORD_OVERHEAD_BYTES * len(ends)
        return results, accepted, plog

    def _out_of_order(self, expected: int, got: int) -> TransactionOutOfOrderError:
        return TransactionOutOfOrderError(
            f"partition {self.partition_id}: transaction out of order: expected {expected}, got {got}"
        )

    def _answer_group(
        self, batch: list[Item], results: list[bytes | None], accepted: list[int], error: WaltzError | None
    ) -> None:
        """Answer every request of a written group, in order: Success for the accepted ones unless the
        fsync failed (``error``)."""
        if accepted:
            if error is None:
                encode_success = st.encode_success
                for i in accepted:
                    msg = batch[i].msg
                    assert msg is not None
                    results[i] = encode_success(msg.session_id, msg.seq_num, msg.partition_id)
                self.appended_records += self._written_records
                self.appended_bytes += self._written_bytes
            else:
                for i in accepted:
                    msg = batch[i].msg
                    assert msg is not None
                    results[i] = st.encode(self._failure(msg, error))
        node = self.node
        # One latency observation per group (its oldest request): observing every request costs more than
        # the rest of the acknowledgement path.
        node.metrics.append_latency.observe(time.monotonic() - batch[0].arrived_s)
        send = node.send_payload
        for item, payload in zip(batch, results, strict=True):
            assert payload is not None
            send(item, payload)
        if accepted and error is None and node.config.segment_preallocate_bytes:
            self._preallocate()

    def _preallocate(self) -> None:
        """Keep the newest segment zero-filled ahead of its last record (see the module docstring): write the
        next chunk of zeros now, if one is missing; the next group's fsync (of the same data file) makes it
        durable with that group's records, one chunk at a time. Called after a group's answers left, so
        the write never delays an acknowledgement.

        The zeros are not fsynced on their own in a thread: that fsync would overlap the groups that come
        meanwhile (each then handed to the worker and an fsync thread, and waiting for the zeros' writeback
        anyway); and a separate descriptor's fsync could consume the only report of a writeback error of the
        group's pages. The chunk is written 4 MiB (the default) ahead of the
        records, so the groups in between overwrite zeros synced earlier and only the one fsync that
        carries a chunk commits a new file size."""
        plog = self.log
        if self._zeros is not None or plog is None or self.health is not Health.SERVING:
            return
        if self.preallocate_off_until and time.monotonic() < self.preallocate_off_until:
            return
        node = self.node
        try:
            job = plog.prefill(node.config.segment_preallocate_bytes)
        except WaltzError as e:
            # The zeros go past the last record: whatever part of them was written is free space, and the
            # records are untouched. Appends extend the file meanwhile, as without preallocation.
            self._preallocation_failed("cannot write preallocated zeros", e)
            return
        except Exception as e:  # noqa: BLE001 - a bug: the partition fails, as in run(); heard, not raised
            # Raising would reach the caller's handler, which answers the group's requests a second time.
            self.fail(f"preallocation: {e!r}", e)
            return
        if job is None:
            return
        job.handle.close()  # its own descriptor, for a separate fsync: the group fsync is on the data file's
        self.preallocated_bytes += job.end - job.start
        self._zeros = job

    def _preallocation_failed(self, what: str, e: Exception) -> None:
        self.preallocate_failures += 1
        self.preallocate_off_until = time.monotonic() + PREALLOCATE_RETRY_S
        log.warning(
            "partition %d: %s (%s); appends extend the data file for the next %.0f s",
            self.partition_id,
            what,
            e,
            PREALLOCATE_RETRY_S,
        )

    async def _fsync(self, plog: PartitionLog) -> WaltzError | None:
        """Make the data file durable; return None, or the error that fails the whole group.

        On the event loop thread when no other partition has requests queued or an fsync waiting and the
        node's :class:`~waltz.storage.fsync.FsyncPolicy` allows it; otherwise through the node's
        :class:`~waltz.storage.fsync.GroupSync`, in a thread together with the other partitions' fsyncs
        asked for meanwhile (so the other partitions are served while the disk works, and one hand-off
        serves them all; with many files, one ``syncfs`` of the file system for all of them, see
        :class:`~waltz.storage.fsync.GroupSync`). Either way this group is answered Success only after a
        sync that covers its file returned 0, and only this file's own failure fails it.
        """
        node = self.node
        group = node.group_sync
        if node.queued.items == len(self.queue) and not group.pending and node.fsync.inline_allowed():
            return self._fsync_inline(plog)
        waiter = group.ask(plog.flush, plog.flush_begin, self.partition_id)
        with contextlib.suppress(Exception):  # any fsync failure fails the whole group: read below
            await waiter
        return self._sync_outcome(plog, waiter)

    def _sync_outcome(self, plog: PartitionLog, waiter: asyncio.Future[bool]) -> WaltzError | None:
        """The error that fails a group whose fsync the node's GroupSync ran (``waiter``, done), or None
        once its file is durable; counts the fsync either way."""
        if waiter.cancelled():
            return self._fsync_failed(StorageError("the fsync was cancelled"))
        e = waiter.exception()
        if e is not None:
            return self._fsync_failed(e if isinstance(e, Exception) else StorageError(repr(e)))
        self.threaded_fsync_count += waiter.result()
        self._fsynced(plog)
        return None

    def _fsync_inline(self, plog: PartitionLog) -> WaltzError | None:
        """:meth:`_fsync` on the loop thread (the caller checked that it may)."""
        try:
            self.node.fsync.run_inline(plog.flush)
        except Exception as e:  # noqa: BLE001 - any fsync failure fails the whole group
            return self._fsync_failed(e)
        self._fsynced(plog)
        return None

    def write_flushed_index(self) -> None:
        """Write the index entries of the records the group fsyncs made durable (see
        :mod:`waltz.storage.index_writes`); an I/O failure is the log's to report, a bug fails the
        partition."""
        plog = self.log
        if plog is None:
            return  # closed meanwhile: closing wrote them
        try:
            plog.write_flushed_index()
        except Exception as e:  # noqa: BLE001 - a bug: as in run(), the partition fails; heard, not raised
            self.fail(f"index write: {e!r}", e)

    def _fsync_failed(self, e: Exception) -> WaltzError:
        # Nothing of this group may be acknowledged: its durability is unknown. After a failed fsync Linux
        # may have dropped the dirty pages and report the next fsync as clean, so the partition stops taking
        # writes; the server starts a new session elsewhere and recovery decides what survived.
        self._break(f"fsync failed: {e}")
        return e if isinstance(e, WaltzError) else StorageError(f"fsync failed: {e}")

    def _fsynced(self, plog: PartitionLog) -> None:
        self.node.index_writes.owe(self)  # lets recovery after a kill tell damage from a torn tail
        zeros = self._zeros
        if zeros is not None:
            # Written before this fsync began (after the previous group's answers; never during a group):
            # the fdatasync of the data file (or a syncfs of the file system) made them durable with the size.
            self._zeros = None
            zeros.done()
        self.fsync_count += 1
        self.durable_max = plog.max_transaction_id
        if self.lost is not None:
            self.check_repaired()

    def _break(self, reason: str) -> None:
        if self._become(Health.FAIL_STOPPED, reason):
            log.error(
                "partition %d: %s; fail-stopped: refusing requests until it heals (disk space, clean fsync)",
                self.partition_id,
                reason,
            )
            self._next_heal_s = time.monotonic() + HEAL_INTERVAL_S

    def _failure(self, msg: st.StorageMessage, e: WaltzError) -> st.StorageMessage:
        self.node.metrics.failures.labels(type(e).__name__).inc()
        log.debug("partition %d: %s failed: %s", self.partition_id, type(msg).__name__, e)
        return st.failure_from_error(msg.session_id, msg.seq_num, msg.partition_id, e)

    def _respond(self, item: Item, resp: st.StorageMessage) -> None:
        self.node.respond(item, resp)


def _is_io_error(e: WaltzError) -> bool:
    """An I/O failure of the file layer (it raises plain StorageError), as opposed to a refused request."""
    return type(e) is StorageError

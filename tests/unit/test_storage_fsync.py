"""Where a storage node runs its group-commit fsync: on the event loop while the disk is fast (a thread
hand-off costs more CPU than the fsync), in a thread once one fsync on the loop was slow (so a stalling disk
does not stall /health, keep-alives and the other partitions with it). The fsync policy's clock is virtual
here: a "slow" fsync advances it instead of sleeping."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from waltz.errors import StorageError
from waltz.protocol import storage as st
from waltz.protocol.records import Record, ReqId
from waltz.storage import fsync as fsync_module
from waltz.storage.config import StorageConfig
from waltz.storage.controlfile import FLAG_ASSIGNED, FLAG_AVAILABLE, ControlFile
from waltz.storage.fsync import FsyncPolicy
from waltz.storage.index_writes import FLUSHED_INDEX_DELAY_S
from waltz.storage.metrics import Latency, RequestCounts
from waltz.storage.node import StorageNode
from waltz.storage.segment import PREFILL_CHUNK_BYTES, ZeroFill, data_file_name, index_file_name
from waltz.storage.work import Item
from waltz.storage.worker import StoragePartition


class _Clock:
    """Virtual monotonic seconds for the node's fsync policy."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class _Log:
    """The methods ``_fsync`` calls on a partition log, recording the thread and taking ``delay_s`` of
    ``clock``'s time."""

    def __init__(self, clock: _Clock, delay_s: float) -> None:
        self.clock = clock
        self.delay_s = delay_s
        self.threads: list[bool] = []
        self.max_transaction_id = 7

    def flush(self) -> None:
        self.threads.append(threading.current_thread() is threading.main_thread())
        self.clock.now_s += self.delay_s

    def flush_begin(self) -> Callable[[], None]:
        raise AssertionError("one partition never makes a batch of several files to syncfs")

    def write_flushed_index(self) -> None:
        # After every fsync, on the loop thread whichever ran the fsync: it touches what appends touch.
        if threading.current_thread() is not threading.main_thread():
            raise AssertionError("the index entries of flushed records were written off the loop thread")


def _node(tmp_path: Path, clock: _Clock | None = None, **settings: object) -> StorageNode:
    """A one-partition node on ``tmp_path`` (not serving), with ``settings`` (config keys) on top; its fsync
    policy reads ``clock`` (virtual) if given."""
    key = uuid.uuid4()
    config = StorageConfig.from_mapping(
        {
            "storage.directory": str(tmp_path),
            "storage.port": 1,
            "storage.admin.port": 2,
            "storage.cluster.key": str(key),
            "storage.cluster.numPartitions": 1,
            **settings,
        }
    )
    control = ControlFile.open_or_create(str(tmp_path), key, 1)
    if clock is None:
        return StorageNode(config, control)
    return StorageNode(config, control, fsync=FsyncPolicy(clock=clock))


def test_fsyncs_run_on_the_loop_until_one_is_slow_then_in_a_thread_for_a_while(tmp_path: Path) -> None:
    clock = _Clock()
    node = _node(tmp_path, clock)
    partition = node.partitions[0]

    async def main() -> None:
        fast = _Log(clock, 0.0)
        assert await partition._fsync(fast) is None  # type: ignore[arg-type]
        assert await partition._fsync(fast) is None  # type: ignore[arg-type]
        assert fast.threads == [True, True]  # on the loop's (main) thread

        slow = _Log(clock, fsync_module.INLINE_FSYNC_LIMIT_S * 2)
        assert await partition._fsync(slow) is None  # type: ignore[arg-type]
        assert slow.threads == [True]  # it could not know in advance
        assert await partition._fsync(fast) is None  # type: ignore[arg-type]
        assert fast.threads == [True, True, False]  # now in a worker thread
        assert partition.durable_max == 7
        assert (partition.fsync_count, partition.threaded_fsync_count) == (4, 1)
        assert partition.may_commit_now is False  # an append that arrives now is the worker's

        clock.now_s += fsync_module.INLINE_FSYNC_FIRST_BACKOFF_S  # the back-off has passed
        assert partition.may_commit_now is True  # the worker idles, nothing queued, fsyncs on the loop
        assert await partition._fsync(fast) is None  # type: ignore[arg-type]
        assert fast.threads[-1] is True
        assert partition.threaded_fsync_count == 1

    asyncio.run(main())


def test_fsync_threads_return_results_and_errors_on_the_loop_and_stop_on_close() -> None:
    threads = fsync_module.FsyncThreads(2)
    ran_in: list[str] = []

    def ok() -> None:
        ran_in.append(threading.current_thread().name)

    def failing() -> None:
        raise OSError(5, "injected")

    async def main() -> None:
        await asyncio.gather(threads.run(ok), threads.run(ok), threads.run(ok))
        with pytest.raises(OSError, match="injected"):  # the error reaches the awaiting worker
            await threads.run(failing)
        started = list(threads._threads)
        assert len(started) == 2
        assert all(t.is_alive() for t in started)
        await asyncio.to_thread(threads.close)
        assert not any(t.is_alive() for t in started)

    asyncio.run(main())
    assert len(ran_in) == 3
    assert all(name.startswith("storage-fsync-") for name in ran_in)


def test_the_append_latency_histogram_exports_what_a_prometheus_histogram_would() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    buckets = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)
    reference, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("waltz_storage_append_seconds", "doc", buckets=buckets, registry=reference)
    latency = Latency("waltz_storage_append_seconds", "doc", buckets)
    ours.register(latency)
    for seconds in (0.0001, 0.0005, 0.0007, 0.001, 0.3, 0.5, 2.0, 1.0, 0.02, 0.0):
        histogram.observe(seconds)
        latency.observe(seconds)
    expected = [line for line in generate_latest(reference).decode().splitlines() if "_created" not in line]
    assert generate_latest(ours).decode().splitlines() == expected


def test_the_request_counts_export_what_a_prometheus_counter_would() -> None:
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    reference, ours = CollectorRegistry(), CollectorRegistry()
    counter = Counter("waltz_storage_requests", "Requests processed", ["type"], registry=reference)
    counts = RequestCounts()
    ours.register(counts)
    for kind, n in (("AppendRequest", 31), ("RecordRunRequest", 1), ("AppendRequest", 2), ("OpenRequest", 1)):
        counter.labels(kind).inc(n)
        counts.inc(kind, n)
    expected = [line for line in generate_latest(reference).decode().splitlines() if "_created" not in line]
    assert sorted(generate_latest(ours).decode().splitlines()) == sorted(expected)


def _exported(node: StorageNode) -> list[str]:
    from prometheus_client import generate_latest

    return generate_latest(node.registry).decode().splitlines()


def test_a_fresh_node_exports_its_append_request_count_at_zero(tmp_path: Path) -> None:
    """As when it was a prometheus Counter whose AppendRequest child was made at start: an idle node shows 0
    (a rate of 0, and the first appends counted by increase()), not a series that appears later."""
    from prometheus_client import generate_latest

    node = _node(tmp_path)
    exported = generate_latest(node.registry).decode().splitlines()
    assert 'waltz_storage_requests_total{type="AppendRequest"} 0.0' in exported


def test_a_lone_slow_fsync_sends_fsyncs_to_threads_for_a_second_and_repeated_ones_for_longer(
    tmp_path: Path,
) -> None:
    clock = _Clock()
    node = _node(tmp_path, clock)
    partition = node.partitions[0]
    slow = _Log(clock, fsync_module.INLINE_FSYNC_LIMIT_S * 2)

    async def slow_inline_fsync() -> float:
        """Run a slow fsync on the loop (once the back-off has passed); how long fsyncs now stay in
        threads."""
        clock.now_s = max(clock.now_s, node.fsync.inline_off_until)
        assert node.fsync.inline_allowed()
        before = len(slow.threads)
        assert await partition._fsync(slow) is None  # type: ignore[arg-type]
        assert slow.threads[before:] == [True]
        assert not node.fsync.inline_allowed()
        return node.fsync.inline_off_until - clock.now_s

    async def main() -> None:
        assert await slow_inline_fsync() == fsync_module.INLINE_FSYNC_FIRST_BACKOFF_S
        assert await slow_inline_fsync() == 2.0  # again within a minute: twice as long
        assert await slow_inline_fsync() == 4.0
        assert await slow_inline_fsync() == 8.0
        assert await slow_inline_fsync() == fsync_module.INLINE_FSYNC_BACKOFF_S  # capped
        assert await slow_inline_fsync() == fsync_module.INLINE_FSYNC_BACKOFF_S
        clock.now_s += fsync_module.INLINE_FSYNC_RESET_S + 1  # a quiet minute later
        assert await slow_inline_fsync() == fsync_module.INLINE_FSYNC_FIRST_BACKOFF_S
        assert slow.threads == [True] * 7  # every one of them ran on the loop (each after its back-off)

    asyncio.run(main())


# -------------------------------------------------------------------------------------- preallocated zeros


class _Handle:
    """A zero fill's duplicate descriptor: its fsync fails as a dying disk's would."""

    path = "/data/0/0000000000000000000.seg"

    def __init__(self) -> None:
        self.closed = False

    def fsync(self, *, data_only: bool = False) -> None:
        raise StorageError(f"{self.path}: cannot fsync: Input/output error")

    def close(self) -> None:
        self.closed = True


def _assigned(tmp_path: Path) -> tuple[StorageNode, StoragePartition]:
    """A node with partition 0 assigned; its fsync policy's clock stands still, so no real fsync counts as
    slow (on a loaded host one could, and send the next ones to threads)."""
    node = _node(tmp_path, _Clock())
    partition = node.partitions[0]
    partition.open_log()
    return node, partition


def test_zeros_are_written_ahead_and_made_durable_by_the_next_group_fsync_one_chunk_at_a_time(
    tmp_path: Path,
) -> None:
    """No fsync of their own: the next group's fsync of the data file carries them (see _preallocate), so no
    fsync in a thread overlaps the groups and group fsyncs stay on the loop."""
    node, partition = _assigned(tmp_path)
    plog = partition.log
    assert plog is not None
    ahead = node.config.segment_preallocate_bytes
    data_file = tmp_path / "0" / "0000000000000000000.seg"
    chunk = min(PREFILL_CHUNK_BYTES, ahead // 2)

    async def main() -> None:
        partition._preallocate()
        assert partition.preallocating
        assert node.fsync.in_flight == 0
        assert partition.may_commit_now  # the next group's fsync runs on the loop
        partition._preallocate()  # one chunk at a time
        assert partition.preallocated_bytes == chunk
        assert plog.prefilled_bytes == 0  # written, not yet fsynced
        assert partition._fsync_inline(plog) is None  # a group's fsync
        assert not partition.preallocating
        assert plog.prefilled_bytes == chunk
        while partition.preallocated_bytes < ahead:
            partition._preallocate()
            assert partition.preallocating
            assert await partition._fsync(plog) is None
        partition._preallocate()
        assert not partition.preallocating  # nothing missing
        assert plog.prefilled_bytes == ahead

    asyncio.run(main())
    assert node.fsync.threads._threads == []  # no thread was ever needed
    assert data_file.stat().st_size == 128 + ahead
    assert partition.broken is None
    partition.close_log()
    assert data_file.stat().st_size == 128  # a closed segment ends with its last record


def test_zeros_are_never_fsynced_through_a_descriptor_of_their_own(tmp_path: Path) -> None:
    """A second descriptor's fsync shares the data file's writeback-error cursor: failing, it may consume the
    only report of pages of the groups' records the disk lost, and a group's own fsync then returns
    success. The zero fill's descriptor is closed unused; the group fsync that carries the zeros is the one
    that hears of an error, and no thread runs an fsync meanwhile."""
    node, partition = _assigned(tmp_path)
    plog = partition.log
    assert plog is not None
    handle = _Handle()
    segment = plog._writable()
    plog.prefill = lambda ahead: ZeroFill(segment, 128, 4096, 0, handle)  # type: ignore[assignment,method-assign,arg-type]

    async def main() -> None:
        partition._preallocate()
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(main())
    assert handle.closed
    assert partition.broken is None
    assert node.fsync.threads._threads == []
    assert (node.fsync.in_flight, partition.may_commit_now) == (0, True)
    partition.close_log()


def test_a_failed_group_fsync_that_carried_zeros_breaks_the_partition_and_the_zeros_never_count(
    tmp_path: Path,
) -> None:
    node, partition = _assigned(tmp_path)
    plog = partition.log
    assert plog is not None

    def failing() -> None:
        raise StorageError("/data/0/x.seg: cannot fsync: Input/output error")

    partition._preallocate()
    plog.flush = failing  # type: ignore[method-assign]
    error = partition._fsync_inline(plog)
    assert error is not None
    assert "Input/output error" in str(error)
    assert partition.broken is not None
    assert plog.prefilled_bytes == 0
    assert not node.health()[0]
    partition.close_log()
    assert not partition.preallocating  # a heal reopens the log: the zeros were cut or are free space


def test_a_failed_write_of_zeros_is_reported_and_pauses_preallocation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk, say: the records are untouched (the zeros go past them), so the partition serves on,
    and says so once per pause."""
    node, partition = _assigned(tmp_path)
    plog = partition.log
    assert plog is not None
    calls: list[int] = []

    def full(ahead: int) -> None:
        calls.append(ahead)
        raise StorageError("/data/0/x.seg: cannot write: No space left on device")

    plog.prefill = full  # type: ignore[assignment,method-assign]
    with caplog.at_level(logging.WARNING):
        partition._preallocate()
        partition._preallocate()  # paused: not tried again
    assert len(calls) == 1
    assert partition.preallocate_failures == 1
    assert partition.broken is None
    assert node.health()[0]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "cannot write preallocated zeros" in line
    assert "No space left on device" in line
    partition.preallocate_off_until = time.monotonic() - 1  # the pause is over
    partition._preallocate()
    assert len(calls) == 2
    partition.close_log()


def test_zeros_pending_across_a_roll_over_or_a_truncation_never_count_and_do_not_stay_pending(
    tmp_path: Path,
) -> None:
    """The group fsync that follows a roll-over fsyncs the new segment, and one that follows a truncation
    fsyncs a file whose zeros were cut: neither may count the pending chunk as durable zeros of the segment
    now written (its appends would skip the size's journal commit), and neither may leave the chunk pending
    (no more preallocation)."""
    asyncio.run(_zeros_across_roll_over_and_truncation(tmp_path))


async def _zeros_across_roll_over_and_truncation(tmp_path: Path) -> None:
    # On a loop, as a node runs: a group fsync schedules its index write there.
    node = _node(
        tmp_path,
        _Clock(),
        **{"storage.segment.preallocateBytes": 64 * 1024, "storage.segment.size.threshold": 8192},
    )
    partition = node.partitions[0]
    plog = partition.open_log()
    next_id = 0

    def group(n: int) -> None:
        """A group commit of ``n`` records of 1000 bytes: written, fsynced, then zeros (_answer_group)."""
        nonlocal next_id
        plog.append([Record.build(i, ReqId(1 << 32, i), 0, bytes(1000)) for i in range(next_id, next_id + n)])
        next_id += n
        assert partition._fsync_inline(plog) is None
        partition._preallocate()

    group(1)
    assert partition.preallocating
    first_segment = plog.segment_first_ids[-1]
    pending = partition._zeros
    assert pending is not None
    assert pending.segment is plog._writable()
    group(8)  # crosses the threshold: the group's last records go to a new segment, its fsync to that one
    assert plog.segment_first_ids[-1] != first_segment
    assert plog._writable() is not pending.segment
    assert partition._zeros is not pending  # taken by the group fsync, and a chunk of the new segment written
    assert partition.preallocating
    assert plog.prefilled_bytes == 0  # written, not fsynced yet: nothing of the old chunk counts here
    assert pending.segment.closed
    assert (tmp_path / "0" / data_file_name(first_segment)).stat().st_size == pending.segment.size_bytes

    cut = partition._zeros
    assert cut is not None
    assert plog.truncate(next_id - 2) == next_id - 2  # cuts a record and the zeros after it
    next_id -= 1
    assert plog.prefilled_bytes == 0
    group(1)
    assert plog.prefilled_bytes == 0  # the chunk cut by the truncation counts for nothing
    assert partition._zeros is not None
    assert partition._zeros is not cut
    assert partition._fsync_inline(plog) is None
    assert plog.prefilled_bytes > 0
    assert partition.broken is None
    assert partition.failed is None
    partition.close_log()


def test_a_group_fsyncs_index_entries_reach_the_index_file_soon_after_not_at_once(tmp_path: Path) -> None:
    """The entries of the records a group fsync made durable are written (for recovery after a kill, see
    waltz.storage.index_writes) within FLUSHED_INDEX_DELAY_S, not on the acknowledgement's path."""

    async def main() -> None:
        node = _node(tmp_path)
        partition = node.partitions[0]
        plog = partition.open_log()
        index = tmp_path / "0" / index_file_name(0)
        empty = index.stat().st_size
        plog.append([Record.build(i, ReqId(1 << 32, i), 0, b"x") for i in range(3)])
        assert partition._fsync_inline(plog) is None
        assert index.stat().st_size == empty
        assert "waltz_storage_index_writes_total 0.0" in _exported(node)
        await asyncio.sleep(FLUSHED_INDEX_DELAY_S + 0.05)
        assert index.stat().st_size == empty + 3 * 8  # one i64 offset per record
        assert "waltz_storage_index_writes_total 1.0" in _exported(node)  # one write for the group's three
        partition.close_log()

    asyncio.run(main())


def test_appended_records_and_bytes_count_a_groups_accepted_requests_once_answered_success(
    tmp_path: Path,
) -> None:
    """``appended_records`` and ``appended_bytes`` (waltz_storage_appended_*) count the data of the requests
    a group accepted, as decoded from the wire or as Records, and nothing of a group whose fsync failed."""
    node, partition = _assigned(tmp_path)
    node.control.update(0, session_id=1, flags=FLAG_ASSIGNED | FLAG_AVAILABLE)
    partition.session_id = 1

    def records(first: int, n: int, size: int) -> list[Record]:
        return [Record.build(i, ReqId(1, i), 0, bytes([i % 251]) * size) for i in range(first, first + n)]

    def wire(recs: list[Record]) -> Item:
        msg = st.decode(st.encode(st.AppendRequest(1, 0, 0, recs, False)))  # as the data port decodes it
        assert isinstance(msg, st.AppendRequest)
        assert isinstance(msg.records, st.WireRecordList)
        return Item(msg, None)

    ok = [
        wire(records(0, 2, 100)),
        wire(records(7, 1, 9)),
        Item(st.AppendRequest(1, 0, 0, records(2, 3, 50), False), None),
    ]
    results, accepted, _plog = partition._write_group(ok)
    assert accepted == [0, 2]  # the second is out of order: refused alone
    partition._answer_group(ok, results, accepted, None)
    assert (partition.appended_records, partition.appended_bytes) == (5, 2 * 100 + 3 * 50)

    failed = [wire(records(5, 4, 10))]
    results, accepted, _plog = partition._write_group(failed)
    assert accepted == [0]
    partition._answer_group(failed, results, accepted, StorageError("fsync failed (injected)"))
    assert (partition.appended_records, partition.appended_bytes) == (5, 350)
    partition.close_log()

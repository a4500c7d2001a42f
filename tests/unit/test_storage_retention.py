"""Retention on one partition log: detaching the segments below a trim point and deleting their files,
durably, with crashes at every step (CrashFS)."""

from __future__ import annotations

import pytest

from waltz.errors import TrimmedError
from waltz.storage.partition import PartitionLog
from waltz.storage.retention import DetachedSegments, check_readable, delete_detached, trim_refusal
from waltz.testing.crashfs import CrashFS, SimulatedCrash

from .test_storage_partition import KEY, PDIR, PID, ROOT, batch, fill, open_log


def test_detach_takes_only_whole_segments_below_the_trim_point_and_never_the_writable_one() -> None:
    fs = CrashFS()
    log = open_log(fs, threshold=600)
    fill(log, 200)
    firsts = log.segment_first_ids
    assert len(firsts) > 4
    cut = firsts[3] + 1  # inside the fourth segment: it stays
    detached = log.detach_below(cut)
    assert detached is not None
    assert detached.first_ids == tuple(firsts[:3])
    assert detached.end_transaction_id == firsts[3]
    assert log.segment_first_ids == firsts[3:]
    assert log.detach_below(cut) is None  # nothing more below it
    assert delete_detached(fs, detached) > 0
    assert not any(fs.exists(p) for p in detached.paths())
    assert log.read_records(firsts[3], 10) == batch(firsts[3], 10)
    # Everything below the last segment goes; the last (writable) one never does.
    everything = log.detach_below(10_000)
    assert everything is not None
    assert log.segment_first_ids == firsts[-1:]
    delete_detached(fs, everything)
    fill(log, 5)
    assert log.max_transaction_id == 204
    log.close()


@pytest.mark.parametrize("ops", range(8))
def test_a_crash_while_deleting_leaves_whole_segments_that_a_later_deletion_removes(ops: int) -> None:
    fs = CrashFS(ops)
    log = open_log(fs, threshold=600)
    fill(log, 200)
    firsts = log.segment_first_ids
    detached = log.detach_below(firsts[3])
    assert detached is not None
    fs.arm(ops)
    try:
        delete_detached(fs, detached)
    except SimulatedCrash:
        pass
    fs.arm(None)
    fs.crash()
    log2 = open_log(fs, threshold=600)
    left = log2.segment_first_ids
    # A prefix of the detached segments may be back (whole), never a hole; the log reads as before.
    assert left[-len(firsts) + 3 :] == firsts[3:]
    assert set(left) <= set(firsts)
    assert log2.read_records(firsts[3], 10) == batch(firsts[3], 10)
    again = log2.detach_below(firsts[3])
    if again is not None:
        delete_detached(fs, again)
    assert log2.segment_first_ids == firsts[3:]
    assert sorted(n for n in fs.listdir(PDIR)) == sorted(
        n for f in firsts[3:] for n in (f"{f:019d}.seg", f"{f:019d}.idx")
    )
    log2.close()


def test_refusals_and_reads() -> None:
    assert trim_refusal(0, 10) is None
    assert "negative" in (trim_refusal(0, -1) or "")
    check_readable(3, 10, 10)
    check_readable(3, -1, 10)  # "from the start" is not a read of a trimmed id
    with pytest.raises(TrimmedError, match="partition 3: transaction 9 is below the trim point 10"):
        check_readable(3, 9, 10)


@pytest.mark.parametrize("ops", range(8))
def test_restart_at_survives_a_crash_at_any_step(ops: int) -> None:
    fs = CrashFS(ops)
    log = open_log(fs, threshold=600)
    fill(log, 100)
    fs.arm(ops)
    try:
        detached = log.restart_at(500)
        delete_detached(fs, detached)
        restarted = True
    except SimulatedCrash:
        restarted = False
    fs.arm(None)
    fs.crash()
    # Reopened with the trim point persisted (the node persists it before restarting the log): either the
    # old log (the restart never became durable) or the empty log at 500, never a mix that fails to open.
    log2 = PartitionLog.open(ROOT, KEY, PID, fs=fs, segment_size_threshold_bytes=600, trim_point=500)
    assert log2.max_transaction_id in (99, 499)
    if restarted:
        assert log2.max_transaction_id == 499
    if log2.max_transaction_id == 499:
        assert log2.segment_first_ids == [500]
        log2.append(batch(500, 3))
        assert log2.read_records(500, 10) == batch(500, 3)
    log2.close()


def test_segment_sizes_are_the_newest_segments_files_oldest_first() -> None:
    fs = CrashFS()
    log = open_log(fs, threshold=600)
    fill(log, 200)
    firsts = log.segment_first_ids

    def files_bytes(first: int) -> int:
        total = 0
        for path in DetachedSegments(log.directory, (first,), 0).paths():
            f = fs.open(path, read_only=True)
            total += f.size()
            f.close()
        return total

    sizes = log.segment_sizes(3)
    assert sizes == [(first, files_bytes(first)) for first in firsts[-3:]]
    assert all(size > 0 for _, size in sizes)
    assert [f for f, _ in log.segment_sizes(10_000)] == firsts
    assert log.segment_sizes(0) == []
    # The writable segment is measured each time; a detached one is no longer listed.
    fill(log, 1)
    assert log.segment_sizes(1)[0][1] >= sizes[-1][1]
    detached = log.detach_below(firsts[2])
    assert detached is not None
    assert [f for f, _ in log.segment_sizes(10_000)] == firsts[2:]
    log.close()


def test_a_paced_deletion_frees_in_steps_at_the_rate_asked() -> None:
    fs = CrashFS()
    log = open_log(fs, threshold=600)
    fill(log, 200)
    firsts = log.segment_first_ids
    detached = log.detach_below(firsts[3])
    assert detached is not None
    sizes = []
    for path in detached.paths():
        f = fs.open(path, read_only=True)
        sizes.append(f.size())
        f.close()
    slept: list[float] = []
    freed = delete_detached(fs, detached, max_bytes_per_second=1000, step_bytes=100, sleep=slept.append)
    assert freed == sum(sizes)
    assert not any(fs.exists(p) for p in detached.paths())
    # One pause of step / rate for each step but a file's last (which the unlink frees).
    assert slept == [0.1] * sum((size - 1) // 100 for size in sizes)
    log.close()


@pytest.mark.parametrize("ops", range(0, 40, 3))
def test_a_crash_during_a_paced_deletion_leaves_nothing_the_next_open_does_not_delete(ops: int) -> None:
    fs = CrashFS(ops)
    log = open_log(fs, threshold=600)
    fill(log, 200)
    firsts = log.segment_first_ids
    detached = log.detach_below(firsts[3])
    assert detached is not None
    fs.arm(ops)
    try:
        delete_detached(fs, detached, max_bytes_per_second=10**6, step_bytes=50, sleep=lambda _s: None)
    except SimulatedCrash:
        pass
    fs.arm(None)
    fs.crash()
    # The node reopens the log with its trim point (from the control file): what is below it goes.
    log2 = PartitionLog.open(
        ROOT,
        KEY,
        PID,
        fs=fs,
        segment_size_threshold_bytes=600,
        segment_cache_capacity=5,
        trim_point=firsts[3],
    )
    assert log2.segment_first_ids == firsts[3:]
    assert sorted(fs.listdir(PDIR)) == sorted(
        n for f in firsts[3:] for n in (f"{f:019d}.seg", f"{f:019d}.idx")
    )
    assert log2.read_records(firsts[3], 10) == batch(firsts[3], 10)
    log2.close()

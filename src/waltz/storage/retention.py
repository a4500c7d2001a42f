"""Retention on a storage node: the trim point of a partition and the deletion of segments below it.

The **trim point** of a partition is the lowest transaction id a replica must still hold; every id below it
was deleted on purpose (``docs/operations.md``, "Retention"). The owning server sends it to each replica
(storage message ``TrimRequest``, :mod:`waltz.protocol.storage`); the node:

1. checks it (:func:`trim_refusal`: not negative); a trim point at or below the current one changes
   nothing. A replica that lags below the trim point (its durable log ends before ``trim point - 1``) starts
   its log again, empty, at the trim point (:meth:`PartitionLog.restart_at`): what it lacks was trimmed on
   every replica, so catch-up continues from there. That only
   committed transactions are trimmed is the sender's rule (the owning server sends at most its high-water
   mark + 1, and committed records are never truncated); the request is session-checked like a write, so
   only the partition's current owner (or an offline tool on an offline replica) can send it;
2. persists it in the control file (fsynced) before answering, so reads below it fail from then on, across
   restarts (:func:`check_readable`);
3. detaches, on the partition's worker, the segments wholly below it (:meth:`PartitionLog.detach_below`: a
   bounded, in-memory change; the writable segment is never detached) and deletes their files in a thread
   (:func:`delete_detached`), data file then index, then one fsync of the directory, so appends are never
   blocked by the unlinking of a large file; paced (``storage.trim.deleteBytesPerSecond``), so the file
   system's work of freeing a gigabyte does not stall the appends' fsyncs either. A crash before the
   deletion finishes leaves segments below the trim point (whole, or a data file shortened by a paced
   deletion); the node detaches and deletes them again when it next opens the log.

A segment that straddles the trim point stays whole until the log moves past it: reads of its ids below the
trim point fail all the same, so what a reader sees never depends on segment sizes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from waltz.errors import TrimmedError
from waltz.storage.fileio import FileSystem
from waltz.storage.segment import data_file_name, index_file_name

log = logging.getLogger(__name__)

__all__ = ["DetachedSegments", "check_readable", "delete_detached", "trim_refusal"]


@dataclass(frozen=True)
class DetachedSegments:
    """Segments no longer part of a log, whose files are still to be deleted."""

    directory: str
    first_ids: tuple[int, ...]
    """First transaction ids of the segments, oldest first."""
    end_transaction_id: int
    """The first id after the last detached segment (the first id the log still holds)."""

    def paths(self) -> list[str]:
        """The files, data before index for each segment, oldest segment first."""
        out: list[str] = []
        for first in self.first_ids:
            out += [os.path.join(self.directory, data_file_name(first))]
            out += [os.path.join(self.directory, index_file_name(first))]
        return out


def trim_refusal(partition_id: int, trim_point: int) -> str | None:
    """Why a replica refuses to raise its trim point to ``trim_point``, or None. The replica's log is not a
    bound: a replica below the trim point restarts there (see the module docstring)."""
    if trim_point < 0:
        return f"partition {partition_id}: trim point {trim_point} is negative"
    return None


def check_readable(partition_id: int, transaction_id: int, trim_point: int) -> None:
    """Raise :class:`TrimmedError` if a read from ``transaction_id`` starts below the trim point."""
    if 0 <= transaction_id < trim_point:
        raise TrimmedError.below(partition_id, transaction_id, trim_point)


DELETE_STEP_BYTES = 8 * 1024 * 1024
"""A paced deletion frees at most this much at a time (a truncation), then waits its share of the rate."""


def delete_detached(
    fs: FileSystem,
    detached: DetachedSegments,
    *,
    max_bytes_per_second: int = 0,
    step_bytes: int = DELETE_STEP_BYTES,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Delete the files of detached segments, durably (one directory fsync at the end); returns the bytes
    freed. Blocking: run it in a thread. A file already gone (a deletion repeated after a crash) is
    skipped. With ``max_bytes_per_second``, a large file is first truncated from its end in steps of
    :data:`DELETE_STEP_BYTES`, sleeping between steps so that no more than that is freed per second: each
    step is a small change for the file system's journal (and the device's discard), where one unlink of
    a whole segment is a large one that stalls every fsync behind it. A crash midway leaves a shortened
    data file of a segment below the trim point, which no one reads and the next open deletes."""
    freed = 0
    for path in detached.paths():
        if not fs.exists(path):
            continue
        f = fs.open(path, read_only=max_bytes_per_second <= 0)
        try:
            size = f.size()
            freed += size
            while max_bytes_per_second > 0 and size > step_bytes:
                size -= step_bytes
                f.truncate(size)
                sleep(step_bytes / max_bytes_per_second)
        finally:
            f.close()
        fs.remove(path)
    fs.fsync_dir(detached.directory)
    return freed

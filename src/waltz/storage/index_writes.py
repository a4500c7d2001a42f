"""The index entries of flushed records, written a little after their group fsyncs, many groups at once.

After a process kill, index recovery tells a damaged durable record (kept, reported, repaired) from a torn
tail (cut) by its index entry on disk (see :mod:`waltz.storage.resync`). A segment writes an entry only after
an fsync of its data file covered the record (:meth:`~waltz.storage.segment.Segment.write_flushed_index`,
no fsync of its own). Written after every group fsync, that was a ``pwrite`` system call on the path of
every acknowledgement: with one append in flight, the storage node's largest cost after the fsync itself.

So a partition whose group fsync made records durable *owes* their entries (:meth:`FlushedIndexWrites.owe`),
and the node writes what its partitions owe at most :data:`FLUSHED_INDEX_DELAY_S` later, one ``pwrite`` per
partition for all the groups of that interval, after their answers left. The cost: a kill loses the entries
of at most the last :data:`FLUSHED_INDEX_DELAY_S` of fsyncs. Those records are then the log's tail, kept if
they verify (a kill does not change bytes an fsync made durable) and cut only if one of them also went bad
within those milliseconds. A clean close, a roll-over, a checkpoint and a truncation write every entry.
"""

from __future__ import annotations

import asyncio
from typing import Final, Protocol

FLUSHED_INDEX_DELAY_S: Final = 0.02
"""How long after a group fsync its records' index entries may wait for their write."""


class OwesIndex(Protocol):
    """A partition whose group fsyncs made records durable (a ``StoragePartition``)."""

    partition_id: int

    def write_flushed_index(self) -> None:
        """Write the index entries its fsyncs made due; never raises (a failure is the partition's)."""
        ...


class FlushedIndexWrites:
    """The index writes the node's partitions owe, made together on the loop (see the module docstring).
    Owned by the node; :meth:`close` drops what is owed (closing the logs writes every entry)."""

    def __init__(self, delay_s: float = FLUSHED_INDEX_DELAY_S) -> None:
        self._delay_s = delay_s
        self._owed: dict[int, OwesIndex] = {}
        self._timer: asyncio.TimerHandle | None = None
        self.writes = 0
        """Index writes made (one per owing partition per interval)."""

    def owe(self, part: OwesIndex) -> None:
        """``part``'s last group fsync made records durable: write their entries soon, on the loop."""
        self._owed[part.partition_id] = part
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._delay_s, self._write_owed)

    @property
    def owed(self) -> int:
        """Partitions whose entries wait for their write."""
        return len(self._owed)

    def _write_owed(self) -> None:
        """The timer's callback: every owed partition's entries, one write each."""
        self._timer = None
        owed, self._owed = self._owed, {}
        for part in owed.values():
            part.write_flushed_index()
        self.writes += len(owed)

    def close(self) -> None:
        """Stop: nothing more is written from here (the logs write their entries as they close)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._owed.clear()

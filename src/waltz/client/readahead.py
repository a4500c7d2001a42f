"""Readahead of transaction data: an application that reads each transaction's data in feed order (a catch-up
replaying a partition, the tutorial's ``apply_transaction``) gets it from range reads, not one data request
per transaction.

A miss at ``transaction_id`` that starts where the partition's previous read ended is sequential: the window
(how many records the next read asks for) doubles, up to :data:`READAHEAD_MAX`; any other miss starts again at
one record (the single data request), so an application that reads the data of a few transactions only pays
for those. The records a range read returns beyond the one asked for are kept, per partition, until taken
(each once) or replaced by the partition's next read: at most one window per partition is held, and only
while the partition is mounted (the client forgets a partition it releases or stops, and all at close).

Thread safety: :meth:`Readahead.take` runs on any thread (``Transaction.get_transaction_data`` on a callback
thread takes its data without a hop to the event loop); everything else runs on the loop. A partition's kept
records are one dict, replaced whole by :meth:`Readahead.keep` and read with ``dict.pop``, both atomic under
the GIL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from waltz.protocol.records import Record

READAHEAD_MAX: Final = 1024
"""The most records one readahead read asks for (the server may return fewer: it bounds its responses)."""


class Readahead:
    """Per partition: the window of the next read, where the last read ended, and the records kept from it."""

    __slots__ = ("_ends", "_kept", "_windows")

    def __init__(self) -> None:
        self._kept: dict[int, dict[int, bytes]] = {}
        self._windows: dict[int, int] = {}
        self._ends: dict[int, int] = {}

    def take(self, partition_id: int, transaction_id: int) -> bytes | None:
        """The data of ``transaction_id`` if a read kept it (removed: each is taken once), else None."""
        kept = self._kept.get(partition_id)
        return kept.pop(transaction_id, None) if kept else None

    def window(self, partition_id: int, transaction_id: int) -> int:
        """How many records to read from ``transaction_id`` (a miss): doubling while reads are sequential."""
        if self._ends.get(partition_id) == transaction_id:
            window = min(self._windows.get(partition_id, 1) * 2, READAHEAD_MAX)
        else:
            window = 1
        self._windows[partition_id] = window
        self._ends[partition_id] = transaction_id + 1  # Until keep() says how far the read went.
        return window

    def keep(self, partition_id: int, records: Sequence[Record]) -> None:
        """The records of a read (the first one, asked for, is not kept: its caller has it)."""
        if records:
            self._ends[partition_id] = records[-1].transaction_id + 1
        self._kept[partition_id] = {r.transaction_id: r.data for r in records[1:]}

    def holds(self, partition_id: int) -> bool:
        """True while anything of ``partition_id`` is kept: its window, where its last read ended, records."""
        return partition_id in self._windows or partition_id in self._ends or partition_id in self._kept

    def forget(self, partition_id: int) -> None:
        """Drop everything of ``partition_id`` (released or stopped: a later mount starts with one record)."""
        self._kept.pop(partition_id, None)
        self._windows.pop(partition_id, None)
        self._ends.pop(partition_id, None)

    def clear(self) -> None:
        """Drop everything (the client closed)."""
        self._kept.clear()
        self._windows.clear()
        self._ends.clear()

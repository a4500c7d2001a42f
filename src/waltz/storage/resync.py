"""Damage inside a segment's log, told from a torn tail, for index recovery (:meth:`Segment._recover`).

Index recovery re-verifies the records after the last checkpoint and stops at the first one that does not
verify. Only records written after the last fsync can be torn by a crash, and they are the end of the log;
a record that was durable and does not verify is *damage* (bit rot, a lost or misdirected write), and cutting
the log there would destroy every acknowledged record after it. A record is known durable when:

* its id is at or below the partition's local low-water mark (persisted after an fsync of the log), or
* the index file holds its entry: a segment writes index entries to its index file only after an fsync of
  its data file covered their records (:meth:`Segment.sync`, :meth:`Segment.truncate`, recovery), so an
  entry on disk, fsynced or not, intact or garbled by a crash, proves its record was durable. A truncation
  cuts the data file durably before the index, so the only stale entries a crash can leave point past the
  end of the data file, where no record is: recovery then finds no bytes to keep.

A durable record that does not verify is kept, as a damaged record, with the records after it: its extent
is found from the next record that verifies (:func:`find_next_good`: the index entries after it, its own
length field, or a search for the next id), the records in between from the index or their length fields
(:func:`damaged_extents`). Reading a damaged record raises
:class:`~waltz.storage.segment.RecordCorruptionError`; the node reports it and accepts a repair from
another replica (see ``docs/replication.md``).

Everything here only reads; every search is bounded (``RESYNC_MAX_RECORDS`` index entries,
``RESYNC_MAX_BYTES`` of data).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from waltz.errors import CorruptionError
from waltz.storage.fileio import File

RESYNC_MAX_RECORDS = 4096
"""Index entries tried, after a damaged record, for the next record that verifies."""
RESYNC_MAX_BYTES = 64 * 1024 * 1024
"""Bytes searched, after a damaged record, for the next record's id when the index cannot say where it is."""
RESYNC_CHUNK_BYTES = 1024 * 1024

_RECORD_HEADER_BYTES = 36
_RECORD_OVERHEAD_BYTES = 40
_INDEX_ENTRY_BYTES = 8
_LENGTH = struct.Struct(">i")
_I64 = struct.Struct(">q")

Verify = Callable[[bytes, int, str, int], object]
"""``verify(raw, transaction_id, path, offset)``: raises CorruptionError unless ``raw`` is that whole
record."""
IndexEntries = Callable[[int, int], bytes | bytearray]
"""``entries(i, n)``: the raw index entries ``i .. i+n-1`` of the segment (fewer at the index's end)."""


def record_end(
    data_file: File, offset: int, transaction_id: int, data_end: int, path: str, verify: Verify
) -> int | None:
    """The end of ``transaction_id``'s record at ``offset`` if a whole record that verifies is there."""
    if offset < 0 or offset + _RECORD_OVERHEAD_BYTES > data_end:
        return None
    head = data_file.pread(_RECORD_HEADER_BYTES, offset)
    if len(head) < _RECORD_HEADER_BYTES:
        return None
    n: int = _LENGTH.unpack_from(head, 28)[0]
    if n < 0 or offset + _RECORD_OVERHEAD_BYTES + n > data_end:
        return None
    raw = data_file.pread(_RECORD_OVERHEAD_BYTES + n, offset)
    try:
        verify(raw, transaction_id, path, offset)
    except CorruptionError:
        return None
    end: int = offset + _RECORD_OVERHEAD_BYTES + n
    return end


def find_next_good(
    data_file: File,
    entries: IndexEntries,
    first: int,
    index_count: int,
    transaction_id: int,
    offset: int,
    data_end: int,
    path: str,
    verify: Verify,
) -> tuple[int, int] | None:
    """``(id, offset)`` of the first record after the damaged ``transaction_id`` (at ``offset``) that
    verifies where it is found, or None. Tried in turn: the damaged record's own length field (right when
    only its data or checksum is damaged), the index entries after it, a search for the next id's 8 bytes in
    the data file. A record found there carries the id expected at that place, so it is the real one."""
    head = data_file.pread(_RECORD_HEADER_BYTES, offset)
    if len(head) == _RECORD_HEADER_BYTES:
        n: int = _LENGTH.unpack_from(head, 28)[0]
        at = offset + _RECORD_OVERHEAD_BYTES + n
        if n >= 0 and record_end(data_file, at, transaction_id + 1, data_end, path, verify) is not None:
            return transaction_id + 1, at
    lo = transaction_id + 1 - first
    raw = entries(lo, min(RESYNC_MAX_RECORDS, max(0, index_count - lo)))
    for i in range(len(raw) // _INDEX_ENTRY_BYTES):
        at = _I64.unpack_from(raw, i * _INDEX_ENTRY_BYTES)[0]
        txn = first + lo + i
        if at > offset and record_end(data_file, at, txn, data_end, path, verify) is not None:
            return txn, at
    return _search_id(data_file, transaction_id + 1, offset + 1, data_end, path, verify)


def _search_id(
    data_file: File, transaction_id: int, start: int, data_end: int, path: str, verify: Verify
) -> tuple[int, int] | None:
    needle = _I64.pack(transaction_id)
    stop = min(data_end, start + RESYNC_MAX_BYTES)
    pos = start
    while pos < stop:
        chunk = data_file.pread(min(RESYNC_CHUNK_BYTES, stop - pos) + len(needle) - 1, pos)
        at = chunk.find(needle)
        while at >= 0:
            if record_end(data_file, pos + at, transaction_id, data_end, path, verify) is not None:
                return transaction_id, pos + at
            at = chunk.find(needle, at + 1)
        pos += RESYNC_CHUNK_BYTES
    return None


def damaged_extents(
    data_file: File,
    entries: IndexEntries,
    first: int,
    ids: range,
    offset: int,
    limit: int,
) -> list[int]:
    """Offsets for the damaged records ``ids``, the first at ``offset``, all inside ``[offset, limit)``:
    from the index where its entries are there and consistent,
    else from each record's length field, else (nothing says where a record begins) empty extents that read
    as damaged. The records stay in the log either way; only a repair needs the true extents."""
    raw = entries(ids.start - first, len(ids))
    if len(raw) == _INDEX_ENTRY_BYTES * len(ids):
        found = list(struct.unpack(f">{len(ids)}q", raw))
        if found[0] == offset and all(
            b - a >= _RECORD_OVERHEAD_BYTES for a, b in zip(found, [*found[1:], limit], strict=True)
        ):
            return found
    offsets: list[int] = []
    at = offset
    for _ in ids:
        offsets.append(at)
        head = data_file.pread(_RECORD_HEADER_BYTES, at)
        n = _LENGTH.unpack_from(head, 28)[0] if len(head) == _RECORD_HEADER_BYTES else -1
        if n >= 0 and at + _RECORD_OVERHEAD_BYTES + n <= limit:
            at += _RECORD_OVERHEAD_BYTES + n
    return offsets


def last_end(data_file: File, offset: int, limit: int) -> int:
    """Where a damaged record with nothing that verifies after it ends: as its length field says if that fits
    before ``limit``, else at ``limit``."""
    head = data_file.pread(_RECORD_HEADER_BYTES, offset)
    n = _LENGTH.unpack_from(head, 28)[0] if len(head) == _RECORD_HEADER_BYTES else -1
    if n >= 0 and offset + _RECORD_OVERHEAD_BYTES + n <= limit:
        return offset + _RECORD_OVERHEAD_BYTES + n
    return limit

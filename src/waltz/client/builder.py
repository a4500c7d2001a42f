"""``TransactionBuilder``: what ``TransactionContext.execute`` fills in."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar, overload

from waltz.client.locks import PartitionLocalLock, java_string_hash, lock_hash
from waltz.client.serializer import Serializer
from waltz.protocol.checksum import crc32 as _crc32
from waltz.protocol.client_server import AppendRequest, frame_append, new_append_request
from waltz.protocol.records import ReqId
from waltz.protocol.wire import I32_MAX, I32_MIN

T = TypeVar("T")


class TransactionBuilder:
    """Collects one transaction's header, data and locks.

    A fresh builder is made for every execution of a context; ``client_high_water_mark`` is the
    application's high-water mark of the partition when the execution started. The locks are checked against
    it by the server:

    * **write locks** fail the append if a transaction after ``client_high_water_mark`` took the lock
      (write or append); on success the lock is taken by this transaction;
    * **read locks** fail the append in the same case, but are not taken;
    * **append locks** are never checked, but are taken on success (they invalidate other writers' and
      readers' locks without ever failing themselves).

    Without :meth:`set_transaction_data` the data is empty; without :meth:`set_header` the header is 0.
    """

    def __init__(self, partition_id: int, client_high_water_mark: int) -> None:
        self.partition_id = partition_id
        self.client_high_water_mark = client_high_water_mark
        self._header = 0
        self._data = b""
        self._write_locks: tuple[PartitionLocalLock, ...] = ()
        # A plain attribute, kept with the locks (the core reads it twice per append: no property call).
        self.write_lock_hashes: tuple[int, ...] = ()
        """The distinct 32-bit hashes of the write locks, as the server sees them (read-only)."""
        self._read_locks: tuple[PartitionLocalLock, ...] = ()
        self._append_locks: tuple[PartitionLocalLock, ...] = ()

    def set_header(self, header: int) -> None:
        """Set the application-defined 32-bit header (streamed with the feed, before any data fetch)."""
        if type(header) is int and I32_MIN <= header <= I32_MAX:
            self._header = header  # The common case in one test (a bool's type is not int).
            return
        if isinstance(header, bool) or not isinstance(header, int):
            raise TypeError(f"header must be an int, got {type(header).__name__}")
        if not I32_MIN <= header <= I32_MAX:
            raise ValueError(f"header {header} does not fit in a signed 32-bit int")
        self._header = header

    @overload
    def set_transaction_data(self, data: bytes | bytearray | memoryview, serializer: None = None) -> None: ...
    @overload
    def set_transaction_data(self, data: T, serializer: Serializer[T]) -> None: ...
    def set_transaction_data(self, data: Any, serializer: Serializer[Any] | None = None) -> None:
        """Set the data: ``bytes`` as they are, or ``serializer.serialize(data)``."""
        if type(data) is bytes and serializer is None:
            self._data = data  # The common case in one test (bytes(data) would be data itself).
            return
        if serializer is not None:
            raw: bytes | bytearray | memoryview = serializer.serialize(data)
            if not isinstance(raw, bytes | bytearray | memoryview):
                raise TypeError(
                    f"{type(serializer).__name__}.serialize returned {type(raw).__name__}, not bytes"
                )
        elif isinstance(data, bytes | bytearray | memoryview):
            raw = data
        else:
            raise TypeError(f"transaction data without a serializer must be bytes, got {type(data).__name__}")
        self._data = bytes(raw)

    def set_write_locks(self, locks: Iterable[PartitionLocalLock]) -> None:
        """Locks this transaction checks and takes."""
        if type(locks) is list and len(locks) == 1:
            lock = locks[0]
            if type(lock) is PartitionLocalLock:
                # The common case, ``[lock]`` (once per locked append): the tuple and its hash at once,
                # instead of _check_locks, then _hashes on first use.
                self._write_locks = (lock,)
                # lock_hash(lock), written out (one call less per locked append; test_builder checks that
                # both give the same value).
                h = lock.id
                if not 0 <= h <= 0x7FFFFFFF:  # Long.hashCode of a small id is the id itself.
                    bits = h & 0xFFFFFFFFFFFFFFFF
                    h = (bits ^ (bits >> 32)) & 0xFFFFFFFF
                    if h >= 1 << 31:
                        h -= 1 << 32
                self.write_lock_hashes = (java_string_hash(lock.name) ^ h,)
                return
        self._write_locks = _check_locks(locks)
        self.write_lock_hashes = _hashes(self._write_locks) if self._write_locks else ()

    def set_read_locks(self, locks: Iterable[PartitionLocalLock]) -> None:
        """Locks this transaction checks but does not take."""
        self._read_locks = _check_locks(locks)

    def set_append_locks(self, locks: Iterable[PartitionLocalLock]) -> None:
        """Locks this transaction takes without checking them."""
        self._append_locks = _check_locks(locks)

    @property
    def header(self) -> int:
        return self._header

    @property
    def data(self) -> bytes:
        return self._data

    @property
    def write_locks(self) -> tuple[PartitionLocalLock, ...]:
        return self._write_locks

    @property
    def read_locks(self) -> tuple[PartitionLocalLock, ...]:
        return self._read_locks

    @property
    def append_locks(self) -> tuple[PartitionLocalLock, ...]:
        return self._append_locks

    def frame_append(
        self, out: list[bytes], magic: int, version: int, max_frame_bytes: int, req_id: ReqId
    ) -> bool:
        """The frame of ``build(req_id)`` appended to ``out`` in one pass (see
        :func:`waltz.protocol.client_server.frame_append`, whose result this is): False, having appended
        nothing, where that shortcut does not apply (read or append locks among them)."""
        if self._read_locks or self._append_locks:
            return False
        return frame_append(
            out,
            magic,
            version,
            max_frame_bytes,
            req_id,
            self.client_high_water_mark,
            self.write_lock_hashes,
            self._header,
            self._data,
        )

    def build(self, req_id: ReqId) -> AppendRequest:
        """The append request for this transaction (the client assigns ``req_id`` when it sends it)."""
        data = self._data
        return new_append_request(
            req_id,
            self.client_high_water_mark,
            self.write_lock_hashes,
            _hashes(self._read_locks) if self._read_locks else (),
            _hashes(self._append_locks) if self._append_locks else (),
            self._header,
            data,
            _crc32(data) & 0xFFFFFFFF,  # records.crc32, inline
        )


def _check_locks(locks: Iterable[PartitionLocalLock]) -> tuple[PartitionLocalLock, ...]:
    if type(locks) is list and len(locks) == 1 and type(locks[0]) is PartitionLocalLock:
        return (locks[0],)  # The common case, ``[lock]``, in one test (no iterator, no loop).
    result = tuple(locks)
    for lock in result:
        if not isinstance(lock, PartitionLocalLock):
            raise TypeError(f"locks must be PartitionLocalLock, got {type(lock).__name__}")
    return result


def _hashes(locks: tuple[PartitionLocalLock, ...]) -> tuple[int, ...]:
    if len(locks) == 1:
        return (lock_hash(locks[0]),)  # The common case: no duplicates to drop, no generator.
    # Duplicates (two locks, or two hashes that collide) mean nothing more to the server; send each once.
    return tuple(dict.fromkeys(lock_hash(lock) for lock in locks))

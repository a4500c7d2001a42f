"""``Transaction``: a committed transaction as the feed delivers it, with its data fetched on demand."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, overload

from waltz.client.serializer import Serializer
from waltz.protocol.records import ReqId

T = TypeVar("T")


class TransactionDataSource(Protocol):
    """Where a :class:`Transaction` gets its data (the client core): checksum-verified bytes."""

    def fetch_blocking(self, partition_id: int, transaction_id: int) -> bytes:
        """Fetch from a thread other than the event loop."""

    async def fetch(self, partition_id: int, transaction_id: int) -> bytes:
        """Fetch on the event loop."""


class Transaction:
    """A committed transaction: id, header and request id come with the feed; the data is fetched lazily.

    :meth:`get_transaction_data` makes an RPC the first time it is called (retried with backoff on errors,
    re-requested on a checksum mismatch, then :class:`~waltz.errors.DataChecksumError`) and caches the bytes.
    It blocks, so call it from ``apply_transaction`` (a callback thread), not from the event loop; on the
    loop use ``await fetch_transaction_data()``.
    """

    __slots__ = ("_data", "_source", "header", "partition_id", "req_id", "transaction_id")

    def __init__(
        self,
        partition_id: int,
        transaction_id: int,
        header: int,
        req_id: ReqId,
        source: TransactionDataSource,
    ) -> None:
        self.partition_id = partition_id
        self.transaction_id = transaction_id
        self.header = header
        self.req_id = req_id
        self._source = source
        self._data: bytes | None = None

    @overload
    def get_transaction_data(self, serializer: None = None) -> bytes: ...
    @overload
    def get_transaction_data(self, serializer: Serializer[T]) -> T: ...
    def get_transaction_data(self, serializer: Serializer[Any] | None = None) -> Any:
        """The transaction data: bytes, or ``serializer.deserialize(bytes)``. Blocking; thread-safe."""
        if self._data is None:
            self._data = self._source.fetch_blocking(self.partition_id, self.transaction_id)
        return self._data if serializer is None else serializer.deserialize(self._data)

    @overload
    async def fetch_transaction_data(self, serializer: None = None) -> bytes: ...
    @overload
    async def fetch_transaction_data(self, serializer: Serializer[T]) -> T: ...
    async def fetch_transaction_data(self, serializer: Serializer[Any] | None = None) -> Any:
        """Like :meth:`get_transaction_data`, as a coroutine for the client's event loop."""
        if self._data is None:
            self._data = await self._source.fetch(self.partition_id, self.transaction_id)
        return self._data if serializer is None else serializer.deserialize(self._data)

    def __repr__(self) -> str:
        return (
            f"Transaction(partition={self.partition_id}, id={self.transaction_id}, "
            f"header={self.header}, req_id={self.req_id!r})"
        )


_object_new = object.__new__


def new_transactions(
    partition_id: int, entries: Sequence[tuple[int, ReqId, int]], source: TransactionDataSource
) -> list[Transaction]:
    """``[Transaction(partition_id, tid, header, req_id, source) for tid, req_id, header in entries]``
    without a call of ``__init__`` per transaction (the feed makes one per committed append): the same
    slots, set here."""
    out: list[Transaction] = []
    append = out.append
    for tid, req_id, header in entries:
        t = _object_new(Transaction)
        t.partition_id = partition_id
        t.transaction_id = tid
        t.header = header
        t.req_id = req_id
        t._source = source
        t._data = None
        append(t)
    return out

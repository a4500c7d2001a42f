"""Shared test doubles for the client tests: recording callbacks and simple contexts."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from waltz import (
    ClientCallbacks,
    ClientConfig,
    PartitionLocalLock,
    Transaction,
    TransactionBuilder,
    TransactionContext,
)
from waltz.errors import ClusterError
from waltz.testing import MockDriver

FAST = ClientConfig(
    long_wait_threshold_ms=50,
    retry_initial_backoff_ms=1,
    retry_max_backoff_ms=10,
    submit_timeout_ms=2000,
    mount_timeout_ms=2000,
    request_timeout_ms=2000,
)
"""Short timeouts so that tests of failure paths run in milliseconds."""


class RecordingCallbacks(ClientCallbacks):
    """Applies transactions to an in-memory list per partition; records every call. Thread-safe."""

    def __init__(self, high_water_marks: dict[int, int] | None = None) -> None:
        self.lock = threading.Lock()
        self.hwm: dict[int, int] = dict(high_water_marks or {})
        self.applied: dict[int, list[tuple[int, bytes]]] = {}
        self.deliveries: list[tuple[int, int]] = []
        self.errors: list[tuple[int, int, BaseException]] = []
        self.threads: set[str] = set()
        self.fail_next: dict[tuple[int, int], int] = {}  # (partition, txn) -> failures left
        self.on_apply: Callable[[Transaction], None] | None = None

    def client_high_water_mark(self, partition_id: int) -> int:
        with self.lock:
            return self.hwm.get(partition_id, -1)

    def apply_transaction(self, transaction: Transaction) -> None:
        self._deliver(transaction)
        self._record(transaction, transaction.get_transaction_data())

    def _deliver(self, transaction: Transaction) -> None:
        key = (transaction.partition_id, transaction.transaction_id)
        with self.lock:
            self.threads.add(threading.current_thread().name)
            self.deliveries.append(key)
            if self.fail_next.get(key, 0) > 0:
                self.fail_next[key] -= 1
                raise RuntimeError(f"apply of {key} failed on purpose")

    def _record(self, transaction: Transaction, data: bytes) -> None:
        key = (transaction.partition_id, transaction.transaction_id)
        if self.on_apply is not None:
            self.on_apply(transaction)
        with self.lock:
            expected = self.hwm.get(transaction.partition_id, -1) + 1
            if transaction.transaction_id != expected:
                raise AssertionError(f"applied {key} but expected id {expected}")
            self.applied.setdefault(transaction.partition_id, []).append((transaction.transaction_id, data))
            self.hwm[transaction.partition_id] = transaction.transaction_id

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        with self.lock:
            self.errors.append((partition_id, transaction_id, exception))

    def data(self, partition_id: int = 0) -> list[bytes]:
        with self.lock:
            return [d for _, d in self.applied.get(partition_id, [])]


class AsyncRecordingCallbacks(RecordingCallbacks):
    """:class:`RecordingCallbacks` for ``client.callbackMode: inline``: a coroutine ``apply_transaction``
    (the data is fetched with ``await``, since a blocking fetch is refused on the loop)."""

    async def apply_transaction(self, transaction: Transaction) -> None:  # type: ignore[override]
        self._deliver(transaction)
        self._record(transaction, await transaction.fetch_transaction_data())


def recording_callbacks(mode: str = "threads") -> RecordingCallbacks:
    """The recording callbacks that suit ``client.callbackMode`` ``mode``."""
    return AsyncRecordingCallbacks() if mode == "inline" else RecordingCallbacks()


class ApplyOrderCallbacks(ClientCallbacks):
    """Appends ``apply:<id>`` to a shared event list per applied transaction (hook-order tests); fails loudly
    if an apply raises."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.hwm = -1

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm

    def apply_transaction(self, transaction: Transaction) -> None:
        self.events.append(f"apply:{transaction.transaction_id}")
        self.hwm = transaction.transaction_id

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        raise AssertionError(f"apply of {transaction_id} failed: {exception!r}")


class Ctx(TransactionContext):
    """Appends ``data`` to ``partition``, with optional locks; records its hooks in order."""

    def __init__(
        self,
        data: bytes,
        partition: int = 0,
        *,
        header: int = 0,
        write: tuple[PartitionLocalLock, ...] = (),
        read: tuple[PartitionLocalLock, ...] = (),
        append: tuple[PartitionLocalLock, ...] = (),
        give_up: bool = False,
        raise_in_execute: BaseException | None = None,
    ) -> None:
        super().__init__()
        self.data = data
        self.partition = partition
        self.header = header
        self.write, self.read, self.append = write, read, append
        self.give_up = give_up
        self.raise_in_execute = raise_in_execute
        self.executions = 0
        self.hwms_seen: list[int] = []
        self.events: list[str] = []
        self.exception: BaseException | None = None
        self.finished = threading.Event()

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        self.executions += 1
        self.hwms_seen.append(builder.client_high_water_mark)
        if self.raise_in_execute is not None:
            raise self.raise_in_execute
        if self.give_up:
            return False
        builder.set_header(self.header)
        builder.set_transaction_data(self.data)
        builder.set_write_locks(self.write)
        builder.set_read_locks(self.read)
        builder.set_append_locks(self.append)
        return True

    def on_completion(self, result: bool) -> None:
        self.events.append(f"completion:{result}")
        if not result:
            self.finished.set()

    def on_application(self) -> None:
        self.events.append("application")
        self.finished.set()

    def on_exception(self, exception: BaseException) -> None:
        self.events.append(f"exception:{type(exception).__name__}")
        self.exception = exception
        self.finished.set()

    def on_lock_failure(self) -> None:
        self.events.append("lock_failure")


class UnreachableDriver(MockDriver):
    """A driver whose cluster cannot be reached: ``open`` fails as the network driver does then."""

    async def open(self, listener: Any) -> None:
        raise ClusterError("cannot connect to ZooKeeper at 127.0.0.1:9: no answer within 100 ms")

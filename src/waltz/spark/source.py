"""What the data source needs from a Waltz log: :class:`LogSource`, and an in-memory one for tests.

The Spark layer never talks to the network itself. It plans against high-water marks and reads committed
transactions through this small synchronous interface, because every Spark entry point (planning on the
driver, ``read()`` on an executor) is a plain blocking call. :mod:`waltz.spark.cluster` implements it over
the client's :class:`~waltz.client.reader.LogReader`; :class:`MemoryLogSource` implements it over lists, so
offset handling and range planning are tested without a cluster and without Spark.

Contract of every implementation:

* ``high_water_marks(partitions)`` returns, per partition, the id of the last **committed** transaction
  (-1 for an empty partition). Committed transactions never change, so ``[start, hwm + 1)`` can be read
  again later with the same result: this is what makes Spark's replays deterministic.
* ``read(partition, start, end)`` yields the records ``start, start + 1, ..., end - 1`` in order, as
  :class:`~waltz.protocol.record_run.RecordRun` batches that follow each other without gaps, or raises. A run
  is the records as the storage node keeps them; its checksums are verified when it is unpacked
  (``run.records()``, ``run.columns()`` or ``run_bounds``, which raise
  :class:`~waltz.errors.DataChecksumError`), so each task unpacks its own batches straight into columns.
  ``end`` must be at most ``hwm + 1`` of an earlier ``high_water_marks`` call; a source never returns a
  record past the committed high-water mark.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Protocol

from waltz.errors import ClientError
from waltz.protocol.record_run import RecordRun, encode_run
from waltz.protocol.records import Record, ReqId

__all__ = ["LogSource", "MemoryLogSource"]


class LogSource(Protocol):
    """A partitioned log of committed transactions, read in batches (see the module docstring)."""

    @property
    def cluster_name(self) -> str:
        """The cluster's identity, recorded in streaming offsets so a checkpoint cannot switch logs."""
        ...

    @property
    def cluster_key(self) -> str:
        """The log's unique identity (its cluster key, a UUID), recorded in streaming offsets: two clusters
        may share a name, never a key."""
        ...

    @property
    def num_partitions(self) -> int: ...

    def high_water_marks(self, partitions: Sequence[int]) -> dict[int, int]:
        """Per partition, the id of the last committed transaction (-1 for none)."""
        ...

    def read(self, partition: int, start: int, end: int) -> Iterator[RecordRun]:
        """The committed records ``[start, end)`` in order, in runs of up to the fetch size."""
        ...


class MemoryLogSource:
    """A log held in lists; thread-safe. ``append`` adds committed transactions (tests grow the log)."""

    def __init__(
        self,
        num_partitions: int,
        cluster_name: str = "memory",
        fetch_size: int = 10_000,
        cluster_key: str = "00000000-0000-0000-0000-00000000beef",
    ) -> None:
        self._cluster_name = cluster_name
        self._cluster_key = cluster_key
        self._logs: list[list[Record]] = [[] for _ in range(num_partitions)]
        self._lock = threading.Lock()
        self.fetch_size = fetch_size
        self.reads: list[tuple[int, int, int]] = []
        """Every ``read(partition, start, end)`` call, for tests."""

    @property
    def cluster_name(self) -> str:
        return self._cluster_name

    @property
    def cluster_key(self) -> str:
        return self._cluster_key

    @property
    def num_partitions(self) -> int:
        return len(self._logs)

    def append(self, partition: int, data: bytes, header: int = 0) -> int:
        """Commit one transaction; returns its id."""
        with self._lock:
            log = self._logs[partition]
            txn = len(log)
            log.append(Record.build(txn, ReqId.of(1, 0, partition, txn + 1), header, data))
            return txn

    def high_water_marks(self, partitions: Sequence[int]) -> dict[int, int]:
        with self._lock:
            return {p: len(self._logs[p]) - 1 for p in partitions}

    def read(self, partition: int, start: int, end: int) -> Iterator[RecordRun]:
        self.reads.append((partition, start, end))
        with self._lock:
            committed = len(self._logs[partition])
        if not 0 <= start <= end <= committed:
            raise ClientError(f"partition {partition}: range [{start}, {end}) outside [0, {committed})")
        pos = start
        while pos < end:
            with self._lock:
                batch = self._logs[partition][pos : min(end, pos + self.fetch_size)]
            yield RecordRun(pos, len(batch), encode_run(batch))
            pos += len(batch)

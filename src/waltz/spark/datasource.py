# Method names (streamReader, latestOffset, batchId, ...) are PySpark's API and cannot follow PEP 8.
# ruff: noqa: N802, N803
"""``WaltzDataSource``: the ``waltz`` format for ``spark.read``, ``spark.readStream`` and ``df.write``.

Which process runs what (PySpark 4.x Python Data Source API):

* the data source object is built in a driver-side worker (``DataSource(options)``): options are parsed
  there, so a bad option fails ``load()`` / ``save()`` / ``start()`` at once with a ``ConfigError``;
* a batch read plans in a driver-side worker (``reader().partitions()``: one high-water-mark read per
  partition) and pickles the reader with its ranges to the executors, whose ``read()`` opens the
  process-wide :func:`~waltz.spark.cluster.open_source` lazily and yields Arrow record batches;
* a streaming read keeps one :class:`WaltzStreamReader` alive in a driver-side process for the whole query
  (offsets, admission control, planning), and pickles it to executors for ``read()``, which depends only on
  the range and the options (the planner is not pickled);
* writers run ``write()`` per task on executors, on Arrow record batches; ``commit``/``abort`` run on the
  driver.

Filter pushdown is deliberately not implemented (pitfall P1 of PySpark 4.3: a pushed filter leaks into other
DataFrames of the same relation); prune with ``partitions``, ``startingOffsets`` and ``endingOffsets``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from waltz.errors import TrimmedError
from waltz.spark.arrow import (
    ALL_COLUMNS,
    READ_SCHEMA_DDL,
    READ_SCHEMA_NO_DATA_DDL,
    Column,
    read_columns,
    to_arrow,
)
from waltz.spark.options import SourceOptions, parse_options
from waltz.spark.plan import (
    StreamPlanner,
    TxnRange,
    resolve_batch_ranges,
    selected_partitions,
    split_ranges,
)
from waltz.spark.source import LogSource
from waltz.spark.writer import (
    RowWriter,
    WriteSummary,
    check_partitions,
    check_write_schema,
    checkpoint_identity,
    exactly_once_commit,
)

__all__ = ["WaltzDataSource"]

log = logging.getLogger(__name__)


def _source(options: SourceOptions) -> LogSource:
    # Imported here so that unpickling a reader on an executor does not open anything.
    from waltz.spark.cluster import open_source

    return open_source(options)


class TxnRangePartition(InputPartition):
    """One Spark task: the transactions ``[start, end)`` of one Waltz partition."""

    def __init__(self, txn_range: TxnRange) -> None:
        super().__init__(txn_range)
        self.range = txn_range


def _read(options: SourceOptions, columns: tuple[Column, ...], partition: InputPartition) -> Iterator[Any]:
    txn_range = getattr(partition, "range", None)
    if not isinstance(txn_range, TxnRange):
        return  # Spark turns an empty plan into one partition of None: nothing to read.
    source = _source(options)
    p, pos, end = txn_range.partition, txn_range.start, txn_range.end
    while pos < end:
        try:
            for run in source.read(p, pos, end):
                pos = run.end
                yield to_arrow(p, run, columns=columns)
            return
        except TrimmedError as e:
            pos = _past_trim_point(options, e, pos)


def _past_trim_point(options: SourceOptions, error: TrimmedError, pos: int) -> int:
    """A read below the partition's trim point: with ``failOnDataLoss`` (the default) the task fails with
    the error's message; without, one WARNING and the read goes on at the trim point, as Kafka's source goes
    on at the earliest offset left."""
    if options.fail_on_data_loss:
        raise TrimmedError(
            f"{error}; set failOnDataLoss=false to start at the trim point",
            partition_id=error.partition_id,
            transaction_id=error.transaction_id,
            trim_point=error.trim_point,
        ) from error
    log.warning("waltz data source: %s; starting at the trim point (failOnDataLoss=false)", error)
    return max(pos + 1, error.trim_point)


def _columns(schema: Any, options: SourceOptions) -> tuple[Column, ...]:
    """The columns a read produces: those of the read's schema, which is the source's own or one the user
    gave (``spark.read.format("waltz").schema(...)``, any subset of the source's columns)."""
    if not hasattr(schema, "fields"):  # pragma: no cover - PySpark passes a StructType
        return ALL_COLUMNS if options.include_data else ALL_COLUMNS[:4]
    return read_columns(schema, options.include_data)


class WaltzDataSource(DataSource):
    """The ``waltz`` format. Register with :func:`waltz.spark.register` (or ``spark.dataSource.register``)."""

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self.parsed = parse_options(options)

    @classmethod
    def name(cls) -> str:
        return "waltz"

    def schema(self) -> str:
        return READ_SCHEMA_DDL if self.parsed.include_data else READ_SCHEMA_NO_DATA_DDL

    def reader(self, schema: Any) -> DataSourceReader:
        options = self.parsed.for_batch_read()
        return WaltzBatchReader(options, _columns(schema, options))

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        options = self.parsed.for_stream_read()
        return WaltzStreamReader(options, _columns(schema, options))

    def writer(self, schema: Any, overwrite: bool) -> DataSourceArrowWriter:
        return WaltzBatchWriter(self.parsed.for_write(streaming=False), schema, overwrite)

    def streamWriter(self, schema: Any, overwrite: bool) -> DataSourceStreamArrowWriter:
        return WaltzStreamWriter(self.parsed.for_write(streaming=True), schema, overwrite)


class WaltzBatchReader(DataSourceReader):
    """A batch read: the committed log from ``startingOffsets`` to ``endingOffsets``, fixed at planning."""

    def __init__(self, options: SourceOptions, columns: tuple[Column, ...] = ALL_COLUMNS) -> None:
        self.options = options
        self.columns = columns

    def partitions(self) -> Sequence[InputPartition]:
        opts = self.options
        source = _source(opts)
        parts = selected_partitions(opts.partitions, source.num_partitions)
        hwms = source.high_water_marks(parts)
        ranges = resolve_batch_ranges(
            opts.starting(streaming=False), opts.ending_offsets, parts, hwms, opts.fail_on_data_loss
        )
        tasks = split_ranges(ranges, opts.min_partitions, opts.max_records_per_partition)
        log.info("waltz batch read of %s: %d tasks for %s", source.cluster_name, len(tasks), ranges)
        return [TxnRangePartition(t) for t in tasks]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(self.options, self.columns, partition)


class WaltzStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A streaming read with JSON offsets, ``maxOffsetsPerTrigger`` and ``Trigger.AvailableNow``.

    Offsets are ``{"v": 1, "cluster": ..., "partitions": {"0": next_id}}`` (see :mod:`waltz.spark.plan`);
    they never move backwards and never past the committed high-water mark, so a micro-batch replayed from
    the checkpoint after a crash reads exactly the same transactions.
    """

    def __init__(self, options: SourceOptions, columns: tuple[Column, ...] = ALL_COLUMNS) -> None:
        self.options = options
        self.columns = columns
        self._planner: StreamPlanner | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Executors only need the options and columns: the planner holds a live connection.
        return {"options": self.options, "columns": self.columns, "_planner": None}

    @property
    def planner(self) -> StreamPlanner:
        if self._planner is None:
            opts = self.options
            self._planner = StreamPlanner(
                _source(opts),
                partitions=opts.partitions,
                starting=opts.starting(streaming=True),
                fail_on_data_loss=opts.fail_on_data_loss,
                min_partitions=opts.min_partitions,
                max_records_per_partition=opts.max_records_per_partition,
                min_offsets_per_trigger=opts.min_offsets_per_trigger,
                max_trigger_delay_ms=opts.max_trigger_delay_ms,
            )
        return self._planner

    def initialOffset(self) -> dict[str, Any]:
        return self.planner.initial_offset()

    def getDefaultReadLimit(self) -> ReadLimit:
        limit = self.options.max_offsets_per_trigger
        return ReadAllAvailable() if limit is None else ReadMaxRows(limit)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        return self.planner.latest_offset(start, max_rows)

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return self.planner.latest_reported()

    def prepareForTriggerAvailableNow(self) -> None:
        self.planner.prepare_available_now()

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        return [TxnRangePartition(t) for t in self.planner.plan(start, end)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(self.options, self.columns, partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to acknowledge: the log is immutable and the position lives in Spark's checkpoint."""

    def stop(self) -> None:
        """The process-wide source stays open for other queries; it closes at interpreter exit."""


@dataclass(frozen=True)
class WaltzCommitMessage(WriterCommitMessage):
    """What a write task reports: its summary, and in exactly-once mode the rows for the driver."""

    summary: WriteSummary
    rows: tuple[tuple[int, int, bytes, tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...] = ()


def _planned_partition_count(options: SourceOptions) -> int:
    """The cluster's partition count, read when a write is planned (on the driver), with the ``partition``
    option checked against it: a write to a partition that does not exist fails before any task starts."""
    count = _source(options).num_partitions
    check_partitions(options, count)
    return count


class WaltzBatchWriter(DataSourceArrowWriter):
    """``df.write.format("waltz").mode("append")``: every row becomes one transaction (at-least-once).

    An Arrow writer: tasks get the rows as the Arrow record batches Spark already builds for the Python
    worker, not as one ``Row`` object per row."""

    def __init__(self, options: SourceOptions, schema: Any, overwrite: bool) -> None:
        if overwrite:
            from waltz.errors import ConfigError

            raise ConfigError("waltz data source: a log cannot be overwritten; use mode('append')")
        check_write_schema(schema)
        self.options = options
        self.num_partitions = _planned_partition_count(options)

    def write(self, iterator: Iterator[Any]) -> WaltzCommitMessage:
        return WaltzCommitMessage(RowWriter(self.options, self.num_partitions).append_batches(iterator))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        total = sum(m.summary.appended for m in messages if isinstance(m, WaltzCommitMessage))
        log.info("waltz write committed: %d transactions appended", total)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        done = sum(m.summary.appended for m in messages if isinstance(m, WaltzCommitMessage))
        log.warning(
            "waltz write aborted: %d transactions of successful tasks stay in the log (at-least-once)", done
        )


class WaltzStreamWriter(DataSourceStreamArrowWriter):
    """The streaming sink: at-least-once from the executors, or exactly-once per (queryId, batch id).

    An Arrow writer, as :class:`WaltzBatchWriter`."""

    def __init__(self, options: SourceOptions, schema: Any, overwrite: bool) -> None:
        check_write_schema(schema)
        self.options = options
        self.num_partitions = _planned_partition_count(options)
        self._checkpoint: str | None = None

    def write(self, iterator: Iterator[Any]) -> WaltzCommitMessage:
        writer = RowWriter(self.options, self.num_partitions)
        if self.options.exactly_once:
            rows, summary = writer.collect_batches(iterator)
            return WaltzCommitMessage(summary, rows)
        return WaltzCommitMessage(writer.append_batches(iterator))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        if not self.options.exactly_once:
            return
        if self._checkpoint is None and self.options.checkpoint_location:
            # Read on the driver at the first commit: Spark has written the checkpoint's metadata by then.
            self._checkpoint = checkpoint_identity(self.options.checkpoint_location)
        rows = [row for m in messages if isinstance(m, WaltzCommitMessage) for row in m.rows]
        exactly_once_commit(self.options, batchId, rows, self._checkpoint)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        if not self.options.exactly_once:
            log.warning(
                "waltz sink: batch %d aborted; rows appended by its tasks stay (at-least-once)", batchId
            )

"""Appending Spark rows to Waltz: the at-least-once row writer and the exactly-once micro-batch commit.

Write schema: ``data BINARY`` (required, not null), and optionally ``partition INT`` (default: the
``partition`` option), ``header INT`` (default 0), and ``writeLocks`` / ``readLocks`` / ``appendLocks``
``ARRAY<STRING>`` whose elements are ``"name:id"`` (a :class:`~waltz.client.locks.PartitionLocalLock`).
Any other column is an error.

Delivery guarantees
    *Batch writes and the default streaming sink are at-least-once.* Each task appends its rows through a
    :class:`~waltz.WaltzClient`, which appends every row exactly once while the task lives (a lost append is
    detected by the transaction monitor and executed again; one that committed is never sent twice). If a
    task or job fails, rows already appended stay in the log, and a retried task appends its rows again.
    Within one task, rows of one partition are appended in row order unless an append has to be retried.

Speed
    Tasks get their rows as Arrow record batches (a ``DataSourceArrowWriter``) and convert each column to
    Python values once (:func:`rows_of_batch`). A task keeps at most ``client.maxConcurrentTransactions``
    (default :data:`WRITER_MAX_CONCURRENT_TRANSACTIONS`) appends in flight and hands them to the client's
    bulk path in chunks; the client runs the sink's callbacks inline on its loop; and a Python worker keeps
    its client open for its next task for :data:`SESSION_IDLE_CLOSE_S` (a task that failed closes it).

    *``exactlyOnce=true`` (streaming only) appends each micro-batch exactly once,* keyed by
    (``queryId``, checkpoint, batch id), the checkpoint being :func:`checkpoint_identity` of the writer's
    ``checkpointLocation`` (a new checkpoint restarts batch ids at 0, so without it a reused ``queryId``
    would skip the new checkpoint's batches). Tasks send their rows to the driver in their commit messages,
    and the driver's
    :func:`exactly_once_commit` appends them between two marker transactions in the marker partition (the
    ``partition`` option): ``BEGIN(query, batch)``, then the rows, then ``END(query, batch)``. Before
    appending it scans the last :data:`EXACTLY_ONCE_SCAN_WINDOW` transactions: with an ``END`` the batch is
    already in the log and nothing is appended; otherwise the rows appended by earlier attempts (the
    clients named by their ``BEGIN`` markers; client ids are unique in a cluster) are subtracted and only
    the missing rows are appended. Spark replays a failed batch with the same rows (the sources must be
    replayable, as the waltz source is), so every row lands exactly once. Markers carry the header
    :data:`MARKER_HEADER` and JSON data; consumers of the log skip that header. The batch must be replayed
    before :data:`EXACTLY_ONCE_SCAN_WINDOW` later transactions bury its markers, and it must fit in the
    driver's memory.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from waltz.client.api import ClientCallbacks
from waltz.client.builder import TransactionBuilder
from waltz.client.context import TransactionContext
from waltz.client.driver import ClientDriver
from waltz.client.locks import PartitionLocalLock
from waltz.client.sync import WaltzClient
from waltz.client.transaction import Transaction
from waltz.errors import ClientError, ClientTimeoutError, ConfigError
from waltz.protocol.wire import I32_MAX, I32_MIN
from waltz.spark.options import SourceOptions

__all__ = [
    "EXACTLY_ONCE_SCAN_WINDOW",
    "MARKER_HEADER",
    "RowWriter",
    "WriteSummary",
    "check_partitions",
    "check_write_schema",
    "checkpoint_identity",
    "exactly_once_commit",
]

log = logging.getLogger(__name__)

MARKER_HEADER = 0x7761_6C74
"""Header of the exactly-once sink's marker transactions (``"walt"``); consumers skip it."""
EXACTLY_ONCE_SCAN_WINDOW = 10_000
"""How many of the latest transactions of a partition the exactly-once commit scans for earlier attempts."""
FLUSH_TIMEOUT_S = 300.0

WRITE_COLUMNS = {
    "data": "binary",
    "partition": "int",
    "header": "int",
    "writeLocks": "array<string>",
    "readLocks": "array<string>",
    "appendLocks": "array<string>",
}

WriteRow = tuple[int, int, bytes, tuple[str, ...], tuple[str, ...], tuple[str, ...]]
"""(partition, header, data, writeLocks, readLocks, appendLocks): one transaction to append."""


def check_write_schema(schema: Any) -> None:
    """Raise ConfigError unless ``schema`` (a StructType) is a valid write schema (module docstring)."""
    problems = []
    names = set()
    for f in schema.fields:
        names.add(f.name)
        want = WRITE_COLUMNS.get(f.name)
        if want is None:
            problems.append(f"unknown column {f.name!r}")
        elif f.dataType.simpleString() != want:
            problems.append(
                f"column {f.name} must be {want.upper()}, not {f.dataType.simpleString().upper()}"
            )
    if "data" not in names:
        problems.append("a data BINARY column is required")
    if problems:
        allowed = ", ".join(f"{k} {v.upper()}" for k, v in WRITE_COLUMNS.items())
        raise ConfigError(f"waltz sink: {'; '.join(problems)} (columns: {allowed})")


@dataclass(frozen=True)
class WriteSummary:
    """What one task did."""

    rows: int
    appended: int


def _locks(values: Sequence[str] | None) -> tuple[PartitionLocalLock, ...]:
    out = []
    for text in values or ():
        name, sep, ident = str(text).rpartition(":")
        try:
            if not sep or not name:
                raise ValueError(text)
            out.append(PartitionLocalLock(name, int(ident)))
        except ValueError:
            raise ClientError(f"waltz sink: lock {text!r} is not 'name:id' with an integer id") from None
    return tuple(out)


def _to_write_row(row: Any, default_partition: int) -> WriteRow:
    fields = row.asDict() if hasattr(row, "asDict") else dict(row)
    data = fields.get("data")
    if data is None:
        raise ClientError("waltz sink: a row has a null data column")
    partition = fields.get("partition")
    header = fields.get("header")
    return (
        default_partition if partition is None else int(partition),
        0 if header is None else int(header),
        bytes(data),
        tuple(fields.get("writeLocks") or ()),
        tuple(fields.get("readLocks") or ()),
        tuple(fields.get("appendLocks") or ()),
    )


class _RowContext(TransactionContext):
    """Appends one row as it is: no state is read, so re-executing it is always correct."""

    def __init__(self, row: WriteRow, outcome: _Outcome) -> None:
        super().__init__()
        self.row = row
        self.outcome = outcome
        self.writes = _locks(row[3])
        self.reads = _locks(row[4])
        self.appends = _locks(row[5])

    def partition_id(self, num_partitions: int) -> int:
        return self.row[0]

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_header(self.row[1])
        builder.set_transaction_data(self.row[2])
        if self.writes:
            builder.set_write_locks(self.writes)
        if self.reads:
            builder.set_read_locks(self.reads)
        if self.appends:
            builder.set_append_locks(self.appends)
        return True

    def on_completion(self, result: bool) -> None:
        self.outcome.done(result, None)

    def on_exception(self, exception: BaseException) -> None:
        self.outcome.done(False, exception)


class _Outcome:
    """Counts how a task's contexts ended, and lets the task wait until enough have (the submit window).

    ``done`` runs once per context on the client's loop thread (``callbackMode: inline``, the sink's default)
    or on its callback threads; it wakes the task only when the count it waits for is reached."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.appended = 0
        self.ended = 0
        self.error: BaseException | None = None
        self._wake_at: int | None = None  # the ended count the task waits for, if it waits

    def done(self, appended: bool, error: BaseException | None) -> None:
        with self._cond:
            self.ended += 1
            self.appended += int(appended)
            if error is not None and self.error is None:
                self.error = error
            if self._wake_at is not None and (self.ended >= self._wake_at or self.error is not None):
                self._wake_at = None
                self._cond.notify_all()

    def wait_ended(self, count: int, timeout_s: float) -> bool:
        """Wait until ``count`` contexts have ended (or one failed); False on timeout."""
        with self._cond:
            if self.ended >= count or self.error is not None:
                return True
            self._wake_at = count
            return self._cond.wait_for(lambda: self.ended >= count or self.error is not None, timeout_s)


class _NoApply(ClientCallbacks):
    """A writer applies nothing: its feed starts at the high-water mark read just before mounting.

    ``start`` holds the mounted partitions and, per partition, the last transaction the feed delivered, so
    a client that re-mounts (a server moved the partition) resumes the feed there, not at the first mount:
    a session lives on across tasks (:func:`_borrow_session`)."""

    def __init__(self) -> None:
        self.start: dict[int, int] = {}

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.start[partition_id]

    def apply_transaction(self, transaction: Transaction) -> None:
        self.start[transaction.partition_id] = transaction.transaction_id

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        log.error("waltz sink: partition %d: %r", partition_id, exception)


WRITER_MAX_CONCURRENT_TRANSACTIONS = 800
"""Transactions a write task keeps in flight over all its partitions unless
``waltz.client.maxConcurrentTransactions`` is given (the task's window, and the client's limit per partition,
so a partition never lacks room). Rows carry no locks and never conflict, so a deep pipeline is safe, and
the client's default (5, sized for applications that read their own writes) makes a bulk write wait for a
round trip every few rows. 800 is where a deeper window stops adding rows/s for a task on its own core
(docs/BENCHMARKS.md, "Spark batch write")."""
SUBMIT_CHUNKS_PER_WINDOW = 4
"""The in-flight window is refilled in chunks of a quarter of it: one hop onto the client's loop and one
wake-up of the task per chunk, while three quarters of the window stay in flight."""


class RowWriter:
    """Appends rows through one :class:`WaltzClient` (see the module docstring for the guarantee).

    ``num_partitions`` is the cluster's partition count as read when the write was planned: rows are checked
    against it before a connection is opened, so a row for a partition that does not exist fails at once.
    Rows come as Spark ``Row`` objects or dicts (:meth:`append_rows`) or as Arrow record batches
    (:meth:`append_batches`, what the data source's tasks get: no Python object per row until the
    transaction contexts).
    """

    def __init__(self, options: SourceOptions, num_partitions: int | None = None) -> None:
        self.options = options
        self.num_partitions = num_partitions

    def _row(self, raw: Any) -> WriteRow:
        row = _to_write_row(raw, self.options.default_partition)
        _check_row(row, self.num_partitions)
        return row

    def _row_chunks(self, rows: Iterable[Any]) -> Iterator[list[WriteRow]]:
        iterator = iter(rows)
        while chunk := [self._row(raw) for raw in itertools.islice(iterator, BATCH_ROWS)]:
            yield chunk

    def _batch_chunks(self, batches: Iterable[Any]) -> Iterator[list[WriteRow]]:
        for batch in batches:
            rows = rows_of_batch(batch, self.options.default_partition, self.num_partitions)
            if rows:
                yield rows

    def collect_rows(self, rows: Iterable[Any]) -> tuple[tuple[WriteRow, ...], WriteSummary]:
        out = tuple(row for chunk in self._row_chunks(rows) for row in chunk)
        return out, WriteSummary(len(out), 0)

    def collect_batches(self, batches: Iterable[Any]) -> tuple[tuple[WriteRow, ...], WriteSummary]:
        out = tuple(row for chunk in self._batch_chunks(batches) for row in chunk)
        return out, WriteSummary(len(out), 0)

    def append_rows(self, rows: Iterable[Any]) -> WriteSummary:
        return self._append(self._row_chunks(rows))

    def append_batches(self, batches: Iterable[Any]) -> WriteSummary:
        """Append the rows of Arrow record batches (the write schema's columns), in order."""
        return self._append(self._batch_chunks(batches))

    def _append(self, chunks: Iterator[list[WriteRow]]) -> WriteSummary:
        chunk = next(chunks, None)
        if chunk is None:
            return WriteSummary(0, 0)  # an empty task opens no connection
        count = 0
        session = _borrow_session(self.options)
        healthy = False
        try:
            while chunk is not None:
                session.submit_many(chunk)
                count += len(chunk)
                chunk = next(chunks, None)
            appended = session.finish()
            healthy = True
        finally:
            _return_session(session, healthy)
        return WriteSummary(count, appended)


BATCH_ROWS = 10_000
"""Rows converted and checked at a time by :meth:`RowWriter.append_rows` (Spark's Arrow batches hold 10,000
rows too): a bad row fails before any row of its batch is submitted."""


def rows_of_batch(batch: Any, default_partition: int, num_partitions: int | None = None) -> list[WriteRow]:
    """The rows of an Arrow record batch of the write schema, checked as :func:`_check_row` checks one row.

    Each column is converted to Python values once (``to_pylist``, in C); absent or null ``partition`` and
    ``header`` take the ``partition`` option and 0, as in :func:`_to_write_row`.
    """
    n = batch.num_rows
    names = batch.schema.names
    if n == 0:
        return []

    def column(name: str) -> Any:
        return batch.column(names.index(name)) if name in names else None

    data_column = column("data")
    if data_column is None or data_column.null_count:
        raise ClientError("waltz sink: a row has a null data column")
    data = data_column.to_pylist()
    partitions = _ints(column("partition"), default_partition, n)
    headers = _ints(column("header"), 0, n)
    locks = [_lock_texts(column(name), n) for name in ("writeLocks", "readLocks", "appendLocks")]
    if num_partitions is not None:
        low, high = min(partitions), max(partitions)
        bad = low if low < 0 else high if high >= num_partitions else None
        if bad is not None:
            _check_row((bad, 0, b"", (), (), ()), num_partitions)
    if MARKER_HEADER in headers:
        _check_row((0, MARKER_HEADER, b"", (), (), ()))
    for column_locks in locks:
        if isinstance(column_locks, list):
            for texts in column_locks:
                _locks(texts)
    return list(zip(partitions, headers, data, *locks, strict=False))


def _ints(column: Any, default: int, n: int) -> list[int]:
    if column is None:
        return [default] * n
    values: list[int] = column.to_pylist()
    if column.null_count:
        values = [default if v is None else v for v in values]
    return values


def _lock_texts(column: Any, n: int) -> Any:
    """Per row, the lock texts of a ``writeLocks``/``readLocks``/``appendLocks`` column (a tuple each)."""
    if column is None or column.null_count == n:
        return itertools.repeat((), n)
    return [tuple(v) if v else () for v in column.to_pylist()]


def check_partitions(options: SourceOptions, num_partitions: int) -> None:
    """When a write is planned: the ``partition`` option must name a partition of the cluster."""
    if not 0 <= options.default_partition < num_partitions:
        raise ConfigError(
            f"waltz sink: partition {options.default_partition} does not exist "
            f"(the cluster has partitions 0..{num_partitions - 1})"
        )


def _check_row(row: WriteRow, num_partitions: int | None = None) -> None:
    if num_partitions is not None and not 0 <= row[0] < num_partitions:
        raise ClientError(
            f"waltz sink: a row is for partition {row[0]}, which does not exist "
            f"(the cluster has partitions 0..{num_partitions - 1})"
        )
    if not I32_MIN <= row[1] <= I32_MAX:
        raise ClientError(f"waltz sink: header {row[1]} does not fit in a signed 32-bit int")
    if row[1] == MARKER_HEADER:
        raise ClientError(f"waltz sink: header {MARKER_HEADER} is reserved for the exactly-once markers")
    _locks(row[3] + row[4] + row[5])


class _Session:
    """A write-only client, mounting partitions as rows need them; used by one task at a time.

    Rows go to :meth:`WaltzClient.submit_many <waltz.client.sync.WaltzClient.submit_many>`, the client's
    bulk path: the contexts are executed on the task's thread and handed to the client's loop in chunks with
    one wake-up each, never more than the client has room for (see :meth:`submit_many`). Its callbacks run
    inline on the client's loop unless ``client.callbackMode`` is given.
    """

    def __init__(self, options: SourceOptions, *, driver: ClientDriver | None = None) -> None:
        self.callbacks = _NoApply()
        self.outcome = _Outcome()
        config = options.client_config.replace(auto_mount=False)
        if "client.maxConcurrentTransactions" not in options.client:
            config = config.replace(max_concurrent_transactions=WRITER_MAX_CONCURRENT_TRANSACTIONS)
        if "client.callbackMode" not in options.client:
            # The contexts and callbacks here only count and never block: running them on the client's loop
            # saves a hop to a callback thread and back for every row.
            config = config.replace(callback_mode="inline")
        self.key = options.cluster_key
        self.client = WaltzClient(self.callbacks, config, driver=driver)  # driver: tests' MockDriver
        self.window = config.max_concurrent_transactions
        self.chunk = max(1, self.window // SUBMIT_CHUNKS_PER_WINDOW)
        self.wait_s = config.submit_timeout_ms / 1000
        self.submitted = 0

    def __enter__(self) -> _Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.client.close()

    def reset(self) -> None:
        """Start counting afresh for the next task (every context of the last one has ended)."""
        self.outcome = _Outcome()
        self.submitted = 0

    def mount(self, partitions: Iterable[int]) -> None:
        new = sorted(set(partitions) - set(self.callbacks.start))
        if not new:
            return
        for p in new:
            if not 0 <= p < self.client.num_partitions:
                raise ClientError(f"waltz sink: partition {p} outside 0..{self.client.num_partitions - 1}")
            # Raises (retriable) for a partition that is not served: never taken as an empty log.
            self.callbacks.start[p] = self.client.high_water_mark(p)
        self.client.set_partitions(self.callbacks.start)

    def submit(self, row: WriteRow) -> None:
        self.submit_many([row])

    def submit_many(self, rows: Sequence[WriteRow]) -> None:
        """Submit ``rows`` in order, at most ``client.maxConcurrentTransactions`` in flight in all.

        The window is this task's, over all partitions, and is the client's limit per partition, so the
        client always has room for what is handed to it: ``WaltzClient.submit_many`` then takes a whole chunk
        with one hop onto its loop, where a full client would make it wait for room one context at a time
        (a hop and a wake-up per row). Blocks while the window is full, up to ``client.submitTimeout``.
        """
        self.mount({row[0] for row in rows})
        for first in range(0, len(rows), self.chunk):
            part = rows[first : first + self.chunk]
            if not self.outcome.wait_ended(self.submitted + len(part) - self.window, self.wait_s):
                raise ClientTimeoutError(
                    f"waltz sink: no room in the window of {self.window} transactions within "
                    f"{self.wait_s:g} s (client.submitTimeout)"
                )
            self._raise_failure()
            self.client.submit_many([_RowContext(row, self.outcome) for row in part])
            self.submitted += len(part)

    def _raise_failure(self) -> None:
        error = self.outcome.error
        if error is not None:
            raise ClientError(f"waltz sink: an append failed: {error!r}") from error

    def finish(self) -> int:
        """Wait until every submitted row is appended; raise if one failed. Returns the number appended."""
        self.client.flush_transactions(timeout=FLUSH_TIMEOUT_S)
        self._raise_failure()
        if self.outcome.appended != self.submitted:
            raise ClientError(
                f"waltz sink: {self.submitted - self.outcome.appended} of {self.submitted} rows not appended"
            )
        return self.outcome.appended


SESSION_IDLE_CLOSE_S = 30.0
"""How long a write session stays open with no task using it. Spark runs the tasks of a Python worker one
after the other, so the next task (the next micro-batch of a streaming sink, the next write of a job)
takes the open client instead of opening a ZooKeeper session, a client id and server connections again;
an idle client still follows the feed of its partitions, hence the bound."""

_idle_sessions: dict[tuple[tuple[str, str], ...], tuple[_Session, threading.Timer]] = {}
_idle_lock = threading.Lock()


def _borrow_session(options: SourceOptions) -> _Session:
    """This process's idle session for ``options``' cluster settings, or a new one. The borrower has it to
    itself until :func:`_return_session`; concurrent writers in one process get sessions of their own."""
    with _idle_lock:
        idle = _idle_sessions.pop(options.cluster_key, None)
    if idle is None:
        return _Session(options)
    session, timer = idle
    timer.cancel()
    session.reset()
    return session


def _return_session(session: _Session, healthy: bool) -> None:
    """Keep ``session`` for the next task (closed after :data:`SESSION_IDLE_CLOSE_S` unused), or close it if
    its task failed: a client that saw an error is not trusted with the next task's rows."""
    if healthy:
        timer = threading.Timer(SESSION_IDLE_CLOSE_S, _close_idle, args=(session,))
        timer.daemon = True
        timer.name = "waltz-sink-idle"
        with _idle_lock:
            if session.key not in _idle_sessions:
                _idle_sessions[session.key] = (session, timer)
                timer.start()
                return
    try:
        session.close()
    except Exception:  # the task's own error, if any, is the one to report
        log.warning("waltz sink: closing a write session failed", exc_info=True)


def _close_idle(session: _Session) -> None:
    with _idle_lock:
        idle = _idle_sessions.get(session.key)
        if idle is None or idle[0] is not session:
            return  # borrowed again meanwhile
        del _idle_sessions[session.key]
    session.close()


def close_idle_sessions() -> None:
    """Close every idle write session of this process (at interpreter exit; tests)."""
    with _idle_lock:
        idle = list(_idle_sessions.values())
        _idle_sessions.clear()
    for session, timer in idle:
        timer.cancel()
        try:
            session.close()
        except Exception:
            log.debug("closing an idle waltz sink session failed", exc_info=True)


# The ZooKeeper client's threads are not daemons, and the interpreter joins non-daemon threads before it
# runs atexit handlers: close idle sessions from the hook that runs before that join (as waltz.spark.cluster
# does for its sources).
_register_atexit = getattr(threading, "_register_atexit", None)
if _register_atexit is not None:
    _register_atexit(close_idle_sessions)
else:  # pragma: no cover - other interpreters
    atexit.register(close_idle_sessions)


def checkpoint_identity(location: str) -> str:
    """What names a streaming query's checkpoint: Spark's query id, which Spark keeps in
    ``<checkpointLocation>/metadata`` and which changes when a checkpoint is deleted and made again; the
    location itself when that file cannot be read here (a remote file system)."""
    parsed = urllib.parse.urlparse(location)
    if parsed.scheme in ("", "file"):
        path = Path(urllib.parse.unquote(parsed.path) if parsed.scheme else location)
        try:
            first = (path / "metadata").read_text().splitlines()[0]
            query_id = json.loads(first)["id"]
            if isinstance(query_id, str) and query_id:
                return f"spark-query:{query_id}"
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            log.warning("waltz sink: cannot read Spark's query id in %s/metadata; keying on the path", path)
    return f"location:{location}"


def _marker(kind: str, query: str, checkpoint: str, batch: int, client_id: int) -> WriteRow:
    data = json.dumps(
        {"waltz.spark": kind, "query": query, "checkpoint": checkpoint, "batch": batch, "client": client_id}
    ).encode()
    return (-1, MARKER_HEADER, data, (), (), ())


def _parse_marker(data: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) and "waltz.spark" in value else None


def _not_appended_yet(
    rows: Sequence[WriteRow],
    touched: list[int],
    earlier_clients: set[int],
    window: Callable[[int], Iterator[Any]],
) -> list[WriteRow]:
    """The rows an earlier attempt (one of ``earlier_clients``) did not append, as a multiset: a row given
    twice and found once is appended once more; ``window(p)`` reads the records of partition ``p`` to look
    in."""
    todo = Counter((r[0], r[1], r[2]) for r in rows)
    if earlier_clients:
        for p in touched:
            for rec in window(p):
                key = (p, rec.header, rec.data)
                if rec.req_id.client_id in earlier_clients and rec.header != MARKER_HEADER and todo[key] > 0:
                    todo[key] -= 1
    pending = []
    for row in rows:
        key = (row[0], row[1], row[2])
        if todo[key] > 0:
            todo[key] -= 1
            pending.append(row)
    return pending


def exactly_once_commit(
    options: SourceOptions, batch_id: int, rows: Sequence[WriteRow], checkpoint: str | None = None
) -> int:
    """Append the rows of micro-batch ``batch_id`` exactly once (module docstring); returns rows appended.

    Batches are keyed by (``queryId``, ``checkpoint``, batch id), ``checkpoint`` being
    :func:`checkpoint_identity` of the writer's ``checkpointLocation`` (by default): a new checkpoint starts
    its batch ids at 0 again, so with the query id alone its batches would be taken for the old ones and
    skipped.
    """
    from waltz.spark.cluster import open_source

    query = options.query_id
    if not query:
        raise ConfigError("waltz sink: exactlyOnce needs queryId")
    if checkpoint is None:
        if not options.checkpoint_location:
            raise ConfigError("waltz sink: exactlyOnce needs the writer's checkpointLocation option")
        checkpoint = checkpoint_identity(options.checkpoint_location)
    marker_partition = options.default_partition
    touched = sorted({marker_partition, *(r[0] for r in rows)})
    source = open_source(options)
    hwms = source.high_water_marks(touched)

    def window(p: int) -> Iterator[Any]:
        end = hwms[p] + 1
        for run in source.read(p, max(0, end - EXACTLY_ONCE_SCAN_WINDOW), end):
            yield from run.records()

    earlier_clients: set[int] = set()
    for rec in window(marker_partition):
        if rec.header != MARKER_HEADER:
            continue
        marker = _parse_marker(rec.data)
        if (
            marker is None
            or marker.get("query") != query
            or marker.get("checkpoint") != checkpoint
            or marker.get("batch") != batch_id
        ):
            continue  # another query or checkpoint (markers without one predate checkpoint keys)
        if marker["waltz.spark"] == "end":
            log.info("waltz sink: batch %d of %s is already in the log; nothing to do", batch_id, query)
            return 0
        earlier_clients.add(rec.req_id.client_id)
    pending = _not_appended_yet(rows, touched, earlier_clients, window)
    # A client of its own, never a pooled one (_borrow_session): its client id names this attempt's rows to
    # the next attempt, so it must not have appended anything else.
    with _Session(options) as session:
        session.mount(touched)
        client_id = session.client.client_id
        begin = _marker("begin", query, checkpoint, batch_id, client_id)
        session.submit((marker_partition, *begin[1:]))
        session.finish()  # BEGIN is committed before any row: a later attempt will recognise our rows.
        for row in pending:
            session.submit(row)
        session.finish()
        end = _marker("end", query, checkpoint, batch_id, client_id)
        session.submit((marker_partition, *end[1:]))
        session.finish()
    log.info(
        "waltz sink: batch %d of %s: %d rows appended (%d were already in the log)",
        batch_id,
        query,
        len(pending),
        len(rows) - len(pending),
    )
    return len(pending)

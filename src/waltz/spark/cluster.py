"""A :class:`~waltz.spark.source.LogSource` over a real Waltz cluster, shared per Python process.

Spark calls the data source from plain threads (planning workers, executor tasks, the long-lived streaming
source process), and reuses Python workers between tasks. So each process keeps **one** background asyncio
loop thread (``waltz-spark-io``) and one open reader per cluster configuration, created lazily on first use
(never while a reader object is being built or pickled) and closed at interpreter exit.

Bulk reads go through the server's V5 range read (``TransactionRangeRequest``): one round trip returns up to
10,000 consecutive committed records as a *record run*, the bytes the storage node keeps, which the server
relays without decoding (:mod:`waltz.protocol.record_run`); this process verifies every checksum while
unpacking the run straight into Arrow columns. We chose the server over reading a storage replica directly
because:

* the server is the one place that knows the committed high-water mark and which replicas are clean in the
  current store session; a replica may hold an uncommitted or stale tail (or lag behind), so a direct read
  would need its own proof that the replica's records below the mark are the committed ones;
* storage ports carry the cluster key and are meant for servers and operators, not for every Spark executor;
* relaying a run costs the server one frame per request, not work per record, so the server is no longer the
  bottleneck: the per-record work (checksums, columns) happens in the tasks and scales with them.

``fetchDepth`` range requests are in flight per task, so the server and the storage node fetch the next runs
while the task unpacks this one.

The network side is the client's :class:`~waltz.client.reader.LogReader` (ZooKeeper discovery, one RPC
connection per server, retries on a moved partition within ``client.requestTimeout``); this module adds the
process-wide sharing, the read-ahead, the batch checks and ``fetchOffset.*`` retries on top.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import gc
import logging
import os
import threading
import time
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from waltz.client.reader import LogReader
from waltz.errors import ClientError, TrimmedError, WaltzError
from waltz.protocol.record_run import RecordRun
from waltz.runtime import new_event_loop, tune_malloc
from waltz.spark.options import SourceOptions

__all__ = ["ClusterLogSource", "close_all", "open_source"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Loop:
    """One daemon thread running an asyncio loop for this process's Waltz I/O."""

    def __init__(self) -> None:
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="waltz-spark-io", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        return self.submit(coro).result(timeout_s)


class ClusterLogSource:
    """A LogSource over a cluster (see the module docstring). Thread-safe; shared by a whole process."""

    def __init__(self, options: SourceOptions, io: _Loop) -> None:
        self._options = options
        self._io = io
        self._timeout_s = options.client_config.request_timeout_ms / 1000 + 5
        self._reader = LogReader(options.client_config)
        self._cluster_key: str | None = None  # read on first use: only planners need it
        self._io.run(
            self._reader.open(), self._timeout_s + options.client_config.zookeeper_session_timeout_ms / 1000
        )

    @property
    def cluster_name(self) -> str:
        return self._reader.cluster_name

    @property
    def cluster_key(self) -> str:
        if self._cluster_key is None:
            self._cluster_key = str(self._retrying("cluster key read", self._reader.cluster_key))
        return self._cluster_key

    @property
    def num_partitions(self) -> int:
        return self._reader.num_partitions

    def _retrying(self, what: str, make: Any) -> Any:
        attempts = self._options.fetch_num_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                return self._io.run(make(), self._timeout_s)
            except (TimeoutError, WaltzError) as e:
                retriable = not isinstance(e, WaltzError) or e.retriable
                if attempt == attempts or not retriable:
                    raise ClientError(f"{what} failed after {attempt} attempt(s): {e!r}") from e
                log.warning("%s failed (%r); retrying (%d/%d)", what, e, attempt, attempts - 1)
                time.sleep(self._options.fetch_retry_interval_ms / 1000)
        raise AssertionError("unreachable")  # pragma: no cover

    def high_water_marks(self, partitions: Sequence[int]) -> dict[int, int]:
        async def all_hwms() -> list[int]:
            return list(await asyncio.gather(*(self._reader.high_water_mark(p) for p in partitions)))

        values = self._retrying("high-water mark read", all_hwms)
        return dict(zip(partitions, values, strict=True))

    def read(self, partition: int, start: int, end: int) -> Iterator[RecordRun]:
        fetch = self._options.fetch_size
        pos = start  # the first id not yet yielded
        asked = start  # the first id not yet asked for
        # (first id, count asked, answer) of the requests in flight, in id order.
        pending: collections.deque[tuple[int, int, concurrent.futures.Future[RecordRun]]] = (
            collections.deque()
        )
        failures = 0
        try:
            while pos < end:
                # Several requests in flight: the server and the storage node fetch the next runs while the
                # caller unpacks this one.
                while len(pending) < self._options.fetch_depth and asked < end:
                    count = min(fetch, end - asked)
                    future = self._io.submit(self._reader.read_run(partition, asked, count))
                    pending.append((asked, count, future))
                    asked += count
                first, count, future = pending.popleft()
                try:
                    run: RecordRun | None = future.result(self._timeout_s)
                    problem = f"the server returned nothing at transaction {pos}, below the planned end {end}"
                except TrimmedError:
                    raise  # Final: the caller applies failOnDataLoss (waltz.spark.datasource).
                except (TimeoutError, WaltzError) as e:
                    run, problem = None, f"reading from transaction {pos} failed: {e!r}"
                if run is None or run.count == 0:
                    _cancel(pending)
                    asked = pos
                    failures += 1
                    if failures > self._options.fetch_num_retries:
                        raise ClientError(f"partition {partition}: {problem} ({failures} attempts)")
                    log.warning("partition %d: %s; retrying", partition, problem)
                    time.sleep(self._options.fetch_retry_interval_ms / 1000)
                    continue
                failures = 0
                pos = run.end
                if pos < first + count:
                    # Trimmed (a size limit, a segment end): the requests after it leave a gap; ask again.
                    _cancel(pending)
                    asked = pos
                yield run
        finally:
            _cancel(pending)

    def close(self) -> None:
        self._io.run(self._reader.close(), self._timeout_s)


def _cancel(pending: collections.deque[tuple[int, int, concurrent.futures.Future[RecordRun]]]) -> None:
    for _, _, future in pending:
        future.cancel()
    pending.clear()


_io: _Loop | None = None
_sources: dict[tuple[tuple[str, str], ...], ClusterLogSource] = {}
_sources_lock = threading.Lock()


def open_source(options: SourceOptions) -> ClusterLogSource:
    """The process-wide source for ``options``' cluster settings, opened on first use."""
    global _io
    key = (
        *options.cluster_key,
        ("fetch", f"{options.fetch_size}/{options.fetch_depth}"),
        ("retries", f"{options.fetch_num_retries}/{options.fetch_retry_interval_ms}"),
    )
    with _sources_lock:
        source = _sources.get(key)
        if source is None:
            if _io is None:
                _io = _Loop()
            source = ClusterLogSource(options, _io)
            _sources[key] = source
            _tune_reused_worker()
        return source


def _tune_reused_worker() -> bool:
    """In a PySpark worker that Spark reuses between tasks (``SPARK_REUSE_WORKER`` set; elsewhere -- a
    driver, tests, a plain process -- nothing changes), tune the process for bulk reads; returns whether it
    did.

    * ``gc.freeze()``: PySpark's daemon runs a full ``gc.collect()`` in the worker after every task. With
      the ~100,000 long-lived objects of a worker holding an open source (modules, PySpark's, pyarrow's and
      the client's), each took 50-200 ms of CPU and found nothing: two per query, as much as the rest of a
      100,000-row task. Frozen objects are still freed by reference counting; only a cycle among them would
      never be collected, and they are the process's long-lived state.
    * :func:`~waltz.runtime.tune_malloc`: every record run (~5 MB) is received into a new buffer; with
      glibc's defaults such buffers are mapped afresh and given back to the system each time, so every page
      of every run was faulted in (one fault per 4 KiB received, ~0.2 us of the task's ~1 us of CPU per
      row). The worker now keeps what its largest read needed (a few runs) mapped between runs.
    """
    if not os.environ.get("SPARK_REUSE_WORKER"):
        return False
    gc.freeze()
    tune_malloc()
    return True


def close_all() -> None:
    """Close every source this process opened (their ZooKeeper sessions and server connections)."""
    with _sources_lock:
        for source in _sources.values():
            try:
                source.close()
            except Exception:
                log.debug("closing a waltz source failed", exc_info=True)
        _sources.clear()


# The ZooKeeper client's threads are not daemons, and the interpreter joins non-daemon threads *before* it
# runs atexit handlers: close the sources from the hook that runs before that join (the one
# concurrent.futures uses), so a process that forgot close_all() still exits.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(close_all)
else:  # pragma: no cover - other interpreters
    atexit.register(close_all)

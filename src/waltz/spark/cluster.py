"""A :class:`~waltz.spark.source.LogSource` over a real Waltz cluster, shared per Python process.

Spark calls the data source from plain threads (planning workers, executor tasks, the long-lived streaming
source process), and reuses Python workers between tasks. So each process keeps **one** background asyncio
loop thread (``waltz-spark-io``) and one open reader per cluster configuration, created lazily on first use
(never while a reader object is being built or pickled) and closed at interpreter exit.

Bulk reads go through the server's V5 range read (``TransactionRangeRequest``): one round trip returns up to
10,000 consecutive committed records with their stored checksums, and the server never returns anything past
its committed high-water mark. We chose the server over reading a storage replica directly because:

* the server is the one place that knows the committed high-water mark; a storage replica may hold an
  uncommitted tail (or lag behind), so a replica read would need a separate high-water mark check and a
  fallback to another replica, and would bypass the server's transaction cache;
* storage admin ports carry the cluster key and are meant for operators, not for every Spark executor.

While the caller turns one batch into Arrow, the next range request is already in flight (one request of
read-ahead per task), so network and decoding overlap.

The network side is the client's :class:`~waltz.client.reader.LogReader` (ZooKeeper discovery, one RPC
connection per server, retries on a moved partition within ``client.requestTimeout``); this module adds the
process-wide sharing, the read-ahead, the batch checks and ``fetchOffset.*`` retries on top.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from waltz.client.reader import LogReader
from waltz.errors import ClientError, WaltzError
from waltz.protocol.records import Record
from waltz.spark.options import SourceOptions
from waltz.spark.source import check_batch

__all__ = ["ClusterLogSource", "close_all", "open_source"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Loop:
    """One daemon thread running an asyncio loop for this process's Waltz I/O."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
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
        self._io.run(
            self._reader.open(), self._timeout_s + options.client_config.zookeeper_session_timeout_ms / 1000
        )

    @property
    def cluster_name(self) -> str:
        return self._reader.cluster_name

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

    def read(self, partition: int, start: int, end: int) -> Iterator[Sequence[Record]]:
        fetch = self._options.fetch_size
        pos = start
        pending: concurrent.futures.Future[list[Record]] | None = None
        failures = 0
        try:
            while pos < end:
                if pending is None:
                    pending = self._io.submit(self._reader.read_range(partition, pos, min(fetch, end - pos)))
                try:
                    records = pending.result(self._timeout_s)
                except (TimeoutError, WaltzError) as e:
                    pending = None
                    failures += 1
                    if failures > self._options.fetch_num_retries:
                        raise ClientError(
                            f"partition {partition}: reading from transaction {pos} failed {failures} times: "
                            f"{e!r}"
                        ) from e
                    log.warning("partition %d: range read at %d failed (%r); retrying", partition, pos, e)
                    time.sleep(self._options.fetch_retry_interval_ms / 1000)
                    continue
                records = records[: end - pos]
                if not records:
                    pending = None
                    failures += 1
                    if failures > self._options.fetch_num_retries:
                        raise ClientError(
                            f"partition {partition}: the server returned nothing at transaction {pos}, "
                            f"below the planned end {end} (was the log restored from an older copy?)"
                        )
                    time.sleep(self._options.fetch_retry_interval_ms / 1000)
                    continue
                check_batch(partition, pos, records)
                pos += len(records)
                failures = 0
                # Read ahead: the next request is in flight while the caller converts this batch.
                pending = (
                    self._io.submit(self._reader.read_range(partition, pos, min(fetch, end - pos)))
                    if pos < end
                    else None
                )
                yield records
        finally:
            if pending is not None:
                pending.cancel()

    def close(self) -> None:
        self._io.run(self._reader.close(), self._timeout_s)


_io: _Loop | None = None
_sources: dict[tuple[tuple[str, str], ...], ClusterLogSource] = {}
_sources_lock = threading.Lock()


def open_source(options: SourceOptions) -> ClusterLogSource:
    """The process-wide source for ``options``' cluster settings, opened on first use."""
    global _io
    key = (
        *options.cluster_key,
        ("fetchSize", str(options.fetch_size)),
        ("retries", f"{options.fetch_num_retries}/{options.fetch_retry_interval_ms}"),
    )
    with _sources_lock:
        source = _sources.get(key)
        if source is None:
            if _io is None:
                _io = _Loop()
            source = ClusterLogSource(options, _io)
            _sources[key] = source
        return source


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

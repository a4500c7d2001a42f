"""Shared parts of the performance and validation tools: clients, contexts that report to the loop, results.

The tools run every simulated client as an :class:`~waltz.client.core.AsyncWaltzClient` on one event loop
(like the original tools' threads, each client has its own connections and feed). ``driver_factory`` returns
the driver of each new client: ``None`` for the network driver, a :class:`~waltz.testing.MockDriver` in tests.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from waltz.client.api import ClientCallbacks
from waltz.client.builder import TransactionBuilder
from waltz.client.config import ClientConfig
from waltz.client.context import TransactionContext
from waltz.client.core import AsyncWaltzClient
from waltz.client.driver import ClientDriver
from waltz.client.locks import PartitionLocalLock
from waltz.client.transaction import Transaction
from waltz.errors import ClientError

T = TypeVar("T")
DriverFactory = Callable[[], ClientDriver | None]
MAX_CLIENTS = 1000
MAX_TXN_BYTES = 16 * 1024 * 1024
COMPLETION_TIMEOUT_S = 300.0
"""How long a tool waits for its last transaction to complete before it reports a failure."""
STALL_TIMEOUT_S = 15.0
"""A run in which no append has committed for this long while some are outstanding stops with a clear error
(the cluster cannot take appends: no quorum of storage nodes, no server) instead of waiting for the end."""
PROGRESS_INTERVAL_S = 0.5


class Progress:
    """A run's outcomes as they happen (on the loop), for the live progress line and the stall check."""

    def __init__(self, total: int, done: str = "committed") -> None:
        self.total = total
        self.done = done  # What an outcome is called on the line: "committed", "read".
        self.committed = 0
        self.failed = 0
        self.started = time.perf_counter()
        self.last_change = self.started

    def note(self, ok: bool) -> None:
        if ok:
            self.committed += 1
        else:
            self.failed += 1
        self.last_change = time.perf_counter()

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return (
            f"{self.committed}/{self.total} {self.done}, {self.failed} failed, "
            f"{self.committed / elapsed:,.0f}/s, {elapsed:.1f} s"
        )

    def stalled_s(self) -> float:
        """Seconds without any outcome while appends are outstanding (0 when done)."""
        if self.committed + self.failed >= self.total:
            return 0.0
        return time.perf_counter() - self.last_change


ProgressLine = Callable[[str], None]
"""Shows the live progress line (the CLI draws it with rich; the library does not print)."""


async def watch(progress: Progress, show: ProgressLine | None, what: str = "appends") -> None:
    """Refresh the progress line through ``show`` (if given) and raise ClientError if the run stalls; runs
    until cancelled."""
    while True:
        await asyncio.sleep(PROGRESS_INTERVAL_S)
        if show is not None:
            show(progress.line())
        if progress.stalled_s() > STALL_TIMEOUT_S:
            raise ClientError(
                f"no {what} completed in the last {STALL_TIMEOUT_S:g} s ({progress.line()}): the cluster "
                "cannot take appends right now (is a quorum of storage nodes up and a server serving the "
                "partition? see 'waltz local status' or 'waltz cluster status')"
            )


def network_driver() -> ClientDriver | None:
    return None


class MarkCallbacks(ClientCallbacks):
    """Callbacks that start at given high-water marks and just track the marks (nothing is applied).

    ``on_apply`` (optional, a coroutine function) is awaited for every transaction on the client's event
    loop (``apply_transaction`` is a coroutine function: no thread hop), so it must not block: it reads a
    transaction's data with ``await transaction.fetch_transaction_data()``.
    """

    def __init__(
        self,
        start_marks: dict[int, int],
        on_apply: Callable[[Transaction], Awaitable[None]] | None = None,
    ) -> None:
        self.start_marks = dict(start_marks)
        self.marks = dict(start_marks)
        self.on_apply = on_apply
        self._lock = threading.Lock()

    def client_high_water_mark(self, partition_id: int) -> int:
        with self._lock:
            return self.marks.get(partition_id, -1)

    async def apply_transaction(self, transaction: Transaction) -> None:
        if self.on_apply is not None:
            await self.on_apply(transaction)
        with self._lock:
            self.marks[transaction.partition_id] = transaction.transaction_id

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        return None  # The tools report what they saw; a redelivery is not an error for them.


async def watched(
    work: Awaitable[T], progress: Progress, show: ProgressLine | None, what: str = "appends"
) -> T:
    """Await ``work`` under :func:`watch`: a live progress line, and the stall error if nothing completes."""
    watcher = asyncio.create_task(watch(progress, show, what))
    task = asyncio.ensure_future(work)
    try:
        both: list[asyncio.Future[Any]] = [watcher, task]
        done, _ = await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        if watcher in done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            watcher.result()  # Raises the stall error.
        return await task
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


class ReportingContext(TransactionContext):
    """A context that appends ``data`` to ``partition`` (optionally under one write lock) and resolves a
    future on the client's loop with ``(result, completion time)`` when it ends."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        partition: int,
        data: bytes | Callable[[TransactionBuilder], bytes],
        write_lock: PartitionLocalLock | None = None,
    ) -> None:
        super().__init__()
        self.loop = loop
        self.partition = partition
        self.data = data
        self.write_lock = write_lock
        self.executions = 0
        self.sent_at = 0.0
        self.done: asyncio.Future[tuple[bool, float]] = loop.create_future()
        self.progress: Progress | None = None

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    async def execute(self, builder: TransactionBuilder) -> bool:
        # A coroutine, as the hooks: with the client's defaults it runs on the loop, as an asyncio
        # application's does (a plain function would cross to a callback thread and back for each append).
        self.executions += 1
        data = self.data(builder) if callable(self.data) else self.data
        builder.set_transaction_data(data)
        if self.write_lock is not None:
            builder.set_write_locks([self.write_lock])
        return True

    def _resolve(self, result: bool | BaseException) -> None:
        """On the client's loop: the hooks are coroutine functions, which the client awaits there."""
        if self.done.done():
            return
        if self.progress is not None:
            self.progress.note(result is True)
        if isinstance(result, BaseException):
            self.done.set_exception(result)
            self.done.exception()  # Read by submit_and_settle, or never: no "never retrieved" noise.
        else:
            self.done.set_result((result, time.perf_counter()))

    async def on_completion(self, result: bool) -> None:
        self._resolve(result)

    async def on_exception(self, exception: BaseException) -> None:
        self._resolve(exception)


@dataclass
class Settled:
    """How a run of contexts ended: the committed ones with their completion times, failures and retries."""

    committed: list[tuple[ReportingContext, float]] = field(default_factory=list)
    failed: int = 0
    retries: int = 0


async def submit_and_settle(
    client: AsyncWaltzClient,
    contexts: Iterable[ReportingContext],
    interval_ms: float = 0.0,
    progress: Progress | None = None,
) -> Settled:
    """Submit each context in turn (pausing ``interval_ms`` between submits), then wait for every outcome.

    A refused submit, an exception or a context not done within COMPLETION_TIMEOUT_S counts as failed;
    retries are executions beyond the first. ``sent_at`` is set when ``submit`` returned (the append was
    sent; waiting for room, the client-side congestion, is excluded from latency as in the original tool).
    """
    out = Settled()
    submitted: list[ReportingContext] = []
    for ctx in contexts:
        ctx.progress = progress
        try:
            await client.submit(ctx)
        except ClientError:
            out.failed += 1
            if progress is not None and not ctx.done.done():
                progress.note(False)
            continue
        ctx.sent_at = time.perf_counter()
        submitted.append(ctx)
        if interval_ms:
            await asyncio.sleep(interval_ms / 1000)
    for ctx in submitted:
        done = ctx.done
        try:
            if not done.done():  # (most are, by the time the last one was submitted: no timer for those)
                async with asyncio.timeout(COMPLETION_TIMEOUT_S):
                    await done
            ok, finished_at = done.result()
        except (ClientError, TimeoutError):
            out.failed += 1
            continue
        out.retries += ctx.executions - 1
        if ok:
            out.committed.append((ctx, finished_at))
        else:
            out.failed += 1
    return out


async def start_client(
    callbacks: ClientCallbacks, config: ClientConfig, driver_factory: DriverFactory
) -> AsyncWaltzClient:
    client = AsyncWaltzClient(callbacks, config, driver=driver_factory())
    try:
        await client.start()
    except BaseException:
        await client.close()
        raise
    return client


async def current_marks(config: ClientConfig, driver_factory: DriverFactory) -> tuple[dict[int, int], int]:
    """({partition: high-water mark}, partition count) read by a short-lived client that mounts nothing."""
    probe = await start_client(MarkCallbacks({}), config.replace(auto_mount=False), driver_factory)
    try:
        n = probe.num_partitions
        # high_water_mark raises for a partition that is not served: never printed as an empty one (-1).
        marks = {p: await probe.high_water_mark(p) for p in range(n)}
        return marks, n
    finally:
        await probe.close()


async def close_all(clients: Sequence[AsyncWaltzClient]) -> None:
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


def active_partitions(requested: int | None, num_partitions: int) -> list[int]:
    if requested is None:
        return list(range(num_partitions))
    if not 1 <= requested <= num_partitions:
        raise ClientError(
            f"--partitions must be between 1 and the cluster's {num_partitions}, got {requested}"
        )
    return list(range(requested))


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (0.0 for none)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


@dataclass
class PerfResult:
    """What ``waltz perf`` prints. Latencies in milliseconds."""

    mode: str
    transactions: int
    txn_size_bytes: int
    seconds: float
    retries: int = 0
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    failed: int = 0
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def megabytes(self) -> float:
        return self.transactions * self.txn_size_bytes / 1_000_000

    def to_json(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ms)
        out: dict[str, Any] = {
            "mode": self.mode,
            **self.parameters,
            "transactions": self.transactions,
            "failed": self.failed,
            "megabytes": round(self.megabytes, 3),
            "seconds": round(self.seconds, 3),
            "transactions_per_second": round(self.transactions / self.seconds, 1) if self.seconds else 0.0,
            "megabytes_per_second": round(self.megabytes / self.seconds, 3) if self.seconds else 0.0,
        }
        if self.mode == "producer":
            out["retries_per_transaction"] = (
                round(self.retries / self.transactions, 3) if self.transactions else 0
            )
            out["latency_ms"] = {
                "p50": round(percentile(lat, 50), 2),
                "p95": round(percentile(lat, 95), 2),
                "p99": round(percentile(lat, 99), 2),
                "max": round(lat[-1], 2) if lat else 0.0,
            }
        return out

    def render(self) -> str:
        j = self.to_json()
        verb = "appended" if self.mode == "producer" else "read"
        lines = [
            f"transactions {verb}: {j['transactions']}" + (f" ({self.failed} failed)" if self.failed else ""),
            f"MB {verb}: {j['megabytes']:.3f}",
            f"seconds: {j['seconds']:.3f}",
            f"transactions/s: {j['transactions_per_second']:.1f}",
            f"MB/s: {j['megabytes_per_second']:.3f}",
        ]
        if self.mode == "producer":
            lat = j["latency_ms"]
            lines += [
                f"retries/transaction: {j['retries_per_transaction']:.3f}",
                f"latency ms: p50 {lat['p50']:.2f}  p95 {lat['p95']:.2f}  "
                f"p99 {lat['p99']:.2f}  max {lat['max']:.2f}",
            ]
        return "\n".join(lines)

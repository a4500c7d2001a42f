"""``waltz perf producer`` and ``waltz perf consumer``: append and read throughput and latency.

Producer: ``clients`` clients each append ``txns_per_client`` transactions of ``txn_size_bytes`` random bytes
to random partitions among the first ``partitions``; with ``lock_pool_size`` K > 0 each transaction takes a
write lock on a random id below K (so concurrent transactions conflict and are retried). Each client submits
in a loop, so up to ``client.maxConcurrentTransactions`` appends per partition are in flight, optionally
pausing ``interval_ms`` between submits. Latency runs from the moment ``submit`` returned (the append was
sent: waiting for room, the client-side congestion, is excluded as in the original tool) to
``on_completion(True)``; retries are executions beyond the first. Clients start at the partitions' current
high-water marks, so earlier runs on the same cluster do not slow a run down. ``max_in_flight`` (if set)
replaces ``client.maxConcurrentTransactions`` for the run, to measure pipelined throughput.

Consumer: first appends ``num_txns`` transactions (untimed, a few producer clients, no locks), then
``clients`` fresh clients mount at the marks before those appends and each reads them all, fetching every
transaction's data; the time runs from the consumers' start to the last transaction read by the last one.

Both run their clients with the configuration as given (the client's defaults unless the file says
otherwise), on the path an asyncio application gets from coroutine callbacks: ``execute``, the hooks and
``apply_transaction`` are ``async def``, so the client awaits them on its event loop (the consumer's awaits
``fetch_transaction_data``), on uvloop when the CLI finds it, with a live progress line and the stall
check.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

from waltz.client.config import ClientConfig
from waltz.client.core import AsyncWaltzClient
from waltz.client.locks import PartitionLocalLock
from waltz.client.transaction import Transaction
from waltz.errors import ClientError, ClientTimeoutError, ConfigError
from waltz.perf.common import (
    COMPLETION_TIMEOUT_S,
    MAX_CLIENTS,
    MAX_TXN_BYTES,
    DriverFactory,
    MarkCallbacks,
    PerfResult,
    Progress,
    ProgressLine,
    ReportingContext,
    active_partitions,
    close_all,
    current_marks,
    network_driver,
    start_client,
    submit_and_settle,
    watched,
)

LOCK_NAME = "perf"
CONSUMER_LOAD_CLIENTS = 4


@dataclass(frozen=True)
class ProducerOptions:
    txn_size_bytes: int = 512
    txns_per_client: int = 1000
    clients: int = 1
    interval_ms: float = 0.0
    lock_pool_size: int = 0
    partitions: int | None = None
    seed: int | None = None
    max_in_flight: int | None = None

    def validate(self) -> None:
        if not 1 <= self.txn_size_bytes <= MAX_TXN_BYTES:
            raise ConfigError(f"--txn-size must be between 1 and {MAX_TXN_BYTES}, got {self.txn_size_bytes}")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ConfigError(f"--max-in-flight must be positive, got {self.max_in_flight}")
        if self.txns_per_client < 1:
            raise ConfigError(f"--txns-per-client must be positive, got {self.txns_per_client}")
        if not 1 <= self.clients <= MAX_CLIENTS:
            raise ConfigError(f"--clients must be between 1 and {MAX_CLIENTS}, got {self.clients}")
        if self.interval_ms < 0 or self.lock_pool_size < 0:
            raise ConfigError("--interval-ms and --lock-pool-size must not be negative")


async def _produce(
    client: AsyncWaltzClient,
    opts: ProducerOptions,
    partitions: list[int],
    rng: random.Random,
    result: PerfResult,
    progress: Progress | None = None,
) -> None:
    loop = asyncio.get_running_loop()

    def contexts() -> Iterator[ReportingContext]:
        for _ in range(opts.txns_per_client):
            lock = (
                PartitionLocalLock(LOCK_NAME, rng.randrange(opts.lock_pool_size))
                if opts.lock_pool_size
                else None
            )
            yield ReportingContext(loop, rng.choice(partitions), rng.randbytes(opts.txn_size_bytes), lock)

    settled = await submit_and_settle(client, contexts(), opts.interval_ms, progress)
    result.failed += settled.failed
    result.retries += settled.retries
    result.transactions += len(settled.committed)
    result.latencies_ms.extend((finished_at - ctx.sent_at) * 1000 for ctx, finished_at in settled.committed)


async def run_producers(
    config: ClientConfig,
    opts: ProducerOptions,
    driver_factory: DriverFactory = network_driver,
    *,
    show_progress: ProgressLine | None = None,
) -> PerfResult:
    """Run the producer benchmark (see the module docstring) and return its figures.

    The clients run with ``config`` as given: the tool's hooks are coroutine functions that only note
    outcomes, run on the loop, the fast path of an asyncio application. ``show_progress`` is called with a
    progress line twice a second. A run in which nothing commits for
    :data:`~waltz.perf.common.STALL_TIMEOUT_S` stops with a ClientError saying so.
    """
    opts.validate()
    if opts.max_in_flight is not None:
        config = config.replace(max_concurrent_transactions=opts.max_in_flight)
    marks, n = await current_marks(config, driver_factory)
    partitions = active_partitions(opts.partitions, n)
    rng = random.Random(opts.seed)
    result = PerfResult(
        "producer",
        0,
        opts.txn_size_bytes,
        0.0,
        parameters={
            "clients": opts.clients,
            "txns_per_client": opts.txns_per_client,
            "txn_size": opts.txn_size_bytes,
            "lock_pool_size": opts.lock_pool_size,
            "partitions": len(partitions),
            "interval_ms": opts.interval_ms,
            "max_in_flight": config.max_concurrent_transactions,
        },
    )
    clients: list[AsyncWaltzClient] = []
    try:
        for _ in range(opts.clients):
            clients.append(await start_client(MarkCallbacks(marks), config, driver_factory))  # noqa: PERF401 - closed on failure
        started = time.perf_counter()
        progress = Progress(opts.clients * opts.txns_per_client)
        producers = asyncio.gather(
            *(_produce(c, opts, partitions, random.Random(rng.random()), result, progress) for c in clients)
        )
        await watched(producers, progress, show_progress)
        result.seconds = time.perf_counter() - started
    finally:
        await close_all(clients)
    return result


@dataclass(frozen=True)
class ConsumerOptions:
    txn_size_bytes: int = 512
    num_txns: int = 10000
    clients: int = 1
    partitions: int | None = None
    seed: int | None = None

    def validate(self) -> None:
        if not 1 <= self.txn_size_bytes <= MAX_TXN_BYTES:
            raise ConfigError(f"--txn-size must be between 1 and {MAX_TXN_BYTES}, got {self.txn_size_bytes}")
        if self.num_txns < 1:
            raise ConfigError(f"--num-txns must be positive, got {self.num_txns}")
        if not 1 <= self.clients <= MAX_CLIENTS:
            raise ConfigError(f"--clients must be between 1 and {MAX_CLIENTS}, got {self.clients}")


async def _load_log(
    config: ClientConfig, opts: ConsumerOptions, driver_factory: DriverFactory
) -> tuple[dict[int, int], int]:
    """Append the consumers' ``opts.num_txns`` transactions; return the high-water marks before them (what
    the consumers start from) and how many were appended."""
    marks, n = await current_marks(config, driver_factory)
    # The most load clients (up to CONSUMER_LOAD_CLIENTS) that split num_txns evenly, so exactly num_txns
    # transactions are appended and read.
    load_clients = max(c for c in range(1, CONSUMER_LOAD_CLIENTS + 1) if opts.num_txns % c == 0)
    per_client = opts.num_txns // load_clients
    load = await run_producers(
        config,
        ProducerOptions(
            txn_size_bytes=opts.txn_size_bytes,
            txns_per_client=per_client,
            clients=load_clients,
            partitions=opts.partitions,
            seed=opts.seed,
        ),
        driver_factory,
    )
    if load.failed:
        raise ClientError(
            f"loading the log failed: {load.failed} of {load.transactions + load.failed} appends"
        )
    end_marks, _ = await current_marks(config, driver_factory)
    expected = sum(end_marks[p] - marks[p] for p in range(n))
    return marks, expected


async def run_consumers(
    config: ClientConfig,
    opts: ConsumerOptions,
    driver_factory: DriverFactory = network_driver,
    *,
    show_progress: ProgressLine | None = None,
) -> PerfResult:
    """Run the consumer benchmark (see the module docstring) and return its figures.

    The consumers' ``apply_transaction`` is a coroutine function, run on the event loop, that awaits the
    transaction's data (no callback thread). ``show_progress`` is called with a progress line twice a
    second; a run in which no transaction is read for
    :data:`~waltz.perf.common.STALL_TIMEOUT_S` stops with a ClientError saying so.
    """
    opts.validate()
    marks, expected = await _load_log(config, opts, driver_factory)
    progress = Progress(expected * opts.clients, "read")
    done_events: list[asyncio.Event] = []
    read_bytes = [0]

    def make_callbacks() -> _ReadingCallbacks:
        event = asyncio.Event()
        done_events.append(event)
        return _ReadingCallbacks(marks, expected, event, progress, read_bytes)

    consumer_config = config
    clients: list[AsyncWaltzClient] = []
    try:
        started = time.perf_counter()
        progress.started = progress.last_change = started
        for _ in range(opts.clients):
            clients.append(await start_client(make_callbacks(), consumer_config, driver_factory))  # noqa: PERF401 - closed on failure

        async def all_read() -> None:
            try:
                async with asyncio.timeout(COMPLETION_TIMEOUT_S):
                    await asyncio.gather(*(e.wait() for e in done_events))
            except TimeoutError:
                raise ClientTimeoutError(
                    f"consumers did not read the {expected} transactions within {COMPLETION_TIMEOUT_S:g} s"
                ) from None

        await watched(all_read(), progress, show_progress, "reads")
        seconds = time.perf_counter() - started
    finally:
        await close_all(clients)
    return PerfResult(
        "consumer",
        expected * opts.clients,
        opts.txn_size_bytes,
        seconds,
        parameters={"clients": opts.clients, "num_txns": expected, "txn_size": opts.txn_size_bytes},
    )


class _ReadingCallbacks(MarkCallbacks):
    """A consumer's callbacks (coroutines, on the loop): every transaction's data is fetched and counted."""

    def __init__(
        self,
        start_marks: dict[int, int],
        expected: int,
        done: asyncio.Event,
        progress: Progress,
        read_bytes: list[int],
    ) -> None:
        super().__init__(start_marks)
        self._expected = expected
        self._count = 0
        self._done = done
        self._progress = progress
        self._read_bytes = read_bytes

    async def apply_transaction(self, transaction: Transaction) -> None:
        data = await transaction.fetch_transaction_data()
        self._read_bytes[0] += len(data)
        self.marks[transaction.partition_id] = transaction.transaction_id
        self._progress.note(True)
        self._count += 1
        if self._count == self._expected:
            self._done.set()

"""``waltz client validate``: a serializability check of the whole path client -> server -> storage -> feed.

Every client appends, ``txns_per_client`` times, a transaction whose data is its high-water mark of the
partition plus one (8 bytes, big-endian), under **one** write lock shared by all clients. The lock means a
transaction commits only if no other transaction committed after the mark it read, so the transaction that
commits must be exactly the next one: its value must equal its own transaction id. Every client checks every
transaction it receives from the feed:

* ids arrive in order with no gap and no duplicate (``transaction id X after Y``);
* each value equals its transaction id (``transaction X carries value V``);
* at the end, every client has received every transaction up to the partition's high-water mark, and the
  number of transactions added to each partition equals the number the clients saw committed.

Clients start at the partitions' current high-water marks (earlier contents of the log are not checked).
"""

from __future__ import annotations

import asyncio
import random
import struct
import threading
import time
from dataclasses import dataclass, field

from waltz.client.builder import TransactionBuilder
from waltz.client.config import ClientConfig
from waltz.client.core import AsyncWaltzClient
from waltz.client.locks import PartitionLocalLock
from waltz.client.transaction import Transaction
from waltz.errors import ConfigError
from waltz.perf.common import (
    COMPLETION_TIMEOUT_S,
    MAX_CLIENTS,
    DriverFactory,
    MarkCallbacks,
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

VALUE = struct.Struct(">q")
SHARED_LOCK = PartitionLocalLock("validate", 0)
MAX_VIOLATIONS_KEPT = 100


@dataclass(frozen=True)
class ValidateOptions:
    txns_per_client: int = 100
    clients: int = 2
    interval_ms: float = 0.0
    partitions: int | None = None
    seed: int | None = None

    def validate(self) -> None:
        if self.txns_per_client < 1:
            raise ConfigError(f"--txns-per-client must be positive, got {self.txns_per_client}")
        if not 1 <= self.clients <= MAX_CLIENTS:
            raise ConfigError(f"--clients must be between 1 and {MAX_CLIENTS}, got {self.clients}")
        if self.interval_ms < 0:
            raise ConfigError("--interval-ms must not be negative")


@dataclass
class ValidationReport:
    clients: int
    committed: int = 0
    failed: int = 0
    retries: int = 0
    seconds: float = 0.0
    start_marks: dict[int, int] = field(default_factory=dict)
    end_marks: dict[int, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    violation_count: int = 0

    @property
    def ok(self) -> bool:
        return self.violation_count == 0

    def violation(self, text: str) -> None:
        self.violation_count += 1
        if len(self.violations) < MAX_VIOLATIONS_KEPT:
            self.violations.append(text)

    def render(self) -> str:
        added = sum(self.end_marks[p] - self.start_marks.get(p, -1) for p in self.end_marks)
        lines = [
            f"{self.clients} clients committed {self.committed} transactions in {self.seconds:.2f} s "
            f"({self.retries} retries, {self.failed} failed); the log grew by {added}",
            f"high-water marks: {self.start_marks} -> {self.end_marks}",
        ]
        if self.ok:
            lines.append("OK: every client received every transaction in order, each value equal to its id")
        else:
            lines.append(f"VALIDATION FAILED: {self.violation_count} violations")
            lines += [f"  - {v}" for v in self.violations]
            if self.violation_count > len(self.violations):
                lines.append(f"  ... and {self.violation_count - len(self.violations)} more")
        return "\n".join(lines)


class _Checker:
    """Checks one client's feed (called on the client's callback threads, one per partition at a time)."""

    def __init__(self, index: int, start_marks: dict[int, int], report: ValidationReport) -> None:
        self.index = index
        self.last = dict(start_marks)
        self.report = report
        self.lock = threading.Lock()

    def __call__(self, transaction: Transaction) -> None:
        self.check(transaction, transaction.get_transaction_data())

    def check(self, transaction: Transaction, data: bytes) -> None:
        p, tid = transaction.partition_id, transaction.transaction_id
        with self.lock:
            last = self.last.get(p, -1)
            if tid != last + 1:
                self.report.violation(
                    f"client {self.index} partition {p}: transaction id {tid} after {last} "
                    f"({'gap' if tid > last + 1 else 'duplicate or out of order'})"
                )
            if len(data) != VALUE.size:
                self.report.violation(
                    f"client {self.index} partition {p}: transaction {tid} carries {len(data)} bytes, not 8"
                )
            else:
                (value,) = VALUE.unpack(data)
                if value != tid:
                    self.report.violation(
                        f"client {self.index} partition {p}: transaction {tid} carries value {value} "
                        "(its writer's high-water mark + 1): not serializable"
                    )
            self.last[p] = max(last, tid)


class _CheckingCallbacks(MarkCallbacks):
    """Feeds every transaction to a :class:`_Checker`, on the client's loop (a coroutine
    ``apply_transaction``): the data is fetched with ``await``, no thread hop."""

    def __init__(self, start_marks: dict[int, int], checker: _Checker) -> None:
        super().__init__(start_marks)
        self.checker = checker

    async def apply_transaction(self, transaction: Transaction) -> None:
        self.checker.check(transaction, await transaction.fetch_transaction_data())
        with self._lock:
            self.marks[transaction.partition_id] = transaction.transaction_id


def _next_value(builder: TransactionBuilder) -> bytes:
    return VALUE.pack(builder.client_high_water_mark + 1)


async def run_validation(
    config: ClientConfig,
    opts: ValidateOptions,
    driver_factory: DriverFactory = network_driver,
    *,
    show_progress: ProgressLine | None = None,
) -> ValidationReport:
    """Run the check (see the module docstring); violations are in the report, never raised. The clients run
    their callbacks on the loop (coroutines: the fast path); a run in which nothing completes for
    :data:`~waltz.perf.common.STALL_TIMEOUT_S` raises ClientError, and ``show_progress`` is called with a
    progress line twice a second."""
    opts.validate()
    marks, n = await current_marks(config, driver_factory)
    partitions = active_partitions(opts.partitions, n)
    report = ValidationReport(opts.clients, start_marks=dict(marks))
    rng = random.Random(opts.seed)
    checkers = [_Checker(i, marks, report) for i in range(opts.clients)]
    clients: list[AsyncWaltzClient] = []
    loop = asyncio.get_running_loop()
    progress = Progress(opts.clients * opts.txns_per_client)

    async def produce(client: AsyncWaltzClient, crng: random.Random) -> None:
        contexts = (
            ReportingContext(loop, crng.choice(partitions), _next_value, SHARED_LOCK)
            for _ in range(opts.txns_per_client)
        )
        settled = await submit_and_settle(client, contexts, opts.interval_ms, progress)
        report.failed += settled.failed
        report.retries += settled.retries
        report.committed += len(settled.committed)

    try:
        for checker in checkers:
            clients.append(await start_client(_CheckingCallbacks(marks, checker), config, driver_factory))  # noqa: PERF401 - closed on failure
        started = time.perf_counter()
        producers = asyncio.gather(*(produce(c, random.Random(rng.random())) for c in clients))
        await watched(producers, progress, show_progress)
        report.seconds = time.perf_counter() - started
        end_marks = {p: await clients[0].high_water_mark(p) for p in range(n)}
        report.end_marks = end_marks
        deadline = time.monotonic() + COMPLETION_TIMEOUT_S
        for checker in checkers:
            while any(checker.last.get(p, -1) < end_marks[p] for p in range(n)):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            for p in range(n):
                got = checker.last.get(p, -1)
                if got < end_marks[p]:
                    report.violation(
                        f"client {checker.index} partition {p}: received transactions up to {got}, "
                        f"but the partition's high-water mark is {end_marks[p]}"
                    )
    finally:
        await close_all(clients)
    added = sum(report.end_marks.get(p, -1) - marks[p] for p in range(n))
    if report.end_marks and added != report.committed:
        report.violation(
            f"the clients saw {report.committed} transactions committed but the log grew by {added} "
            "(another writer, or a lost or duplicated transaction)"
        )
    return report

"""Failover drills on a ``waltz local`` cluster under load: how long partitions go unserved after a fault,
and what an application appending meanwhile sees.

    .venv/bin/python -m bench.failover [--scenario server-kill] [--zk-session-timeout-ms 2000 30000]
        [--zookeepers 3] [--repeat 3] [--rate 200]

For each session timeout given, starts a local cluster (3 storage nodes, 2 servers, 4 partitions), runs one
client submitting distinct transactions at ``--rate`` per second with up to ``--window`` in flight, injects
the fault and reports, per run: the time from the fault until every partition is served again (``/health``
of the live servers, polled every 20 ms), submits that failed (raised or ended unsuccessfully), the longest
wait of one submit until its acknowledgement, and whether every acknowledged transaction is in the log once.

Scenarios: ``server-kill`` (SIGKILL a server owning partitions; it is started again after the run),
``zk-leader-kill`` (SIGKILL the ensemble's leader; needs ``--zookeepers 3``), ``quorum-loss`` (SIGKILL two
of three members for ``--outage-s``, then start them again).

The drill functions (:class:`Load`, :func:`kill_server`, ...) are what tests/integration/test_failover.py
runs. Wall-clock figures: meaningful on an idle machine only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from waltz import local
from waltz.client.config import ClientConfig
from waltz.client.core import AsyncWaltzClient
from waltz.client.transaction import Transaction
from waltz.cluster import zkserver
from waltz.errors import ClientError, WaltzError
from waltz.local import probe, procs
from waltz.local.state import LocalCluster
from waltz.perf.common import MarkCallbacks, ReportingContext, current_marks, network_driver

POLL_S = 0.02
SERVED_TIMEOUT_S = 60.0


@dataclass
class LoadReport:
    """What the application saw."""

    submitted: int = 0
    acked: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    """The first few failures, as the application saw them."""
    longest_wait_s: float = 0.0
    """The longest time from calling submit until the transaction was acknowledged."""
    missing: int = 0
    """Acknowledged transactions not (yet) seen in the log at the end."""
    duplicated: int = 0
    """Transactions seen in the log more than once."""


class Load:
    """One client appending distinct transactions (``tag:<n>``) round robin over the partitions, up to
    ``window`` in flight, one submit every ``1 / rate`` seconds; it also applies every transaction of the log
    it reads, so that :meth:`stop` can check that each acknowledged one is there exactly once."""

    def __init__(self, config: ClientConfig, *, rate: float = 200.0, window: int = 20) -> None:
        self.config = config
        self.rate = rate
        self.window = window
        self.report = LoadReport()
        self._seen: collections.Counter[bytes] = collections.Counter()
        self._seen_lock = threading.Lock()
        self._acked: set[bytes] = set()
        self._client: AsyncWaltzClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._settles: set[asyncio.Task[None]] = set()
        self._progress = asyncio.Event()  # Set at each acknowledgement.

    async def _on_apply(self, txn: Transaction) -> None:
        data = await txn.fetch_transaction_data()
        if data.startswith(b"tag:"):
            with self._seen_lock:
                self._seen[data] += 1

    async def start(self) -> None:
        marks, self._partitions = await current_marks(self.config, network_driver)
        self._client = AsyncWaltzClient(MarkCallbacks(marks, self._on_apply), self.config)
        await self._client.start()
        self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def acked(self) -> int:
        return self.report.acked

    async def _run(self) -> None:
        assert self._client is not None
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(self.window)
        n = 0
        while True:
            await slots.acquire()
            tag = f"tag:{n}".encode()
            ctx = ReportingContext(loop, n % self._partitions, tag)
            n += 1
            started = time.monotonic()
            try:
                await self._client.submit(ctx)
            except ClientError as e:
                slots.release()
                self._fail(repr(e))
                continue
            self.report.submitted += 1
            task = loop.create_task(self._settle(ctx, tag, started, slots))
            self._settles.add(task)
            task.add_done_callback(self._settles.discard)
            await asyncio.sleep(1 / self.rate)

    def _fail(self, error: str) -> None:
        self.report.failed += 1
        if len(self.report.errors) < 5:
            self.report.errors.append(error)

    async def _settle(
        self, ctx: ReportingContext, tag: bytes, started: float, slots: asyncio.Semaphore
    ) -> None:
        try:
            ok, _ = await ctx.done
        except ClientError as e:
            self._fail(repr(e))
            return
        finally:
            slots.release()
        if not ok:
            self._fail(f"{tag.decode()} ended unsuccessfully")
            return
        self.report.acked += 1
        self._progress.set()
        self._acked.add(tag)
        self.report.longest_wait_s = max(self.report.longest_wait_s, time.monotonic() - started)

    async def wait_acked(self, count: int, timeout_s: float) -> None:
        """Wait until ``count`` more transactions than now are acknowledged (appends continue)."""
        target = self.report.acked + count
        async with asyncio.timeout(timeout_s):
            while self.report.acked < target:
                self._progress.clear()
                await self._progress.wait()

    async def stop(self, settle_s: float = 30.0) -> LoadReport:
        """Stop submitting, wait up to ``settle_s`` for what is in flight and for the log to show every
        acknowledged transaction, close the client and return the report."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            if self._settles:
                await asyncio.wait(set(self._settles), timeout=settle_s)
            deadline = time.monotonic() + settle_s
            # The log reaches _on_apply on the client's event loop: polled, not awaited.
            while time.monotonic() < deadline and self._missing():  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        finally:
            for task in self._settles:
                task.cancel()
            if self._client is not None:
                await self._client.close()
        with self._seen_lock:
            self.report.duplicated = sum(1 for c in self._seen.values() if c > 1)
        self.report.missing = len(self._missing())
        return self.report

    def _missing(self) -> set[bytes]:
        with self._seen_lock:
            return {t for t in self._acked if t not in self._seen}


def served(cluster: LocalCluster) -> set[int]:
    found: set[int] = set()
    for rec in cluster.servers:
        if procs.is_alive(rec.process):
            found |= probe.served_partitions(rec.http_port)
    return found


async def wait_all_served(
    cluster: LocalCluster, since_s: float, timeout_s: float = SERVED_TIMEOUT_S
) -> float:
    """Seconds from ``since_s`` (monotonic) until the live servers serve every partition."""
    wanted = set(range(cluster.num_partitions))
    deadline = time.monotonic() + timeout_s
    while not wanted <= await asyncio.to_thread(served, cluster):
        if time.monotonic() > deadline:
            raise WaltzError(f"partitions were not served again within {timeout_s:g} s")
        await asyncio.sleep(POLL_S)
    return time.monotonic() - since_s


async def kill_server(directory: Path) -> float:
    """SIGKILL a server that owns partitions; seconds until every partition is served again."""
    cluster = LocalCluster.load(directory)
    victim = next(i for i, s in enumerate(cluster.servers) if probe.served_partitions(s.http_port))
    t0 = time.monotonic()
    await asyncio.to_thread(local.kill, directory, "server", victim)
    return await wait_all_served(LocalCluster.load(directory), t0)


def zk_leader(cluster: LocalCluster) -> int:
    """The index of the ensemble member that is the leader now."""
    for rec in cluster.zookeepers:
        if procs.is_alive(rec.process) and "Mode: leader" in zkserver.four_letter_word(
            "127.0.0.1", rec.port, "srvr"
        ):
            return rec.index
    raise WaltzError("the ensemble has no leader")


async def kill_zk_leader(directory: Path) -> tuple[int, float]:
    """SIGKILL the ensemble's leader; its index and the seconds until every partition is served (checked
    after a new leader is elected: the servers' sessions must not have expired)."""
    cluster = LocalCluster.load(directory)
    leader = zk_leader(cluster)
    t0 = time.monotonic()
    await asyncio.to_thread(local.kill, directory, "zookeeper", leader)
    return leader, await wait_all_served(LocalCluster.load(directory), t0)


async def lose_quorum(directory: Path, outage_s: float, during: float = 0.0) -> list[int]:
    """SIGKILL a majority of the ensemble (the leader first), wait ``outage_s``, start them again and wait
    until they serve. Returns the members killed."""
    cluster = LocalCluster.load(directory)
    leader = zk_leader(cluster)
    others = [z.index for z in cluster.zookeepers if z.index != leader]
    victims = [leader, *others[: len(cluster.zookeepers) // 2]]
    for index in victims:
        await asyncio.to_thread(local.kill, directory, "zookeeper", index)
    await asyncio.sleep(outage_s)
    for index in victims:
        await asyncio.to_thread(local.start, directory, "zookeeper", index)
    return victims


async def drill(directory: Path, scenario: str, rate: float, outage_s: float) -> dict[str, object]:
    config = ClientConfig.from_yaml(directory / "client.yaml")
    load = Load(config, rate=rate)
    await load.start()
    await load.wait_acked(100, 30)
    result: dict[str, object] = {"scenario": scenario}
    try:
        if scenario == "server-kill":
            result["unserved_s"] = round(await kill_server(directory), 2)
        elif scenario == "zk-leader-kill":
            leader, unserved_s = await kill_zk_leader(directory)
            result["leader"], result["unserved_s"] = leader, round(unserved_s, 2)
        else:
            result["killed"] = await lose_quorum(directory, outage_s)
        await load.wait_acked(200, 60)  # Appends continue.
    finally:
        result.update(asdict(await load.stop()))
    return result


def restore(directory: Path) -> None:
    """Start whatever a drill killed, and wait until every partition is served."""
    cluster = LocalCluster.load(directory)
    for rec in cluster.zookeepers:
        if not procs.is_alive(rec.process):
            local.start(directory, "zookeeper", rec.index)
    for rec in cluster.servers:
        if not procs.is_alive(rec.process):
            local.start(directory, "server", rec.index)
    asyncio.run(wait_all_served(LocalCluster.load(directory), time.monotonic()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--scenario", choices=("server-kill", "zk-leader-kill", "quorum-loss"), default="server-kill"
    )
    parser.add_argument(
        "--zk-session-timeout-ms", type=int, nargs="+", default=[local.DEFAULT_ZK_SESSION_TIMEOUT_MS]
    )
    parser.add_argument("--zookeepers", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rate", type=float, default=200.0, help="submits per second")
    parser.add_argument("--outage-s", type=float, default=4.0, help="quorum-loss: how long")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    for logger in ("kazoo", "waltz.cluster.zk"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    for session_ms in args.zk_session_timeout_ms:
        with tempfile.TemporaryDirectory(prefix="waltz-failover-") as tmp:
            directory = Path(tmp) / "cluster"
            opts = local.UpOptions(
                directory=directory, zookeepers=args.zookeepers, zk_session_timeout_ms=session_ms
            )
            local.up(opts)
            try:
                for _ in range(args.repeat):
                    result = asyncio.run(drill(directory, args.scenario, args.rate, args.outage_s))
                    print(json.dumps({"zk_session_timeout_ms": session_ms, **result}), flush=True)
                    restore(directory)
            finally:
                local.down(directory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

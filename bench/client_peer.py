"""The client library against a real cluster, through the public API only (the peer-comparison workload).

Starts a ``waltz local`` cluster (ZooKeeper, 3 storage nodes, 1 server, 1 partition) in a temporary
directory, runs the phases below in this process with one :class:`~waltz.AsyncWaltzClient` (and one
:class:`~waltz.WaltzClient` for ``sync8``), then stops the cluster. Every record is 512 bytes.

=========  ==================================================================================================
phase      what it measures
=========  ==================================================================================================
seq        one append at a time; latency = submit to ``on_completion(True)``
conc       64 coroutines appending, each waiting for its own ``on_completion`` (64 outstanding)
occ1       one at a time with a write lock, waiting for ``on_application``
occ64      64 writers, each with a write lock on its own key, each waiting for its own ``on_application``
hot64      64 writers with a write lock on ONE key (a counter); successes = committed appends; latency =
           submit to ``on_application`` including retries; prints the fewest successes of one writer
read1      ``high_water_mark`` one at a time
read64     ``high_water_mark`` from 64 coroutines
sync8      :class:`~waltz.WaltzClient` driven from 8 threads (each submits; completions are counted)
partitions many partitions against few, the same total in flight (``--in-flight``, default 80 = 4 x 20):
           rounds of ``p4`` (the coroutines spread over partitions 0-3) and ``pN`` (over all ``--partitions``,
           default 256) alternate ``--rounds`` times on one cluster of N partitions; then the median ratio.
           Not run unless asked for (its cluster has N partitions)
clients    ``--clients`` processes (default 32) with ``--client-in-flight`` appends in flight each (default 8)
           against one process with all of them in flight: aggregate rate, per-process min/mean/max
           (``bench/clients.py``). Not run unless asked for (it starts 33 interpreters)
=========  ==================================================================================================

Each phase stops after ``--count`` operations or ``--seconds``, whichever comes first, after a short warm-up.
Per phase it prints ops/s, p50/p99 latency, client CPU per op (this process: ``time.process_time``; its
system share in brackets), server CPU per op (server + storage processes, from ``/proc/<pid>/stat``) and
the appends per committed batch (from the server's ``waltz_server_store_batch_appends`` histogram: each batch
is a request to every storage node), and the storage nodes' append requests and group-commit fsyncs per op.
The load average and a CPU gauge (milliseconds for a fixed pure-Python workload, lower is a faster
machine) are printed at the start and the end. The application's hooks and ``apply_transaction`` are
coroutine functions (``--plain``: plain functions, which the default ``client.callbackMode`` runs on the
callback threads, handing results to the loop with ``call_soon_threadsafe``); ``--mode`` sets
``client.callbackMode`` (default: the client's default), ``--max-concurrent``
``client.maxConcurrentTransactions`` (default: the client's default), ``--loop`` the application's event
loop (uvloop, the default, or the standard asyncio loop).

    .venv/bin/python bench/client_peer.py                       # every phase, the client's defaults
    .venv/bin/python bench/client_peer.py --plain --phase conc --phase seq
    .venv/bin/python bench/client_peer.py --phase partitions --partitions 256 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from bench.client_app import PAYLOAD, AsyncCallbacks, AsyncCtx, Callbacks, Ctx  # noqa: E402
from bench.procstat import total_cpu_s  # noqa: E402

from waltz import (  # noqa: E402
    AsyncWaltzClient,
    ClientConfig,
    TransactionBuilder,
    TransactionContext,
    WaltzClient,
)
from waltz.cluster import zk as zkutil  # noqa: E402
from waltz.local import cluster as local  # noqa: E402
from waltz.local import configs  # noqa: E402
from waltz.local.probe import http_get  # noqa: E402
from waltz.ops.features import raise_features as raise_features_of  # noqa: E402

WARMUP_S = 1.0
PHASES = ("seq", "conc", "occ1", "occ64", "hot64", "read1", "read64", "sync8")
OTHER_PHASES = ("partitions", "clients")
"""Run only when named: their cluster differs from the one of :data:`PHASES`."""
FEW_PARTITIONS = 4
"""The few partitions of the ``partitions`` phase (``--few``)."""


def _metrics(http_port: int) -> str:
    """A node's Prometheus text (``GET /metrics`` on its HTTP port)."""
    return http_get(http_port, "/metrics")[1].decode()


def batch_histogram(http_port: int | None) -> dict[str, float]:
    """The server's ``waltz_server_store_batch_appends`` histogram (appends per committed batch, every
    partition): ``{le: cumulative count, "sum": appends}``; empty if it has none (an older server)."""
    if http_port is None:
        return {}
    text = _metrics(http_port)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("waltz_server_store_batch_appends_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[le] = out.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("waltz_server_store_batch_appends_sum{"):
            out["sum"] = out.get("sum", 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def storage_counts(http_ports: list[int]) -> tuple[float, float, float, float, float]:
    """Group-commit fsyncs, append request frames (AppendRequests alone and MultiAppendRequests), fsyncs run
    in a thread, hand-offs of fsyncs to a thread and syncfs calls of every storage node
    (``waltz_storage_fsyncs_total``, ``waltz_storage_requests_total`` of append types,
    ``waltz_storage_fsyncs_in_thread_total``, ``waltz_storage_fsync_handoffs_total``: a node without it hands
    each fsync off alone, so its fsyncs in a thread count; ``waltz_storage_fsync_syncfs_total``: each stands
    for the fsyncs of a batch), summed."""
    fsyncs = requests = threaded = handoffs = syncfs = 0.0
    for port in http_ports:
        text = _metrics(port)
        node_handoffs = node_threaded = None
        for line in text.splitlines():
            if line.startswith("waltz_storage_fsyncs_total "):
                fsyncs += float(line.rsplit(" ", 1)[1])
            elif line.startswith("waltz_storage_fsyncs_in_thread_total "):
                node_threaded = float(line.rsplit(" ", 1)[1])
            elif line.startswith("waltz_storage_fsync_handoffs_total "):
                node_handoffs = float(line.rsplit(" ", 1)[1])
            elif line.startswith("waltz_storage_fsync_syncfs_total "):
                syncfs += float(line.rsplit(" ", 1)[1])
            elif line.startswith("waltz_storage_requests_total{") and "append" in line.lower():
                # Request frames: an append inside a MultiAppendRequest is counted as an AppendRequest too.
                sign = -1.0 if 'type="AppendInMultiAppend"' in line else 1.0
                requests += sign * float(line.rsplit(" ", 1)[1])
        threaded += node_threaded or 0.0
        handoffs += node_handoffs if node_handoffs is not None else node_threaded or 0.0
    return fsyncs, requests, threaded, handoffs, syncfs


def batch_note(before: dict[str, float], after: dict[str, float]) -> str:
    """Appends per committed batch over a phase, from two :func:`batch_histogram` readings: the mean and the
    batches per bucket (``<=8: 12`` = 12 batches of 5 to 8 appends)."""
    if not after:
        return ""
    batches = after["+Inf"] - before.get("+Inf", 0.0)
    if not batches:
        return ""
    mean = (after["sum"] - before.get("sum", 0.0)) / batches
    parts, below = [], 0.0
    for le, count in after.items():
        if le == "sum":
            continue
        n = count - before.get(le, 0.0) - below
        below += n
        if n:
            parts.append(f"<={le.removesuffix('.0')}: {n:.0f}")
    return f"appends/batch {mean:.1f} over {batches:.0f} batches ({', '.join(parts)})"


@dataclass
class Result:
    phase: str
    ops: int
    seconds: float
    latencies_s: list[float]
    client_cpu_s: float
    client_sys_s: float
    server_cpu_s: float
    note: str = ""
    storage_requests: float = 0.0
    """Append requests the storage nodes received during the phase (all nodes)."""
    fsyncs: float = 0.0
    """Group-commit fsyncs the storage nodes ran during the phase (all nodes)."""

    @property
    def rate(self) -> float:
        return self.ops / self.seconds

    @property
    def p99_s(self) -> float:
        lat = sorted(self.latencies_s)
        return lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else float("nan")

    def line(self) -> str:
        lat = sorted(self.latencies_s)
        p50 = statistics.median(lat) * 1000 if lat else float("nan")
        p99 = self.p99_s * 1000
        per_op = 1e6 / max(self.ops, 1)
        return (
            f"{self.phase:7} {self.ops / self.seconds:9.0f} ops/s  p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  "
            f"client {self.client_cpu_s * per_op:6.1f} us/op (sys {self.client_sys_s * per_op:4.1f})  "
            f"server {self.server_cpu_s * per_op:6.1f} us/op"
            f"  ({self.ops} ops in {self.seconds:.1f} s){'  ' + self.note if self.note else ''}"
        )


class Bench:
    def __init__(
        self,
        args: argparse.Namespace,
        client: AsyncWaltzClient,
        pids: list[int],
        http_port: int | None,
        storage_http_ports: list[int],
    ) -> None:
        self.args = args
        self.client = client
        self.pids = pids
        self.http_port = http_port
        self.storage_http_ports = storage_http_ports
        self.inline = args.mode == "inline"
        self.ctx_type = Ctx if args.plain else AsyncCtx
        self.loop = asyncio.get_running_loop()

    async def one(
        self, lock: int | None = None, wait_apply: bool = False, header: int = 0, partition: int = 0
    ) -> bool:
        future: asyncio.Future[bool] = self.loop.create_future()

        def done(ok: bool) -> None:
            if not future.done():
                future.set_result(ok)

        await self.client.submit(
            self.ctx_type(self.loop, self.inline, done, lock, wait_apply, header, partition)
        )
        return await future

    async def workers(
        self, phase: str, n: int, op: Callable[[int], Awaitable[bool]], per_worker: list[int] | None = None
    ) -> Result:
        """``n`` coroutines each running ``op(worker)`` in a loop; warm-up, then measure."""
        latencies: list[float] = []
        count = 0
        measuring = False
        stop = False
        deadline = self.loop.time() + WARMUP_S + self.args.seconds

        async def worker(w: int) -> None:
            nonlocal count, stop
            while not stop:
                t0 = time.perf_counter()
                ok = await op(w)
                if measuring and ok:
                    latencies.append(time.perf_counter() - t0)
                    count += 1
                    if per_worker is not None:
                        per_worker[w] += 1
                    if count >= self.args.count or self.loop.time() > deadline:
                        stop = True

        tasks = [asyncio.create_task(worker(w)) for w in range(n)]
        await asyncio.sleep(WARMUP_S)
        # The server's /metrics grows with its partitions (0.9 MB at 256): read off the loop, and skipped
        # with many partitions (its histogram is read while the phase runs, skewing the counts per op).
        http_port = self.http_port if self.args.partitions <= FEW_PARTITIONS else None
        h0 = await asyncio.to_thread(batch_histogram, http_port)
        f0, r0, x0, o0, y0 = await asyncio.to_thread(storage_counts, self.storage_http_ports)
        measuring = True
        # The server process alone too (the first pid; the rest are the storage nodes).
        w0 = total_cpu_s(self.pids[:1])
        c0, k0, s0, t0 = time.process_time(), os.times().system, total_cpu_s(self.pids), time.perf_counter()
        while not stop and not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
            if self.loop.time() > deadline + 30:
                stop = True  # A stuck phase ends (and says so through its count).
        elapsed = time.perf_counter() - t0
        c1, k1, s1 = time.process_time(), os.times().system, total_cpu_s(self.pids)
        w1 = total_cpu_s(self.pids[:1])
        f1, r1, x1, o1, y1 = await asyncio.to_thread(storage_counts, self.storage_http_ports)
        h1 = await asyncio.to_thread(batch_histogram, http_port)
        note = batch_note(h0, h1)
        if count:
            note += f"; server process alone {(w1 - w0) * 1e6 / count:.1f} us/op"
            note += f"; storage append requests/op {(r1 - r0) / count:.3f}, fsyncs/op {(f1 - f0) / count:.3f}"
            if f1 > f0:
                note += f" ({100 * (x1 - x0) / (f1 - f0):.0f}% in a thread)"
            note += f", hand-offs to a thread/op {(o1 - o0) / count:.3f}, syncfs/op {(y1 - y0) / count:.3f}"
        await asyncio.wait(tasks, timeout=30)
        return Result(phase, count, elapsed, latencies, c1 - c0, k1 - k0, s1 - s0, note, r1 - r0, f1 - f0)

    async def run(self, phase: str) -> Result:
        if phase == "seq":
            return await self.workers(phase, 1, lambda w: self.one())
        if phase == "conc":
            return await self.workers(phase, 64, lambda w: self.one())
        if phase == "occ1":
            return await self.workers(phase, 1, lambda w: self.one(lock=0, wait_apply=True))
        if phase == "occ64":
            return await self.workers(phase, 64, lambda w: self.one(lock=w + 1, wait_apply=True))
        if phase == "hot64":
            per_worker = [0] * 64
            result = await self.workers(
                phase, 64, lambda w: self.one(lock=1_000_000, wait_apply=True, header=1), per_worker
            )
            result.note = f"fewest successes of one writer: {min(per_worker)}; {result.note}"
            return result
        if phase in ("read1", "read64"):

            async def read(w: int) -> bool:
                await self.client.high_water_mark(0)
                return True

            return await self.workers(phase, 1 if phase == "read1" else 64, read)
        raise ValueError(phase)

    async def partitions(self) -> list[Result]:
        """Rounds of ``p4`` and ``pN`` alternating (see the module docstring), each printed as it ends."""
        many = self.args.partitions
        in_flight = self.args.in_flight
        results: list[Result] = []
        for _ in range(self.args.rounds):
            for spread in (self.args.few, many):
                result = await self.workers(
                    f"p{spread}", in_flight, lambda w, spread=spread: self.one(partition=w % spread)
                )
                print(result.line(), flush=True)
                results.append(result)
        return results


def sync8(args: argparse.Namespace, config: ClientConfig, pids: list[int]) -> Result:
    """WaltzClient from 8 threads, each submitting in a loop (bounded by client.maxConcurrentTransactions)."""
    callbacks = Callbacks()
    lock = threading.Lock()
    sent: dict[int, float] = {}
    latencies: list[float] = []
    committed = [0]

    class SyncCtx(TransactionContext):
        def __init__(self, key: int) -> None:
            super().__init__()
            self.key = key

        def partition_id(self, num_partitions: int) -> int:
            return 0

        def execute(self, builder: TransactionBuilder) -> bool:
            builder.set_transaction_data(PAYLOAD)
            return True

        def on_completion(self, result: bool) -> None:
            with lock:
                t0 = sent.pop(self.key, None)
                if result and t0 is not None:
                    committed[0] += 1
                    latencies.append(time.perf_counter() - t0)

    with WaltzClient(callbacks, config) as client:
        stop = threading.Event()
        keys = iter(range(1 << 62))

        def thread_main() -> None:
            while not stop.is_set():
                with lock:
                    key = next(keys)
                    sent[key] = time.perf_counter()
                client.submit(SyncCtx(key))

        threads = [threading.Thread(target=thread_main) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(WARMUP_S)
        with lock:
            n0 = committed[0]
            latencies.clear()
        c0, k0, s0, t0 = time.process_time(), os.times().system, total_cpu_s(pids), time.perf_counter()
        deadline = t0 + args.seconds
        while time.perf_counter() < deadline and committed[0] - n0 < args.count:
            time.sleep(0.05)
        elapsed = time.perf_counter() - t0
        c1, k1, s1 = time.process_time(), os.times().system, total_cpu_s(pids)
        with lock:
            n = committed[0] - n0
            lat = list(latencies)
        stop.set()
        for t in threads:
            t.join()
        client.flush_transactions(30)
    return Result("sync8", n, elapsed, lat, c1 - c0, k1 - k0, s1 - s0)


async def main_async(
    args: argparse.Namespace,
    config: ClientConfig,
    pids: list[int],
    http_port: int | None,
    storage_http_ports: list[int],
) -> list[Result]:
    results: list[Result] = []
    async with AsyncWaltzClient(Callbacks() if args.plain else AsyncCallbacks(), config) as client:
        bench = Bench(args, client, pids, http_port, storage_http_ports)
        for phase in args.phase:
            if phase in ("sync8", "clients"):
                continue
            if phase == "partitions":
                rounds = await bench.partitions()
                print(partitions_summary(rounds, args.few, args.partitions), flush=True)
                results.extend(rounds)
                continue
            result = await bench.run(phase)
            print(result.line(), flush=True)
            results.append(result)
        await client.flush_transactions(30)
    return results


def partitions_summary(results: list[Result], few_n: int, many: int) -> str:
    """The ``partitions`` phase's verdict: medians over its rounds of ``pN`` against ``p4``."""
    few = [r for r in results if r.phase == f"p{few_n}"]
    lots = [r for r in results if r.phase == f"p{many}"]

    def median(rs: list[Result], f: Callable[[Result], float]) -> float:
        return statistics.median(f(r) for r in rs)

    def per_op(value: Callable[[Result], float]) -> Callable[[Result], float]:
        return lambda r: value(r) / max(r.ops, 1)

    rate = median(lots, lambda r: r.rate) / median(few, lambda r: r.rate)
    p99 = median(lots, lambda r: r.p99_s) / median(few, lambda r: r.p99_s)
    cpu = [median(rs, per_op(lambda r: r.server_cpu_s)) * 1e6 for rs in (few, lots)]
    fsyncs = [median(rs, per_op(lambda r: r.fsyncs)) for rs in (few, lots)]
    requests = [median(rs, per_op(lambda r: r.storage_requests)) for rs in (few, lots)]
    return (
        f"partitions: p{many}/p{few_n}, medians of {len(few)} rounds: rate {rate:.2f}x, "
        f"p99 {p99:.2f}x; "
        f"server+storage CPU {cpu[0]:.0f} -> {cpu[1]:.0f} us/op, storage append requests/op "
        f"{requests[0]:.3f} -> {requests[1]:.3f}, fsyncs/op {fsyncs[0]:.3f} -> {fsyncs[1]:.3f}"
    )


def raise_features(cluster: local.LocalCluster, target: int | None) -> None:
    """Raise the new cluster's feature version (``waltz cluster raise-features``): every process runs this
    release, and what its newest feature version allows (several partitions' appends in one storage request
    from 3 on) is what the figures are about."""
    client = configs.zk_connect(cluster, 10_000)
    try:
        old, new = raise_features_of(client, cluster.cluster_root, target, configs.admin_ssl(cluster))
    finally:
        zkutil.close(client)
    print(f"cluster feature version {old} -> {new}", flush=True)


def cpu_gauge_ms() -> float:
    """Milliseconds for a fixed pure-Python workload (best of 3): the machine's own speed, independent of
    Waltz. This VM's speed swings by ~1.6x within minutes with nothing else running; printed at the start
    and the end of a run so that its figures can be read against it."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i
        table = {i: i * 2 for i in range(100_000)}
        total += len(table)
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("auto", "inline", "threads"), help="client.callbackMode")
    parser.add_argument("--plain", action="store_true", help="plain-function callbacks (see above)")
    parser.add_argument(
        "--phase",
        action="append",
        choices=PHASES + OTHER_PHASES,
        help=f"repeatable; default: {', '.join(PHASES)}",
    )
    parser.add_argument(
        "--partitions", type=int, help="the cluster's partitions (default 1; 256 with `partitions`)"
    )
    parser.add_argument("--in-flight", type=int, default=80, help="appends in flight in `partitions`")
    parser.add_argument(
        "--few", type=int, default=FEW_PARTITIONS, help="the few partitions of `partitions` (default 4)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of p4 and pN in `partitions`")
    parser.add_argument("--clients", type=int, default=32, help="client processes in `clients`")
    parser.add_argument("--client-in-flight", type=int, default=8, help="appends in flight per process")
    parser.add_argument("--count", type=int, default=100_000, help="operations per phase at most")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per phase at most")
    parser.add_argument("--max-concurrent", type=int, help="client.maxConcurrentTransactions")
    parser.add_argument("--profile", help="write a cProfile of the async phases to this file")
    parser.add_argument(
        "--features", type=int, help="raise the cluster's feature version to this (default: the newest)"
    )
    parser.add_argument(
        "--loop", choices=("uvloop", "asyncio"), default="uvloop", help="the application's event loop"
    )
    args = parser.parse_args()
    args.phase = args.phase or list(PHASES)
    if args.partitions is None:
        args.partitions = 256 if "partitions" in args.phase else 1
    # Every process of the run (client, server, storage nodes) runs this interpreter, and its build matters as
    # much as the code: an optimised build (Debian's python3.11) takes far less CPU per append than a default
    # source build (pyenv's); see docs/operations.md.
    print(f"python {platform.python_version()} ({sys.executable}; {platform.python_build()[1]})", flush=True)
    print(f"load average at start: {os.getloadavg()}; cpu gauge {cpu_gauge_ms():.0f} ms", flush=True)
    with tempfile.TemporaryDirectory(prefix="waltz-client-peer-") as tmp:
        opts = local.UpOptions(
            directory=Path(tmp) / "cluster", storages=3, servers=1, partitions=args.partitions
        )
        cluster = local.up(opts)
        try:
            raise_features(cluster, args.features)
            pids = [r.pid for r in [*cluster.servers, *cluster.storages] if r.pid is not None]
            http_port = cluster.servers[0].http_port
            storage_http_ports = [r.http_port for r in cluster.storages]
            config = ClientConfig.from_yaml(
                Path(cluster.directory) / "client.yaml",
                {
                    key: value
                    for key, value in (
                        ("client.maxConcurrentTransactions", args.max_concurrent),
                        ("client.callbackMode", args.mode),
                    )
                    if value is not None
                },
            )
            if args.profile:
                import cProfile

                # CPU time of the loop's thread (the client's work in inline mode), not wall time: a wall
                # clock charges waits for the GIL and the kernel's scheduling to whatever ran last.
                profiler = cProfile.Profile(time.thread_time)
                profiler.enable()
            if args.loop == "uvloop":
                import uvloop

                uvloop.run(main_async(args, config, pids, http_port, storage_http_ports))
            else:
                asyncio.run(main_async(args, config, pids, http_port, storage_http_ports))
            if args.profile:
                profiler.disable()
                profiler.dump_stats(args.profile)
            if "sync8" in args.phase:
                print(sync8(args, config, pids).line(), flush=True)
            if "clients" in args.phase:
                from bench import clients

                clients.run(
                    Path(cluster.directory) / "client.yaml",
                    args.clients,
                    args.client_in_flight,
                    args.seconds,
                    args.mode,
                    args.max_concurrent,
                    pids,
                    http_port,
                )
        finally:
            local.down(cluster.directory, purge=True)
    print(f"load average at end: {os.getloadavg()}; cpu gauge {cpu_gauge_ms():.0f} ms", flush=True)


if __name__ == "__main__":
    main()

"""Memory under sustained load: a local cluster at full load for a while, every process's RSS sampled.

Starts ZooKeeper, three storage nodes and ``--servers`` servers (real processes, as ``append_e2e.py`` does)
with ``--partitions`` partitions, and one load generator process per partition appending 512-byte
transactions through the raw client protocol, ``--in-flight`` (64) unanswered at a time, for ``--seconds``.
Every ``--sample-s`` it reads each process's resident set size (``VmRSS`` of ``/proc/<pid>/status``) and the
number of committed transactions (the storage nodes' max transaction ids), and prints one table row.

At the end it prints a verdict per server and storage node: the least-squares slope of its RSS against the
number of transactions written, over the samples after ``--warmup-s`` (the caches fill then), in bytes per
transaction, and ``flat`` when the slope is below ``--max-slope`` (bytes per transaction), else ``GROWING``.
The exit status is 1 when any server or storage node grows. The load generators and ZooKeeper are shown
but not judged (a load generator keeps a little per append; ZooKeeper is the JVM's business).

    .venv/bin/python bench/soak.py                                  # one hour, judged after 10 minutes
    .venv/bin/python bench/soak.py --seconds 660 --warmup-s 360 --sample-s 20
    .venv/bin/python bench/soak.py --seconds 300 -S server.feedCacheSize=8388608 \\
        -S server.transactionDataCacheSize=16777216                  # small caches: short warm-up
    .venv/bin/python bench/soak.py --keep-last 3000000   # trim every minute: disk stays bounded
    .venv/bin/python bench/soak.py --seconds 300 --tracemalloc /tmp/tm   # where does a server's memory go

With the default caches (``server.feedCacheSize`` 64 MiB, about 2.2 million transactions of headers, and
``server.transactionDataCacheSize`` 128 MiB) a server's warm-up lasts until the feed cache is full: at
2,000 transactions/s about 18 minutes, at 8,000/s about 5. Smaller caches shorten it (``-S``), which is
how a short run can still judge the steady state.

``--tracemalloc DIR`` (diagnosis): each server starts tracing allocations at the end of the warm-up and
writes a ``tracemalloc`` snapshot to ``DIR/<server>-<n>.snap`` at every later sample (through a
``sitecustomize`` hook and SIGUSR2: the server's code is not changed), and the script prints the top
allocation sites that grew between the first and the last snapshot. Tracing slows the server and costs
memory itself: do not read the RSS of such a run as a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.procstat import rss_bytes  # noqa: E402
from tests.integration.raw_client import RawClient  # noqa: E402
from tests.integration.server_process import Cluster  # noqa: E402

from waltz.cluster import zk as zkutil  # noqa: E402
from waltz.cluster.store_metadata import read_partition_assignment  # noqa: E402
from waltz.cluster.zkserver import ZooKeeperServer  # noqa: E402
from waltz.errors import WaltzError  # noqa: E402
from waltz.ops.trim import trim_partition  # noqa: E402

RECORD_BYTES = 512
MIB = 1024 * 1024

_HOOK = """\
import os, signal, tracemalloc
_dir = os.environ.get("WALTZ_SOAK_TRACEMALLOC")
if _dir:
    _n = [0]
    def _on_usr2(signum, frame):
        if not tracemalloc.is_tracing():
            tracemalloc.start(8)
            return
        _n[0] += 1
        tracemalloc.take_snapshot().dump(os.path.join(_dir, f"{os.getpid()}-{_n[0]:04d}.snap"))
    signal.signal(signal.SIGUSR2, _on_usr2)
"""


# ----------------------------------------------------------------------------------------- load generator


async def _load(endpoint: str, client_id: int, partition: int, seconds: float, in_flight: int) -> int:
    host, port, generation = endpoint.split(":")
    client = RawClient(
        None,
        client_id,
        partition=partition,
        endpoint=(host, int(port), int(generation)),
        max_in_flight=in_flight,
        keep_data=False,
        keep_latencies=False,
        keep_log=False,
    )
    await client.start()
    payload = bytes(RECORD_BYTES)
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    i = 0
    try:
        while loop.time() < end:
            await client.append(payload)
            i += 1
            if i % 256 == 0:
                await client.drain()
        await client.wait_idle(30.0)
        return client.stats.acknowledged
    finally:
        await client.aclose()


def load_main(args: argparse.Namespace) -> None:
    import uvloop

    acked = uvloop.run(_load(args.load, args.client_id, args.partition, args.seconds, args.in_flight))
    print(json.dumps({"acked": acked}), flush=True)


# ------------------------------------------------------------------------------------------------- driver


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against ``xs`` (0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return 0.0 if den == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


async def _committed(cluster: Cluster) -> int:
    """Transactions written so far, all partitions: the first storage node's max ids + 1."""
    async with await cluster.admin(cluster.storages[0]) as admin:
        parts = json.loads(await admin.metrics_json())["partitions"]
    return sum(max(0, int(p["maxTransactionId"]) + 1) for p in parts.values())


async def _endpoints(cluster: Cluster, zk: Any, partitions: int) -> list[str]:
    by_id = {s.server_id: s for s in cluster.servers}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assignment, _ = read_partition_assignment(zk, cluster.root)
        gens = assignment.generations()
        owners = [assignment.owner_of(p) for p in range(partitions)]
        if all(p in gens for p in range(partitions)) and all(o is not None and o in by_id for o in owners):
            return [f"127.0.0.1:{by_id[o].port}:{gens[p]}" for p, o in enumerate(owners) if o is not None]
        await asyncio.sleep(0.2)
    raise SystemExit("partitions were never assigned")


def _start_loads(endpoints: list[str], args: argparse.Namespace) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--load",
                endpoint,
                "--partition",
                str(p),
                "--client-id",
                str(p + 1),
                "--seconds",
                str(args.seconds),
                "--in-flight",
                str(args.in_flight),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for p, endpoint in enumerate(endpoints)
    ]


def _config(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"zookeeper.sessionTimeout": 10000}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


async def driver(args: argparse.Namespace, base: Path) -> int:
    zks = ZooKeeperServer(base / "zk")
    zks.start()
    cluster: Cluster | None = None
    zk = None
    loads: list[subprocess.Popen[str]] = []
    try:
        zk = zkutil.connect(zks.connect_string, session_timeout_ms=10000)
        cluster = Cluster(
            base, zk, zks.connect_string, num_partitions=args.partitions, server_config=_config(args.set)
        )
        await cluster.start(storages=3, servers=args.servers)
        endpoints = await _endpoints(cluster, zk, args.partitions)
        procs = {f"server-{i}": s.pid for i, s in enumerate(cluster.servers, 1)}
        procs.update({f"storage-{i}": s.pid for i, s in enumerate(cluster.storages, 1)})
        judged = list(procs)
        if zks.pid:
            procs["zookeeper"] = zks.pid
        loads = _start_loads(endpoints, args)
        procs.update({f"load-{p}": proc.pid for p, proc in enumerate(loads)})
        samples = await _sample(cluster, procs, loads, args)
        for proc in loads:
            proc.communicate(timeout=120)
            if proc.returncode != 0:
                raise SystemExit(f"a load generator failed (exit {proc.returncode})")
        return _verdict(samples, judged, args)
    finally:
        for proc in loads:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if cluster is not None:
            cluster.stop()
        if zk is not None:
            zkutil.close(zk)
        zks.stop()


async def _sample(
    cluster: Cluster, procs: dict[str, int], loads: list[subprocess.Popen[str]], args: argparse.Namespace
) -> list[tuple[float, int, dict[str, int]]]:
    """Sample every process's RSS until the load generators finish: ``(seconds, committed, {name: rss})``."""
    print(f"{'t s':>6} {'txns':>10} {'txn/s':>7} " + " ".join(f"{n:>10}" for n in procs) + "   (RSS MiB)")
    samples: list[tuple[float, int, dict[str, int]]] = []
    start = time.monotonic()
    tracing = False
    trimmed_at = 0.0
    while True:
        elapsed = time.monotonic() - start
        committed = await _committed(cluster)
        rss = {name: rss_bytes(pid) for name, pid in procs.items()}
        rate = (committed - samples[-1][1]) / max(elapsed - samples[-1][0], 1e-9) if samples else 0.0
        samples.append((elapsed, committed, rss))
        row = " ".join(f"{rss[n] / MIB:10.1f}" for n in procs)
        print(f"{elapsed:6.0f} {committed:10d} {rate:7.0f} {row}", flush=True)
        if args.tracemalloc and elapsed >= args.warmup_s:
            for server in cluster.servers:
                os.kill(server.pid, signal.SIGUSR2)  # the first starts tracing, later ones write snapshots
            tracing = True
        if all(proc.poll() is not None for proc in loads):
            break
        if args.keep_last and elapsed - trimmed_at >= args.trim_every_s:
            trimmed_at = elapsed
            await _trim(cluster, args)
        await asyncio.sleep(args.sample_s)
    if tracing:
        _tracemalloc_report(Path(args.tracemalloc), [s.pid for s in cluster.servers])
    return samples


async def _trim(cluster: Cluster, args: argparse.Namespace) -> None:
    """Keep the last ``--keep-last`` transactions of every partition (``waltz cluster trim --keep-last
    --grace-ms 0``: in force at once, so the disk stays bounded)."""
    for partition in range(args.partitions):
        try:
            outcome = await asyncio.to_thread(
                trim_partition, cluster.zk, cluster.root, partition, keep_last=args.keep_last, grace_ms=0
            )
            print(f"       trim: {outcome.message}", flush=True)
        except WaltzError as e:
            print(f"       trim of partition {partition} refused: {e}", flush=True)


def _verdict(
    samples: list[tuple[float, int, dict[str, int]]], judged: list[str], args: argparse.Namespace
) -> int:
    steady = [s for s in samples if s[0] >= args.warmup_s]
    if len(steady) < 3:
        print(f"verdict: too few samples after the {args.warmup_s:.0f} s warm-up to judge")
        return 1
    first, last = steady[0], steady[-1]
    txns = last[1] - first[1]
    print(
        f"after the {args.warmup_s:.0f} s warm-up: {len(steady)} samples over {last[0] - first[0]:.0f} s, "
        f"{txns} transactions ({txns / max(last[0] - first[0], 1e-9):.0f}/s); "
        f"{last[1]} transactions in all"
    )
    growing = False
    xs = [float(s[1]) for s in steady]
    for name in judged:
        ys = [float(s[2][name]) for s in steady]
        b = slope(xs, ys)
        bad = b >= args.max_slope
        growing |= bad
        print(
            f"  {name:10s} RSS {first[2][name] / MIB:7.1f} -> {last[2][name] / MIB:7.1f} MiB "
            f"(max {max(ys) / MIB:7.1f}), slope {b:6.2f} bytes/txn: {'GROWING' if bad else 'flat'}"
        )
    print(f"verdict: {'GROWING' if growing else 'flat'} (threshold {args.max_slope} bytes/txn)")
    return 1 if growing else 0


def _tracemalloc_report(directory: Path, pids: list[int]) -> None:
    for pid in pids:
        snaps = sorted(directory.glob(f"{pid}-*.snap"))
        if len(snaps) < 2:
            print(f"tracemalloc: fewer than two snapshots of server pid {pid}")
            continue
        old = tracemalloc.Snapshot.load(str(snaps[0]))
        new = tracemalloc.Snapshot.load(str(snaps[-1]))
        print(f"tracemalloc, server pid {pid}: growth from {snaps[0].name} to {snaps[-1].name}")
        for stat in new.compare_to(old, "traceback")[:8]:
            print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+8d} blocks")
            for line in stat.traceback.format(limit=4):
                print(f"      {line}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3600.0, help="how long the load runs")
    parser.add_argument("--sample-s", type=float, default=15.0, help="seconds between two samples")
    parser.add_argument("--warmup-s", type=float, default=600.0, help="samples before this are not judged")
    parser.add_argument("--max-slope", type=float, default=1.0, help="bytes per transaction judged growing")
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument(
        "-S", "--set", action="append", default=[], metavar="KEY=VALUE", help="a server config key"
    )
    parser.add_argument(
        "--keep-last", type=int, default=0, help="trim every partition to its last N transactions (0: never)"
    )
    parser.add_argument("--trim-every-s", type=float, default=60.0, help="seconds between two trims")
    parser.add_argument("--dir", default=None, help="where to put the temporary cluster (default /tmp)")
    parser.add_argument("--tracemalloc", default=None, metavar="DIR", help="snapshots of the servers")
    parser.add_argument("--load", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--partition", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--client-id", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        load_main(args)
        return
    # SIGTERM (e.g. from timeout(1)) unwinds like Ctrl-C, so every process started is stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    base = Path(tempfile.mkdtemp(prefix="waltz-soak-", dir=args.dir))
    if args.tracemalloc:
        directory = Path(args.tracemalloc).resolve()
        directory.mkdir(parents=True, exist_ok=True)
        hook = base / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(_HOOK)
        os.environ["WALTZ_SOAK_TRACEMALLOC"] = str(directory)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(hook), str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
    try:
        status = asyncio.run(driver(args, base))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    sys.exit(status)


if __name__ == "__main__":
    main()

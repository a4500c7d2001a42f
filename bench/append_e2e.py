"""End-to-end append throughput and commit latency: client -> Waltz server -> 3 storage nodes, all real
processes on this host.

Starts ZooKeeper, three storage nodes (``waltz storage run``) and one server (``waltz server run``, uvloop),
all in subprocesses on a temporary directory, creates a one-partition cluster, and runs a load generator in a
*separate* process (``--load``, uvloop) speaking the raw client protocol
(``tests/integration/raw_client.py``). An append is committed when the client sees its own request id in the
feed: the server sends FeedData only after a quorum (2 of 3) of storage nodes has fsynced it. Commit latency
is the time from sending the AppendRequest to receiving that FeedData.

Scenarios (each after a warm-up; the figures are measured over ``--seconds``):

* ``pipelined``  512-byte transactions, ``--in-flight`` (64) unanswered at a time, no locks;
* ``locked``     the same, every transaction carrying a write lock on its own key (the lock table is
                 checked and updated for each, and the client's high-water mark goes with it);
* ``single``     one client appending one transaction at a time (the latency floor).

    .venv/bin/python bench/append_e2e.py                 # all scenarios
    .venv/bin/python bench/append_e2e.py --seconds 5 --scenario pipelined
    .venv/bin/python bench/append_e2e.py --max-inflight-batches 1   # one replication batch at a time
    .venv/bin/python bench/append_e2e.py --scenario single --profile-server /tmp/server.prof
    .venv/bin/python bench/append_e2e.py --scenario pipelined --profile-storage /tmp/storage.prof

After each scenario it prints the CPU (user + system, from ``/proc/<pid>/stat``) that each process spent per
committed append over the measured window: the server, each storage node and the load generator
(``cpu us/op server 41.2  storage-1 18.0 ...``), so a change to one process shows in its own column.

At the end it checks the log: every storage node holds the same transactions ``0..hwm`` (compared by
CRC-32 of every record's bytes), and every acknowledged append is in it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.procstat import cpu_s  # noqa: E402
from tests.integration.raw_client import NotCommitted, RawClient  # noqa: E402
from tests.integration.server_process import Cluster, settled_logs  # noqa: E402

from waltz.cluster import zk as zkutil  # noqa: E402
from waltz.cluster.store_metadata import read_partition_assignment  # noqa: E402
from waltz.cluster.zkserver import ZooKeeperServer  # noqa: E402

RECORD_BYTES = 512
WARMUP_S = 2.0


def _cpu_snapshot(procs: dict[str, int]) -> dict[str, float]:
    return {name: cpu_s(pid) for name, pid in procs.items()}


# ----------------------------------------------------------------------------------------- load generator


async def _load(
    host: str, port: int, generation: int, client_id: int, args: argparse.Namespace
) -> dict[str, Any]:
    in_flight = 1 if args.scenario == "single" else args.in_flight
    client = RawClient(
        None, client_id, endpoint=(host, port, generation), max_in_flight=in_flight, keep_data=False
    )
    await client.start()
    payload = bytes(RECORD_BYTES)
    locks = args.scenario == "locked"
    loop = asyncio.get_running_loop()
    start = loop.time()
    measure_from = start + WARMUP_S
    end = measure_from + args.seconds
    i = 0
    acked_at_start = -1
    lat_index = 0
    lock_failures_at_start = 0
    # The processes whose CPU is measured over the window: the cluster's (named by the driver) and this one.
    procs = {name: int(pid) for name, pid in (item.split("=") for item in args.cpu_pids.split(",") if item)}
    procs["loadgen"] = os.getpid()
    cpu_at_start: dict[str, float] = {}
    try:
        while True:
            now = loop.time()
            if acked_at_start < 0 and now >= measure_from:
                acked_at_start = client.stats.acknowledged
                lat_index = len(client.stats.latencies_s)
                lock_failures_at_start = client.stats.lock_failures
                cpu_at_start = _cpu_snapshot(procs)
            if now >= end:
                break
            wl = (((client_id << 24) ^ i) & 0x7FFFFFFF,) if locks else ()
            fut = await client.append(payload, write_locks=wl)
            if in_flight == 1:
                with contextlib.suppress(NotCommitted):
                    await fut  # a failure is counted in the client's statistics
            i += 1
            if i % 256 == 0:
                await client.drain()
        acked = client.stats.acknowledged - acked_at_start
        cpu_at_end = _cpu_snapshot(procs)
        cpu_us_per_op = {
            name: (cpu_at_end[name] - cpu_at_start[name]) * 1e6 / max(acked, 1) for name in procs
        }
        latencies = sorted(client.stats.latencies_s[lat_index:])
        lock_failures = client.stats.lock_failures - lock_failures_at_start
        # Let the tail commit so the final check sees every acknowledged append.
        await client.wait_idle(10.0)
        return {
            "acked": acked,
            "seconds": args.seconds,
            "latencies": _percentiles(latencies),
            "lock_failures": lock_failures,
            "cpu_us_per_op": cpu_us_per_op,
            "violations": client.violations,
            "hwm": client.hwm,
        }
    finally:
        await client.aclose()


def _percentiles(sorted_s: list[float]) -> dict[str, float]:
    if not sorted_s:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "mean_ms": float("nan")}
    n = len(sorted_s)
    return {
        "p50_ms": sorted_s[n // 2] * 1000,
        "p99_ms": sorted_s[min(n - 1, int(n * 0.99))] * 1000,
        "mean_ms": statistics.fmean(sorted_s) * 1000,
    }


def load_main(args: argparse.Namespace) -> None:
    import uvloop

    host, port, generation = args.load.split(":")
    result = uvloop.run(_load(host, int(port), int(generation), args.client_id, args))
    print(json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------------- driver


async def _cluster(base: Path, zks: ZooKeeperServer, server_config: dict[str, Any]) -> tuple[Cluster, Any]:
    client = zkutil.connect(zks.connect_string, session_timeout_ms=10000)
    cluster = Cluster(base, client, zks.connect_string, num_partitions=1, server_config=server_config)
    await cluster.start(storages=3, servers=1)
    return cluster, client


def _run_load(
    endpoint: str, scenario: str, args: argparse.Namespace, client_id: int, cpu_pids: str
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--load",
        endpoint,
        "--scenario",
        scenario,
        "--seconds",
        str(args.seconds),
        "--in-flight",
        str(args.in_flight),
        "--client-id",
        str(client_id),
        "--cpu-pids",
        cpu_pids,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.seconds + 120, check=False)
    if done.returncode != 0:
        raise SystemExit(f"load generator failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


async def driver(args: argparse.Namespace) -> None:
    base = Path(tempfile.mkdtemp(prefix="waltz-e2e-", dir=args.dir))
    zks = ZooKeeperServer(base / "zk")
    zks.start()
    cluster: Cluster | None = None
    zk_client = None
    try:
        server_config: dict[str, Any] = {"zookeeper.sessionTimeout": 10000}
        if args.max_inflight_batches is not None:
            server_config["storage.maxInflightBatches"] = args.max_inflight_batches
        cluster, zk_client = await _cluster(base, zks, server_config)
        server = cluster.servers[0]
        # Wait for the partition to be assigned and its store session to open.
        deadline = time.monotonic() + 30
        generation = -1
        while time.monotonic() < deadline:
            assignment, _ = read_partition_assignment(zk_client, cluster.root)
            gens = assignment.generations()
            if 0 in gens and assignment.owner_of(0) == server.server_id:
                generation = gens[0]
                break
            await asyncio.sleep(0.1)
        if generation < 0:
            raise SystemExit("partition 0 was never assigned")
        endpoint = f"127.0.0.1:{server.port}:{generation}"
        scenarios = [args.scenario] if args.scenario != "all" else ["pipelined", "locked", "single"]
        cpu_pids = ",".join(
            [f"server={server.pid}", *(f"storage-{i}={sp.pid}" for i, sp in enumerate(cluster.storages, 1))]
        )
        results: dict[str, dict[str, Any]] = {}
        for n, scenario in enumerate(scenarios, 1):
            fsyncs_before = await _fsync_counts(cluster)
            r = await asyncio.to_thread(_run_load, endpoint, scenario, args, n, cpu_pids)
            fsyncs_after = await _fsync_counts(cluster)
            results[scenario] = r
            lat = r["latencies"]
            extra = f", lock failures {r['lock_failures']}" if scenario == "locked" else ""
            print(
                f"{scenario:10s} in-flight {1 if scenario == 'single' else args.in_flight:3d}: "
                f"{r['acked'] / r['seconds']:9.0f} txn/s committed, p50 {lat['p50_ms']:.2f} ms, "
                f"p99 {lat['p99_ms']:.2f} ms, mean {lat['mean_ms']:.2f} ms{extra}",
                flush=True,
            )
            print(f"{'':10s} {_cpu_line(r['cpu_us_per_op'])}", flush=True)
            print(f"{'':10s} {_per_fsync_line(fsyncs_before, fsyncs_after)}", flush=True)
            if r["violations"]:
                raise SystemExit(f"protocol violations: {r['violations'][:5]}")
        # Every replica holds the same log; compare CRC-32 of every record.
        hwm = max(r["hwm"] for r in results.values())
        logs = await settled_logs(cluster, cluster.storages, hwm, timeout_s=60)
        crcs = [_crc_of(log) for log in logs]
        if len(set(crcs)) != 1:
            raise SystemExit(f"replicas differ: {crcs}")
        print(f"log check: {hwm + 1} transactions, identical on 3 replicas (crc {crcs[0]:08x})")
    finally:
        if cluster is not None:
            cluster.stop()
        if zk_client is not None:
            zkutil.close(zk_client)
        zks.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


async def _fsync_counts(cluster: Cluster) -> list[tuple[int, int]]:
    """``(max transaction id, fsyncs)`` of partition 0 on each storage node (its admin metrics)."""
    counts = []
    for sp in cluster.storages:
        async with await cluster.admin(sp) as admin:
            part = json.loads(await admin.metrics_json())["partitions"]["0"]
        counts.append((part["maxTransactionId"], part["fsyncs"]))
    return counts


def _per_fsync_line(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> str:
    """``records/fsync storage-1 31.2 ...``: how many records each replication request (one group commit
    and fsync on the node, warm-up included) carried."""
    cols = "  ".join(
        f"storage-{i} {(a[0] - b[0]) / max(a[1] - b[1], 1):.1f}"
        for i, (b, a) in enumerate(zip(before, after, strict=True), 1)
    )
    return f"records/fsync {cols}"


def _cpu_line(cpu: dict[str, float]) -> str:
    """``cpu us/op server 41.2  storage-1 18.0 ... (server+storage 95.3)  loadgen 30.1``."""
    cluster_total = sum(v for name, v in cpu.items() if name != "loadgen")
    cols = "  ".join(f"{name} {v:.1f}" for name, v in cpu.items() if name != "loadgen")
    return f"cpu us/op {cols}  (server+storage {cluster_total:.1f})  loadgen {cpu['loadgen']:.1f}"


def _crc_of(records: list[Any]) -> int:
    crc = 0
    for r in records:
        head = struct.pack(">q16siI", r.transaction_id, r.req_id.to_bytes(), r.header, r.checksum)
        crc = zlib.crc32(r.data, zlib.crc32(head, crc))
    return crc


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per scenario")
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--scenario", choices=["all", "pipelined", "locked", "single"], default="all")
    parser.add_argument(
        "--max-inflight-batches",
        type=int,
        default=None,
        help="the server's storage.maxInflightBatches (default: the server's default)",
    )
    parser.add_argument("--dir", default=None, help="where to put the temporary cluster (default /tmp)")
    parser.add_argument(
        "--profile-server",
        default=None,
        metavar="PATH",
        help="write a cProfile of the server process (its whole run) to PATH (read it with pstats)",
    )
    parser.add_argument(
        "--profile-storage",
        default=None,
        metavar="PREFIX",
        help="write a cProfile of each storage node process (its whole run) to PREFIX.<pid>",
    )
    parser.add_argument("--keep", action="store_true", help="keep the cluster's directory (logs, data)")
    parser.add_argument("--load", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--client-id", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--cpu-pids", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        load_main(args)
    else:
        # SIGTERM (e.g. from timeout(1)) unwinds like Ctrl-C, so every process started is stopped.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        if args.profile_server:
            # Read by `waltz server run` (storage nodes ignore it); the file is written when the server stops.
            os.environ["WALTZ_PROFILE"] = str(Path(args.profile_server).resolve())
        if args.profile_storage:
            # Read by `waltz storage run` (WALTZ_STORAGE_PROFILE); each node writes PREFIX.<pid> on stopping.
            os.environ["WALTZ_STORAGE_PROFILE"] = str(Path(args.profile_storage).resolve())
        asyncio.run(driver(args))


if __name__ == "__main__":
    main()

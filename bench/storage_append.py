"""Append throughput and acknowledgement latency of one storage node, fsync on, over loopback.

Starts a real storage node (``waltz storage run``) in a subprocess on a temporary directory of the disk under
test, assigns partition 0, and appends 512-byte records from this (separate) process through
:class:`waltz.server.storage_client.StorageClient`, in three modes:

* ``single``    one 1-record append in flight at a time: the acknowledgement latency floor.
* ``pipelined`` 1 record per append request, ``--in-flight`` requests outstanding.
* ``batched``   ``--batch`` records per append request (the Waltz server batches up to 100),
                ``--batch-in-flight`` requests outstanding.
* ``read``      (not in the default list) the whole log read back ``--read-passes`` times with
                RecordRunRequests of 10,000 records or 8 MiB, one at a time: the node's CPU per record served.
* ``spread``    (not in the default list) ``--partitions`` partitions (default 256), one append of
                ``--spread-batch`` records (default 1) in flight on each, over one StorageClient (as a server
                writing many partitions, each with one replication batch in flight): what a request costs
                when every partition needs its own fsync. ``--partitions 5 --spread-batch 12`` is what a
                node sees of 4 busy partitions.

For each mode it prints records/s, MB/s (record data only), acknowledgement latency p50/p99 (send of the
request to receipt of its Success, i.e. after the node's fsync) and the node's fsyncs/s. Before that it
measures the raw fsync latency of the same disk: 512-byte appends to a file in the same directory, each
followed by ``fdatasync``, as the node does for one lone record.

    .venv/bin/python bench/storage_append.py                       # all modes, uvloop on both sides
    .venv/bin/python bench/storage_append.py --event-loop asyncio  # the node on the standard loop
    .venv/bin/python bench/storage_append.py --path-only --batch 31   # CPU of the append path alone

Each mode also prints the node's CPU per record (user + system, all threads, from /proc/<pid>/stat): the
steadier figure on a shared machine, and per request: wall time (the run's time over its requests), the
node's user and system CPU. ``--preallocate BYTES`` sets the node's ``storage.segment.preallocateBytes`` (0 =
off; not given: the node's default, and nothing is written to its config, so older trees run too): run it
with 0 and without, alternating, for the A/B of zero-filled segments. ``--syncfs-min-files N`` likewise sets
``storage.fsync.syncfsMinFiles`` (0: an fdatasync per file; the A/B of one ``syncfs`` per batch in spread).

    .venv/bin/python bench/storage_append.py --modes single,raw-batched --preallocate 0

``--profile FILE`` runs the node under cProfile, ``--py-spy FILE`` samples it with py-spy (a dev tool,
installed separately), ``--callgrind FILE`` runs it under valgrind's callgrind, counting the instructions of
the measured modes only (what the server's replication costs a node per request, in a fixed count):

    .venv/bin/python bench/storage_append.py --modes batched --batch 29 --batch-in-flight 1 \
        --records 5800 --callgrind /tmp/node.cg     # then: callgrind_annotate /tmp/node.cg

Every acknowledged append is checked at the end: the node's max transaction id must equal the number of
records acknowledged minus one, and a sample of records is read back and verified.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from procstat import stat as proc_stat
from waltz.protocol import storage as st
from waltz.protocol.framing import MAGIC_STORAGE
from waltz.protocol.records import Record, ReqId
from waltz.server.storage_client import AdminClient, StorageClient
from waltz.transport import FramedConnection, open_connection

KEY = uuid.UUID("0b5e7c1a-43d2-4f5e-9a6b-7c8d9e0f1a2b")
RECORD_BYTES = 512
PARTITION = 0
SESSION = 1
NUM_PARTITIONS = [1]
"""The node's ``storage.cluster.numPartitions`` (``--partitions`` with the ``spread`` mode, else 1)."""


@dataclass
class Result:
    mode: str
    records: int
    seconds: float
    latencies_s: list[float]
    fsyncs: int
    node_user_s: float
    node_system_s: float
    requests: int

    @property
    def node_us_per_record(self) -> float:
        return (self.node_user_s + self.node_system_s) / self.records * 1e6

    def line(self) -> str:
        rate = self.records / self.seconds
        lat = sorted(self.latencies_s)
        p50 = lat[len(lat) // 2] * 1000
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000
        return (
            f"{self.mode:<28} {rate:>10,.0f} rec/s {rate * RECORD_BYTES / 1e6:>7.1f} MB/s  "
            f"ack p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  fsyncs/s {self.fsyncs / self.seconds:>7,.0f}  "
            f"node CPU {self.node_us_per_record:6.1f} us/rec "
            f"(user {self.node_user_s / self.records * 1e6:.1f})  "
            f"per request: wall {self.seconds / self.requests * 1e6:6.1f} us, node user "
            f"{self.node_user_s / self.requests * 1e6:6.1f} us "
            f"sys {self.node_system_s / self.requests * 1e6:6.1f} us  "
            f"({self.records} records in {self.seconds:.1f} s)"
        )


def raw_fsync_latency(directory: Path, seconds: float = 2.0) -> list[float]:
    """512-byte appends each followed by fdatasync, for ``seconds``; returns each latency in seconds."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    block = os.urandom(RECORD_BYTES)
    samples: list[float] = []
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            os.write(fd, block)
            os.fdatasync(fd)
            samples.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    return samples


def append_path_cpu(per_request: int, rounds: int = 60, requests: int = 100) -> str:
    """CPU of the node's append path for requests of ``per_request`` records, in this process: decode the
    payload, build the stored run (checks included), write it (no fsync: the checkpoints' aside) and encode
    the Success. The least CPU time of ``rounds`` rounds of ``requests`` requests, so that other processes
    disturb it as little as possible on a shared machine."""
    # Imported here so that the socket modes also run against trees without it (A/B against older code).
    from waltz.storage.partition import PartitionLog
    from waltz.storage.segment import append_wire_run

    base = Path(tempfile.mkdtemp(prefix="waltz-path-"))
    plog = PartitionLog.open(str(base), KEY, PARTITION)
    data = os.urandom(RECORD_BYTES)
    best = float("inf")
    next_id = 0
    try:
        for _ in range(rounds):
            payloads = []
            for seq in range(requests):
                records = [
                    Record.build(i, ReqId(7 << 32, i), 0, data) for i in range(next_id, next_id + per_request)
                ]
                next_id += per_request
                payloads.append(st.encode(st.AppendRequest(SESSION, seq, PARTITION, records, False)))
            t0 = time.process_time()
            for payload in payloads:
                msg = st.decode(payload)
                assert isinstance(msg, st.AppendRequest)
                assert isinstance(msg.records, st.WireRecordList)
                parts: list[bytes | memoryview] = []
                ends: list[int] = []
                first = plog.max_transaction_id + 1
                append_wire_run(parts, ends, msg.records, first)
                plog.append_run(b"".join(parts), ends, first)
                st.encode_success(msg.session_id, msg.seq_num, msg.partition_id)
            best = min(best, (time.process_time() - t0) / requests)
    finally:
        plog.close()
        shutil.rmtree(base, ignore_errors=True)
    return (
        f"append path, {per_request} records/request: {best * 1e6:7.1f} us/request "
        f"{best / per_request * 1e6:6.2f} us/record (least of {rounds} rounds)"
    )


def start_node(
    directory: Path,
    event_loop: str,
    profile: str | None = None,
    preallocate: int | None = None,
    callgrind: str | None = None,
    partitions: int = 1,
    syncfs_min_files: int | None = None,
) -> tuple[subprocess.Popen[bytes], int, int]:
    config = directory / "storage.yaml"
    extra = "" if preallocate is None else f"storage.segment.preallocateBytes: {preallocate}\n"
    extra += "" if syncfs_min_files is None else f"storage.fsync.syncfsMinFiles: {syncfs_min_files}\n"
    config.write_text(
        f"storage.port: 0\nstorage.admin.port: 0\nstorage.directory: {directory / 'data'}\n"
        f"storage.cluster.key: {KEY}\nstorage.cluster.numPartitions: {partitions}\n{extra}",
        encoding="utf-8",
    )
    # Under cProfile the node writes its profile when it stops (SIGTERM ends it cleanly).
    profiler = ["-m", "cProfile", "-o", profile] if profile else []
    # Under callgrind nothing is counted until a measured mode switches it on (see callgrind_toggle).
    valgrind = (
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={callgrind}"]
        if callgrind
        else []
    )
    cmd = [*valgrind, sys.executable, *profiler, "-m", "waltz.cli.main", "storage", "run"]
    cmd += ["--config", str(config)]
    cmd += ["--event-loop", event_loop]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise SystemExit(f"storage node exited with status {proc.returncode} before serving")
    ready = json.loads(line)
    return proc, int(ready["port"]), int(ready["admin_port"])


class Appender:
    """Keeps up to ``in_flight`` appends of ``batch`` records outstanding, ids dense and in order."""

    def __init__(self, client: StorageClient, next_id: int) -> None:
        self.client = client
        self.next_id = next_id
        self.data = os.urandom(RECORD_BYTES)
        self.acked = 0

    def _records(self, n: int) -> list[Record]:
        first = self.next_id
        self.next_id += n
        return [
            Record.build(i, ReqId(7 << 32, PARTITION << 32 | (i & 0xFFFFFFFF)), 0, self.data)
            for i in range(first, first + n)
        ]

    async def run(self, total_records: int, batch: int, in_flight: int) -> tuple[float, list[float]]:
        slots = asyncio.Semaphore(in_flight)
        latencies: list[float] = []
        errors: list[BaseException] = []

        async def one(records: list[Record]) -> None:
            t0 = time.perf_counter()
            try:
                await self.client.append(SESSION, PARTITION, records)
            except BaseException as e:
                errors.append(e)
                raise
            finally:
                slots.release()
            latencies.append(time.perf_counter() - t0)
            self.acked += len(records)

        tasks: set[asyncio.Task[None]] = set()
        start = time.perf_counter()
        sent = 0
        while sent < total_records and not errors:
            await slots.acquire()
            n = min(batch, total_records - sent)
            # Tasks start in creation order and send before their first await, so ids stay in order.
            task = asyncio.create_task(one(self._records(n)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            sent += n
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.perf_counter() - start
        if errors:
            raise errors[0]
        return elapsed, latencies


class RawPipeline:
    """A lean pipelining client: one connection, ``in_flight`` requests outstanding, no task or timer per
    request. It measures the node rather than the per-call overhead of the general-purpose RpcClient (which
    saturates one core near 10-35k calls/s)."""

    def __init__(self, conn: FramedConnection, next_id: int, next_seq: int) -> None:
        self.conn = conn
        self.next_id = next_id
        self.seq = next_seq
        self.data = os.urandom(RECORD_BYTES)
        self.acked = 0

    async def run(self, total_records: int, batch: int, in_flight: int) -> tuple[float, list[float]]:
        sent_at: dict[int, tuple[float, int]] = {}
        latencies: list[float] = []
        window = asyncio.Event()
        done = asyncio.Event()
        acked_target = self.acked + total_records

        async def read() -> None:
            while self.acked < acked_target:
                msg = st.decode(await self.conn.receive())
                if not isinstance(msg, st.SuccessResponse):
                    raise SystemExit(f"append failed: {msg}")
                t0, n = sent_at.pop(msg.seq_num)
                latencies.append(time.perf_counter() - t0)
                self.acked += n
                window.set()
            done.set()

        reader = asyncio.create_task(read())
        start = time.perf_counter()
        sent = 0
        data = self.data
        while sent < total_records:
            while len(sent_at) >= in_flight:
                window.clear()
                await window.wait()
            n = min(batch, total_records - sent)
            first = self.next_id
            records = [
                Record.build(i, ReqId(7 << 32, PARTITION << 32 | (i & 0xFFFFFFFF)), 0, data)
                for i in range(first, first + n)
            ]
            self.next_id += n
            seq = self.seq
            self.seq += 1
            sent_at[seq] = (time.perf_counter(), n)
            self.conn.send(st.encode(st.AppendRequest(SESSION, seq, PARTITION, records, False)))
            sent += n
            if len(sent_at) % 64 == 0:
                await self.conn.drain()
        await done.wait()
        await reader
        return time.perf_counter() - start, latencies


def callgrind_toggle(args: argparse.Namespace, node_pid: int, on: bool) -> None:
    """Switch the node's callgrind instrumentation on (before a measured mode) or off (after it)."""
    if args.callgrind:
        subprocess.run(
            ["callgrind_control", "-i", "on" if on else "off", str(node_pid)],
            check=True,
            stdout=subprocess.DEVNULL,
        )


async def fsync_count(admin: AdminClient) -> int:
    data = json.loads(await admin.metrics_json())
    return int(data["partitions"][str(PARTITION)]["fsyncs"])


async def open_raw(port: int) -> FramedConnection:
    conn = await open_connection(
        "127.0.0.1",
        port,
        magic=MAGIC_STORAGE,
        versions=st.STORAGE_VERSIONS,
        hello_text=st.STORAGE_CLIENT_HELLO,
    )
    conn.send(st.encode(st.OpenRequest(-1, 0, -1, KEY, NUM_PARTITIONS[0])))
    if not isinstance(st.decode(await conn.receive()), st.SuccessResponse):
        raise SystemExit("open refused")
    return conn


async def read_back(client: StorageClient, records: int, passes: int, node_pid: int) -> str:
    """Read the whole log back ``passes`` times with RecordRunRequests (10,000 records or 8 MiB each, one at
    a time, as a range reader does): the node's CPU per record served."""
    served = 0
    cpu_before = proc_stat(node_pid)
    start = time.perf_counter()
    for _ in range(passes):
        txn = 0
        while txn < records:
            count, _ = await client.read_run(SESSION, PARTITION, txn, 10_000, 8 * 1024 * 1024)
            if count == 0:
                raise SystemExit(f"read_run from {txn} returned nothing; {records} records were acknowledged")
            txn += count
            served += count
    elapsed = time.perf_counter() - start
    cpu_after = proc_stat(node_pid)
    user = cpu_after.user_s - cpu_before.user_s
    total = user + cpu_after.system_s - cpu_before.system_s
    return (
        f"{'read runs, 10k records/8 MiB':<28} {served / elapsed:>10,.0f} rec/s  node CPU "
        f"{total / served * 1e6:6.2f} us/rec (user {user / served * 1e6:.2f})  "
        f"({served} records in {elapsed:.1f} s)"
    )


async def spread(
    args: argparse.Namespace, client: StorageClient, admin: AdminClient, node_pid: int
) -> Result:
    """The ``spread`` mode: partitions 1 to ``--partitions`` - 1 (0 is the other modes'), one append of
    ``--spread-batch`` records in flight on each, ``--records`` in all."""
    partitions = range(1, NUM_PARTITIONS[0])
    await admin.set_assigned(list(partitions), True)
    data = os.urandom(RECORD_BYTES)
    next_ids = dict.fromkeys(partitions, 0)
    latencies: list[float] = []

    batch = max(1, args.spread_batch)

    async def one(partition: int, rounds: int) -> None:
        for _ in range(rounds):
            i = next_ids[partition]
            next_ids[partition] = i + batch
            records = [
                Record.build(j, ReqId(7 << 32, partition << 32 | j), 0, data) for j in range(i, i + batch)
            ]
            t0 = time.perf_counter()
            await client.append(SESSION, partition, records)
            latencies.append(time.perf_counter() - t0)

    async def fsyncs() -> int:
        stats = json.loads(await admin.metrics_json())["partitions"]
        return sum(int(stats[str(p)]["fsyncs"]) for p in partitions)

    await asyncio.gather(*(one(p, 2) for p in partitions))  # warm-up: every partition's first segment
    latencies.clear()
    rounds = max(1, args.records // (len(partitions) * batch))
    before = await fsyncs()
    callgrind_toggle(args, node_pid, True)
    cpu_before = proc_stat(node_pid)
    start = time.perf_counter()
    await asyncio.gather(*(one(p, rounds) for p in partitions))
    elapsed = time.perf_counter() - start
    cpu_after = proc_stat(node_pid)
    callgrind_toggle(args, node_pid, False)
    total = rounds * len(partitions) * batch
    return Result(
        f"{len(partitions)} partitions, {batch} rec x1 each",
        total,
        elapsed,
        latencies,
        await fsyncs() - before,
        cpu_after.user_s - cpu_before.user_s,
        cpu_after.system_s - cpu_before.system_s,
        rounds * len(partitions),
    )


async def bench(args: argparse.Namespace, port: int, admin_port: int, node_pid: int) -> list[Result]:
    n = NUM_PARTITIONS[0]
    admin = await AdminClient.connect("127.0.0.1", admin_port, KEY, n)
    client = await StorageClient.connect(
        "127.0.0.1", port, KEY, n, max_in_flight=max(args.in_flight, 64, 2 * n)
    )
    raw_conn = await open_raw(port)
    results: list[Result] = []
    try:
        await admin.set_assigned([PARTITION], True)
        appender = Appender(client, next_id=0)
        raw = RawPipeline(raw_conn, next_id=0, next_seq=1)
        # Warm-up: first segment writes, connection buffers, code paths.
        await appender.run(2000, 1, 64)
        plans: dict[str, tuple[str, Appender | RawPipeline, int, int, int]] = {
            "single": ("StorageClient 1 rec, 1 in flight", appender, args.single_records, 1, 1),
            "pipelined": (
                f"StorageClient 1 rec/req x{args.in_flight}",
                appender,
                args.records,
                1,
                args.in_flight,
            ),
            "batched": (
                f"StorageClient {args.batch} rec/req x{args.batch_in_flight}",
                appender,
                args.records,
                args.batch,
                args.batch_in_flight,
            ),
            "raw-single": ("lean client 1 rec, 1 in flight", raw, args.single_records, 1, 1),
            "raw-pipelined": (
                f"lean client 1 rec/req x{args.in_flight}",
                raw,
                args.records,
                1,
                args.in_flight,
            ),
            "raw-batched": (
                f"lean client {args.batch} rec/req x{args.batch_in_flight}",
                raw,
                args.records,
                args.batch,
                args.batch_in_flight,
            ),
        }
        acked = appender.acked
        for mode in (m.strip() for m in args.modes.split(",")):
            if mode == "read":
                print(await read_back(client, acked, args.read_passes, node_pid), flush=True)
                continue
            if mode == "spread":
                results.append(await spread(args, client, admin, node_pid))
                print(results[-1].line(), flush=True)
                continue
            label, runner, total, batch, in_flight = plans[mode]
            runner.next_id = acked
            runner.acked = acked
            before = await fsync_count(admin)
            callgrind_toggle(args, node_pid, True)
            cpu_before = proc_stat(node_pid)
            elapsed, lat = await runner.run(total, batch, in_flight)
            cpu_after = proc_stat(node_pid)
            callgrind_toggle(args, node_pid, False)
            fsyncs = await fsync_count(admin) - before
            acked = runner.acked
            results.append(
                Result(
                    label,
                    total,
                    elapsed,
                    lat,
                    fsyncs,
                    cpu_after.user_s - cpu_before.user_s,
                    cpu_after.system_s - cpu_before.system_s,
                    -(-total // batch),
                )
            )
            print(results[-1].line(), flush=True)
        # Everything acknowledged is there, densely, and verifies.
        max_id = await client.max_transaction_id(SESSION, PARTITION)
        if max_id != acked - 1:
            raise SystemExit(f"lost appends: max id {max_id}, acknowledged {acked}")
        for start in (0, max_id // 2, max(0, max_id - 100)):
            for rec in await client.read_records(SESSION, PARTITION, start, 100):
                if not rec.verify():
                    raise SystemExit(f"record {rec.transaction_id} does not verify")
        print(f"verified: max transaction id {max_id} = records acknowledged - 1; sampled records verify")
        part = json.loads(await admin.metrics_json())["partitions"][str(PARTITION)]
        if "extendingWrites" in part:  # older trees do not count them
            print(
                f"data-file writes past the fsynced zeros (extending the file): {part['extendingWrites']} of "
                f"{part['fsyncs']} group commits ({part['threadedFsyncs']} fsynced in a thread); zeros "
                f"written: {part['preallocatedBytes']} bytes"
            )
    finally:
        await raw_conn.aclose()
        await client.aclose()
        await admin.aclose()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", help="directory on the disk under test (default: a temp dir)")
    parser.add_argument(
        "--event-loop", choices=["auto", "uvloop", "asyncio"], default="auto", help="node's loop"
    )
    parser.add_argument("--client-loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--modes", default="single,raw-single,pipelined,raw-pipelined,batched,raw-batched")
    parser.add_argument("--records", type=int, default=200_000, help="records per throughput mode")
    parser.add_argument("--single-records", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, default=512)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--batch-in-flight", type=int, default=8)
    parser.add_argument("--partitions", type=int, default=256, help="partitions of the spread mode")
    parser.add_argument("--spread-batch", type=int, default=1, help="records per append of the spread mode")
    parser.add_argument("--read-passes", type=int, default=3, help="passes over the log of the read mode")
    parser.add_argument(
        "--profile", metavar="FILE", help="run the node under cProfile and write its profile to FILE"
    )
    parser.add_argument(
        "--py-spy",
        metavar="FILE",
        help="sample the node with py-spy while the modes run (threads in a syscall such as fsync count as "
        "busy); collapsed stacks to FILE",
    )
    parser.add_argument(
        "--callgrind",
        metavar="FILE",
        help="run the node under valgrind --tool=callgrind, counting only the measured modes (not the "
        "warm-up); its output to FILE (callgrind_annotate FILE; instructions per request: the total over "
        "the requests of the modes run, so run one mode)",
    )
    parser.add_argument(
        "--preallocate",
        type=int,
        metavar="BYTES",
        help="the node's storage.segment.preallocateBytes (0 = off; default: the node's own default)",
    )
    parser.add_argument(
        "--syncfs-min-files",
        type=int,
        metavar="N",
        help="the node's storage.fsync.syncfsMinFiles (0 = never syncfs; default: the node's own default)",
    )
    parser.add_argument(
        "--path-only",
        action="store_true",
        help="measure only the CPU of the node's append path in this process (no sockets, no fsync)",
    )
    args = parser.parse_args()
    if "spread" in args.modes:
        NUM_PARTITIONS[0] = args.partitions + 1
    if args.path_only:
        for per_request in (1, args.batch):
            print(append_path_cpu(per_request), flush=True)
        return 0

    base = Path(tempfile.mkdtemp(prefix="waltz-bench-", dir=args.dir))
    try:
        raw = sorted(raw_fsync_latency(base))
        raw_p50_ms = statistics.median(raw) * 1000
        print(
            f"raw fsync (512 B write + fdatasync, {len(raw)} samples): p50 {raw_p50_ms:.3f} ms  "
            f"p99 {raw[int(len(raw) * 0.99)] * 1000:.3f} ms  ({1 / statistics.mean(raw):,.0f} fsyncs/s)"
        )
        print(f"node event loop: {args.event_loop}; client loop: {args.client_loop}; cpus: {os.cpu_count()}")
        print(
            "node preallocation: "
            + ("node default" if args.preallocate is None else f"{args.preallocate} bytes (0 = off)")
        )
        proc, port, admin_port = start_node(
            base,
            args.event_loop,
            args.profile,
            args.preallocate,
            args.callgrind,
            NUM_PARTITIONS[0],
            args.syncfs_min_files,
        )
        spy = None
        if args.py_spy:
            spy = subprocess.Popen(
                [
                    *(str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(proc.pid)),
                    *("--rate", "500", "--format", "raw", "--output", args.py_spy, "--nonblocking"),
                ],
                stdout=subprocess.DEVNULL,
            )
        try:
            if args.client_loop == "uvloop":
                import uvloop

                results = uvloop.run(bench(args, port, admin_port, proc.pid))
            else:
                results = asyncio.run(bench(args, port, admin_port, proc.pid))
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
            proc.terminate()
            proc.wait(10)
        for r in results:
            if "1 in flight" in r.mode:
                p50_ms = sorted(r.latencies_s)[len(r.latencies_s) // 2] * 1000
                print(f"{r.mode}: ack p50 / raw fsync p50 = {p50_ms / raw_p50_ms:.2f}x (target < 3x)")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
